"""Every hook the engine puts on a model, installed in one place.

Hook bodies only delegate to the engine's lifecycle methods (``pre_forward``,
``post_forward``, ``pre_backward``, ``on_group_grads``); the returned ``HookHandles``
removes the module hooks, restoring the model's hooks exactly.

[Note: one gradient hook per group]
A group's gradients are handed over once per backward, when every parameter of the
group that takes part in it has its whole gradient (all its uses summed): a multi-grad
hook over the group's parameters (``torch.autograd.graph.register_multi_grad_hook``,
mode "all"), armed when a forward gathers the group and removed at the end of the
backward. So the engine runs once per group, never once per parameter. It is armed
while the group is gathered because the hook takes the parameters' gradient
accumulators, whose expected shapes are those of the parameters at that moment.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from infinity.errors import EngineError, released_message


class GroupGradHook:
    """Hands a group's gradients to the engine, holding the engine weakly.

    [Note: hooks held from C++]
    A parameter's grad hooks are kept alive by the C++ tensor, out of sight of
    Python's cycle collector; a hook holding the engine strongly would make the
    engine, the model and its swap files immortal. The module hooks live in the
    modules' own dicts and may hold the engine strongly.
    """

    __slots__ = ("engine", "group", "params")

    def __init__(self, lifecycle, group, params: list) -> None:
        self.engine = weakref.ref(lifecycle)
        self.group = group
        self.params = params

    def __call__(self, grads) -> None:
        engine = self.engine()
        if engine is not None:
            engine.on_group_grads(self.group, self.params, grads)


def watch_backward(module: nn.Module, output, pre_backward) -> None:
    """Call ``pre_backward(module)`` once, when the first gradient reaches ``module``'s ``output``."""
    tensors = [t for t in tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
    if not tensors:
        return
    fired = [False]

    def on_output_grad(grad):
        if not fired[0]:
            fired[0] = True
            pre_backward(module)

    for t in tensors:
        t.register_hook(on_output_grad)


def watch_group_grads(lifecycle, group) -> RemovableHandle:
    """Arm ``group``'s gradient hook for the coming backward (see [Note: one gradient hook per group])."""
    params = [s.param for s in group.slots if s.param.requires_grad]
    return torch.autograd.graph.register_multi_grad_hook(params, GroupGradHook(lifecycle, group, params),
                                                         mode="all")


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


def install_hooks(root: nn.Module, lifecycle) -> HookHandles:
    """Install the forward hooks and the state-dict pre-hooks on every module under ``root``.

    Parameters
    ----------
    root:
        The model.
    lifecycle:
        An object with ``pre_forward(module, args)``, ``post_forward(module, output)`` and
        ``before_state_dict(module, prefix, keep_vars)`` (the engine).
    """
    handles: list[RemovableHandle] = []
    pre_forward = torch.compiler.disable(lambda m, args: lifecycle.pre_forward(m, args))
    post_forward = torch.compiler.disable(lambda m, args, out: lifecycle.post_forward(m, out))
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(pre_forward, prepend=True))
        # always_call: a forward that raises still releases what its pre-hook acquired; a
        # group left in use would stay gathered and never be refreshed by an optimizer step.
        handles.append(module.register_forward_hook(post_forward, always_call=True))
        handles.append(module.register_state_dict_pre_hook(
            lambda m, prefix, keep_vars: lifecycle.before_state_dict(m, prefix, keep_vars)))
    return HookHandles(handles)


def install_released_guard(root: nn.Module) -> HookHandles:
    """Hooks that make a forward or ``state_dict()`` of a released model raise (see [Note: releasing]
    in infinity/runtime/engine.py); they hold no engine, so its buffers can go."""
    def refuse(what):
        raise EngineError(released_message(f"{type(root).__name__}.{what}"))

    handles: list[RemovableHandle] = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(lambda m, args: refuse("forward()"), prepend=True))
        handles.append(module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: refuse("state_dict()")))
    return HookHandles(handles)
