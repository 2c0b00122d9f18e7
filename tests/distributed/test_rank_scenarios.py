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
