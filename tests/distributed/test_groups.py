"""Several data-parallel groups in one job, each with an engine of its own (``infinity.Init(group=...)``)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches

LOCAL_BATCH = 2


def _two_groups(rank, world, workdir):
    """Ranks 0-1 and 2-3 train two models on one machine, their NVMe tiers on one shared path."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank takes part in making both
    group = groups[rank // 2]
    mine, size = rank % 2, 2
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB"},
           "precision": {"dtype": "float32"}}
    torch.manual_seed(rank // 2)
    ref = TinyGPT()
    torch.manual_seed(rank // 2)
    with infinity.Init(cfg, group=group):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for idx, tgt in batches(3, LOCAL_BATCH * size, seed=rank // 2):
        lo = mine * LOCAL_BATCH
        loss = model(idx[lo:lo + LOCAL_BATCH], tgt[lo:lo + LOCAL_BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() / size - ref_loss.item()) / ref_loss.item())
    infinity.release(model)
    return worst


def test_two_groups_on_one_machine_keep_their_swap_files_apart(tmp_path):
    """Group rank 0 of each group used to take ``<nvme_path>/rank0``, and the second one failed with the
    directory's lock busy: the directories are named by the rank in the job."""
    results = run_ranks(_two_groups, 4, tmp_path)
    assert max(results) <= 1e-5, results
    assert sorted(os.listdir(tmp_path / "nvme")) == ["rank0", "rank1", "rank2", "rank3"]
