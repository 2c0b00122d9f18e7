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


def _bitfit(net) -> None:
    for p in net.parameters():
        p.requires_grad_(p.dim() < 2)


def _train(rank, world, workdir, name, inside=True):
    """``inside``: the blocks frozen inside ``infinity.Init``, else after it and before the optimizer (which
    builds the flat store again on each rank: [Note: frozen after Init] in infinity/optim/relayout.py);
    "bitfit": every matrix frozen inside ``Init``, each block's group split in two at its exit, the values
    gathered over the ranks ([Note: frozen inside a group] in infinity/runtime/construction.py)."""
    freeze = _bitfit if inside == "bitfit" else (lambda net: _set(net, None))
    shape = preset("tiny", n_layer=3)
    nvme = os.path.join(workdir, f"nvme-{name}")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    ref = GPT(shape)
    freeze(ref)
    overrides = {"tiers": {"device": "cpu", "nvme_path": nvme}, "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
        if inside:
            freeze(model)
    if not inside:
        freeze(model)
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
                                          ("offload-host", False), ("nvme", "bitfit")])
def test_freezing_on_two_ranks_matches_plain_torch(tmp_path, name, inside):
    results = run_ranks(_train, 2, tmp_path, name, inside)
    assert max(results) <= 1e-5, results


def _one_rank_short(rank, world, workdir):
    """Blocks frozen after Init; rank 1's host budget holds its store but not a second one beside it."""
    import warnings

    from infinity.registry import engine_of

    shape = preset("tiny", n_layer=3)
    overrides = {"tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}}
    with infinity.Init(load_config("offload-host", overrides=overrides)):   # on every rank: Init is collective
        probe = GPT(shape)
    budget = infinity.stats(probe)["tiers"]["host"]["bytes_in_use"] + 4096 if rank == 1 else 0
    infinity.release(probe)
    overrides["tiers"]["host_budget"] = budget
    torch.manual_seed(0)
    with infinity.Init(load_config("offload-host", overrides=overrides)):
        model = GPT(shape)
    subs = engine_of(model).store.layout.num_subs
    model.blocks.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = infinity.AdamW(model, lr=1e-2)
    said = [str(w.message) for w in caught if "kept the optimizer's flat layout" in str(w.message)]
    kept = engine_of(model).store.layout.num_subs == subs
    torch.manual_seed(0)
    ref = GPT(shape)
    ref.blocks.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches("random", LOCAL_BATCH * world, 32, shape.vocab_size, seed=0)
    worst = 0.0
    for _ in range(3):
        x, y = next(data)
        loss, ref_loss, _, _ = step_beside(model, opt, ref, ref_opt, x, y, rank, world, LOCAL_BATCH)
        worst = max(worst, abs(loss - ref_loss) / ref_loss)
    infinity.release(model)
    return kept, said, worst


def test_a_rank_that_cannot_move_its_store_keeps_every_ranks_layout(tmp_path):
    """The store is built again on each rank; when one rank's tier cannot hold both, no rank moves (they
    keep one flat layout, as a checkpoint in place of them needs), each saying why."""
    results = run_ranks(_one_rank_short, 2, tmp_path)
    (kept0, said0, worst0), (kept1, said1, worst1) = results
    assert kept0 and kept1
    assert any("another rank keeps it" in s for s in said0) and any("would hold" in s for s in said1)
    assert max(worst0, worst1) <= 1e-5


def _woken_on_one_rank(rank, world, workdir):
    """Blocks frozen after Init; on rank 1 every sub-group counts as woken by a load (its shard's moments
    were nonzero there: a rank-local fact), so this rank alone would gain nothing from moving them apart."""
    from infinity.registry import engine_of

    shape = preset("tiny", n_layer=3)
    overrides = {"tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(load_config("offload-host", overrides=overrides)):
        model = GPT(shape)
    store = engine_of(model).store
    subs = store.layout.num_subs
    if rank == 1:
        store.woken.update(range(subs))
    model.blocks.requires_grad_(False)
    opt = infinity.AdamW(model, lr=1e-2)
    moved = engine_of(model).store.layout.num_subs != subs
    torch.manual_seed(0)
    ref = GPT(shape)
    ref.blocks.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches("random", LOCAL_BATCH * world, 32, shape.vocab_size, seed=0)
    worst = 0.0
    for _ in range(3):
        x, y = next(data)
        loss, ref_loss, _, _ = step_beside(model, opt, ref, ref_opt, x, y, rank, world, LOCAL_BATCH)
        worst = max(worst, abs(loss - ref_loss) / ref_loss)
    infinity.release(model)
    return moved, worst


def test_ranks_that_gain_differently_from_a_relayout_decide_it_together(tmp_path):
    """Whether moving frozen groups apart gains anything depends on each rank's shard; a rank that gains
    nothing used to return before the all-reduce the others waited in. Both now take the same layout."""
    (moved0, worst0), (moved1, worst1) = run_ranks(_woken_on_one_rank, 2, tmp_path, collective_timeout=60)
    assert moved0 == moved1
    assert max(worst0, worst1) <= 1e-5
