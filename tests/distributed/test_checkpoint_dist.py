"""Checkpoints across world sizes: exact resume on 2 ranks, resharding 2 -> 1 and 1 -> 2, host and NVMe tiers.

2 ranks save from host tiers (resumed on 1 rank in NVMe tiers) and from NVMe tiers (resumed on
2 ranks); 1 rank saves from host tiers and 2 ranks resume with NVMe parameters and host states.

Every rank draws the same batches (same seeds, same restored RNG), so the mean gradient over 2
ranks is exactly the gradient of one rank ((g + g) / 2 == g in floating point) and, with the
same number of torch threads in every process, a 2-rank run follows the 1-rank trajectory bit
for bit: a checkpoint resharded between world sizes must continue exactly as the run it was
saved from.
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import infinity
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import BufferedGPT

K, N = 1, 2


def GPT(**kwargs) -> BufferedGPT:
    """The tiny GPT of the engine tests with one persistent buffer."""
    return BufferedGPT(scratch=False, **kwargs)


def config(workdir, tag, params, optimizer):
    nvme = os.path.join(str(workdir), f"nvme-{tag}")
    os.makedirs(nvme, exist_ok=True)
    return {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": nvme,
                      "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "partition": {"sub_group_size": 8192}, "prefetch": {"nvme_bytes": "2MiB"},
            "aio": {"engine": "threads"}, "checkpoint": {"buffer_size": "64KiB"}}


def build(cfg, seed):
    torch.manual_seed(seed)
    with infinity.Init(cfg):
        model = GPT()
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.01)


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def train(model, opt, steps):
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 16))
        tgt = torch.randint(0, 64, (4, 16))
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def gathered(model):
    with infinity.gathered(model):
        return {k: v.clone() for k, v in model.state_dict().items()}


def shards(opt):
    sd = opt.state_dict()["shards"]
    return {s: torch.cat(sd[s]) for s in ("master", "exp_avg", "exp_avg_sq")}


def assert_equal_dicts(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def _ranks(rank, world, workdir):
    reference_1 = torch.load(os.path.join(workdir, "reference1.pt"))
    out = {}
    for tiers in (("host", "host"), ("nvme", "nvme")):
        tag = "-".join(tiers)
        model, opt = build(config(workdir, f"a-{tag}", *tiers), 0)
        with torch.no_grad():
            model.pos_scale.fill_(0.5)
        seed_all(1)
        train(model, opt, K)
        infinity.save_checkpoint(os.path.join(workdir, f"ckpt2-{tag}"), model, opt, extra={"rank": rank})
        losses = train(model, opt, N)
        params, states = gathered(model), shards(opt)
        if tiers == ("host", "host"):
            # Resumed by the parent on one rank (2 -> 1).
            out = {"losses": losses, "params": params}
            continue
        resumed, ropt = build(config(workdir, f"b-{tag}", *tiers), 5)
        assert infinity.load_checkpoint(os.path.join(workdir, f"ckpt2-{tag}"), resumed, ropt) == {"rank": rank}
        assert train(resumed, ropt, N) == losses, tag
        assert_equal_dicts(gathered(resumed), params, f"params after resuming on 2 ranks ({tag})")
        assert_equal_dicts(shards(ropt), states, f"optimizer shards after resuming on 2 ranks ({tag})")
    # 1 -> 2: the checkpoint saved by one rank (parent process), into NVMe params and host states on two.
    model, opt = build(config(workdir, "c", "nvme", "host"), 9)
    infinity.load_checkpoint(os.path.join(workdir, "ckpt1"), model, opt)
    assert opt.step_count == K
    assert train(model, opt, N) == reference_1["losses"]
    assert_equal_dicts(gathered(model), reference_1["params"], "params after resharding 1 -> 2")
    return out


@pytest.fixture
def one_thread():
    """The spawned ranks run torch with one thread; so must this process, or matmuls round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_resume_on_two_ranks_and_reshard_both_ways(tmp_path, one_thread):
    # One rank: the run the 1 -> 2 load must continue.
    model, opt = build(config(tmp_path, "p", "host", "host"), 0)
    with torch.no_grad():
        model.pos_scale.fill_(0.5)
    seed_all(1)
    train(model, opt, K)
    infinity.save_checkpoint(tmp_path / "ckpt1", model, opt)
    torch.save({"losses": train(model, opt, N), "params": gathered(model)}, tmp_path / "reference1.pt")

    results = run_ranks(_ranks, 2, tmp_path)
    assert results[0]["losses"] == results[1]["losses"]

    # 2 -> 1: the 2-rank host checkpoint continues here exactly as it did on 2 ranks.
    model, opt = build(config(tmp_path, "q", "nvme", "nvme"), 4)
    infinity.load_checkpoint(tmp_path / "ckpt2-host-host", model, opt)
    assert opt.step_count == K and torch.equal(model.pos_scale, torch.full((16, 1), 0.5))
    assert train(model, opt, N) == results[0]["losses"]
    assert_equal_dicts(gathered(model), results[0]["params"], "params after resharding 2 -> 1")
    assert infinity.checkpoint.verify_checkpoint(tmp_path / "ckpt2-nvme-nvme")["world_size"] == 2
