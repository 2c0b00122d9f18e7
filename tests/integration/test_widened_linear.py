"""``[precision] cpu_linear = "float32"``: linear layers in bf16/fp16 on the CPU multiply in fp32
([Note: widened linear layers] in infinity/tiling/widened.py).

The function: its output and gradients are the fp32 products rounded once (exactly), within bf16
rounding of torch's own kernel, and it is ``F.linear`` itself off its case (fp32, mixed dtypes,
autocast). The engine: which layers ``infinity.Init`` converts (``nn.Linear``, subclasses keeping its
forward, linear tiles; not a subclass with its own forward), that the class name, ``isinstance`` and
the state-dict keys stay, and that the engine's outputs and gradients equal a plain replica's.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import infinity
from infinity.tiling import TiledLinear
from infinity.tiling.widened import widen_linears, widened_linear
from tests.support.parity import stored_grad


def _case(dtype, shape=(3, 5, 24), out=40, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(out, shape[-1], generator=g) / shape[-1] ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(out, generator=g).to(dtype).requires_grad_() if bias else None
    r = torch.randn(*shape[:-1], out, generator=g)
    return x, w, b, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_output_and_gradients_are_the_fp32_products_rounded_once(dtype, bias):
    x, w, b, r = _case(dtype, bias=bias)
    y = widened_linear(x, w, b)
    assert y.dtype == dtype and type(y.grad_fn).__name__ == "_WidenedLinearBackward"
    (y.float() * r).sum().backward()

    x32, w32, g32 = x.detach().float(), w.detach().float(), r.to(dtype).float()
    expect = F.linear(x32, w32, None if b is None else b.detach().float()).to(dtype)
    assert torch.equal(y, expect)
    assert torch.equal(x.grad, (g32 @ w32).to(dtype))
    assert torch.equal(w.grad, (g32.reshape(-1, 40).t() @ x32.reshape(-1, 24)).to(dtype))
    if bias:
        assert torch.equal(b.grad, g32.reshape(-1, 40).sum(0).to(dtype))

    # torch's own kernel in the dtype: the same products, rounded in another order
    xn, wn, bn, _ = _case(dtype, bias=bias)
    yn = F.linear(xn, wn, bn)
    (yn.float() * r).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), yn.float(), **tol)
    torch.testing.assert_close(x.grad.float(), xn.grad.float(), **tol)
    torch.testing.assert_close(w.grad.float(), wn.grad.float(), **tol)


class _Products(TorchDispatchMode):
    """The dtypes of every matrix product run under it."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [True, False])
def test_every_product_forward_and_backward_runs_in_fp32(bias):
    x, w, b, r = _case(torch.bfloat16, bias=bias)
    with _Products() as seen:
        (widened_linear(x, w, b).float() * r).sum().backward()
    assert len(seen.dtypes) == 3 and all(d == {torch.float32} for d in seen.dtypes), seen.dtypes
    with _Products() as native:
        (F.linear(x, w, b).float() * r).sum().backward()
    assert len(native.dtypes) == 3 and all(d == {torch.bfloat16} for d in native.dtypes), native.dtypes


def test_only_the_inputs_asked_for_get_gradients():
    x, w, b, r = _case(torch.bfloat16)
    x = x.detach()
    (widened_linear(x, w, b).float() * r).sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None


def test_outside_its_case_it_is_f_linear():
    x, w, b, _ = _case(torch.float32)
    y = widened_linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b)) and type(y.grad_fn).__name__ != "_WidenedLinearBackward"

    xb, wb, bb, _ = _case(torch.bfloat16)
    with pytest.raises(RuntimeError) as plain:
        F.linear(x, wb, bb)
    with pytest.raises(RuntimeError) as ours:
        widened_linear(x, wb, bb)
    assert str(ours.value) == str(plain.value)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = widened_linear(xb, wb, bb)
        assert torch.equal(y, F.linear(xb, wb, bb)) and type(y.grad_fn).__name__ != "_WidenedLinearBackward"


class _Bare(nn.Linear):
    """A subclass keeping nn.Linear's forward: converted."""


class _Own(nn.Linear):
    """A subclass with a forward of its own: left alone."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 0.5


def _model():
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), _Bare(40, 32, bias=False), _Own(32, 48), nn.Linear(48, 64))


def _cfg(tmp_path, dtype, cpu_linear, tiling=None):
    return {"tiers": {"params": "host", "optimizer": "host", "device": "cpu", "nvme_path": str(tmp_path),
                      "pool_buffer_size": "1MiB", "pool_buffers": 2},
            "precision": {"dtype": dtype, "cpu_linear": cpu_linear},
            "partition": {"sub_group_size": 4096},
            "tiling": tiling or {"enabled": False}}


def test_init_converts_linear_layers_and_equals_a_plain_replica(tmp_path):
    torch.manual_seed(0)
    with infinity.Init(_cfg(tmp_path, "bfloat16", "float32")):
        model = _model()
    names = [type(m).__name__ for m in model]
    assert names == ["Linear", "GELU", "_Bare", "_Own", "Linear"]
    assert [getattr(type(m), "_widened", False) for m in model] == [True, False, True, False, True]
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], _Bare) and type(model[3]) is _Own

    # A plain bf16 replica with the engine's weights, converted the same way (no engine).
    with infinity.gathered(model):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    replica = _model().to(torch.bfloat16)
    replica.load_state_dict(state)
    assert widen_linears([replica]) == 3 and list(replica.state_dict()) == list(state)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 24, generator=g).to(torch.bfloat16)
    r = torch.randn(4, 7, 64, generator=g)
    outs = []
    for m in (model, replica):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y.float() * r).sum().backward()
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for (name, p), q in zip(model.named_parameters(), replica.parameters()):
        assert torch.equal(stored_grad(model, p).float(), q.grad.float()), name


@pytest.mark.parametrize("dtype, cpu_linear", [("bfloat16", "native"), ("float32", "float32")])
def test_init_leaves_layers_alone_unless_asked_and_narrow(tmp_path, dtype, cpu_linear):
    with infinity.Init(_cfg(tmp_path, dtype, cpu_linear)):
        model = _model()
    assert not any(getattr(type(m), "_widened", False) for m in model)
    assert type(model[0]) is nn.Linear and type(model[2]) is _Bare


def test_tiles_are_converted_and_train_like_the_untiled_layer(tmp_path):
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    losses = {}
    for tiled in (False, True):
        torch.manual_seed(0)
        tiling = {"enabled": tiled, "threshold": 1, "tiles": 3, "modules": ["0"] if tiled else []}
        with infinity.Init(_cfg(tmp_path / str(tiled), "bfloat16", "float32", tiling)):
            model = _model()
        opt = infinity.AdamW(model, lr=1e-2)
        if tiled:
            assert isinstance(model[0], TiledLinear)
            assert all(getattr(type(t), "_widened", False) for t in model[0].tiles)
        losses[tiled] = []
        for _ in range(3):
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[tiled].append(loss.item())
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert len(set(losses[True])) == 3


def test_native_on_a_cpu_without_avx512_says_once_which_key_helps(tmp_path, monkeypatch, caplog):
    from infinity.tiling import widened

    monkeypatch.setattr(widened, "slow_narrow_matmul", lambda: True)
    monkeypatch.setattr(widened, "_advised", False)
    for i in range(2):
        with infinity.Init(_cfg(tmp_path / str(i), "bfloat16", "native")):
            _model()
    said = [r.getMessage() for r in caplog.records if "cpu_linear" in r.getMessage()]
    assert len(said) == 1 and 'cpu_linear = "float32"' in said[0] and "bfloat16" in said[0]


def test_the_plan_counts_two_fp32_buffers_of_the_largest_converted_layer(tmp_path):
    from infinity.config import load_config
    from infinity.plan import plan
    from infinity.plan.census import census_of_module

    # Linear 40 x 24, _Bare 32 x 40, _Own 48 x 32 (a forward of its own: not converted), Linear 64 x 48
    census = census_of_module(_model())
    assert census.widened_numel == 64 * 48
    # The last layer in 3 tiles of at most 22 rows: _Bare's weight is then the largest
    tiled = census_of_module(_model(), tiling_enabled=True, tiling_threshold=1, tiles=3, tiling_modules=["4"])
    assert tiled.widened_numel == 32 * 40

    def row(dtype, cpu_linear):
        rows = plan(census, load_config(_cfg(tmp_path, dtype, cpu_linear)), check_fit=False).rows
        return [(r.tier, r.nbytes) for r in rows if r.key == "widened_linear"]

    assert row("bfloat16", "float32") == [("device", 2 * 4 * 64 * 48)]
    assert row("bfloat16", "native") == row("float32", "float32") == []


def test_init_checks_the_buffers_against_the_budget(tmp_path, monkeypatch):
    """Init's budget check counts them with the weights' sizes, not their released placeholders'."""
    import tiers.budget

    checked = []
    check = tiers.budget.check_budget

    def spy(needs, **kwargs):
        checked.extend(needs)
        return check(needs, **kwargs)

    monkeypatch.setattr(tiers.budget, "check_budget", spy)
    with infinity.Init(_cfg(tmp_path, "bfloat16", "float32")):
        _model()
    assert [(n.tier, n.nbytes) for n in checked if "largest linear layer" in n.what] == [("device", 2 * 4 * 64 * 48)]


def test_the_function_widens_into_fresh_tensors_and_leaves_the_layers_buffers_alone():
    """A module calling ``widened_linear`` itself (a tied head) holds no fp32 buffer after its product:
    the reused ones, which the budget counts, stay the converted layers' size."""
    from infinity.tiling import widened

    def run():
        x, w, b, r = _case(torch.bfloat16, out=400)
        (widened_linear(x, w, b).float() * r).sum().backward()
        assert getattr(widened._scratch, "weight", None) is None and getattr(widened._scratch, "weight_grad", None) is None
        small = nn.Linear(24, 40).to(torch.bfloat16)
        widen_linears([small])
        small(x).float().sum().backward()
        return widened._scratch.weight.numel(), widened._scratch.weight_grad.numel()

    got = []
    t = threading.Thread(target=lambda: got.append(run()))   # a thread of its own: buffers are per thread
    t.start()
    t.join()
    assert got == [(40 * 24, 40 * 24)]


@pytest.mark.parametrize("cpu_linear", ["native", "float32"])
def test_train_gpt_multiplies_every_product_of_the_example_gpt_in_fp32_when_asked(tmp_path, cpu_linear):
    """The example GPT's tied head is a function of the embedding weight, not a linear layer Init can
    convert: train_gpt builds it with ``widened_linear`` when the key asks ([Note: tied output head])."""
    from infinity.examples.train_gpt import TrainOptions, train

    options = TrainOptions(config="offload-host", model_size="tiny", steps=1, batch=2, seq=16, data="repeat", lr=1e-2,
                           nvme_dir=str(tmp_path), overrides=(f"precision.cpu_linear={cpu_linear}",))
    with _Products() as seen:
        report = train(options)
    assert report["steps"] and seen.dtypes
    narrow = [d for d in seen.dtypes if d != {torch.float32}]
    # 2 blocks x 4 linear layers + the head, forward and backward (3 products each)
    assert len(seen.dtypes) >= 27
    if cpu_linear == "float32":
        assert narrow == []
    else:
        assert len(narrow) == len(seen.dtypes)
