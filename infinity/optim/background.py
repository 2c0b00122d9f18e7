"""Delayed parameter update (DPU): the host optimizer step of iteration t runs beside iteration t+1.

[Note: delayed parameter update]
With the optimizer on the host, a synchronous step makes compute wait for it every
iteration. With DPU (``dpu.enabled``), after ``dpu.warmup_steps`` ordinary updates,
``opt.step()`` of iteration t

1. waits for the job of iteration t-1 (it ran beside the forward/backward of t, so
   it has usually finished) and publishes its parameters;
2. hands the gradients of iteration t to the background worker as job t;
3. returns.

So the forward/backward of iteration t+1 computes with the parameters produced by the
update of iteration t-1, the newest complete ones, while job t runs: the gradient of
iteration t+1 (computed on p[t-1]) is applied to p[t]. This is ZeRO-Offload's one-step
delay. Publishing happens only inside ``step()`` and ``synchronize()``, i.e. between
iterations, never during a forward or backward. ``synchronize()`` (called by
``infinity.gathered`` and checkpoint saving) waits for the running job and publishes
it: the pipeline drains, and the next forward uses the newest parameters.

Two things would be shared between the worker and compute, and both are double-buffered:

- the gradient accumulator: the job reads the gradient sub-groups of iteration t while
  the next backward accumulates into a second set of keys in the optimizer tier. The
  store's ``keys["grad"]`` list is swapped at hand-off (4 bytes per parameter more in
  the optimizer tier);
- the compute copies in the parameter tier: see [Note: publishing by swapping keys].

Master weights and Adam moments are read and written only by the step, so the job
updates them in place; everything that reads them from the main thread
(``state_dict``, ``gathered``, checkpoints) calls ``synchronize()`` first.

[Note: publishing by swapping keys]
Each trainable group gets a second key of its shard's size in the parameter tier. A
job writes its new compute copies into the keys that are not published; publishing
swaps ``group.param_key`` with that key. We chose this over deferring the job's writes
to the moment of publishing because publishing then moves no data: it is a pointer
swap per group, atomic with respect to compute (it happens on the main thread between
iterations), and the writes themselves (host copies, host-to-device copies, NVMe
writes) are pipelined inside the job, beside compute. Deferred writes would put a
whole-model copy (an NVMe write, with NVMe parameters) on the critical path at every
publish and need a host buffer as large as all compute copies anyway. The cost is one
more shard per trainable group in the parameter tier (2 bytes per parameter in
bf16/fp16, 4 in fp32). Two key sets suffice because job t starts only after job t-1
was published: job t writes the keys of job t-2, which nothing reads any more.
Gathered copies of the old values (persistent groups, prefetched groups) are dropped
when publishing, so the next forward gathers from the new keys.

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
"""
from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

_STOP = object()
# Every worker still alive: at exit each finishes its running job before the interpreter
# tears down (a daemon thread stopped in the middle of a write would leave a half-written
# state and can abort the interpreter's shutdown).
# The drain is registered when the first worker is made, after the engine's weakref.finalize
# (which closes the tiers at exit): exit handlers run last-registered first, so the drain runs
# before the tiers close.
_WORKERS: "weakref.WeakSet[BackgroundUpdate]" = weakref.WeakSet()
_drain_registered = False


def _drain_at_exit() -> None:
    for worker in list(_WORKERS):
        worker._idle.wait()


@dataclass(frozen=True)
class StepJob:
    """Everything one optimizer update needs, fixed when ``opt.step()`` hands it over.

    Attributes
    ----------
    step:
        The Adam step number (bias correction) of this update.
    call:
        Which ``opt.step()`` call produced it (1-based; skipped steps count).
    lr, beta1, beta2, eps, weight_decay:
        Hyper-parameters read from ``param_groups[0]`` at hand-off, so a learning-rate
        scheduler stepped after ``opt.step()`` affects the next update, as in PyTorch.
    decoupled:
        AdamW (True) or Adam with L2 weight decay (False).
    clip_coef:
        Factor by which the gradients of this step are scaled (``clip_grad_norm_``), or None.
    grad_keys:
        The optimizer-tier keys of this step's gradient sub-groups.
    updated:
        The groups this update changes: those with parameters in the optimizer that received
        a gradient since the last ``zero_grad`` (like ``torch.optim``, which skips parameters
        whose ``.grad`` is None). Other groups' ranges of ``grad_keys`` are stale, never read.
    param_keys:
        Per group, the parameter-tier key that receives the new compute copy; None for the
        groups this update does not change.
    delayed:
        True when the job runs on the background worker one step behind (DPU).
    runs:
        Per sub-group, the ``(offset, numel, step)`` ranges Adam updates and the step count of
        each, when some trainable parameter had no gradient or lags in steps (see [Note:
        parameters without a gradient] in optimizer.py); None when every trainable parameter
        of ``updated`` has a gradient and ``step`` (the common case: whole groups, one step).
    overlapped:
        True when the job runs on the background worker at exact semantics: it writes the
        published compute copies in place and reports each finished sub-group
        (``BackgroundUpdate.sub_done``, with the futures of its compute-copy writes) so the
        next forward can fetch those groups once the writes have landed.
    """

    step: int
    call: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    clip_coef: float | None
    grad_keys: tuple[int, ...]
    updated: frozenset[int]
    param_keys: tuple[int | None, ...]
    delayed: bool = False
    overlapped: bool = False
    runs: tuple | None = None


@dataclass
class DpuStats:
    """Where the optimizer's time went (seconds, summed over steps)."""

    sync_steps: int = 0
    delayed_steps: int = 0
    overlapped_steps: int = 0
    skipped_steps: int = 0
    optimizer_seconds: float = 0.0
    exposed_seconds: float = 0.0
    last_job_seconds: float = 0.0
    worker_thread_ids: set = field(default_factory=set)

    def add_sync(self, seconds: float) -> None:
        """Book an update that ran on the calling thread: all of it exposed to compute."""
        self.sync_steps += 1
        self.optimizer_seconds += seconds
        self.exposed_seconds += seconds
        self.last_job_seconds = seconds

    def as_dict(self) -> dict:
        hidden = 1.0 - self.exposed_seconds / self.optimizer_seconds if self.optimizer_seconds else 0.0
        return {"sync_steps": self.sync_steps, "delayed_steps": self.delayed_steps,
                "overlapped_steps": self.overlapped_steps, "skipped_steps": self.skipped_steps,
                "optimizer_seconds": self.optimizer_seconds,
                "exposed_seconds": self.exposed_seconds, "hidden_fraction": hidden,
                "last_job_seconds": self.last_job_seconds}


class DpuWorkerError(RuntimeError):
    """A background optimizer step failed; the message names the step and what state is left."""


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
    in optimizer.py), which writes the compute copies in place and lets each group be
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
                 stats: DpuStats | None = None) -> None:
        self.store = store
        self.coordinator = coordinator
        self.threads = threads
        self.device = device
        self.stats = stats if stats is not None else DpuStats()
        self._run = weakref.WeakMethod(run) if hasattr(run, "__self__") else (lambda: run)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._progress = threading.Condition()
        self._done_sub = -1          # the running job has stepped every sub-group up to this one
        self._copy_writes: dict[int, list] = {}   # sub-group -> its compute-copy write futures
        self._running: StepJob | None = None
        self._unpublished: StepJob | None = None
        self._failure: tuple[StepJob, BaseException] | None = None
        self._stream = None  # the worker's CUDA stream, made on first use
        self.worker_threads: int | None = None
        self._last_sub = [max((p.sub_index for p in pieces), default=-1)
                          for pieces in store.layout.pieces_of_group]
        weakref.finalize(self, self._queue.put, _STOP)
        global _drain_registered
        if not _drain_registered:
            atexit.register(_drain_at_exit)
            _drain_registered = True
        _WORKERS.add(self)

    # -- progress of the running job -------------------------------------------------------------
    def sub_done(self, sub: int, copy_writes=()) -> None:
        """Called by the running job (worker thread): every sub-group up to ``sub`` is stepped, and
        ``copy_writes`` are the futures of ``sub``'s compute-copy writes (the job need not wait for
        them: a fetch waits for those of its own group's sub-groups)."""
        with self._progress:
            self._copy_writes[sub] = list(copy_writes)
            self._done_sub = sub
            self._progress.notify_all()

    def _writes_of(self, group) -> list:
        return [f for p in self.store.layout.pieces_of_group[group.index]
                for f in self._copy_writes.get(p.sub_index, ())]

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
        return self._last_sub[group.index] <= self._done_sub and all(f.done() for f in self._writes_of(group))

    def wait_ready(self, group) -> float:
        """Block until :meth:`ready`; returns the seconds waited. Raises if the job failed."""
        if self.ready(group):
            return 0.0
        self.raise_if_failed()
        t0 = time.perf_counter()
        with self._progress:
            while self._running is not None and group.index in self._running.updated \
                    and self._last_sub[group.index] > self._done_sub:
                self._progress.wait()
            writes = self._writes_of(group) if self._running is not None else []
        for fut in writes:
            fut.wait()
        waited = time.perf_counter() - t0
        self.stats.exposed_seconds += waited
        self.raise_if_failed()
        return waited

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
            self._thread = threading.Thread(target=_worker_loop, name="infinity-dpu", daemon=True,
                                            args=(self._queue, weakref.ref(self)))
            self._thread.start()
        self._idle.clear()
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
        self._queue.put((job, ready))

    def wait(self) -> StepJob | None:
        """Wait for the running job; return the finished job not yet published (or None).

        Raises :class:`DpuWorkerError` if the job failed (once; the job stays unpublished).
        """
        if not self._idle.is_set():
            t0 = time.perf_counter()
            self._idle.wait()
            self.stats.exposed_seconds += time.perf_counter() - t0
        self.raise_if_failed()
        return self._unpublished

    def raise_if_failed(self) -> None:
        if self._failure is None:
            return
        job, exc = self._failure
        self._failure = None
        self._unpublished = None
        raise DpuWorkerError(
            f"the background optimizer step {job.step} (opt.step() call {job.call}) failed: {exc!r}. "
            + ("The parameters are still those of the previous step, but master weights and Adam moments "
               "may be partly updated: reload a checkpoint before training on" if job.delayed else
               "Parameters, master weights and Adam moments may be partly updated: reload a checkpoint "
               "before training on")) from exc

    def _call(self, job: StepJob) -> None:
        run = self._run()
        if run is None:
            raise DpuWorkerError(f"step {job.step}: the optimizer that owns this worker is gone")
        with torch.no_grad():
            run(job)

    def _work(self, job: StepJob, ready) -> None:
        """One job on the worker thread (timed, failures kept for the main thread).

        On CUDA the job runs on the worker's own stream, after the compute stream's work
        that produced its gradients (``ready``), and the stream is drained before the job
        counts as done, so publishing never exposes device work still in flight.
        """
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
        self._idle.set()

    def _cuda_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device.device)
        return self._stream

    def close(self) -> None:
        """Wait for the running job and stop the worker thread."""
        self._idle.wait()
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None


class DelayedUpdate(BackgroundUpdate):
    """The background worker of DPU and the second gradient and compute-copy buffers.

    Parameters are those of :class:`BackgroundUpdate`, and

    trainable:
        Indices of the groups with parameters in the optimizer (they get a second key).
    """

    def __init__(self, store, coordinator, run: Callable[[StepJob], None], threads: int, device,
                 trainable: set[int], stats: DpuStats | None = None) -> None:
        super().__init__(store, coordinator, run, threads, device, stats)
        tier = store.tier
        self._spare_grad_keys = []
        for i, (_, numel) in enumerate(store.layout.sub_ranges):
            key = tier.allocate(numel * 4, tag=f"grad-next:sub{i}")
            tier.write(key, torch.zeros(numel, dtype=torch.float32)).wait()
            self._spare_grad_keys.append(key)
        self._spare_param_keys: dict[int, int] = {}
        for g in coordinator.groups:
            if g.index in trainable:
                shard = torch.empty(g.shard_numel, dtype=g.dtype)
                coordinator.param_tier.read(g.param_key, shard).wait()
                self._spare_param_keys[g.index] = coordinator.param_tier.put(shard, tag=f"param-next:{g.name}")

    # -- the buffers ---------------------------------------------------------------------------
    def target_param_keys(self, updated: frozenset[int]) -> tuple[int | None, ...]:
        """Where the next job writes the compute copies of ``updated`` groups: keys not published."""
        return tuple(self._spare_param_keys[g.index] if g.index in updated else None
                     for g in self.coordinator.groups)

    def hand_over_grads(self) -> tuple[int, ...]:
        """The filled gradient keys, for a job; the store accumulates into the other set from now on.

        The caller has waited for the previous job, which read the other set.
        """
        if self._running is not None:
            raise DpuWorkerError(f"internal: gradient keys handed over while step {self._running.step} "
                                 "still reads the spare set")
        store = self.store
        store.flush()
        filled = tuple(store.keys["grad"])
        store.keys["grad"] = list(self._spare_grad_keys)
        self._spare_grad_keys = list(filled)
        store.zero_grad()
        return filled

    def reading_grads(self, keys) -> bool:
        """True when the running job reads the gradient ``keys`` (a backward must not write them)."""
        job = self._running
        return job is not None and bool(keys) and keys[0] == job.grad_keys[0]

    def ready(self, group) -> bool:
        """A delayed job writes keys nothing reads until it is published: every group is ready."""
        return True

    def publish(self, job: StepJob) -> None:
        """Make ``job``'s compute copies the parameters: swap each trainable group's key."""
        for g in self.coordinator.groups:
            new = job.param_keys[g.index]
            if new is None or new == g.param_key:
                continue
            self._spare_param_keys[g.index] = g.param_key
            g.param_key = new
        if self._unpublished is job:
            self._unpublished = None

    def run_inline(self, job: StepJob) -> None:
        """Run ``job`` on the calling thread (warm-up steps) and publish it."""
        t0 = time.perf_counter()
        self._call(job)
        self.stats.add_sync(time.perf_counter() - t0)
        self.publish(job)


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
        owner._work(*item)
        del owner
