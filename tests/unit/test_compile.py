"""``torch.compile`` of an engine model: the default backend trains as the plain model does.

The engine's forward hooks are kept out of the compiled graphs (each is a graph break):
they move bytes between tiers and are no tensor program. What lies between them, the
modules' own forward, is compiled.
"""
import contextlib
import inspect

import pytest
import torch
from torch import nn

import infinity
from tests.support.parity import engine_twin, train_side_by_side


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.body(x), y)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("tiers", [{"params": "host"},
                                   {"params": "nvme", "optimizer": "nvme"}], ids=["host", "nvme"])
def test_compiled_engine_model_trains_as_the_plain_model(tmp_path, backend, tiers):
    torch.manual_seed(0)
    ref = _Net()
    with infinity.Init({"tiers": {**tiers, "nvme_path": str(tmp_path)}}):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiled = torch.compile(model) if backend == "inductor" else torch.compile(model, backend=backend)
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(4)]
    losses, params = train_side_by_side(compiled, opt, ref, ref_opt, data)
    assert max(losses) < 1e-5, losses
    assert max(params.values()) < 1e-5, params
    infinity.release(model)


def test_module_compile_in_place(tmp_path):
    def in_place(model):
        model.compile()
        return model

    _train_compiled(_Net, in_place)


class _ForeignUse(nn.Module):
    """Uses ``b``'s parameters without calling ``b`` (as ``nn.MultiheadAttention`` uses ``out_proj``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        h = nn.functional.linear(torch.relu(self.a(x)), self.b.weight) + self.b.bias
        return nn.functional.mse_loss(h, y)


class _OwnParameter(nn.Parameter):
    """A subclass of nn.Parameter: released, it keeps its class (see [Note: released placeholders])."""


class _ForeignUseOfASubclass(_ForeignUse):
    def __init__(self):
        super().__init__()
        self.b.weight = _OwnParameter(self.b.weight.detach().clone())


def _train_compiled(net, compile=lambda model: torch.compile(model, backend="aot_eager")) -> None:
    """An engine model of class ``net``, compiled by ``compile`` (aot_eager by default), trains as the plain
    model does; torch.compile's caches are emptied first (the tests look at what one run compiled)."""
    torch._dynamo.reset()
    ref, model = engine_twin(net, {"tiers": {"params": "host"}})
    losses, params = train_side_by_side(compile(model), infinity.AdamW(model, lr=1e-2),
                                        ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
                                        [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)])
    assert max(losses) < 1e-5 and max(params.values()) < 1e-5, (losses, params)
    infinity.release(model)


@pytest.mark.parametrize("net", [_Net, _ForeignUse])
def test_compiled_on_a_torch_whose_tracer_does_not_say_it_is_compiling(monkeypatch, net):
    """Before torch 2.13, ``torch.compiler.is_compiling()`` was False while the tracer itself made a fake
    of a tensor it met (the foreign watch's keys, a released parameter): the placeholder refused the
    tracer's ``_is_view()`` on the lent GPU machine's torch 2.11. Here without 2.13's compile-session flag."""
    # torch 2.13's flag for the whole compile session; a torch that renamed it would make this test 2.13's.
    assert hasattr(torch.compiler, "_compile_session_context") or torch.__version__ < "2.13"
    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    _train_compiled(net)
    torch._dynamo.reset()


@pytest.mark.parametrize("net", [_ForeignUse, _ForeignUseOfASubclass])
def test_the_foreign_watch_stays_out_of_the_graphs_and_their_guards(net):
    """The first step's graphs (traced with the foreign watch on) neither guard on the watch's map of every
    managed parameter nor trace the fetch a foreign use makes (both did: 26 guards on the map in one
    nn.Linear frame of this two-layer model), and the foreign use still fetches the parameter it needs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    _train_compiled(net)
    guards = [str(entry.guard_manager) for code in (_ForeignUse.forward.__code__, nn.Linear.forward.__code__)
              for entry in _debug_get_cache_entry_list(code)]
    torch._dynamo.reset()
    assert "MATCH" in "".join(guards), guards      # the guards' text, where the map's name showed before
    assert guards and not [g for g in guards if "group_of" in g], [g for g in guards if "group_of" in g][0][:2000]


def test_the_engine_hooks_are_never_compiled_so_never_recompiled():
    """The hooks are callables (their pickling raises naming infinity); traced, their ``__call__`` was
    compiled again for every module until dynamo's recompile limit (a failure with
    ``fail_on_recompile_limit_hit``)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from infinity.runtime.hooks import _EngineHook

    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = _Net()
    opt = infinity.AdamW(model, lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(3):
            compiled(torch.randn(5, 8), torch.randn(5, 4)).backward()
            opt.step()
            opt.zero_grad()
    assert not _debug_get_cache_entry_list(inspect.unwrap(_EngineHook.__call__).__code__)
    infinity.release(model)
