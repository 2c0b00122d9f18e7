"""Training batches for the examples, with no downloads.

Three sources, each an endless iterator of ``(inputs, targets)`` token tensors of
shape ``(batch, seq)``:
- ``random``: fresh uniform tokens every step (a throughput workload; the loss
  stays near ``log(vocab)``);
- ``repeat``: one random batch, repeated (the loss must fall: a quick check that
  the updates reach the parameters);
- ``text``: windows of the bundled ``tiny_corpus.txt``, one token per byte (the
  vocabulary must have at least 256 entries).

Each rank of a data-parallel job passes its own ``rank``, so ranks see different
batches from the same seed.
"""
from __future__ import annotations

from importlib import resources
from typing import Iterator

import torch

SOURCES = ("random", "repeat", "text")
_CORPUS = "tiny_corpus.txt"


def corpus_tokens() -> torch.Tensor:
    """The bundled text as a 1-D int64 tensor of byte values."""
    raw = resources.files("infinity.examples").joinpath(_CORPUS).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def batches(source: str, batch: int, seq: int, vocab_size: int, *, seed: int = 0, rank: int = 0,
            device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless iterator of ``(inputs, targets)``, targets being inputs shifted by one token.

    Parameters
    ----------
    source:
        ``"random"``, ``"repeat"`` or ``"text"``.
    batch, seq:
        Shape of each tensor.
    vocab_size:
        Token ids are drawn below this (``text`` needs >= 256).
    seed, rank:
        The generator is seeded with ``seed + 1000 * rank``.
    device:
        Where the tensors are placed.

    Examples
    --------
    >>> x, y = next(batches("repeat", 2, 8, 100))
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), True)
    """
    if source not in SOURCES:
        raise ValueError(f"data source {source!r}: choose one of {', '.join(SOURCES)}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch ({batch}) and seq ({seq}) must be >= 1")
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    if source == "text":
        if vocab_size < 256:
            raise ValueError(f"data source 'text' uses byte tokens and needs vocab_size >= 256, got {vocab_size}")
        yield from _text(batch, seq, gen, device)
        return
    fixed = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen) if source == "repeat" else None
    while True:
        window = fixed if fixed is not None else torch.randint(0, vocab_size, (batch, seq + 1), generator=gen)
        yield window[:, :-1].to(device), window[:, 1:].to(device)


def _text(batch: int, seq: int, gen: torch.Generator, device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    tokens = corpus_tokens()
    if tokens.numel() < seq + 2:
        raise ValueError(f"the bundled corpus has {tokens.numel()} tokens, too few for seq={seq}")
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1].to(device), window[:, 1:].to(device)
