"""``infinity.release``: give back a model's swap files, buffers and directory locks now.

What the room holds: the public function only; the work is ``Engine.release`` (see
[Note: releasing] in infinity/runtime/engine.py).
"""
from __future__ import annotations

from torch import nn

from infinity import registry


def release(model: nn.Module) -> None:
    """Free everything infinity holds for ``model``: swap files, directory locks, pinned buffers.

    Waits for a running optimizer update, removes the engine's hooks, closes the tiers
    (the swap files are deleted and their directories unlocked) and drops the engine's
    and its optimizer's buffers. Afterwards a forward, ``state_dict()``, ``infinity.stats``
    or a call of the model's optimizer raises, naming ``infinity.release``; a new
    ``infinity.Init`` may use the same ``nvme_path`` at once. Releasing twice is an error
    like any other use; save first (``infinity.save_checkpoint``) what must outlive it.

    Parameters
    ----------
    model:
        A model built inside ``infinity.Init`` (the root, or any module of it: the whole
        engine is released).

    Examples
    --------
    >>> import torch, infinity
    >>> with infinity.Init({"tiers": {"params": "host"}}):
    ...     model = torch.nn.Linear(4, 3)
    >>> infinity.release(model)
    >>> model(torch.ones(4))
    Traceback (most recent call last):
    ...
    infinity.errors.EngineError: Linear.forward(): this model's engine was released by infinity.release(model) ...
    """
    registry.engine_of(model, "infinity.release").release()
