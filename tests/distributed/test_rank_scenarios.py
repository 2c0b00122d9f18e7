"""Ranks that do the same unusual thing together issue the same collectives and train as plain torch.

The collective ledger (tests/support/ledger.py) compares every rank's collectives at the end of each call.
Elsewhere: a trace divergence every rank takes at one step (tests/distributed/test_prefetch.py,
``test_two_ranks``), relayout after a rank-local gain (test_frozen_dist.py), failures on one rank and
``grad.norm()`` on one rank (test_fail_together.py), two groups on one machine (test_groups.py).
"""
from __future__ import annotations

import os

import torch

import infinity
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


class _Gated(torch.nn.Module):
    """A weight, and a bias that only rank 0's branch uses: its gradient arrives on rank 0 alone."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.extra = torch.nn.Parameter(torch.zeros(d))
        self.rank = rank

    def forward(self, x):
        y = x @ self.weight.t()
        return y + self.extra if self.rank == 0 else y


class _Net(torch.nn.Module):
    def __init__(self, rank: int, d: int = 16) -> None:
        super().__init__()
        self.first = torch.nn.Linear(d, d)      # as many elements as ``gated``: their reduce-scatters look alike
        self.gated = _Gated(d, rank)
        self.last = torch.nn.Linear(d, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.gated(torch.tanh(self.first(x))))).square().mean()


def _unused_on_one_rank(rank, world, workdir):
    from infinity.errors import EngineError

    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": 2},
                        "precision": {"dtype": "float32"}}):
        model = _Net(rank)
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randn(4, 16)).backward()
    try:
        opt.step()
        said = "no error"
    except EngineError as exc:
        said = str(exc)
    infinity.release(model)
    return said


def test_a_parameter_unused_on_one_rank_is_refused_on_every_rank_before_the_update(tmp_path):
    """Rank 0 reduces ``gated`` when its gradients arrive, rank 1 (whose ``extra`` gets none) at the end of
    the backward, after ``first``: the two same-sized reduce-scatters pair up crosswise, which no collective
    ledger sees (same op, dtype and count). The step checks where each rank handed each group over and
    refuses on every rank, naming the group."""
    for rank, said in enumerate(run_ranks(_unused_on_one_rank, 2, tmp_path, collective_timeout=60)):
        assert "reduced the gradients of" in said and "'gated'" in said, (rank, said)
        assert "The step is not applied" in said, said
        assert "['gated.extra'] got a gradient on some ranks only" in said, said
