"""Keys held as ``uint8`` tensors in memory: what the device and host tiers share.

``MemoryTier`` is the base of ``DeviceTier`` (the compute device's memory) and
``HostTier`` (page-aligned, pinned host RAM): a key is one tensor, allocation is
checked against a capacity, and reads and writes are tensor copies (``copy_bytes``),
asynchronous when CUDA is involved.

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


class MemoryTier(Tier):
    """Keys held as ``uint8`` tensors; subclasses say where the memory comes from.

    Parameters
    ----------
    name : str
        Named in errors and telemetry.
    capacity : int | None
        Most bytes this tier may hold; None: unbounded.
    copy_stream : torch.cuda.Stream | None
        The stream CUDA copies run on (see [Note: CUDA copies on a side stream]); None: the current one.
    """

    def __init__(self, name: str, capacity: int | None, copy_stream=None) -> None:
        self.name = name
        self._capacity = capacity
        self._keys: KeyTable[torch.Tensor] = KeyTable(name)
        self._stats = TierStats(name)
        self._alloc_lock = threading.Lock()
        self._copy_stream = copy_stream

    def _new_storage(self, nbytes: int, stagger: int = 0) -> torch.Tensor:
        """``nbytes`` of fresh ``uint8`` memory for one key (``stagger``: see ``allocate``)."""
        raise NotImplementedError

    def _limit(self) -> str:
        """How the capacity is named in the message of a full tier."""
        return f"capacity {format_nbytes(self._capacity)}"

    def allocate(self, nbytes: int, tag: str = "", stagger: int = 0) -> int:
        """A new key of ``nbytes``. ``stagger``: keys a kernel streams side by side get different
        ones, so that host memory starts them at different addresses modulo the huge page (see
        [Note: staggered starts] in tiers/host_alloc.py); ignored on the device."""
        nbytes = self._keys.validate_nbytes(nbytes, tag)
        with self._alloc_lock:
            in_use = self._stats.bytes_in_use
            if self._capacity is not None and in_use + nbytes > self._capacity:
                raise TierFullError(
                    f"{self.name} tier: allocating {format_nbytes(nbytes)} for {tag!r} would hold "
                    f"{format_nbytes(in_use + nbytes)} > {self._limit()}"
                )
            self._stats.allocated(nbytes)
        try:
            storage = self._new_storage(nbytes, stagger)
        except BaseException:
            self._stats.released(nbytes)
            raise
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

    def place(self, key: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of ``key`` for the caller to compute into, in place: a write
        without the copy, counted as one (checked as ``write`` checks its span)."""
        entry = self._keys.span(key, offset, nbytes, "write")
        self._stats.wrote(nbytes)
        return entry.place[offset:offset + nbytes]

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
