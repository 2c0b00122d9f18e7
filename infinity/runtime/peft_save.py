"""A ``peft.PeftModel``'s adapter, saved as ``PeftModel.save_pretrained`` saves it, gathering the adapter alone.

[Note: an adapter gathered alone]
``PeftModel.save_pretrained`` takes the whole ``model.state_dict()`` and keeps the adapter's entries
(``peft.get_peft_model_state_dict``): on an engine model that would gather every base weight to throw it
away. Which entries peft keeps is decided by their names, so it is asked first with the state dict's
parameters themselves (``state_dict(keep_vars=True)``, which a released parameter answers); the walk of
``infinity.state_dict`` (infinity/runtime/gathered.py) then gathers only the subtrees holding those, and
peft's own ``save_pretrained`` is given that state dict (its ``state_dict=`` argument), so the files, the
config and the model card are peft's. A group holding both (a block's adapters beside its trainable
norms, under units) is gathered whole, once per subtree that reads it.
"""
from __future__ import annotations

import torch
from torch import nn

from infinity.runtime.gathered import state_dict_parts


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False without peft installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_state_dict(engine, model: nn.Module, *, dtype: torch.dtype | None, keep: bool) -> dict:
    """The entries of ``model.state_dict()`` that ``PeftModel.save_pretrained`` keeps, as host copies (in
    ``dtype`` if given), gathered alone (see [Note: an adapter gathered alone]). Every rank calls it; only
    with ``keep`` are the copies made (else an empty dict)."""
    from peft.utils import get_peft_model_state_dict

    by_name = model.state_dict(keep_vars=True)
    kept = {id(value) for adapter in model.peft_config
            for value in get_peft_model_state_dict(model, state_dict=by_name, adapter_name=adapter).values()}
    wanted = [key for key, value in by_name.items() if id(value) in kept]
    prefixes = {key[:i + 1] for key in wanted for i, c in enumerate(key) if c == "."}
    wanted_set = set(wanted)
    out: dict[str, torch.Tensor] = {}
    for part in state_dict_parts(engine, model, skip=lambda prefix: bool(prefix) and prefix not in prefixes):
        for key, value in part.items():
            if keep and key in wanted_set:
                to = dtype if dtype is not None and value.is_floating_point() else value.dtype
                out[key] = value.detach().to("cpu", dtype=to, copy=True)
    return {key: out[key] for key in wanted if key in out}
