"""fp16 loss scaling over two ranks: an overflow on one rank skips the step on both, the ranks keep one
scale, and the steps taken match a plain fp32-master model trained on the whole batch."""
import copy
import os

import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.unit.test_loss_scale import _Net

LOCAL = 2
STEPS = 22
# Rank 1's targets are huge at this step (taken, at the same scale, without them): only its gradients overflow.
POISONED = 16


def _train(rank, world, workdir, tiers):
    nvme = os.path.join(workdir, f"nvme-{tiers['params']}")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    ref = _Net()
    with infinity.Init({"tiers": {**tiers, "nvme_path": nvme},
                        "precision": {"dtype": "float16", "initial_scale": 2.0 ** 24, "growth_interval": 3,
                                      "hysteresis": 1}}):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    half = copy.deepcopy(ref).half()
    gen = torch.Generator().manual_seed(1)
    records = []
    for step in range(STEPS):
        x, y = torch.randn(LOCAL * world, 8, generator=gen), torch.randn(LOCAL * world, 4, generator=gen)
        lo, hi = rank * LOCAL, (rank + 1) * LOCAL
        y_local = y[lo:hi] * (1e6 if step == POISONED and rank == 1 else 1.0)
        scale = opt.stats()["loss_scale"]["scale"]
        loss = model(x[lo:hi], y_local)
        loss.backward()
        taken_before = opt.stats()["steps"]
        opt.step()
        opt.zero_grad()
        taken = opt.stats()["steps"] > taken_before
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        half.load_state_dict(ref.state_dict())
        ref_loss = half(x, y)
        if taken:      # the reference steps where the engine did, on the whole batch's gradient
            ref_loss.backward()
            for p, q in zip(ref.parameters(), half.parameters()):
                p.grad = q.grad.float()
            half.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        loss_diff = abs(float(mean) / world - ref_loss.item()) if step != POISONED else 0.0
        records.append((scale, taken, loss_diff))
    with infinity.gathered(model):
        param_diff = max(float((p.float() - q.detach().half().float()).abs().max())
                         for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)
    return records, param_diff


def _both(rank, world, workdir):
    return [_train(rank, world, workdir, tiers)
            for tiers in ({"params": "host"}, {"params": "nvme", "optimizer": "nvme"})]


def _expected_scales(taken, initial, interval):
    """The rule with hysteresis 1 (torch.amp.GradScaler's), from the engine's own skip decisions."""
    scales, scale, clean = [], initial, 0
    for ok in taken:
        scales.append(scale)
        if not ok:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * 2, 0
    return scales


def test_loss_scale_on_two_ranks(tmp_path):
    rank0, rank1 = run_ranks(_both, 2, tmp_path)
    for (records, param_diff), (records1, param_diff1) in zip(rank0, rank1):
        assert [r[:2] for r in records] == [r[:2] for r in records1]     # one scale, one decision
        scales, taken, loss_diffs = zip(*records)
        assert not taken[0] and not taken[POISONED], taken       # 2**24 overflows; so does rank 1 alone
        assert taken[POISONED - 1] and taken[POISONED + 1] and sum(taken) >= STEPS // 3, taken
        assert list(scales) == _expected_scales(taken, 2.0 ** 24, 3)
        assert max(loss_diffs) < 2e-3, loss_diffs
        assert param_diff < 2e-3 and param_diff1 < 2e-3, (param_diff, param_diff1)
