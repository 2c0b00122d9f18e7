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
  store's ``keys["grad"]`` list is swapped at hand-off (a second gradient per parameter in
  the optimizer tier: 2 bytes with bf16 or fp16 compute until micro-batches accumulate, see
  [Note: compact gradients] in infinity/optim/compact_grads.py, else 4);
- the compute copies in the parameter tier: see

[Note: publishing by swapping keys].

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
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from infinity.errors import EngineError
from infinity.optim.background import BackgroundUpdate, UpdateWorkerError
from infinity.optim.flat_state import allocate_key
from infinity.optim.job import StepJob, UpdateStats


class DelayedUpdate(BackgroundUpdate):
    """The background worker of DPU and the second gradient and compute-copy buffers.

    Parameters are those of :class:`BackgroundUpdate`, and

    trainable:
        Indices of the groups with parameters in the optimizer that require grad at its construction
        (they get a second key; the optimizer refuses to step any other group with DPU).
    """

    def __init__(self, store, coordinator, run: Callable[[StepJob], None], threads: int, device,
                 trainable: set[int], stats: UpdateStats | None = None) -> None:
        super().__init__(store, coordinator, run, threads, device, stats)
        self._spare_grad_keys = self._grad_keys(store.grad_dtype)
        self.trainable = frozenset(trainable)
        self._spare_param_keys = {g.index: coordinator.shards.copy(g, tag=f"param-next:{g.name}")
                                  for g in coordinator.groups if g.index in trainable}
        store.before_widen = self._widen_spare
        store.on_wake.append(self._wake_spare)

    def refuse_untracked(self, with_grads: set[int], what: str) -> None:
        """Raise when a group with gradients (``with_grads``, indices) has no second compute copy: it was
        frozen when the optimizer was built, and the delay cannot step it."""
        late = set(with_grads) - self.trainable
        if late:
            names = sorted(self.coordinator.groups[gi].name for gi in late)
            raise EngineError(f"{what}: with dpu.enabled the parameters an optimizer steps are fixed at its "
                              f"construction, and group(s) {names} were frozen then; set requires_grad before "
                              "building the optimizer, or turn dpu.enabled off")

    def _grad_keys(self, dtype: torch.dtype) -> list[int | None]:
        """A set of zeroed gradient keys in ``dtype``, one per sub-group (None for a dormant one: see
        [Note: dormant sub-groups] in infinity/optim/flat_state.py)."""
        keys: list[int | None] = []
        try:
            for i in range(self.store.layout.num_subs):
                keys.append(None if i in self.store.dormant else self._grad_key(i, dtype))
        except BaseException:   # the disk full half-way: the keys made so far are given back
            self._free(keys)
            raise
        return keys

    def _grad_key(self, sub: int, dtype: torch.dtype) -> int:
        zeros = torch.zeros(self.store.layout.sub_ranges[sub][1], dtype=dtype)
        key = allocate_key(self.store, "grad", zeros.numel() * zeros.element_size(), f"grad-next:sub{sub}", sub)
        self.store.sub_tiers[sub].write(key, zeros).wait()
        return key

    def _free(self, keys) -> None:
        """Give back a set of gradient keys (each in its sub-group's tier, where ``allocate_key`` put it)."""
        for sub, key in enumerate(keys):
            if key is not None:
                self.store.sub_tiers[sub].free(key)

    def _wake_spare(self, sub: int):
        """A dormant sub-group gets its keys in the store: the spare set gets one too. Returns what
        gives it back (the store's wake failed)."""
        self._spare_grad_keys[sub] = self._grad_key(sub, self.store.grad_dtype)

        def undo() -> None:
            self.store.sub_tiers[sub].free(self._spare_grad_keys[sub])
            self._spare_grad_keys[sub] = None
        return undo

    def _widen_spare(self):
        """The store's gradient keys widen to fp32 (micro-batches accumulate): so does the spare set,
        once the running job, which reads it with the store's dtype, is done (see [Note: compact
        gradients] in infinity/optim/compact_grads.py). Its contents are a finished step's: not kept."""
        self.wait()
        dtype = self.store.grad_dtype
        old, self._spare_grad_keys = self._spare_grad_keys, self._grad_keys(torch.float32)
        self._free(old)

        def undo() -> None:     # the store's widening failed: the spare set goes back to its dtype
            wide, self._spare_grad_keys = self._spare_grad_keys, []
            self._free(wide)
            self._spare_grad_keys = self._grad_keys(dtype)
        return undo

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
            raise UpdateWorkerError(f"internal: gradient keys handed over while step {self._running.step} "
                                    "still reads the spare set")
        filled = self.store.swap_grad_keys(self._spare_grad_keys)
        self._spare_grad_keys = list(filled)
        self.store.zero_grad()
        return filled

    def reading_grads(self, keys) -> bool:
        """True when the running job reads the gradient ``keys`` (a backward must not write them)."""
        job = self._running
        held = [i for i, key in enumerate(keys) if key is not None]
        return job is not None and bool(held) and keys[held[0]] == job.grad_keys[held[0]]

    def ready(self, group) -> bool:
        """A delayed job writes keys nothing reads until it is published: every group is ready."""
        return True

    def publish(self, job: StepJob) -> None:
        """Make ``job``'s compute copies the parameters: swap each trainable group's key."""
        for g in self.coordinator.groups:
            new = job.param_keys[g.index]
            if new is not None and new != g.param_key:
                self._spare_param_keys[g.index] = self.coordinator.shards.publish(g, new)
        if self._unpublished is job:
            self._unpublished = None

    def run_inline(self, job: StepJob) -> None:
        """Run ``job`` on the calling thread (warm-up steps) and publish it."""
        t0 = time.perf_counter()
        self._call(job)
        self.stats.add_sync(time.perf_counter() - t0)
        self.publish(job)
