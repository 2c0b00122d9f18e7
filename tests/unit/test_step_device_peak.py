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


def _train(monkeypatch, readings, placement, steps=3, evaluate_first=False):
    """Train ``steps`` steps with CUDA's (allocated, peak) counters read from ``readings`` in turn (after a
    forward without gradients before the optimizer exists, ``evaluate_first``: a step of its own)."""
    it = itertools.chain(readings, itertools.repeat(readings[-1]))     # then steady
    monkeypatch.setattr(telemetry, "device_memory", lambda datapath: next(it))
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "precision": {"dtype": "float32"}}):
        model = TinyGPT()
    engine_of(model).placement = placement
    if evaluate_first:
        with torch.no_grad():
            model(*batches(1, 2)[0])
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
    guess = types.SimpleNamespace(reserve_assumed=True, activation_reserve=10 * GiB)
    start, kept = 30 * GiB, 31 * GiB    # allocated when step 0 began and after it (buffers it made and kept)
    readings = [(start, start), (kept, kept + peak),                       # step 0: begins, is recorded
                (kept, kept + peak), (kept, kept + peak)]                  # step 1: hidden by step 0's peak
    with caplog.at_level(logging.INFO, logger="infinity"):
        records = _train(monkeypatch, readings, guess)
    assert records[0]["device_transient_peak"] == peak
    assert records[1]["device_transient_peak"] is None, "a step under an earlier peak cannot be told"
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
    assert "device_transient_peak" not in infinity.stats(model)["steps"][0]
    infinity.release(model)


def test_a_forward_before_the_optimizer_is_not_the_step_weighed(monkeypatch, caplog):
    """An evaluation (or generate()) before the optimizer exists is a step of its own, with a small peak: the
    first training step is the one weighed."""
    guess = types.SimpleNamespace(reserve_assumed=True, activation_reserve=10 * GiB)
    readings = [(0, 0), (0, GiB),                   # the evaluation: 1 GiB, would say "more states fit"
                (0, GiB), (0, 12 * GiB)]            # the first training step: 12 GiB, more than kept
    with caplog.at_level(logging.INFO, logger="infinity"):
        records = _train(monkeypatch, readings, guess, evaluate_first=True)
    assert [r["device_transient_peak"] for r in records[:2]] == [GiB, 12 * GiB]
    (message,) = [r.getMessage() for r in caplog.records if "kept" in r.getMessage()]
    assert "more than the 10.0 GiB" in message
