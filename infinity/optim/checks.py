"""What ``opt.step()`` checks of the gradients before an update: inf/NaN, which arrived, the global norm.

[Note: skipped steps]
When any rank saw a non-finite gradient (the running norm of ``GradientBook`` is inf or
NaN, e.g. after an fp16 overflow), ``step()`` skips the update as ``torch.cuda.amp.GradScaler`` does: the
step count does not advance, the gradient is dropped, ``skipped_steps`` counts it and
a ``RuntimeWarning`` names the step. With DPU the update still pending from the
previous step is published as usual.

What the room may touch: the gradient book (read only), the state store's accumulated
gradients (to recompute a norm), the ranks' all-reduces and the data path's host reads.
"""
from __future__ import annotations

import inspect
import math
import os
import types
import weakref

import torch

from infinity import registry
from infinity.errors import EngineError
from infinity.runtime.ranks import RanksFailedError


class GradientChecks:
    """The per-step gradient checks and the clipping coefficient they leave for the update.

    Parameters
    ----------
    store:
        The optimizer state store (which parameters' gradients arrived, the squared norm).
    reducer:
        The gradient reducer (``infinity.runtime.grads.GradReducer``): its book of arrivals and norm.
    ranks:
        The data-parallel ranks, for the all-reduces.
    slots:
        ``(group, slot)`` of every parameter in the optimizer, in group order.
    datapath:
        Reads the results on the host (each a counted host wait, in the step).
    loss_scaler:
        fp16's ``LossScaler`` (the stored gradients are scaled by it; norms are reported unscaled), or None.
    """

    def __init__(self, store, reducer, ranks, slots, datapath, loss_scaler=None, stage: int = 3) -> None:
        self.stage = stage      # partition.stage: what a refusal of ranks that took other paths advises
        self.datapath = datapath
        self.loss_scaler = loss_scaler      # fp16: the stored gradients are scaled by it
        self.store = store
        self.reducer = reducer
        self.ranks = ranks
        self.slots = slots
        self.positions = reducer.positions([s.param for _, s in slots])
        self._groups = sorted({g.index for g, _ in slots})
        self.clip_coef: float | None = None

    def exchange(self, failed: bool = False) -> tuple[bool, set[int]]:
        """Whether any rank's gradient of this step has an inf/NaN (the flag is consumed), and the
        ids of the parameters whose gradient arrived on any rank: one all-reduce (which also checks that
        the ranks handed their groups' gradients over in one order: [Note: handed over in order]).

        ``failed``: this rank refused the step before it (it raises its own error after this call); the
        others raise ``RanksFailedError`` ([Note: failing together] in infinity/runtime/ranks.py)."""
        book = self.reducer.book
        flags = book.flags(self.positions)
        n = flags.numel()
        several = self.ranks.world_size > 1
        if several:     # after the flags: [failed, handed at..., -handed at..., -arrived...], max-reduced alike
            handed = torch.tensor([float(failed)] + [float(book.handed_at.get(g, 0)) for g in self._groups],
                                  dtype=torch.float32).to(flags.device)
            flags = torch.cat([flags, handed, -handed[1:], -flags[1:]])
        self.ranks.all_reduce_max(flags)
        values = self.datapath.values(flags)
        if several and not failed:
            if values[n]:
                raise RanksFailedError(f"rank {self.ranks.rank}: another rank refused this opt.step() (see the "
                                       "error raised there); no rank applies it")
            k = len(self._groups)
            self._refuse_another_order(values[n + 1:n + 1 + k], values[n + 1 + k:n + 1 + 2 * k], values[1:n],
                                       values[n + 1 + 2 * k:])
        return bool(values[0]), {id(s.param) for (_, s), f in zip(self.slots, values[1:n]) if f}

    def _refuse_another_order(self, most: list, least: list, any_rank: list, not_every: list) -> None:
        """Every rank raises the same error when some group was handed over at another place on some rank."""
        apart = {gi for gi, hi, lo in zip(self._groups, most, least) if hi != -lo}
        if not apart:
            return
        some = [(g, f"{g.name}.{s.name}" if g.name and not g.name.startswith("<") else s.name)
                for (g, s), a, e in zip(self.slots, any_rank, not_every) if a and e == 0]
        names = [name for g, name in some if g.index in apart]
        group = next((g for g, _ in some if g.index in apart), None) or \
            next(g for g, _ in self.slots if g.index in apart)
        why = f"{names[:3]} got a gradient on some ranks only" if names else "the backward took other paths"
        raise EngineError(
            f"opt.step(): the ranks reduced the gradients of {len(apart)} parameter group(s) at different places "
            f"in their sequence of collectives ({group.name!r}: {why}): a parameter that gets a gradient on "
            "some ranks and not on others (a branch taken on some ranks only) makes a rank hand its group over at "
            "the end of the backward instead of when the gradients arrive, and NCCL pairs collectives by order "
            "alone, so the gradients of this step may be mixed between groups. The step is not applied. Make every "
            "rank call every module with trainable parameters in each forward (a branch not taken can call it on an "
            "empty slice, or add 0 * its output), or freeze what some ranks do not use"
            + ("; at partition.stage 3 every module a rank calls is gathered on every rank too (freezing does not "
               "spare that): make the block whose modules ranks call differently (a mixture of experts, an early "
               "exit) a unit of its own, partition.units = [\"ItsClass\"] (its groups are gathered and handed "
               "over once per call of the block, which every rank makes), or train at stage 1 or 2"
               if self.stage == 3 else ""))

    def clip_grad_norm_(self, max_norm: float, extra_norm_sq: float = 0.0) -> torch.Tensor:
        """The global L2 norm of this step's gradients; the update scales them to ``max_norm``.

        ``extra_norm_sq``: the squares of gradients outside the store (parameters added after Init,
        [Note: unmanaged parameters] in infinity/optim/unmanaged.py), this rank's share of the sum over the
        ranks (their gradients are the same on every rank: divided by the world size)."""
        # A collective user code may call on one rank only: [Note: collectives user code calls].
        self.ranks.arrive("infinity.clip_grad_norm_")

        def local() -> torch.Tensor:
            # The shards still on their way reach the store first (stage 1: the whole gradients their owners): a
            # norm of the stored sum (micro-batches accumulated) must not leave out a copy that has not run yet.
            # Settling and reading the stored sum are this rank's alone and may fail (tier I/O, a hand-off that
            # failed): the failure rides on the sum's all-reduce ([Note: failing together]).
            self.reducer.settle()
            book = self.reducer.book
            norm_sq = book.norm_sq if book.exact else self.store.grad_norm_sq()
            return norm_sq.reshape(1).to(torch.float64) + extra_norm_sq

        norm_sq = self.ranks.reduce_together("infinity.clip_grad_norm_", local, 1)
        total = math.sqrt(float(norm_sq[0]))
        if self.loss_scaler is not None:
            total = self.loss_scaler.unscaled_norm(total)
        coef = max_norm / (total + 1e-6)
        self.clip_coef = coef if coef < 1.0 else None
        return torch.tensor(total)

    def take_clip_coef(self) -> float | None:
        """The coefficient for the update being handed over; the next step starts unclipped."""
        coef, self.clip_coef = self.clip_coef, None
        return coef

    def reset(self) -> None:
        """Gradients were dropped (``zero_grad`` or a skipped step): forget the coefficient.

        (The arrivals and the norm are reset with the accumulator, by ``store.zero_grad``.)
        """
        self.clip_coef = None


def refuse_trainer_checkpoints(who: str) -> None:
    """Refuse a ``transformers.Trainer`` run that would save its own checkpoints, at its start.

    [Note: Trainer's checkpoints]
    ``transformers.Trainer`` saves a checkpoint every ``save_steps`` (500 by default) and at the end
    of training, unless ``save_strategy="no"``: it takes ``model.state_dict()`` on the main process
    only. An engine model's parameters are shards over ranks and tiers, and gathering them needs
    every rank, so that save raises; it did so after hours of training, losing the run. So an infinity
    optimizer created by a Trainer (``optimizer_cls_and_kwargs``), or stepped by one for the first time
    (``optimizers=(opt, None)``), raises when that Trainer's save strategy is not "no", saying what to do
    instead (the Trainer is found up the stack: torch gives no other way to see it). ``infinity.Trainer``
    saves through infinity instead and is let through ([Note: Trainer's checkpoints through infinity] in
    infinity/checkpoint/trainer.py).
    """
    frame = inspect.currentframe().f_back
    while frame is not None:
        trainer = frame.f_locals.get("self") if frame.f_globals.get("__name__") == "transformers.trainer" else None
        args = getattr(trainer, "args", None)
        if getattr(trainer, "infinity_checkpoints", False):
            return      # infinity.Trainer: its checkpoints are infinity's ([Note: Trainer's checkpoints through infinity])
        if args is not None and hasattr(args, "save_strategy"):
            strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
            evaluation = getattr(args, "eval_strategy", "no")
            evaluating = str(getattr(evaluation, "value", evaluation)) != "no"
            if strategy not in ("no", "best") or (strategy == "best" and evaluating):     # "best" saves after an eval
                cls = type(trainer).__name__
                plain = type(trainer).__module__ == "transformers.trainer"
                raise EngineError(
                    f"{who}: {'transformers.' if plain else ''}{cls}{'' if plain else ' (a transformers.Trainer)'} "
                    f"with save_strategy={strategy!r} would save its checkpoints "
                    "through model.state_dict() on the main process only, which an infinity model (its "
                    "parameters shards over ranks and tiers) refuses: the run would stop at its first save "
                    "(save_steps, or the end of training). Use infinity.Trainer"
                    f"{'' if plain else f' in front of it, class T(infinity.Trainer, {cls}),'}"
                    " which saves and resumes them "
                    "with infinity.save_checkpoint and infinity.load_checkpoint, or give TrainingArguments "
                    "save_strategy=\"no\"")
            return
        frame = frame.f_back


def meet_accelerate_prepare() -> None:
    """Called by an infinity optimizer's ``load_state_dict``: when accelerate's ``prepare`` is the caller, give its
    ``Accelerator`` a load-state pre-hook that refuses ``load_state`` on an engine model, and have the
    ``AcceleratedOptimizer`` it builds report this optimizer's skipped steps (``report_skipped_steps``).

    [Note: accelerate's load_state]
    ``Accelerator.save_state`` is refused on an engine model ([Note: accelerate's save_state] in
    infinity/runtime/save_guard.py), so no directory holds what ``load_state`` reads for it, and given the
    directory ``infinity.save_checkpoint`` wrote it stopped at its own "no such file" for
    ``pytorch_model.bin``, saying nothing of infinity. Loading through infinity instead is not possible:
    its pre-hooks may take a model out of its list, not an optimizer, which it would still read from
    ``optimizer.bin``. So the hook refuses before anything is read, naming ``infinity.load_checkpoint``.
    accelerate calls no method of an engine model it prepares, but ``prepare`` of an optimizer calls
    ``opt.load_state_dict(opt.state_dict())``; there the ``Accelerator`` is found up the stack and the
    hook registered (by its public ``register_load_state_pre_hook``). A model prepared with no infinity
    optimizer keeps accelerate's own error. Looked at only when ``accelerate.optimizer`` is the caller.
    """
    frame = inspect.currentframe().f_back.f_back
    if frame is None or frame.f_globals.get("__name__") != "accelerate.optimizer":
        return
    prepared = frame.f_locals.get("self")   # the AcceleratedOptimizer being built around this optimizer
    if prepared is not None and hasattr(type(prepared), "step_was_skipped"):
        report_skipped_steps(prepared)
    while frame is not None:
        if frame.f_globals.get("__name__") == "accelerate.accelerator" and frame.f_code.co_name == "prepare_optimizer":
            accelerator = frame.f_locals.get("self")
            if hasattr(accelerator, "register_load_state_pre_hook"):
                accelerator.register_load_state_pre_hook(_refuse_load_state)
            return
        frame = frame.f_back


def _refuse_load_state(models: list, input_dir: str) -> None:
    """``Accelerator.load_state``'s pre-hook ([Note: accelerate's load_state])."""
    for model in models:
        try:
            registry.engine_of(model)
        except registry.NotManagedError:
            continue
        holds = os.path.isfile(os.path.join(str(input_dir), "latest"))
        raise EngineError(
            f"accelerator.load_state({str(input_dir)!r}): the model was built in infinity.Init, and accelerate reads "
            "a model from the files its save_state writes, which it refuses to write for such a model (its "
            "parameters and optimizer states are shards over ranks and tiers). Nothing was loaded. On every rank, "
            "resume with infinity.load_checkpoint(dir, model, opt) from what infinity.save_checkpoint(dir, model, opt) "
            "wrote (weights, optimizer states, step count and RNG)"
            + (f": {str(input_dir)!r} is such a checkpoint" if holds else ""))


def report_skipped_steps(prepared) -> None:
    """Have accelerate's ``AcceleratedOptimizer`` say when the infinity optimizer it wraps skipped a step.

    [Note: skipped steps under accelerate]
    accelerate holds a prepared scheduler, and the Trainer its scheduler, on a step its ``step_was_skipped``
    says was skipped, which it learns only from its own GradScaler. infinity skips a step with a non-finite
    gradient itself (fp16's overflows: [Note: loss scaling] in infinity/optim/loss_scale.py), so without
    this the schedule went on past steps never taken (a warmup spent on skipped steps), where a plain model
    with accelerate's fp16 GradScaler, and DeepSpeed's, holds it. Once per ``AcceleratedOptimizer``.
    """
    if getattr(prepared.__dict__.get("step"), "reports_skips", False):
        return
    base_step = type(prepared).step

    def step_and_report(self, closure=None):
        inner = self.optimizer
        before = inner.skipped_steps
        base_step(self, closure)
        self._is_overflow = inner.skipped_steps > before   # what accelerate's step_was_skipped reads

    step_and_report.reports_skips = True
    # A method (torch's schedulers wrap it) bound to a proxy: held by the instance, it must not hold it back.
    prepared.step = types.MethodType(step_and_report, weakref.proxy(prepared))
