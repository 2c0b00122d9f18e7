"""The engine's user-facing error: a model used in a way infinity does not support.

Each room raises its own typed errors where they say more (``ConfigError``,
``CheckpointError``, ``ParamStateError``, ``NotManagedError``, ``TilingError``); this one is
for misuse of an engine model or its optimizer, and is shared by the rooms that meet
the user's training loop (runtime, optim). It imports nothing.
"""


class EngineError(RuntimeError):
    """The model was used in a way the engine does not support; the message says how to fix it."""
