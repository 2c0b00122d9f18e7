"""The device tier: bytes kept as ``uint8`` tensors on the compute device (CUDA, or the CPU).

Copies to and from it run on the tier's own CUDA stream (see [Note: CUDA copies on a
side stream] in tiers/memory.py); on the CPU they are plain copies.
"""
from __future__ import annotations

import torch

from tiers.base import format_nbytes
from tiers.host_alloc import STAGGER_MIN_BYTES, HostAllocator
from tiers.memory import MemoryTier


class DeviceTier(MemoryTier):
    """Keys held as ``uint8`` tensors on ``device`` (``"cuda:0"``, ``"cpu"``, ...).

    Parameters
    ----------
    device : torch.device | str
        Where the bytes live. The CPU works as a device (tests, machines without GPU).
    capacity : int | None
        Most bytes this tier may hold; None: the GPU's total memory (CUDA) or unbounded (CPU).
    name : str
        Named in errors and telemetry.

    Examples
    --------
    >>> tier = DeviceTier("cpu")
    >>> key = tier.put(torch.arange(5, dtype=torch.int64))
    >>> out = torch.empty(5, dtype=torch.int64); tier.read(key, out).wait()
    40
    """

    kind = "device"

    def __init__(self, device: torch.device | str = "cpu", capacity: int | None = None,
                 name: str = "device") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if capacity is None and self.device.type == "cuda":
            capacity = torch.cuda.get_device_properties(self.device).total_memory
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The CPU as the device: large keys come from the host allocator, whose starts can be staggered
        # ([Note: staggered starts] in tiers/host_alloc.py); torch's allocator maps large tensors
        # page-aligned one after the other, at addresses that make arrays streamed together alias.
        self._large = HostAllocator(pin="never") if self.device.type == "cpu" else None
        super().__init__(name, capacity, copy_stream)

    def _new_storage(self, nbytes: int, stagger: int = 0) -> torch.Tensor:
        if self._large is not None and nbytes >= STAGGER_MIN_BYTES:
            return self._large.empty(nbytes, stagger=stagger)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _limit(self) -> str:
        return f"capacity {format_nbytes(self._capacity)} on {self.device}"

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        snapshot.update(tier="device", device=str(self.device), capacity=self._capacity)
        return snapshot

    def __repr__(self) -> str:
        return f"DeviceTier(device={str(self.device)!r}, keys={len(self._keys)}, name={self.name!r})"
