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

What the room may touch: the engine's coordinator (read only: which parameters it
manages) and its ``optimizer``.
"""
from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from infinity.errors import EngineError, foreign_optimizer_message


class TorchOptimizerGuard:
    """The step pre-hook of one engine (see [Note: foreign optimizers]); holds the engine weakly."""

    def __init__(self, engine, names: dict) -> None:
        self._engine = weakref.ref(engine)
        self._names = names
        self._checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.handle = register_optimizer_step_pre_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        engine = self._engine()
        if engine is None or optimizer is engine.optimizer:
            return
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if self._checked.get(optimizer) == count:
            return
        managed = engine.coordinator.group_of
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            if p in managed:
                name = self._names.get(p, f"a parameter of shape {tuple(p.shape)}")
                raise EngineError(foreign_optimizer_message(
                    f"{type(optimizer).__module__}.{type(optimizer).__name__}.step()", name))
        self._checked[optimizer] = count

    def remove(self) -> None:
        self.handle.remove()
