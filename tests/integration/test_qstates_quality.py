"""Compressed optimizer states train like fp32 states: GPT tiny on the demo corpus, 300 steps, three seeds.

Why this model and these bounds (benchmarks/qstates.py, docs/benchmarks/compressed-states.md):
at 20M parameters, runs that differ only in rounding part chaotically (fp32 states against fp32
states with the loss scaled by 1 + 2^-20 land up to a few percent apart after 300 steps), so a test
there can only hold a final loss to a few percent, and one seed's gap says little about the format.
The tiny preset is not chaotic: that perturbation moves its final loss by under 0.01% in every seed
measured, so a test's result does not depend on the machine's rounding, and what is left is the
format's own effect. Measured (seeds 0-3, 300 steps, 2 x 32 tokens a step, fixed batch of 32 x 32):
bf16 within 0.07% of fp32 in every seed; int8 -0.17%, +0.82%, -0.43%, -1.18% (mean -0.24%), curves
apart by at most 3.8% on the way; the torch twin in place of the C kernel gives the same to 0.01%.
The bounds below are about twice the largest of those. They catch a format gone grossly wrong
(sqrt(v) under 1/16 of its block's largest read as 0: the run stops on non-finite updates by step
62; scales stored 5% off); subtler breakage
(a 1% scale error, rounding toward zero, a bit less precision in m) moves tiny's final loss no
more than the format's own seed-to-seed spread, and tests/unit/test_moments.py's check of the
update on a fixed gradient stream, where no training amplifies anything, is the one that fails
for those. Nine runs of one thread each, split over two processes (tests/support/ranks.py's pool, no group): 30 s
on a busy two-core machine (2026-11-29).
"""
from __future__ import annotations


import itertools

import pytest
import torch

from tests.support.benchmarks import load_benchmark
from tests.support.ranks import run_ranks


SEEDS, STEPS, BATCH, SEQ, LR, TAIL, EVERY, EVAL_BATCH = (0, 1, 2), 300, 2, 32, 1e-3, 30, 10, 32
SEED_BOUND = {"bf16": 0.005, "int8": 0.02}     # one seed's final loss against fp32's
MEAN_BOUND = {"bf16": 0.002, "int8": 0.01}     # the mean over the seeds
GAP_BOUND = 0.08                               # the curves on the way


def _bench():
    return load_benchmark("qstates")


def _curves(rank, world, workdir, jobs):
    # One thread (the pool's ranks run on one): the thread count orders the matmuls' sums (tiny is not
    # chaotic, so that matters little), and one thread never waits for a descheduled peer at each op on a
    # busy machine. Each rank takes every other run.
    bench = _bench()
    return {(seed, mode): bench.curve("tiny", mode, STEPS, BATCH, SEQ, LR, seed=seed, eval_every=EVERY,
                                      eval_batch=EVAL_BATCH)
            for seed, mode in jobs[rank::world]}


@pytest.mark.slow
def test_bf16_and_int8_states_follow_fp32_states_over_seeds(tmp_path):
    bench = _bench()
    jobs = list(itertools.product(SEEDS, ("fp32", "bf16", "int8")))
    runs: dict = {seed: {} for seed in SEEDS}
    for part in run_ranks(_curves, 2, tmp_path, jobs, group=False):
        for (seed, mode), curve in part.items():
            runs[seed][mode] = curve
    figures = {seed: bench.compare(r, TAIL, EVERY) for seed, r in runs.items()}
    summary = bench.over_seeds(figures)
    stated = "; ".join(f"{m}: final vs fp32 mean {100 * f['mean']:+.2f}%, seeds "
                       + ", ".join(f"{100 * x:+.2f}%" for x in f["samples"])
                       + f", largest gap {100 * f['max_gap_rel']:.2f}%" for m, f in summary.items())
    print(stated)
    for seed, r in runs.items():
        # Every run learned something (the first loss is about ln(512) = 6.2, uniform guesses) ...
        assert figures[seed]["fp32"]["final"] < 0.5 * r["fp32"]["train"][0], stated
    for mode in ("bf16", "int8"):
        # ... the compressed runs are their own runs, not fp32 again ...
        assert all(r[mode]["train"] != r["fp32"]["train"] for r in runs.values()), mode
        # ... and they end near fp32 states, seed by seed and on average, without parting on the way.
        f = summary[mode]
        assert max(abs(x) for x in f["samples"]) < SEED_BOUND[mode], stated
        assert abs(f["mean"]) < MEAN_BOUND[mode], stated
        assert f["max_gap_rel"] < GAP_BOUND, stated
