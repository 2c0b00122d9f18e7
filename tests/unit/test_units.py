"""``partition.units``: a transformer block partitioned as one group, gathered by the block alone."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity import registry
from infinity.config import load_config
from infinity.errors import EngineError
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, Block, preset
from infinity.plan.census import census_of_module
from tests.support import gpt_runs
from tests.support.timing import copies_keep_up


def _build(tmp_path, name: str, units, n_layer: int = 3, **sections):
    return gpt_runs.build(tmp_path, name, n_layer, partition={"units": units}, **sections)


def _train(model, shape, steps: int = 4) -> list[float]:
    return gpt_runs.losses(model, shape, steps)


@pytest.mark.parametrize("units", ["auto", ["Block"], ["Bl*"]])
def test_each_block_is_one_group_gathered_by_the_block_alone(tmp_path, units):
    model, _ = _build(tmp_path, "offload-host", units)
    coordinator = registry.engine_of(model, "test").coordinator
    assert [g.name for g in coordinator.groups] == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    for block in model.blocks:
        (group,) = coordinator.module_groups[block]
        assert {id(s.param) for s in group.slots} == {id(p) for p in block.parameters()}
        for inner in list(block.modules())[1:]:
            assert not coordinator.module_groups.get(inner), "a layer inside a unit gathers nothing itself"


def test_without_units_or_a_declared_class_every_module_keeps_its_group(tmp_path):
    class Plain(nn.Module):     # declares no _no_split_modules: "auto" finds no unit
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

    with infinity.Init(load_config("offload-host", overrides={"tiers": {"device": "cpu"},
                                                              "partition": {"units": "auto"}})):
        model = Plain()
    assert [g.name for g in registry.engine_of(model, "test").coordinator.groups] == ["a", "b"]


@pytest.mark.parametrize("name", ["device", "offload-optimizer", "offload-host", "nvme"])
def test_units_train_bit_for_bit_like_one_group_per_module(tmp_path, name):
    per_module = _train(*_build(tmp_path / "a", name, []))
    model, shape = _build(tmp_path / "b", name, "auto")
    assert _train(model, shape) == per_module
    ledger = infinity.stats(model)["transfers"]
    assert ledger["unpooled"] == 0 and ledger["per_parameter_calls"] == 0, ledger
    if copies_keep_up():
        assert ledger["host_waits"]["forward"] == ledger["host_waits"]["backward"] == 0, ledger


def test_fewer_groups_take_fewer_engine_calls(tmp_path):
    # The point of units: the engine's host work follows the groups, not the layers (a count, not a time).
    import cProfile
    import pstats

    def calls(units) -> int:
        model, shape = _build(tmp_path / str(units), "offload-host", units, n_layer=6)
        _train(model, shape, steps=2)
        data = batches("random", 4, 32, shape.vocab_size, seed=1)
        x, y = next(data)
        prof = cProfile.Profile()
        prof.enable()
        model(x, y).backward()
        prof.disable()
        return pstats.Stats(prof).total_calls

    assert calls("auto") < 0.6 * calls([])


def test_the_plan_counts_the_groups_the_engine_makes(tmp_path):
    model, shape = _build(tmp_path, "nvme", "auto")
    groups = registry.engine_of(model, "test").coordinator.groups
    with torch.device("meta"):
        census = census_of_module(GPT(shape), units=("auto",))
    assert [(g.name, g.numel) for g in census.groups] == [(g.name, g.numel) for g in groups]


class _Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)


class _Model(nn.Module):
    _no_split_modules = ["_Unit"]

    def __init__(self):
        super().__init__()
        self.u = _Unit()
        self.out = nn.Linear(64, 64)


def test_a_tiled_layer_inside_a_unit_is_refused_naming_both(tmp_path):
    overrides = {"tiers": {"device": "cpu"}, "partition": {"units": "auto"},
                 "tiling": {"enabled": True, "modules": ["u.lin"], "tiles": 2}}
    with pytest.raises(EngineError, match=r"u\.lin.*_Unit.*partition\.units"):
        with infinity.Init(load_config("offload-host", overrides=overrides)):
            _Model()
    overrides["tiling"]["modules"] = ["out"]        # outside the unit: tiled as before
    with infinity.Init(load_config("offload-host", overrides=overrides)):
        model = _Model()
    names = [g.name for g in registry.engine_of(model, "test").coordinator.groups]
    assert names[0] == "u" and len(names) > 2, names


def test_a_unit_built_alone_is_one_group(tmp_path):
    with infinity.Init(load_config("offload-host", overrides={"tiers": {"device": "cpu"},
                                                              "partition": {"units": ["Block"]}})):
        block = Block(preset("tiny"))
    (group,) = registry.engine_of(block, "test").coordinator.groups
    assert len(group.slots) == len(list(block.parameters()))
