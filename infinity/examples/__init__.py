"""Runnable examples: the GPT the demo and benchmarks train, its data, and the training loop.

``demo`` is ``make demo``; ``train_gpt`` trains the example GPT with infinity or plain
PyTorch (``gpt``, ``data``), metering each step (``meter``, ``console``); ``runs`` runs
one configuration in a fresh process for the benchmarks. What the room may touch: only
infinity's public face (``infinity.Init``, ``AdamW``, ``stats``, checkpoints, the registry), as a
user would.
"""
