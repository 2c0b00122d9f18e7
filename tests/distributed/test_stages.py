"""ZeRO stages 1 and 2 against plain PyTorch AdamW, and the refused combinations.

Stage 2 keeps whole parameters on every rank's device and partitions gradients and optimizer
states; stage 1 partitions only the optimizer states, reduce-scattering whole gradients once per
step (see [Note: ZeRO stages 1 and 2] in infinity/runtime/grads.py). Every combination that
makes sense must train as plain torch does: losses to 1e-5, parameters to 5e-5 (fp32), with
the global batch split over the ranks, gradient accumulation over micro-batches and clipping.
"""
import itertools
import os

import pytest
import torch
import torch.distributed as dist

import infinity
from infinity.config import ConfigError, load_config
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches

STEPS = 6
LOCAL_BATCH = 2
COMBOS = list(itertools.product((1, 2), ("device", "host", "nvme"), (1, 2)))   # stage, optimizer, micro-batches


def _train(rank, world, workdir, stage, opt_tier, micro):
    nvme = os.path.join(workdir, f"nvme-{stage}-{opt_tier}-{micro}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "device", "optimizer": opt_tier, "nvme_path": nvme},
           "partition": {"stage": stage, "sub_group_size": 4096}}
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    worst = 0.0
    for idx, tgt in batches(STEPS, LOCAL_BATCH * world * micro):
        losses = []
        for m in range(micro):      # this rank's micro-batches of the global batch
            lo = (m * world + rank) * LOCAL_BATCH
            loss = model(idx[lo:lo + LOCAL_BATCH], tgt[lo:lo + LOCAL_BATCH]) / micro
            loss.backward()
            losses.append(loss.detach())
        infinity.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        mean_loss = torch.stack(losses).sum()
        if world > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(mean_loss.item() - ref_loss.item()))
    param_diff = 0.0
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            param_diff = max(param_diff, (p - q).abs().max().item())
    return {"loss_diff": worst, "param_diff": param_diff, "comm": infinity.stats(model)["comm"]}


def _all(rank, world, workdir, combos):
    return {c: _train(rank, world, workdir, *c) for c in combos}


def _check(results, combos):
    for rank, rank_result in enumerate(results):
        for combo in combos:
            r = rank_result[combo]
            where = f"rank {rank}, stage {combo[0]}, optimizer {combo[1]}, {combo[2]} micro-batch(es)"
            assert r["loss_diff"] <= 1e-5, f"{where}: loss differs from plain AdamW by {r['loss_diff']:.3g}"
            assert r["param_diff"] <= 5e-5, f"{where}: parameters differ by {r['param_diff']:.3g}"


def test_stages_one_rank(tmp_path):
    _check([_all(0, 1, str(tmp_path), COMBOS)], COMBOS)


@pytest.mark.parametrize("world", [2, 4])
def test_stages_spawned_ranks(tmp_path, world):
    # On 4 ranks (4 processes on CI's 2 cores) the two micro-batch combinations only: they tell stage 1 from
    # stage 2 (one reduce per step against one per micro-batch); one micro-batch is what 2 ranks check.
    combos = COMBOS if world == 2 else [c for c in COMBOS if c[2] == 2]
    results = run_ranks(_all, world, tmp_path, combos)
    _check(results, combos)
    for rank_result in results:
        for (stage, _, micro), r in rank_result.items():
            calls = r["comm"]["calls"]
            # Stage 1 reduces once per step whatever the micro-batches; stage 2 once per micro-batch.
            groups = calls["all_gather"]      # every group gathered once per step
            assert calls["reduce_scatter"] == groups * (1 if stage == 1 else micro), (stage, micro, calls)


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_refuse_sharded_parameter_tiers(tmp_path, stage, params):
    with pytest.raises(ConfigError, match=r"partition.stage: stage \d keeps whole parameters .* \"device\""):
        load_config({"tiers": {"params": params, "nvme_path": str(tmp_path)}, "partition": {"stage": stage}})


def test_stage_must_be_one_two_or_three():
    with pytest.raises(ConfigError, match=r"partition.stage: expected an integer >= 1, got 0: ZeRO stage 1"):
        load_config({"partition": {"stage": 0}})
