"""A ``torch.optim`` optimizer over an engine's parameters is refused when built, else at its first step.

[Note: foreign optimizers]
An engine parameter holds no values between uses and its gradient lives in the engine's
store (see [Note: gradient tokens] in infinity/optim/grad_face.py), so ``torch.optim.AdamW``
over ``model.parameters()`` would step nothing, silently. torch offers no hook at an
optimizer's construction, but every optimizer's ``Optimizer.add_param_group`` reads each
parameter's ``is_leaf``, and a released parameter answers that in its own
``__torch_function__`` (infinity/runtime/placeholder.py): there, called from
``add_param_group`` of an optimizer that is not the engine's, it refuses, before a forward
and backward are spent on a step that would be refused. What that misses (an optimizer built
over gathered parameters, inside ``infinity.gathered``, or with ``differentiable=True``, which
skips the read) meets a global hook before every step
(``torch.optim.optimizer.register_optimizer_step_pre_hook``): each engine registers one
while its model lives, and the hook raises for any optimizer other than the engine's own
that holds one of its parameters. The verdict is kept per optimizer and its number of
parameters, so a step of an unrelated optimizer costs one dictionary lookup.

One over parameters added to the engine's model after ``Init`` (peft's adapters: [Note: unmanaged
parameters] in infinity/optim/unmanaged.py) steps them as it would on a plain model, but is refused
at its first step where it would fail later or silently: under a ``transformers.Trainer`` that
saves checkpoints (``trl.SFTTrainer(peft_config=...)`` builds one so: its first save takes
``model.state_dict()`` on one process, [Note: Trainer's checkpoints] in infinity/optim/checks.py),
and on several ranks, where nothing averages their gradients (no DDP wraps an engine model;
``infinity.AdamW`` does it).

What the room may touch: the engine's coordinator (read only: which parameters it
manages), its ``roots`` (read only: which parameters were added to them), its ``ranks`` and its
``optimizer``.
"""
from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from infinity.errors import EngineError, foreign_optimizer_message
from infinity.optim.checks import refuse_trainer_checkpoints


class TorchOptimizerGuard:
    """The step pre-hook of one engine (see [Note: foreign optimizers]); holds the engine weakly."""

    def __init__(self, engine, names: dict) -> None:
        self._engine = weakref.ref(engine)
        self._names = names
        self._checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.handle = register_optimizer_step_pre_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        engine = self._engine()
        if engine is None:
            return
        own = engine.optimizer      # and the torch AdamW it steps parameters added after Init with
        if own is not None and (optimizer is own or optimizer is own.unmanaged.optimizer):
            return
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if self._checked.get(optimizer) == count:
            return
        managed = engine.coordinator.group_of
        what = f"{type(optimizer).__module__}.{type(optimizer).__name__}.step()"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            if p in managed:
                name = self._names.get(p, f"a parameter of shape {tuple(p.shape)}")
                raise EngineError(foreign_optimizer_message(what, name))
        added = {p for root in engine.roots for p in root.parameters() if p not in managed}
        if any(p in added for p in params):
            refuse_trainer_checkpoints(what)
            if engine.ranks.world_size > 1:
                raise EngineError(
                    f"{what}: it holds parameters added to a model built in infinity.Init after the block (peft's "
                    f"adapters), which each of the {engine.ranks.world_size} ranks holds whole; nothing averages "
                    "their gradients over the ranks (DistributedDataParallel does not wrap an infinity model), so the "
                    "ranks' copies would drift apart. Step them with infinity.AdamW(model, lr=...), which averages "
                    "them as DDP does (under transformers.Trainer: infinity.Trainer, which builds it)")
        self._checked[optimizer] = count

    def remove(self) -> None:
        self.handle.remove()
