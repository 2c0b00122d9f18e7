"""The gradient book's squared norm of a 2-byte shard on the CPU, taken in 1Mi-element fp32 pieces
(``GradReducer._add_norm``): the float64 sum of squares to fp32 precision, inf or nan exactly when an
element is, and what ``clip_grad_norm_`` returns on an engine model in bf16."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import infinity
from infinity import registry
from infinity.runtime.grads import _NORM_CHUNK, GradientBook, GradReducer


def _norm_sq(shard: torch.Tensor) -> float:
    reducer = SimpleNamespace(book=GradientBook(1, torch.device("cpu")), _norm_scratch=None)
    GradReducer._add_norm(reducer, shard)
    return float(reducer.book.norm_sq)


@pytest.mark.parametrize("numel", [_NORM_CHUNK - 3, 2 * _NORM_CHUNK + 5, 5 * _NORM_CHUNK])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_squared_norm_is_the_float64_sum_of_squares(numel, dtype):
    shard = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    exact = float(shard.double().square().sum())
    assert _norm_sq(shard) == pytest.approx(exact, rel=1e-4)     # fp32 dot products: ~2e-5 at 1Mi elements


@pytest.mark.parametrize("bad, expect", [(float("inf"), "inf"), (float("-inf"), "inf"), (float("nan"), "nan")])
def test_a_non_finite_element_in_any_piece_makes_it_non_finite(bad, expect):
    for at in (0, _NORM_CHUNK - 1, _NORM_CHUNK, 3 * _NORM_CHUNK + 1):
        shard = torch.ones(3 * _NORM_CHUNK + 2, dtype=torch.bfloat16)
        shard[at] = bad
        got = _norm_sq(shard)
        assert (got == float("inf")) if expect == "inf" else got != got, (at, got)


def test_clip_grad_norm_returns_the_norm_of_the_stored_bf16_gradients(tmp_path):
    torch.manual_seed(0)
    cfg = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu", "nvme_path": str(tmp_path),
                     "pool_buffer_size": "1MiB", "pool_buffers": 2},
           "precision": {"dtype": "bfloat16"}, "partition": {"sub_group_size": "8Mi"}}
    with infinity.Init(cfg):
        model = nn.Sequential(nn.Linear(1024, 2100, bias=False), nn.Linear(2100, 8))
    assert model[0].weight.numel() > 2 * _NORM_CHUNK
    x = torch.randn(4, 1024).to(torch.bfloat16)
    model(x).float().square().sum().backward()

    # torch's clip first: reading the gradients settles the shards still on their way (a GPU's downloads)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30)
    engine = registry.engine_of(model)
    engine.store.flush()
    stored = torch.cat([engine.store.read_state_shard("grad", g.index).double() for g in engine.coordinator.groups])
    assert float(total) == pytest.approx(float(stored.square().sum().sqrt()), rel=1e-6)
