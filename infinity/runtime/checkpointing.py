"""``infinity.activation_checkpoint``: activation checkpointing for plain models, whose saved inputs the engine can offload.

A checkpointed region keeps only its inputs from forward to backward and recomputes the
rest; with ``activations.offload`` set, those inputs wait in host memory or on NVMe
([Note: which saved tensors move] in infinity/runtime/activations.py). This is
``torch.utils.checkpoint`` (non-reentrant) and nothing more: the engine recognises any
checkpoint, this one included, so models that call ``torch.utils.checkpoint`` themselves
(transformers' ``gradient_checkpointing_enable()``) need nothing from here.

It is not called ``infinity.checkpoint``: that name is the room of sharded training
checkpoints (``infinity.save_checkpoint``), and a package attribute cannot be both.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn


class Checkpointed(nn.Module):
    """``module`` run under an activation checkpoint: only its inputs are saved for backward.

    The wrapped module is the child ``module``, so its parameters' names gain a ``module.``
    level (as with any wrapper module); nothing of the module itself changes.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False, **kwargs)


def activation_checkpoint(module_or_function, *args, use_reentrant: bool = False, **kwargs):
    """Activation checkpointing: wrap a module, or run a function under a checkpoint.

    ``checkpoint(module)`` returns a :class:`Checkpointed` module to put in the model where
    ``module`` was; ``checkpoint(function, *args, **kwargs)`` is ``torch.utils.checkpoint.checkpoint``
    (non-reentrant unless ``use_reentrant=True``).

    Examples
    --------
    >>> model.blocks = nn.ModuleList(infinity.activation_checkpoint(b) for b in model.blocks)  # doctest: +SKIP
    >>> y = infinity.activation_checkpoint(block, x)  # doctest: +SKIP
    """
    if isinstance(module_or_function, nn.Module) and not args and not kwargs:
        return Checkpointed(module_or_function)
    if not callable(module_or_function):
        raise TypeError(f"infinity.activation_checkpoint: expected an nn.Module or a function, got "
                        f"{type(module_or_function).__name__}")
    return torch.utils.checkpoint.checkpoint(module_or_function, *args, use_reentrant=use_reentrant, **kwargs)
