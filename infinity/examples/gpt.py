"""A small GPT-style language model, written with plain PyTorch modules.

The model infinity's examples and benchmarks train: token and position embeddings,
pre-LayerNorm blocks of causal self-attention (``nn.Linear`` projections and
``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm, and an
output head tied to the token embedding. Nothing in it knows about infinity: build
it inside ``infinity.Init`` to shard it, or outside for plain PyTorch.

[Note: initialisation in reset_parameters]
``nn.Linear`` and ``nn.Embedding`` call ``self.reset_parameters()`` from their
``__init__``; the subclasses below override it with GPT-2's initialisation
(normal, std 0.02; residual projections scaled by 1/sqrt(2 * n_layer)). So each
weight is drawn once, inside the constructor of the module that owns it. Inside
``infinity.Init`` a module is sharded when its constructor returns; an
initialisation pass afterwards (``model.apply(init_fn)``) would gather every
parameter again, which for a model larger than host memory means reading and
rewriting all of it once more. The random draws happen in the same order with
or without infinity, so ``torch.manual_seed(s)`` gives identical weights in both.

[Note: tied output head]
The head computes ``x @ wte.weight.T`` with the embedding's own parameter, passed
to it at call time; ``LMHead`` has no parameter of its own. No second weight is
created, initialised and then thrown away (at 4B parameters the head alone is
~150M parameters), and infinity sees the embedding weight used by the head, so
it gathers it for the head's forward and backward (infinity/runtime/foreign.py, [Note: foreign
parameters]). The product is ``F.linear`` unless the model is built with another function of
its signature (``GPT(cfg, linear=...)``: a training script asking infinity for fp32 products of
bf16 layers on the CPU passes ``infinity.tiling.widened.widened_linear``, which infinity cannot put
in a head it does not see as a linear layer).

Examples
--------
>>> from infinity.examples.gpt import GPT, preset
>>> cfg = preset("tiny")
>>> model = GPT(cfg)
>>> idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
>>> model(idx, idx).item() > 0
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT model.

    Attributes
    ----------
    n_layer:
        Number of transformer blocks.
    d_model:
        Width of the residual stream.
    n_head:
        Attention heads per block; must divide ``d_model``.
    vocab_size:
        Size of the token vocabulary (embedding rows, output classes).
    seq_len:
        Longest sequence the position embedding covers.
    mlp_ratio:
        Hidden width of the MLP as a multiple of ``d_model``.
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = 50304
    seq_len: int = 1024
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: n_head ({self.n_head}) must divide d_model ({self.d_model})")

    @property
    def n_params(self) -> int:
        """Exact parameter count (the tied head adds none)."""
        d, f = self.d_model, self.mlp_ratio * self.d_model
        block = (2 * 2 * d                    # two LayerNorms
                 + d * 3 * d + 3 * d          # qkv
                 + d * d + d                  # attention output
                 + d * f + f + f * d + d)     # MLP
        return (self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d)

    def states_nbytes(self, bytes_per_param: int = 16) -> int:
        """Model states in bytes: fp32 master + Adam m, v + fp32 compute copy = 16 B/param."""
        return self.n_params * bytes_per_param

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token at sequence length ``seq_len`` (default: ``self.seq_len``).

        ``6 * N + 12 * n_layer * d_model * T`` (PaLM, appendix B): two FLOPs per
        multiply-add, forward plus twice that backward, over every weight used in a
        matmul (the tied head multiplies by the whole token embedding; the position
        embedding is only added), plus the attention scores and their weighted sum.
        """
        t = self.seq_len if seq_len is None else seq_len
        return 6 * (self.n_params - self.seq_len * self.d_model) + 12 * self.n_layer * self.d_model * t


# Shapes follow GPT-2 / GPT-3 (Brown et al. 2020, table 2.1) with the vocabulary padded
# to a multiple of 64; "20M" is a small model for these 2-core machines and "4B" is the
# size whose 16 B/param states exceed 2.5x the 24 GiB of RAM here: a model that fits
# only with its states on NVMe.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64),
    "20M": GPTConfig(n_layer=6, d_model=384, n_head=6, vocab_size=16384, seq_len=256),
    "125M": GPTConfig(n_layer=12, d_model=768, n_head=12),
    "350M": GPTConfig(n_layer=24, d_model=1024, n_head=16),
    "760M": GPTConfig(n_layer=24, d_model=1536, n_head=16),
    "1.3B": GPTConfig(n_layer=24, d_model=2048, n_head=16),
    "2.7B": GPTConfig(n_layer=32, d_model=2560, n_head=32),
    "4B": GPTConfig(n_layer=36, d_model=3072, n_head=24),
    "6.7B": GPTConfig(n_layer=32, d_model=4096, n_head=32),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The model shape called ``name`` (see ``PRESETS``), with fields replaced by ``overrides``.

    Examples
    --------
    >>> preset("125M", seq_len=128).n_layer
    12
    """
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(PRESETS)}") from None
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def shape_for_params(n_params: float, vocab_size: int = 50304, seq_len: int = 1024,
                     width_per_layer: int = 80, d_model: int | None = None) -> GPTConfig:
    """A GPT shape with about ``n_params`` parameters, GPT-3-like proportions.

    Depth and width grow together (``d_model ~ width_per_layer * n_layer``, GPT-3's
    ratio is 64-128), ``d_model`` a multiple of 128 with 64-wide heads, so a ladder
    of sizes scales every layer, not just the count of layers. With ``d_model`` given,
    only the depth is chosen (a ladder whose largest layer stays the same size).

    Examples
    --------
    >>> cfg = shape_for_params(4e9)
    >>> cfg.d_model, cfg.n_layer, round(cfg.n_params / 1e9, 2)
    (2944, 37, 4.0)
    """
    if n_params < 1e5:
        raise ValueError(f"shape_for_params: {n_params:.0f} parameters is below the smallest shape (1e5)")
    if d_model is None:
        d = (width_per_layer * n_params / 12) ** (1 / 3)
        d_model = max(128, int(round(d / 128)) * 128)
    per_layer = 12 * d_model * d_model + 13 * d_model
    n_layer = max(1, int(round((n_params - (vocab_size + seq_len) * d_model) / per_layer)))
    return GPTConfig(n_layer=n_layer, d_model=d_model, n_head=d_model // 64, vocab_size=vocab_size,
                     seq_len=seq_len)


class Linear(nn.Linear):
    """``nn.Linear`` initialised as GPT-2 does (see [Note: initialisation in reset_parameters])."""

    def __init__(self, in_features: int, out_features: int, std: float = _INIT_STD) -> None:
        self.init_std = std
        super().__init__(in_features, out_features, bias=True)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised with std 0.02 (GPT-2)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one qkv projection, SDPA, one output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = Linear(cfg.d_model, cfg.d_model, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = Linear(cfg.d_model, hidden)
        self.proj = Linear(hidden, cfg.d_model, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Logits from the final hidden states and the (tied) token embedding weight, by ``linear``."""

    def __init__(self, linear=F.linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight)


class GPT(nn.Module):
    """A GPT-style decoder-only language model.

    Parameters
    ----------
    cfg:
        The model shape, e.g. ``preset("125M")``.
    linear:
        The tied head's product, ``linear(x, weight)`` (default ``F.linear``; [Note: tied output head]).

    Examples
    --------
    >>> model = GPT(preset("tiny"))                     # doctest: +SKIP
    >>> loss = model(idx, targets); loss.backward()     # doctest: +SKIP
    """

    # The module a device map keeps whole (transformers' convention; partition.units = "auto" reads it).
    _no_split_modules = ["Block"]

    def __init__(self, cfg: GPTConfig, *, linear=F.linear) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = LMHead(linear)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``, or the mean cross-entropy loss when ``targets`` is given."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x), self.wte.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
