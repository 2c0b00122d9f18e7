"""Aligned host memory for shard reads issued ahead of use, bounded in bytes.

[Note: why prefetched reads have their own staging]
Demand fetches stage NVMe reads in the coordinator's fixed pool (a few buffers as
large as the largest shard, see [Note: staging buffers] in infinity/runtime/shards.py). If reads
issued ahead took buffers from that pool, a module needing a buffer could wait
for one that only a later module would give back: a hang on one thread. And
``prefetch.nvme_bytes`` is a byte budget, which a count of largest-shard buffers
expresses badly when shard sizes differ a lot (one big embedding, many small
layers). So reads ahead get their own arena: one aligned allocation of
``prefetch.nvme_bytes`` (made at the first read ahead, never on the hot path
afterwards), carved into 4096-aligned slices by a best-fit free list. A slice
that does not fit is simply not taken and the read is left to demand: the arena
can never hold more than its budget, and it never blocks.
"""
from __future__ import annotations

import threading

import torch

from tiers.freelist import FreeList
from tiers.pool import Loan


class StagingArena:
    """``capacity`` bytes of aligned host memory handed out in aligned slices (see the note).

    Parameters
    ----------
    allocator:
        ``tiers.HostAllocator`` (pinned and NUMA-bound as configured), used once.
    capacity:
        Bytes in all (rounded up to 4096): ``prefetch.nvme_bytes``.
    name:
        For messages and telemetry.

    Examples
    --------
    >>> from tiers.host_alloc import HostAllocator
    >>> arena = StagingArena(HostAllocator(pin="never"), 3 * 4096)
    >>> a = arena.take(5000, "a"); b = arena.take(4096, "b")
    >>> arena.take(1, "c") is None, arena.bytes_in_use
    (True, 12288)
    >>> a.release(); arena.bytes_in_use
    4096
    """

    def __init__(self, allocator, capacity: int, name: str = "prefetch-staging") -> None:
        if capacity < 0:
            raise ValueError(f"staging arena {name!r}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.allocator = allocator
        self._free = FreeList(start=0)
        self.capacity = self._free.round_up(capacity) if capacity else 0
        self._memory: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self.slices_out = 0
        self.refused = 0

    def take(self, nbytes: int, owner: str) -> Loan | None:
        """A slice of at least ``nbytes`` bytes (a ``tiers.pool.Loan``), or None when the arena has no
        room for it now."""
        if nbytes <= 0:
            raise ValueError(f"staging arena {self.name!r}: {owner!r} asked for {nbytes} bytes; need > 0")
        with self._lock:
            size = self._free.round_up(nbytes)
            if size > self.capacity - self.bytes_in_use:
                self.refused += 1
                return None
            offset = self._free.allocate(nbytes)
            if offset + size > self.capacity:       # fragmented: the free holes are all too small
                self._free.release(offset, nbytes)
                self.refused += 1
                return None
            if self._memory is None:
                self._memory = self.allocator.empty(self.capacity)
            self.bytes_in_use += size
            self.slices_out += 1
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            tensor = self._memory[offset:offset + size]
        return Loan(tensor, lambda: self._return(offset, size), owner,
                    f"arena slice at offset {offset} of {self.name!r}")

    def _return(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.release(offset, nbytes)
            self.bytes_in_use -= nbytes
            self.slices_out -= 1

    def stats(self) -> dict:
        with self._lock:
            return {"name": self.name, "capacity": self.capacity, "allocated": self._memory is not None,
                    "bytes_in_use": self.bytes_in_use, "peak_bytes": self.peak_bytes,
                    "slices_out": self.slices_out, "refused": self.refused}
