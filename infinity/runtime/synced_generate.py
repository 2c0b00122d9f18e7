"""transformers' ``generate`` on several ranks, where a forward of the model is a collective.

[Note: generating on several ranks]
At stage 3 each forward all-gathers the model's groups, so every rank must run as many forwards as the
others. transformers' ``generate`` ends a rank's loop once its own sequences are done (an end-of-sequence
token, its own ``max_new_tokens``) unless ``synced_gpus``, which it turns on by itself for DeepSpeed ZeRO-3
and FSDP only: a rank done first would leave the others in the next forward's all-gathers (on NCCL for
ever), or pair them with its own next collective. So on several ranks at stage 3 an engine model's
``generate`` defaults ``synced_gpus`` to True, as transformers does for those: a rank done early runs
forwards whose tokens it does not keep until every rank is done (one flag all-reduce a token). A
``synced_gpus`` given is kept. Not where the engine's process group leaves out some processes:
transformers' flag all-reduce runs over all of them. Stages 1 and 2 gather only in the first forward after
an update, which every rank's ``generate`` runs. ``infinity.release`` puts the model's own back. Called on
one rank only (``if rank == 0: model.generate(...)``), it waits for the others, as any forward does.

What the room may touch: the roots' ``generate`` attribute, set on the instance.
"""
from __future__ import annotations

import functools
import weakref

import torch.distributed as dist
from torch import nn


class SyncedGenerate:
    """``root.generate`` with ``synced_gpus`` True unless given; ``remove()`` gives ``root`` its class's back."""

    def __init__(self, root: nn.Module) -> None:
        ref = self._root = weakref.ref(root)      # the attribute must not keep its model alive
        own = type(root).generate

        @functools.wraps(own)
        def generate(*args, **kwargs):
            if kwargs.get("synced_gpus") is None:
                kwargs["synced_gpus"] = True
            return own(ref(), *args, **kwargs)

        self._generate = generate
        root.__dict__["generate"] = generate

    def remove(self) -> None:
        root = self._root()
        if root is not None and root.__dict__.get("generate") is self._generate:
            del root.__dict__["generate"]


def sync_generate(roots, ranks, stage: int) -> list[SyncedGenerate]:
    """A ``SyncedGenerate`` for each root that generates, where [Note: generating on several ranks] asks."""
    if ranks.world_size == 1 or stage != 3 or ranks.world_size != dist.get_world_size():
        return []
    return [SyncedGenerate(root) for root in roots
            if callable(getattr(type(root), "generate", None)) and "generate" not in vars(root)]
