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

What the room may touch: the modules' ``save_pretrained`` attribute, set on the instance.
"""
from __future__ import annotations

import functools
import inspect
import weakref

from torch import nn

from infinity.errors import EngineError
from infinity.param_group import ParamState

_REFUSED = (
    "{cls}.save_pretrained(): the model was built in infinity.Init, and transformers saves it through "
    "model.state_dict(), whole, while its parameters are shards over ranks and tiers. Nothing was written. On "
    "every rank, save with infinity.save_pretrained(model, d): the same files, each module's tensors written as "
    "it is gathered (or model.save_pretrained(d, state_dict=infinity.state_dict(model)), the whole state dict "
    "held in host memory)")


class GuardedSave:
    """``module.save_pretrained`` refused while the module's parameters are released and no ``state_dict`` is
    given; ``remove()`` gives ``module`` its class's back."""

    def __init__(self, module: nn.Module, own, coordinator) -> None:
        ref = self._module = weakref.ref(module)      # the attribute must not keep its model, nor its engine, alive
        engine_groups = weakref.ref(coordinator)
        signature = inspect.signature(own)

        @functools.wraps(own)
        def save_pretrained(*args, **kwargs):
            module = ref()
            given = signature.bind_partial(module, *args, **kwargs).arguments.get("state_dict")
            if given is None and _released(module, engine_groups()):
                raise EngineError(_REFUSED.format(cls=type(module).__name__))
            return own(module, *args, **kwargs)

        save_pretrained.__signature__ = inspect.signature(functools.partial(own, module))   # the bound method's
        self._save = save_pretrained
        module.__dict__["save_pretrained"] = save_pretrained

    def remove(self) -> None:
        module = self._module()
        if module is not None and module.__dict__.get("save_pretrained") is self._save:
            del module.__dict__["save_pretrained"]


def _released(module: nn.Module, coordinator) -> bool:
    if coordinator is None:
        return False
    groups = coordinator.group_of
    return any(groups[p].state is not ParamState.AVAILABLE for p in module.parameters() if p in groups)


def guard_save_pretrained(roots, coordinator) -> list[GuardedSave]:
    """A ``GuardedSave`` for each module under ``roots`` whose ``save_pretrained`` is transformers' own."""
    guards, seen = [], set()
    for root in roots:
        for module in root.modules():
            own = getattr(type(module), "save_pretrained", None)
            if own is None or id(module) in seen or not any(
                    c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils"
                    for c in type(module).__mro__):
                continue
            seen.add(id(module))
            guards.append(GuardedSave(module, own, coordinator))
    return guards
