"""``infinity.stats``: what the engine did, without a profiler."""
from __future__ import annotations

from torch import nn

from infinity import registry


def stats(model: nn.Module) -> dict:
    """Telemetry of the engine managing ``model``.

    Returns a dict with ``fetch`` (stall seconds, fetches, prefetch hits and hit rate,
    bytes gathered and read from the parameter tier), ``tiers`` (bytes read/written,
    wait time, current and peak bytes per tier), ``steps`` (per-step records) and
    ``prefetch`` (trace state), on this rank.
    """
    return registry.engine_of(model, "infinity.stats").stats()
