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
    engine = _engine(model)
    if engine is None:
        # A wrapper made after the block (peft.get_peft_model's PeftModel): the engine of the model it wraps,
        # whose parameters added since are trained beside it ([Note: unmanaged parameters] in
        # infinity/optim/unmanaged.py).
        engine = next((_engine(m) for name, m in model.named_modules() if name and _engine(m) is not None), None)
    if engine is None:
        raise NotManagedError(
            f"{what}: {type(model).__name__} was not built inside infinity.Init, so its parameters "
            "are not sharded; construct it under `with infinity.Init(config): model = ...`")
    if engine.released:
        raise EngineError(released_message(what))
    return engine


def _engine(module: nn.Module):
    ref = _ENGINES.get(module)
    return ref() if ref is not None else None


def engines_by_added_param() -> dict:
    """``{parameter: engine}`` for the parameters added to a model some engine manages after ``infinity.Init``
    exited (held by its roots, managed by none)."""
    out, seen = {}, set()
    for ref in list(_ENGINES.values()):
        engine = ref()
        if engine is None or engine.released or id(engine) in seen:
            continue
        seen.add(id(engine))
        for root in getattr(engine, "roots", None) or []:
            for p in root.parameters():
                if p not in engine.coordinator.group_of:
                    out.setdefault(p, engine)
    return out


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
