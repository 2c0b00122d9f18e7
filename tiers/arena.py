"""Memory lent in aligned slices of any size, out of slabs allocated once.

[Note: arenas]
A pool (tiers/pool.py) lends equal buffers; an arena lends slices of the size asked
for, carved from a few large slabs by a best-fit free list (tiers/freelist.py), so
groups of very different sizes (one big embedding, many small layers) share one
budget without rounding each up to the largest. Slabs come from one allocation
function (the host allocator: pinned, page-aligned; or the compute device) and are
allocated once: the steady state allocates nothing, so nothing is page-faulted or
registered on the hot path, and no memory is handed back to the C allocator to be
asked for again (the growth of the resident set that comes with that).

With a ``capacity`` the arena is one slab of that size, made at the first ``take``,
and a slice that does not fit is refused (None): the caller falls back, nothing
blocks. Without one it grows by slabs of ``slab_nbytes`` (or larger, for a larger
slice) and never refuses: its size is the high-water mark of what was lent at once.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from tiers.freelist import FreeList
from tiers.pool import Loan


class _Slab:
    __slots__ = ("memory", "free", "nbytes")

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.nbytes = memory.numel()
        self.free = FreeList(start=0)


class Arena:
    """Slices of memory out of slabs from ``allocate`` (see [Note: arenas]).

    Parameters
    ----------
    allocate:
        Returns a new ``uint8`` tensor of the given byte count (a slab).
    capacity:
        Bytes in all (rounded up to 4096), in one slab made at the first take; None: grow.
    slab_nbytes:
        Size of each slab of a growing arena (a larger slice gets a slab of its own size).
    name:
        For messages and telemetry.

    Examples
    --------
    >>> from tiers.host_alloc import HostAllocator
    >>> arena = Arena(HostAllocator(pin="never").empty, 3 * 4096)
    >>> a = arena.take(5000, "a"); b = arena.take(4096, "b")
    >>> arena.take(1, "c") is None, arena.bytes_in_use
    (True, 12288)
    >>> a.release(); arena.bytes_in_use
    4096
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], capacity: int | None = None,
                 slab_nbytes: int = 64 << 20, name: str = "arena") -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"arena {name!r}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.allocate = allocate
        granule = FreeList(start=0)
        self.capacity = None if capacity is None else (granule.round_up(capacity) if capacity else 0)
        self.slab_nbytes = granule.round_up(slab_nbytes)
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self.slices_out = 0
        self.refused = 0

    @property
    def nbytes(self) -> int:
        """Bytes of all slabs allocated so far."""
        return sum(slab.nbytes for slab in self._slabs)

    def take(self, nbytes: int, owner: str) -> Loan | None:
        """A slice of at least ``nbytes`` bytes, or None when a bounded arena has no room for it now."""
        if nbytes <= 0:
            raise ValueError(f"arena {self.name!r}: {owner!r} asked for {nbytes} bytes; need > 0")
        with self._lock:
            found = self._find(nbytes)
            if found is None:
                self.refused += 1
                return None
            index, offset, size = found
            self.bytes_in_use += size
            self.slices_out += 1
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            slab = self._slabs[index]
        return Loan(slab.memory[offset:offset + size], lambda: self._return(index, offset, size), owner,
                    f"arena slice at offset {offset} of {self.name!r}")

    def _find(self, nbytes: int) -> tuple[int, int, int] | None:
        """(slab, offset, size) of a free slice, growing when unbounded; None when bounded and full."""
        if self.capacity is not None:
            if not self._slabs and self.capacity:
                self._slabs.append(_Slab(self.allocate(self.capacity)))
            if not self._slabs or self._slabs[0].free.round_up(nbytes) > self.capacity - self.bytes_in_use:
                return None
        for index, slab in enumerate(self._slabs):
            offset = slab.free.allocate(nbytes)
            size = slab.free.round_up(nbytes)
            if offset + size <= slab.nbytes:
                return index, offset, size
            slab.free.release(offset, nbytes)     # fragmented, or too small: the holes do not fit it
        if self.capacity is not None:
            return None
        slab = _Slab(self.allocate(max(self.slab_nbytes, FreeList(start=0).round_up(nbytes))))
        self._slabs.append(slab)
        return len(self._slabs) - 1, slab.free.allocate(nbytes), slab.free.round_up(nbytes)

    def _return(self, index: int, offset: int, nbytes: int) -> None:
        with self._lock:
            self._slabs[index].free.release(offset, nbytes)
            self.bytes_in_use -= nbytes
            self.slices_out -= 1

    def stats(self) -> dict:
        with self._lock:
            return {"name": self.name, "capacity": self.capacity, "allocated": bool(self._slabs),
                    "slabs": len(self._slabs), "nbytes": self.nbytes,
                    "bytes_in_use": self.bytes_in_use, "peak_bytes": self.peak_bytes,
                    "slices_out": self.slices_out, "refused": self.refused}
