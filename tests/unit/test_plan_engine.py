"""The plan's prediction against what the engine's tiers actually hold and move.

A small model is trained for two steps under ``infinity.Init`` with each tier combination; after
them, every tier's bytes in use, the host allocator's bytes and the NVMe bytes read and written
in the second step (steady state: Adam's moments exist) must match ``infinity.plan.plan`` for
the same model and config within 10%.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.plan import plan

REL = 0.10
# Rows the tiers themselves hold (the rest are buffers or transient device memory).
STORED = ("compute_copy", "master", "adam_moments", "grad_accumulator", "dpu_grad_accumulator",
          "dpu_compute_copy")


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))
              for _ in range(2)]
        )
        self.head = nn.Linear(64, 500)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(tokens)))


def _config(tmp_path, params: str, optimizer: str, dtype: str, dpu: bool = False) -> dict:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    return {
        # DPU's warm-up outlasts the two steps: its second buffers exist, its steps stay synchronous.
        "dpu": {"enabled": dpu, "warmup_steps": 10},
        "tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(nvme),
                  "device": "cpu"},
        "precision": {"dtype": dtype},
        "partition": {"sub_group_size": 65536},  # more than one sub-group per rank
        # Buffered I/O: the same bytes move, without this disk's per-request O_DIRECT latency.
        "aio": {"direct": False},
    }


def _small(frozen: bool | str = False) -> Small:
    """``Small``; ``frozen``: its first block frozen (fine-tuning the rest), or ``"bitfit"``: every matrix
    frozen, the vectors trained (each linear layer's weight and bias stay one group in the engine, which
    trains: the plan counts the weight with it)."""
    model = Small()
    if frozen == "bitfit":
        for p in model.parameters():
            p.requires_grad_(p.dim() < 2)
    elif frozen:
        model.blocks[0].requires_grad_(False)
    return model


def _train_two_steps(cfg: dict, frozen: bool = False) -> tuple[dict, dict]:
    """Tier statistics after step 1 and after step 2."""
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = _small(frozen)
    opt = infinity.AdamW(model, lr=1e-3)
    after = []
    for _ in range(2):
        loss = model(torch.randint(0, 500, (2, 8))).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()   # a background update (DPU, dpu.overlap) counts its bytes when it ends
        after.append(infinity.stats(model)["tiers"])
    return after[0], after[1]


def _stored(p, tier: str) -> int:
    return sum(row.nbytes for row in p.rows if row.tier == tier and row.key in STORED)


@pytest.mark.parametrize(
    "params, optimizer, dtype, dpu, frozen",
    [
        ("nvme", "nvme", "bfloat16", False, False),
        ("host", "nvme", "bfloat16", False, False),
        ("host", "host", "bfloat16", False, False),
        ("device", "nvme", "float32", False, False),
        # fp32 with params and optimizer in one tier: the compute copy is stored apart from the master.
        ("nvme", "nvme", "float32", False, False),
        ("host", "host", "float32", False, False),
        ("nvme", "nvme", "bfloat16", True, False),
        ("host", "host", "float32", True, False),
        # A frozen block: its master is held (it may be unfrozen later; in bf16 split while it sleeps), its
        # moments and gradient are not, and its bytes do not move.
        ("nvme", "nvme", "bfloat16", False, True),
        ("host", "host", "float32", True, True),
        ("host", "host", "bfloat16", False, True),
        ("host", "nvme", "bfloat16", False, True),
        ("device", "host", "bfloat16", False, True),
        ("nvme", "nvme", "bfloat16", False, "bitfit"),
    ],
)
def test_plan_matches_the_tiers_after_training(tmp_path, params, optimizer, dtype, dpu, frozen):
    cfg = _config(tmp_path, params, optimizer, dtype, dpu)
    first, second = _train_two_steps(cfg, frozen)
    p = plan(_small(frozen), cfg, check_fit=False)
    for tier in ("device", "host", "nvme"):
        if tier in second:
            assert second[tier]["bytes_in_use"] == pytest.approx(_stored(p, tier), rel=REL), tier
    # Every host row (tier storage, I/O pool, sub-group buffers, staging) comes from the allocator; the NVMe
    # I/O pool's buffers each at the first loan that finds none free, so those not made yet count at their size.
    pool = (second.get("nvme") or {}).get("pool") or {}
    unmade = pool["nbytes"] - pool["made_nbytes"] if pool else 0
    assert second["host_allocator"]["bytes_allocated"] + unmade == pytest.approx(
        p.tier_bytes("host"), rel=REL)
    if "nvme" in (params, optimizer):
        read = second["nvme"]["bytes_read"] - first["nvme"]["bytes_read"]
        written = second["nvme"]["bytes_written"] - first["nvme"]["bytes_written"]
        assert read == pytest.approx(p.nvme_read_bytes, rel=REL)
        assert written == pytest.approx(p.nvme_write_bytes, rel=REL)
    else:
        assert p.nvme_read_bytes == p.nvme_write_bytes == 0


def per_parameter_after_steps(cfg: dict, steps: int = 3):
    """Train ``Small`` under ``cfg`` for ``steps`` steps: the engine's bytes per parameter of the last
    step, the plan's, and the optimizer's stats."""
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Small()
    opt = infinity.AdamW(model, lr=1e-3)
    for _ in range(steps):
        model(torch.randint(0, 500, (2, 8))).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
    measured = infinity.stats(model)["transfers"]["per_parameter"]
    planned = plan(Small(), cfg, check_fit=False).per_parameter()
    stats = opt.stats()
    infinity.release(model)
    return measured, planned, stats


@pytest.mark.parametrize("params, optimizer, stored", [("nvme", "nvme", 14), ("host", "host", 16)])
def test_bytes_per_parameter_planned_and_measured_agree(tmp_path, params, optimizer, stored):
    """Stored bytes and NVMe bytes read and written per parameter per step: the plan's figures and the
    engine's (``infinity.stats(model)["transfers"]["per_parameter"]``) within 5%."""
    measured, planned, _ = per_parameter_after_steps(_config(tmp_path, params, optimizer, "bfloat16"))
    assert measured["stored"] == pytest.approx(planned["stored"], rel=0.05)
    assert measured["stored_nvme"] == pytest.approx(planned["stored_nvme"], rel=0.05)
    assert measured["nvme_read"] == pytest.approx(planned["nvme_read"], rel=0.05)
    assert measured["nvme_written"] == pytest.approx(planned["nvme_written"], rel=0.05)
    # bf16 compute, one micro-batch: compute copy 2 + master 2 (remainder, on NVMe) or 4 + m, v 8 + gradient 2
    assert planned["stored"] == pytest.approx(stored, rel=0.05)


def test_delayed_updates_move_the_planned_bytes_per_parameter(tmp_path):
    """With DPU running (one warm-up step, then delayed jobs) both gradient sets are compact: NVMe stores
    18 bytes per parameter (14, a second compute copy and a second bf16 gradient), and a step moves
    what the plan says."""
    cfg = _config(tmp_path, "nvme", "nvme", "bfloat16", dpu=True)
    cfg["dpu"]["warmup_steps"] = 1
    measured, planned, stats = per_parameter_after_steps(cfg, steps=4)
    assert stats["delayed_steps"] >= 2, "the steps measured ran in the background"
    for key in ("stored", "stored_nvme", "nvme_read", "nvme_written"):
        assert measured[key] == pytest.approx(planned[key], rel=0.05), key
    assert planned["stored_nvme"] == pytest.approx(18, rel=0.05)


def _hits_per_step(cfg: dict, steps: int = 4) -> tuple[list[int], dict]:
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Small()
    opt = infinity.AdamW(model, lr=1e-3)
    hits = []
    for _ in range(steps):
        before = infinity.stats(model)["fetch"]["prefetch_hits"]
        model(torch.randint(0, 500, (2, 8))).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()       # the overlapped update done: hits do not depend on how it raced the forward
        hits.append(infinity.stats(model)["fetch"]["prefetch_hits"] - before)
    arena = infinity.stats(model)["prefetch"]["arena"]
    infinity.release(model)
    return hits, arena


def test_the_read_ahead_arena_is_sized_to_a_small_model_as_planned_and_prefetches_as_the_whole_budget(
        tmp_path, monkeypatch):
    """A model of a few hundred KiB got the whole prefetch.nvme_bytes (256 MiB; 512 in the nvme preset) of host
    memory ([Note: the arena sized to the model] in infinity/prefetch/prefetcher.py)."""
    from infinity.prefetch import prefetcher

    cfg = _config(tmp_path, "nvme", "nvme", "bfloat16")
    hits, arena = _hits_per_step(cfg)
    shards = 2 * (65_536 + 36_864 + 36_864 + 4_096 + 36_864 + 36_864 + 4_096 + 65_536)     # bf16, 4 KiB each
    assert arena["capacity"] == arena["nbytes"] == shards and arena["refused"] == 0
    assert dict((r.key, r.nbytes) for r in plan(Small(), cfg, check_fit=False).rows)["prefetch_arena"] == shards
    monkeypatch.setattr(prefetcher, "read_ahead_arena_nbytes", lambda budget, shard_nbytes: int(budget))
    (tmp_path / "whole").mkdir()
    whole_hits, whole = _hits_per_step(_config(tmp_path / "whole", "nvme", "nvme", "bfloat16"))
    assert whole["capacity"] == 256 * 2**20 and whole_hits == hits and sum(hits) > 0
