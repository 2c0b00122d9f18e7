"""The device tier: bytes kept as ``uint8`` tensors on the compute device (CUDA, or the CPU).

[Note: CUDA copies on a side stream]
On CUDA a write or read is issued on the tier's own copy stream, so it overlaps the
compute on the current stream. The copy stream first waits for the current stream
(the source may still be being produced there), the copy is enqueued with
``non_blocking=True``, and an event is recorded after it. The returned future waits
on that event (``wait()`` blocks the host; ``wait_on(stream)`` only makes a stream
wait). ``record_stream`` tells the caching allocator the tensors are in use on the
copy stream, so freeing them on the current stream cannot recycle them too early.
On the CPU the copy is a plain ``copy_`` and the future is already complete.
"""
from __future__ import annotations

import threading

import torch

from tiers.base import CompletedFuture, Future, Tier, TierFullError, byte_view, format_nbytes
from tiers.future import TransferFuture
from tiers.keytable import KeyTable
from tiers.telemetry import TierStats


class CudaCopyFuture(TransferFuture):
    """A copy pending on a CUDA event; ``event`` lets another stream wait without blocking the host."""

    __slots__ = ("event",)

    def __init__(self, event: "torch.cuda.Event", nbytes: int, stats: TierStats) -> None:
        super().__init__(event.synchronize, event.query, nbytes, stats)
        self.event = event

    def wait_on(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make ``stream`` (default: the current one) wait for the copy, without blocking the host."""
        (stream or torch.cuda.current_stream()).wait_event(self.event)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, stats: TierStats,
               stream: "torch.cuda.Stream | None" = None) -> Future:
    """Copy the ``uint8`` tensor ``src`` into ``dst`` (same size); async when CUDA is involved.

    CPU to CPU copies finish before returning. When either side is on CUDA the copy is
    enqueued on ``stream`` (default: the current stream) after it waited for the current
    stream; see [Note: CUDA copies on a side stream].
    """
    nbytes = src.numel()
    if not (dst.is_cuda or src.is_cuda):
        dst.copy_(src)
        return CompletedFuture(nbytes)
    cuda_device = dst.device if dst.is_cuda else src.device
    current = torch.cuda.current_stream(cuda_device)
    stream = stream or current
    if stream != current:
        stream.wait_stream(current)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    for tensor in (dst, src):
        if tensor.is_cuda and stream != current:
            tensor.record_stream(stream)
    return CudaCopyFuture(event, nbytes, stats)


class DeviceTier(Tier):
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

    def __init__(self, device: torch.device | str = "cpu", capacity: int | None = None,
                 name: str = "device") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = name
        if capacity is None and self.device.type == "cuda":
            capacity = torch.cuda.get_device_properties(self.device).total_memory
        self._capacity = capacity
        self._keys: KeyTable[torch.Tensor] = KeyTable(name)
        self._stats = TierStats(name)
        self._alloc_lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def allocate(self, nbytes: int, tag: str = "") -> int:
        nbytes = self._keys.validate_nbytes(nbytes, tag)
        with self._alloc_lock:
            in_use = self._stats.bytes_in_use
            if self._capacity is not None and in_use + nbytes > self._capacity:
                raise TierFullError(
                    f"{self.name} tier: allocating {format_nbytes(nbytes)} for {tag!r} would hold "
                    f"{format_nbytes(in_use + nbytes)} > capacity {format_nbytes(self._capacity)} on {self.device}"
                )
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._stats.allocated(nbytes)
        return self._keys.add(storage, nbytes, tag)

    def write(self, key: int, src: torch.Tensor, offset: int = 0) -> Future:
        data = byte_view(src, f"{self.name} tier write source")
        entry = self._keys.span(key, offset, data.numel(), "write")
        self._stats.wrote(data.numel())
        return copy_bytes(entry.place[offset:offset + data.numel()], data, self._stats, self._copy_stream)

    def read(self, key: int, dst: torch.Tensor, offset: int = 0) -> Future:
        data = byte_view(dst, f"{self.name} tier read destination")
        entry = self._keys.span(key, offset, data.numel(), "read")
        self._stats.read(data.numel())
        return copy_bytes(data, entry.place[offset:offset + data.numel()], self._stats, self._copy_stream)

    def view(self, key: int) -> torch.Tensor:
        """The ``uint8`` tensor holding ``key``'s bytes on the device (aliases them, no copy)."""
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
        snapshot.update(tier="device", device=str(self.device), capacity=self._capacity)
        return snapshot

    def __repr__(self) -> str:
        return f"DeviceTier(device={str(self.device)!r}, keys={len(self._keys)}, name={self.name!r})"
