"""Per-rank plans of small models, checked against sums worked out by hand.

[Note: the tiny model]
fc1 = Linear(100, 300): 30,000 + 300 = 30,300 elements; norm = LayerNorm(300): 600;
fc2 = Linear(300, 10, bias=False): 3,000. On 2 ranks each group's shard is
ceil(numel / 2) rounded up to 2048 elements: fc1 15,150 -> 16,384; norm 300 -> 2,048;
fc2 1,500 -> 2,048; 20,480 elements per rank, 40,960 over both (7,060 of padding).
The largest group gathered is fc1: 32,768 elements.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.plan import Bandwidth, ModelCensus, PlanError, census_of_module, load_model, plan
from infinity.plan.layout import SHARD_ALIGN_NUMEL, shard_numel

MiB = 1 << 20


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(100, 300)
        self.norm = nn.LayerNorm(300)
        self.fc2 = nn.Linear(300, 10, bias=False)


def _rows(p):
    return {row.key: (row.tier, row.nbytes) for row in p.rows}


def test_host_params_nvme_optimizer_bf16(tmp_path):
    cfg = {
        "tiers": {"params": "host", "optimizer": "nvme", "nvme_path": str(tmp_path)},
        "precision": {"dtype": "bfloat16"},
        "partition": {"persistence_threshold": 1000},
    }
    p = plan(Tiny(), cfg, world_size=2, nvme_bandwidth=(1.0, 2.0), check_fit=False)
    assert p.num_params == 33_900
    assert p.shards.shard_numel == 20_480
    assert p.shards.trainable_shard_numel == 20_480
    assert p.shards.padding_numel == 7_060
    assert p.shards.largest_group == "fc1"
    assert p.shards.largest_group_numel == 32_768
    assert _rows(p) == {
        "compute_copy": ("host", 2 * 20_480),
        "master": ("nvme", 4 * 20_480),
        "adam_moments": ("nvme", 8 * 20_480),
        # One micro-batch per step: gradient shards stored in bf16, as they arrive.
        "grad_accumulator": ("nvme", 2 * 20_480),
        "pool_buffers": ("host", 8 * 64 * MiB),
        # The whole shard is smaller than a sub-group: 2 sets x (4 fp32 states + the bf16 gradient
        # as read) x 20,480.
        "optimizer_subgroup_buffers": ("host", 2 * (4 * 4 + 2) * 20_480),
        "working_set": ("device", 2 * 32_768),
        # fc1's gradient bucket, in bf16 as the gradients are, before its reduce-scatter.
        "working_set_grad": ("device", 2 * 2 * 32_768),   # two buckets of the largest
        # Two host buffers for gradient shards on their way to the fp32 accumulator on NVMe: fc1's
        # shard is 16,384 bf16 elements, 32 KiB.
        "grad_staging": ("host", 2 * 2 * 16_384),
        # No compute-copy staging: the update's C pass writes the new bf16 compute copies straight
        # into the host tier (with parameters on NVMe or the device they go through two sub-groups'
        # worth of it).
        "device_prefetch": ("device", 128 * MiB),
        # norm (600 elements < 1000) stays gathered: 4,096 padded elements in bf16.
        "persistent_params": ("device", 2 * 4_096),
    }
    assert p.tier_bytes("host") == 40_960 + 8 * 64 * MiB + 737_280 + 65_536   # no compute-copy staging
    assert p.tier_bytes("nvme") == 14 * 20_480
    # Optimizer pass: read master, m, v (4 + 8) and the bf16 grad (2); write grad (backward, 2) + master, m, v.
    assert p.nvme_read_bytes == 14 * 20_480
    assert p.nvme_write_bytes == 14 * 20_480
    # Both ranks share the disk: 2 x (286,720 B / 1 GB/s + 286,720 B / 2 GB/s).
    assert p.step_time_lower_bound_s == pytest.approx(2 * (286_720 / 1e9 + 286_720 / 2e9))


def test_everything_on_nvme_fp32_stores_the_compute_copy_apart_from_the_master(tmp_path):
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}}
    p = plan(Tiny(), cfg, world_size=2, check_fit=False)
    rows = _rows(p)
    # Shards of fc1 (16,384), norm (2,048) and fc2 (2,048) elements, fp32, as the engine stores them.
    assert rows["compute_copy"] == ("nvme", 81_920)
    assert rows["master"] == ("nvme", 4 * 20_480)
    # Demand staging: 3 buffers of the largest shard (fc1 16,384 x 4 B = 64 KiB), and the read-ahead
    # arena: twice every shard, less than prefetch.nvme_bytes (256 MiB by default; [Note: the arena sized
    # to the model] in infinity/prefetch/prefetcher.py).
    assert rows["nvme_staging"] == ("host", 3 * 65_536)
    assert rows["prefetch_arena"] == ("host", 2 * 81_920)
    assert rows["working_set"] == ("device", 4 * 32_768)
    # Forward and backward read the compute copy: 2 x 81,920, less what the forward takes from the
    # overlapped step's fresh shards (all 81,920: they fit in prefetch.nvme_bytes); then the optimizer pass.
    assert p.nvme_read_bytes == 2 * 81_920 - 81_920 + 16 * 20_480
    no_overlap = plan(Tiny(), {**cfg, "dpu": {"overlap": False}}, world_size=2, check_fit=False)
    assert no_overlap.nvme_read_bytes == 2 * 81_920 + 16 * 20_480
    # Gradients, master, m, v, and the new compute copy.
    assert p.nvme_write_bytes == 16 * 20_480 + 81_920
    assert p.step_time_lower_bound_s is None


@pytest.mark.parametrize("arena, paced, ended", [
    # Every shard (fc1 64 KiB, norm and fc2 8 KiB each) fits a 64 KiB arena: a forward keeping pace with
    # the update takes all 81,920 bytes from host memory; after the update only the first 64 KiB wait.
    (65_536, 81_920, 65_536),
    # An arena as large as every shard together: the same either way.
    (81_920, 81_920, 81_920),
])
def test_fresh_shards_when_the_forward_keeps_pace_and_when_the_update_ends_first(tmp_path, arena, paced, ended):
    """[Note: NVMe traffic per step]: the plan's reads assume the forward keeps pace with the
    overlapped update (each fresh shard taken as it is made, its arena slice reused); ``nvme_read_bytes_max``
    is the case of an update ending before the forward starts."""
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)},
           "prefetch": {"nvme_bytes": arena}}
    p = plan(Tiny(), cfg, world_size=2, check_fit=False)
    optimizer_pass = 16 * 20_480
    assert p.nvme_read_bytes == 2 * 81_920 - paced + optimizer_pass
    assert p.nvme_read_bytes_max == 2 * 81_920 - ended + optimizer_pass
    assert p.to_dict()["nvme_read_bytes_per_step_max"] == p.nvme_read_bytes_max


def test_nvme_params_host_optimizer_with_frozen_group(tmp_path):
    model = Tiny()
    model.fc2.weight.requires_grad_(False)
    cfg = {
        "tiers": {"params": "nvme", "optimizer": "host", "nvme_path": str(tmp_path)},
        "precision": {"dtype": "bfloat16"},
        "prefetch": {"enabled": False},
    }
    p = plan(model, cfg, world_size=2, check_fit=False)
    rows = _rows(p)
    trainable = 16_384 + 2_048
    assert p.shards.trainable_shard_numel == trainable
    assert rows["compute_copy"] == ("nvme", 2 * 20_480)
    # Every element's master, the frozen group's too (it may be unfrozen): as a 2-byte remainder beside its
    # bf16 copy while it is frozen ([Note: dormant sub-groups] in infinity/optim/flat_state.py).
    assert rows["master"] == ("host", 4 * trainable + 2 * (20_480 - trainable))
    # Moments and a bf16 gradient for the trainable elements only.
    assert rows["adam_moments"] == ("host", 8 * trainable)
    assert rows["grad_accumulator"] == ("host", 2 * trainable)
    assert "device_prefetch" not in rows and "optimizer_subgroup_buffers" not in rows
    # Demand staging is there whether or not prefetching is on (3 x 32 KiB shards); no arena.
    assert rows["nvme_staging"] == ("host", 3 * 32_768)
    assert "prefetch_arena" not in rows
    assert p.nvme_read_bytes == 2 * 2 * 20_480
    # Only trainable groups' compute copies are rewritten by the update.
    assert p.nvme_write_bytes == 2 * trainable


def test_needs_cover_this_machine(tmp_path):
    cfg = {
        "tiers": {"params": "host", "optimizer": "nvme", "nvme_path": str(tmp_path),
                  "device": "cpu"},
        "precision": {"dtype": "bfloat16"},
    }
    p = plan(Tiny(), cfg, world_size=4, local_ranks=2, check_fit=False)
    needs = p.needs()
    per_tier = {tier: sum(n.nbytes for n in needs if n.tier == tier)
                for tier in ("device", "host", "nvme")}
    # Two ranks on this machine; with the CPU as compute device its "device" bytes are RAM too.
    assert per_tier == {tier: 2 * p.tier_bytes(tier) for tier in per_tier}
    assert {n.path for n in needs if n.tier == "nvme"} == {str(tmp_path)}
    assert all(n.what.endswith("(x2 ranks)") for n in needs)
    assert "fp32 master (x2 ranks)" in {n.what for n in needs}
    assert sum(n.nbytes for n in p.needs(local_ranks=1)) == sum(
        p.tier_bytes(t) for t in ("device", "host", "nvme"))


def test_nvme_bytes_spread_over_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = {"tiers": {"params": "host", "optimizer": "nvme", "nvme_path": [str(a), str(b)]}}
    p = plan(Tiny(), cfg, world_size=2, local_ranks=1, check_fit=False)
    nvme = [n for n in p.needs() if n.tier == "nvme"]
    assert {n.path for n in nvme} == {str(a), str(b)}
    assert sum(n.nbytes for n in nvme) == p.tier_bytes("nvme")


def test_fit_check_names_the_shortfall(tmp_path):
    cfg = {
        "tiers": {"params": "host", "optimizer": "nvme", "nvme_path": str(tmp_path),
                  "host_budget": "1MiB"},
    }
    p = plan(Tiny(), cfg, world_size=1)
    assert p.fit is not None and not p.fit.fits
    assert any("host_budget" in line for line in p.fit.shortfalls)
    roomy = plan(Tiny(), {"tiers": {"host_budget": "64GiB"}, "prefetch": {"enabled": False}})
    assert roomy.fit is not None and roomy.fit.fits, roomy.fit.shortfalls
    assert "Fits this machine (1 rank): yes" in roomy.table()


def test_table_and_dict_say_units_and_agree(tmp_path):
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)},
           "precision": {"dtype": "bfloat16"}}
    p = plan(Tiny(), cfg, world_size=2, nvme_bandwidth=Bandwidth(2.0, 3.0, "test"),
             check_fit=False)
    text = p.table()
    assert "GiB = 2^30 bytes" in text and "GB = 1e9 bytes" in text
    assert "ranks 0-1" in text and "padded to a multiple of 2048" in text
    d = p.to_dict()
    assert d["tier_bytes"]["nvme"] == p.tier_bytes("nvme")
    assert d["nvme_read_bytes_per_step"] == p.nvme_read_bytes
    assert d["step_time_lower_bound_s"] == pytest.approx(
        2 * (p.nvme_read_bytes / 2e9 + p.nvme_write_bytes / 3e9))
    assert [r["key"] for r in d["per_rank"]] == [r.key for r in p.rows]


def test_tiling_splits_large_linear_layers():
    model = nn.Linear(64, 4096)  # weight 262,144 elements, bias 4,096
    tiling = dict(tiling_enabled=True, tiling_threshold=100_000, param_bytes=2)
    # 128 KiB tiles of bf16: ceil(262,144 x 2 / 131,072) = 4 tiles of 1,024 rows x 64.
    census = census_of_module(model, max_tile_bytes=128 * 1024, **tiling)
    assert [(g.name, g.numel) for g in census.groups] == [
        (f"<root>[tile {i}/4]", 65_536) for i in range(1, 5)] + [("<root>", 4_096)]
    # tiles = 3 splits 4,096 rows as 1,366 / 1,365 / 1,365.
    census = census_of_module(model, tiles=3, **tiling)
    assert [g.numel for g in census.groups] == [1_366 * 64, 1_365 * 64, 1_365 * 64, 4_096]
    # Patterns that do not match leave the layer whole; below the threshold nothing is tiled.
    assert len(census_of_module(model, tiles=3, tiling_modules=("blocks.*",), **tiling).groups) == 1
    assert len(census_of_module(model, tiles=3, tiling_enabled=True, tiling_threshold=10**6,
                                param_bytes=2).groups) == 1
    # The tile is the working set.
    p = plan(model, {"tiling": {"threshold": 100_000, "tiles": 3},
                     "precision": {"dtype": "bfloat16"}}, check_fit=False)
    assert p.shards.largest_group == "<root>[tile 1/3]"
    assert p.shards.largest_group_numel == shard_numel(1_366 * 64, 1)


def test_tied_weights_and_meta_models_count_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.head = nn.Linear(64, 1000, bias=False)
            self.head.weight = self.emb.weight

    with torch.device("meta"):
        model = Tied()
    assert model.emb.weight.is_meta
    census = census_of_module(model)
    assert [(g.name, g.numel) for g in census.groups] == [("emb", 64_000)]


def test_callable_spec_builds_on_meta(tmp_path, monkeypatch):
    (tmp_path / "plan_tinymod.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "SEEN = []\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Linear(100, 300), nn.LayerNorm(300))\n"
        "    SEEN.append(m[0].weight.device.type)\n"
        "    return m\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = load_model("plan_tinymod:build")
    import plan_tinymod

    assert plan_tinymod.SEEN == ["meta"]
    p = plan("plan_tinymod:build", {}, world_size=2, check_fit=False)
    assert p.source == "plan_tinymod:build"
    assert p.num_params == sum(t.numel() for t in model.parameters()) == 30_900


def test_bare_parameter_count():
    p = plan("1e6", {"precision": {"dtype": "bfloat16"}}, check_fit=False)
    assert p.num_params == 10**6
    assert p.shards.shard_numel == shard_numel(10**6, 1) == 1_001_472
    assert p.shards.largest_group is None and p.row("working_set") is None
    assert "largest working set: unknown" in p.table()
    census = ModelCensus.from_num_params(10**6)
    assert plan(census, {}, check_fit=False).num_params == 10**6


def test_padding_matches_the_engine():
    param_group = pytest.importorskip("infinity.param_group")
    assert SHARD_ALIGN_NUMEL == param_group.ALIGN_NUMEL
    for numel in (1, 4095, 4096, 4097, 30_300, 10**7 + 1):
        for ranks in (1, 2, 3, 4, 7):
            assert shard_numel(numel, ranks) == param_group.padded_shard_numel(numel, ranks)


@pytest.mark.parametrize(
    "model, kwargs, match",
    [
        (Tiny(), {"world_size": 0}, "world_size must be a positive integer"),
        (Tiny(), {"world_size": -2}, "world_size must be a positive integer"),
        (Tiny(), {"world_size": 4, "local_ranks": 3}, r"local_ranks \(3\) must divide world_size"),
        (Tiny(), {"world_size": 2, "local_ranks": 4}, "must divide world_size"),
        (0, {}, "must be positive"),
        (-1e9, {}, "must be positive"),
        (object(), {}, "model must be an nn.Module"),
        (nn.ReLU(), {}, "has no parameters"),
        (Tiny(), {"nvme_bandwidth": (0.0, 1.0)}, "read_gbps must be a positive number"),
        (Tiny(), {"nvme_bandwidth": (1.0, -3.0)}, "write_gbps must be a positive number"),
    ],
)
def test_bad_plan_input(model, kwargs, match):
    with pytest.raises(PlanError, match=match):
        plan(model, {}, check_fit=False, **kwargs)


def test_tiles_must_fit_the_rows():
    with pytest.raises(PlanError, match="tiling.tiles = 3 but layer '<root>' has only 2"):
        plan(nn.Linear(64, 2), {"tiling": {"threshold": 1, "tiles": 3}}, check_fit=False)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_pkg_for_plan.models:build",
         "cannot import module 'no_such_pkg_for_plan.models' .*ModuleNotFoundError"),
        ("torch.nn", "must look like 'package.module:callable'"),
        ("torch.nn:NoSuchLayer", "module 'torch.nn' has no attribute 'NoSuchLayer'"),
        ("torch.nn:Linear", "building model 'torch.nn:Linear' on the meta device failed: TypeError"),
        ("math:pi", "is not callable"),
        ("builtins:dict", "returned a dict, not a torch.nn.Module"),
    ],
)
def test_bad_model_callable(spec, match):
    with pytest.raises(PlanError, match=match):
        plan(spec, {}, check_fit=False)


@pytest.mark.parametrize(
    "config, match",
    [
        ("/nonexistent/offload.toml", "config /nonexistent/offload.toml does not load"),
        ({"tiers": {"parms": "host"}}, "does not load: .*parms"),
        ({"tiers": {"params": "nvme"}}, "does not load: .*nvme_path"),
        ("no-such-preset", "does not load"),
    ],
)
def test_bad_config(config, match):
    with pytest.raises(PlanError, match=match):
        plan(Tiny(), config, check_fit=False)


def test_a_module_frozen_in_part_or_whole_holds_the_frozen_parameters_masters_only(tmp_path):
    """BitFit freezes a module's weight after the module was built: the engine splits the module's group at
    ``infinity.Init``'s exit ([Note: frozen inside a group]), so the frozen weight is dormant as a module
    frozen whole is: its master only, 2 bytes beside its bf16 copy ([Note: dormant sub-groups])."""
    cfg = {"tiers": {"params": "host", "optimizer": "host"}, "precision": {"dtype": "bfloat16"}}
    model = Tiny()
    model.fc1.weight.requires_grad_(False)      # fc1: weight 30,000 -> 16,384 per rank, bias 300 -> 2,048
    model.fc2.requires_grad_(False)             # fc2: 2,048 per rank, frozen whole
    rows = _rows(plan(model, cfg, world_size=2, check_fit=False))
    held = 2_048 + 2_048                        # fc1's bias and the norm
    frozen = 16_384 + 2_048                     # fc1's weight, fc2
    assert rows["adam_moments"] == ("host", 8 * held)
    assert rows["grad_accumulator"] == ("host", 2 * held)
    assert rows["master"] == ("host", 4 * held + 2 * frozen)
