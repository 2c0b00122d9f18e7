"""DPU on 2 spawned gloo ranks: the delayed schedule against a single-process plain-PyTorch reference.

Each rank computes on its half of every batch; the reference computes on the whole batch
(the engine averages gradients over ranks, so the two agree to rounding). Host and NVMe
tiers run inside one spawn.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.unit.test_dpu import DelayedReference, Tiny, batches, capture_forward_params, max_diff

STEPS, WARMUP, LOCAL = 6, 2, 2
TIERS = [("host", "host"), ("nvme", "nvme")]


def _train(rank, world, workdir, params, optimizer):
    nvme = os.path.join(workdir, f"nvme-{params}-{optimizer}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": nvme},
           "partition": {"sub_group_size": 4096}, "dpu": {"enabled": True, "warmup_steps": WARMUP}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Tiny()
    torch.manual_seed(0)
    ref = Tiny()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    reference = DelayedReference(ref, WARMUP, 1e-2, 0.1)
    seen = capture_forward_params(model)
    worst_params, worst_loss = 0.0, 0.0
    for idx, tgt in batches(STEPS):
        seen.clear()
        lo, hi = rank * LOCAL, (rank + 1) * LOCAL
        loss = model(idx[lo:hi], tgt[lo:hi])
        loss.backward()
        worst_params = max(worst_params, max_diff(seen, ref))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = ref(idx[:LOCAL * world], tgt[:LOCAL * world])
        ref_loss.backward()
        worst_loss = max(worst_loss, abs(float(mean) / world - ref_loss.item()))
        infinity.clip_grad_norm_(model, 0.5)
        torch.nn.utils.clip_grad_norm_(reference.params, 0.5)
        opt.step()
        reference.step(1e-2)
        opt.zero_grad()
    pending = opt.stats()["pending"]
    reference.synchronize()
    named = dict(ref.named_parameters(remove_duplicate=False))
    with infinity.gathered(model):
        final = max(float((p - named[n]).abs().max()) for n, p in model.named_parameters(remove_duplicate=False))
    return {"params": worst_params, "loss": worst_loss, "final": final, "pending": pending,
            "delayed": opt.stats()["delayed_steps"]}


def _all(rank, world, workdir):
    return {t: _train(rank, world, workdir, *t) for t in TIERS}


def test_delayed_schedule_on_two_ranks(tmp_path):
    for rank_result in run_ranks(_all, 2, tmp_path):
        for tiers, r in rank_result.items():
            assert r["params"] <= 1e-5 and r["final"] <= 1e-5, (tiers, r)
            assert r["loss"] <= 1e-5, (tiers, r)
            assert r["pending"] == 1 and r["delayed"] == STEPS - WARMUP, (tiers, r)
