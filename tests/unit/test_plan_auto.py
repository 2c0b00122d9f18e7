"""``auto`` placement and the step-time model (infinity/plan/step_model.py, placement.py): decisions for
machine profiles given as data, checked against an exhaustive search and the uniform plan's own bytes."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from infinity.config import ConfigError, load_config
from infinity.plan import PlanError, plan
from infinity.plan.census import ModelCensus
from infinity.plan.machine import MachineProfile, Workload
from infinity.plan.placement import best_split, decide, default_workload, resolve_auto
from infinity.plan.shapes import KNOWN_SHAPES, known_census
from infinity.plan.step_model import PAIRS, RESOURCES, TIERS, Placement, StepModel

GiB = 2**30

# The machines of the issue, as data: rates are typical of each class of machine, not measured here.
PROFILES = {
    "1x80GB": dict(name="1x80GB", device_bytes=80e9, host_bytes=128 * GiB, nvme_bytes=4e12, disk_read_gbps=2.0,
                   disk_write_gbps=2.0, h2d_gbps=25.0, d2h_gbps=25.0, device_flops=400e12,
                   host_adam_params_per_s=1.5e9, host_memory_gbps=100.0),
    "1x24GB": dict(name="1x24GB", device_bytes=24e9, host_bytes=64 * GiB, nvme_bytes=2e12, disk_read_gbps=3.0,
                   disk_write_gbps=2.0, h2d_gbps=12.0, d2h_gbps=12.0, device_flops=80e12,
                   host_adam_params_per_s=0.8e9, host_memory_gbps=50.0),
    "8x80GB": dict(name="8x80GB", ranks=8, device_bytes=80e9, host_bytes=1024 * GiB, nvme_bytes=16e12,
                   disk_read_gbps=12.0, disk_write_gbps=10.0, h2d_gbps=25.0, d2h_gbps=25.0, device_flops=400e12,
                   host_adam_params_per_s=4e9, host_memory_gbps=200.0, interconnect_gbps=150.0),
}
WORKLOAD = Workload(tokens=8192, activation_bytes=4 * GiB)
CFG = load_config("auto", nvme_path="/nonexistent/infinity-plan")
SLICES = 6


def _model(profile: str, model: str, cfg=CFG, **changes) -> StepModel:
    prof = MachineProfile(**{**PROFILES[profile], **changes})
    return StepModel(known_census(model), cfg, prof.ranks, prof, WORKLOAD)


def _every_placement(model: StepModel, slices: int):
    """Every way to put ``slices`` slices into the pairs the engine allows: written here apart from the
    library's search, so a shortcut there cannot hide in both."""
    pairs = [pair for pair in PAIRS if pair in model.pairs]
    for counts in itertools.product(range(slices + 1), repeat=len(pairs) - 1):
        rest = slices - sum(counts)
        if rest >= 0:
            yield Placement(slices, tuple(zip(pairs, (*counts, rest))))


def _fits(model: StepModel, placement: Placement) -> bool:
    need, budget = model.need(placement), model.budget()
    return all(need[t] <= budget[t] for t in TIERS)


CASES = list(itertools.product(PROFILES, KNOWN_SHAPES))


def _fastest_tiers_first(model: StepModel, slices: int):
    """Every placement with the fastest tiers on the same slices (copies of ``a`` slices on the device and ``c``
    in host memory, states of ``b`` and ``d``), none pruned."""
    for a, b in itertools.product(range(slices + 1), repeat=2):
        for c, d in itertools.product(range(slices - a + 1), range(slices - b + 1)):
            placement = Placement.from_counts(slices, (a, c), (b, d))
            if all(pair in model.pairs for pair, _ in placement.cells):
                yield placement


@pytest.mark.parametrize("profile,model_name", CASES)
def test_no_placement_that_fits_predicts_a_faster_step_than_the_split(profile, model_name):
    model = _model(profile, model_name)
    best = best_split(model, SLICES)
    assert best is not None and _fits(model, best.placement)
    faster = [p for p in _fastest_tiers_first(model, SLICES)
              if _fits(model, p) and model.predict(p).step_s < best.step_s * (1 - 1e-9)]
    assert not faster, (f"{best.placement.describe()} predicts {best.step_s:.4f} s but "
                        f"{faster[0].describe()} fits and predicts {model.predict(faster[0]).step_s:.4f} s")


@pytest.mark.parametrize("profile,model_name", CASES)
def test_auto_runs_the_fastest_pair_that_fits(profile, model_name):
    model = _model(profile, model_name)
    decision = decide(model, slices=SLICES)
    chosen = decision.chosen
    assert chosen.fits and _fits(model, chosen.placement)
    for pair in model.pairs:
        other = model.predict(Placement.uniform(*pair))
        if _fits(model, other.placement):
            assert chosen.step_s <= other.step_s, f"{pair} fits and predicts {other.step_s} < {chosen.step_s}"
    # A split of the compute copies too is reported only when the engine's best is slower.
    assert decision.split is None or decision.split.step_s < chosen.step_s


def test_decisions_follow_from_the_sizes():
    """What the sizes alone settle: 1.3B x 16 bytes fits one 80 GB device whole, and nothing beats no
    transfers; 70B's optimizer states (70e9 x 12 bytes) fit neither 128 nor 64 GiB of host memory; on
    eight 80 GB devices 70B's states are 140 GB per rank, more than a device holds."""
    tiers = lambda p, m: decide(_model(p, m), slices=SLICES).tiers()   # noqa: E731
    assert tiers("1x80GB", "gpt-1.3b") == {"params": "device", "optimizer": "device", "optimizer_device_share": 0.0,
                                           "optimizer_host_share": 0.0}
    assert tiers("1x80GB", "llama-70b")["optimizer"] == "nvme"
    assert tiers("1x24GB", "llama-70b")["optimizer"] == "nvme"
    assert tiers("8x80GB", "llama-70b")["optimizer"] != "device"
    assert tiers("8x80GB", "llama-7b")["params"] == "device"


@pytest.mark.parametrize("params,optimizer", [pair for pair in PAIRS])
def test_a_uniform_placement_costs_what_the_plan_counts(params, optimizer):
    """The model's bytes and traffic of a pair are the uniform plan's (infinity/plan/layout.py)."""
    prof = MachineProfile(**{**PROFILES["1x80GB"]})
    census = known_census("gpt-1.3b")
    model = StepModel(census, CFG, 1, prof, Workload(tokens=8192))
    cfg = load_config(CFG, overrides={"tiers": {"params": params, "optimizer": optimizer}})
    expected = plan(census, cfg, check_fit=False)
    need = model.need(Placement.uniform(params, optimizer))
    for tier in TIERS:
        assert need[tier] == pytest.approx(expected.tier_bytes(tier), rel=1e-12), tier
    costs = model.pairs[(params, optimizer)]
    assert sum(costs.h2d) == pytest.approx(expected.host_to_device_bytes)
    assert sum(costs.d2h) == pytest.approx(expected.device_to_host_bytes)
    assert sum(costs.nvme_read) == pytest.approx(expected.nvme_read_bytes)
    assert sum(costs.nvme_write) == pytest.approx(expected.nvme_write_bytes)


def test_collectives_are_what_the_plan_sends_over_the_interconnect():
    cfg = load_config(CFG, overrides={"tiers": {"params": "host", "optimizer": "host"}})
    census = known_census("llama-7b")
    expected = plan(census, cfg, world_size=8, check_fit=False)
    model = _model("8x80GB", "llama-7b")
    costs = model.pairs[("host", "host")]
    assert sum(costs.collectives) == pytest.approx(expected.all_gather_bytes + expected.reduce_scatter_bytes)
    got = model.predict(Placement.uniform("host", "host"))
    assert got.bound_terms["interconnect"] == pytest.approx(sum(costs.collectives) / 150e9)
    # Without a rate the collectives are left out, and nothing else changes.
    alone = _model("8x80GB", "llama-7b", interconnect_gbps=0.0).predict(Placement.uniform("host", "host"))
    assert alone.bound_terms["interconnect"] == 0 and alone.bound_terms["nvme"] == got.bound_terms["nvme"]


@pytest.mark.parametrize("sub_group_size", [2**20, 2**26, 2**31])
def test_the_update_during_backward_waits_for_its_first_sub_group_and_steps_its_last_after(sub_group_size):
    """States in host memory, stepped during backward: the update starts after the backward of the model's last
    sub-group and steps its first one after the backward; so one sub-group (all of a 1B model) is the
    sequential step, and finer ones approach the backward and the update in one window."""
    census = ModelCensus.from_num_params(10**9)
    cfg = load_config({"tiers": {"params": "device", "optimizer": "host"}, "optimizer": {"update_in_backward": True},
                       "partition": {"sub_group_size": sub_group_size}})
    prof = MachineProfile(name="hand", device_bytes=1e12, host_bytes=1e12, device_flops=1e14, h2d_gbps=20.0,
                          d2h_gbps=20.0, host_adam_params_per_s=2e9, host_memory_gbps=100.0)
    model = StepModel(census, cfg, 1, prof, Workload(tokens=4096))
    got = model.predict(Placement.uniform("device", "host"))
    fwd, bwd, upd = (got.phases[k] for k in ("forward", "backward", "update"))
    share = min(1.0, sub_group_size / 10**9)
    assert got.schedule == "update beside backward"
    assert got.step_s >= fwd + max(bwd * share + upd, bwd + upd * share) * (1 - 1e-12)
    assert got.step_s <= fwd + bwd + upd
    if share == 1.0:
        assert got.step_s == pytest.approx(fwd + bwd + upd, rel=1e-12)
    else:
        assert got.step_s < fwd + bwd + upd


def test_the_step_by_hand_with_the_update_beside_the_forward():
    """fp32, params on the device, states on NVMe: the update overlaps the next forward, so the step is
    max(forward compute, the update's NVMe time, its copies, the update then its last sub-group's forward)
    + max(backward compute, gradients out)."""
    census = ModelCensus.from_num_params(10**9)
    cfg = load_config({"tiers": {"params": "device", "optimizer": "nvme", "nvme_path": "/x"}})
    prof = MachineProfile(name="hand", device_bytes=1e12, host_bytes=1e12, nvme_bytes=1e13, device_flops=1e14,
                          h2d_gbps=1000.0, d2h_gbps=3.0, disk_read_gbps=2.0, disk_write_gbps=1.5)
    tokens = 4096
    model = StepModel(census, cfg, 1, prof, Workload(tokens=tokens))
    got = model.predict(Placement.uniform("device", "nvme"))
    p = plan(census, cfg, check_fit=False)
    t = p.shards.trainable_shard_numel
    grads = 4 * t                                   # fp32 gradients, written as backward makes them
    update_disk = p.nvme_read_bytes / 2e9 + (p.nvme_write_bytes - grads) / 1.5e9
    forward = max(2 * 10**9 * tokens / 1e14, update_disk, 4 * t / 1000e9)
    # ... and no shorter than the update alone and then the forward of the groups in its last sub-group.
    last = cfg.partition.sub_group_size / 10**9
    forward = max(forward, max(update_disk, 4 * t / 1000e9) + 2 * 10**9 * tokens / 1e14 * last)
    backward = max(4 * 10**9 * tokens / 1e14, grads / 1.5e9, 4 * t / 3e9)
    assert got.schedule == "update beside forward"
    assert got.step_s == pytest.approx(forward + backward, rel=1e-12)
    assert got.governing == "nvme"
    assert got.bound_terms["nvme"] == pytest.approx(p.nvme_read_bytes / 2e9 + p.nvme_write_bytes / 1.5e9)


@pytest.mark.parametrize("overrides,schedule", [
    ({}, "update beside forward"),
    ({"dpu": {"enabled": True}}, "update beside the whole step"),
    ({"optimizer": {"update_in_backward": True}}, "update beside backward"),
    ({"dpu": {"overlap": False}}, "sequential"),
])
def test_schedules_merge_windows_and_never_beat_the_bound(overrides, schedule):
    cfg = load_config(CFG, overrides={**overrides})
    model = _model("1x24GB", "llama-7b", cfg=cfg)
    for placement in itertools.islice(_every_placement(model, 3), 0, None, 7):
        got = model.predict(placement)
        assert got.step_s >= got.bound_s * (1 - 1e-12)
        assert got.step_s <= sum(got.phases.values()) * (1 + 1e-12)
        assert got.bound_terms[got.governing] == max(got.bound_terms.values())
        assert set(got.bound_terms) == set(RESOURCES)
    got = model.predict(Placement.uniform("host", "nvme"))
    assert got.schedule == schedule
    if schedule == "sequential":
        assert got.step_s == pytest.approx(sum(got.phases.values()))


def test_more_room_or_a_faster_disk_never_predicts_a_slower_choice():
    for profile, name in [("1x24GB", "llama-13b"), ("1x80GB", "llama-70b"), ("1x80GB", "llama-7b")]:
        base = decide(_model(profile, name), slices=SLICES).chosen.step_s
        prof = PROFILES[profile]
        for change in ({"disk_read_gbps": prof["disk_read_gbps"] * 2}, {"host_bytes": prof["host_bytes"] * 2},
                       {"device_bytes": prof["device_bytes"] * 2}):
            assert decide(_model(profile, name, **change), slices=SLICES).chosen.step_s <= base * (1 + 1e-12)


def test_auto_without_nvme_path_never_chooses_nvme_and_says_when_nothing_fits():
    cfg = load_config("auto")
    model = _model("1x80GB", "llama-7b", cfg=cfg)
    chosen = decide(model, slices=SLICES).chosen.placement
    assert chosen.share(params="nvme") == chosen.share(optimizer="nvme") == 0
    with pytest.raises(PlanError, match=r'no placement fits this machine \(1x80GB\):\n  params device, '
                                        r'optimizer device: device: needs'):
        decide(_model("1x80GB", "llama-70b", cfg=cfg), slices=SLICES)


def test_a_fixed_tier_beside_auto_is_kept():
    cfg = load_config(CFG, overrides={"tiers": {"params": "host"}})
    resolved, decision = resolve_auto(cfg, known_census("llama-7b"), machine=MachineProfile(**PROFILES["1x80GB"]))
    assert resolved.tiers.params == "host" and resolved.tiers.optimizer != "auto"
    assert all(c.placement.pair[0] == "host" for c in decision.candidates)
    stage2 = load_config(CFG, overrides={"partition": {"stage": 2}})
    resolved, _ = resolve_auto(stage2, 1.3e9, machine=MachineProfile(**PROFILES["1x80GB"]))
    assert resolved.tiers.params == "device"


def test_plan_of_auto_resolves_the_tiers_and_predicts(tmp_path):
    prof = tmp_path / "box.toml"
    prof.write_text('name = "box"\ndevice_bytes = "24GB"\nhost_bytes = "64GiB"\nnvme_bytes = "2TB"\n'
                    "disk_read_gbps = 3.0\ndisk_write_gbps = 2.0\n")
    p = plan(known_census("llama-13b"), CFG, machine=prof, check_fit=False)
    st = p.settings
    assert {"params": st.params_tier, "optimizer": st.optimizer_tier, "optimizer_device_share":
            st.optimizer_device_share, "optimizer_host_share": st.optimizer_host_share} == p.auto.tiers()
    assert p.prediction is p.auto.chosen
    # The planner's NVMe bound, from the profile's disk rates, is the model's NVMe term.
    assert p.bandwidth.source == "machine profile box"
    assert p.step_time_lower_bound_s == pytest.approx(p.prediction.bound_terms["nvme"], rel=1e-12)
    text = p.table()
    assert "Placement: params" in text and "Predicted step:" in text and "governed by" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert data["prediction"]["governing"] in RESOURCES
    assert data["auto"]["chosen"] == p.auto.tiers()


def test_machine_profiles_are_checked_and_read_from_files(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**PROFILES["8x80GB"], "host_bytes": "1TiB"}))
    prof = MachineProfile.from_file(path)
    assert prof.host_bytes == 2**40 and prof.ranks == 8 and prof.source == str(path)
    assert MachineProfile.from_dict(prof.to_dict()) == prof
    path.write_text(json.dumps({"name": "x", "device_bytes": 1, "host_bytes": 1, "host_gb": 3}))
    with pytest.raises(PlanError, match=r"unknown keys \['host_gb'\]"):
        MachineProfile.from_file(path)
    with pytest.raises(PlanError, match="no disk bandwidth"):
        MachineProfile(name="x", device_bytes=1, host_bytes=1, nvme_bytes=10)
    with pytest.raises(PlanError, match="h2d_gbps must be positive"):
        MachineProfile(name="x", device_bytes=1, host_bytes=1, h2d_gbps=0)


def test_init_with_auto_needs_the_model_size():
    import infinity

    with pytest.raises(ConfigError, match=r'tiers.params: tiers "auto" places states for a model of known size'):
        infinity.Init("auto")


def test_init_with_auto_resolves_and_trains(monkeypatch):
    import torch

    import infinity

    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    # 8 GiB of memory for a 4,160-element model: everything fits "on the device", the CPU's memory.
    box = MachineProfile(name="cpu box", device_bytes=0, host_bytes=8 * GiB, unified=True)
    with infinity.Init("auto", model=64 * 64 + 64, machine=box) as init:
        model = torch.nn.Linear(64, 64)
    assert (init.config.tiers.params, init.config.tiers.optimizer) == ("device", "device")
    assert init.placement.chosen.placement.pair == ("device", "device")
    opt = infinity.AdamW(model, lr=1e-3)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    # 4,160 parameters and 1 MiB of host memory: the states do not all fit in memory, and there is no NVMe.
    tiny = dataclasses.replace(box, host_bytes=2**20)
    with pytest.raises(ConfigError, match="no placement fits this machine"):
        infinity.Init("auto", model=64 * 64 + 64, machine=tiny)


def test_infinity_plan_prints_the_placement_phases_and_governing_term(capsys, tmp_path):
    from infinity.cli.plan import main

    box = tmp_path / "box.json"
    box.write_text(json.dumps(PROFILES["1x24GB"]))
    assert main(["model", "--params", "7B", "--config", "auto", "--set", "tiers.nvme_path=/nonexistent/x",
                 "--machine", str(box), "--tokens", "8192", "--no-check"]) == 0
    out = capsys.readouterr().out
    # as Init("auto") decides: a quarter of the GPU kept for activations not given
    decision = decide(StepModel(ModelCensus.from_num_params(7 * 10**9), CFG, 1, MachineProfile(**PROFILES["1x24GB"]),
                                Workload(tokens=8192, activation_share=0.25)), slices=16)
    assert f"Placement: {decision.chosen.placement.describe()} (tiers \"auto\")" in out
    assert f"Predicted step: {decision.chosen.step_s:.3f} s" in out
    assert "governed by" in out and out.count("\n") > 20
    assert "5.6 GiB of device memory kept for activations" in out
    assert main(["model", "--params", "7B", "--config", "auto", "--set", "tiers.nvme_path=/nonexistent/x",
                 "--machine", str(box), "--activation-bytes", "2GiB", "--no-check"]) == 0
    assert "kept for activations" not in capsys.readouterr().out
    # A fixed preset with a profile: the same lines, without the candidates.
    assert main(["model", "--params", "7B", "--config", "offload-host", "--machine", str(box), "--no-check",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prediction"]["placement"]["describe"] == "params host, optimizer host" and data["auto"] is None
    assert main(["model", "--params", "7B", "--config", "auto", "--machine", str(box), "--tokens", "many"]) == 2
    assert "--tokens: tokens must be a positive whole number" in capsys.readouterr().err


def test_probes_are_cached_per_machine_and_take_the_disk_from_a_bench_file(tmp_path, monkeypatch):
    from infinity.plan import probes

    cache = tmp_path / "machine.json"
    rates = {"h2d_gbps": 7.0, "d2h_gbps": 6.0, "host_memory_gbps": 11.0, "host_adam_params_per_s": 3e8,
             "device_flops": 5e10, "device_update_params_per_s": 3e8}
    key = probes.machine_key("cpu", "bfloat16")
    cache.write_text(json.dumps({key: {"rates": rates, "load_per_core": 0.1}, "another box | cpu": {"rates": {}}}))

    def no_probing(*args, **kwargs):
        raise AssertionError("a cached machine was probed again")
    monkeypatch.setattr(probes, "probe_rates", no_probing)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"best": {"read_gbps": 2.5, "write_gbps": 1.25}}))
    prof = probes.machine_profile("cpu", "bfloat16", nvme_paths=(str(tmp_path),), host_budget=GiB, cache=cache,
                                  bench_json=bench)
    assert (prof.h2d_gbps, prof.host_adam_params_per_s, prof.host_bytes) == (7.0, 3e8, GiB)
    assert (prof.disk_read_gbps, prof.disk_write_gbps) == (2.5, 1.25) and prof.nvme_bytes > 0 and prof.unified
    stored = json.loads(cache.read_text())
    assert stored[key]["disk"]["disk_read_gbps"] == 2.5 and "another box | cpu" in stored
    # Without a bench file the cached disk rates stay; a machine never benched has no NVMe room.
    again = probes.machine_profile("cpu", "bfloat16", nvme_paths=(str(tmp_path),), cache=cache)
    assert again.disk_write_gbps == 1.25
    # Another dtype is another key: probed once, then read from the cache.
    calls = []
    monkeypatch.setattr(probes, "probe_rates", lambda *a, **k: calls.append(a) or dict(rates, device_flops=9e10))
    first = probes.machine_profile("cpu", "float32", cache=cache)
    second = probes.machine_profile("cpu", "float32", cache=cache)
    assert len(calls) == 1 and first.device_flops == second.device_flops == 9e10 and first.nvme_bytes == 0
    # refresh probes again and keeps the disk rates a bench file gave.
    fresh = probes.machine_profile("cpu", "bfloat16", nvme_paths=(str(tmp_path),), cache=cache, refresh=True)
    assert len(calls) == 2 and fresh.device_flops == 9e10 and fresh.disk_read_gbps == 2.5


def test_a_probe_taken_on_a_busy_machine_is_taken_again_once_it_is_quiet(tmp_path, monkeypatch):
    from infinity.plan import probes

    cache = tmp_path / "machine.json"
    calls, load = [], [0.9]
    quiet = {"h2d_gbps": 20.0, "d2h_gbps": 18.0, "host_memory_gbps": 40.0, "host_adam_params_per_s": 2e9,
             "device_flops": 1.7e11, "device_update_params_per_s": 2e9}
    monkeypatch.setattr(probes, "load_per_core", lambda: load[0])
    monkeypatch.setattr(probes, "probe_rates", lambda *a, **k: calls.append(load[0]) or {
        k: v / (5 if load[0] >= probes.BUSY else 1) for k, v in quiet.items()})
    busy = probes.machine_profile("cpu", "bfloat16", cache=cache)
    assert busy.host_adam_params_per_s == 4e8 and json.loads(cache.read_text())[
        probes.machine_key("cpu", "bfloat16")]["load_per_core"] == 0.9
    assert probes.machine_profile("cpu", "bfloat16", cache=cache).host_adam_params_per_s == 4e8
    assert calls == [0.9], "still busy: the cached probe is kept (a probe now would read no better)"
    load[0] = 0.1
    assert probes.cached_profile("cpu", "bfloat16", cache=cache).host_adam_params_per_s == 4e8
    assert calls == [0.9], "cached_profile never probes"
    again = probes.machine_profile("cpu", "bfloat16", cache=cache)
    assert calls == [0.9, 0.1] and again.host_adam_params_per_s == 2e9 and again.device_flops == 1.7e11
    assert probes.machine_profile("cpu", "bfloat16", cache=cache).host_adam_params_per_s == 2e9
    assert calls == [0.9, 0.1], "a probe taken on a quiet machine is kept"
    key = probes.machine_key("cpu", "bfloat16")
    old = json.loads(cache.read_text())
    del old[key]["load_per_core"]       # cached before probes recorded their load
    cache.write_text(json.dumps(old))
    assert probes.machine_profile("cpu", "bfloat16", cache=cache).host_adam_params_per_s == 2e9
    assert calls == [0.9, 0.1, 0.1] and json.loads(cache.read_text())[key]["load_per_core"] == 0.1


def test_the_cached_profile_is_read_without_probing_or_is_none(tmp_path, monkeypatch):
    from infinity.plan import probes

    def no_probing(*args, **kwargs):
        raise AssertionError("cached_profile probed")
    monkeypatch.setattr(probes, "probe_rates", no_probing)
    cache = tmp_path / "machine.json"
    assert probes.cached_profile("cpu", "bfloat16", cache=cache) is None and not cache.exists()
    cache.write_text(json.dumps({probes.machine_key("cpu", "float32"): {"rates": {"h2d_gbps": 1.0}}}))
    assert probes.cached_profile("cpu", "bfloat16", cache=cache) is None      # another dtype's rates only
    rates = {"h2d_gbps": 7.0, "d2h_gbps": 6.0, "host_memory_gbps": 11.0, "host_adam_params_per_s": 3e8,
             "device_flops": 5e10, "device_update_params_per_s": 3e8}
    cache.write_text(json.dumps({probes.machine_key("cpu", "bfloat16"): {"rates": rates}}))
    prof = probes.cached_profile("cpu", "bfloat16", host_budget=GiB, cache=cache)
    assert (prof.device_flops, prof.host_bytes, prof.unified) == (5e10, GiB, True)


def test_a_measured_compute_time_replaces_the_flops():
    cfg = load_config(CFG, overrides={"dpu": {"overlap": False}})
    prof = MachineProfile(**PROFILES["1x80GB"])
    census = known_census("gpt-1.3b")
    flops = StepModel(census, cfg, 1, prof, Workload(tokens=8192)).predict(Placement.uniform("device", "device"))
    measured = StepModel(census, cfg, 1, prof, Workload(tokens=8192, compute_s=3.0))
    got = measured.predict(Placement.uniform("device", "device"))
    update = flops.phases["update"]
    assert got.phases["forward"] == pytest.approx(1.0) and got.phases["backward"] == pytest.approx(2.0)
    assert got.step_s == pytest.approx(3.0 + update) and update > 0
    recompute = StepModel(census, cfg, 1, prof, Workload(tokens=8192, compute_s=4.0, recompute=True))
    assert recompute.predict(Placement.uniform("device", "device")).phases["forward"] == pytest.approx(1.0)
    with pytest.raises(PlanError, match="compute_s must be a finite number"):
        Workload(compute_s=-1.0)


def test_a_placement_counts_its_slices():
    assert Placement.from_counts(4, (1, 2), (0, 4)).cells == ((("device", "host"), 1), (("host", "host"), 2),
                                                               (("nvme", "host"), 1))
    with pytest.raises(PlanError, match="must count its 3 slices"):
        Placement(3, ((("device", "device"), 2),))


def test_auto_keeps_a_share_of_a_gpu_for_activations_it_cannot_know_yet():
    """Resolved at Init, before any step: without ``activations.checkpoint_nbytes`` a quarter of a GPU's memory
    is kept for activations (GPT 6.7B on an 80 GB GPU filled it with states to 82 GB, and the first forward's
    9-12 GB would not have fit); given, the bytes given are kept instead. A CPU device keeps nothing apart."""
    from infinity.plan.placement import ACTIVATION_SHARE

    gpu = MachineProfile(**PROFILES["1x80GB"])
    _, kept = resolve_auto(CFG, 6.7e9, machine=gpu)
    assert kept.reserve_assumed and kept.activation_reserve == ACTIVATION_SHARE * 80e9
    assert kept.chosen.need["device"] <= 80e9 and "GiB of device memory kept for activations" in kept.summary()
    states = kept.chosen.need["device"] - kept.activation_reserve
    assert states <= (1 - ACTIVATION_SHARE) * 80e9
    given = load_config(CFG, overrides={"activations": {"checkpoint_nbytes": "2GB"}})
    _, told = resolve_auto(given, 6.7e9, machine=gpu)
    assert not told.reserve_assumed and told.activation_reserve == 2e9 and "kept for" not in told.summary()
    assert told.chosen.need["device"] - 2e9 > states, "the room the reserve kept goes to states when told less"
    offloaded = load_config(CFG, overrides={"activations": {"offload": "host"}})
    assert resolve_auto(offloaded, 6.7e9, machine=gpu)[1].activation_reserve == 0
    cpu = MachineProfile(**{**PROFILES["1x80GB"], "unified": True, "device_bytes": 0})
    assert resolve_auto(CFG, 1.3e9, machine=cpu)[1].activation_reserve == 0
    with pytest.raises(PlanError, match="activation_share"):
        Workload(activation_share=1.0)
    # tiers given are planned as they are: their fit counts what the config says, nothing guessed
    assert default_workload(load_config("offload-host")).activation_share == 0
    with pytest.raises(PlanError, match=r"(?s)no placement fits.*18\.6 GiB kept for activations, a 0\.25 share"):
        resolve_auto(load_config("auto"), known_census("llama-70b"), machine=gpu)


def test_the_gpu_probe_counts_free_memory_and_this_process_allocators_unused_cache(monkeypatch):
    import torch

    from infinity.plan import probes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (30e9, 80e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 12e9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2e9)
    assert probes.device_free_bytes() == 40e9     # another process's 40 GB and our live 2 GB are not ours
