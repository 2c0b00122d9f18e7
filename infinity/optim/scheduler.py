"""Where and when each optimizer update runs: now, beside the next forward, or one step behind.

[Note: update modes]
Every update is one ``StepJob`` run by ``UpdatePass`` (see [Note: the update pass] in
infinity/optim/update.py). The scheduler decides where it runs:

- synchronously, inside ``opt.step()``, when the pass moves no NVMe bytes (states and
  parameters in memory) or ``dpu.overlap`` is off;
- overlapped (``dpu.overlap``, the default when the pass reads or writes NVMe, or when the
  states are in host memory and the compute runs on a GPU; DPU off): on the background
  worker, at exact semantics, each fetch of the next forward waiting only for its own group
  (see [Note: overlapped step] in infinity/optim/background.py);
- delayed (``dpu.enabled``): after ``dpu.warmup_steps`` synchronous updates, one step
  behind (see [Note: delayed parameter update] in infinity/optim/delayed.py).

After an update that rewrote stored shards, gathered copies (persistent groups too) are
stale: the scheduler drops them, so the next forward gathers the new values.

What the room may touch: the background workers, the state store's gradient keys, and
the coordinator's availability (``release_all``, the fresh-shard hand-off).
"""
from __future__ import annotations

import dataclasses
import time

from infinity.errors import EngineError
from infinity.optim import tier_split
from infinity.optim.background import BackgroundUpdate, damage
from infinity.optim.delayed import DelayedUpdate
from infinity.optim.job import StepJob, UpdateStats
from infinity.optim.update import UpdatePass


class UpdateScheduler:
    """Runs each ``StepJob`` in the mode the config asks for (see [Note: update modes]).

    Parameters
    ----------
    engine:
        The engine (its ``config``, ``store``, ``coordinator`` and ``device``).
    update:
        The update pass that runs every job.
    trainable:
        Indices of the groups with parameters in the optimizer (DPU gives them a second key).
    what:
        The optimizer's name, for messages.
    device_lane:
        With the optimizer states split over tiers, the pass over the device share, run inside ``opt.step()``
        before the rest ([Note: optimizer states over tiers] in infinity/optim/tier_split.py); else None.
    """

    def __init__(self, engine, update: UpdatePass, trainable: set[int], what: str,
                 device_lane: UpdatePass | None = None) -> None:
        dpu = engine.config.dpu
        self.store = engine.store
        self.coordinator = engine.coordinator
        self.update = update
        self.device_lane = device_lane
        # The update during backward ([Note: update during backward] in infinity/optim/in_backward.py), or None.
        self.in_backward = None
        self.what = what
        self.stats = UpdateStats()
        self.warmup_steps = dpu.warmup_steps
        # Held weakly by the workers (a bound method), so a worker never keeps the optimizer alive.
        run = update.run
        self.delay = (DelayedUpdate(self.store, self.coordinator, run, dpu.threads, engine.device, trainable,
                                    self.stats) if dpu.enabled else None)
        # With the CPU as compute device, a second full team of threads beside compute slows both
        # (see [Note: chunks and parallel regions] in infinity/optim/update.py); the overlapped
        # update mostly waits for NVMe.
        overlap_threads = dpu.threads or (0 if engine.device.is_cuda else 1)
        self.overlap = (BackgroundUpdate(self.store, self.coordinator, run, overlap_threads, engine.device,
                                         self.stats)
                        if self.overlap_wanted(engine) else None)
        self.background = self.delay or self.overlap
        update.progress = self.overlap
        self.damaged = damage(engine)
        for worker in (self.delay, self.overlap):
            if worker is not None:
                worker.on_failure = self.damaged

    @staticmethod
    def overlap_wanted(engine) -> bool:
        """Whether updates run overlapped with the next forward (see [Note: update modes]).

        With ``dpu.overlap`` and without DPU: when the pass reads or writes NVMe, or when the
        states are in host memory and the compute runs on a GPU (the host Adam then runs beside
        the GPU's forward). With the CPU as compute device and everything in memory, the update
        would only compete with the forward for the same cores.
        """
        dpu, tiers = engine.config.dpu, engine.config.tiers
        if not dpu.overlap or dpu.enabled:
            return False
        streamed = not engine.store.in_place or tiers.params == "nvme"
        return streamed or (engine.device.is_cuda and any(t.kind == "host" for t in engine.store.tiers))

    # -- the engine's lifecycle --------------------------------------------------------------------
    def before_forward(self) -> None:
        """A forward is starting: a failed background update is reported at once.

        Parameters are only published inside ``step()``/``synchronize()``, so there is nothing
        to swap here; an overlapped update is waited for group by group, by the fetches.
        """
        if self.background is not None:
            self.background.raise_if_failed()

    def before_grad(self) -> None:
        """A gradient is about to be accumulated: it must not land in keys a background update reads."""
        if self.delay is not None and self.delay.reading_grads(self.store.keys["grad"]):
            raise EngineError(f"{self.what}: a backward is accumulating into the gradient buffer that the "
                              "background step still reads (internal error: the buffers were not swapped)")
        if self.overlap is not None:
            # The overlapped update reads the gradient keys this backward is about to write. By now
            # the forward has waited for every group it used, so what is left is its last writes.
            # A failed one is reported here at the latest.
            self.overlap.wait()

    def wait_running(self, report: bool = True) -> None:
        """Wait for the running background update without publishing it: a DPU step's parameters become
        current at the ``opt.step()`` they would have anyway, so an observer (``infinity.trace``) changes no
        result. ``report``: raise a failed update's error (once, as ``opt.step()`` would), else leave it to
        be raised there."""
        if self.background is None:
            return
        if report:
            self.background.wait()
        else:
            self.background.wait_idle()

    def synchronize(self) -> None:
        """Wait for the running update; with DPU publish it (the delay restarts from there). Sub-groups the update
        during backward is stepping are waited for too; a failure of theirs is reported where the step is."""
        if self.in_backward is not None:
            self.in_backward.pending.wait()
        if self.delay is not None:
            self._publish(self.delay.wait())
        elif self.overlap is not None:
            self.overlap.wait()

    # -- one step ------------------------------------------------------------------------------------
    def refuse_half_step(self, what: str) -> None:
        """A save between a backward and ``opt.step()`` after the update during backward stepped sub-groups would
        keep half a step (resumed, they would be stepped twice): refused, saying how to go on."""
        stepped = self.in_backward.stepped if self.in_backward is not None else ()
        if stepped:
            raise EngineError(f"{what}: {len(stepped)} sub-groups of this step were already stepped during backward "
                              "(optimizer.update_in_backward = true), the rest not: call opt.step() first")

    def begin_step(self) -> None:
        """``opt.step()`` starts: report a failed delayed update; wait for an overlapped one."""
        if self.delay is not None:
            self.delay.raise_if_failed()
        if self.overlap is not None:
            self.overlap.wait()   # the previous update (the forward has usually waited for it already)

    def delays(self, step_count: int) -> bool:
        """Whether the update after ``step_count`` updates runs one step behind (DPU past warm-up)."""
        return self.delay is not None and step_count >= self.warmup_steps

    @property
    def overlaps(self) -> bool:
        return self.overlap is not None

    def publish_finished(self) -> None:
        """DPU: wait for the running update and make its parameters current."""
        if self.delay is not None:
            self._publish(self.delay.wait())

    def grad_keys(self, delayed: bool) -> tuple[int, ...]:
        """The gradient keys the next job reads (DPU hands over the filled set and swaps)."""
        return self.delay.hand_over_grads() if delayed else tuple(self.store.keys["grad"])

    def param_keys(self, updated: frozenset[int]) -> tuple[int | None, ...]:
        """Per group, the key the next job writes its compute copy into (DPU: the unpublished one)."""
        if self.delay is not None:
            return self.delay.target_param_keys(updated)
        return self.coordinator.shards.keys(self.coordinator.groups, updated)

    def run(self, job: StepJob, continues: bool = False) -> None:
        """Run ``job`` in its mode (see [Note: update modes]).

        ``continues``: the job finishes an update begun during backward (sub-groups stepped there), whose
        fresh shards are kept (see [Note: fresh shards] in infinity/prefetch/fresh_shards.py).
        """
        if not (job.delayed or continues):
            self.coordinator.shards.reset_fresh()
        if self.device_lane is not None:
            job = self._run_device_share(job)
        if job.delayed:
            self.delay.submit(job)
        elif self.overlap is not None:
            self._after_update()   # gathered copies are stale from here on; fetches wait per group
            self.overlap.submit(job)
        elif self.delay is not None:
            self.delay.run_inline(job)
            self._after_update()
        else:
            t0 = time.perf_counter()
            self.update.run(job)
            self.stats.add_sync(time.perf_counter() - t0)
            self._after_update(synchronous=True)

    def _run_device_share(self, job: StepJob) -> StepJob:
        """Step the device share's groups now, on the compute stream, and return the job over the rest (see
        [Note: optimizer states over tiers] in infinity/optim/tier_split.py): the next forward needs them
        first, and their update is the device's fast one."""
        on_device = frozenset(g for g in job.updated if tier_split.group_tier(self.store, g).kind == "device")
        if on_device:
            t0 = time.perf_counter()
            self.device_lane.run(dataclasses.replace(job, updated=on_device, overlapped=False, offer_fresh=False))
            self.stats.add_device_share(time.perf_counter() - t0)
        return dataclasses.replace(job, updated=job.updated - on_device)

    def set_ranges(self, ranges) -> None:
        """Which elements the updates change, from now on (``add_param_group``): every lane's."""
        for lane in (self.update, self.device_lane):
            if lane is not None:
                lane.ranges = ranges

    def after_load(self) -> None:
        """States were loaded: gathered copies are stale."""
        self._after_update()

    def _publish(self, job: StepJob | None) -> None:
        if job is not None:
            self.delay.publish(job)
            self._after_update()

    def _after_update(self, synchronous: bool = False) -> None:
        """Gathered copies (persistent groups too) are stale after an update: drop them.

        Except, after a ``synchronous`` update, groups gathered in place (one rank, shards in the
        compute device's memory): each is its stored shard, which the update rewrote and whose
        writes it waited for, so nothing is stale; gathering all of them again before every
        forward cost host time per group for nothing (the ``device`` preset, every step).
        """
        self.coordinator.release_all(include_persistent=not (synchronous and self.coordinator.in_place))

    def as_dict(self) -> dict:
        """Update counts and times, the mode, and whether a delayed update is unpublished."""
        out = self.stats.as_dict()
        out.update(dpu=self.delay is not None, overlap=self.overlap is not None,
                   pending=int(self.delay is not None and self.delay.pending),
                   worker_threads=self.background.worker_threads if self.background is not None else None)
        return out
