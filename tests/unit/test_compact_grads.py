"""Gradients stored in the compute dtype while a step has one micro-batch: results unchanged, bytes halved.

See [Note: compact gradients] in infinity/optim/compact_grads.py.
"""
from copy import deepcopy
import pytest
import torch

import infinity
from infinity import registry
from infinity.optim import relayout
from tests.support.tiny_gpt import TinyGPT, batches


def _train(preset: str, swap, compact: bool, accum: int, steps: int = 3, rank: int = 0, world: int = 1,
           dpu: bool = False):
    """Losses, final states and the store's gradient dtypes; ``compact`` False: fp32 keys as before;
    ``dpu``: delayed updates after one warm-up step."""
    if not compact:
        original = relayout.grad_dtype_for
        relayout.grad_dtype_for = lambda *a: torch.float32
    try:
        overrides = {"tiers": {"nvme_path": str(swap)}, "partition": {"sub_group_size": 4096}}
        if dpu:
            overrides["dpu"] = {"enabled": True, "warmup_steps": 1}
        cfg = infinity.load_config(preset, overrides=overrides)
        torch.manual_seed(0)
        with infinity.Init(cfg):
            model = TinyGPT(d=48)
    finally:
        if not compact:
            relayout.grad_dtype_for = original
    store = registry.engine_of(model, "test").store
    opt = infinity.AdamW(model, lr=1e-2)
    losses, dtypes = [], [store.grad_dtype]
    counts = [accum] * steps if isinstance(accum, int) else list(accum)     # micro-batches of each step
    data = batches(sum(counts) * world, 4)
    i = 0
    for count in counts:
        for _ in range(count):
            x, y = data[i * world + rank]
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            i += 1
        if i % 2 == 0:
            infinity.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
        dtypes.append(store.grad_dtype)
        if dpu:
            spare = opt._updates.delay._spare_grad_keys
            assert all(store.tier.nbytes(k) == store.tier.nbytes(store.keys["grad"][sub])
                       for sub, k in enumerate(spare)), "both sets of gradient keys in one dtype"
    shards = deepcopy(opt.state_dict()["shards"])
    infinity.release(model)
    return losses, shards, dtypes


def _same(a, b) -> None:
    assert a[0] == b[0]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for x, y in zip(a[1][name], b[1][name]):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name


@pytest.mark.parametrize("preset", ["nvme", "offload-host"])
def test_one_micro_batch_keeps_compute_dtype_gradients_and_the_same_results(preset, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    compact = _train(preset, tmp_path / "a", True, accum=1)
    wide = _train(preset, tmp_path / "b", False, accum=1)
    assert set(compact[2]) == {torch.bfloat16} and set(wide[2]) == {torch.float32}
    _same(compact, wide)


def test_accumulating_micro_batches_widen_to_fp32_exactly(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    compact = _train("nvme", tmp_path / "a", True, accum=2)
    wide = _train("nvme", tmp_path / "b", False, accum=2)
    assert compact[2][0] == torch.bfloat16 and set(compact[2][1:]) == {torch.float32}
    _same(compact, wide)


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [1, 1, 1, 2, 1]], ids=["one", "accumulating-later"])
def test_delayed_updates_keep_both_gradient_sets_compact_until_micro_batches_accumulate(tmp_path, counts):
    # DPU's second set of gradient keys (read by the background step) is compact too. The first
    # accumulation, here while a delayed job runs, waits for it and widens both sets. Results equal
    # fp32 keys throughout.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    compact = _train("nvme", tmp_path / "a", True, accum=counts, dpu=True)
    wide = _train("nvme", tmp_path / "b", False, accum=counts, dpu=True)
    widened = counts.index(2) + 1 if 2 in counts else len(counts) + 1      # dtypes[k]: after step k
    assert compact[2][:widened] == [torch.bfloat16] * widened and set(compact[2][widened:]) <= {torch.float32}
    assert set(wide[2]) == {torch.float32}
    _same(compact, wide)
