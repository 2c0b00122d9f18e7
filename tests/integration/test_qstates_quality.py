"""Compressed optimizer states keep fp32 states' quality: GPT 20M on the demo corpus, 300 steps per state_dtype.

The curves come from benchmarks/qstates.py at the settings of the README's table (2 x 32 tokens a step,
the loss on a fixed batch of 64 x 32 every 10 steps, the final loss the mean of the last five records):
about 2 minutes on two quiet cores, up to 9 on busy ones.
"""
from __future__ import annotations

import importlib.util
import os
import statistics

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, BATCH, SEQ, LR, TAIL, EVERY = 300, 2, 32, 1e-3, 30, 10


def _bench():
    spec = importlib.util.spec_from_file_location("qstates_bench", os.path.join(ROOT, "benchmarks", "qstates.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bf16_and_int8_states_follow_fp32_states_on_gpt_20m():
    bench = _bench()
    # The thread count orders the matmuls' sums; fixed, so that a run alone gives the README's curves.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        curves = {mode: bench.curve("20M", mode, STEPS, BATCH, SEQ, LR, eval_every=EVERY)
                  for mode in ("fp32", "bf16", "int8")}
    finally:
        torch.set_num_threads(threads)
    figures = bench.compare(curves, TAIL, EVERY)
    stated = "; ".join(f"{m}: final {f['final']:.4f} ({100 * f['final_rel']:+.2f}% vs fp32), largest gap "
                       f"{100 * f['max_gap_rel']:.2f}% at step {f['max_gap_step']}" for m, f in figures.items())
    print(stated)
    # The run learned something (the comparison would be empty otherwise: the first step's loss is
    # about ln(16384) = 9.7, the loss of uniform guesses) ...
    assert figures["fp32"]["final"] < 0.5 * curves["fp32"]["train"][0], stated
    for mode in ("bf16", "int8"):
        # ... the compressed runs are their own runs, not fp32 again ...
        assert curves[mode]["train"] != curves["fp32"]["train"], mode
        # ... and they end near fp32 states on the fixed batch. Runs that differ in rounding take
        # different, chaotic paths: the same code gave int8 +0.61% alone and +1.98% inside the whole
        # suite (fp32's own curve moved too: 2.4696 vs 2.4417 at the end, with the same seeds and
        # threads), so this test can hold the final loss only to 3%, not to the 1% the README's run
        # shows; on the way the curves part by a few percent, and 10% would be a run going astray.
        assert abs(figures[mode]["final_rel"]) < 0.03, stated
        assert figures[mode]["max_gap_rel"] < 0.10, stated
