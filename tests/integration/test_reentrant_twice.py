"""A module called twice under reentrant checkpoints gets both calls' gradients, as in plain torch.

``torch.utils.checkpoint(..., use_reentrant=True)`` runs a nested backward per call: a module called
twice (weights shared between calls, blocks looped) stores its parameters' gradients twice in one
backward. The engine took the first, re-armed the group when the second call recomputed, and autograd
added the second onto the ``.grad`` just taken: that gradient was counted twice and training drifted
from plain torch from the second step on (see ``GradReducer.reopen`` in infinity/runtime/grads.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import infinity

WIDTH = 16


class Looped(nn.Module):
    def __init__(self, reentrant: tuple[bool, bool]) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        a, b = torch.tanh(self.a(x)), torch.tanh(self.b(x))
        first, second = self.reentrant
        h = ckpt.checkpoint(self.shared, a, use_reentrant=first) * ckpt.checkpoint(self.shared, b,
                                                                                  use_reentrant=second)
        return self.out(torch.tanh(h)).pow(2).mean()


def _losses(model, opt, steps: int = 4, micro: int = 1) -> list[float]:
    out = []
    for i in range(steps):
        for j in range(micro):
            loss = model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + j)))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("reentrant", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("params, micro", [("host", 1), ("device", 2)])
def test_both_calls_gradients_count_once(reentrant, params, micro):
    torch.manual_seed(0)
    ref = Looped(reentrant)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": params, "optimizer": params, "device": "cpu"},
                        "precision": {"dtype": "float32"}, "partition": {"persistence_threshold": 0}}):
        model = Looped(reentrant)
    got = _losses(model, infinity.AdamW(model, lr=1e-2), micro=micro)
    want = _losses(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), micro=micro)
    assert got == pytest.approx(want, rel=1e-6)
    infinity.release(model)
