"""Parity of the ZeRO-3 engine with plain PyTorch AdamW, at every step, over tiers and world sizes.

Each spawned rank trains the tiny GPT under infinity for every (params tier, optimizer tier,
batch split) combination and a plain single-process reference on the concatenated batch; the
mean loss over ranks must equal the reference loss at every step, and the gathered parameters
must equal the reference's at the end.
"""
import itertools
import os

import pytest
import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches

STEPS = 20
LOCAL_BATCH = 2
COMBOS = list(itertools.product(("device", "host", "nvme"), ("host", "nvme"), ("same", "split")))


def _train(rank, world, workdir, params_tier, opt_tier, split, steps):
    nvme = os.path.join(workdir, f"nvme-{params_tier}-{opt_tier}-{split}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": nvme},
           "partition": {"sub_group_size": 4096}}
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    global_batches = batches(steps, LOCAL_BATCH * (world if split == "split" else 1))
    worst = 0.0
    for idx, tgt in global_batches:
        if split == "split":
            lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
            local_idx, local_tgt = idx[lo:hi], tgt[lo:hi]
        else:
            local_idx, local_tgt = idx, tgt
        loss = model(local_idx, local_tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(mean_loss.item() - ref_loss.item()))
    param_diff = 0.0
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            param_diff = max(param_diff, (p - q).abs().max().item())
    return {"loss_diff": worst, "param_diff": param_diff}


def _all_combos(rank, world, workdir, combos, steps, same_steps=None):
    """``same_steps``: fewer steps for the combinations where every rank takes the whole batch."""
    return {c: _train(rank, world, workdir, *c, same_steps if same_steps and c[2] == "same" else steps)
            for c in combos}


def _check(results, combos):
    # Losses to 1e-5 (the bar). Parameters to 5e-5: with 4 ranks the gradient
    # mean is summed in another order than the reference's single batch, and Adam's
    # normalisation turns those last-bit differences into ~1e-5 after a few steps.
    for rank_result in results:
        for combo in combos:
            r = rank_result[combo]
            assert r["loss_diff"] <= 1e-5, f"{combo}: loss differs from plain AdamW by {r['loss_diff']:.3g}"
            assert r["param_diff"] <= 5e-5, f"{combo}: parameters differ by {r['param_diff']:.3g}"


def test_parity_one_rank_without_distributed(tmp_path):
    """No torch.distributed at all: the engine runs as one rank."""
    combos = [c for c in COMBOS if c[2] == "same"]
    results = [_all_combos(0, 1, str(tmp_path), combos, STEPS)]
    _check(results, combos)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_spawned_ranks(tmp_path, world):
    # Every combination on 2 ranks, the same batch on every rank for half the steps (drift over the
    # longer run is what the split batch and the one-rank test check). On 4 (the suite's slowest test: 4
    # ranks on CI's 2 cores), the split batch for half the steps over three tier pairs that put the
    # parameters in each tier and the optimizer states in each (2 ranks try every pair).
    combos = COMBOS if world == 2 else [("device", "host", "split"), ("host", "nvme", "split"),
                                        ("nvme", "nvme", "split")]
    results = run_ranks(_all_combos, world, tmp_path, combos, STEPS if world == 2 else STEPS // 2, STEPS // 2)
    _check(results, combos)
