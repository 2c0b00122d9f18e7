"""The data path: every movement of bytes between the compute device, host memory and NVMe, and every
point where the host waits for the device, with a ledger of each step.

[Note: the data path]
A step's time should approach the largest of compute, PCIe bytes over the pinned copy
bandwidth, host Adam, and NVMe bytes over the disk's bandwidth, not their sum. The
rules that make the overlap possible all live here:

- host <-> device copies run ``non_blocking`` on a copy stream of their direction
  (``upload`` on the host->device stream, ``download`` on the device->host stream), and
  the compute stream waits for them through events (``use``), never the host;
- the host side of such a copy is memory of the tiers' allocator (pinned on a GPU),
  never pageable: a copy whose host side is not is counted ``unpooled``;
- a host buffer is given back only once the copy reading or filling it is done
  (``when_done``), without blocking the host;
- the host waits for the device only through ``host_wait`` / ``scalar`` / ``values``,
  each counted for the phase it happens in (forward, backward, step).

On the CPU the same code runs: copies complete at once and events are already done, but
every copy, its direction and its host side, and every host wait are booked exactly as
on a GPU. So the ledger reads the same on both, and the tests of these rules run on
the CPU in every CI run (see [Note: the transfer ledger]).

[Note: the transfer ledger]
``infinity.stats(model)["transfers"]`` is the ledger of the last complete step:
``host_to_device``, ``device_to_host``, ``nvme_to_host``, ``host_to_nvme`` (each
``{"copies": n, "bytes": n}``), ``unpooled`` (host<->device copies whose host side is
not allocator memory), ``host_waits`` by phase, ``per_parameter_calls`` (engine
calls made once per parameter rather than once per group or bucket), and ``per_parameter``:
bytes stored and moved to and from NVMe per element of the rank's shards (``with_per_parameter``). Which side of a
copy is "host" is the role of the memory, not its torch device: on the CPU the
compute device's buffers (gathered groups, gradient buckets) count as device memory
and the tiers' host memory as host memory, as they would on a GPU.

[Note: a step's bytes]
The ledger books a transfer to the step whose work it is, not to the step during whose wall time it
happens to start. A step's forward and backward book into the running step; an update that runs on
a background thread after ``opt.step()`` returned (overlapped, or delayed by DPU) books into the step
that handed it over, through the record ``hold`` gave it (``booking`` on the worker thread), and that
step's record becomes ``last`` only once the update ended. Booking by wall time instead, the step's
bounds (one root forward's start to the next) fall in the middle of the overlapped update, whose
first reads are issued just before or just after the next forward starts, as the threads happen to
run: on a 2-core machine, GPT 20M in bfloat16 with everything on NVMe, steps alternated between
2.7 and 30.8 B/param read (both updates' reads, or neither) where every step reads 16.7, and
``per_parameter`` read 42.8 or 56.8 B/param moved where the operating system counts 30.8 per step.
Booked by cause, a steady step's NVMe bytes equal what ``/proc/self/io`` counts from one quiet
point (no transfer in flight) to the next over whole steps, to the byte
(tests/integration/test_ledger_disk_bytes.py): the tiers' keys are 4096-aligned, so ``O_DIRECT``
adds no padding and reads no edge blocks. The per-step records of [Note: step records] in
infinity/telemetry.py stay wall-time windows: they give the rates a step achieved, and their bytes
average to the ledger's over steps, not step by step.

[Note: late copies]
On the CPU a copy is a memcpy done before the call returns, so code that reads a copy's
destination before its event, or reuses its source too early, is right on the CPU and
wrong on a GPU, where the copy runs on a copy stream at some later moment. With
``late_polls`` (``$INFINITY_LATE_COPIES``, which the test suite sets) a CPU copy is held
back as a GPU's copy stream may hold it: it runs only when its event is used by the
compute side (``use``), waited for by the host (``host_wait``, ``synchronize``), or asked
whether it is done more than ``late_polls`` times; a copy that must wait for other events
(``after``) runs them first, as the stream would. Reading its destination before then
reads stale bytes, so the CPU's parity tests see what a GPU would get wrong.
``late_copies`` counts the copies held back.

What the room may touch: tensors it is handed, tiers' reads and writes, CUDA streams
and events; it decides nothing about when to move what.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import torch

from infinity.config import ConfigError
from tiers.base import byte_view

DIRECTIONS = {("host", "device"): "host_to_device", ("device", "host"): "device_to_host",
              ("nvme", "host"): "nvme_to_host", ("host", "nvme"): "host_to_nvme"}
PHASES = ("forward", "backward", "step")


class _Done:
    """The event of work that is complete already (CPU copies)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _Done()

# Holds the CPU's data-path copies back as a GPU's copy streams may ([Note: late copies]): a test suite sets it,
# so that its CPU runs see what a GPU's timing would.
LATE_COPIES_ENV = "INFINITY_LATE_COPIES"
_MAX_POLLS = 10**9


def late_copy_polls() -> int | None:
    """$INFINITY_LATE_COPIES as the number of polls a held-back CPU copy answers "not done" to, or None
    (unset or empty: copies complete at once)."""
    chosen = os.environ.get(LATE_COPIES_ENV, "")
    if not chosen:
        return None
    if not chosen.isdigit() or int(chosen) > _MAX_POLLS:
        raise ConfigError(f"the environment variable {LATE_COPIES_ENV}={chosen!r} is not a count of polls from 0 "
                          f"to {_MAX_POLLS} (it holds the CPU's data-path copies back until they are used, waited "
                          "for, or polled that many times); unset it for copies that complete at once",
                          "tiers.device")
    return int(chosen)


_held_late = [0]    # late copies held by every data path of this process (a suite's proof that it ran late)
_held_late_lock = threading.Lock()


def held_late_copies() -> int:
    """How many copies the data paths of this process have held back so far (see [Note: late copies])."""
    return _held_late[0]


class LateCopy:
    """A CPU copy held back as a GPU's copy stream may hold it (see [Note: late copies]).

    It runs when its event is used, waited for, or polled more than ``polls`` times; as on a stream, the
    copies issued before it in its direction (``prior``) run first, and so do the events it was ordered
    behind (``after``). ``lock`` is its data path's, shared by every copy of both directions."""

    on_device = True
    __slots__ = ("dst", "src", "after", "prior", "polls", "done", "lock")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, after: tuple, polls: int, prior: "LateCopy | None",
                 lock: threading.RLock) -> None:
        self.dst, self.src, self.after, self.prior, self.polls = dst, src, after, prior, polls
        self.done = False
        self.lock = lock

    def run(self) -> None:
        if self.done:
            return
        with self.lock:
            chain, copy = [], self
            while copy is not None and not copy.done:      # a loop: thousands may wait on one stream
                chain.append(copy)
                copy = copy.prior
            for copy in reversed(chain):
                for event in copy.after:
                    if isinstance(event, LateCopy):
                        event.run()
                copy.dst.copy_(copy.src)
                copy.dst = copy.src = copy.after = copy.prior = None    # the buffers are the caller's again
                copy.done = True

    def query(self) -> bool:
        if not self.done:
            self.polls -= 1
            if self.polls < 0:
                self.run()
        return self.done

    def synchronize(self) -> None:
        self.run()


class _LateWrite:
    """A device tier's write held late (a CUDA copy future's face: ``event``, ``done``, ``wait``)."""

    __slots__ = ("event", "nbytes")

    def __init__(self, copy: LateCopy, nbytes: int) -> None:
        self.event, self.nbytes = copy, nbytes

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> int:
        self.event.run()
        return self.nbytes


class StepRecord:
    """One step's counters, how many background jobs still book into them, and the step's place in order."""

    __slots__ = ("counts", "holds", "closed", "seq")

    def __init__(self, counts: dict, seq: int) -> None:
        self.counts, self.holds, self.closed, self.seq = counts, 0, False, seq


class StepLedger:
    """Counters of the running step, kept as ``last`` when it closes; thread-safe.

    A background job that does a step's work after the step closed (the overlapped or delayed
    update) books into that step's record, not the running one's (see [Note: a step's bytes]):
    ``hold`` on the thread that hands the job over, ``booking`` around the job on its thread,
    ``release`` when it ends. A closed record becomes ``last`` once nothing holds it, unless a
    later step's record is ``last`` already.

    Subclasses say what is counted (``_empty``) and how (methods that change ``_counts()`` under ``_lock``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.last: dict | None = None
        self._last_seq = -1
        self._seq = 0
        self._record = StepRecord(self._empty(), self._seq)

    @classmethod
    def _empty(cls) -> dict:
        raise NotImplementedError

    @property
    def _current(self) -> dict:
        """The running step's counters (what ``current()`` reads)."""
        return self._record.counts

    def _counts(self) -> dict:
        """Where this thread books now: the held record of its job, else the running step's. Under ``_lock``."""
        held = getattr(self._local, "record", None)
        return self._record.counts if held is None else held.counts

    def close_step(self) -> None:
        """A step ended: what was counted becomes ``last`` (once its held jobs end), and counting starts again."""
        with self._lock:
            ended = self._record
            ended.closed = True
            self._seq += 1
            self._record = StepRecord(self._empty(), self._seq)
            self._publish(ended)

    def discard(self) -> None:
        """Forget what was counted so far (traffic before the first step)."""
        with self._lock:
            self._record.counts = self._empty()

    def hold(self) -> StepRecord:
        """The running step's record, held open for a job that will book into it later (``booking``)."""
        with self._lock:
            self._record.holds += 1
            return self._record

    def release(self, record: StepRecord) -> None:
        """The job that held ``record`` ended: the record is complete once its step has closed too."""
        with self._lock:
            record.holds -= 1
            self._publish(record)

    @contextlib.contextmanager
    def booking(self, record: StepRecord):
        """Within it, what this thread books goes to ``record`` (a held step's), not to the running step."""
        outer = getattr(self._local, "record", None)
        self._local.record = record
        try:
            yield record
        finally:
            self._local.record = outer

    def _publish(self, record: StepRecord) -> None:
        if record.closed and record.holds == 0 and record.seq > self._last_seq:
            self.last, self._last_seq = record.counts, record.seq


class TransferLedger(StepLedger):
    """Counts of one step's movements and host waits (see [Note: the transfer ledger])."""

    @classmethod
    def _empty(cls) -> dict:
        out: dict = {name: {"copies": 0, "bytes": 0} for name in DIRECTIONS.values()}
        out.update(unpooled=0, host_waits=dict.fromkeys(PHASES, 0), per_parameter_calls=0)
        return out

    def copy(self, direction: str, nbytes: int, pooled: bool = True) -> None:
        with self._lock:
            counts = self._counts()
            entry = counts[direction]
            entry["copies"] += 1
            entry["bytes"] += nbytes
            if not pooled:
                counts["unpooled"] += 1

    def host_wait(self, phase: str) -> None:
        with self._lock:
            if phase in PHASES:
                self._counts()["host_waits"][phase] += 1

    def per_parameter_call(self) -> None:
        with self._lock:
            self._counts()["per_parameter_calls"] += 1

    def current(self) -> dict:
        with self._lock:
            return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._current.items()}


def with_per_parameter(last: dict | None, numel: int, tiers) -> dict | None:
    """The ledger's ``last`` step with ``per_parameter`` added: bytes per element of this rank's shards
    (padding included) ``stored`` by the parameter and optimizer tiers (``stored_nvme``: by NVMe), and
    ``nvme_read`` / ``nvme_written`` in that step. ``infinity.plan``'s ``Plan.per_parameter`` predicts them."""
    if last is None:
        return None
    numel = max(1, numel)
    used = {id(t): t for t in (tiers.params, *tiers.optimizer_parts)}.values()
    stored = {t.kind: t.stats()["bytes_in_use"] for t in used}
    return dict(last, per_parameter={
        "stored": sum(stored.values()) / numel, "stored_nvme": stored.get("nvme", 0) / numel,
        "nvme_read": last["nvme_to_host"]["bytes"] / numel, "nvme_written": last["host_to_nvme"]["bytes"] / numel})


class DataPath:
    """The one owner of host<->device copies, tier transfers and host waits (see [Note: the data path]).

    Parameters
    ----------
    device:
        The compute device (``infinity.runtime.device.ComputeDevice``).
    allocator:
        The tiers' host allocator: host memory it made counts as pooled.
    late_polls:
        On the CPU, hold copies back until used, waited for or polled this many times (see [Note: late
        copies]); None completes them at once. Ignored on CUDA, where the copy streams do it.
    """

    def __init__(self, device, allocator, late_polls: int | None = None) -> None:
        self.device = device.device
        self.is_cuda = device.is_cuda
        self.allocator = allocator
        self.late_polls = None if device.is_cuda else late_polls
        self.late_copies = 0
        self._late_lock = threading.RLock()
        self._last_late: dict[str, LateCopy] = {}     # direction -> its newest held copy (a stream's tail)
        self.ledger = TransferLedger()
        self._local = threading.local()
        self._deferred: list[tuple[object, Callable[[], None]]] = []
        self._deferred_lock = threading.Lock()
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device)

    # -- phases -------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """What this thread is doing: "forward", "backward", "step" or "idle"."""
        return getattr(self._local, "phase", "idle")

    def set_phase(self, phase: str) -> None:
        self._local.phase = phase

    # -- host <-> device -----------------------------------------------------------------------------
    def upload(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy host ``src`` into device ``dst``; returns the event that marks its end.

        ``after``: an event, or a tuple of events, the copy must wait for first (the compute stream's
        last use of ``dst``'s memory: ``mark()`` when ``dst`` was just allocated on the compute stream,
        whose freed blocks may still be read by its queued kernels). The compute stream does not wait
        for the copy until ``use(event)``.
        """
        self.ledger.copy("host_to_device", src.numel() * src.element_size(), self.allocator.owns(src))
        return self._copy(self.h2d if self.is_cuda else "host_to_device", dst, src, after)

    def download(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy device ``src`` into host ``dst``, after the compute stream's work so far; returns its event."""
        self.ledger.copy("device_to_host", src.numel() * src.element_size(), self.allocator.owns(dst))
        after = None
        if self.is_cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        return self._copy(self.d2h if self.is_cuda else "device_to_host", dst, src, after)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, after):
        """On CUDA ``stream`` is the copy stream; on the CPU the direction's name (its late copies' queue)."""
        if isinstance(stream, str):
            if self.late_polls is None:
                dst.copy_(src)
                return DONE
            with self._late_lock:
                prior = self._last_late.get(stream)
                copy = LateCopy(dst, src, after if isinstance(after, tuple) else (after,), self.late_polls,
                                None if prior is None or prior.done else prior, self._late_lock)
                self._last_late[stream] = copy
                self.late_copies += 1
            with _held_late_lock:
                _held_late[0] += 1
            return copy
        with torch.cuda.stream(stream):
            for event in (after if isinstance(after, tuple) else (after,)):
                if event is not None and event is not DONE:
                    stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for tensor in (dst, src):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        return event

    def mark(self):
        """An event at the compute stream's work enqueued so far (``DONE`` on the CPU)."""
        if not self.is_cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def use(self, event) -> None:
        """The compute stream waits for ``event`` (a copy's end) before its next work; the host does not."""
        if isinstance(event, LateCopy):
            event.run()     # the CPU's compute "stream" is the host: its next work comes after the copy
        elif self.is_cuda and event is not DONE:
            torch.cuda.current_stream(self.device).wait_event(event)

    def when_done(self, event, callback: Callable[[], None]) -> None:
        """Run ``callback`` (give a host buffer back) once ``event`` is done, without blocking the host."""
        if event is DONE or event.query():
            callback()
            return
        with self._deferred_lock:
            self._deferred.append((event, callback))
        self.settle()

    def settle(self, wait: bool = False) -> None:
        """Run the callbacks whose events are done (all of them, waiting, with ``wait``)."""
        with self._deferred_lock:
            pending, self._deferred = self._deferred, []
        left = []
        for event, callback in pending:
            if wait and not event.query():
                if getattr(event, "on_device", True):
                    self.host_wait(event)
                else:
                    event.synchronize()     # I/O (tier writes), not the device
            if event.query():
                callback()
            else:
                left.append((event, callback))
        if left:
            with self._deferred_lock:
                self._deferred[:0] = left

    # -- host waits -----------------------------------------------------------------------------------
    def host_wait(self, event) -> None:
        """Block the host until ``event`` is done (counted for this thread's phase)."""
        self.ledger.host_wait(self.phase)
        event.synchronize()

    def scalar(self, tensor: torch.Tensor) -> float:
        """``float(tensor)`` of a device scalar: a host wait (counted)."""
        return float(self._read_back(tensor))

    def values(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()`` of a device tensor: a host wait (counted)."""
        return self._read_back(tensor).tolist()

    def _read_back(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in host memory, valid until this thread's next read back (a counted host wait).

        On CUDA they come through a pinned buffer of this thread's (allocated once, grown when too small),
        not through the pageable memory ``.item()`` / ``.tolist()`` would copy into. Not booked as a
        transfer: a few bytes, read to decide, not to move data (``host_waits`` counts them)."""
        self.ledger.host_wait(self.phase)
        if not tensor.is_cuda:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        buffer = getattr(self._local, "read_back", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._local.read_back = self.allocator.empty(max(4096, nbytes))
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        self.mark().synchronize()
        return host

    # -- tiers ------------------------------------------------------------------------------------------
    def read(self, tier, key: int, dst: torch.Tensor, offset: int = 0, into: str = "host"):
        """Start ``tier.read`` into ``dst``, which lives on ``into`` ("host" or "device"); booked by direction."""
        self._book(tier.kind, into, dst)
        return tier.read(key, dst, offset)

    def write(self, tier, key: int, src: torch.Tensor, offset: int = 0, source: str = "host"):
        """Start ``tier.write`` of ``src``, which lives on ``source`` ("host" or "device")."""
        # Into a host tier's pinned keys from the device: pooled, whatever memory the source is.
        self._book(source, tier.kind, src, pooled=True if (source, tier.kind) == ("device", "host") else None)
        crossing = {("host", "device"): "host_to_device", ("device", "host"): "device_to_host"}.get((source, tier.kind))
        if self.late_polls is not None and crossing is not None and not self.is_cuda:
            # On a GPU this is a copy across the link pending on an event (a device share's new compute copies
            # into host-memory shards, an update's into device shards): held late like the others.
            data = byte_view(src, f"{tier.kind} tier write source")
            copy = self._copy(crossing, tier.place(key, offset, data.numel()), data, None)
            return _LateWrite(copy, data.numel())
        return tier.write(key, src, offset)

    def _book(self, src: str, dst: str, tensor: torch.Tensor, pooled: bool | None = None) -> None:
        direction = DIRECTIONS.get((src, dst))
        if direction is not None:
            host_side = direction in ("host_to_device", "device_to_host")
            if pooled is None:
                pooled = self.allocator.owns(tensor) if host_side else True
            self.ledger.copy(direction, tensor.numel() * tensor.element_size(), pooled)

    def per_parameter_call(self) -> None:
        self.ledger.per_parameter_call()
