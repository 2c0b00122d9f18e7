"""``infinity.AdamW``/``Adam`` take what ``torch.optim`` takes: parameters, param groups with their own
hyper-parameters, ``add_param_group``, LR schedulers, ``state_dict`` with torch's ``param_groups``."""
import pytest
import torch

import infinity
from infinity.errors import EngineError
from infinity.registry import NotManagedError
from tests.support.tiny_gpt import TinyGPT, batches, engine_and_plain


def _cfg(params_tier, opt_tier, tmp_path, **dpu):
    return {"tiers": {"params": params_tier, "optimizer": opt_tier, "nvme_path": str(tmp_path)},
            "partition": {"sub_group_size": 4096}, "dpu": dpu}


def decay_groups(model, lr_rest=None):
    """Trainer's recipe: weight decay for matrices, none for biases and norms (and here another lr).

    By name, as Trainer does: outside ``infinity.gathered`` an engine parameter has no values, and
    its shape is that of its placeholder."""
    no_decay = lambda n: n.endswith("bias") or "ln" in n
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    rest = [p for n, p in model.named_parameters() if no_decay(n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if lr_rest is not None:
        groups[1].update(lr=lr_rest, betas=(0.8, 0.99), eps=1e-6)
    return groups


def _run(model, opt, sched, data):
    losses = []
    for idx, tgt in data:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _max_param_diff(model, ref) -> float:
    with infinity.gathered(model):
        return max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))


@pytest.mark.parametrize("cls, ref_cls", [(infinity.AdamW, torch.optim.AdamW), (infinity.Adam, torch.optim.Adam)])
@pytest.mark.parametrize("params_tier, opt_tier, dpu", [("host", "host", {}), ("nvme", "nvme", {}),
                                                        ("device", "device", {})])
def test_param_groups_with_their_own_hyperparameters_and_a_scheduler_match_torch(
        tmp_path, cls, ref_cls, params_tier, opt_tier, dpu):
    model, ref = engine_and_plain(_cfg(params_tier, opt_tier, tmp_path, **dpu))
    opt = cls(decay_groups(model, lr_rest=3e-3), lr=1e-2)
    ref_opt = ref_cls(decay_groups(ref, lr_rest=3e-3), lr=1e-2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    data = batches(6, 2)
    losses = _run(model, opt, _warmup(opt), data)
    ref_losses = _run(ref, ref_opt, _warmup(ref_opt), data)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_param_diff(model, ref) <= 1e-5
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_parameters_iterable_and_add_param_group_match_torch(tmp_path):
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    first = lambda m: [p for n, p in m.named_parameters() if n.startswith("blocks.0.")]
    others = lambda m: [p for n, p in m.named_parameters() if not n.startswith("blocks.0.")]
    opt = infinity.AdamW(first(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(first(ref), lr=1e-2)
    data = batches(4, 2)
    for step, (idx, tgt) in enumerate(data):
        if step == 2:   # the rest joins later, with its own lr and an eps above the first step's tiniest gradients
            opt.add_param_group({"params": others(model), "lr": 5e-3, "eps": 1e-4})
            ref_opt.add_param_group({"params": others(ref), "lr": 5e-3, "eps": 1e-4})
        for m, o in ((model, opt), (ref, ref_opt)):
            m(idx, tgt).backward()
            o.step()
            m.zero_grad()     # torch's o.zero_grad() would leave the others' .grad accumulating
    assert _max_param_diff(model, ref) <= 1e-5


def test_state_dict_has_torchs_param_groups_and_loads_them(tmp_path):
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(decay_groups(model, lr_rest=3e-3), lr=1e-2)
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    opt.step()
    sd = opt.state_dict()
    n_decay = len(opt.param_groups[0]["params"])
    assert sd["param_groups"][0]["params"] == list(range(n_decay))
    assert sd["param_groups"][1]["lr"] == 3e-3 and sd["param_groups"][1]["weight_decay"] == 0.0
    opt.param_groups[1]["lr"] = 1.0
    opt.load_state_dict(sd)
    assert opt.param_groups[1]["lr"] == 3e-3
    sd["param_groups"] = sd["param_groups"][:1]
    with pytest.raises(ValueError, match="1 parameter groups, this optimizer 2"):
        opt.load_state_dict(sd)


def test_parameters_not_built_in_init_are_refused(tmp_path):
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    with pytest.raises(NotManagedError, match="not managed by infinity"):
        infinity.AdamW(ref.parameters())
    with pytest.raises(ValueError, match="lr must be >= 0"):
        infinity.AdamW([{"params": list(model.parameters()), "lr": -1.0}])
    opt = infinity.AdamW(model.parameters())
    with pytest.raises(EngineError, match="already has an infinity optimizer"):
        infinity.AdamW(model)
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_a_torch_optimizer_over_engine_parameters_is_refused_as_it_is_built(tmp_path, cls):
    """It was refused at its first step, after a whole forward and backward (minutes, on a large model)."""
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    name = f"{cls.__module__}.{cls.__name__}"
    with pytest.raises(EngineError, match=rf"^{name}\(\.\.\.\): it holds 'wpe', a parameter of a model built in "
                                          r"infinity.Init.*use infinity.AdamW"):
        cls(model.parameters(), lr=1e-2)
    plain = cls(ref.parameters(), lr=1e-2)      # optimizers of other models are built and step as usual
    with pytest.raises(EngineError, match=rf"^{name}\(\.\.\.\): it holds 'wpe'"):
        plain.add_param_group({"params": [model.wpe]})
    idx, tgt = batches(1, 2)[0]
    ref(idx, tgt).backward()
    plain.step()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_a_torch_optimizer_built_over_gathered_parameters_raises_at_its_first_step(tmp_path, cls):
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    with infinity.gathered(model):      # plain parameters while gathered: the step's hook is what sees it
        opt = cls(model.parameters(), lr=1e-2)
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    with pytest.raises(EngineError, match=r"\.step\(\): it holds 'wpe', a parameter of a model built in infinity.Init"):
        opt.step()


@pytest.mark.parametrize("key", ["maximize", "amsgrad"])
def test_torch_options_the_host_adam_lacks_are_refused_not_ignored(tmp_path, key):
    """``maximize`` and ``amsgrad`` in a param group were accepted and stepped as if False."""
    model, _ = engine_and_plain(_cfg("host", "host", tmp_path))
    with pytest.raises(ValueError, match=rf"param group 0 sets {key}=True, which infinity's host Adam does not"):
        infinity.AdamW([{"params": list(model.parameters()), key: True}])
    opt = infinity.AdamW([{"params": list(model.parameters()), key: False}])     # torch's default: fine
    idx, tgt = batches(1, 2)[0]
    model(idx, tgt).backward()
    opt.param_groups[0][key] = True         # set later, as code that edits param_groups may
    with pytest.raises(ValueError, match=rf"AdamW.step\(\): param group 0 sets {key}=True"):
        opt.step()
    step_count = opt.step_count
    opt.param_groups[0][key] = False
    opt.step()                              # nothing was changed by the refused call
    assert opt.step_count == step_count + 1


def test_a_state_dict_that_is_not_an_infinity_optimizers_is_refused_before_anything_loads(tmp_path):
    model, ref = engine_and_plain(_cfg("host", "host", tmp_path))
    opt = infinity.AdamW(model, lr=1e-2)
    broken = opt.state_dict()
    broken["step"] = 123
    del broken["shards"]
    with pytest.raises(EngineError, match=r"the state has no \['shards'\].*nothing was loaded"):
        opt.load_state_dict(broken)
    assert opt.step_count == 0
