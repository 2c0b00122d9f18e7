"""The engine's user-facing error: a model used in a way infinity does not support.

Each room raises its own typed errors where they say more (``ConfigError``,
``CheckpointError``, ``ParamStateError``, ``NotManagedError``, ``TilingError``); this one is
for misuse of an engine model or its optimizer, and is shared by the rooms that meet
the user's training loop (runtime, optim). It imports nothing.
"""


class EngineError(RuntimeError):
    """The model was used in a way the engine does not support; the message says how to fix it."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``: Python 3.10 has no notes, and keeps it in ``__notes__`` (shown from 3.11 on), so
    that an error path never fails on the interpreter's version."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


def released_message(what: str) -> str:
    """The message of any use of a model, or of its optimizer, after ``infinity.release(model)``."""
    return (f"{what}: this model's engine was released by infinity.release(model) (its shards, swap files and "
            "buffers are gone); build the model again under infinity.Init (and load a checkpoint) to use it")


# Shared by the hooks (torch.jit.script asks each hook its name) and the engine (torch.jit.trace runs a forward).
TORCHSCRIPT = (
    "torch.jit.script and torch.jit.trace (and torch.onnx.export's TorchScript exporter) on a model infinity "
    "manages: they compile a copy that holds the parameters' current tensors, and this model's parameters are "
    "shards that infinity's hooks (Python, which TorchScript cannot compile) gather and release around each module. "
    "To export, load infinity.state_dict(model) into the same model built outside infinity.Init (or "
    "consolidate a checkpoint with infinity-consolidate) and script or trace that; "
    "torch.compile(model) works on the managed model")


def foreign_optimizer_message(what: str, name: str) -> str:
    """A ``torch.optim`` optimizer over an engine parameter ([Note: foreign optimizers] in
    infinity/optim/torch_guard.py): ``what`` is the call refused, ``name`` the parameter's."""
    return (f"{what}: it holds {name!r}, a parameter of a model built in infinity.Init, whose values and gradients "
            "live in infinity's shards, so it would update nothing; use infinity.AdamW (or infinity.Adam) with the "
            "same arguments: infinity.AdamW(model.parameters(), lr=...) or torch-style param groups (under "
            "transformers.Trainer: infinity.Trainer, which builds it)")
