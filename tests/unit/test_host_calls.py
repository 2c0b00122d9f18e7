"""The engine's host work per transformer block and step: a count of Python calls, not a timing.

On a GPU a step runs at plain torch's speed only while the host queues kernels faster than the
device runs them, so what the engine does in Python per module and group is what decides the
``device`` preset's ratio to torch at GPT 350M's 150 groups (benchmarks/host_overhead.py times it).
The count of Python calls a steady step makes is the same on every machine for the same code and
torch version, so it can be held here: per block (one parameter group each), and constant as the
model gets deeper (work that grows with the number of groups already handled, such as a scan of a
list of earlier groups, makes a step quadratic in depth). The NVMe preset is left out: how often it polls its reads depends on the
disk's timing.
"""
from __future__ import annotations

import cProfile
import gc
import pstats

import pytest
import torch

import infinity
from infinity import registry
from infinity.config import load_config
from infinity.examples.gpt import GPT, GPTConfig

# Per transformer block (the presets partition each block as one group: partition.units = "auto"),
# measured with torch 2.13 (2026-11-27): device 445, offload-host 821, offload-optimizer 513 calls per
# block and step, since the modules without groups lose their forward hooks once the trace is followed
# and a group's gradients are copied in one call (854, 1258 and 922 before), and a group gathered into
# lent memory keeps its parameters' views (offload-host 849 before). With one group per module
# (six per block) they were 2310, 3876 and 2766 that day (385, 646 and 461 per group); before that day's
# earlier changes, 484, 704-746 (growing with depth) and 521-563 per group. About 10% of headroom, for
# small changes of torch's own hook machinery: a bigger rise is work added per block or group, which a
# GPU step pays for in host time.
BUDGET = {"device": 490, "offload-host": 905, "offload-optimizer": 565}


def _calls_per_step(preset: str, layers: int) -> tuple[int, int]:
    """(Python calls of one steady step, parameter groups) for a GPT of ``layers`` blocks."""
    torch.manual_seed(0)
    shape = GPTConfig(n_layer=layers, d_model=32, n_head=2, vocab_size=64, seq_len=8)
    cfg = load_config(preset, overrides={"tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}})
    with infinity.Init(cfg):
        model = GPT(shape)
    opt = infinity.AdamW(model, lr=1e-4)
    idx = torch.randint(0, shape.vocab_size, (1, 8))

    def step():
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    try:
        for _ in range(3):          # the trace is recorded in the first step and followed after
            step()
        # The cyclic collector runs when earlier allocations (the tests before this one's) say, and the
        # finalizers it triggers are Python calls: without it the count is the step's alone (the offload-optimizer
        # case once failed in a suite run and passed alone, the same code).
        gc.collect()
        gc.disable()
        prof = cProfile.Profile()
        try:
            prof.enable()
            step()
            prof.disable()
        finally:
            gc.enable()
        return pstats.Stats(prof).total_calls, len(registry.engine_of(model, "test").coordinator.groups)
    finally:
        infinity.release(model)


@pytest.mark.copies_at_once(reason="counts the engine's Python calls per block: a held CPU copy adds calls "
                                    "(running it later) that a GPU's copy stream makes in hardware")
@pytest.mark.parametrize("preset", sorted(BUDGET))
def test_host_calls_per_block_are_bounded_and_do_not_grow_with_depth(preset):
    counts = {layers: _calls_per_step(preset, layers) for layers in (2, 5, 10)}
    (c2, g2), (c5, g5), (c10, g10) = counts[2], counts[5], counts[10]
    assert g5 - g2 == 3 and g10 - g5 == 5, f"{preset}: expected one group per block ({counts})"
    shallow = (c5 - c2) / 3
    deep = (c10 - c5) / 5
    assert deep <= shallow * 1.02, (
        f"{preset}: each block costs {deep:.0f} Python calls per step between 5 and 10 blocks against "
        f"{shallow:.0f} between 2 and 5: per-block work grows with the number of blocks ({counts})")
    assert deep <= BUDGET[preset], (
        f"{preset}: {deep:.0f} Python calls per block and step, over the budget of "
        f"{BUDGET[preset]} (see the note at the top of this file; profile one step of "
        f"benchmarks/host_overhead.py to see where they go)")
