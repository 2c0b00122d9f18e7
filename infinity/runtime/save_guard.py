"""transformers' ``save_pretrained`` on an engine model, refused before it writes anything.

[Note: save_pretrained refused before it writes]
``model.save_pretrained(d)`` writes ``config.json`` and ``generation_config.json`` first, and only then takes
``model.state_dict()``, which refuses a released parameter (its values are shards over ranks and tiers): the
refusal came after those files, written over what the directory held, beside no weights. So each module of an
engine model whose class has transformers' ``save_pretrained`` gets one on its instance that refuses first,
naming ``infinity.save_pretrained``, unless the caller gives the values (``state_dict=``, as
``infinity.save_pretrained`` does for a peft model and as ``state_dict=infinity.state_dict(model)`` does) or every
parameter of the module is gathered (inside ``infinity.gathered``), where transformers' own goes on as on a
plain model. ``push_to_hub`` saves through it. ``infinity.release`` gives each module its own back.

``state_dict_refusal`` words what ``model.state_dict()`` of a released parameter raises, by the caller on the
stack (accelerate's ``save_state``, peft's ``save_pretrained``), and lets through peft's calls that read the
keys alone.

What the room may touch: the modules' ``save_pretrained`` attribute, set on the instance.
"""
from __future__ import annotations

import functools
import inspect
import weakref

from torch import nn

from infinity.errors import EngineError
from infinity.param_group import ParamState
from infinity.runtime.placeholder import keys_only_caller, on_stack
from infinity.runtime.synced_generate import OnInstance

_REFUSED = (
    "{cls}.save_pretrained(): the model was built in infinity.Init, and transformers saves it through "
    "model.state_dict(), whole, while its parameters are shards over ranks and tiers. Nothing was written. On "
    "every rank, save with infinity.save_pretrained(model, d): the same files, each module's tensors written as "
    "it is gathered (or model.save_pretrained(d, state_dict=infinity.state_dict(model)), the whole state dict "
    "held in host memory)")


def guarded(module: nn.Module, own, coordinator) -> OnInstance:
    """``module.save_pretrained`` refused while the module's parameters are released and no ``state_dict`` is
    given."""
    ref = weakref.ref(module)      # the attribute must not keep its model, nor its engine, alive
    engine_groups = weakref.ref(coordinator)
    signature = inspect.signature(own)

    @functools.wraps(own)
    def save_pretrained(*args, **kwargs):
        module = ref()
        given = signature.bind_partial(module, *args, **kwargs).arguments.get("state_dict")
        if given is None and _released(module, engine_groups()):
            raise EngineError(_REFUSED.format(cls=type(module).__name__))
        return own(module, *args, **kwargs)

    return OnInstance(module, "save_pretrained", save_pretrained, own)


def _released(module: nn.Module, coordinator) -> bool:
    if coordinator is None:
        return False
    groups = coordinator.group_of
    return any(groups[p].state is not ParamState.AVAILABLE for p in module.parameters() if p in groups)


def guard_save_pretrained(roots, coordinator) -> list[OnInstance]:
    """A guarded ``save_pretrained`` (``OnInstance``) for each module under ``roots`` whose ``save_pretrained`` is transformers' own."""
    guards, seen = [], set()
    for root in roots:
        for module in root.modules():
            own = getattr(type(module), "save_pretrained", None)
            if own is None or id(module) in seen or not any(
                    c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils"
                    for c in type(module).__mro__):
                continue
            seen.add(id(module))
            guards.append(guarded(module, own, coordinator))
    return guards


def state_dict_refusal(name: str) -> str | None:
    """What ``model.state_dict()`` of a released parameter (``name``) raises, naming the way for the caller on the
    stack; None where the caller asks for the keys alone and takes no value (peft finding an adapter's entries
    in a ``modules_to_save`` wrapper, or the keys a saved adapter loads into: the parameters it reads from are
    those of a ``state_dict(keep_vars=True)``, [Note: an adapter gathered alone] in infinity/runtime/peft_save.py).
    Looked at only on that error path.

    [Note: accelerate's save_state]
    ``Accelerator.save_state`` takes ``model.state_dict()`` of every prepared model first and calls
    the hooks of ``register_save_state_pre_hook`` only after, with those state dicts, so no hook can
    route an engine model to ``infinity.save_checkpoint`` instead. Its ``state_dict()`` is refused
    as any other is (before_state_dict), and this names what a user of ``save_state`` does instead.
    ``load_state`` is refused by a pre-hook before it reads a file ([Note: accelerate's load_state] in
    infinity/optim/checks.py). Looked at only on that error path.
    """
    if keys_only_caller():
        return None
    if on_stack("accelerate.accelerator", "save_state"):
        return ACCELERATE_SAVE_STATE
    if on_stack("peft.utils.save_and_load", "get_peft_model_state_dict"):
        return PEFT_SAVE_PRETRAINED
    return (f"state_dict(): parameter {name!r} is released (its values are shards over ranks and tiers); take it "
            "with infinity.state_dict(model) (a transformers model: infinity.save_pretrained(model, d)) or inside "
            "`with infinity.gathered(model):`, or save with infinity.save_checkpoint and infinity-consolidate")


ACCELERATE_SAVE_STATE = (
    "accelerator.save_state(): the model was built in infinity.Init, and accelerate saves a model through "
    "model.state_dict() on every process, whole, before any hook of its own runs; an engine model's parameters and "
    "optimizer states are shards over ranks and tiers, saved by infinity. No file was written. On every rank, save "
    "with infinity.save_checkpoint(dir, model, opt) and resume with infinity.load_checkpoint(dir, model, opt) "
    "(weights, optimizer states, step count and RNG); keep the scheduler's state_dict() beside them; "
    "infinity-consolidate makes the weights one file")


PEFT_SAVE_PRETRAINED = (
    "PeftModel.save_pretrained(): the model was built in infinity.Init, and peft takes model.state_dict() whole, "
    "on this process alone, to keep the adapter's entries; the base weights are shards over ranks and tiers. No "
    "weights were written. On every rank, save with infinity.save_pretrained(model, d): it writes what "
    "PeftModel.save_pretrained writes (adapter_model.safetensors, adapter_config.json), gathering only the "
    "adapter; or, on every rank, model.save_pretrained(d, state_dict=infinity.state_dict(model)) (the whole "
    "model copied to host memory first)")
