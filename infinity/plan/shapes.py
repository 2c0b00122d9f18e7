"""Censuses of decoder-only transformers from their layer shapes, without building or allocating a model.

[Note: censuses from shapes]
One group per transformer block (the presets' ``partition.units = "auto"``), plus the token embedding,
the final norm and an untied output head, as the engine forms them for a Llama- or GPT-style model: a
block holds the attention projections (q and o: hidden x hidden; k and v: hidden x kv_hidden), the MLP
(two matrices hidden x ffn for a plain MLP, three for a gated one) and two norms of ``hidden``. Used where
a model is described by its sizes (tests of placements, ``infinity-plan --shape``); a real model is better
read with ``census_of_module`` on the meta device.
"""
from __future__ import annotations

from infinity.plan.census import CensusGroup, ModelCensus

# name -> (layers, hidden, ffn, vocab, kv_hidden, gated MLP)
KNOWN_SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "gpt-1.3b": (24, 2048, 8192, 50304, 2048, False),
    "llama-7b": (32, 4096, 11008, 32000, 4096, True),
    "llama-13b": (40, 5120, 13824, 32000, 5120, True),
    "llama-70b": (80, 8192, 28672, 32000, 1024, True),
}


def transformer_census(layers: int, hidden: int, ffn: int, vocab: int, kv_hidden: int | None = None,
                       gated: bool = True, source: str | None = None) -> ModelCensus:
    """The census of a decoder-only transformer of these sizes (see [Note: censuses from shapes]).

    Examples
    --------
    >>> transformer_census(*KNOWN_SHAPES["llama-7b"]).num_params
    6738415616
    """
    kv = hidden if kv_hidden is None else kv_hidden
    mlp = (3 if gated else 2) * hidden * ffn
    block = (2 * hidden * hidden, 2 * hidden * kv, mlp, 2 * hidden)
    groups = [CensusGroup("embed", (vocab * hidden,))]
    groups += [CensusGroup(f"layers.{i}", block) for i in range(layers)]
    groups += [CensusGroup("norm", (hidden,)), CensusGroup("lm_head", (vocab * hidden,))]
    return ModelCensus(source=source or f"transformer {layers}x{hidden}", groups=tuple(groups),
                       widened_numel=vocab * hidden)


def known_census(name: str) -> ModelCensus:
    """The census of one of ``KNOWN_SHAPES``."""
    return transformer_census(*KNOWN_SHAPES[name], source=name)


__all__ = ["KNOWN_SHAPES", "known_census", "transformer_census"]
