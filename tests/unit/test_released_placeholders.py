"""Released placeholders beyond plain ``nn.Parameter``: subclasses of it, and a tiled layer's joined weight.

Outside ``infinity.gathered`` an engine parameter holds an empty tensor; reading it must raise an error
naming ``infinity.gathered``, never give a silent ``(0,)`` result (see [Note: released placeholders] and
[Note: released joins] in infinity/runtime/placeholder.py). Both used to: a parameter of a subclass of
``nn.Parameter`` kept its class, and a tiled layer's ``weight`` was ``torch.empty(0)`` (so
``layer.weight.shape`` said ``(0,)``, where Hugging Face reads the vocabulary size from it).
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import EngineError
from infinity.runtime.placeholder import ReleasedJoin, ReleasedParameter, released_class
from infinity.tiling import TiledLinear
from tests.support.parity import engine_twin, train_side_by_side


class _OwnParameter(nn.Parameter):
    """A subclass with a method of its own."""

    def kind(self) -> str:
        return "own"


class _OwnDispatch(nn.Parameter):
    """A subclass with a ``__torch_function__`` of its own: released, it keeps its class."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(6, 4)
        self.a.weight = _OwnParameter(self.a.weight.detach().clone())

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def _refusals(p) -> dict:
    reads = {"sum": lambda: p.sum(), "detach": lambda: p.detach(), "data": lambda: p.data,
             "clone": lambda: p.clone(), "index": lambda: p[0], "init": lambda: nn.init.zeros_(p),
             "torch.save": lambda: torch.save(p, io.BytesIO())}
    out = {}
    for what, read in reads.items():
        with pytest.raises(EngineError) as caught:
            read()
        out[what] = str(caught.value)
    return out


def test_a_parameter_subclass_is_released_as_a_subclass_of_its_own_class():
    ref, model = engine_twin(_Net, {"tiers": {"params": "host"}})
    with infinity.gathered(model):
        assert type(model.a.weight) is _OwnParameter
    p = model.a.weight
    assert isinstance(p, _OwnParameter) and isinstance(p, ReleasedParameter) and type(p) is not _OwnParameter
    assert p.shape == (6, 8) and p.numel() == 48 and p.kind() == "own"
    for what, message in _refusals(p).items():
        assert "'a.weight'" in message and "infinity.gathered" in message, (what, message)
    losses, params = train_side_by_side(model, infinity.AdamW(model, lr=1e-2), ref,
                                        torch.optim.AdamW(ref.parameters(), lr=1e-2),
                                        [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)])
    assert max(losses) < 1e-6 and max(params.values()) < 1e-6, (losses, params)
    assert type(model.a.weight) is released_class(_OwnParameter)
    infinity.release(model)


def test_a_subclass_with_its_own_dispatch_keeps_its_class():
    assert released_class(_OwnDispatch) is None
    assert released_class(nn.Parameter) is ReleasedParameter
    assert released_class(released_class(_OwnParameter)) is released_class(_OwnParameter)


def _tiled_model():
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host"}, "tiling": {"modules": ["head"], "tiles": 3}}):
        model = nn.Sequential()
        model.add_module("body", nn.Linear(4, 6))
        model.add_module("head", nn.Linear(6, 9))
    assert isinstance(model.head, TiledLinear)
    return model


def test_a_tiled_weight_outside_gathered_is_described_and_refused():
    model = _tiled_model()
    for name, shape in (("weight", (9, 6)), ("bias", (9,))):
        joined = getattr(model.head, name)
        assert type(joined) is ReleasedJoin and isinstance(joined, nn.Parameter)
        assert joined.shape == shape and joined.dim() == len(shape) and joined.numel() == torch.Size(shape).numel()
        assert joined.dtype == torch.float32 and joined.requires_grad
        for what, message in _refusals(joined).items():
            assert f"'head.{name}'" in message and "infinity.gathered" in message, (what, message)
        with pytest.raises(EngineError, match=rf"\.grad on 'head\.{name}'.*tiles\[i\]\.{name}\.grad"):
            joined.grad
    assert model.state_dict(keep_vars=True)["head.weight"].shape == (9, 6)
    with infinity.gathered(model):
        assert model.head.weight.shape == (9, 6)
    infinity.release(model)


@pytest.mark.parametrize("where", ["released", "gathered"])
def test_freezing_a_tiled_weight_freezes_every_tile(where):
    model = _tiled_model()
    if where == "released":
        model.head.weight.requires_grad_(False)
    else:
        with infinity.gathered(model):
            model.head.weight.requires_grad = False
    assert [t.weight.requires_grad for t in model.head.tiles] == [False] * 3
    assert [t.bias.requires_grad for t in model.head.tiles] == [True] * 3
    assert not model.head.weight.requires_grad
    with infinity.gathered(model):
        before = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    opt = infinity.AdamW(model, lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with infinity.gathered(model):
        assert torch.equal(model.head.weight, before[0])
        assert not torch.equal(model.head.bias, before[1])
    infinity.release(model)


def test_edits_through_the_data_and_views_of_a_gathered_tiled_weight_reach_the_shards():
    model = _tiled_model()
    with infinity.gathered(model):
        model.head.weight.data[2].zero_()               # Hugging Face's padding-row init
        model.head.weight.detach()[7].fill_(3.0)
        model.head.weight.view(-1)[0:6].fill_(-1.0)
        model.head.bias.data.fill_(0.5)
    with infinity.gathered(model):
        w, b = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    assert torch.equal(w[2], torch.zeros(6)) and torch.equal(w[7], torch.full((6,), 3.0))
    assert torch.equal(w[0], torch.full((6,), -1.0)) and torch.equal(b, torch.full((9,), 0.5))
    infinity.release(model)


def test_pickling_a_model_raises_naming_the_infinity_way_and_training_goes_on(tmp_path):
    """``torch.save(model)`` and ``pickle.dumps(model)`` reach the engine's module hooks before any
    parameter: they said "Can't pickle local object 'install_hooks.<locals>.<lambda>'"."""
    import copy
    import pickle

    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = _Net()
    opt = infinity.AdamW(model, lr=1e-2)
    for what, call in {"torch.save": lambda: torch.save(model, io.BytesIO()),
                       "pickle": lambda: pickle.dumps(model), "deepcopy": lambda: copy.deepcopy(model)}.items():
        with pytest.raises(EngineError, match=r"infinity.gathered|infinity.save_checkpoint"):
            call()
    model(torch.ones(2, 8), torch.zeros(2, 4)).backward()
    opt.step()
    infinity.release(model)
    with pytest.raises(EngineError, match="pickling a model infinity manages"):
        torch.save(model, io.BytesIO())
