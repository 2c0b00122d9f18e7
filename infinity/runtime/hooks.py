"""Every hook the engine puts on a model, installed in one place.

Hook bodies only delegate to the engine's lifecycle methods (``pre_forward``,
``post_forward``, ``pre_backward``, ``on_grad``); the returned ``HookHandles``
removes all of them, restoring the model's hooks exactly.
"""
from __future__ import annotations

import weakref

from torch import nn
from torch.utils.hooks import RemovableHandle


class _GradHook:
    """The post-accumulate-grad hook of one parameter, holding the engine weakly.

    [Note: hooks held from C++]
    A parameter's grad hooks are kept alive by the C++ tensor, out of sight of
    Python's cycle collector; a hook holding the engine strongly would make the
    engine, the model and its swap files immortal. The module hooks live in the
    modules' own dicts and may hold the engine strongly.
    """

    __slots__ = ("engine",)

    def __init__(self, lifecycle) -> None:
        self.engine = weakref.ref(lifecycle)

    def __call__(self, param) -> None:
        engine = self.engine()
        if engine is not None:
            engine.on_grad(param)


class HookHandles:
    """The handles of every hook installed on one model; ``remove()`` undoes all of them."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __len__(self) -> int:
        return len(self._handles)


def install_hooks(root: nn.Module, lifecycle, params) -> HookHandles:
    """Install the forward hooks on every module under ``root`` and a gradient hook on ``params``.

    Parameters
    ----------
    root:
        The model.
    lifecycle:
        An object with ``pre_forward(module)``, ``post_forward(module, output)`` and
        ``on_grad(param)`` (the engine).
    params:
        The managed parameters that receive a post-accumulate-grad hook.
    """
    handles: list[RemovableHandle] = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, args: lifecycle.pre_forward(m), prepend=True))
        # always_call: a forward that raises still releases what its pre-hook acquired; a
        # group left in use would stay gathered and never be refreshed by an optimizer step.
        handles.append(module.register_forward_hook(
            lambda m, args, out: lifecycle.post_forward(m, out), always_call=True))
    for p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(_GradHook(lifecycle)))
    return HookHandles(handles)
