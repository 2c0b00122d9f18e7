"""Reading ahead: the recorded trace, the prefetcher that walks it, and the host memory reads land in.

What the room holds: ``trace`` (the order modules asked for their parameters, and its
RECORDING / FOLLOWING / DIVERGED states), ``prefetcher`` (walks ahead along the trace
within two byte budgets, NVMe->host and host->device; reads ahead land in an arena of
aligned host memory, ``tiers.arena``) and ``fresh_shards`` (shards the overlapped
optimizer step has just rewritten, handed to the next forward from that arena).

What it may touch: the coordinator, through its public methods (``start_fetch``,
``wait_available``, ``keep_for_reuse``...), and the parameter groups' states. It never
waits on timing to decide anything, so every rank issues the same collectives.
"""
from infinity.prefetch.prefetcher import Prefetcher

__all__ = ["Prefetcher"]
