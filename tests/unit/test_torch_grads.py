"""torch's gradient API on engine parameters: ``model.zero_grad()``, ``clip_grad_norm_``, ``clip_grad_value_``.

Each test trains a model under infinity and its plain twin with the same torch calls and compares the
returned norms, the losses and the final parameters (see [Note: gradient tokens] in
infinity/optim/grad_face.py).
"""
import pytest
import torch

import infinity
from infinity.errors import EngineError
from tests.support.tiny_gpt import TinyGPT, batches, engine_and_plain


def _cfg(params_tier, opt_tier, tmp_path):
    return {"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": str(tmp_path)},
            "partition": {"sub_group_size": 4096}}


def _max_param_diff(model, ref) -> float:
    with infinity.gathered(model):
        return max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


def _train(model, opt, data, micro=2, max_norm=None, clip_value=None, zero=lambda m, o: m.zero_grad(),
           foreach=None):
    """Per step: ``micro`` backwards (accumulation), torch's clipping, step, ``zero``; returns losses and norms."""
    losses, norms = [], []
    for idx, tgt in data:
        for _ in range(micro):
            loss = model(idx, tgt)
            loss.backward()
        losses.append(float(loss.detach()))
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value, foreach=foreach)
        opt.step()
        zero(model, opt)
    return losses, norms


@pytest.mark.parametrize("params_tier, opt_tier, foreach", [
    ("host", "host", None), ("device", "device", None), ("nvme", "nvme", None),
    ("host", "host", True)])     # torch._foreach_norm / _foreach_mul_ (torch's default on CUDA)
def test_model_zero_grad_and_torch_clipping_match_plain_torch(tmp_path, params_tier, opt_tier, foreach):
    model, ref = engine_and_plain(_cfg(params_tier, opt_tier, tmp_path))
    data = batches(6, 2)
    kw = dict(max_norm=0.5, clip_value=2e-3, foreach=foreach)
    losses, norms = _train(model, infinity.AdamW(model, lr=1e-2), data, **kw)
    ref_losses, ref_norms = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, **kw)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5, (norms, ref_norms)
    assert _max_param_diff(model, ref) <= 1e-5


def test_zero_grad_without_set_to_none_and_opt_zero_grad_clear(tmp_path):
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    data = batches(4, 2)
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    zero_kept = lambda m, o: m.zero_grad(set_to_none=False)
    losses, _ = _train(model, opt, data[:2], zero=zero_kept)
    ref_losses, _ = _train(ref, ref_opt, data[:2], zero=zero_kept)
    more, _ = _train(model, opt, data[2:], zero=lambda m, o: o.zero_grad())
    ref_more, _ = _train(ref, ref_opt, data[2:], zero=lambda m, o: o.zero_grad())
    assert max(abs(a - b) for a, b in zip(losses + more, ref_losses + ref_more)) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5


@pytest.mark.parametrize("zero", ["model", "opt"])
def test_gradients_zeroed_in_place_read_as_zeros_until_the_next_backward(tmp_path, zero):
    """``zero_grad(set_to_none=False)`` leaves zero-filled ``.grad`` in torch: the optimizer's left None
    (``p.grad.norm()`` raised AttributeError), and the model's still answered the old norms."""
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    opts = {model: infinity.AdamW(model, lr=1e-2), ref: torch.optim.AdamW(ref.parameters(), lr=1e-2)}
    data = batches(3, 2)
    seen = []
    for net, opt in opts.items():
        clear = (lambda: net.zero_grad(set_to_none=False)) if zero == "model" else (
            lambda: opt.zero_grad(set_to_none=False))
        norms = []
        for idx, tgt in data:
            net(idx, tgt).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)))
            opt.step()
            clear()
            assert all(p.grad is not None for p in net.parameters())
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])))
            torch.nn.utils.clip_grad_value_(net.parameters(), 1e-3)     # leaves zeros zero
        seen.append(norms)
    assert seen[0][1::2] == seen[1][1::2] == [0.0] * len(data)
    assert max(abs(a - b) / b for a, b in zip(seen[0][::2], seen[1][::2])) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5


def test_gradients_not_cleared_accumulate_over_steps_as_in_torch(tmp_path):
    """Without any zero_grad torch keeps adding into .grad from step to step; so does the engine."""
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    data = batches(3, 2)
    keep = lambda m, o: None
    losses, _ = _train(model, infinity.AdamW(model, lr=1e-2), data, micro=1, zero=keep)
    ref_losses, _ = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, micro=1, zero=keep)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5


def test_grad_is_a_token_with_the_parameter_shape_whose_values_cannot_be_read(tmp_path):
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    infinity.AdamW(model, lr=1e-2)
    assert all(p.grad is None for p in model.parameters())
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    grad = model.head.weight.grad
    assert grad is not None and grad.shape == (64, 32) and grad.dtype == torch.float32
    with pytest.raises(EngineError, match=r"\.grad of 'wte.weight'.*never whole"):
        grad.sum()
    with pytest.raises(EngineError, match="only norms"):
        torch.add(torch.ones(1), grad)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_clearing_only_some_gradients_is_refused(tmp_path):
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=1e-2)
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    model.head.weight.grad = None
    with pytest.raises(EngineError, match="was cleared but that of .* was not; .*model.zero_grad"):
        opt.step()


def test_clipping_only_some_parameters_is_refused(tmp_path):
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=1e-2)
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    torch.nn.utils.clip_grad_norm_(list(model.blocks.parameters()), 1e-4)
    with pytest.raises(EngineError, match="clip all parameters together"):
        opt.step()


def test_state_dict_outside_gathered_raises_naming_the_parameter(tmp_path):
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    with pytest.raises(EngineError, match=r"parameter 'wpe' is released.*infinity.gathered"):
        model.state_dict()
    with pytest.raises(EngineError, match=r"parameter 'blocks.0.ln1.weight' is released"):
        model.blocks.state_dict(prefix="blocks.")
    with infinity.gathered(model):
        sd = model.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def _first_backward_inside_gathered(tmp_path):
    """A TinyGPT and its twin, their optimizers, three batches, and the first batch's backward taken inside
    ``infinity.gathered`` (its out_proj weights, read by nn.MultiheadAttention, keep plain gradients)."""
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(3, 2)
    with infinity.gathered(model):
        model(*data[0]).backward()
    return model, opt, ref, ref_opt, data


def test_a_backward_inside_gathered_that_the_engine_cannot_take_is_refused_and_training_goes_on(tmp_path):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: inside gathered nothing
    sees that, so a first step taken there skipped that gradient silently, and the trace it recorded
    made the next ordinary forward fail on the released weight."""
    model, opt, ref, ref_opt, data = _first_backward_inside_gathered(tmp_path)
    for _ in range(2):      # refused, and again until they are cleared
        with pytest.raises(EngineError, match=r"did not take \(\[.blocks.0.attn.out_proj.weight.*backward inside .*"
                                              r"outside infinity.gathered"):
            opt.step()
    with pytest.raises(EngineError, match=r"loss.backward\(\): parameters hold gradients the engine did not take"):
        model(*data[1]).backward()      # refused before autograd adds onto them
    model.zero_grad()
    opt.zero_grad()
    losses, _ = _train(model, opt, data[1:], micro=1)
    ref_losses, _ = _train(ref, ref_opt, data[1:], micro=1)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5


def test_a_gradient_set_by_hand_is_refused_naming_the_parameter(tmp_path):
    """Outside gathered torch said "assign a gradient of size [16, 32] to a tensor of size [0]"; inside,
    the assignment passed and opt.step() blamed a .grad "cleared"."""
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=1e-2)
    with pytest.raises(EngineError, match=r"assigning a .grad on parameter 'wpe'"):
        model.wpe.grad = torch.ones(16, 32)
    model.wpe.grad = None                       # clearing stays allowed
    with infinity.gathered(model):
        model.wpe.grad = torch.ones(16, 32)
    with pytest.raises(EngineError, match=r"gradients the engine did not take \(\['wpe'\]\): set by hand"):
        opt.step()
    model.zero_grad()


def test_opt_zero_grad_clears_gradients_left_inside_gathered_too(tmp_path):
    """The next backward added onto them, and the step took the sum (0.039 off torch after two steps)."""
    model, opt, ref, ref_opt, data = _first_backward_inside_gathered(tmp_path)
    ref(*data[0]).backward()
    opt.zero_grad()
    ref_opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    losses, _ = _train(model, opt, data[1:], micro=1, zero=lambda m, o: o.zero_grad())
    ref_losses, _ = _train(ref, ref_opt, data[1:], micro=1, zero=lambda m, o: o.zero_grad())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5


def test_a_clamp_that_fails_forgets_the_norms_taken_before_it(tmp_path, monkeypatch):
    """A norm is cached until the gradients change; a clamp_ that fails half-way (a tier write) may have changed
    some of them, and with ranks, a rank that read its cached norm would skip the collectives the others issue:
    the next norm is taken again."""
    from infinity.registry import engine_of

    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    infinity.AdamW(model, lr=1e-2)
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    engine = engine_of(model)
    p = next(q for q in model.parameters() if q.requires_grad)
    before = float(p.grad.norm())
    taken = []
    arrive = engine.ranks.arrive
    monkeypatch.setattr(engine.ranks, "arrive", lambda what: (taken.append(what), arrive(what)))
    assert float(p.grad.norm()) == before and taken == [], "a second norm is read from the cache"

    def cut(*args, **kwargs):
        raise OSError("injected: the tier write failed")

    monkeypatch.setattr(engine.store, "write_state_shard", cut)
    with pytest.raises(OSError, match="injected"):
        p.grad.clamp_(-1e-9, 1e-9)
    monkeypatch.undo()
    monkeypatch.setattr(engine.ranks, "arrive", lambda what: (taken.append(what), arrive(what)))
    assert float(p.grad.norm()) == before and len(taken) == 1, "taken again, not read from the cache"
