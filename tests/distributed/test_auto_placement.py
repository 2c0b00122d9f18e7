"""``tiers = "auto"`` on several ranks: rank 0 decides and every rank runs its pair, whatever each rank's own
machine profile would have chosen (a branch around collectives must be decided by what every rank knows)."""
from __future__ import annotations

import torch

import infinity
from infinity.plan.machine import MachineProfile
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches


def _auto(rank, world, workdir):
    with torch.device("meta"):
        size = sum(p.numel() for p in TinyGPT().parameters())
    box = MachineProfile(name=f"rank {rank}", device_bytes=0, host_bytes=4 * 2**30, unified=True,
                         device_update_params_per_s=1e9 if rank == 0 else 1.0)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "auto", "optimizer": "auto"}, "precision": {"dtype": "float32"}},
                       model=size, machine=box) as init:
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    losses = []
    for idx, tgt in batches(2, 2, seed=rank):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    infinity.release(model)
    return (init.config.tiers.params, init.config.tiers.optimizer), init.placement.chosen.placement.pair, losses


def test_every_rank_runs_rank_0s_placement(tmp_path):
    results = run_ranks(_auto, 2, tmp_path)
    (ran0, own0, _), (ran1, own1, losses1) = results
    # Rank 1's device update is predicted to take 1 s per element: alone it would keep the states off the device.
    assert own0 == ("device", "device") and own1[1] != "device"
    assert ran0 == ran1 == own0
    assert all(torch.isfinite(torch.tensor(losses1)))
