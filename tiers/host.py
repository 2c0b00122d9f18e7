"""The host tier: bytes kept in (pinned, NUMA-bound, page-aligned) host memory.

Every key is one :class:`~tiers.host_alloc.HostAllocator` allocation, so a key can be
the target of ``O_DIRECT`` I/O or a non-blocking CUDA copy directly, and ``view(key)``
hands out the stored bytes without a copy. Keys are meant to be large (flat,
per-sub-group buffers, see shared/DESIGN.md): each costs at least one page.
"""
from __future__ import annotations

import torch

from tiers.base import format_nbytes
from tiers.host_alloc import HostAllocator
from tiers.memory import MemoryTier


class HostTier(MemoryTier):
    """Keys held in host memory from ``allocator``.

    Parameters
    ----------
    allocator : HostAllocator | None
        Source of the memory (pinning / NUMA as configured); None: unpinned, unbound.
    capacity : int | None
        Most bytes this tier may hold (the config's ``host_budget``); None: unbounded.
    name : str
        Named in errors and telemetry.

    Examples
    --------
    >>> tier = HostTier(HostAllocator(pin="never"))
    >>> key = tier.put(torch.ones(3, dtype=torch.float16))
    >>> tier.view(key)
    tensor([ 0, 60,  0, 60,  0, 60], dtype=torch.uint8)
    """

    kind = "host"

    def __init__(self, allocator: HostAllocator | None = None, capacity: int | None = None,
                 name: str = "host") -> None:
        self.allocator = allocator if allocator is not None else HostAllocator(pin="never")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"{name} tier: capacity must be None or an int >= 0, got {capacity!r}")
        super().__init__(name, capacity)

    def _new_storage(self, nbytes: int, stagger: int = 0) -> torch.Tensor:
        return self.allocator.empty(nbytes, stagger=stagger)

    def _limit(self) -> str:
        return f"host budget {format_nbytes(self._capacity)} (tiers.host_budget: raise it, or put states on NVMe)"

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        snapshot.update(tier="host", capacity=self._capacity, pinned=self.allocator.pinned,
                        numa_node=self.allocator.numa.node)
        return snapshot

    def __repr__(self) -> str:
        return f"HostTier(keys={len(self._keys)}, allocator={self.allocator!r}, name={self.name!r})"
