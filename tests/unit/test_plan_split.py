"""``auto`` placement over the optimizer states split over tiers ([Note: auto placement] in
infinity/plan/placement.py, [Note: optimizer states over tiers] in infinity/optim/tier_split.py): the choice
among what the engine runs, the step of a split as the engine schedules it, and a split config's bytes per
tier as the plan and the engine count them."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from infinity.config import load_config
from infinity.optim.tier_split import cut_groups, group_kind
from infinity.plan import plan
from infinity.plan.census import ModelCensus
from infinity.plan.layout import Layout, shard_numel
from infinity.prefetch.prefetcher import read_ahead_arena_nbytes
from infinity.plan.machine import MachineProfile, Workload
from infinity.plan.placement import SPLIT_WORTH, decide, resolve_auto
from infinity.plan.shapes import KNOWN_SHAPES, known_census
from infinity.plan.step_model import TIERS, Placement, StepModel
from tests.unit.test_plan_auto import CFG, PROFILES, WORKLOAD, _fits, _model

SLICES = 8


def _runnable(model: StepModel, slices: int):
    """Every placement the engine runs, written apart from the library's search: one params tier, the states'
    slices on the device, in host memory and on NVMe, fastest first."""
    for params in TIERS:
        for device, host in itertools.product(range(slices + 1), repeat=2):
            if device + host <= slices:
                cells = (((params, "device"), device), ((params, "host"), host),
                         ((params, "nvme"), slices - device - host))
                # The update during backward runs the host optimizer: never all of the states on the device.
                if model.cfg.optimizer.update_in_backward and device == slices:
                    continue
                if all(pair in model.pairs for pair, n in cells if n):
                    yield Placement(slices, cells)


# With the update during backward too: the engine steps a split's host and NVMe shares during backward and its
# device share in opt.step(), so auto may choose a device share, never all of the states on the device.
IN_BACKWARD = load_config("auto", nvme_path="/nonexistent/infinity-plan",
                          overrides={"optimizer": {"update_in_backward": True}})


@pytest.mark.parametrize("profile,model_name,cfg", [(p, m, c) for p, m in itertools.product(PROFILES, KNOWN_SHAPES)
                                                    for c in (CFG, IN_BACKWARD)])
def test_auto_runs_the_fastest_runnable_placement_that_fits(profile, model_name, cfg):
    model = _model(profile, model_name, cfg=cfg)
    decision = decide(model, slices=SLICES)
    chosen = decision.chosen
    assert chosen.placement.params_tier is not None and chosen.fits and _fits(model, chosen.placement)
    # The decision is a config the engine takes.
    load_config(cfg, overrides={"tiers": decision.tiers()})
    # A split is taken only when it is worth its second tier: SPLIT_WORTH shorter than the best uniform pair.
    bar = chosen.step_s * (1 - SPLIT_WORTH if chosen.placement.pair is not None else 1 - 1e-9)
    faster = [p for p in _runnable(model, SLICES) if _fits(model, p) and model.predict(p).step_s < bar]
    assert not faster, (f"{chosen.placement.describe()} predicts {chosen.step_s:.4f} s but {faster[0].describe()} "
                        f"fits and predicts {model.predict(faster[0]).step_s:.4f} s")
    faster_uniform = [p for p in _runnable(model, SLICES) if p.pair is not None and _fits(model, p)
                      and model.predict(p).step_s < chosen.step_s * (1 - 1e-9)]
    assert not faster_uniform, faster_uniform[0].describe()
    if decision.split is not None:      # reported only when it beats what the engine runs
        assert decision.split.placement.params_tier is None and decision.split.step_s < chosen.step_s


def test_a_split_wins_where_the_states_do_not_fit_the_device():
    """13B on one 80 GB GPU: the uniform pairs put all of the states on NVMe (182 s); the engine's split keeps
    a share on the device and in host memory and predicts several times less."""
    decision = decide(_model("1x80GB", "llama-13b"), slices=16)
    tiers = decision.tiers()
    assert tiers["optimizer"] == "nvme" and tiers["optimizer_device_share"] > 0 and tiers["optimizer_host_share"] > 0
    uniform = min(c.step_s for c in decision.candidates if c.fits)
    assert decision.chosen.step_s < uniform / 3
    assert "device_update" in decision.chosen.phases


def test_with_the_update_during_backward_a_split_keeps_its_device_share():
    """13B on one 80 GB GPU, the update during backward: auto still keeps a share of the states on the device (stepped
    inside opt.step()) and one in host memory, and predicts a shorter step than the overlapped one."""
    with_key = decide(_model("1x80GB", "llama-13b", cfg=IN_BACKWARD), slices=16)
    without = decide(_model("1x80GB", "llama-13b"), slices=16)
    tiers = with_key.tiers()
    assert tiers["optimizer_device_share"] > 0 and tiers["optimizer_host_share"] > 0
    assert with_key.chosen.schedule == "update beside backward" and "device_update" in with_key.chosen.phases
    assert with_key.chosen.step_s < without.chosen.step_s


def test_the_device_share_is_stepped_before_the_forward():
    """fp32, params on the device, half of the states on the device and half in host memory, on a GPU: the host
    half's update runs beside the next forward, the device half's inside opt.step(), before it; so the step is
    max(forward, host update, its copies, host update then its last sub-group's forward) + max(backward, gradients
    out) + the device update."""
    census = ModelCensus.from_num_params(10**9)
    cfg = load_config({"tiers": {"params": "device", "optimizer": "host", "optimizer_device_share": 0.5}})
    prof = MachineProfile(name="hand", device_bytes=1e12, host_bytes=1e12, device_flops=1e14, h2d_gbps=10.0,
                          d2h_gbps=5.0, host_adam_params_per_s=1e9, host_memory_gbps=1e6,
                          device_update_params_per_s=2e10)
    tokens = 4096
    model = StepModel(census, cfg, 1, prof, Workload(tokens=tokens))
    got = model.predict(Placement(2, ((("device", "device"), 1), (("device", "host"), 1))))
    p = plan(census, cfg, check_fit=False)
    half = p.shards.trainable_shard_numel / 2
    forward = max(2 * 10**9 * tokens / 1e14, half / 1e9, 4 * half / 10e9)
    # ... no shorter than the host update alone, then the forward of the groups in its last sub-group.
    forward = max(forward, max(half / 1e9, 4 * half / 10e9) + 2 * 10**9 * tokens / 1e14 * cfg.partition.sub_group_size
                  / 10**9)
    backward = max(4 * 10**9 * tokens / 1e14, 4 * half / 5e9)
    device = half / 2e10
    assert got.schedule == "update beside forward"
    assert got.phases["device_update"] == pytest.approx(device)
    assert got.step_s == pytest.approx(forward + backward + device, rel=1e-12)
    # The config's own tiers, as infinity-plan predicts them, are the same placement.
    from infinity.plan.placement import predict_configured

    assert predict_configured(cfg, census, 1, 1, prof, Workload(tokens=tokens)).step_s == pytest.approx(got.step_s)


def _expected(census, device_share, host_share, base):
    """Elements (all, trainable) per tier, cut as the engine cuts."""
    shards = [shard_numel(g.numel, 1) for g in census.groups]
    cuts = cut_groups(shards, device_share, host_share)
    out: dict[str, list[int]] = {}
    for i, (n, g) in enumerate(zip(shards, census.groups)):
        counts = out.setdefault(group_kind(cuts, base, i), [0, 0])
        counts[0] += n
        counts[1] += n if g.trainable else 0
    return out


@pytest.mark.parametrize("device_share,host_share,grad_bytes", [(0.25, 0.25, 4), (0.0, 0.5, 2)])
def test_a_config_with_shares_is_counted_per_tier(device_share, host_share, grad_bytes):
    """bf16, states split: each tier holds its share's fp32 masters (no split masters), m, v and gradients (fp32
    with a device share, else bf16); only the NVMe share is streamed."""
    census = known_census("llama-7b")
    cfg = load_config({"precision": {"dtype": "bfloat16"}, "tiers": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": "/nonexistent/x", "optimizer_device_share": device_share,
        "optimizer_host_share": host_share}})
    p = plan(census, cfg, check_fit=False)
    expected = _expected(census, device_share, host_share, "nvme")
    for tier in TIERS:
        rows = {r.key: r for r in p.rows if r.tier == tier and r.key in ("master", "adam_moments", "grad_accumulator")}
        n, t = expected.get(tier, (0, 0))
        assert (rows["master"].nbytes if rows else 0) == 4 * n, tier
        assert (rows["adam_moments"].nbytes if rows else 0) == 8 * t, tier
        assert (rows["grad_accumulator"].nbytes if rows else 0) == grad_bytes * t, tier
    t_nvme = expected["nvme"][1]
    on_disk = [-(-shard_numel(g.numel, 1) * 2 // 4096) * 4096 for g in census.groups]
    # Written: the NVMe share's gradients, masters and moments, and every rewritten compute copy.
    assert p.nvme_write_bytes == (4 + 8 + grad_bytes) * t_nvme + sum(on_disk)
    # Read: the NVMe share's states, and the compute copies (forward and backward) but the fresh ones the
    # overlapped update hands the next forward, which the device share's groups (stepped inside opt.step())
    # do not offer.
    layout = Layout(census, cfg, 1, 2)
    cuts = cut_groups([shard_numel(g.numel, 1) for g in census.groups], device_share, host_share)
    kinds = [group_kind(cuts, "nvme", i) for i in range(len(census.groups))]
    arena = read_ahead_arena_nbytes(cfg.prefetch.nvme_bytes, on_disk)
    offered = [n for n, kind in zip(on_disk, kinds) if kind != "device"]
    assert layout.fresh_bytes() == max(min(arena, sum(offered)), sum(n for n in offered if n <= arena))
    assert p.nvme_read_bytes == 2 * sum(on_disk) - layout.fresh_bytes() + (4 + 8 + grad_bytes) * t_nvme
    assert p.per_parameter()["stored_nvme"] < 14
    text = p.table()
    assert ", the rest in nvme" in text and ("the device share" in text if device_share else "the host share" in text)


def test_the_plan_counts_what_the_engine_puts_in_each_tier(monkeypatch, tmp_path):
    """A tiny model with its states split over the device (the CPU here), host memory and NVMe: the plan's
    elements per tier are what the engine's store got (``infinity.stats(model)["optimizer_tiers"]``)."""
    import infinity
    from tests.support.tiny_gpt import TinyGPT

    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    cfg = load_config({"tiers": {"params": "host", "optimizer": "nvme", "nvme_path": str(tmp_path),
                                 "optimizer_device_share": 0.3, "optimizer_host_share": 0.4,
                                 "pool_buffer_size": "256KiB", "pool_buffers": 4},
                       "partition": {"sub_group_size": 4096}, "aio": {"engine": "threads"},
                       "prefetch": {"nvme_bytes": "2MiB"}})
    with torch.device("meta"):
        meta = TinyGPT()
    planned = plan(meta, cfg, check_fit=False)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-3)
    got = infinity.stats(model)["optimizer_tiers"]
    rows = {r.tier: r.nbytes // 4 for r in planned.rows if r.key == "master"}
    assert {kind: info["elements"] for kind, info in got.items()} == rows
    assert set(rows) == {"device", "host", "nvme"}
    del opt
    infinity.release(model)


def test_resolving_auto_sets_the_shares_and_infinity_plan_prints_them(capsys, tmp_path):
    census = known_census("llama-13b")
    prof = MachineProfile(**PROFILES["1x80GB"])
    resolved, decision = resolve_auto(CFG, census, machine=prof, workload=WORKLOAD)
    t = resolved.tiers
    assert (t.params, t.optimizer, t.optimizer_device_share, t.optimizer_host_share) == tuple(decision.tiers().values())
    assert t.optimizer_device_share > 0
    # The plan of the resolved config holds what the model counted.
    counted = plan(census, resolved, check_fit=False)
    need = decision.chosen.need
    assert counted.tier_bytes("host") == pytest.approx(need["host"])
    assert counted.tier_bytes("device") + WORKLOAD.activation_bytes == pytest.approx(need["device"])
    from infinity.cli.plan import main

    box = tmp_path / "box.json"
    box.write_text(json.dumps(PROFILES["1x80GB"]))
    assert main(["model", "--params", "13B", "--config", "auto", "--set", "tiers.nvme_path=/nonexistent/x",
                 "--activation-bytes", "4GiB", "--machine", str(box), "--tokens", "8192", "--no-check"]) == 0
    out = capsys.readouterr().out
    assert "Placement: params device, optimizer device " in out and "device update " in out
    assert "The optimizer states are split over tiers" in out and "on the device, " in out and "the rest in nvme" in out
