"""The host tier: bytes kept in (pinned, NUMA-bound, page-aligned) host memory.

Every key is one :class:`~tiers.host_alloc.HostAllocator` allocation, so a key can be
the target of ``O_DIRECT`` I/O or a non-blocking CUDA copy directly, and ``view(key)``
hands out the stored bytes without a copy. Keys are meant to be large (flat,
per-sub-group buffers, see shared/DESIGN.md): each costs at least one page.
"""
from __future__ import annotations

import threading

import torch

from tiers.base import Future, Tier, TierFullError, byte_view, format_nbytes
from tiers.device import copy_bytes
from tiers.host_alloc import HostAllocator
from tiers.keytable import KeyTable
from tiers.telemetry import TierStats


class HostTier(Tier):
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

    def __init__(self, allocator: HostAllocator | None = None, capacity: int | None = None,
                 name: str = "host") -> None:
        self.allocator = allocator if allocator is not None else HostAllocator(pin="never")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"{name} tier: capacity must be None or an int >= 0, got {capacity!r}")
        self.name = name
        self._capacity = capacity
        self._keys: KeyTable[torch.Tensor] = KeyTable(name)
        self._stats = TierStats(name)
        self._alloc_lock = threading.Lock()

    def allocate(self, nbytes: int, tag: str = "") -> int:
        nbytes = self._keys.validate_nbytes(nbytes, tag)
        with self._alloc_lock:
            in_use = self._stats.bytes_in_use
            if self._capacity is not None and in_use + nbytes > self._capacity:
                raise TierFullError(
                    f"{self.name} tier: allocating {format_nbytes(nbytes)} for {tag!r} would hold "
                    f"{format_nbytes(in_use + nbytes)} > host budget {format_nbytes(self._capacity)}"
                )
            self._stats.allocated(nbytes)
        try:
            storage = self.allocator.empty(nbytes)
        except BaseException:
            self._stats.released(nbytes)
            raise
        return self._keys.add(storage, nbytes, tag)

    def write(self, key: int, src: torch.Tensor, offset: int = 0) -> Future:
        data = byte_view(src, f"{self.name} tier write source")
        entry = self._keys.span(key, offset, data.numel(), "write")
        self._stats.wrote(data.numel())
        return copy_bytes(entry.place[offset:offset + data.numel()], data, self._stats)

    def read(self, key: int, dst: torch.Tensor, offset: int = 0) -> Future:
        data = byte_view(dst, f"{self.name} tier read destination")
        entry = self._keys.span(key, offset, data.numel(), "read")
        self._stats.read(data.numel())
        return copy_bytes(data, entry.place[offset:offset + data.numel()], self._stats)

    def view(self, key: int) -> torch.Tensor:
        """The ``uint8`` tensor holding ``key``'s bytes (aliases them: writes to it are stored)."""
        return self._keys.get(key).place

    def free(self, key: int) -> None:
        entry = self._keys.pop(key)
        self._stats.released(entry.nbytes)

    def nbytes(self, key: int) -> int:
        return self._keys.get(key).nbytes

    def capacity(self) -> int | None:
        return self._capacity

    def bytes_in_use(self) -> int:
        return self._stats.bytes_in_use

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        snapshot.update(tier="host", capacity=self._capacity, pinned=self.allocator.pinned,
                        numa_node=self.allocator.numa.node)
        return snapshot

    def __repr__(self) -> str:
        return f"HostTier(keys={len(self._keys)}, allocator={self.allocator!r}, name={self.name!r})"
