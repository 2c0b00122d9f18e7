"""fp16 dynamic loss scaling: overflowing steps are skipped, the scale backs off and grows again,
and the steps taken match torch.amp.GradScaler on a plain fp32-master model."""
import copy
import warnings

import pytest
import torch
from torch import nn

import infinity
from infinity.config import ConfigError, load_config
from infinity.optim.loss_scale import LossScaler


class _Net(nn.Module):
    """fp16 layers, an fp32 loss (the usual mixed-precision shape)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, y):
        out = self.body(x.to(self.body[0].weight.dtype))
        return nn.functional.mse_loss(out.float(), y)


def _fp16(tmp_path, tiers, **precision):
    return {"tiers": {**tiers, "nvme_path": str(tmp_path)},
            "precision": {"dtype": "float16", **precision}}


@pytest.mark.parametrize("tiers", [{"params": "host"}, {"params": "nvme", "optimizer": "nvme"}],
                         ids=["host", "nvme"])
def test_overflow_skips_backs_off_recovers_and_matches_grad_scaler(tmp_path, tiers):
    torch.manual_seed(0)
    ref = _Net()
    with infinity.Init(_fp16(tmp_path, tiers, initial_scale=2.0 ** 24, growth_interval=3, hysteresis=1)):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=3)
    half = copy.deepcopy(ref).half()
    skipped = 0
    for step in range(16):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

        half.load_state_dict(ref.state_dict())       # the fp16 compute copy of the fp32 masters
        ref_loss = half(x, y)
        scaler.scale(ref_loss).backward()
        for p, q in zip(ref.parameters(), half.parameters()):
            p.grad = q.grad.float()
        half.zero_grad()
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        ref_opt.zero_grad()

        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3, abs=1e-4), step
        assert opt.stats()["loss_scale"]["scale"] == scaler.get_scale(), step
    assert skipped >= 3, "the first steps must overflow at 2**24"
    stats = infinity.stats(model)["loss_scale"]
    assert stats["skipped_steps"] == skipped and opt.stats()["steps"] == 16 - skipped
    assert stats["scale"] > 2.0 ** 24 / 2 ** skipped, "the scale must have grown after clean steps"
    with infinity.gathered(model):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.float(), q.to(torch.float16).float(), atol=1e-3), name
    infinity.release(model)


def _scaler(**precision):
    return LossScaler(load_config({"precision": {"dtype": "float16", **precision}}).precision)


def test_hysteresis_min_scale_and_growth_by_hand():
    s = _scaler(initial_scale=8.0, hysteresis=2, growth_interval=2, min_scale=2.0)
    seen = []
    for overflow in [True, True, True, True, False, False, True, False, False]:
        s.update(overflow)
        seen.append(s.scale)
    # 1st overflow: a strike, no change; then each overflow halves, down to min_scale; two clean steps
    # double it and forget the strikes, so the next overflow is again only a strike.
    assert seen == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]
    assert s.skipped_steps == 5


def test_fixed_scale_never_changes_but_overflows_are_skipped():
    s = _scaler(loss_scale=128)
    for overflow in [True, False, False, True]:
        s.update(overflow)
    assert (s.scale, s.dynamic, s.skipped_steps) == (128.0, False, 2)


def test_other_dtypes_have_no_scaler(tmp_path):
    assert LossScaler.for_precision(load_config({"precision": {"dtype": "bfloat16"}}).precision) is None
    with infinity.Init({"tiers": {"params": "host"}}):
        model = _Net()
    assert infinity.stats(model)["loss_scale"] is None
    infinity.release(model)


def test_clipping_sees_unscaled_gradients(tmp_path):
    torch.manual_seed(2)
    ref = _Net()
    cfg = _fp16(tmp_path, {"params": "host"}, initial_scale=1024.0)
    norms = {}
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    for clip in ("infinity", "torch"):
        with infinity.Init(cfg):
            model = _Net()
        with infinity.gathered(model):
            model.load_state_dict(ref.state_dict())
        opt = infinity.AdamW(model, lr=1e-2)
        model(x, y).backward()
        if clip == "infinity":
            norms[clip] = float(infinity.clip_grad_norm_(model, 1e-3))
        else:
            norms[clip] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        opt.step()
        with infinity.gathered(model):
            after = [p.detach().float().clone() for p in model.parameters()]
        infinity.release(model)
    half = copy.deepcopy(ref).half()
    half(x, y).backward()
    want = float(torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in half.parameters()])))
    assert norms["infinity"] == pytest.approx(want, rel=2e-3)
    assert norms["torch"] == pytest.approx(want, rel=2e-3)
    # The step applies the clipped, unscaled gradient: plain AdamW on the same gradient.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for p, q in zip(ref.parameters(), half.parameters()):
        p.grad = q.grad.float() * (1e-3 / (want + 1e-6))
    ref_opt.step()
    for p, q in zip(after, ref.parameters()):
        assert torch.allclose(p, q.detach().half().float(), atol=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_an_overflow_clipped_by_torch_is_skipped_as_without_clipping(tmp_path, dtype):
    """A non-finite gradient norm made torch's clip_grad_norm_ give every parameter a NaN factor, and NaN is not
    equal to NaN: opt.step() raised "scaled by other factors than the rest" where it skips the step (the
    Hugging Face Trainer clips by default, so an fp16 overflow ended training). Now the step is skipped and
    counted, and the next one trains as torch does."""
    torch.manual_seed(2)
    ref = _Net()
    cfg = _fp16(tmp_path, {"params": "host"}) if dtype == "float16" else {"tiers": {"params": "host"}}
    with infinity.Init(cfg):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    opt = infinity.AdamW(model, lr=1e-2)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    (model(x, y) * float("nan")).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).isnan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # fp32 says each skipped step
        opt.step()
    opt.zero_grad()
    assert (opt.step_count, opt.skipped_steps) == (0, 1)
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ref_model = copy.deepcopy(ref).half() if dtype == "float16" else copy.deepcopy(ref)
    ref_model(x, y).backward()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for p, q in zip(ref.parameters(), ref_model.parameters()):
        p.grad = q.grad.float()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    with infinity.gathered(model):
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.detach().float(), q.detach().to(p.dtype).float(), atol=1e-3)
    infinity.release(model)


def test_clip_grad_value_clamps_the_unscaled_gradient(tmp_path):
    torch.manual_seed(3)
    ref = _Net()
    with infinity.Init(_fp16(tmp_path, {"params": "host"}, initial_scale=1024.0)):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    # eps of the gradients' order: Adam's first step then depends on their size, not only their sign.
    opt = infinity.AdamW(model, lr=0.1, eps=1e-3, weight_decay=0.0)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    model(x, y).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    opt.step()
    half = copy.deepcopy(ref).half()
    (half(x, y) * 1024.0).backward()
    for p, q in zip(ref.parameters(), half.parameters()):
        p.grad = (q.grad.float() / 1024.0).clamp(-1e-3, 1e-3)
    torch.optim.AdamW(ref.parameters(), lr=0.1, eps=1e-3, weight_decay=0.0).step()
    with infinity.gathered(model):
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.float(), q.detach().half().float(), atol=1e-3)
    infinity.release(model)


def test_the_scale_goes_on_after_a_checkpoint_and_a_state_dict(tmp_path):
    cfg = _fp16(tmp_path, {"params": "host"}, initial_scale=2.0 ** 20, growth_interval=2, hysteresis=1)
    torch.manual_seed(4)
    with infinity.Init(cfg):
        model = _Net()
    opt = infinity.AdamW(model, lr=1e-2)
    for _ in range(7):
        model(torch.randn(5, 8), torch.randn(5, 4)).backward()
        opt.step()
        opt.zero_grad()
    saved = opt.stats()["loss_scale"]
    assert saved["scale"] != 2.0 ** 20 and saved["skipped_steps"] > 0
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    state = opt.state_dict()
    for load in ("checkpoint", "state_dict"):
        with infinity.Init(cfg):
            again = _Net()
        opt2 = infinity.AdamW(again, lr=1e-2)
        assert opt2.stats()["loss_scale"]["scale"] == 2.0 ** 20
        if load == "checkpoint":
            infinity.load_checkpoint(tmp_path / "ckpt", again, opt2)
        else:
            opt2.load_state_dict(state)
        assert opt2.stats()["loss_scale"] == saved, load
        infinity.release(again)
    infinity.release(model)
