"""A Llama-shaped decoder, written with plain PyTorch modules, for the scale benchmark.

Pre-RMSNorm blocks of causal self-attention with rotary position embeddings (no
position table, no biases) and a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), a
final RMSNorm and an output head that is its own weight (untied from the token
embedding). The shapes follow Llama (Touvron et al. 2023): ``llama-6.7B`` is
hidden 4096, 32 layers, 32 heads, intermediate 11008, vocabulary 32000, 6.74B
parameters. Initialisation is done inside each module's constructor, as in
``gpt.py`` (see [Note: initialisation in reset_parameters] there), so a model
built inside ``infinity.Init`` draws every weight once.

RMSNorm normalises in fp32 and rotary angles are computed in fp32 for the
positions of each call, then cast to the activations' dtype: no buffers, so the
model builds on the meta device and under ``infinity.Init`` alike.

Examples
--------
>>> from infinity.examples.llama import Llama, llama_preset
>>> cfg = llama_preset("llama-tiny")
>>> model = Llama(cfg)
>>> idx = torch.randint(0, cfg.vocab_size, (2, 16))
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
class LlamaConfig:
    """The shape of a Llama-style model.

    Attributes
    ----------
    n_layer, d_model, n_head:
        Blocks, width of the residual stream, attention heads (must divide ``d_model``).
    intermediate:
        Hidden width of the SwiGLU MLP (each of gate, up and down has ``d_model x intermediate``).
    vocab_size:
        Token vocabulary (embedding rows and, separately, head rows).
    seq_len:
        Longest sequence a forward accepts (rotary needs no table; this only bounds inputs).
    rope_base:
        Rotary frequency base.
    """

    n_layer: int
    d_model: int
    n_head: int
    intermediate: int
    vocab_size: int = 32000
    seq_len: int = 2048
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "intermediate", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: n_head ({self.n_head}) must divide d_model ({self.d_model}) "
                             "into heads of even width")

    @property
    def n_params(self) -> int:
        """Exact parameter count: embedding + head (untied) + blocks + final norm."""
        d, f = self.d_model, self.intermediate
        block = 2 * d + 4 * d * d + 3 * d * f
        return 2 * self.vocab_size * d + self.n_layer * block + d

    def states_nbytes(self, bytes_per_param: int = 16) -> int:
        """Model states in bytes at ``bytes_per_param`` (16: fp32 master + Adam m, v + fp32 copy)."""
        return self.n_params * bytes_per_param

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: ``6 * N`` over the matmul weights (the embedding is a lookup)
        plus ``12 * n_layer * d_model * T`` for attention (PaLM, appendix B)."""
        t = self.seq_len if seq_len is None else seq_len
        matmul = self.n_params - self.vocab_size * self.d_model - (2 * self.n_layer + 1) * self.d_model
        return 6 * matmul + 12 * self.n_layer * self.d_model * t


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(n_layer=2, d_model=64, n_head=4, intermediate=176, vocab_size=512, seq_len=64),
    "llama-1B": LlamaConfig(n_layer=16, d_model=2048, n_head=16, intermediate=5504),
    "llama-2B": LlamaConfig(n_layer=24, d_model=2560, n_head=20, intermediate=6912),
    "llama-6.7B": LlamaConfig(n_layer=32, d_model=4096, n_head=32, intermediate=11008),
}


def llama_preset(name: str, **overrides) -> LlamaConfig:
    """The shape called ``name`` (see ``LLAMA_PRESETS``) with fields replaced by ``overrides``."""
    try:
        base = LLAMA_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Llama size {name!r}; choose one of {', '.join(LLAMA_PRESETS)}") from None
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` drawn from N(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float = _INIT_STD) -> None:
        self.init_std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class Embedding(nn.Embedding):
    """``nn.Embedding`` drawn from N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the mean square taken in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def _rotary(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs by position-dependent angles."""
    t, hd = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention: q, k, v projections, rotary on q and k, SDPA, output projection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head, self.rope_base = cfg.n_head, cfg.rope_base
        self.q, self.k, self.v = Linear(d, d), Linear(d, d), Linear(d, d)
        self.o = Linear(d, d, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = _rotary(q, self.rope_base), _rotary(k, self.rope_base)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.d_model, cfg.intermediate)
        self.up = Linear(cfg.d_model, cfg.intermediate)
        self.down = Linear(cfg.intermediate, cfg.d_model, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-shaped decoder-only language model; ``forward(idx, targets)`` as ``GPT``'s."""

    # The module a device map keeps whole (transformers' convention; partition.units = "auto" reads it).
    _no_split_modules = ["Block"]

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``, or the mean cross-entropy loss when ``targets`` is given."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"Llama: sequence of {idx.shape[1]} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def llama_6p7b() -> Llama:
    """The 6.7B shape, for ``infinity-plan model --model infinity.examples.llama:llama_6p7b``."""
    return Llama(LLAMA_PRESETS["llama-6.7B"])


def llama_1b() -> Llama:
    """The 1B rehearsal shape, for ``infinity-plan model --model infinity.examples.llama:llama_1b``."""
    return Llama(LLAMA_PRESETS["llama-1B"])
