"""Parameters frozen inside ``infinity.Init`` beside trainable ones of the same module hold their masters
only ([Note: frozen inside a group] in infinity/runtime/construction.py).

BitFit (every weight frozen, the biases trained) and adapters inside a block freeze after the modules
are built, which left one group per module (per block under the presets' units) training whole: 16
bytes per frozen parameter instead of 4. The context's exit now splits such a group, so the frozen part
is dormant as a module frozen in its own constructor is, bit for bit.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import infinity
from infinity.checkpoint import CheckpointMismatchError
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset
from infinity.registry import engine_of
from tests.integration.test_dormant_states import _held

WIDTH, LAYERS = 256, 3


class FrozenWeightLinear(nn.Linear):
    """A linear layer that freezes its own weight as it is built: its module is partitioned split."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight.requires_grad_(False)


class Stack(nn.Module):
    def __init__(self, linear=nn.Linear) -> None:
        super().__init__()
        self.layers = nn.ModuleList(linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x).float().pow(2).mean()


def _bitfit(model) -> None:
    for p in model.parameters():
        if p.dim() > 1:
            p.requires_grad_(False)


def _config(nvme, params, optimizer, dtype):
    return {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(nvme), "device": "cpu",
                      "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "precision": {"dtype": dtype}, "partition": {"sub_group_size": 32768}, "aio": {"engine": "threads"}}


def _build(tmp_path, name, params, optimizer, dtype, when):
    """``when``: "constructor" (the layers freeze their own weights), "in Init" (BitFit in the Init block,
    after the layers were built) or "after Init" (BitFit after the block: the groups stay whole)."""
    (tmp_path / name).mkdir()
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path / name, params, optimizer, dtype)):
        model = Stack(FrozenWeightLinear if when == "constructor" else nn.Linear)
        if when == "in Init":
            _bitfit(model)
    if when == "after Init":
        _bitfit(model)
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)


def _step(model, opt, i: int) -> float:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    loss = model(x.to(model.layers[0].bias.dtype))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("params, optimizer, dtype", [
    ("host", "host", "float32"), ("nvme", "nvme", "float32"), ("host", "host", "bfloat16"),
    ("nvme", "nvme", "bfloat16"), ("device", "host", "bfloat16")])
def test_bitfit_in_init_holds_what_weights_frozen_in_their_constructor_hold_and_trains_bit_for_bit(
        tmp_path, params, optimizer, dtype):
    runs = {}
    for when in ("constructor", "in Init", "after Init"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[when] = _build(tmp_path, when.replace(" ", "-"), params, optimizer, dtype, when)
        said = [str(w.message) for w in caught if "frozen parameters share parameter groups" in str(w.message)]
        assert len(said) == (when == "after Init"), (when, said)     # the optimizer says what it costs
    for when, (model, _) in runs.items():
        groups = engine_of(model).coordinator.module_groups[model.layers[0]]
        assert len(groups) == (1 if when == "after Init" else 2), when
    held = {when: _held(model, optimizer) for when, (model, _) in runs.items()}
    assert held["in Init"] == held["constructor"]
    # a frozen weight's m and v (4 + 4 bytes) and gradient, at least, for each layer's 65,536 elements
    assert held["after Init"] - held["in Init"] >= 10 * WIDTH * WIDTH * LAYERS
    losses = {when: [] for when in runs}
    for i in range(5):
        if i == 3:      # everything trains from here: the dormant weights wake
            for model, _ in runs.values():
                model.requires_grad_(True)
        for when, (model, opt) in runs.items():
            losses[when].append(_step(model, opt, i))
    assert losses["in Init"] == losses["constructor"] == losses["after Init"]
    assert _held(runs["in Init"][0], optimizer) == _held(runs["constructor"][0], optimizer)
    for model, _ in runs.values():
        infinity.release(model)


def test_a_unit_frozen_in_part_in_init_gathers_as_two_groups_and_trains_as_one_frozen_after(tmp_path):
    """The presets' units (one group per transformer block): BitFit inside ``Init`` splits each block in
    two, both gathered by the block; losses equal those of BitFit after ``Init`` (one group per block)."""
    shape = preset("tiny", n_layer=2)
    runs = {}
    for when in ("in Init", "after Init"):
        nvme = tmp_path / when.replace(" ", "-")
        nvme.mkdir()
        torch.manual_seed(0)
        cfg = load_config("nvme", overrides={"tiers": {"device": "cpu", "nvme_path": str(nvme)}})
        with infinity.Init(cfg):
            model = GPT(shape)
            if when == "in Init":
                _bitfit(model)
        if when == "after Init":
            _bitfit(model)
        runs[when] = model, infinity.AdamW(model, lr=1e-2)
    engine = engine_of(runs["in Init"][0])
    block = runs["in Init"][0].blocks[0]
    groups = engine.coordinator.module_groups[block]
    assert [g.has_trainable for g in groups] == [True, False]
    assert {s.name for g in groups for s in g.slots} == {n for n, _ in block.named_parameters()}
    assert len(engine_of(runs["after Init"][0]).coordinator.module_groups[runs["after Init"][0].blocks[0]]) == 1
    assert _held(runs["in Init"][0], "nvme") < _held(runs["after Init"][0], "nvme")
    data = batches("random", 2, 32, shape.vocab_size, seed=0)
    for _ in range(3):
        x, y = next(data)
        losses = []
        for model, opt in runs.values():
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    for model, _ in runs.values():
        infinity.release(model)


def _resume(cfg, checkpoint, bitfit: bool):
    torch.manual_seed(0)
    with infinity.Init(cfg, resume=checkpoint):
        model = Stack()
        if bitfit:
            _bitfit(model)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    infinity.load_checkpoint(checkpoint, model, opt)
    return model, opt


def test_a_checkpoint_in_place_of_groups_split_in_init_resumes_bit_for_bit(tmp_path):
    """Parameters and states on NVMe, bf16 (split masters): the swap files of the split groups are the
    checkpoint; a run that freezes the same inside ``Init`` adopts them and goes on as if uninterrupted, one
    that does not is refused, saying so."""
    model, opt = _build(tmp_path, "ref", "nvme", "nvme", "bfloat16", "in Init")
    reference = [_step(model, opt, i) for i in range(5)]
    infinity.release(model)
    model, opt = _build(tmp_path, "run", "nvme", "nvme", "bfloat16", "in Init")
    assert [_step(model, opt, i) for i in range(2)] == reference[:2]
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    cfg = _config(tmp_path / "run", "nvme", "nvme", "bfloat16")
    with pytest.raises(CheckpointMismatchError, match="freeze the same parameters inside infinity.Init"):
        _resume(cfg, tmp_path / "ckpt", bitfit=False)      # one group per layer: not the saved layout
    model, opt = _resume(cfg, tmp_path / "ckpt", bitfit=True)
    assert [_step(model, opt, i) for i in range(2, 5)] == reference[2:]
    infinity.release(model)
