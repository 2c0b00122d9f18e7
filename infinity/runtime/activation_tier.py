"""Where offloaded activations wait for backward: host memory, or NVMe through a constant-size buffer.

[Note: activation memory]
Activations live from the forward that saves them to the backward that uses them; the
engine's other buffers (gathered parameters, gradient buckets, NVMe staging) live for one
module or one transfer. So they are placed apart (ZeRO-R): with ``offload = "host"`` each
activation takes a slice of its own arena of host memory (``tiers/arena.py``: pinned slabs
allocated once, grown to the most held at once, reused best-fit every step), which never
mixes with the short-lived buffers. With ``offload = "nvme"`` an activation is a key of
the NVMe tier, and its bytes pass through one bounded arena of ``activations.buffer_bytes``
host memory, allocated at first use and never grown: a chunk of at most a quarter of it is
copied off the device, written, and given back. One I/O thread runs the writes and the
reads in the order they were asked for, so a read of a key always follows its writes and
its free follows both. A read lands chunk by chunk in the arena and is copied to the
compute device into a fresh tensor that autograd owns and frees after use.

Every copy between the compute device and host memory is the data path's (``download``,
``upload``), every NVMe transfer too (``read``, ``write``), so the ledger books them all.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import torch

from infinity.errors import EngineError
from infinity.runtime.datapath import DONE
from tiers.arena import Arena

ALIGN = 4096


class _ReadFailed:
    """What a failed read of the I/O thread returns (see ``ActivationTier._read``)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class _HostPlace:
    __slots__ = ("loan", "event")

    def __init__(self, loan, event) -> None:
        self.loan = loan
        self.event = event      # the last copy reading or filling the slice


class _NvmePlace:
    __slots__ = ("key", "freed")

    def __init__(self, key: int) -> None:
        self.key = key
        self.freed = False


class ActivationTier:
    """Puts activations in their tier and fetches them back (see [Note: activation memory]).

    Parameters
    ----------
    config:
        The ``[activations]`` section ("host" or "nvme").
    datapath:
        ``infinity.runtime.datapath.DataPath``.
    tiers:
        The rank's ``TierSet``.
    device:
        The compute device.
    """

    def __init__(self, config, datapath, tiers, device: torch.device) -> None:
        self.kind = config.offload
        self.datapath = datapath
        self.device = torch.device(device)
        self._closed = False
        self._jobs: collections.deque = collections.deque()
        self._jobs_lock = threading.Lock()     # discard may run from a finalizer, on any thread
        # A transfer's error, kept until a call that may raise reports it (a finalizer's discard may not: its
        # error would be printed and dropped), and the keys whose write failed (their bytes are not there).
        self._error: BaseException | None = None
        self._unwritten: dict[int, BaseException] = {}
        if self.kind == "host":
            self.arena = Arena(tiers.allocator.empty, None, 64 << 20, name="activations-host")
            return
        if tiers.nvme_tier is None:
            raise EngineError("activations.offload = \"nvme\" needs the NVMe tier; set tiers.nvme_path")
        self.nvme = tiers.nvme_tier
        self.arena = Arena(tiers.allocator.empty, config.buffer_bytes, name="activations-staging")
        self.chunk = max(ALIGN, config.buffer_bytes // 4 // ALIGN * ALIGN)
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="activations-io")

    # -- into the tier -------------------------------------------------------------------------------
    def put(self, tensor: torch.Tensor):
        """Start moving ``tensor`` to the tier; returns (its place, seconds waited for buffer space)."""
        src = _flat_bytes(tensor)
        nbytes = src.numel()
        if self.kind == "host":
            loan = self.arena.take(nbytes, "activation")
            return _HostPlace(loan, self.datapath.download(loan.tensor[:nbytes], src)), 0.0
        self._raise_kept()
        key = self.nvme.allocate(_round(nbytes), tag="activation")
        waited = 0.0
        for offset in range(0, nbytes, self.chunk):
            size = min(self.chunk, nbytes - offset)
            loan, seconds = self._staging(size)
            waited += seconds
            event = self.datapath.download(loan.tensor[:size], src[offset:offset + size])
            self._submit(self._write, key, loan, event, offset, _round(size))
        return _NvmePlace(key), waited

    def _staging(self, nbytes: int):
        """A slice of the staging arena, waiting for the oldest transfers to give theirs back if need be."""
        waited = 0.0
        while True:
            loan = self.arena.take(nbytes, "activation write")
            if loan is not None:
                return loan, waited
            with self._jobs_lock:
                oldest = self._jobs.popleft() if self._jobs else None
            if oldest is None:
                raise EngineError(f"activations: no room for {nbytes} bytes in the {self.arena.capacity}-byte "
                                  "staging buffer and no transfer to wait for; raise activations.buffer_bytes")
            started = time.perf_counter()
            oldest.result()
            waited += time.perf_counter() - started

    def _write(self, key: int, loan, event, offset: int, nbytes: int) -> None:
        try:
            if event is not DONE:
                self.datapath.host_wait(event)
            self.datapath.write(self.nvme, key, loan.tensor[:nbytes], offset).wait()
        except BaseException as exc:
            self._unwritten.setdefault(key, exc)
            raise
        finally:
            loan.release()

    # -- back to the device ----------------------------------------------------------------------------
    def fetch(self, place, nbytes: int):
        """Start bringing ``nbytes`` of ``place`` back to the compute device; ``wait`` gives the tensor."""
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        allocated = self.datapath.mark()    # dst may be a block the compute stream's queued kernels still read
        if self.kind == "host":
            place.event = self.datapath.upload(dst, place.loan.tensor[:nbytes], after=(place.event, allocated))
            return dst, place.event
        failed = self._unwritten.get(place.key)
        if failed is not None:
            with self._jobs_lock:
                if self._error is failed:       # reported here, once
                    self._error = None
            raise EngineError(f"activations: an activation offloaded to NVMe cannot be read back: its write failed "
                              f"({failed!r}); backward cannot go on (the gradients would come from missing bytes)") \
                from failed
        return self._submit(self._read, place.key, dst, allocated)

    def _read(self, key: int, dst: torch.Tensor, allocated):
        """The bytes of ``key`` into ``dst``; a failure is returned (``_ReadFailed``), raised by ``wait`` when
        backward uses the activation: not kept for the next call to report, as a write's is (a fetch ahead
        that nobody uses, of a graph no backward reads, is no error of the run's)."""
        try:
            return self._read_now(key, dst, allocated)
        except BaseException as exc:
            return _ReadFailed(exc)

    def _read_now(self, key: int, dst: torch.Tensor, allocated) -> torch.Tensor:
        failed = self._unwritten.get(key)     # here, on the I/O thread after the key's writes: definitive
        if failed is not None:
            raise EngineError(f"activations: an activation offloaded to NVMe cannot be read back: its write "
                              f"failed ({failed!r}); backward cannot go on") from failed
        nbytes = dst.numel()
        for offset in range(0, nbytes, self.chunk):
            size = min(self.chunk, nbytes - offset)
            loan = self.arena.take(size, "activation read")
            if loan is None:    # the writes ran before (one thread, in order) and gave theirs back
                raise EngineError("activations: the staging buffer is held while backward reads activations "
                                  "back; a forward and a backward of one model ran at the same time")
            self.datapath.read(self.nvme, key, loan.tensor[:_round(size)], offset).wait()
            event = self.datapath.upload(dst[offset:offset + size], loan.tensor[:size], after=allocated)
            if event is not DONE:
                self.datapath.host_wait(event)
            loan.release()
        return dst

    def wait(self, pending) -> torch.Tensor:
        """The fetched bytes on the compute device (the compute stream ordered after their copy)."""
        if self.kind == "host":
            dst, event = pending
            self.datapath.use(event)
            return dst
        out = pending.result()
        if isinstance(out, _ReadFailed):
            raise out.error
        return out

    # -- giving back ------------------------------------------------------------------------------------
    def discard(self, place) -> None:
        """Give ``place`` back (after the transfers still using it); a second call does nothing."""
        if self.kind == "host":
            loan, place.loan = place.loan, None
            if loan is not None:
                self.datapath.when_done(place.event, loan.release)
            return
        if place.freed or self._closed:
            return
        place.freed = True
        self._submit(self._free, place.key, report=False)     # a finalizer's call may not raise

    def _free(self, key: int) -> None:
        # On the I/O thread, after the key's writes: a write failing after the graph let the key go would
        # otherwise mark it unwritten after the mark was cleared, and its next owner could never be read.
        self._unwritten.pop(key, None)
        self.nvme.free(key)

    def _submit(self, fn, *args, report: bool = True):
        """Start ``fn(*args)`` on the I/O thread; the errors of transfers that finished since are kept, and raised
        here unless ``report`` is False (they are then raised by the next call that reports)."""
        with self._jobs_lock:
            while self._jobs and self._jobs[0].done():
                error = self._jobs.popleft().exception()
                if error is not None and self._error is None:
                    self._error = error
            try:
                job = self._io.submit(fn, *args)
            except RuntimeError:
                if report:
                    raise
                return None     # the interpreter is exiting (its executors are shut down): the files go with it
            self._jobs.append(job)
        if report:
            self._raise_kept()
        return job

    def _raise_kept(self) -> None:
        """Raise the error a transfer left (once)."""
        with self._jobs_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait for every transfer and free asked for so far (raising the first error)."""
        while True:
            with self._jobs_lock:
                job = self._jobs.popleft() if self._jobs else None
            if job is None:
                break
            error = job.exception()
            if error is not None and self._error is None:
                self._error = error
        self._raise_kept()

    def stats(self) -> dict:
        return {"arena": self.arena.stats()}

    def close(self) -> None:
        """Finish the transfers under way and stop the I/O thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.kind == "nvme":
            self._io.shutdown(wait=True)
        self.datapath.settle(wait=True)     # the copies still using arena slices end, and give them back
