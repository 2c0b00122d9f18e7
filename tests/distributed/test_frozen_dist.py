"""Freezing and unfreezing on two ranks trains as plain torch on the whole batch.

On several ranks the gradient of a group is reduce-scattered from its bucket, and which gradients
arrived travels with the non-finite check's all-reduce (see [Note: parameters without a gradient] in
infinity/optim/ranges.py): a frozen parameter's slot must reach every rank's shard as zeros, and a
parameter frozen on every rank must be left alone by every rank's optimizer. The one-rank cases are
in tests/integration/test_partly_frozen.py.
"""
from __future__ import annotations

import os

import pytest
import torch

import infinity
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset
from tests.support.ranks import run_ranks, step_beside

LOCAL_BATCH = 2


def _set(net, step: int) -> None:
    """Blocks frozen at construction (step None) and unfrozen at step 2; block 1's matrices frozen again
    at step 3 (its group keeps its vectors trainable)."""
    if step is None:
        net.blocks.requires_grad_(False)
    elif step == 2:
        net.blocks.requires_grad_(True)
    elif step == 3:
        for p in net.blocks[1].parameters():
            if p.dim() > 1:
                p.requires_grad_(False)


def _train(rank, world, workdir, name, inside=True):
    """``inside``: the blocks frozen inside ``infinity.Init``, else after it and before the optimizer (which
    builds the flat store again on each rank: [Note: frozen after Init] in infinity/optim/relayout.py)."""
    shape = preset("tiny", n_layer=3)
    nvme = os.path.join(workdir, f"nvme-{name}")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    ref = GPT(shape)
    _set(ref, None)
    overrides = {"tiers": {"device": "cpu", "nvme_path": nvme}, "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
        if inside:
            _set(model, None)
    if not inside:
        _set(model, None)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches("random", LOCAL_BATCH * world, 32, shape.vocab_size, seed=0)
    worst = 0.0
    for step in range(5):
        _set(model, step)
        _set(ref, step)
        x, y = next(data)
        loss, ref_loss, norm, ref_norm = step_beside(model, opt, ref, ref_opt, x, y, rank, world, LOCAL_BATCH, 0.5)
        worst = max(worst, abs(loss - ref_loss) / ref_loss, abs(norm - ref_norm) / ref_norm)
    infinity.release(model)
    return worst


@pytest.mark.parametrize("name, inside", [("offload-optimizer", True), ("offload-host", True),
                                          ("offload-host", False)])
def test_freezing_on_two_ranks_matches_plain_torch(tmp_path, name, inside):
    results = run_ranks(_train, 2, tmp_path, name, inside)
    assert max(results) <= 1e-5, results
