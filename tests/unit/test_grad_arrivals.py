"""A group's gradients are handed over once all its parameters that took part in the backward have theirs.

The hooks are registered once per parameter ([Note: one gradient hook per group] in
infinity/runtime/hooks.py). A parameter a backward never reaches leaves its group short until the end
of that backward, which hands the group over with no gradient for it: the optimizer then leaves that
parameter alone, as ``torch.optim.AdamW`` does a parameter whose ``.grad`` is None.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity


class MaybeBias(nn.Module):
    """One group of two parameters; the bias takes part only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.bias = nn.Parameter(torch.randn(8) * 0.3)

    def forward(self, x, use_bias: bool):
        y = x @ self.weight.t()
        return y + self.bias if use_bias else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.middle = MaybeBias()
        self.last = nn.Linear(8, 1)

    def forward(self, x, use_bias: bool):
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)), use_bias))).square().mean()


@pytest.mark.parametrize("preset", ["device", "offload-host"])
def test_a_parameter_a_backward_never_reaches_gets_no_update(tmp_path, preset):
    cfg = infinity.load_config(preset, overrides={"tiers": {"device": "cpu", "nvme_path": str(tmp_path)},
                                                   "precision": {"dtype": "float32"}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Net()
    torch.manual_seed(0)
    ref = Net()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for use_bias in (True, False, False, True, False):
        x = torch.randn(4, 8, generator=g)
        model(x, use_bias).backward()
        ref(x, use_bias).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with infinity.gathered(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{preset}: {name}")


def test_a_backward_inside_gathered_leaves_the_gradients_to_autograd(tmp_path):
    # No forward under the engine armed the groups: autograd stores .grad as it would without it.
    cfg = infinity.load_config("offload-host", overrides={"tiers": {"device": "cpu", "nvme_path": str(tmp_path)},
                                                          "precision": {"dtype": "float32"}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = nn.Linear(4, 2)
    with infinity.gathered(model):
        loss = (model.weight.sum() * 2 + model.bias.sum())
        loss.backward()
        assert torch.equal(model.weight.grad, torch.full((2, 4), 2.0))
        assert torch.equal(model.bias.grad, torch.ones(2))
