"""torch's gradient and optimizer API over two ranks: ``clip_grad_norm_`` returns the global norm of
the averaged gradients, ``clip_grad_value_`` clamps them, ``model.zero_grad()`` clears them, and param
groups with their own hyper-parameters driven by an LR scheduler step as on a plain model trained on
the whole batch."""
import os

import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches
from tests.unit.test_param_groups import decay_groups

LOCAL = 2


def _train(rank, world, workdir, params_tier, opt_tier):
    nvme = os.path.join(workdir, f"nvme-{params_tier}-{opt_tier}")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": nvme},
                        "partition": {"sub_group_size": 4096}}):
        model = TinyGPT()
    opt = infinity.AdamW(decay_groups(model, lr_rest=3e-3), lr=1e-2)
    ref_opt = torch.optim.AdamW(decay_groups(ref, lr_rest=3e-3), lr=1e-2)
    warmup = lambda step: min(1.0, (step + 1) / 3)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in (opt, ref_opt)]
    worst_loss, worst_norm = 0.0, 0.0
    for step, (idx, tgt) in enumerate(batches(5, LOCAL * world)):
        lo, hi = rank * LOCAL, (rank + 1) * LOCAL
        loss = model(idx[lo:hi], tgt[lo:hi])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if step % 2:
            torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3)
        opt.step()
        model.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        if step % 2:
            torch.nn.utils.clip_grad_value_(ref.parameters(), 2e-3)
        ref_opt.step()
        ref.zero_grad()
        for sched in scheds:
            sched.step()
        worst_loss = max(worst_loss, abs(float(mean) / world - ref_loss.item()))
        worst_norm = max(worst_norm, abs(float(norm) - float(ref_norm)) / float(ref_norm))
    with infinity.gathered(model):
        param_diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return worst_loss, worst_norm, param_diff


def _both(rank, world, workdir):
    return [_train(rank, world, workdir, *tiers) for tiers in (("host", "host"), ("nvme", "nvme"))]


def test_torch_clipping_and_zero_grad_on_two_ranks(tmp_path):
    for rank_results in run_ranks(_both, 2, tmp_path):
        for loss_diff, norm_diff, param_diff in rank_results:
            assert loss_diff <= 1e-5 and norm_diff <= 1e-5 and param_diff <= 5e-5, (loss_diff, norm_diff, param_diff)
