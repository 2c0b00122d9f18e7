"""A ``torch.optim`` AdamW state dict loads into ``infinity.AdamW``: a plain PyTorch run goes on under
infinity as it would have gone on in torch ([Note: torch.optim state dicts] in infinity/optim/torch_state.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.errors import EngineError
from tests.support.tiny_gpt import TinyGPT, batches, engine_and_plain
from tests.unit.test_param_groups import decay_groups


def _cfg(tmp_path, params, optimizer):
    return {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(tmp_path), "device": "cpu"},
            "partition": {"sub_group_size": 4096}, "aio": {"engine": "threads"}}


def _step(model, opt, idx, tgt) -> float:
    loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("params, optimizer", [("host", "host"), ("nvme", "nvme")])
def test_a_plain_run_goes_on_under_infinity_as_in_torch(tmp_path, params, optimizer):
    """Two param groups (another lr and betas for the second), the head frozen for the first steps (its
    parameters have no state, then a lagging step), a scheduler's ``initial_lr`` in the groups."""
    model, plain = engine_and_plain(_cfg(tmp_path, params, optimizer))
    data = batches(6, 2)
    plain_opt = torch.optim.AdamW(decay_groups(plain, lr_rest=3e-3), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda step: 1.0)
    head = [p for n, p in plain.named_parameters() if n.startswith("head")]
    for p in head:
        p.requires_grad_(False)
    for i, (idx, tgt) in enumerate(data[:3]):
        if i == 2:
            for p in head:
                p.requires_grad_(True)
        _step(plain, plain_opt, idx, tgt)
    with infinity.gathered(model):
        model.load_state_dict(plain.state_dict())
    opt = infinity.AdamW(decay_groups(model), lr=5e-1)     # hyper-parameters come from the state dict
    opt.load_state_dict(plain_opt.state_dict())
    assert opt.step_count == 3 and opt.param_steps() == {n: 1 for n, _ in plain.named_parameters()
                                                         if n.startswith("head")}
    assert opt.param_groups[1]["lr"] == 3e-3 and opt.param_groups[1]["betas"] == (0.8, 0.99)
    assert "initial_lr" in opt.param_groups[0] and "foreach" not in opt.param_groups[0]
    for idx, tgt in data[3:]:
        assert _step(model, opt, idx, tgt) == pytest.approx(_step(plain, plain_opt, idx, tgt), rel=1e-5)
    with infinity.gathered(model):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
    infinity.release(model)


def _one_plain_step(tmp_path, lr: float):
    """A TinyGPT in infinity (its optimizer at lr 1e-2, never stepped) and a plain one stepped once at ``lr``."""
    model, plain = engine_and_plain(_cfg(tmp_path, "host", "host"))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr)
    _step(plain, plain_opt, *batches(1, 2)[0])
    return model, infinity.AdamW(model, lr=1e-2), plain_opt


def _states(opt) -> dict:
    return {k: [t.clone() for t in v] for k, v in opt.state_dict()["shards"].items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for key in a for x, y in zip(a[key], b[key]))


def test_what_a_torch_state_dict_cannot_carry_is_refused_naming_it_and_nothing_loads(tmp_path):
    model, opt, plain_opt = _one_plain_step(tmp_path, 2e-2)
    saved = plain_opt.state_dict()
    before = _states(opt)

    def refused(edit, says, cls=infinity.AdamW):
        broken = copy.deepcopy(plain_opt.state_dict())     # its entries are the optimizer's own
        edit(broken)
        with pytest.raises(EngineError, match=says):
            (opt if cls is infinity.AdamW else other).load_state_dict(broken)

    first = next(iter(saved["state"]))
    refused(lambda d: d["state"][first].update(exp_avg=torch.zeros(3)), r"exp_avg has shape \(3,\)")
    refused(lambda d: d["state"].update({999: d["state"][first]}), "parameter index 999")
    refused(lambda d: d["param_groups"][0].update(amsgrad=True), "amsgrad=True")
    refused(lambda d: d["param_groups"][0]["params"].pop(), "parameters here")
    refused(lambda d: d["state"][first].pop("exp_avg_sq"), "has no 'exp_avg_sq'")
    assert opt.step_count == 0 and opt.param_groups[0]["lr"] == 1e-2 and _same(before, _states(opt))
    infinity.release(model)
    model, _ = engine_and_plain(_cfg(tmp_path, "host", "host"))
    other = infinity.Adam(model, lr=1e-2)
    refused(lambda d: None, r"torch.optim.AdamW \(decoupled weight decay\) and this is infinity.Adam", infinity.Adam)
    infinity.release(model)


def test_a_torch_state_dict_leaves_a_frozen_base_dormant(tmp_path):
    """Parameters without state load as zeros: a base frozen in Init keeps no moment keys."""
    torch.manual_seed(0)
    with infinity.Init(_cfg(tmp_path, "host", "host")):
        model = TinyGPT()
        model.blocks.requires_grad_(False)
    opt = infinity.AdamW(model, lr=1e-2)
    held = infinity.stats(model)["tiers"]["host"]["bytes_in_use"]
    torch.manual_seed(0)
    plain = TinyGPT()
    plain.blocks.requires_grad_(False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _step(plain, plain_opt, *batches(1, 2)[0])
    opt.load_state_dict(plain_opt.state_dict())
    assert infinity.stats(model)["tiers"]["host"]["bytes_in_use"] == held
    infinity.release(model)


def test_a_load_whose_moments_do_not_fit_the_tier_keeps_nothing(tmp_path):
    """The saved moments wake a dormant base: with a host budget that holds the model as built but not
    those keys, the load raises naming why and leaves every state as it was (it wrote the groups before
    the first that did not fit)."""
    from tests.integration.test_dormant_states import Stack, _config, _held

    def built(cfg):
        torch.manual_seed(0)
        with infinity.Init(cfg):
            model = Stack()
            model.layers[2:].requires_grad_(False)
        return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)

    (tmp_path / "probe").mkdir()
    probe, _ = built(_config(tmp_path / "probe", "host"))
    held = _held(probe, "host")
    infinity.release(probe)
    cfg = _config(tmp_path, "host")
    cfg["tiers"]["host_budget"] = held + 4096
    model, opt = built(cfg)
    torch.manual_seed(0)
    plain = Stack()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=2e-2, weight_decay=0.1)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    plain(x).backward()
    plain_opt.step()
    before = _states(opt)
    with pytest.raises(MemoryError, match="would hold") as raised:
        opt.load_state_dict(plain_opt.state_dict())
    assert any("nothing was loaded" in note for note in raised.value.__notes__)
    assert opt.step_count == 0 and opt.param_groups[0]["lr"] == 1e-2 and _held(model, "host") == held
    assert _same(before, _states(opt))
    infinity.release(model)


def test_hyper_parameters_out_of_range_are_refused_as_the_constructor_refuses_them(tmp_path):
    model, opt, plain_opt = _one_plain_step(tmp_path, 1e-2)
    saved = copy.deepcopy(plain_opt.state_dict())
    saved["param_groups"][0]["eps"] = -5.0
    with pytest.raises(EngineError, match=r"eps must be > 0, got -5.0 \(param group 0\); nothing was loaded"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["eps"] == 1e-8
    infinity.release(model)
