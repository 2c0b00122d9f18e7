"""Engine features against plain PyTorch: gradient accumulation, clipping, LR schedulers,
optimizer state dicts, persistent small parameters; one process and two spawned ranks."""
import os

import pytest
import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches


def _pair(cfg, lr=1e-2):
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    return model, infinity.AdamW(model, lr=lr), ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=1e-2)


def _mean(t, world):
    t = t.detach().clone()
    if world > 1:
        dist.all_reduce(t)
        t /= world
    return float(t)


def _features(rank, world, workdir, params_tier, opt_tier):
    nvme = os.path.join(workdir, f"nvme-{params_tier}-{opt_tier}-{rank}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": nvme},
           "partition": {"sub_group_size": 4096, "persistence_threshold": 100}}
    out = {}

    # Gradient accumulation over two micro-batches, clipping and a scheduler, every step.
    model, opt, ref, ref_opt = _pair(cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    worst_loss = worst_norm = 0.0
    for idx, tgt in batches(6, 4 * world):
        mine = idx[rank * 4:(rank + 1) * 4], tgt[rank * 4:(rank + 1) * 4]
        total = 0.0
        for half in (slice(0, 2), slice(2, 4)):
            loss = model(mine[0][half], mine[1][half]) / 2
            loss.backward()
            total += _mean(loss, world)
        norm = float(infinity.clip_grad_norm_(model, 0.5))
        opt.step()
        opt.zero_grad()
        sched.step()
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        worst_loss = max(worst_loss, abs(total - ref_loss.item()))
        worst_norm = max(worst_norm, abs(norm - ref_norm))
    out["accumulate_clip_schedule"] = (worst_loss, worst_norm, opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])

    # Optimizer state dict: a fresh model + optimizer loaded from it continue identically.
    state = opt.state_dict()
    with infinity.gathered(model):
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    os.makedirs(nvme + "-b", exist_ok=True)
    with infinity.Init(dict(cfg, tiers=dict(cfg["tiers"], nvme_path=nvme + "-b"))):
        model2 = TinyGPT()
    with infinity.gathered(model2):
        model2.load_state_dict(weights)
    opt2 = infinity.AdamW(model2, lr=1.0)
    opt2.load_state_dict(state)
    worst_resume = 0.0
    for idx, tgt in batches(2, 4 * world, seed=7):
        mine = idx[rank * 4:(rank + 1) * 4], tgt[rank * 4:(rank + 1) * 4]
        for m, o in ((model, opt), (model2, opt2)):
            loss = m(*mine)
            loss.backward()
            o.step()
            o.zero_grad()
            if m is model:
                a = loss.item()
            else:
                worst_resume = max(worst_resume, abs(a - loss.item()))
    out["resume"] = worst_resume
    return out


def _check(results):
    for r in results:
        loss_diff, norm_diff, lr, ref_lr = r["accumulate_clip_schedule"]
        assert loss_diff <= 1e-5, f"accumulated loss differs by {loss_diff:.3g}"
        assert norm_diff <= 1e-5, f"gradient norm differs by {norm_diff:.3g}"
        assert lr == ref_lr == pytest.approx(1e-2 * 0.5 ** 3)
        assert r["resume"] == 0.0, f"resumed run differs by {r['resume']:.3g}"


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")])
def test_features_one_rank(tmp_path, tiers):
    _check([_features(0, 1, str(tmp_path), *tiers)])


def test_features_two_ranks(tmp_path):
    _check(run_ranks(_features, 2, tmp_path, "device", "nvme"))
