"""Ranks that do the same unusual thing together issue the same collectives and train as plain torch.

The collective ledger (tests/support/ledger.py) compares every rank's collectives at the end of each call.
Elsewhere: a trace divergence every rank takes at one step (tests/distributed/test_prefetch.py,
``test_two_ranks``), relayout after a rank-local gain (test_frozen_dist.py), failures on one rank and
``grad.norm()`` on one rank (test_fail_together.py), two groups on one machine (test_groups.py).
"""
from __future__ import annotations

import os

import pytest
import torch

import infinity
from tests.support.adapted import adapted
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches

LOCAL = 2


def _forward_without_backward(rank, world, workdir):
    """Step 1 runs a forward with gradients on and drops its graph (an evaluation that forgot no_grad, an
    exception between forward and backward): groups read ahead for a backward that never comes are dropped."""
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB"},
           "precision": {"dtype": "float32"}, "prefetch": {"nvme_bytes": 64 << 10}}
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for i, (idx, tgt) in enumerate(batches(4, LOCAL * world)):
        mine = slice(LOCAL * rank, LOCAL * rank + LOCAL)
        if i == 1:
            dropped = model(idx[mine], tgt[mine])       # graph kept a moment, then dropped: no backward
            del dropped
        loss = model(idx[mine], tgt[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - ref_loss.item()) / ref_loss.item())
    infinity.release(model)
    return worst


def test_a_forward_with_gradients_and_no_backward_on_every_rank(tmp_path):
    assert max(run_ranks(_forward_without_backward, 2, tmp_path, collective_timeout=60)) <= 1e-5


def _ddp_step(ref, ref_opt, world: int, loss_of) -> None:
    """Torch DDP (find_unused_parameters) in one process: each rank's ``loss_of(rank)`` backward, the mean over the
    ranks (zeros where a rank had no gradient), one step of ``ref_opt``."""
    for r in range(world):
        loss_of(r).backward()
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= world
    ref_opt.step()
    ref_opt.zero_grad()


class _Gated(torch.nn.Module):
    """A weight, and a bias that only the ranks in ``users`` add: its gradient arrives on those alone."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.extra = torch.nn.Parameter(torch.zeros(d))
        self.users = {0}
        self.rank = 0

    def forward(self, x):
        y = x @ self.weight.t()
        return y + self.extra if self.rank in self.users else y


class _Net(torch.nn.Module):
    """``gated`` (its ``extra`` used by some ranks only), then an expert only rank 0 calls (an MoE expert that
    got no tokens elsewhere): both the size of ``first``, so that reduce-scatters paired crosswise look alike."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.first = torch.nn.Linear(d, d)
        self.gated = _Gated(d)
        self.expert = torch.nn.Linear(d, d)
        self.last = torch.nn.Linear(d, 4)
        self.never = torch.nn.Linear(d, d)      # no rank uses it: no update, as torch leaves a None .grad
        self.rank = 0
        self.experts_on = {0}

    def forward(self, x):
        x = torch.tanh(self.gated(torch.tanh(self.first(x))))
        if self.rank in self.experts_on:
            x = torch.tanh(self.expert(x))
        return self.last(x).square().mean()

    def at(self, rank: int) -> "_Net":
        self.rank = self.gated.rank = rank
        return self


def _unused_on_some_ranks(rank, world, workdir, stage, in_backward=False):
    from infinity.errors import EngineError

    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": stage},
                        "precision": {"dtype": "float32"},
                        "optimizer": {"update_in_backward": in_backward}}):
        model = _Net().at(rank)
    if stage == 3:      # every rank calls every module: its all-gathers pair up ([Note: gathered in one order])
        model.experts_on = ref.experts_on = set(range(world))
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    inputs = torch.randn(4, world, 4, 16, generator=torch.Generator().manual_seed(1))
    worst = 0.0
    for step in range(4):
        users = {0} if step % 2 == 0 else set(range(world))    # extra: rank 0 alone, then every rank
        model.gated.users = ref.gated.users = users
        try:
            model(inputs[step, rank]).backward()
            opt.step()
            opt.zero_grad()
        except EngineError as exc:
            infinity.release(model)
            return str(exc)
        _ddp_step(ref, ref_opt, world, lambda r: ref.at(r)(inputs[step, r]))
        with infinity.gathered(model):
            for (name, mine), theirs in zip(model.named_parameters(), ref.parameters()):
                worst = max(worst, (mine.detach() - theirs.detach()).abs().max().item())
    with infinity.gathered(model):
        untouched = torch.equal(model.never.weight.detach(), ref.never.weight.detach())
    infinity.release(model)
    return worst, untouched


def test_parameters_unused_on_some_ranks_train_as_ddp(tmp_path):
    """Rank 0 uses ``gated.extra`` and (below stage 3) ``expert``, rank 1 neither (then ``extra`` too): rank 0's
    groups are complete during the backward, rank 1's only at its end, and ``expert`` is never armed there. At
    stages 1 and 2 every rank hands every trainable group over in one order ([Note: handed over in order] in
    infinity/runtime/grads.py) and gathers in one order ([Note: gathered in one order] in
    infinity/runtime/coordinator.py); at stage 3 a group one call used is handed over at that call's backward
    end ([Note: handed over at the call's end]). The collectives pair up (the ledger compares them) and training
    matches torch DDP with ``find_unused_parameters``: the mean with zeros from the ranks without a gradient; a
    parameter no rank used is not updated."""
    for stage in (1, 2, 3):
        for rank, got in enumerate(run_ranks(_unused_on_some_ranks, 2, tmp_path / str(stage), stage,
                                             collective_timeout=60)):
            assert not isinstance(got, str), (stage, rank, got)
            worst, untouched = got
            assert worst <= 1e-5, (stage, rank, worst)
            assert untouched, (stage, rank)


def test_parameters_unused_on_some_ranks_update_during_backward_as_ddp(tmp_path):
    """With ``update_in_backward`` a group complete on rank 0 is stepped during the backward there and at the step
    on rank 1 (partial there): both from the same reduced gradient, with the same parameters updated."""
    for stage in (2, 3):
        for rank, got in enumerate(run_ranks(_unused_on_some_ranks, 2, tmp_path / str(stage), stage, True,
                                             collective_timeout=60)):
            assert not isinstance(got, str), (stage, rank, got)
            worst, untouched = got
            assert worst <= 1e-5, (stage, rank, worst)
            assert untouched, (stage, rank)


class _Layer(torch.nn.Module):
    """A layer that takes the running state and an argument every layer shares (T5's position bias, a
    diffusion model's time embedding), adding to its input in place as some models do."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.gate = torch.nn.Parameter(torch.ones(d))

    def forward(self, h, shared):
        h.mul_(1.0)     # in place on its argument
        y = torch.tanh(self.proj(h) + shared) * self.gate
        y += h
        return y


class _Stack(torch.nn.Module):
    def __init__(self, d: int = 16, layers: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(d, d)
        self.shared = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList([_Layer(d) for _ in range(layers)])
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        shared = self.shared(x)
        for layer in self.layers:
            h = layer(h, shared)
        return self.head(h).square().mean()


def _shared_argument(rank, world, workdir, stage):
    from infinity.registry import engine_of

    torch.manual_seed(0)
    ref = _Stack()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": stage},
                        "precision": {"dtype": "float32"}}):
        model = _Stack()
    engine = engine_of(model)
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    waiting = []        # groups complete and waiting, at each hand-over during the backward
    take = engine.reducer.take

    def recorded(group, params, grads):
        waiting.append(len(engine._arrivals._complete))
        return take(group, params, grads)

    engine.reducer.take = recorded
    inputs = torch.randn(3, world, 4, 16, generator=torch.Generator().manual_seed(2))
    worst = 0.0
    for step in range(3):
        model(inputs[step, rank]).backward()
        if step == 1 and (rank == 0 or stage == 3):    # a saliency map (stage 3: every forward gathers)
            x = inputs[step, rank].clone().requires_grad_(True)
            torch.autograd.grad(model(x), x)
        opt.step()
        opt.zero_grad()
        for r in range(world):
            ref(inputs[step, r]).backward()
        for p in ref.parameters():
            p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad()
        with infinity.gathered(model):
            for mine, theirs in zip(model.parameters(), ref.parameters()):
                worst = max(worst, (mine.detach() - theirs.detach()).abs().max().item())
    infinity.release(model)
    return worst, max(waiting)


def test_an_argument_every_layer_shares_does_not_hold_the_layers_to_the_end(tmp_path):
    """At stage 3 each layer's group is handed over when that call's part of its arguments' gradients is in,
    not when the shared argument's whole gradient is (after the last layer's backward): at most one other group
    waits at any hand-over (at stage 2, waiting for its turn, none in a model built in the order it runs). A
    module changing its argument in place, and ``torch.autograd.grad`` (no gradient stored: no hand-over; at
    stage 2 on rank 0 alone, no collective) leave training as torch DDP's."""
    for stage in (2, 3):
        for rank, (worst, waiting) in enumerate(run_ranks(_shared_argument, 2, tmp_path / str(stage), stage,
                                                          collective_timeout=60)):
            assert worst <= 1e-5, (stage, rank, worst)
            assert waiting <= 1, (stage, rank, waiting)


def _adapters_after_init(rank, world, workdir, clip_with):
    """Parameters added after Init are averaged over the ranks as DDP averages them ([Note: unmanaged
    parameters]): ``.grad`` after backward is the mean (torch's clip_grad_norm_ sees it; infinity's counts it
    once, not once per rank), one used on rank 0 only is averaged with zeros, a backward cut short by an error
    on every rank leaves the next one averaged; the base is the engine's as ever. Before, a world size above 1
    was refused."""
    def fail(grad):
        raise RuntimeError("a hook failed")

    ref, model = adapted(engine=False, extra=True), adapted(engine=True, extra=True)
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = torch.randn(3, 4 * world, 8, generator=torch.Generator().manual_seed(2))
    norms = []
    for i, x in enumerate(data):
        if i == 1:      # every rank's backward cut short (its queued end dropped by autograd), then zero_grad
            handle = model.lora.weight.register_hook(fail)
            try:
                model(x[:4]).backward()
            except RuntimeError:
                pass
            handle.remove()
            opt.zero_grad()
        loss = model(x[4 * rank:4 * rank + 4], extra=rank == 0)
        loss.backward()
        if clip_with == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            norm = opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        ref_loss = sum(ref(x[4 * r:4 * r + 4], extra=r == 0) for r in range(world)) / world
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norms.append(abs(float(norm) - float(ref_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = infinity.state_dict(model), ref.state_dict()
    infinity.release(model)
    return max(norms), max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.parametrize("clip_with", ["torch", "infinity"])
def test_parameters_added_after_init_are_averaged_over_the_ranks_as_ddp_averages_them(tmp_path, clip_with):
    for norm_error, weight_error in run_ranks(_adapters_after_init, 2, tmp_path, clip_with):
        assert norm_error <= 1e-5 and weight_error <= 1e-6, (norm_error, weight_error)


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, h, use):
        for e in use:
            h = h + torch.tanh(self.experts[e](h))
        return h


class _Routed(torch.nn.Module):
    """Each rank's tokens go to another expert of the same size (a mixture of experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.moe, self.last = torch.nn.Linear(8, 8), _Experts(), torch.nn.Linear(8, 1)

    def forward(self, x, use):
        return self.last(self.moe(torch.tanh(self.first(x)), use)).square().mean()


def _routed_apart(rank, world, workdir, units):
    """Two steps, rank r routing to expert r, at stage 3; returns what the first step said and the weights'
    largest difference from DDP's (torch's AdamW over every rank's gradients averaged)."""
    torch.manual_seed(0)
    ref = _Routed()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": 3, "units": units},
                        "precision": {"dtype": "float32"}}):
        model = _Routed()
    opt, ref_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs = torch.randn(2, world, 4, 8, generator=torch.Generator().manual_seed(1))
    said = "no error"
    for step in range(2):
        model(xs[step, rank], (rank,)).backward()
        try:
            opt.step()
        except infinity.errors.EngineError as exc:
            said = str(exc)
            break
        opt.zero_grad()
        _ddp_step(ref, ref_opt, world, lambda r: ref(xs[step, r], (r,)))
    with infinity.gathered(model):
        worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)
    return said, worst


def test_experts_routed_apart_at_stage_3_need_a_unit_and_the_refusal_says_so(tmp_path):
    """At stage 3 every module a rank calls is gathered on every rank: experts of one size routed apart paired
    the ranks' all-gathers on other experts. The step is refused, and the advice was to freeze what some ranks
    do not use, which does not help there; it names the unit that does. As a unit the block trains as DDP."""
    for said, _ in run_ranks(_routed_apart, 2, tmp_path, [], collective_timeout=60):
        assert "partition.units" in said and "at partition.stage 3" in said, said
    for said, worst in run_ranks(_routed_apart, 2, tmp_path, ["_Experts"], collective_timeout=60):
        assert said == "no error" and worst < 1e-5, (said, worst)


def _evaluated_on_rank_0(rank, world, workdir, stage):
    """Three steps beside DDP (torch's AdamW over the ranks' mean gradient); after the first, rank 0 alone runs
    a forward without gradients (an evaluation) before the next training forward."""
    torch.manual_seed(0)
    ref = _Routed()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": stage},
                        "precision": {"dtype": "float32"}}):
        model = _Routed()
    opt, ref_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs = torch.randn(3, world, 4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        if step == 1 and rank == 0:
            with torch.no_grad():
                model(xs[step, rank][:2], (0, 1))
        model(xs[step, rank], (0, 1)).backward()
        opt.step()
        opt.zero_grad()
        _ddp_step(ref, ref_opt, world, lambda r: ref(xs[step, r], (0, 1)))
    with infinity.gathered(model):
        worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)
    return worst


@pytest.mark.parametrize("stage", [1, 2])
def test_an_evaluation_on_one_rank_after_a_step_trains_on_as_ddp(tmp_path, stage):
    """At stages 1 and 2 the first forward after a step gathers, and one rank's evaluation there pairs its
    gathers with the others' next training forward, as designed; but each group's hand-over was placed among
    the collectives counted from the step's first training forward, which that evaluation preceded on one rank
    only, and the next opt.step() was refused on every rank as taking other paths. Placed from each backward's
    first hand-over, the run trains as DDP."""
    for worst in run_ranks(_evaluated_on_rank_0, 2, tmp_path, stage, collective_timeout=60):
        assert worst < 1e-5, worst
