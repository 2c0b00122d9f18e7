"""Once a step follows the recorded trace, only the modules with parameter groups (and the roots) keep
the engine's forward hooks ([Note: which modules stay hooked] in infinity/runtime/hooks.py)."""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity import registry
from infinity.errors import EngineError
from infinity.runtime import engine as engine_module
from tests.support.gpt_runs import build, losses


def _hooked(model) -> dict:
    engine = registry.engine_of(model, "test")
    return {name: engine.hooks[0].hooked(m) for name, m in model.named_modules()}


def test_after_the_recorded_step_only_the_roots_and_the_group_owners_stay_hooked(tmp_path):
    model, shape = build(tmp_path / "nvme", "offload-host", n_layer=2)
    assert all(_hooked(model).values()), "every module is hooked while the first step records the trace"
    losses(model, shape, steps=3)
    hooked = _hooked(model)
    engine = registry.engine_of(model, "test")
    owners = {name for name, m in model.named_modules() if engine.coordinator.module_groups.get(m)}
    assert {name for name, on in hooked.items() if on} == owners | {""}
    # one group per block (partition.units = "auto"): the block is hooked, what is inside it is not
    assert hooked["blocks.0"] and not hooked["blocks.0.attn"] and not hooked["blocks.0.attn.qkv"]


def test_an_unhooked_module_called_alone_refuses_its_released_parameters_by_name(tmp_path):
    model, shape = build(tmp_path / "nvme", "offload-host", n_layer=2)
    losses(model, shape, steps=3)
    x = torch.randn(1, 4, shape.d_model, dtype=torch.bfloat16)
    with pytest.raises(EngineError, match="infinity.gathered"):
        model.blocks[0].attn.qkv(x)
    with torch.no_grad():
        assert model.blocks[0](x).shape == x.shape, "a block owns its group: called alone, it gathers it"
        with infinity.gathered(model):
            assert model.blocks[0].attn.qkv(x).shape == (1, 4, 3 * shape.d_model)


def test_training_goes_on_exactly_when_the_idle_hooks_go(tmp_path, monkeypatch):
    """The same losses with every module hooked all along."""
    model, shape = build(tmp_path / "a", "offload-host", n_layer=2)
    unhooked = losses(model, shape, steps=4)
    monkeypatch.setattr(engine_module, "unhook_idle", lambda *args: None)
    model, shape = build(tmp_path / "b", "offload-host", n_layer=2)
    hooked = losses(model, shape, steps=4)
    assert all(_hooked(model).values())
    assert unhooked == hooked
