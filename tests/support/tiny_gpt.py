"""The small GPT-style models of the engine tests: tied embeddings, layer norms, attention, MLP.

``TinyGPT`` is the model of the parity, feature and prefetch tests; ``BufferedGPT`` adds
the persistent and non-persistent buffers that checkpoints must save (or leave out).
"""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attn_bias: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=attn_bias)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Tied embeddings, ``layers`` blocks, a non-persistent ``scale`` buffer on the logits.

    ``attn_bias`` is off by default: the key bias has an exactly-zero true gradient, so Adam
    amplifies rounding noise there and parameter comparisons would test noise, not the engine.
    """

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16,
                 attn_bias: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList([Block(d, heads, attn_bias) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.ones(1), persistent=False)
        self.apply(self._init)
        nn.init.normal_(self.wpe, std=0.02)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)) * self.scale
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class BufferedGPT(TinyGPT):
    """``TinyGPT`` with an attention bias, a persistent ``pos_scale`` buffer used in forward, and,
    with ``scratch``, a second non-persistent buffer: what checkpoints save and leave out."""

    def __init__(self, vocab: int = 64, d: int = 32, h: int = 4, n: int = 2, T: int = 16,
                 scratch: bool = True) -> None:
        super().__init__(vocab, d, h, n, T, attn_bias=True)
        self.register_buffer("pos_scale", torch.ones(T, 1))
        if scratch:
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]] * self.pos_scale[: idx.shape[1]].to(self.wpe.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def engine_and_plain(cfg):
    """A TinyGPT built under ``infinity.Init(cfg)`` and a plain one with the same initial weights."""
    import infinity

    torch.manual_seed(0)
    plain = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    return model, plain


def batches(steps: int, batch: int, seq: int = 16, vocab: int = 64, seed: int = 1):
    """Deterministic (idx, targets) pairs."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(steps)]


def trained_on_host(model_cls=None, steps: int = 2):
    """A model of ``model_cls`` (TinyGPT) built in ``infinity.Init`` with host tiers and its ``infinity.AdamW``,
    trained ``steps`` steps: what a checkpoint test saves."""
    import infinity

    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
        model = (model_cls or TinyGPT)()
    opt = infinity.AdamW(model, lr=1e-2)
    for idx, tgt in batches(steps, 4):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    return model, opt
