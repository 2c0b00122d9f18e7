"""Communication volume (``infinity.stats(model)["comm"]``) against the ZeRO paper's analysis.

Stages 1 and 2 all-gather the updated parameters once and reduce-scatter the gradients once:
2 Psi (N-1)/N elements per rank and step.

Stage 3 gathers every parameter in forward and again in backward and reduce-scatters every
gradient: 3 Psi (N-1)/N elements sent per rank and step, in the compute dtype (see [Note:
communication volume] in infinity/runtime/ranks.py). The model here has no tied weight and
groups large enough for the shard padding to stay small, so the measured bytes must come within
15% of the paper's figure, and equal what infinity-plan prints exactly.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import infinity
from infinity.config import load_config
from infinity.plan import comm_per_rank, plan
from tests.support.ranks import run_ranks

D = 512


def mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(D, D) for _ in range(4)])


def _train(rank, world, workdir, dtype, stage=3):
    cfg = load_config("offload-host" if stage == 3 else "offload-optimizer", overrides={
        "tiers": {"device": "cpu", "nvme_path": workdir}, "precision": {"dtype": dtype},
        "partition": {"persistence_threshold": 0, "stage": stage}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = mlp()
    opt = infinity.AdamW(model, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, D, generator=g).to(getattr(torch, dtype))
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    expected = plan(mlp(), cfg, world_size=world, check_fit=False)
    return infinity.stats(model)["comm"], expected.all_gather_bytes, expected.reduce_scatter_bytes


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (4, "bfloat16")])
def test_stage_3_sends_three_psi_per_rank_as_the_zero_paper_says(tmp_path, world, dtype):
    psi = sum(p.numel() for p in mlp().parameters())
    itemsize = 4 if dtype == "float32" else 2
    paper = comm_per_rank(psi, world, stage=3, param_bytes=itemsize, grad_bytes=itemsize)
    assert paper == 3 * psi * itemsize * (world - 1) // world
    for rank, (comm, gather, scatter) in enumerate(run_ranks(_train, world, tmp_path, dtype)):
        where = f"rank {rank} of {world}: {comm}"
        assert comm["all_gather_bytes"] == gather and comm["reduce_scatter_bytes"] == scatter, where
        sent = comm["all_gather_bytes"] + comm["reduce_scatter_bytes"]
        assert paper <= sent <= 1.15 * paper, (where, sent, paper)
        # The step's non-finite flags and gradient norm: a few bytes per parameter tensor, no more.
        assert 0 < comm["all_reduce_bytes"] < 0.01 * paper, where
        assert comm["calls"]["all_gather"] == 2 * 4 and comm["calls"]["reduce_scatter"] == 4, where


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_send_two_psi_per_rank(tmp_path, stage):
    world, itemsize = 2, 2
    psi = sum(p.numel() for p in mlp().parameters())
    paper = comm_per_rank(psi, world, stage=stage, param_bytes=itemsize, grad_bytes=itemsize)
    assert paper == 2 * psi * itemsize * (world - 1) // world
    for rank, (comm, gather, scatter) in enumerate(run_ranks(_train, world, tmp_path, "bfloat16", stage)):
        where = f"stage {stage}, rank {rank} of {world}: {comm}"
        assert comm["all_gather_bytes"] == gather and comm["reduce_scatter_bytes"] == scatter, where
        sent = comm["all_gather_bytes"] + comm["reduce_scatter_bytes"]
        assert paper <= sent <= 1.15 * paper, (where, sent, paper)
        assert comm["calls"]["all_gather"] == 4 and comm["calls"]["reduce_scatter"] == 4, where


def test_one_rank_sends_nothing():
    cfg = load_config("offload-host", overrides={"tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}})
    with infinity.Init(cfg):
        model = mlp()
    opt = infinity.AdamW(model)
    for _ in range(2):
        model(torch.randn(2, D)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    comm = infinity.stats(model)["comm"]
    assert {k: v for k, v in comm.items() if k != "calls"} == dict.fromkeys(
        ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "broadcast_bytes"), 0)
