"""Which engine manages which model.

[Note: engine registry]
The engine never writes attributes onto the user's modules or parameters
(STYLE.md 2). Like FSDP2's composable-state mapping, a weak-keyed dictionary maps
each managed module to its engine; entries vanish with the module. The values
are weak too: the engine references the model, so a strong value would keep its
own key alive forever. The engine lives as long as the model's hooks, which hold it.
"""
from __future__ import annotations

import weakref

from torch import nn

from infinity.errors import EngineError, released_message

_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class NotManagedError(TypeError):
    """A model or parameter that infinity does not manage was passed to an infinity API."""


def register(module: nn.Module, engine) -> None:
    _ENGINES[module] = weakref.ref(engine)


def engine_of(model: nn.Module, what: str = "this call"):
    """The engine managing ``model``; a clear error when it was built outside ``infinity.Init``."""
    if not isinstance(model, nn.Module):
        raise NotManagedError(f"{what}: expected the nn.Module built inside infinity.Init, "
                              f"got {type(model).__name__}")
    # torch.compile(model) returns a wrapper whose one link to the model is ``_orig_mod`` (the
    # attribute accelerate's unwrap_model reads too): infinity calls accept the compiled model.
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    ref = _ENGINES.get(model)
    engine = ref() if ref is not None else None
    if engine is None:
        inner = next(((name, m) for name, m in model.named_modules() if name and _engine(m) is not None), None)
        if inner is not None:
            raise NotManagedError(f"{what}: {type(model).__name__} wraps {inner[0]!r}, built inside infinity.Init, "
                                  f"but was made after the block{_added_after(model, _engine(inner[1]))}. "
                                  f"{ADAPTERS_INSIDE_INIT}")
        raise NotManagedError(
            f"{what}: {type(model).__name__} was not built inside infinity.Init, so its parameters "
            "are not sharded; construct it under `with infinity.Init(config): model = ...`")
    if engine.released:
        raise EngineError(released_message(what))
    return engine


ADAPTERS_INSIDE_INIT = (
    "Parameters added after infinity.Init exited (peft.get_peft_model on a model built earlier, as TRL's "
    "SFTTrainer(peft_config=...) does) are plain tensors, whole on the device, that infinity neither shards, "
    "steps nor saves. Add the adapters inside the block: `with infinity.Init(config): model = ...; model = "
    "peft.get_peft_model(model, lora_config)`; then infinity.AdamW, infinity.save_pretrained (the adapter, as "
    "PeftModel.save_pretrained writes it) and infinity.Trainer take the PeftModel (to TRL's SFTTrainer pass it "
    "with no peft_config)")


def _engine(module: nn.Module):
    ref = _ENGINES.get(module)
    return ref() if ref is not None else None


def _added_after(model: nn.Module, engine) -> str:
    """``: its parameter 'x' (and n more) is not managed by infinity`` for the first parameter of ``model`` the
    engine does not manage, or nothing."""
    if engine is None:
        return ""
    names = [name for name, p in model.named_parameters() if p not in engine.coordinator.group_of]
    if not names:
        return ""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f": its parameter {names[0]!r}{more} {'are' if more else 'is'} not managed by infinity"


def name_in_engine(param) -> str | None:
    """The name of ``param`` in a model some engine manages (a parameter added to it after ``infinity.Init``
    exited), or None."""
    for ref in list(_ENGINES.values()):
        engine = ref()
        for root in (getattr(engine, "roots", None) or []) if engine is not None else []:
            for name, p in root.named_parameters():
                if p is param:
                    return name
    return None


def engine_of_param(param, what: str = "this call"):
    """The engine managing ``param`` (a parameter of a model built inside ``infinity.Init``), or None."""
    seen = set()
    for ref in list(_ENGINES.values()):
        engine = ref()
        if engine is None or engine.released or id(engine) in seen:
            continue
        seen.add(id(engine))
        if param in engine.coordinator.group_of:
            return engine
    return None
