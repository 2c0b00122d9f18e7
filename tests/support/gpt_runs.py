"""A small example GPT built under a preset on the CPU in bf16, and its losses over a few steps."""
from __future__ import annotations

import torch

import infinity
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset


def build(nvme_dir, name: str, n_layer: int = 3, **sections):
    """(model, shape): the tiny GPT with ``n_layer`` blocks under preset ``name`` (seed 0), CPU, bf16;
    ``sections`` override config sections. ``nvme_dir`` is created if missing."""
    nvme_dir.mkdir(parents=True, exist_ok=True)
    shape = preset("tiny", n_layer=n_layer)
    torch.manual_seed(0)
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(nvme_dir)}, "precision": {"dtype": "bfloat16"},
                 **sections}
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
    return model, shape


def losses(model, shape, steps: int = 4, batch: int = 4, weight_decay: float = 0.1) -> list[float]:
    """Train ``steps`` AdamW steps on random tokens (seed 0); the loss of each."""
    opt = infinity.AdamW(model, lr=1e-3, weight_decay=weight_decay)
    data = batches("random", batch, 32, shape.vocab_size, seed=0)
    out = []
    for _ in range(steps):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    opt.synchronize()
    return out


def trained(nvme_dir, name: str, steps: int = 3, **sections) -> tuple[list[float], list[torch.Tensor]]:
    """The tiny GPT under preset ``name`` (``build``) trained ``steps`` steps: its losses and its final
    parameters, gathered."""
    model, shape = build(nvme_dir, name, **sections)
    out = losses(model, shape, steps=steps)
    with infinity.gathered(model):
        params = [p.detach().clone() for p in model.parameters()]
    return out, params
