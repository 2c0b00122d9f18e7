"""A load that fails at any tier call, into optimizer states split over tiers and into NVMe: mended by the next load.

``load_checkpoint`` writes the saved bytes into each sub-group's tier: the device and host shares by memory
writes, the NVMe share through the swap files ([Note: optimizer states over tiers] in
infinity/optim/tier_split.py). An I/O error at the k-th allocation, read or write of any tier during the load
(each k of ``_fault_points``; INFINITY_TEST_ALL_FAULTS=1 tries each) must be raised as it is, leave the engine
refusing to train when bytes had reached the tiers, and a second load must mend it: the run then continues
exactly as the one that loaded once.
"""
from __future__ import annotations

import errno

import pytest
import torch

import infinity
from infinity import registry
from infinity.errors import EngineError
from tests.unit.test_step_faults import SPLIT, _config, _Fault, _fault_points, _tier_calls
from tests.support.tiny_gpt import TinyGPT, batches


def _build(tmp_path, tiers):
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, "float32", tiers=tiers)):
        model = TinyGPT(d=48)
    return model, infinity.AdamW(model, lr=1e-2)


def _train(model, opt, data):
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _load_with_fault(tmp_path, tiers, ckpt, fault):
    """A model trained one step on other data, the checkpoint loaded (``fault`` armed during the first try, and a
    second load after a failure): the losses of two more steps, what the first load raised, and whether the
    engine refused to train in between."""
    model, opt = _build(tmp_path, tiers)
    _train(model, opt, batches(1, 4, seed=7))      # states the load must replace
    opt.synchronize()       # the overlapped update's tier calls are not the load's
    said, refused = None, False
    if fault is not None:
        _tier_calls(registry.engine_of(model, "test"), fault, every_tier=True)
        fault.armed = True
    try:
        infinity.load_checkpoint(ckpt, model, opt)
    except OSError as exc:
        said = exc
        try:
            model(*batches(1, 4)[0])
        except EngineError as exc:
            refused = "load a checkpoint" in str(exc)
        infinity.load_checkpoint(ckpt, model, opt)
    finally:
        if fault is not None:
            fault.armed = False
    losses = _train(model, opt, batches(4, 4)[2:])
    infinity.release(model)
    return losses, said, refused


@pytest.mark.parametrize("tiers", [SPLIT, None], ids=["states split device/host/nvme", "nvme"])
def test_a_load_failing_at_any_tier_call_is_mended_by_the_next_load(tmp_path, tiers):
    model, opt = _build(tmp_path / "saved", tiers)
    _train(model, opt, batches(4, 4)[:2])
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt)
    infinity.release(model)
    expected, _, _ = _load_with_fault(tmp_path / "ref", tiers, ckpt, None)
    counting = _Fault(10 ** 9, OSError(errno.EIO, "Input/output error (injected)"))
    _load_with_fault(tmp_path / "count", tiers, ckpt, counting)
    assert counting.calls >= 4, f"only {counting.calls} tier calls in the load"
    refused_runs = 0
    for k in _fault_points(counting.calls):
        fault = _Fault(k, OSError(errno.EIO, "Input/output error (injected)"))
        losses, said, refused = _load_with_fault(tmp_path / f"k{k}", tiers, ckpt, fault)
        assert fault.fired and said is not None and "injected" in str(said), (k, said)
        assert losses == expected, f"a load failing at tier call {k} of {counting.calls}, then a second load, " \
                                   f"trained differently ({said!r})"
        refused_runs += refused
    assert refused_runs, "no failed load left the engine refusing to train: the fault points missed the tier writes"
