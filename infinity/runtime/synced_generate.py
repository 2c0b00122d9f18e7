"""transformers' ``generate`` on several ranks, where a forward of the model is a collective.

[Note: generating on several ranks]
At stage 3 each forward all-gathers the model's groups, so every rank must run as many forwards as the
others. transformers' ``generate`` ends a rank's loop once its own sequences are done (an end-of-sequence
token, its own ``max_new_tokens``) unless ``synced_gpus``, which it turns on by itself for DeepSpeed ZeRO-3
and FSDP only (so does ``Seq2SeqTrainer``, which passes False otherwise): a rank done first would leave the
others in the next forward's all-gathers (on NCCL for ever), or pair them with its own next collective. So
on several ranks at stage 3 the ``generate`` of each module of an engine model that takes ``synced_gpus``
(transformers' models; a model's own ``generate`` without it is left alone) runs with it True, as
transformers does for those: a rank done early runs forwards whose tokens it does not keep until every rank
is done (one flag all-reduce a token), with the same tokens as without. False given is taken as True too:
here it could only part the ranks. Not where the engine's process group leaves out some processes:
transformers' flag all-reduce runs over all of them. Stages 1 and 2 gather only in the first forward after
an update, which every rank's ``generate`` runs. ``infinity.release`` gives each module its own back. Left:
a ``generate`` a module holds on its instance (a Hub repository's ``custom_generate``), and one rank alone
calling ``generate`` (``if rank == 0:``), which waits for the others as any forward does.

What the room may touch: the modules' ``generate`` attribute, set on the instance.
"""
from __future__ import annotations

import functools
import inspect
import weakref

import torch.distributed as dist
from torch import nn

_KEY = "synced_gpus"


class OnInstance:
    """``function`` set as ``module.<name>`` on the instance, over its class's method ``own`` (its signature the
    bound method's); ``remove()`` gives ``module`` its class's back, if it is still ``function``."""

    def __init__(self, module: nn.Module, name: str, function, own) -> None:
        function.__signature__ = inspect.signature(functools.partial(own, module))
        self._module = weakref.ref(module)      # the attribute must not keep its model alive
        self._name, self._function = name, function
        module.__dict__[name] = function

    def remove(self) -> None:
        module = self._module()
        if module is not None and module.__dict__.get(self._name) is self._function:
            del module.__dict__[self._name]


def synced(module: nn.Module, own) -> OnInstance:
    """``module.generate`` with ``synced_gpus`` True."""
    ref = weakref.ref(module)
    at = list(inspect.signature(own).parameters).index(_KEY) - 1    # its place among the arguments after self

    @functools.wraps(own)
    def generate(*args, **kwargs):
        if len(args) > at:
            args = (*args[:at], True, *args[at + 1:])
        else:
            kwargs[_KEY] = True
        return own(ref(), *args, **kwargs)

    return OnInstance(module, "generate", generate, own)


def sync_generate(roots, ranks, stage: int) -> list[OnInstance]:
    """A synced ``generate`` (``OnInstance``) for each module under ``roots`` whose ``generate`` takes ``synced_gpus``, where
    [Note: generating on several ranks] asks for it."""
    if ranks.world_size == 1 or stage != 3 or ranks.world_size != dist.get_world_size():
        return []
    out = []
    for root in roots:
        for module in root.modules():
            own = getattr(type(module), "generate", None)
            if callable(own) and "generate" not in vars(module) and _takes_sync(own):
                out.append(synced(module, own))
    return out


def _takes_sync(fn) -> bool:
    try:
        return _KEY in inspect.signature(fn).parameters
    except (TypeError, ValueError):     # a callable without a signature
        return False
