"""A step's device memory above its start (``infinity.stats(model)["steps"]``, [Note: step records] in
infinity/telemetry.py) and, after the first step of tiers "auto", how it compares with what the choice kept for
activations ([Note: activations before the first step] in infinity/plan/placement.py). CUDA's counters are
played by a script here: the engine runs on the CPU."""
from __future__ import annotations

import itertools
import logging
import types

import pytest
import torch

import infinity
from infinity import telemetry
from infinity.registry import engine_of
from tests.support.tiny_gpt import TinyGPT, batches

GiB = 2**30


def _train(monkeypatch, readings, placement, steps=3):
    """Train ``steps`` steps with CUDA's (allocated, peak) counters read from ``readings`` in turn."""
    it = itertools.chain(readings, itertools.repeat(readings[-1]))     # then steady
    monkeypatch.setattr(telemetry, "device_memory", lambda datapath: next(it))
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "precision": {"dtype": "float32"}}):
        model = TinyGPT()
    engine_of(model).placement = placement
    opt = infinity.AdamW(model, lr=1e-2)
    for idx, tgt in batches(steps, 2):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    records = infinity.stats(model)["steps"]
    infinity.release(model)
    return records


@pytest.mark.parametrize("peak, said", [(12 * GiB, "more than the 10.0 GiB"), (2 * GiB, "may put more states"),
                                        (7 * GiB, None)])
def test_the_first_step_is_weighed_against_the_share_auto_kept_for_activations(monkeypatch, caplog, peak, said):
    kept = types.SimpleNamespace(reserve_assumed=True, activation_reserve=10 * GiB)
    start = 30 * GiB    # allocated when step 0 began; the peak so far was construction's, lower
    readings = [(start, start), (0, start + peak),                         # step 0: begins, is recorded
                (start, start + peak), (0, start + peak)]                  # step 1: hidden by step 0's peak
    with caplog.at_level(logging.INFO, logger="infinity"):
        records = _train(monkeypatch, readings, kept)
    assert records[0]["device_peak_over_start"] == peak
    assert records[1]["device_peak_over_start"] is None, "a step under an earlier peak cannot be told"
    messages = [r.getMessage() for r in caplog.records if "kept" in r.getMessage()]
    if said is None:
        assert messages == [], "within what was kept: nothing to say"
    else:
        (message,) = messages
        assert said in message and f"activations.checkpoint_nbytes = {peak}" in message


def test_no_word_without_auto_or_when_the_activations_were_given(monkeypatch, caplog):
    readings = [(0, 0), (0, 50 * GiB)] * 2
    with caplog.at_level(logging.INFO, logger="infinity"):
        _train(monkeypatch, readings, None, steps=2)
        _train(monkeypatch, readings, types.SimpleNamespace(reserve_assumed=False, activation_reserve=GiB), steps=2)
    assert not [r for r in caplog.records if "kept" in r.getMessage()]


def test_a_cpu_device_records_no_device_peak():
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "precision": {"dtype": "float32"}}):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    for idx, tgt in batches(2, 2):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    assert "device_peak_over_start" not in infinity.stats(model)["steps"][0]
    infinity.release(model)
