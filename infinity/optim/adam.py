"""Adam and AdamW over each rank's fp32 master shard, on the host, states in their tier.

[Note: host Adam kernel]
The update runs torch's fused CPU Adam/AdamW kernel (``torch._fused_adamw_``) on
the flat fp32 sub-groups, one tensor per run of trainable groups (usually one per
sub-group). On these machines it streams the 28 bytes a parameter needs (read
master, grad, m, v; write master, m, v) at memory speed: 100M parameters, 2 threads,
1.74 G params/s, as fast as DeepSpeed's CPUAdam (1.57) and above a STREAM-triad bound
(1.22); the foreach path is 12x slower (benchmarks/adam.py). The engine's step also
writes each compute copy (4 bytes, plus the line's write-allocate read), which costs
it about half that rate when synchronous; with DPU it is off the critical path. The
kernel's math is ``torch.optim.AdamW``'s, so results match plain PyTorch to rounding.
Gradient clipping is folded into the kernel's ``grad_scale`` (it divides by
``1 / clip_coef``), which saves a pass over the gradients and differs from a separate
multiplication by at most one rounding. The kernel releases the GIL, so a background
step (DPU) runs beside compute.

[Note: the update pass]
Every update, synchronous or delayed, is one :class:`infinity.optim.background.StepJob` run by
``_apply``: one pass over the sub-groups that reads master, gradient and moments,
runs the kernel, writes them back and writes each trainable group's new compute
copy into the parameter tier. On the host tier the states are updated in place; on
NVMe two sets of sub-group buffers pipeline the pass (sub-group i+1 is read while i
is stepped and i-1 written back). The job carries every key it touches (the
gradient keys and the compute-copy keys may be the second buffers of DPU), so the
pass never reads state the main thread may be changing. See [Note: delayed
parameter update] in dpu.py for when jobs run and are published.

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
sub-group holding it was stepped and those writes landed (``update_gate``); reads ahead
skip a group not ready yet and try again at the next walk, so the compute thread only
ever waits for the group it needs now. Each fetch sees the new values, so results equal
the synchronous step's bit for bit (tests/unit/test_overlap_step.py). The first gradient
of the next backward waits for the job to end (it reads the gradient keys that backward
accumulates into); so do ``synchronize()`` and everything that calls it (``state_dict``,
``gathered``, checkpoints), and the next ``step()``. With NVMe parameters the forward
takes most groups from host memory, not from the disk: see [Note: fresh shards] in
fresh_shards.py.

[Note: parameters without a gradient]
As in ``torch.optim``, a parameter whose gradient did not arrive since the last
``zero_grad`` (on any rank: the flags travel with the non-finite check's all-reduce) is
left alone: no weight decay, its moments and step count unchanged. Each parameter keeps
its own step count for Adam's bias correction as torch's ``state["step"]`` does; they
are stored as a lag behind the optimizer's ``step_count`` (``_lag``, parameters with lag
0 not listed), saved in ``state_dict`` and checkpoints as ``param_steps`` by name. When
every trainable parameter of the changed groups has a gradient and no lag, the job is
the usual one (whole groups, padding included, one step); otherwise it carries its
ranges (``StepJob.runs``), one per parameter shard, merged where their steps agree.

[Note: skipped steps]
When any rank saw a non-finite gradient (``GradReducer.nonfinite``, e.g. an fp16
overflow), ``step()`` skips the update as ``torch.cuda.amp.GradScaler`` does: the
step count does not advance, the gradient is dropped, ``skipped_steps`` counts it and
a ``RuntimeWarning`` names the step. With DPU the update still pending from the
previous step is published as usual.
"""
from __future__ import annotations

import math
import time
import warnings

import torch
from torch import nn

from infinity import registry
from infinity.optim.background import BackgroundUpdate, DelayedUpdate, DpuStats, StepJob
from infinity.prefetch.fresh_shards import FreshShards
from infinity.errors import EngineError

_MOMENTS = ("exp_avg", "exp_avg_sq")
# See [Note: chunks and parallel regions]. A multiple of ALIGN_NUMEL, so every compute-copy
# write starts on a 4096-byte block: the NVMe tier writes a partial block by read-modify-write,
# and two such writes in flight to one block would race.
_CHUNK_NUMEL = 4 << 20
_WHOLE = 1 << 62
_STATES = ("master", "exp_avg", "exp_avg_sq", "grad")


class _OffloadAdam(torch.optim.Optimizer):
    """Adam-family optimizer over the sharded states of a model built in ``infinity.Init``."""

    _decoupled = True
    _name = "infinity.AdamW"

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        engine = registry.engine_of(model, self._name)
        if engine.optimizer is not None:
            raise EngineError(f"{self._name}: this model already has an infinity optimizer; create one per model")
        if not 0.0 <= lr:
            raise ValueError(f"{self._name}: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{self._name}: betas must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"{self._name}: eps must be > 0, got {eps}")
        for name, p in model.named_parameters():
            if p not in engine.coordinator.group_of:
                raise EngineError(
                    f"{self._name}: parameter {name!r} of {type(model).__name__} is not managed by infinity "
                    "(added after infinity.Init exited?), so it would never be updated; build the whole "
                    "model inside infinity.Init")
        params = [s.param for g in engine.coordinator.groups for s in g.slots if s.param.requires_grad]
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.engine = engine
        self.store = engine.store
        self.step_count = 0
        self.skipped_steps = 0
        self._calls = 0
        self._clip_coef: float | None = None
        self._trainable, self._ranges = self._trainable_ranges(params)
        # See [Note: parameters without a gradient].
        chosen = {id(p) for p in params}
        self._param_slots = [(g, s) for g in engine.coordinator.groups for s in g.slots if id(s.param) in chosen]
        self._lag: dict[int, int] = {}
        self._param_names = {}
        for name, p in model.named_parameters():
            self._param_names.setdefault(id(p), name)
        self._stream_buffers: list[dict[str, torch.Tensor]] | None = None
        self._stats = DpuStats()
        dpu = engine.config.dpu
        self._warmup_steps = dpu.warmup_steps
        self._delay = (DelayedUpdate(self.store, engine.coordinator, self._apply, dpu.threads, engine.device,
                                     self._trainable, self._stats) if dpu.enabled else None)
        streamed = not self.store.in_place or engine.config.tiers.params == "nvme"
        # With the CPU as compute device, a second full team of threads beside compute slows both
        # (see [Note: chunks and parallel regions]); the overlapped update mostly waits for NVMe.
        overlap_threads = dpu.threads or (0 if engine.device.is_cuda else 1)
        self._overlap = (BackgroundUpdate(self.store, engine.coordinator, self._apply, overlap_threads,
                                          engine.device, self._stats)
                         if dpu.overlap and streamed and not dpu.enabled else None)
        self._background = self._delay or self._overlap
        engine.coordinator.update_gate = self._overlap
        arena = getattr(engine.prefetcher, "arena", None)
        if self._overlap is not None and arena is not None:
            engine.coordinator.fresh = FreshShards(arena)
        engine.optimizer = self

    # -- hooks the engine calls --------------------------------------------------------------
    def _before_forward(self) -> None:
        """A forward is starting. Parameters are only published inside step()/synchronize(),
        so there is nothing to swap here; a failed background step is reported at once.
        (An overlapped step is waited for group by group, by the coordinator's fetches.)"""
        if self._background is not None:
            self._background.raise_if_failed()

    def _before_grad(self) -> None:
        """A gradient is about to be accumulated: it must not land in keys a background step reads."""
        if self._delay is not None and self._delay.reading_grads(self.store.keys["grad"]):
            raise EngineError(f"{self._name}: a backward is accumulating into the gradient buffer that the "
                              "background step still reads (internal error: the buffers were not swapped)")
        if self._overlap is not None:
            # The overlapped step reads the gradient keys this backward is about to write. By now
            # the forward has waited for every group it used, so what is left is its last writes.
            # A failed one is reported here at the latest.
            self._overlap.wait()

    def synchronize(self) -> None:
        """Wait until every parameter and state reflects all steps taken so far.

        With DPU this waits for the background step and publishes it, so the next
        forward uses the newest parameters (the delay restarts from there). With the
        overlapped step (``dpu.overlap``) it waits for the update to finish.
        """
        if self._delay is not None:
            self._publish(self._delay.wait())
        elif self._overlap is not None:
            self._overlap.wait()

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Apply one Adam(W) update from the accumulated gradients (delayed by one step with DPU)."""
        if closure is not None:
            raise EngineError(f"{self._name}.step: closures are not supported with offloaded states")
        engine = self.engine
        engine.recover_aborted_backward()
        if engine.reducer.pending() or engine._backward_active:
            raise EngineError(f"{self._name}.step() called while a backward pass is still running")
        if not self.store.has_grad:
            raise EngineError(f"{self._name}.step() called before backward(): there are no gradients "
                              "to apply (call loss.backward() first)")
        self._calls += 1
        if self._delay is not None:
            self._delay.raise_if_failed()
        if self._overlap is not None:
            self._overlap.wait()   # the previous update (the forward has usually waited for it already)
        nonfinite, with_grad = self._exchange_flags()
        if nonfinite:
            self._skip()
            return None
        delayed = self._delay is not None and self.step_count >= self._warmup_steps
        if delayed:
            self._publish(self._delay.wait())
        self.step_count += 1
        job = self._job(delayed, with_grad)
        self._clip_coef = None
        if delayed:
            self._delay.submit(job)
        elif self._overlap is not None:
            self._after_update()   # gathered copies are stale from here on; fetches wait per group
            if self.engine.coordinator.fresh is not None:
                self.engine.coordinator.fresh.reset()
            self._overlap.submit(job)
        elif self._delay is not None:
            self._delay.run_inline(job)
            self._after_update()
        else:
            t0 = time.perf_counter()
            self._apply(job)
            self._stats.add_sync(time.perf_counter() - t0)
            self._after_update()
        return None

    def _job(self, delayed: bool, with_grad: set[int]) -> StepJob:
        hp = self.param_groups[0]
        self.store.flush()  # gradient writes the backward issued to the tier must land before the pass reads
        updated = frozenset(self._trainable & self.store.grad_written)
        for _, slot in self._param_slots:
            if id(slot.param) not in with_grad:
                self._lag[id(slot.param)] = self._lag.get(id(slot.param), 0) + 1
        runs = self._param_runs(updated, with_grad) if self._lag else None
        if delayed:
            grad_keys = self._delay.hand_over_grads()
        else:
            grad_keys = tuple(self.store.keys["grad"])
        if self._delay is not None:
            param_keys = self._delay.target_param_keys(updated)
        else:
            param_keys = tuple(g.param_key if g.index in updated else None for g in self.engine.coordinator.groups)
        return StepJob(step=self.step_count, call=self._calls, lr=float(hp["lr"]), beta1=float(hp["betas"][0]),
                       beta2=float(hp["betas"][1]), eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]),
                       decoupled=self._decoupled, clip_coef=self._clip_coef, grad_keys=grad_keys,
                       updated=updated, param_keys=param_keys, delayed=delayed,
                       overlapped=not delayed and self._overlap is not None, runs=runs)

    def _exchange_flags(self) -> tuple[bool, set[int]]:
        """Whether any rank's gradient of this step has an inf/NaN (the flag is consumed), and the
        ids of the trainable parameters whose gradient arrived on any rank: one all-reduce."""
        reducer = self.engine.reducer
        local = self.store.param_grads
        flags = torch.tensor([1.0 if reducer.nonfinite else 0.0]
                             + [1.0 if id(s.param) in local else 0.0 for _, s in self._param_slots])
        self.engine.ranks.all_reduce_max(flags)
        reducer.nonfinite = False
        had = flags[1:].tolist()
        return bool(flags[0].item()), {id(s.param) for (_, s), f in zip(self._param_slots, had) if f}

    def _param_runs(self, updated: frozenset[int], with_grad: set[int]) -> tuple:
        """Per sub-group, ``(offset, numel, step)`` of each updated parameter's shard on this rank
        (see [Note: parameters without a gradient])."""
        layout = self.store.layout
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(layout.num_subs)]
        for g, slot in self._param_slots:
            pid = id(slot.param)
            if g.index not in updated or pid not in with_grad:
                continue
            step = self.step_count - self._lag.get(pid, 0)
            start = g.rank * g.shard_numel
            a, b = max(slot.offset, start) - start, min(slot.offset + slot.numel, start + g.shard_numel) - start
            for piece in layout.pieces_of_group[g.index]:
                lo, hi = max(a, piece.group_offset), min(b, piece.group_offset + piece.numel)
                if lo < hi:
                    runs[piece.sub_index].append((piece.sub_offset + lo - piece.group_offset, hi - lo, step))
        merged = []
        for sub_runs in runs:
            out: list[tuple[int, int, int]] = []
            for offset, numel, step in sorted(sub_runs):
                if out and out[-1][0] + out[-1][1] == offset and out[-1][2] == step:
                    out[-1] = (out[-1][0], out[-1][1] + numel, step)
                else:
                    out.append((offset, numel, step))
            merged.append(out)
        return tuple(merged)

    def param_steps(self) -> dict[str, int]:
        """Adam step counts of the parameters that lag behind ``step_count`` (missed updates), by name."""
        return {self._param_names.get(pid, str(pid)): self.step_count - lag for pid, lag in self._lag.items()}

    def load_param_steps(self, steps: dict[str, int], where: str = "state") -> None:
        """Restore :meth:`param_steps` (after ``step_count``); unknown names are an error."""
        by_name = {name: pid for pid, name in self._param_names.items()}
        unknown = sorted(set(steps) - set(by_name))
        if unknown:
            raise EngineError(f"{self._name}: the {where} has step counts for parameters this model does not "
                              f"have: {unknown[:5]}")
        self._lag = {by_name[name]: self.step_count - int(step) for name, step in steps.items()
                     if self.step_count != int(step)}

    def _skip(self) -> None:
        """See [Note: skipped steps]."""
        self.skipped_steps += 1
        self._stats.skipped_steps += 1
        if self._delay is not None:
            self._publish(self._delay.wait())
        self.store.zero_grad()
        self._clip_coef = None
        warnings.warn(f"{self._name}: opt.step() call {self._calls} found a non-finite gradient (inf/NaN, e.g. an "
                      f"fp16 overflow) and skipped its update ({self.skipped_steps} skipped so far)",
                      RuntimeWarning, stacklevel=3)

    def _publish(self, job: StepJob | None) -> None:
        if job is not None:
            self._delay.publish(job)
            self._after_update()

    def _after_update(self) -> None:
        """Gathered copies (persistent groups too) are stale after an update: drop them."""
        self.engine.coordinator.release_all(include_persistent=True)

    # -- the update pass (see [Note: the update pass]) ----------------------------------------
    def _trainable_ranges(self, params) -> tuple[set[int], list[list[tuple[int, int, int]]]]:
        """The groups with parameters in the optimizer, and per sub-group their (group, offset, numel) ranges.

        A group whose parameters all require gradients is one range, padding included
        (padding stays exactly zero under Adam), so the kernel sees long runs.
        Parameters frozen before the optimizer was built are left out, as in ``torch.optim``.
        """
        chosen = {id(p) for p in params}
        layout = self.store.layout
        trainable: set[int] = set()
        ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(layout.num_subs)]
        for g in self.engine.coordinator.groups:
            mine = [s for s in g.slots if id(s.param) in chosen]
            if not mine:
                continue
            trainable.add(g.index)
            if len(mine) == len(g.slots):
                spans = [(0, g.shard_numel)]
            else:
                start = g.rank * g.shard_numel
                spans = [(max(s.offset, start) - start, min(s.offset + s.numel, start + g.shard_numel)
                          - max(s.offset, start)) for s in mine]
            for piece in layout.pieces_of_group[g.index]:
                for offset, numel in spans:
                    a = max(offset, piece.group_offset)
                    b = min(offset + numel, piece.group_offset + piece.numel)
                    if a < b:
                        ranges[piece.sub_index].append((g.index, piece.sub_offset + a - piece.group_offset, b - a))
        return trainable, ranges

    def _runs(self, sub: int, updated: frozenset[int]) -> list[tuple[int, int]]:
        """The (offset, numel) ranges of ``sub`` whose elements ``updated`` changes, adjacent ones merged."""
        return _merge((offset, numel) for gi, offset, numel in self._ranges[sub] if gi in updated)

    def _spans(self, sub: int, updated: frozenset[int]) -> list[tuple[int, int]]:
        """The ranges of ``sub`` holding ``updated`` groups' shards: their compute copies are rewritten whole."""
        return _merge((p.sub_offset, p.numel) for p in self.store.layout.pieces_of_sub[sub]
                      if p.group_index in updated)

    def _apply(self, job: StepJob) -> None:
        """Run one update: Adam over the changed ranges, and the changed groups' new compute copies.

        On a single-threaded run the work goes in chunks (see [Note: chunks and parallel
        regions]): the kernel on a chunk, then that chunk's compute copies while it is in cache.
        """
        kernel = torch._fused_adamw_ if job.decoupled else torch._fused_adam_
        # The kernel reads the step and the scale where the states are (a device optimizer tier).
        device = self.store.tier.device if self.store.in_place and hasattr(self.store.tier, "device") else "cpu"
        step_ts: dict[int, torch.Tensor] = {}

        def step_t(step: int) -> torch.Tensor:
            if step not in step_ts:
                step_ts[step] = torch.tensor(float(step), device=device)
            return step_ts[step]

        grad_scale = None if job.clip_coef is None else torch.tensor(1.0 / job.clip_coef, device=device)
        hyper = dict(amsgrad=False, lr=job.lr, beta1=job.beta1, beta2=job.beta2, weight_decay=job.weight_decay,
                     eps=job.eps, maximize=False, grad_scale=grad_scale, found_inf=None)
        layout = self.store.layout
        runs = job.runs or [[(o, n, job.step) for o, n in self._runs(sub, job.updated)]
                            for sub in range(layout.num_subs)]
        spans = [self._spans(sub, job.updated) for sub in range(layout.num_subs)]
        if self.store.in_place:
            passes = self._in_place_pass(job, [sub for sub, r in enumerate(spans) if r])
        else:
            passes = self._streamed_pass(job, spans)
        chunk = _chunk_numel()
        copies: list = []
        try:
            for sub, st, writes in passes:
                states = (st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"])
                for start, numel in spans[sub]:
                    for c0 in range(start, start + numel, chunk):
                        c1 = min(c0 + chunk, start + numel)
                        parts = [(max(o, c0), min(o + n, c1), k) for o, n, k in runs[sub]
                                 if o < c1 and o + n > c0]
                        if parts:
                            kernel(*[[t[a:b] for a, b, _ in parts] for t in states], [],
                                   [step_t(k) for _, _, k in parts], **hyper)
                        self._write_compute_copies(job, sub, st["master"], c0, c1, copies)
                if job.overlapped:
                    # The next forward may fetch this sub-group's groups once their copies have landed.
                    if self.engine.device.is_cuda:   # a device tier's copies ran on this worker's stream
                        torch.cuda.current_stream(self.engine.device.device).synchronize()
                    self._overlap.sub_done(sub, [fut for fut, _ in copies])
                writes.extend(copies)
                copies = []
        except BaseException:
            # Wait for what this sub-group issued, then let the pass wait for the rest (its
            # except clause), before the error travels on: no transfer outlives a failed update.
            _drain([fut for fut, _ in copies])
            passes.close()
            raise

    def _write_compute_copies(self, job: StepJob, sub: int, master: torch.Tensor, c0: int, c1: int,
                              writes: list) -> None:
        """Write elements [c0, c1) of ``sub``'s master weights into the job's compute-copy keys."""
        coordinator = self.engine.coordinator
        for piece in self.store.layout.pieces_of_sub[sub]:
            key = job.param_keys[piece.group_index]
            a, b = max(piece.sub_offset, c0), min(piece.sub_offset + piece.numel, c1)
            if key is None or a >= b:
                continue
            values = master[a:b].to(coordinator.dtype)
            offset = (piece.group_offset + a - piece.sub_offset) * values.element_size()
            fut = coordinator.param_tier.write(key, values, offset=offset)
            if job.overlapped and coordinator.fresh is not None:
                coordinator.fresh.offer(coordinator.groups[piece.group_index], piece.group_offset + a - piece.sub_offset,
                                        values)
            if not fut.done():
                writes.append((fut, values))

    def _in_place_pass(self, job: StepJob, subs: list[int]):
        """Host tier: yield the stored states themselves; compute-copy writes are waited at the end."""
        store, writes = self.store, []
        try:
            for sub in subs:
                st = {s: store.view(s, sub) for s in ("master", *_MOMENTS)}
                st["grad"] = store.tier.view(job.grad_keys[sub]).view(torch.float32)
                yield sub, st, writes
        except BaseException:
            _drain([f for f, _ in writes])   # as in _streamed_pass
            raise
        for fut, _ in writes:
            fut.wait()

    def _streamed_pass(self, job: StepJob, spans: list[list[tuple[int, int]]]):
        """NVMe tier: two buffer sets, the next sub-group read while this one is stepped.

        Sub-groups the update does not change are not read or written, except in the first
        pass, which writes every sub-group's (zero) moments so that their keys hold data.
        """
        store, tier = self.store, self.store.tier
        layout = store.layout
        bufs = self._buffers()
        moments_known = store.moments_initialized
        subs = [sub for sub, r in enumerate(spans) if r or not moments_known]
        reads: list[list] = [[], []]
        writes: list[list] = [[], []]

        def key(state: str, sub: int) -> int:
            return job.grad_keys[sub] if state == "grad" else store.keys[state][sub]

        def issue_reads(i: int) -> None:
            sub, slot = subs[i], i % 2
            for fut, _ in writes[slot]:
                fut.wait()
            writes[slot] = []
            numel = layout.sub_ranges[sub][1]
            reads[slot] = []
            for s in _STATES:
                buf = bufs[slot][s][:numel]
                if s in _MOMENTS and not moments_known:
                    buf.zero_()
                elif s == "grad" and not spans[sub]:
                    continue
                else:
                    reads[slot].append(tier.read(key(s, sub), buf))

        try:
            if subs:
                issue_reads(0)
            for i, sub in enumerate(subs):
                slot = i % 2
                for fut in reads[slot]:
                    fut.wait()
                if i + 1 < len(subs):
                    issue_reads(i + 1)
                numel = layout.sub_ranges[sub][1]
                st = {s: bufs[slot][s][:numel] for s in _STATES}
                yield sub, st, writes[slot]
                for s in ("master", *_MOMENTS):
                    writes[slot].append((tier.write(store.keys[s][sub], st[s]), st[s]))
        except BaseException:
            # A failed pass still waits for every transfer it issued, so none outlives it (into
            # buffers or keys the next pass, a fetch or a checkpoint load uses); its error wins.
            _drain([f for slot in reads for f in slot] + [f for slot in writes for f, _ in slot])
            raise
        for slot in range(2):
            for fut, _ in writes[slot]:
                fut.wait()
        store.moments_initialized = True

    def _buffers(self) -> list[dict[str, torch.Tensor]]:
        """Two sets of sub-group buffers for the streamed pass.

        The store already holds two such sets for its own ``iterate``, which nothing else runs
        while an update is in flight, so they are borrowed rather than pinning a second set.
        """
        if self._stream_buffers is None:
            borrowed = getattr(self.store, "_buffers", None)
            if borrowed is not None and all(set(b) >= set(_STATES) for b in borrowed):
                self._stream_buffers = borrowed
            else:
                n = self.store.layout.sub_group_size
                alloc = self.engine.tiers.allocator
                self._stream_buffers = [{s: alloc.empty(n * 4).view(torch.float32) for s in _STATES}
                                        for _ in range(2)]
        return self._stream_buffers

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradient shards (the parameters' ``.grad`` are always None).

        Does not wait for a background step: that step reads its own gradient buffer.
        """
        self.engine.recover_aborted_backward()
        self.store.zero_grad()
        self.engine.reducer.nonfinite = False
        self._clip_coef = None

    # -- gradient clipping -------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients by their global L2 norm (applied by the step, DPU included)."""
        norm_sq = torch.tensor([self.store.grad_norm_sq()], dtype=torch.float64)
        self.engine.ranks.all_reduce_sum(norm_sq)
        total = math.sqrt(float(norm_sq))
        coef = max_norm / (total + 1e-6)
        self._clip_coef = coef if coef < 1.0 else None
        return torch.tensor(total)

    # -- telemetry and state -------------------------------------------------------------------
    def stats(self) -> dict:
        """Step counts and optimizer time: total, exposed to compute, and the fraction hidden by DPU
        or by the overlapped step (whose exposed time is what fetches and ``step()`` waited for it).

        ``pending`` is 1 while a delayed (DPU) step has not been published.
        """
        out = self._stats.as_dict()
        out.update(steps=self.step_count, calls=self._calls, dpu=self._delay is not None,
                   overlap=self._overlap is not None,
                   pending=int(self._delay is not None and self._delay.pending),
                   worker_threads=self._background.worker_threads if self._background is not None else None)
        return out

    def state_dict(self) -> dict:
        """This rank's optimizer state: hyper-parameters, step, and fp32 shards per group.

        For large models use ``infinity.save_checkpoint``, which streams the shards to
        files instead of holding them in memory.
        """
        self.synchronize()
        groups = self.engine.coordinator.groups
        shards = {s: [self.store.read_state_shard(s, g.index) for g in groups]
                  for s in ("master", "exp_avg", "exp_avg_sq")}
        hp = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"param_groups": [hp], "step": self.step_count, "skipped_steps": self.skipped_steps,
                "param_steps": self.param_steps(),
                "rank": self.engine.ranks.rank, "world_size": self.engine.ranks.world_size,
                "shard_numels": [g.shard_numel for g in groups], "shards": shards}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = self.engine.coordinator.groups
        got = state_dict.get("shard_numels")
        want = [g.shard_numel for g in groups]
        if got != want or state_dict.get("world_size") != self.engine.ranks.world_size:
            differ = ""
            if got is not None and len(got) == len(want) and got != want:
                i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                differ = (f"; group {i} ({groups[i].name!r}) has {want[i]} elements per shard here, "
                          f"{got[i]} in the state")
            raise EngineError(
                f"{self._name}.load_state_dict: the state was saved with world size "
                f"{state_dict.get('world_size')} and {len(got or [])} groups; this model has world size "
                f"{self.engine.ranks.world_size} and {len(want)} groups{differ} "
                "(use infinity.load_checkpoint to reshard)")
        self.synchronize()
        for hp_key, value in state_dict["param_groups"][0].items():
            self.param_groups[0][hp_key] = value
        self.step_count = int(state_dict["step"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.load_param_steps(state_dict.get("param_steps", {}), "state dict")
        for s, shards in state_dict["shards"].items():
            for g, shard in zip(groups, shards):
                self.store.write_state_shard(s, g.index, shard)
        self._refresh_compute_copies()

    def _refresh_compute_copies(self) -> None:
        coordinator = self.engine.coordinator
        for g in coordinator.groups:
            master = self.store.read_state_shard("master", g.index)
            coordinator.write_shard(g, master).wait()
        self._after_update()


class AdamW(_OffloadAdam):
    """AdamW (decoupled weight decay) over a model built in ``infinity.Init``.

    With ``dpu.enabled`` in the config, updates after ``dpu.warmup_steps`` run in the
    background, one step behind (see ``infinity.optim.background``); ``synchronize()`` waits for them.

    Parameters
    ----------
    model:
        The model built inside ``infinity.Init``.
    lr, betas, eps, weight_decay:
        As in ``torch.optim.AdamW``.

    Examples
    --------
    >>> opt = infinity.AdamW(model, lr=3e-4, weight_decay=0.1)   # doctest: +SKIP
    >>> loss.backward(); opt.step(); opt.zero_grad()              # doctest: +SKIP
    """

    _decoupled = True
    _name = "infinity.AdamW"

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(model, lr, betas, eps, weight_decay)


class Adam(_OffloadAdam):
    """Adam (L2 weight decay added to the gradient) over a model built in ``infinity.Init``.

    Parameters are as in ``torch.optim.Adam``; see :class:`AdamW`.
    """

    _decoupled = False
    _name = "infinity.Adam"


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global L2 norm; returns the norm.

    Like ``torch.nn.utils.clip_grad_norm_``: call after ``backward()`` and before
    ``opt.step()``. The scaling is applied to the fp32 gradient shards as the step
    reads them; with DPU it belongs to the step handed over next.
    """
    engine = registry.engine_of(model, "infinity.clip_grad_norm_")
    if engine.optimizer is None:
        raise EngineError("infinity.clip_grad_norm_: create the infinity optimizer for this model first")
    return engine.optimizer.clip_grad_norm_(max_norm)


def _chunk_numel() -> int:
    """Elements per chunk of the update pass on the calling thread.

    [Note: chunks and parallel regions]
    Writing a chunk's compute copy right after the kernel stepped it, while the chunk
    (4Mi elements: 16 MiB of fp32, 8 MiB as bf16) is still in the 32 MiB L3, halves the
    cost of the bf16/fp16 conversion on one thread (64Mi parameters: 51 vs 109 ms; fp32
    copies gain nothing, 46 vs 46 ms). But every torch kernel call on several threads is
    an OpenMP parallel region ending in a barrier, and when the cores are oversubscribed
    (compute beside the DPU worker, or other processes) each barrier waits for a
    descheduled thread: on 2 threads at load 5-7, 4Mi chunks took 254 ms where whole
    sub-groups took 54 ms (fp32; bf16 384 vs 124 ms). So chunks are used only when the
    calling thread's team is one thread, as the DPU worker's is with ``dpu.threads = 1``.
    """
    return _CHUNK_NUMEL if torch.get_num_threads() == 1 else _WHOLE


def _drain(futures) -> None:
    """Wait for every future, ignoring their errors (a failure is being raised already)."""
    for fut in futures:
        try:
            fut.wait()
        except BaseException:   # noqa: BLE001 - the error being raised matters more
            pass


def _merge(ranges) -> list[tuple[int, int]]:
    """(offset, numel) ranges in increasing order, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for offset, numel in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + numel)
        else:
            out.append((offset, numel))
    return out
