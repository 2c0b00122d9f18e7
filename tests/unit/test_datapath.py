"""The GPU data path's contract, checked on the CPU through the transfer ledger (one rank).

For every preset, in a steady-state step (the trace recorded, the optimizer's update landed):
no host<->device copy from memory outside the tiers' pools (pageable on a GPU), no host wait
for the device in forward or backward, at most two host->device copies per parameter group (one
more per extra module holding it: a tied weight is gathered by both its users in forward),
no engine call per parameter, and the bytes moved between host and device, and to and from
NVMe, equal to what ``infinity-plan`` prints for that configuration. A second test fails if
any module other than the data path calls a host-waiting torch function during a step.
"""
from __future__ import annotations

import collections
import inspect
import os

import pytest
import torch

import infinity
from infinity import registry
from infinity.config import load_config
from infinity.plan import plan
from tests.support.tiny_gpt import TinyGPT, batches
from tests.support.timing import copies_keep_up

PRESETS = ["device", "offload-optimizer", "offload-host", "nvme"]


def _config(tmp_path, preset: str, **sections):
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path), "pool_buffer_size": "1MiB",
                           "pool_buffers": 4},
                 "partition": {"sub_group_size": 8192},
                 "prefetch": {"nvme_bytes": "4MiB", "device_bytes": "1MiB"}, **sections}
    return load_config(preset, overrides=overrides)


def _steady_ledger(cfg, steps: int = 4):
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-3)
    for idx, tgt in batches(steps, 2):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()     # a background update's bytes belong to the step that took it
    return model, infinity.stats(model)["transfers"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_steady_step_keeps_the_gpu_rules_and_moves_the_planned_bytes(tmp_path, preset):
    cfg = _config(tmp_path, preset)
    model, ledger = _steady_ledger(cfg)
    coordinator = registry.engine_of(model).coordinator
    holders = collections.Counter(g for groups in coordinator.module_groups.values() for g in groups)
    assert ledger is not None, "no complete step was recorded"
    assert ledger["unpooled"] == 0, ledger
    if copies_keep_up():
        assert ledger["host_waits"]["forward"] == 0 and ledger["host_waits"]["backward"] == 0, ledger
    assert ledger["host_to_device"]["copies"] <= sum(holders[g] + 1 for g in coordinator.groups), ledger
    assert ledger["per_parameter_calls"] == 0, ledger
    expected = plan(TinyGPT(), cfg, check_fit=False)
    assert ledger["host_to_device"]["bytes"] == expected.host_to_device_bytes, (ledger, expected.host_to_device_bytes)
    assert ledger["device_to_host"]["bytes"] == expected.device_to_host_bytes, (ledger, expected.device_to_host_bytes)
    assert ledger["nvme_to_host"]["bytes"] == expected.nvme_read_bytes
    assert ledger["host_to_nvme"]["bytes"] == expected.nvme_write_bytes


def test_the_device_preset_moves_nothing(tmp_path):
    _, ledger = _steady_ledger(_config(tmp_path, "device"))
    moved = {k: v for k, v in ledger.items() if isinstance(v, dict) and "bytes" in v and v["bytes"]}
    assert moved == {}


def test_offload_host_uploads_the_compute_dtype_twice_and_downloads_gradients_once(tmp_path):
    cfg = _config(tmp_path, "offload-host")
    model, ledger = _steady_ledger(cfg)
    groups = registry.engine_of(model).coordinator.groups
    wte = groups[0]     # tied to the head: gathered by the embedding and by the head in forward
    assert wte.name == "wte" and wte.dtype == torch.bfloat16
    assert ledger["host_to_device"]["bytes"] == 2 * sum(g.shard_nbytes for g in groups) + wte.shard_nbytes
    assert ledger["device_to_host"]["bytes"] == sum(g.shard_nbytes for g in groups if g.trainable)


def _warmed_up(cfg):
    """A model two steps in (the trace recorded), its optimizer, and four batches (two used)."""
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-3)
    data = batches(4, 2)
    for idx, tgt in data[:2]:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, data


_HOST_WAITS = [(torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"),
               (torch.Tensor, "__float__"), (torch.Tensor, "__bool__")]


@pytest.mark.parametrize("preset", ["offload-host", "nvme"])
def test_only_the_data_path_waits_for_the_device(tmp_path, preset, monkeypatch):
    """Every torch call that makes the host wait for a device tensor, made by engine code during a
    step, comes from infinity/runtime/datapath.py (on a GPU, the others would stall the stream)."""
    cfg = _config(tmp_path, preset)
    model, opt, data = _warmed_up(cfg)
    root = os.path.dirname(os.path.dirname(infinity.__file__))
    allowed = os.path.join(root, "infinity", "runtime", "datapath.py")
    callers = []

    def watch(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            frame = inspect.currentframe().f_back
            path = frame.f_code.co_filename
            if path.startswith(os.path.join(root, "infinity")) or path.startswith(os.path.join(root, "tiers")):
                if path != allowed:
                    callers.append(f"{os.path.relpath(path, root)}:{frame.f_lineno} {name}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls, name in _HOST_WAITS:
        watch(cls, name)
    for idx, tgt in data[2:]:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    monkeypatch.undo()
    assert callers == [], callers


def test_a_steady_step_intercepts_no_torch_call(tmp_path, monkeypatch):
    """Python runs per module, not per torch op: once the trace is followed, the foreign-parameter
    watch (a torch-function mode) is off, and the attention's out_proj, used without being called,
    is still gathered with the attention module."""
    from infinity.runtime.foreign import ForeignParamWatch

    cfg = _config(tmp_path, "offload-host")
    model, opt, data = _warmed_up(cfg)
    coordinator = registry.engine_of(model).coordinator
    attn = model.blocks[0].attn
    out_proj = coordinator.group_of[attn.out_proj.weight]
    assert out_proj in coordinator.module_groups[attn], "the first step's watch adopts out_proj into attn"
    calls = []
    original = ForeignParamWatch.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(ForeignParamWatch, "__torch_function__", counting)
    losses = []
    for idx, tgt in data[2:]:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert calls == []
    assert all(torch.isfinite(torch.tensor(losses)))
