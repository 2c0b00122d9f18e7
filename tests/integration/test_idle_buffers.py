"""Host buffers that training with everything on NVMe does not use: the NVMe tier's I/O pool, which only
unaligned transfers use and the engine's own (construction's writes of cast shards and split masters, the
gradient reads a norm makes each step) are aligned, so it makes none of its buffers, and the demand-read
staging buffers beyond as many as reads overlapped in (see [Note: constant-size buffers] in tiers/pool.py,
[Note: staging buffers] in infinity/runtime/shards.py). Each is zeroed when made, so it would count in the
resident set whether used or not."""
from __future__ import annotations

import torch

import infinity
from infinity.registry import engine_of
from tests.support.tiny_gpt import TinyGPT


def test_training_on_nvme_makes_no_idle_buffer(tmp_path):
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path), "device": "cpu"},
           "partition": {"units": "auto"}, "precision": {"dtype": "bfloat16"}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT(vocab=256, d=64, heads=4, layers=3, seq=32)
    opt = infinity.AdamW(model, lr=1e-3)
    engine = engine_of(model, "test")
    pool = engine.tiers.pool
    loans = pool.stats()["acquires"]        # construction's writes of layers smaller than 4096 bytes
    assert pool.made == pool.stats()["peak_in_use"] == 1, "a buffer is made only for a loan that finds none free"
    for step in range(3):
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
        model(x, torch.roll(x, -1, dims=1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)     # reads the gradients from NVMe
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert pool.stats()["acquires"] == loans, f"a training step's transfer went through the I/O pool: {pool.stats()}"
    staging = engine.coordinator.shards.staging.stats()
    assert staging["buffers"] == staging["peak_in_use"], staging
    assert staging["buffers"] < 3 and engine.stats()["transfers"]["unpooled"] == 0, staging
