"""Frozen groups are released in backward once their module's backward is over, not at its end
([Note: a module's backward is over] in infinity/runtime/backward_holds.py).

A frozen group has no gradient to say autograd is done with it, so it stayed gathered from its
module's pre-backward to the end of the backward: a model trained in part (BitFit, adapters, a frozen
trunk) had every frozen block on the compute device at once, past ``partition.max_live_parameters``.
The release must never come before a node that reads the weight has run: the cases where calls
overlap, arguments come by keyword, the graph is kept or recomputed are compared with plain torch.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import infinity
from infinity.config import load_config
from infinity.examples.gpt import GPT, GPTConfig
from infinity.registry import engine_of
from tests.unit.test_max_live import train_losses

SHAPE = GPTConfig(n_layer=6, d_model=32, n_head=4, vocab_size=128, seq_len=8)
WIDTH = 16


def _bitfit(model) -> None:
    for p in model.parameters():
        if p.dim() > 1:
            p.requires_grad_(False)


def _gpt(max_live: int = 0):
    cfg = load_config("offload-host", overrides={
        "tiers": {"device": "cpu"}, "precision": {"dtype": "float32"},
        "partition": {"max_live_parameters": max_live, "persistence_threshold": 0},
        "prefetch": {"device_bytes": "64MiB", "reuse_distance": "64MiB"}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(SHAPE)
        _bitfit(model)
    return model


def _frozen_held_at_each_gradient(model, steps: int = 3) -> tuple[list[float], list[int]]:
    """Train BitFit ``steps`` steps; (losses, the frozen groups held for backward whenever a trainable
    parameter's gradient arrives)."""
    coordinator = engine_of(model).coordinator
    held = []
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p: held.append(sum(not g.has_trainable for g in coordinator.backward_held)))
    return train_losses(model, infinity.AdamW(model, lr=1e-2), steps, SHAPE, batch=2), held


def test_a_bitfit_backward_holds_one_frozen_block_at_a_time_and_trains_as_plain_torch():
    model = _gpt()
    losses, held = _frozen_held_at_each_gradient(model)
    frozen = sum(not g.has_trainable for g in engine_of(model).coordinator.groups)
    assert frozen >= SHAPE.n_layer
    # A block's frozen group and the one before it (gathered at its pre-backward, which comes first on the
    # tensor between them); held to the end of the backward, they were all of them by its last gradient.
    assert held and max(held) <= 2, held
    infinity.release(model)

    torch.manual_seed(0)
    ref = GPT(SHAPE)
    _bitfit(ref)
    want = train_losses(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2), 3,
                        SHAPE, batch=2)
    assert losses == pytest.approx(want, rel=1e-5)


def test_max_live_parameters_bounds_a_frozen_models_backward():
    """Frozen groups held for backward count against the bound whatever it says; released as their
    blocks' backwards end, the bound holds."""
    free = _gpt()
    groups = sorted(g.numel for g in engine_of(free).coordinator.groups)
    free_losses, _ = _frozen_held_at_each_gradient(free)
    infinity.release(free)
    bound = 3 * groups[-1] + sum(g for g in groups if g < groups[-1])
    bounded = _gpt(bound)
    losses, _ = _frozen_held_at_each_gradient(bounded)
    assert infinity.stats(bounded)["fetch"]["peak_live_numel"] <= bound < sum(groups)
    assert losses == free_losses
    infinity.release(bounded)


class Matmul(torch.autograd.Function):
    """``x @ weight.t()`` whose backward counts the reads of a released weight in ``late`` (its memory
    given back: reading it would read what the next gather put there, or crash) instead of making them."""

    @staticmethod
    def forward(ctx, x, weight, late: list):
        ctx.save_for_backward(weight)
        ctx.late = late
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        if weight.untyped_storage().nbytes() < weight.numel() * weight.element_size():
            ctx.late.append(weight.shape)
            return torch.zeros_like(grad), None, None
        return grad @ weight, None, None


class FrozenLinear(nn.Module):
    """A weight frozen as it is built (a group of its own, nothing under the module trainable)."""

    def __init__(self, late: list) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH, requires_grad=False)
        self.late = late

    def forward(self, x, other=None):
        out = Matmul.apply(x, self.weight, self.late)
        return out if other is None else out + Matmul.apply(torch.sin(other), self.weight, self.late)


class Inner(nn.Module):
    def __init__(self, weight: nn.Parameter, late: list) -> None:
        super().__init__()
        self.weight = weight
        self.late = late

    def forward(self, y):
        return Matmul.apply(y, self.weight, self.late)


class Outer(nn.Module):
    """Reads its frozen weight, then calls a module that reads the same one: the inner call's backward is
    over while the outer call's first node has yet to read it."""

    def __init__(self, late: list) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH, requires_grad=False)
        self.late = late
        self.inner = Inner(self.weight, late)

    def forward(self, x):
        u = Matmul.apply(x, self.weight, self.late)
        return torch.tanh(self.inner(torch.tanh(u))) * u


class Twice(nn.Module):
    """A frozen weight read by two calls whose backwards overlap, by keyword, recomputed, or in a kept graph."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.late: list = []
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.shared = FrozenLinear(self.late)
        self.outer = Outer(self.late)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        if self.how == "two calls":
            # Both calls' backwards begin at the product; autograd runs the nodes made last first, so the
            # second call's argument (made after the first call) has its whole gradient, and that call is
            # over, before the first call's node reads the weight.
            first = self.shared(torch.tanh(self.a(x)))
            h = first * self.shared(torch.tanh(self.b(x)))
        elif self.how == "keyword":         # the second argument by keyword, made after the first
            a = torch.tanh(self.a(x))
            h = self.shared(a, other=torch.tanh(self.b(x)))
        elif self.how == "checkpoint":
            first = ckpt.checkpoint(self.shared, torch.tanh(self.a(x)), use_reentrant=False)
            h = first * ckpt.checkpoint(self.shared, torch.tanh(self.b(x)), use_reentrant=True)
        elif self.how == "nested":
            h = self.outer(torch.tanh(self.a(x)))
        else:                               # a leaf argument: not watched
            h = self.shared(torch.tanh(self.a(x))) + self.shared(x)
        return self.out(torch.tanh(h)).pow(2).mean()


def _run(model, opt, steps: int, retain: bool, gathered=infinity.gathered) -> tuple[list, dict]:
    """Train ``steps`` steps; (per step the loss and the input's gradient if it has one, final parameters)."""
    seen = []
    for i in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
        if model.how == "leaf":
            x.requires_grad_(True)
        loss = model(x)
        loss.backward(retain_graph=retain)
        if retain:          # a second backward through the kept graph: the frozen groups gathered again
            loss.backward()
        seen.append((loss.item(), None if x.grad is None else x.grad.clone()))
        opt.step()
        opt.zero_grad()
    with gathered(model):
        return seen, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how, retain", [("two calls", False), ("nested", False), ("keyword", False),
                                         ("checkpoint", False), ("leaf", False), ("two calls", True)])
def test_calls_that_overlap_or_hide_an_argument_read_the_weight_before_its_release(how, retain):
    torch.manual_seed(0)
    ref = Twice(how)
    # Nothing kept gathered for reuse: a group released is given back at once.
    cfg = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}, "precision": {"dtype": "float32"},
           "partition": {"persistence_threshold": 0}, "prefetch": {"reuse_distance": 0}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Twice(how)
    got_seen, got = _run(model, infinity.AdamW(model, lr=1e-2), 3, retain)
    want_seen, want = _run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3, retain, lambda m: nullcontext())
    for (loss, grad), (want_loss, want_grad) in zip(got_seen, want_seen):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        if want_grad is not None:
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert model.late == [], "the backward read a frozen weight after its release"
    infinity.release(model)
