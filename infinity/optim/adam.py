"""``infinity.AdamW`` and ``infinity.Adam``: the ``torch.optim`` face of the host optimizer.

The front checks what the user asked (``step``, ``zero_grad``, ``clip_grad_norm_``,
``state_dict``), fixes one :class:`~infinity.optim.job.StepJob` per step and hands it to
the :class:`~infinity.optim.scheduler.UpdateScheduler`. Its parts, each in its own
module of this room: the gradient checks (``checks``), the ranges an update changes
and each parameter's step count (``ranges``), the update pass (``update``), where it
runs (``scheduler``). See the notes there: [Note: host Adam kernel], [Note: the update
pass], [Note: update modes], [Note: parameters without a gradient], [Note: skipped steps].
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from infinity import registry
from infinity.errors import EngineError, released_message
from infinity.optim import param_groups, torch_state
from infinity.optim.checks import GradientChecks, meet_accelerate_prepare, refuse_trainer_checkpoints
from infinity.optim.in_backward import InBackwardUpdate
from infinity.optim.job import StepJob
from infinity.optim.nonfinite import NonFiniteSteps
from infinity.optim.ranges import ParamSteps, UpdateRanges
from infinity.optim.relayout import relayout_frozen, warn_frozen_in_part
from infinity.optim.scheduler import UpdateScheduler
from infinity.optim.shard_states import ShardStates
from infinity.optim.unmanaged import UnmanagedAdam
from infinity.optim.update import update_lanes
from infinity.runtime.ranks import RanksFailedError


class _Released:
    """Stands in for the parts of a released engine: any attribute read raises, naming infinity.release."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str):
        raise EngineError(released_message(self._what))


class _OffloadAdam(torch.optim.Optimizer):
    """Adam-family optimizer over the sharded states of a model built in ``infinity.Init``."""

    _decoupled = True
    _name = "infinity.AdamW"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        engine, groups = param_groups.resolve(params, self._name)
        if engine.optimizer is not None:
            raise EngineError(f"{self._name}: this model already has an infinity optimizer, whose states are the "
                              "engine's (one set per model): go on with it, opt.add_param_group(...) adding the "
                              "parameters to train from now on (after peft's merge_and_unload, set_adapter or "
                              "add_adapter too); infinity.release(model) lets both go")
        self.engine = engine
        refuse_trainer_checkpoints(self._name)     # [Note: Trainer's checkpoints] in infinity/optim/checks.py
        relayout_frozen(engine, self._name)     # [Note: frozen after Init] in infinity/optim/relayout.py
        warn_frozen_in_part(engine, self._name)
        if engine.steps_not_loaded:
            warnings.warn(f"{self._name}: {engine.steps_not_loaded} was loaded into this model before an optimizer "
                          "existed: its Adam moments are loaded, but its step counts, hyper-parameters and loss scale "
                          "had no optimizer to go to, so bias correction would start again from step 0 against "
                          "trained moments. Load it again now: infinity.load_checkpoint(path, model, opt)",
                          RuntimeWarning, stacklevel=3)
        self.store = engine.store
        self._ranges = None
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.step_count = 0
        self.skipped_steps = 0
        self._calls = 0
        self._names: dict[int, str] = {}
        for root in engine.roots:
            for name, p in root.named_parameters():
                self._names.setdefault(id(p), name)
        self._select()
        self._nonfinite = NonFiniteSteps(engine, self._name)
        update, device_lane = update_lanes(self.store, engine.coordinator, self._ranges, engine.device,
                                           engine.tiers.allocator)
        # DPU's second compute copies: for the groups training now (one unfrozen later is refused at step()).
        self._updates = UpdateScheduler(engine, update, self._ranges.training, self._name, device_lane)
        self._in_backward = None    # [Note: update during backward] in infinity/optim/in_backward.py
        if engine.config.optimizer.update_in_backward:
            self._in_backward = InBackwardUpdate(self, engine, update.run, self._job_in_backward,
                                                 self._ranges.trainable)
            self._updates.in_backward = self._in_backward
        # Parameters added after Init (peft's adapters): torch's Adam(W) beside ([Note: unmanaged parameters]).
        # Built last: its hooks must not outlive a constructor that raises.
        self.unmanaged = UnmanagedAdam(self._name, self._decoupled, self.param_groups, engine)
        try:
            engine.attach_optimizer(self, self._updates)
        except BaseException:
            self.unmanaged.remove()
            raise

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` (its parameters are updated
        from the next step on, with the group's hyper-parameters)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        param_groups.check_hyper(group, self._name, len(self.param_groups) - 1)
        group["betas"] = tuple(group["betas"])
        if self._ranges is None:
            return      # the constructor's groups: resolved there
        engine, _ = param_groups.resolve([group], f"{self._name}.add_param_group")
        if engine is not self.engine:
            raise EngineError(f"{self._name}.add_param_group: a parameter of shape {tuple(group['params'][0].shape)} "
                              "is not managed by this model's infinity engine")
        self.unmanaged.add(len(self.param_groups) - 1, group)
        self._select()

    def _select(self) -> None:
        """Which parameters the update changes, in which groups (the constructor, ``add_param_group``)."""
        engine = self.engine
        groups = engine.coordinator.groups
        # Every parameter it holds, frozen or not, as torch.optim: one without a gradient is left alone
        # (see [Note: parameters without a gradient]), one unfrozen later is stepped from then on.
        params = [p for g in self.param_groups for p in g["params"] if p in engine.coordinator.group_of]
        chosen = {id(p) for p in params}
        slots = [(g, s) for g in groups for s in g.slots if id(s.param) in chosen]
        self._hyper_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        ranges = UpdateRanges(groups, self.store.layout, params)
        if self._ranges is not None:
            if self._updates.delay is not None and ranges.training - self._updates.delay.trainable:
                raise EngineError(f"{self._name}.add_param_group: with dpu.enabled the parameters an optimizer "
                                  "steps are fixed at its construction; pass every group to the constructor")
            self._updates.set_ranges(ranges)
            if self._in_backward is not None:
                self._in_backward.refresh(ranges.trainable)
        steps: dict[str, int] = {}
        if self._ranges is not None:      # parameters joining now start at Adam step 0, as in torch
            steps = self._param_steps.as_dict(self.step_count)
            before = {id(s.param) for _, s in self._param_steps.slots}
            steps.update({self._names[id(s.param)]: 0 for _, s in slots if id(s.param) not in before})
        self._ranges = ranges
        self._param_steps = ParamSteps(slots, self.store.layout, self._names, self._name)
        self._param_steps.load(steps, self.step_count, "optimizer")
        clip_coef = getattr(self, "_checks", None) and self._checks.clip_coef
        self._checks = GradientChecks(self.store, engine.reducer, engine.ranks, slots, engine.datapath,
                                      engine.loss_scaler, engine.config.partition.stage)
        self._checks.clip_coef = clip_coef or None

    @property
    def updates(self) -> UpdateScheduler:
        """Where this optimizer's updates run (synchronous, overlapped or delayed) and their workers."""
        return self._updates

    def synchronize(self) -> None:
        """Wait until every parameter and state reflects all steps taken so far.

        With DPU this waits for the background step and publishes it, so the next
        forward uses the newest parameters (the delay restarts from there). With the
        overlapped step (``dpu.overlap``) it waits for the update to finish; with the
        update during backward, for the sub-groups it is stepping.
        """
        self._updates.synchronize()

    def drop_engine_state(self) -> None:
        """The engine was released (see [Note: releasing] in infinity/runtime/engine.py): let go of its
        parts, so their buffers are freed; every later use of this optimizer raises, naming infinity.release."""
        self.unmanaged.remove()
        gone = _Released(self._name)
        self.engine = self.store = self._updates = self._checks = self._ranges = self._param_steps = gone
        self._in_backward = None

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Apply one Adam(W) update from the accumulated gradients (delayed by one step with DPU)."""
        if closure is not None:
            raise EngineError(f"{self._name}.step: closures are not supported with offloaded states")
        engine = self.engine
        # Rank-local failures (a damaged engine, a cut swap file, a background update that failed here) stop
        # every rank before the step's first collective: [Note: failing together] in infinity/runtime/ranks.py.
        with engine.ranks.together(f"{self._name}.step()"):
            # First: closing a backward cut short may find it half applied (the update during backward).
            engine.recover_aborted_backward()
            engine.check_intact(f"{self._name}.step()", grads=True)
            if self._calls == 0:
                refuse_trainer_checkpoints(self._name)     # [Note: Trainer's checkpoints] in infinity/optim/checks.py
            param_groups.check_options(self.param_groups, f"{self._name}.step()")
            engine.tiers.check()    # the update reads every state: no swap file may have been cut under it
            self._updates.begin_step()      # reports a failed delayed update; waits for an overlapped one
        if engine.backward_running:
            raise EngineError(f"{self._name}.step() called while a backward pass is still running")

        engine.datapath.set_phase("step")
        try:
            local = None    # a refusal of this rank's: the exchange's all-reduce tells the others
            try:
                # Shards still on their way to the host are added now; after a failed hand-off (this step's
                # gradients not whole here) it raises, after stage 1's reduce-scatters that every rank issues.
                engine.reducer.settle()
                engine.grad_face.before_step()
                if not self.store.has_grad and not self.unmanaged.has_grad():
                    raise EngineError(f"{self._name}.step() called before backward(): no gradient of the "
                                      "parameters it steps arrived since the last step or zero_grad() (call "
                                      "loss.backward() first; a backward that reached only parameters outside this "
                                      "optimizer, or frozen ones, gives none)")
                if self._updates.delay is not None:
                    self._updates.delay.refuse_untracked(self._ranges.trainable & self.store.grad_written,
                                                         f"{self._name}.step()")
                clip_coef = self._clip_coef()
            except BaseException as exc:
                local = exc
            try:
                nonfinite, with_grad = self._checks.exchange(failed=local is not None)
            except EngineError:     # the ranks handed gradients over in other orders ([Note: handed over in order])
                if self._in_backward is not None and self._in_backward.stepped:
                    self._in_backward.wait()
                    self._updates.damaged(f"{len(self._in_backward.stepped)} sub-groups were stepped during "
                                          "backward with gradients the ranks may have reduced into each other")
                raise
            except RanksFailedError as exc:     # another rank refused it: no rank applies it, and here too
                if self._in_backward is not None:   # sub-groups stepped during backward are half a step
                    self._in_backward.cut_short(f"{self._name}.step() failed on another rank ({exc})")
                raise
            if local is not None:
                if self._in_backward is not None:   # sub-groups stepped during backward: half a step, damaged
                    self._in_backward.cut_short(f"{self._name}.step() failed ({local!r})")
                raise local
            nonfinite = nonfinite or self.unmanaged.nonfinite()
            self._calls += 1
            engine.agree_at_forward = True      # every rank is here: the next forward agrees first
            stepped = frozenset()
            if self._in_backward is not None:   # sub-groups stepped during backward: the rest is stepped here
                with engine.ranks.together(f"{self._name}.step()"):     # the worker's failure, on every rank
                    stepped = self._in_backward.finish(f"{self._name}.step()", clip_coef, nonfinite)
            if engine.loss_scaler is not None:
                engine.loss_scaler.update(nonfinite)    # [Note: loss scaling] in infinity/optim/loss_scale.py
            if nonfinite:
                self._nonfinite.skipped()   # raises after too many in a row, naming the broken groups
                self._skip()
                return None
            self._nonfinite.stepped()
            delayed = self._updates.delays(self.step_count)
            if delayed:
                self._updates.publish_finished()
            self.step_count += 1
            try:
                # Sub-groups stepped during backward began this update (and its fresh shards): continue it.
                job = self._job(delayed, with_grad, clip_coef, stepped)
                self._updates.run(job, continues=bool(stepped))
                self.unmanaged.step(self.param_groups, self._unmanaged_factor)
            except BaseException as exc:
                if not engine.damaged:      # a failure the background reported has marked it already
                    self._updates.damaged(f"the optimizer step {self.step_count} (opt.step() call {self._calls}) "
                                          f"failed: {exc!r}. Parameters, master weights and Adam moments may be "
                                          "partly updated")
                raise
            # As torch's in-place update does: a graph recorded before this step then refuses a backward
            # ("modified by an inplace operation") instead of mixing new weights with old activations.
            groups = engine.coordinator.groups
            torch.autograd.graph.increment_version([s.param for gi in job.updated for s in groups[gi].slots
                                                    if id(s.param) in with_grad])
            if self._in_backward is not None:
                self._in_backward.reset("")
        finally:
            engine.datapath.set_phase("idle")
        return None

    def _job(self, delayed: bool, with_grad: set[int], clip_coef: float | None,
             stepped: frozenset = frozenset()) -> StepJob:
        hypers = param_groups.hyper_sets(self.param_groups)
        uniform = len(set(hypers)) == 1
        self.store.flush()  # gradient writes the backward issued to the tier must land before the pass reads
        updated = frozenset(self._ranges.trainable & self.store.grad_written)
        self._param_steps.count_missing(with_grad)
        runs = None
        if self._param_steps.lagging or not uniform:
            runs = self._param_steps.runs(updated, with_grad, self.step_count, None if uniform else self._hyper_of)
        lr, beta1, beta2, eps, weight_decay = hypers[0]
        subs = grads = None
        if self._in_backward is not None:
            subs = frozenset(range(self.store.layout.num_subs)) - stepped
            grads = self._in_backward.remaining_grads(subs)
        overlapped = not delayed and self._updates.overlaps
        return StepJob(step=self.step_count, call=self._calls, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, decoupled=self._decoupled, clip_coef=clip_coef,
                       grad_keys=self._updates.grad_keys(delayed), updated=updated,
                       param_keys=self._updates.param_keys(updated), delayed=delayed,
                       overlapped=overlapped, runs=runs, hypers=() if uniform else tuple(hypers), subs=subs,
                       grads=grads, offer_fresh=overlapped or self._in_backward is not None)

    def _job_in_backward(self, sub: int, updated: frozenset[int], grads: dict | None,
                          hypers: list) -> StepJob:
        """The job stepping sub-group ``sub`` during backward, as the next ``opt.step()`` would step it
        (see [Note: update during backward] in infinity/optim/in_backward.py): its step counts, and the
        hyper-parameters ``hypers`` read from ``param_groups`` at the step's first sub-group."""
        uniform = len(set(hypers)) == 1
        groups = self.engine.coordinator.groups
        # Every trainable parameter of ``updated`` had its gradient (the watcher's "complete"); frozen ones none.
        with_grad = {id(s.param) for gi in updated for s in groups[gi].slots if s.param.requires_grad}
        step = self.step_count + 1
        runs = self._param_steps.runs(updated, with_grad, step, None if uniform else self._hyper_of)
        lr, beta1, beta2, eps, weight_decay = hypers[0]
        return StepJob(step=step, call=self._calls + 1, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, decoupled=self._decoupled, clip_coef=None,
                       grad_keys=tuple(self.store.keys["grad"]), updated=updated,
                       param_keys=self.engine.coordinator.shards.keys(groups, updated), runs=runs,
                       hypers=() if uniform else tuple(hypers), subs=frozenset([sub]), grads=grads,
                       offer_fresh=True)

    def _clip_coef(self) -> float | None:
        """The factor of this step's gradients: ``infinity.clip_grad_norm_``'s times torch's (``.grad.mul_``),
        times ``1 / loss scale`` in fp16."""
        clip = self._checks.take_clip_coef()
        unscale = 1.0 / self.engine.loss_scaler.scale if self.engine.loss_scaler is not None else None
        # Parameters added after Init: their .grad is torch's own, unscaled as it arrives: only the clipping.
        self._unmanaged_factor = clip
        factors = [f for f in (clip, self.engine.grad_face.common_factor(), unscale) if f is not None]
        return math.prod(factors) if factors else None

    def _skip(self) -> None:
        """See [Note: skipped steps] in infinity/optim/checks.py."""
        self.skipped_steps += 1
        self._updates.stats.skipped_steps += 1
        self._updates.publish_finished()
        if self._in_backward is not None:
            self._in_backward.reset("")
        self.store.zero_grad()
        self.unmanaged.zero_grad()
        self._checks.reset()
        self.engine.grad_face.forget()
        nonfinite = self._nonfinite
        if nonfinite.expected:
            return      # an overflow the dynamic loss scale answers: expected, counted in stats()
        if nonfinite.dtype == "float16":
            why = (f"inf/NaN in float16 with a loss scale that does not come down further; {nonfinite.in_a_row} in "
                   "a row" + (f", the run stops at {nonfinite.limit}" if nonfinite.limit else ""))
        else:
            why = (f"inf/NaN in {nonfinite.dtype}, which does not overflow like float16; {nonfinite.in_a_row} in "
                   "a row" + (f", the run stops at {nonfinite.limit}" if nonfinite.limit else ""))
        warnings.warn(f"{self._name}: opt.step() call {self._calls} found a non-finite gradient ({why}) and "
                      f"skipped its update ({self.skipped_steps} skipped so far)", RuntimeWarning, stacklevel=3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradient shards and the parameters' ``.grad`` (as ``model.zero_grad()`` does).

        Does not wait for a background step: that step reads its own gradient buffer.
        """
        # Every rank calls it, also after a backward cut short, which may leave one rank's states damaged (a half
        # update during backward) and not another's: the next forward agrees first, as after a step ([Note:
        # failing together] in infinity/runtime/ranks.py; a step sets it anyway, so no extra collective then).
        # Set before the backward is closed, which may fail on one rank alone: every rank's forward agrees, and
        # there finishes this clear, which the others did ([Note: a resumable end of backward] in
        # infinity/runtime/backward_end.py).
        # So is a clear that fails part-way (a gradient write that cannot be flushed): owed, not half done here
        # while the others train on.
        engine = self.engine
        engine.agree_at_forward = True

        def owed(exc: BaseException) -> None:
            engine.clear_owed = (f"{self._name}.zero_grad() raised before it cleared this rank's gradients "
                                 f"({exc!r}); call {self._name}.zero_grad() again", set_to_none)

        try:
            engine.recover_aborted_backward()
        except BaseException as exc:
            owed(exc)
            raise
        if self._in_backward is not None:   # refuses before anything is dropped
            try:
                self._in_backward.reset(f"{self._name}.zero_grad()")
            except EngineError:     # refused, as it is on a rank whose backward ended: nothing owed, step first
                engine.clear_owed = None
                raise
        try:
            engine.reducer.settle(drop=True)
            self.store.zero_grad()
            self.unmanaged.zero_grad(set_to_none)
            self._checks.reset()
            engine.grad_face.forget(keep_zeros=not set_to_none)
        except BaseException as exc:
            owed(exc)
            raise
        engine.clear_owed = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients by their global L2 norm (applied by the step, DPU included)."""
        if self._in_backward is not None:
            self._in_backward.refuse(f"{self._name}.clip_grad_norm_")
        # Their gradients are the same on every rank (averaged at the end of backward): counted once.
        return self._checks.clip_grad_norm_(max_norm, self.unmanaged.norm_sq() / self.engine.ranks.world_size)

    # -- telemetry and state -------------------------------------------------------------------
    def stats(self) -> dict:
        """Step counts and optimizer time: total, exposed to compute, and the fraction hidden by DPU
        or by the overlapped step (whose exposed time is what fetches and ``step()`` waited for it).

        ``pending`` is 1 while a delayed (DPU) step has not been published.
        """
        out = self._updates.as_dict()
        scaler = self.engine.loss_scaler
        if self._in_backward is not None:
            out["in_backward_subs"] = self._in_backward.subs_stepped
            out["in_backward_wait_seconds"] = self._in_backward.waited_s
        out.update(steps=self.step_count, calls=self._calls,
                   loss_scale=scaler.as_dict() if scaler is not None else None)
        return out

    def param_steps(self) -> dict[str, int]:
        """Adam step counts of the parameters that lag behind ``step_count`` (missed updates), by name."""
        return self._param_steps.as_dict(self.step_count)

    def load_param_steps(self, steps: dict[str, int], where: str = "state") -> None:
        """Restore :meth:`param_steps` (after ``step_count``); unknown names are an error."""
        self._param_steps.load(steps, self.step_count, where)

    def state_dict(self) -> dict:
        """This rank's optimizer state: hyper-parameters, step, and fp32 shards per group.

        ``"shards"`` maps each state to its shards, read from their tier when looked at
        (:class:`~infinity.optim.shard_states.ShardStates`); ``torch.save`` writes them as tensors.

        For large models use ``infinity.save_checkpoint``, which streams the shards to
        files instead of holding them in memory.
        """
        self.synchronize()
        groups = self.engine.coordinator.groups
        shards = ShardStates(self.store, [g.index for g in groups])   # [Note: a lazy optimizer state dict]
        return {"param_groups": self._indexed_groups(), "step": self.step_count, "skipped_steps": self.skipped_steps,
                "param_steps": self.param_steps(),
                "rank": self.engine.ranks.rank, "world_size": self.engine.ranks.world_size,
                "shard_numels": [g.shard_numel for g in groups], "shards": shards,
                "unmanaged": self.unmanaged.state_dict(),
                "loss_scale": self.engine.loss_scaler.as_dict() if self.engine.loss_scaler is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        meet_accelerate_prepare()      # [Note: accelerate's load_state] in infinity/optim/checks.py
        groups = self.engine.coordinator.groups
        if torch_state.is_torch_state(state_dict):     # [Note: torch.optim state dicts]
            self.synchronize()
            step_count, steps = torch_state.load(self._name, self._decoupled, self.engine, self.store,
                                                 self.param_groups, self._names, state_dict)
            self.step_count, self.skipped_steps = step_count, 0
            self.load_param_steps(steps, "torch.optim state dict")
            self._updates.after_load()
            return
        missing = [k for k in ("world_size", "shard_numels", "param_groups", "step", "shards") if k not in state_dict]
        if missing:
            raise EngineError(f"{self._name}.load_state_dict: the state has no {missing} (it is not a state_dict() "
                              "of an infinity optimizer); nothing was loaded")
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
        self._load_groups(state_dict["param_groups"])
        self.synchronize()
        self.step_count = int(state_dict["step"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.load_param_steps(state_dict.get("param_steps", {}), "state dict")
        if self.engine.loss_scaler is not None and state_dict.get("loss_scale") is not None:
            self.engine.loss_scaler.load(state_dict["loss_scale"], f"{self._name}.load_state_dict")
        self.unmanaged.load_state_dict(state_dict.get("unmanaged"))
        saved = state_dict["shards"]
        if isinstance(saved, ShardStates) and saved.is_stored_in(self.store):
            return      # this optimizer's own states: nothing to write ([Note: a lazy optimizer state dict])
        for s, shards in saved.items():
            for g, shard in zip(groups, shards):
                self.store.write_state_shard(s, g.index, shard)
        coordinator = self.engine.coordinator
        for g in groups:
            coordinator.shards.write(g, self.store.read_state_shard("master", g.index)).wait()
        self._updates.after_load()


    def _indexed_groups(self) -> list[dict]:
        """``param_groups`` as ``torch.optim``'s state dict has them: parameters as indices, in order."""
        out, start = [], 0
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            out.append(entry)
        return out

    def _load_groups(self, saved: list[dict]) -> None:
        """The hyper-parameters of each saved group (checked against these groups, as torch does)."""
        if len(saved) != len(self.param_groups):
            raise ValueError(f"{self._name}.load_state_dict: the state has {len(saved)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for i, (group, old) in enumerate(zip(self.param_groups, saved)):
            if "params" in old and len(old["params"]) != len(group["params"]):
                raise ValueError(f"{self._name}.load_state_dict: param group {i} has {len(group['params'])} "
                                 f"parameters here, {len(old['params'])} in the state")
        for group, old in zip(self.param_groups, saved):
            group.update({k: v for k, v in old.items() if k != "params"})


class AdamW(_OffloadAdam):
    """AdamW (decoupled weight decay) over a model built in ``infinity.Init``.

    With ``dpu.enabled`` in the config, updates after ``dpu.warmup_steps`` run in the
    background, one step behind (see ``infinity.optim.delayed``); ``synchronize()`` waits for them.

    Parameters
    ----------
    params:
        The model built inside ``infinity.Init``, an iterable of its parameters, or torch-style
        param groups (dicts with ``"params"`` and any of ``lr``, ``betas``, ``eps``,
        ``weight_decay``), each honoured at every step (see [Note: parameter groups of the
        optimizer] in infinity/optim/param_groups.py).
    lr, betas, eps, weight_decay:
        As in ``torch.optim.AdamW``: the defaults of the groups.

    Examples
    --------
    >>> opt = infinity.AdamW(model, lr=3e-4, weight_decay=0.1)   # doctest: +SKIP
    >>> decay = [p for n, p in model.named_parameters() if p.dim() >= 2]          # doctest: +SKIP
    >>> rest = [p for n, p in model.named_parameters() if p.dim() < 2]            # doctest: +SKIP
    >>> opt = infinity.AdamW([{"params": decay, "weight_decay": 0.1},
    ...                       {"params": rest, "weight_decay": 0.0}], lr=3e-4)    # doctest: +SKIP
    >>> loss.backward(); opt.step(); opt.zero_grad()              # doctest: +SKIP
    """

    _decoupled = True
    _name = "infinity.AdamW"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


class Adam(_OffloadAdam):
    """Adam (L2 weight decay added to the gradient) over a model built in ``infinity.Init``.

    Parameters are as in ``torch.optim.Adam`` (a model, parameters or param groups); see :class:`AdamW`.
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
