"""A model with adapters added after ``infinity.Init`` (parameters the engine does not manage: [Note: unmanaged
parameters] in infinity/optim/unmanaged.py), and its plain PyTorch twin."""
from __future__ import annotations

import torch

import infinity

HOST_FP32 = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}, "precision": {"dtype": "float32"}}


class Adapted(torch.nn.Module):
    """Two layers built in Init; adapters added after it (peft's get_peft_model does so): ``lora``, and ``extra``,
    used only where the forward is given ``extra``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, extra: bool = False):
        h = torch.tanh(self.inner(x))
        h = h + self.lora(h)
        if extra:
            h = h + self.extra(h)
        return self.outer(h).pow(2).mean()


def adapted(engine: bool, extra: bool = False) -> Adapted:
    """The model, built in ``infinity.Init`` (host tiers, fp32) when ``engine``, else plain; the same values either
    way: its layers from seed 0, then its adapters from seed 1 (``extra`` too when asked)."""
    torch.manual_seed(0)
    if engine:
        with infinity.Init(HOST_FP32):
            model = Adapted()
    else:
        model = Adapted()
    torch.manual_seed(1)
    model.lora = torch.nn.Linear(8, 8)
    if extra:
        model.extra = torch.nn.Linear(8, 8)
    return model
