"""A plain fp32 model under a bf16 preset: the inputs of its outermost forward are cast to the compute dtype
([Note: inputs in the compute dtype] in infinity/runtime/engine.py), and a tensor of another dtype made inside
the forward gets an error that names precision.dtype and what to do."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _build(make, preset="offload-host", overrides=None):
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    with infinity.Init(infinity.load_config(preset, overrides=overrides)):
        model = make()
    return model, ref


def test_fp32_inputs_train_under_a_bf16_preset_as_the_model_in_bf16_would():
    model, ref = _build(_mlp)
    x = torch.randn(5, 8)                  # fp32, as a user has them
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16)(x.to(torch.bfloat16)))
    opt = infinity.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        loss = F.mse_loss(model(x), y)     # an fp32 target beside the bf16 output
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(map(torch.isfinite, torch.tensor(losses)))


def test_an_input_that_requires_grad_gets_its_gradient_in_its_own_dtype():
    model, _ = _build(_mlp)
    x = torch.randn(2, 8, requires_grad=True)
    model(x).float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


class _Mixed(nn.Module):
    """Floats nested in kwargs and containers, beside integer tensors that must stay integers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids, extra, *, scale):
        assert ids.dtype == torch.long and extra["mask"].dtype == torch.long
        return self.lin(self.emb(ids) + extra["bias"][0]) * scale


def test_floats_in_kwargs_and_containers_are_cast_and_integers_are_not():
    model, _ = _build(_Mixed)
    ids = torch.randint(0, 10, (2, 3))
    out = model(ids, {"mask": torch.ones(2, 3, dtype=torch.long), "bias": [torch.randn(8, dtype=torch.float64)]},
                scale=torch.tensor(2.0))
    assert out.dtype == torch.bfloat16


class _MakesFp32(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x) + torch.ones(8))      # fp32 made inside: promotes the activation to fp32


def test_a_float32_tensor_made_inside_the_forward_names_precision_dtype_and_the_fix():
    model, _ = _build(_MakesFp32)
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8))
    note = "\n".join(getattr(info.value, "__notes__", ()))
    assert 'computes in bfloat16 ([precision] dtype = "bfloat16"' in note
    assert "t.to(self.weight.dtype)" in note and '"precision": {"dtype": "float32"}' in note


def test_float32_compute_leaves_inputs_alone():
    model, ref = _build(_mlp, overrides={"precision": {"dtype": "float32"}})
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
    with pytest.raises(RuntimeError, match="same dtype") as info:       # as plain torch: no cast, no note
        model(x.double())
    assert not getattr(info.value, "__notes__", ())
