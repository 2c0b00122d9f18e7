"""The GPU data path's contract at world size 2 (gloo on the CPU): the ledger of a steady step.

Each rank moves only its shards: the host<->device and NVMe bytes of infinity-plan at world size 2,
no unpooled copy, no host wait in forward or backward, no per-parameter engine call; every
collective went through the checked wrapper (infinity/runtime/ranks.py).
"""
from __future__ import annotations

import os

import torch

import infinity
from infinity.config import load_config
from infinity.plan import plan
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches
from tests.support.timing import copies_keep_up

PRESETS = ("offload-optimizer", "offload-host", "nvme")


def _ranks(rank, world, workdir):
    out = {}
    for preset in PRESETS:
        nvme = os.path.join(workdir, f"nvme-{preset}")
        os.makedirs(nvme, exist_ok=True)
        cfg = load_config(preset, overrides={
            "tiers": {"device": "cpu", "nvme_path": nvme, "pool_buffer_size": "1MiB", "pool_buffers": 4},
            "partition": {"sub_group_size": 8192},
            "prefetch": {"nvme_bytes": "4MiB", "device_bytes": "1MiB"}})
        torch.manual_seed(0)
        with infinity.Init(cfg):
            model = TinyGPT()
        opt = infinity.AdamW(model, lr=1e-3)
        for idx, tgt in batches(4, 2):
            model(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
        expected = plan(TinyGPT(), cfg, world_size=world, check_fit=False)
        stats = infinity.stats(model)
        out[preset] = (stats["transfers"],
                       (expected.host_to_device_bytes, expected.device_to_host_bytes,
                        expected.nvme_read_bytes, expected.nvme_write_bytes),
                       (stats["comm"], expected.all_gather_bytes, expected.reduce_scatter_bytes))
    return out


def test_two_ranks_keep_the_rules_and_move_their_shards(tmp_path):
    for rank, result in enumerate(run_ranks(_ranks, 2, tmp_path)):
        for preset, (ledger, (h2d, d2h, nvme_read, nvme_write), (comm, gather, scatter)) in result.items():
            where = f"rank {rank}, {preset}: {ledger}"
            assert ledger["unpooled"] == 0, where
            if copies_keep_up():
                assert ledger["host_waits"]["forward"] == ledger["host_waits"]["backward"] == 0, where
            assert ledger["per_parameter_calls"] == 0, where
            assert ledger["host_to_device"]["bytes"] == h2d, where
            assert ledger["device_to_host"]["bytes"] == d2h, where
            assert ledger["nvme_to_host"]["bytes"] == nvme_read, where
            assert ledger["host_to_nvme"]["bytes"] == nvme_write, where
            # What the collectives sent is what infinity-plan says for the tied-weight model.
            assert (comm["all_gather_bytes"], comm["reduce_scatter_bytes"]) == (gather, scatter), (where, comm)
            assert comm["all_reduce_bytes"] > 0 and comm["calls"]["broadcast"] == 0, comm
