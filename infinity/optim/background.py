"""The background worker that runs optimizer updates beside compute, and how far the running one got.

``BackgroundUpdate`` is the overlapped exact step by itself (``dpu.overlap``) and the
base of DPU's ``DelayedUpdate`` (infinity/optim/delayed.py). It runs ``StepJob``s on
one worker thread, reports each stepped sub-group, and answers for each parameter
group whether its stored shard is final (``ready``) or blocks until it is
(``wait_ready``). A failed job is kept and raised on the main thread.

[Note: overlapped step]
Without DPU, a synchronous update makes the next forward wait for the whole pass: with
states on NVMe that is the step's largest block of I/O (master, m, v and gradient read,
master, m, v and compute copies written), while the disk idles through most of the
backward. With ``dpu.overlap`` (the default; used when the pass moves bytes to or from
NVMe and DPU is off), ``step()`` checks the gradients (non-finite flag, clipping), hands
the job to the background worker and returns. The job writes the compute copies in
place, in sub-group order (the order of group creation, close to the forward's), and
reports each stepped sub-group with the futures of its compute-copy writes
(``BackgroundUpdate.sub_done``). The coordinator's fetch of a group waits until every
sub-group holding it that the job steps was stepped and those writes landed (``update_gate``;
the rest of an update during backward steps only the sub-groups backward left, and those
stepped during backward are final before it starts); reads ahead
skip a group not ready yet and try again at the next walk, so the compute thread only
ever waits for the group it needs now. Each fetch sees the new values, so results equal
the synchronous step's bit for bit (tests/unit/test_overlap_step.py). The first gradient
of the next backward waits for the job to end (it reads the gradient keys that backward
accumulates into); so do ``synchronize()`` and everything that calls it (``state_dict``,
``gathered``, checkpoints), and the next ``step()``. With NVMe parameters the forward
takes most groups from host memory, not from the disk: see [Note: fresh shards] in
infinity/prefetch/fresh_shards.py.

[Note: bounding the worker's threads]
``torch.set_num_threads`` is process-wide (it also resizes shared pools), so calling it
for the worker would take cores from compute. With torch's OpenMP backend the team
size of a parallel region is a per-thread setting (OpenMP's nthreads-var ICV): the
worker thread first lets ATen initialise its thread-local OpenMP state (any
``torch.get_num_threads()`` call) and then sets its own team size with
``omp_set_num_threads`` from the OpenMP runtime torch loaded. Every ATen kernel the
job runs (the fused Adam kernel, the dtype conversions of compute copies) then uses at
most ``dpu.threads`` threads, while the main thread keeps its own setting. With another
backend (TBB, native) there is no per-thread setting; a warning says the worker uses
torch's default. ``dpu.threads = 0`` keeps torch's default.

[Note: device copies of an overlapped update]
With parameters on the device and states on the host (``offload-optimizer`` on a GPU),
a sub-group's new compute copies go host->device on the device tier's copy stream, each
write a future carrying its CUDA event. The job reports the sub-group as soon as the
kernel stepped it and the copies are enqueued; it does not wait for them. A fetch of one
of its groups needs the host side only (the kernel has run: ``ready``), then orders its
read of the shard after the copies' events (``device_copies``): the compute stream waits
for them (through the data path's ``use``) when it copies a shard in device memory, the
host->device stream when it uploads a shard in host memory (states on the device,
parameters in host RAM: the copies go device->host), so neither the worker nor the
compute thread blocks on the device. Host and NVMe writes have no event and are waited
for as before.
"""
from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import warnings
import weakref
from typing import Callable

import torch

from infinity.optim.job import StepJob, UpdateStats

_STOP = object()
# Every worker still alive: at exit each finishes its running job and its thread is stopped and
# joined before the interpreter tears down. A daemon thread left alive is killed by finalization
# as soon as it next takes the GIL; one inside a torch call that released the GIL (a copy, a
# stream synchronize) then unwinds through C++ that may not be unwound, and the process aborts
# ("terminate called without an active exception", exit status -6: seen on an H100, at the end
# of every run whose last step overlapped its update). A stopped thread is only half the cure
# for a job still writing: that one is finished first.
# The drain is registered when the first worker is made, after the engine's weakref.finalize
# (which closes the tiers at exit): exit handlers run last-registered first, so the drain runs
# before the tiers close.
_WORKERS: "weakref.WeakSet" = weakref.WeakSet()
_drain_registered = False


def close_at_exit(worker) -> None:
    """Have ``worker.close()`` (finish the running job, stop and join the thread) run at exit."""
    global _drain_registered
    if not _drain_registered:
        atexit.register(_drain_at_exit)
        _drain_registered = True
    _WORKERS.add(worker)


def _drain_at_exit() -> None:
    for worker in list(_WORKERS):
        worker.close()


def damage(engine):
    """What marks ``engine``'s states damaged after an update failed part-way: forward, ``opt.step()`` and
    saves refuse until a checkpoint loads (the engine's ``check_intact``)."""
    def mark(what: str) -> None:
        engine.damaged = (f"{what}: load a checkpoint (infinity.load_checkpoint), or build the model again, "
                          "to train on")
    return mark


class UpdateWorkerError(RuntimeError):
    """A background optimizer step failed; the message names the step and what state is left."""


def _on_device(future) -> bool:
    """Whether ``future`` is a device copy the compute stream can wait for (it has a CUDA event)."""
    return getattr(future, "event", None) is not None


def bound_this_thread(threads: int) -> int:
    """Limit the ATen kernels run by the calling thread to ``threads`` threads; returns the bound.

    See [Note: bounding the worker's threads]. Returns torch's count for this thread,
    unchanged when ``threads`` is 0 or the OpenMP runtime cannot be reached.
    """
    current = torch.get_num_threads()  # initialises ATen's thread-local OpenMP state first
    if threads <= 0 or threads == current:
        return current
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        warnings.warn(f"dpu.threads = {threads}: torch's parallel backend is not OpenMP, so the worker's "
                      "threads cannot be bounded without limiting compute too; the worker uses torch's "
                      f"default ({current})", RuntimeWarning, stacklevel=2)
        return current
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        warnings.warn(f"dpu.threads = {threads}: the OpenMP runtime's omp_set_num_threads is not visible "
                      f"in this process; the worker uses torch's default ({current})",
                      RuntimeWarning, stacklevel=2)
        return current
    set_threads.argtypes = [ctypes.c_int]
    set_threads(int(threads))
    return torch.get_num_threads()


class BackgroundUpdate:
    """Runs optimizer updates on a worker thread and tracks how far the running one got.

    The base of both background modes: :class:`DelayedUpdate` (DPU, one step behind)
    and, with ``dpu.overlap``, the exact overlapped step (see [Note: overlapped step]
    above), which writes the compute copies in place and lets each group be
    fetched as soon as the update has rewritten it.

    Parameters
    ----------
    store:
        The optimizer state store (its layout says which sub-groups hold each group).
    coordinator:
        Owner of the parameter groups.
    run:
        Runs one :class:`StepJob` (the optimizer's streaming pass). Held weakly, so the
        worker thread does not keep the optimizer alive.
    threads:
        ``dpu.threads``: the worker's thread bound (0: torch's default).
    device:
        The compute device (``infinity.runtime.device.ComputeDevice``); on CUDA the worker issues
        its host-to-device copies on a stream of its own.
    stats:
        Where step counts and times are added up (shared with the optimizer).
    """

    def __init__(self, store, coordinator, run: Callable[[StepJob], None], threads: int, device,
                 stats: UpdateStats | None = None) -> None:
        self.store = store
        self.coordinator = coordinator
        self.threads = threads
        self.device = device
        self.stats = stats if stats is not None else UpdateStats()
        self._run = weakref.WeakMethod(run) if hasattr(run, "__self__") else (lambda: run)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()
        self.idle.set()
        self._progress = threading.Condition()
        self._done_sub = -1          # the running job has stepped every sub-group up to this one
        self._copy_writes: dict[int, list] = {}   # group index -> its compute-copy write futures
        # Called with what a failed job left (the states partly updated) when it is reported.
        self.on_failure: Callable[[str], None] | None = None
        self._running: StepJob | None = None
        self._unpublished: StepJob | None = None
        self._failure: tuple[StepJob, BaseException] | None = None
        self._stream = None  # the worker's CUDA stream, made on first use
        self.worker_threads: int | None = None
        self._subs_of = [sorted({p.sub_index for p in pieces}) for pieces in store.layout.pieces_of_group]
        weakref.finalize(self, self._queue.put, _STOP)
        close_at_exit(self)

    # -- progress of the running job -------------------------------------------------------------
    def sub_done(self, sub: int, copy_writes=None) -> None:
        """Called by the running job (worker thread): every sub-group up to ``sub`` is stepped, and
        ``copy_writes`` maps each group index to the futures of its compute-copy writes in ``sub``
        (the job need not wait for them: a fetch of the group waits for its own, and only those,
        so that the fetches of a sub-group's many groups stay linear in their number)."""
        with self._progress:
            for index, futures in (copy_writes or {}).items():
                self._copy_writes.setdefault(index, []).extend(futures)
            self._done_sub = sub
            self._progress.notify_all()

    def _writes_of(self, group) -> list:
        return self._copy_writes.get(group.index, [])

    def ready(self, group) -> bool:
        """Whether ``group``'s stored shard is final: no running job will still rewrite it.

        False while a failed job is not reported yet, so the next fetch raises it
        (``wait_ready``) instead of computing with partly updated parameters.
        """
        if self._failure is not None:
            return False
        job = self._running
        if job is None or group.index not in job.updated:
            return True
        return self._last_stepped(job, group.index) <= self._done_sub and all(
            f.done() or _on_device(f) for f in self._writes_of(group))

    def _last_stepped(self, job: StepJob, index: int) -> int:
        """The last sub-group of group ``index`` that ``job`` steps; -1 for none: the rest of an update during
        backward steps only the sub-groups backward left, and the groups stepped then (their writes waited
        for by ``opt.step()``) are final before it starts."""
        subs = self._subs_of[index]
        if job.subs is None:
            return subs[-1] if subs else -1
        return max((sub for sub in subs if sub in job.subs), default=-1)

    def wait_ready(self, group) -> float:
        """Block until :meth:`ready`; returns the seconds waited. Raises if the job failed."""
        if self.ready(group):
            return 0.0
        self.raise_if_failed()
        t0 = time.perf_counter()
        with self._progress:
            while self._running is not None and group.index in self._running.updated \
                    and self._last_stepped(self._running, group.index) > self._done_sub:
                self._progress.wait()
            writes = self._writes_of(group) if self._running is not None else []
        for fut in writes:
            if not _on_device(fut):
                fut.wait()      # a host or NVMe write of the new compute copy
        waited = time.perf_counter() - t0
        self.stats.exposed_seconds += waited
        self.raise_if_failed()
        return waited

    def device_copies(self, group) -> tuple:
        """The events of the device copies of ``group``'s new compute copy still in flight: whatever
        reads the shard next waits for them on its stream (the host does not). A fetch asks once
        :meth:`ready` holds. See [Note: device copies of an overlapped update]."""
        with self._progress:    # kept after the job ends: the copies may still be in flight
            writes = self._writes_of(group)
        return tuple(fut.event for fut in writes if _on_device(fut) and not fut.done())

    @property
    def pending(self) -> bool:
        """A job was handed over and is not published yet."""
        return self._unpublished is not None

    @property
    def running(self) -> bool:
        return self._running is not None

    # -- the worker ----------------------------------------------------------------------------
    def submit(self, job: StepJob) -> None:
        """Start ``job`` on the background worker; returns at once."""
        self.raise_if_failed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker_loop, name="infinity-dpu", daemon=True,
                                            args=(self._queue, weakref.ref(self)))
            self._thread.start()
        # The job's transfers are this step's, whenever they run ([Note: a step's bytes] in
        # infinity/runtime/datapath.py); held before the worker counts as busy, so nothing between leaves
        # ``wait()`` waiting for a job never queued.
        held = self.coordinator.datapath.ledger.hold()
        self.idle.clear()
        if job.delayed:
            self.stats.delayed_steps += 1
        else:
            self.stats.overlapped_steps += 1
        with self._progress:
            self._done_sub = -1
            self._copy_writes = {}
            self._running = job
        self._unpublished = job
        ready = None
        if self.device is not None and self.device.is_cuda:
            # Gradients of an in-place device tier were accumulated on the compute stream.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device.device))
        self._queue.put((job, ready, held))

    def wait(self) -> StepJob | None:
        """Wait for the running job; return the finished job not yet published (or None).

        Raises :class:`UpdateWorkerError` if the job failed (once; the job stays unpublished).
        """
        if not self.idle.is_set():
            t0 = time.perf_counter()
            self.idle.wait()
            self.stats.exposed_seconds += time.perf_counter() - t0
        self.raise_if_failed()
        return self._unpublished

    def wait_idle(self) -> None:
        """Wait until no job runs, without reporting a failure (at exit, and in tests)."""
        self.idle.wait()

    def raise_if_failed(self) -> None:
        if self._failure is None:
            return
        job, exc = self._failure
        self._failure = None
        self._unpublished = None
        what = (f"the background optimizer step {job.step} (opt.step() call {job.call}) failed: {exc!r}. "
                + ("The parameters are still those of the previous step, but master weights and Adam moments "
                   "may be partly updated" if job.delayed else
                   "Parameters, master weights and Adam moments may be partly updated"))
        if self.on_failure is not None:
            self.on_failure(what)
        raise UpdateWorkerError(what + ": load a checkpoint (infinity.load_checkpoint) before training on") from exc

    def _call(self, job: StepJob) -> None:
        run = self._run()
        if run is None:
            raise UpdateWorkerError(f"step {job.step}: the optimizer that owns this worker is gone")
        with torch.no_grad():
            run(job)

    def work(self, job: StepJob, ready, held) -> None:
        """One job on the worker thread (timed, failures kept for the main thread).

        On CUDA the job runs on the worker's own stream, after the compute stream's work
        that produced its gradients (``ready``), and the stream is drained before the job
        counts as done, so publishing never exposes device work still in flight. Its
        transfers are booked to the step that handed it over (``held``, its ledger record).
        """
        ledger = self.coordinator.datapath.ledger
        try:
            with ledger.booking(held):
                self._work(job, ready)
        finally:
            ledger.release(held)

    def _work(self, job: StepJob, ready) -> None:
        t0 = time.perf_counter()
        try:
            if self.device is not None and self.device.is_cuda:
                stream = self._cuda_stream()
                try:
                    with torch.cuda.device(self.device.device), torch.cuda.stream(stream):
                        if ready is not None:
                            stream.wait_event(ready)
                        self._call(job)
                finally:   # a failed job's device work must not outlive it either
                    stream.synchronize()
            else:
                self._call(job)
        except BaseException as exc:  # handed to the main thread by wait()
            self._failure = (job, exc)
        seconds = time.perf_counter() - t0
        self.stats.optimizer_seconds += seconds
        self.stats.last_job_seconds = seconds
        self.stats.worker_thread_ids.add(threading.get_ident())
        with self._progress:
            self._running = None
            self._progress.notify_all()
        # Idle is signalled by the worker loop once it let go of this object and the job (``_worker_loop``).

    @staticmethod
    def _worker_loop(jobs: queue.Queue, owner_ref) -> None:
        """The worker thread: bound its threads, then run jobs until told to stop.

        It holds its owner weakly between jobs so a dropped optimizer can be collected
        (``weakref.finalize`` then posts the stop marker).
        """
        owner = owner_ref()
        if owner is None:
            return
        owner.worker_threads = bound_this_thread(owner.threads)
        del owner
        while True:
            item = jobs.get()
            if item is _STOP:
                return
            owner = owner_ref()
            if owner is None:
                return
            idle = owner.idle
            try:
                owner.work(*item)
            finally:
                # Idle only once this thread holds neither the optimizer nor the job: a model dropped right
                # after the wait for this job is collected at once, its engine with it (a thread not yet
                # scheduled again kept it alive past the caller's gc.collect()).
                del owner, item
                idle.set()

    def _cuda_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device.device)
        return self._stream

    def close(self) -> None:
        """Wait for the running job and stop the worker thread."""
        self.idle.wait()
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
