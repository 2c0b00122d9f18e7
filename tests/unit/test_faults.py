"""Faults injected into a running engine, each with what must survive it (README, "What survives what").

Every test breaks one thing (an exception in the user's code or a hook, a swap file truncated or
overwritten, a disk that fills, a process killed) and checks that the error names what broke and that
nothing is lost: the previous checkpoint loads, the model trains on as if nothing had happened, files
and locks are given back. Small models and few steps: the whole file runs in well under a minute.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

import infinity
from tests.support.tiny_gpt import BufferedGPT as GPT


def nvme_config(tmp_path, **sections):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(nvme),
                     "pool_buffer_size": "256KiB", "pool_buffers": 4},
           "partition": {"sub_group_size": 8192}, "prefetch": {"nvme_bytes": "2MiB"},
           "aio": {"engine": "threads"}, "checkpoint": {"buffer_size": "64KiB"}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def swap_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- Init


class Boom(RuntimeError):
    pass


def test_init_whose_body_raises_gives_back_files_lock_and_memory_and_a_retry_works(tmp_path):
    cfg = nvme_config(tmp_path)
    init = infinity.Init(cfg)
    allocator = None
    with pytest.raises(Boom):
        with init:
            model = GPT()
            allocator = init.engine.tiers.allocator
            assert swap_files(tmp_path)                    # swap files and the lock exist while it runs
            raise Boom("the user's code failed half-way")
    del model
    gc.collect()
    assert swap_files(tmp_path) == [], "swap files or the directory lock were left behind"
    assert allocator.stats()["bytes_allocated"] == 0, "host buffers of the failed Init are still held"
    with infinity.Init(cfg):                               # the retry, in the same process
        model = GPT()
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
    opt.step()


def test_init_whose_module_constructor_raises_gives_back_everything(tmp_path):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(32, 32)
            raise Boom("a constructor failed after its first layer was partitioned")

    cfg = nvme_config(tmp_path)
    with pytest.raises(Boom):
        with infinity.Init(cfg):
            Broken()
    gc.collect()
    assert swap_files(tmp_path) == []
    with infinity.Init(cfg):
        nn.Linear(8, 8)
