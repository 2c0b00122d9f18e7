"""The user's contract, on one rank: what a model built in ``infinity.Init`` computes equals plain PyTorch.

Each test trains a model under infinity and the same model (same seed) under plain PyTorch
side by side and compares losses at every step and the gathered parameters at the end;
buffers are compared directly. Models are tiny and steps few, so each test takes about a
second on the CPU; NVMe tiers use ``tmp_path``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.errors import EngineError
from tests.support.parity import train_side_by_side as _train_side_by_side

LR = 1e-2
WEIGHT_DECAY = 0.01
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5


def _cfg(params_tier, opt_tier, tmp_path):
    return {"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": str(tmp_path)},
            # Two sub-groups, so the optimizer's streamed pass runs over more than one.
            "partition": {"sub_group_size": 4096}}


def _data(steps, batch=4, features=8, classes=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, features, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def _build(make, cfg):
    """The model under infinity and a plain reference with identical initial weights."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = make()
    return model, ref


def _assert_parity(loss_diffs, param_diffs):
    for step, d in enumerate(loss_diffs):
        assert d <= LOSS_TOL, f"step {step}: loss differs from plain PyTorch by {d:.3g}"
    for name, d in param_diffs.items():
        assert d <= PARAM_TOL, f"{name}: differs from plain PyTorch by {d:.3g} after {len(loss_diffs)} steps"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


# -- infinity.Adam: L2 weight decay added to the gradient, as torch.optim.Adam ----------------

@pytest.mark.parametrize("params_tier, opt_tier", [("host", "host"), ("nvme", "nvme")])
def test_adam_matches_torch_adam(tmp_path, params_tier, opt_tier):
    data = _data(10)
    model, ref = _build(MLP, _cfg(params_tier, opt_tier, tmp_path))
    opt = infinity.Adam(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data))


def test_adam_and_adamw_differ_on_this_model():
    """The parity above could not pass with decoupled decay: on this model and these settings
    torch's Adam and AdamW end far apart (so infinity.Adam running AdamW's kernel would fail it)."""
    finals = []
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        torch.manual_seed(0)
        m = MLP()
        o = cls(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for x, y in _data(10):
            m(x, y).backward()
            o.step()
            o.zero_grad()
        finals.append([p.detach().clone() for p in m.parameters()])
    gap = max(float((a - b).abs().max()) for a, b in zip(*finals))
    assert gap > 100 * PARAM_TOL, f"Adam and AdamW differ by only {gap:.3g}"


# -- modules called several times in one forward, and parameters used by a non-owner ---------

class Reuse(nn.Module):
    """One forward that calls the same modules more than once and uses another module's weight."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.proj = nn.Linear(8, 8, bias=False)   # never called: its weight is used by forward()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = self.block(self.block(h))        # one block twice in a row
        h = self.inp(h)                      # the first layer again, later in the forward
        h = F.linear(h, self.proj.weight)    # a parameter used outside its owner's forward
        return F.cross_entropy(self.head(h), y)


@pytest.mark.parametrize("params_tier", ["host", "nvme"])
def test_reused_modules_and_foreign_parameters_match_torch(tmp_path, params_tier):
    data = _data(6)
    model, ref = _build(Reuse, _cfg(params_tier, "host", tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    gathered_after_step = []

    def after_step():
        gathered_after_step.append(infinity.stats(model)["gathered_bytes_now"])

    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data, after_step))
    # The uses of each group balance: after every step nothing is left gathered.
    assert gathered_after_step == [0] * len(data)


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(F.linear(x, self.lin.weight), y)   # lin.bias gets no gradient


def test_parameter_without_gradient_is_not_updated():
    model, ref = _build(PartlyUsed, {"tiers": {"params": "host", "optimizer": "host"}})
    opt = infinity.AdamW(model, lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    before = ref.lin.bias.detach().clone()
    for x, y in _data(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
    assert torch.equal(ref.lin.bias, before)    # torch leaves it alone
    with infinity.gathered(model):
        assert torch.equal(model.lin.bias, before)


class Branchy(nn.Module):
    """Two experts: ``a`` on every step, ``b`` only on the steps told, so ``b`` lags in Adam's steps."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, use_b=False):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return F.cross_entropy(self.head(h + self.gate(h)), y)


@pytest.mark.parametrize("opt_tier,dpu_overlap", [("host", False), ("nvme", True), ("nvme", False)])
def test_parameters_updated_only_on_their_steps_match_torch_with_their_own_step_counts(
        tmp_path, opt_tier, dpu_overlap):
    """``b`` gets gradients on steps 3, 4 and 7 only: torch skips it otherwise and corrects its
    bias with its own step count (1, 2, 3), which must survive a state_dict round trip."""
    cfg = _cfg("host", opt_tier, tmp_path)
    cfg["dpu"] = {"overlap": dpu_overlap}
    model, ref = _build(Branchy, cfg)
    opt = infinity.AdamW(model, lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    uses = [False, False, True, True, False, False, True, False]
    for step, ((x, y), use_b) in enumerate(zip(_data(len(uses)), uses)):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, y, use_b).backward()
            o.step()
            o.zero_grad()
        if step == 4:   # a round trip through the state dict keeps b's own step count
            opt.load_state_dict(opt.state_dict())
    assert opt.param_steps() == {"b.weight": 3, "b.bias": 3}
    assert ref_opt.state[ref.b.weight]["step"].item() == 3
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert float((p - q).detach().abs().max()) <= PARAM_TOL, name


# -- buffers ---------------------------------------------------------------------------------

class Buffered(nn.Module):
    """Persistent and non-persistent buffers used by forward, and BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.linspace(-1.0, 1.0, 8))                       # persistent
        self.register_buffer("inv_std", torch.full((8,), 0.5), persistent=False)
        self.register_buffer("order", torch.randperm(8), persistent=False)                # int64
        self.bn = nn.BatchNorm1d(8)
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        h = ((x - self.mean) * self.inv_std)[:, self.order]
        return F.cross_entropy(self.lin(self.bn(h)), y)


def test_buffers_keep_their_values_and_are_used(tmp_path):
    data = _data(5)
    model, ref = _build(Buffered, _cfg("host", "host", tmp_path))
    fixed = ("mean", "inv_std", "order")
    initial = {name: getattr(ref, name).clone() for name in fixed}
    for name in fixed:
        buf = getattr(model, name)
        assert buf.dtype == initial[name].dtype and buf.device.type == "cpu", name
        assert torch.equal(buf, initial[name]), f"{name} changed while the model was built inside Init"
    assert torch.equal(model.order, initial["order"]) and not torch.equal(model.order, torch.arange(8))

    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data))

    for name in fixed:
        assert torch.equal(getattr(model, name), initial[name]), f"{name} changed during training"
    # BatchNorm's running statistics are updated in place by forward, as in plain PyTorch.
    assert int(model.bn.num_batches_tracked) == len(data) == int(ref.bn.num_batches_tracked)
    assert torch.allclose(model.bn.running_mean, ref.bn.running_mean, rtol=0, atol=1e-6)
    assert torch.allclose(model.bn.running_var, ref.bn.running_var, rtol=0, atol=1e-6)
    assert not torch.equal(model.bn.running_mean, torch.zeros(8))

    with infinity.gathered(model):
        state = model.state_dict()
    assert set(state) == set(ref.state_dict())
    assert "mean" in state and "inv_std" not in state and "order" not in state
    assert torch.equal(state["mean"], initial["mean"])

    # Evaluation uses the running statistics: the same loss as the reference.
    model.eval()
    ref.eval()
    x, y = _data(1, seed=9)[0]
    with torch.no_grad():
        assert abs(model(x, y).item() - ref(x, y).item()) <= LOSS_TOL


# -- a forward that raises -------------------------------------------------------------------

class Widens(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x, y, widen=False):
        h = torch.tanh(self.a(x))
        if widen:
            h = torch.cat([h, h], dim=1)     # a user's shape bug: self.b raises inside its forward
        return F.cross_entropy(self.b(h), y)


def test_forward_that_raises_inside_a_module_leaves_training_exact(tmp_path):
    """A failed forward (a shape error, fixed and retried, as in a notebook) must not leave the
    failing module's parameters gathered: a group left in use is never refreshed by opt.step()."""
    data = _data(4)
    model, ref = _build(Widens, _cfg("host", "host", tmp_path))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model(*data[0], widen=True)
    assert infinity.stats(model)["gathered_bytes_now"] == 0
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data))


@pytest.mark.parametrize("params, optimizer", [("host", "host"), ("nvme", "nvme")])
def test_a_forward_interrupted_by_ctrl_c_leaves_training_exact(tmp_path, params, optimizer):
    """KeyboardInterrupt is no Exception: torch skips the engine's always_call post-hooks for it, and the
    cut-short forward stayed open, so every later forward counted as nested in it (no step begun: the
    overlapped update not waited for, stale values) and the losses drifted from torch's."""
    data = _data(5)
    model, ref = _build(Widens, _cfg(params, optimizer, tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data[:2]))

    def interrupt(*args):
        raise KeyboardInterrupt
    handle = model.b.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(*data[2])
    handle.remove()
    opt.zero_grad()
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data[2:]))
    assert infinity.stats(model)["gathered_bytes_now"] == 0


@pytest.mark.parametrize("params, optimizer", [("host", "host"), ("nvme", "nvme"), ("device", "host")])
def test_a_second_backward_through_a_retained_graph_adds_its_gradients_as_in_torch(tmp_path, params, optimizer):
    """``loss.backward(retain_graph=True); loss.backward()`` doubles the gradients in torch; the engine
    had released the parameters after the first and computed the second with empty placeholders."""
    data = _data(3)
    model, ref = _build(MLP, _cfg(params, optimizer, tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for x, y in data:
        for net, o in ((model, opt), (ref, ref_opt)):
            loss = net(x, y)
            loss.backward(retain_graph=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)   # sees the doubled gradients
            o.step()
            o.zero_grad()
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert float((p - q).detach().abs().max()) <= PARAM_TOL, name


def test_a_second_backward_in_bf16_equals_a_doubled_loss_bit_for_bit(tmp_path):
    runs = []
    for twice in (True, False):
        (tmp_path / str(twice)).mkdir()
        cfg = {**_cfg("host", "host", tmp_path / str(twice)), "precision": {"dtype": "bfloat16"}}
        model, _ = _build(MLP, cfg)
        opt = infinity.AdamW(model, lr=LR)
        for x, y in _data(3):
            loss = model(x.bfloat16(), y)
            if twice:
                loss.backward(retain_graph=True)
                loss.backward()
            else:
                (2 * loss).backward()
            opt.step()
            opt.zero_grad()
        runs.append(opt.state_dict()["shards"]["master"])
        infinity.release(model)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("params, optimizer", [("host", "host"), ("nvme", "nvme"), ("device", "host")])
def test_a_backward_through_a_graph_recorded_before_the_step_raises_as_in_torch(tmp_path, params, optimizer):
    """The step changes the weights that graph saved: torch refuses ("modified by an inplace
    operation"); the engine ran it silently with the new weights and old activations."""
    data = _data(4)
    model, ref = _build(MLP, _cfg(params, optimizer, tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for net, o in ((model, opt), (ref, ref_opt)):
        kept = net(*data[0])
        net(*data[1]).backward()
        o.step()
        o.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            kept.backward()
        o.zero_grad()
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data[2:]))


class CallsItself(nn.Module):
    """A module whose forward calls the module itself again (a recursive or tree model)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))     # the module's own group

    def forward(self, x, y, depth=1):
        h = torch.tanh(self.a(x)) * self.scale
        if depth:
            inner = self(h, y, depth - 1)
            return inner + 0.5 * F.cross_entropy(self.b(h * self.scale), y)     # its group used after the call
        return F.cross_entropy(self.b(h), y)


def test_a_module_that_calls_itself_trains_as_in_torch(tmp_path):
    """Its inner call is not taken for the next forward after one cut short by Ctrl-C."""
    model, ref = _build(CallsItself, _cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, _data(3)))


def test_a_step_bumps_only_the_parameters_it_updated(tmp_path):
    """BitFit: a frozen weight shares its group with a trained bias; a graph that saved only the weight
    backs through after the step, as in torch (the step does not change the weight)."""
    model, ref = _build(MLP, _cfg("host", "host", tmp_path))
    model.net[0].weight.requires_grad_(False)
    ref.net[0].weight.requires_grad_(False)
    opt = infinity.AdamW(model, lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    (x, y), = _data(1)
    for net, o in ((model, opt), (ref, ref_opt)):
        kept = (net.net[0](x.requires_grad_()) ** 2).sum()     # saves x and the frozen weight only
        net(x, y).backward()
        o.step()
        o.zero_grad()
        kept.backward()
        x.grad = None


def test_own_step_counts_travel_with_a_checkpoint_and_are_checked_by_name(tmp_path):
    cfg = _cfg("host", "nvme", tmp_path)
    model, _ = _build(Branchy, cfg)
    opt = infinity.AdamW(model, lr=0.05)
    for (x, y), use_b in zip(_data(3), [True, False, False]):
        model(x, y, use_b).backward()
        opt.step()
        opt.zero_grad()
    assert opt.param_steps() == {"b.weight": 1, "b.bias": 1}
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    cfg2 = _cfg("host", "nvme", tmp_path / "other")
    (tmp_path / "other").mkdir()
    other, _ = _build(Branchy, cfg2)
    oopt = infinity.AdamW(other, lr=0.05)
    infinity.load_checkpoint(tmp_path / "ckpt", other, oopt)
    assert oopt.step_count == 3 and oopt.param_steps() == {"b.weight": 1, "b.bias": 1}
    state = oopt.state_dict()
    state["param_steps"] = {"c.weight": 2}
    with pytest.raises(infinity.runtime.engine.EngineError, match=r"step counts for parameters .*'c.weight'"):
        oopt.load_state_dict(state)


def test_load_state_dict_with_assign_is_refused_before_any_parameter_is_replaced(tmp_path):
    """It replaced the managed parameters by plain tensors the engine never updates or saves, silently
    (until an optimizer was built); without assign, a load inside ``infinity.gathered`` stores the values."""
    model, ref = _build(Buffered, _cfg("host", "host", tmp_path))
    managed = [id(p) for p in model.parameters()]
    with infinity.gathered(model):
        values = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    for where in ("outside", "inside"):
        with pytest.raises(EngineError, match=r"load_state_dict\(assign=True\): '.*' is a parameter "
                                                       r"infinity manages.*nothing was loaded"):
            if where == "inside":
                with infinity.gathered(model):
                    model.load_state_dict(values, assign=True)
            else:
                model.load_state_dict(values, assign=True)
        assert [id(p) for p in model.parameters()] == managed, where
    with infinity.gathered(model):
        model.load_state_dict(values)
    with infinity.gathered(model):
        assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    infinity.release(model)


@pytest.mark.parametrize("params, optimizer", [("host", "host"), ("nvme", "nvme"), ("device", "host")])
def test_a_first_forward_under_inference_mode_leaves_training_exact(tmp_path, params, optimizer):
    """An evaluation before training under torch.inference_mode (Lightning's sanity check runs one): the buffers
    the engine made there were inference tensors, and every later training forward, gathered and state_dict
    raised torch's "Inplace update to inference tensor outside InferenceMode", for good. Now they are not."""
    data = _data(4)
    model, ref = _build(MLP, _cfg(params, optimizer, tmp_path))
    opt = infinity.AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    with torch.inference_mode():
        assert torch.equal(model(*data[0]), ref(*data[0]))
        with infinity.gathered(model):
            pass
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data[:2]))
    with torch.inference_mode():
        assert torch.allclose(model(*data[2]), ref(*data[2]), atol=LOSS_TOL)
    _assert_parity(*_train_side_by_side(model, opt, ref, ref_opt, data[2:]))


def test_an_inference_mode_forward_is_no_training_forward_and_leaves_parameters_unfreezable(tmp_path):
    """Leaving inference mode for the engine's own work turned gradients on: its hooks took an evaluation under
    torch.inference_mode for a training forward (groups armed for a backward, recorded in the training trace).
    And placeholders made there were inference tensors: requires_grad_ after it raised."""
    model, _ = _build(MLP, _cfg("host", "host", tmp_path))
    engine = infinity.registry.engine_of(model)
    opt = infinity.AdamW(model, lr=LR)
    with torch.inference_mode():
        model(*_data(1)[0])
        assert engine.prefetcher.lane == "inference"     # its own trace, not the training steps'
        with infinity.gathered(model):
            pass
    model.requires_grad_(False)
    model.requires_grad_(True)
    model(*_data(1)[0]).backward()
    opt.step()
