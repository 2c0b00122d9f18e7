"""A plain fp32 model under a bf16 preset takes its floating-point inputs in bf16, as after ``model.to(bf16)``:
they are not cast for it (a target or a mask would be rounded silently), and the dtype error torch raises gets
a note naming precision.dtype and the ways out ([Note: inputs in the compute dtype] in
infinity/runtime/inputs.py)."""
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


def test_fp32_inputs_under_a_bf16_preset_fail_as_after_model_to_bf16_naming_precision_dtype():
    model, ref = _build(_mlp)
    x = torch.randn(5, 8)                  # fp32, as a user has them
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(x)
    with pytest.raises(RuntimeError, match="same dtype"):
        ref.to(torch.bfloat16)(x)          # plain torch refuses the same
    note = "\n".join(getattr(info.value, "__notes__", ()))
    assert 'computes in bfloat16 ([precision] dtype = "bfloat16"' in note and "x.to(torch.bfloat16)" in note
    assert '"precision": {"dtype": "float32"}' in note


def test_inputs_in_the_compute_dtype_train_as_the_model_in_bf16_and_a_fp32_target_is_not_rounded():
    model, ref = _build(_mlp)
    x = torch.randn(5, 8)
    assert torch.equal(model(x.to(torch.bfloat16)), ref.to(torch.bfloat16)(x.to(torch.bfloat16)))
    opt = infinity.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        out = model(x.to(torch.bfloat16)).float()
        loss = F.mse_loss(out, y)
        assert torch.equal(loss, F.mse_loss(out, y))     # the target as given: fp32, never rounded
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)


class _MakesFp32(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x) + torch.ones(8))      # fp32 made inside: promotes the activation to fp32


def test_a_float32_tensor_made_inside_the_forward_names_precision_dtype_and_the_fix():
    model, _ = _build(_MakesFp32)
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8).to(torch.bfloat16))
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
