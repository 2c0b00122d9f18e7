"""Bad input to the engine: each a clear error that names what is wrong, raised early."""
import shutil
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn

import infinity
from tests.support.parity import train_side_by_side
from infinity.config import ConfigError
from infinity.errors import EngineError
from infinity import registry
from infinity.registry import NotManagedError
from tiers.base import TierFullError
from tiers.budget import BudgetError


def _nvme_cfg(path):
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(path)}}


def test_missing_nvme_path_is_named(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ConfigError, match="no-such-dir.*does not exist"):
        with infinity.Init(_nvme_cfg(missing)):
            nn.Linear(4, 4)


def test_too_little_disk_says_how_much(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(BudgetError, match=r"need .* on nvme_path .*free"):
        with infinity.Init(_nvme_cfg(tmp_path)):
            nn.Linear(64, 64)


def test_too_little_disk_names_the_bytes_per_parameter(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    cfg = dict(_nvme_cfg(tmp_path), precision={"dtype": "bfloat16"})
    # bf16 on NVMe: compute copy 2 + master remainder 2 + m, v 8 + bf16 gradient 2
    with pytest.raises(BudgetError, match=r"model states: 14\.00 bytes per parameter element, 14\.00 of them on NVMe"):
        with infinity.Init(cfg):
            nn.Linear(64, 64)


def test_too_little_host_memory_for_optimizer_states():
    # The first module that does not fit stops construction, naming the tier and budget.
    with pytest.raises((BudgetError, TierFullError), match="host.*budget"):
        with infinity.Init({"tiers": {"params": "device", "optimizer": "host", "host_budget": 4096}}):
            nn.Linear(256, 256)


def test_step_before_backward():
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    opt = infinity.AdamW(model)
    with pytest.raises(EngineError, match=r"before backward\(\)"):
        opt.step()


def test_model_built_outside_init():
    model = nn.Linear(4, 4)
    with pytest.raises(NotManagedError, match="not built inside infinity.Init"):
        infinity.AdamW(model)
    with pytest.raises(NotManagedError, match="not built inside infinity.Init"):
        with infinity.gathered(model):
            pass


def test_construction_interception_is_undone_on_error():
    before_linear = nn.Linear.__init__
    before_subclass = nn.Module.__dict__.get("__init_subclass__")

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            raise ValueError("user code failed")

    with pytest.raises(ValueError, match="user code failed"):
        with infinity.Init({}):
            Boom()
    assert nn.Linear.__init__ is before_linear
    assert nn.Module.__dict__.get("__init_subclass__") is before_subclass
    plain = nn.Linear(3, 2)
    assert plain.weight.shape == (2, 3)


def test_a_class_whose_init_is_wrapped_again_inside_the_context_keeps_that_wrapper():
    """A class defined inside Init (transformers imports a model's module at first use) and then decorated
    (the kernels package's ``use_kernelized_func``) keeps the decorator's ``__init__`` after exit; ours, which it
    calls, goes inert and keeps neither the context nor its engine alive."""
    import gc
    import weakref

    context = infinity.Init({"tiers": {"params": "host"}})
    with context:
        class Late(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

        wrapped = Late.__init__

        def decorated(self, *args, **kwargs):
            wrapped(self, *args, **kwargs)
            self.__dict__["_added"] = {"by": "decorator"}

        Late.__init__ = decorated
        model = Late()
    assert Late.__init__ is decorated and model._added == {"by": "decorator"}
    with pytest.raises(EngineError, match="infinity.gathered"):
        model.lin.weight.sum()                  # built by the engine
    plain = Late()
    assert plain._added == {"by": "decorator"} and plain.lin.weight.sum().isfinite()    # an ordinary module
    engine = weakref.ref(registry.engine_of(model))
    context = weakref.ref(context)
    infinity.release(model)
    del model
    gc.collect()
    assert context() is None and engine() is None
    # A later context wraps the decorated __init__ again and builds through the whole chain.
    with infinity.Init({"tiers": {"params": "host"}}):
        again = Late()
    assert again._added == {"by": "decorator"} and Late.__init__ is decorated
    with pytest.raises(EngineError, match="infinity.gathered"):
        again.lin.weight.sum()
    infinity.release(again)


def test_released_parameters_refuse_reads_and_gathered_ones_are_whole():
    with infinity.Init({"tiers": {"params": "host"}}):
        model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    assert model[0].weight.shape == (3, 5)          # described as on the plain model
    with pytest.raises(EngineError, match=r"'0\.weight'.*infinity\.gathered"):
        model[0].weight.sum()
    with infinity.gathered(model):
        assert model[0].weight.shape == (3, 5)
        with torch.no_grad():
            model[2].bias.fill_(7.0)
    with infinity.gathered(model):
        assert torch.equal(model[2].bias, torch.full((2,), 7.0))


def test_swap_directory_is_released_with_the_model(tmp_path):
    """Dropping the model closes its swap files and lock: the directory can be used again."""
    import gc

    for _ in range(2):
        with infinity.Init(_nvme_cfg(tmp_path)):
            model = nn.Linear(8, 8)
        opt = infinity.AdamW(model)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert list(tmp_path.rglob("*.swap"))
        # The overlapped step (dpu.overlap) holds the optimizer, and so the model, until it ends.
        opt.synchronize()
        del model, opt
        gc.collect()
        # A clean close deletes the swap files; the second turn takes the same directory's lock.
        assert not list(tmp_path.rglob("*.swap"))


# -- unsupported use of Init and of the optimizer: one test per error ---------------------------

class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x, hook=None):
        h = self.a(x)
        if hook is not None:
            h.register_hook(hook)
        return self.b(h).sum()


def test_nested_init_is_refused():
    with pytest.raises(RuntimeError, match="infinity.Init is already active; nested Init contexts are not supported"):
        with infinity.Init({}):
            nn.Linear(4, 4)
            with infinity.Init({}):
                nn.Linear(4, 4)
    assert not getattr(nn.Linear.__init__, "infinity_init", False)
    assert nn.Linear(3, 2).weight.shape == (2, 3)


def test_init_that_builds_no_parameters():
    with pytest.raises(RuntimeError, match="infinity.Init: no module with parameters was built inside the context"):
        with infinity.Init({}):
            nn.ReLU()


def test_meta_parameter_left_at_init_exit():
    with pytest.raises(EngineError, match="module 'Linear' has parameter 'weight' on the meta device"):
        with infinity.Init({}):
            nn.Linear(4, 4, device="meta")


@pytest.mark.parametrize("second", ["AdamW", "Adam"])
def test_second_optimizer_over_one_model(second):
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    infinity.AdamW(model)
    with pytest.raises(EngineError, match=rf"infinity\.{second}: this model already has an infinity optimizer"):
        getattr(infinity, second)(model)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), r"infinity\.AdamW: lr must be >= 0, got -1\.0"),
    (dict(betas=(0.9, 1.0)), r"infinity\.AdamW: betas must be in \[0, 1\), got \(0\.9, 1\.0\)"),
    (dict(eps=0.0), r"infinity\.AdamW: eps must be > 0, got 0\.0"),
])
def test_bad_optimizer_hyperparameters(kwargs, message):
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=message):
        infinity.AdamW(model, **kwargs)
    infinity.AdamW(model)   # the refused optimizer did not claim the model


def test_optimizer_given_parameters_of_a_model_built_outside_init():
    plain = nn.Linear(4, 4)
    with pytest.raises(NotManagedError, match=r"infinity.AdamW: a parameter of shape \(4, 4\) in param group 0 is "
                                              "not managed by infinity"):
        infinity.AdamW(plain.parameters())
    with pytest.raises(NotManagedError, match="infinity.Adam: Linear was not built inside infinity.Init"):
        infinity.Adam(plain)


@pytest.mark.parametrize("add, name", [
    (lambda m: m.register_parameter("extra", nn.Parameter(torch.ones(4))), "extra"),
    (lambda m: m.add_module("adapter", nn.Linear(4, 4)), "adapter.weight"),
], ids=["parameter", "module"])
def test_parameter_added_after_init_is_stepped_by_torch_adamw(add, name):
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    add(model)
    # Trained as torch trains it, beside the engine ([Note: unmanaged parameters] in infinity/optim/unmanaged.py).
    added = dict(model.named_parameters())[name]
    copy = nn.Parameter(added.detach().clone())
    opt, reference = infinity.AdamW(model, lr=0.1), torch.optim.AdamW([copy], lr=0.1)
    assert any(p is added for p in opt.unmanaged.params)
    model(torch.randn(2, 4)).sum().backward()
    added.grad = torch.ones_like(added)
    copy.grad = torch.ones_like(copy)
    opt.step()
    reference.step()
    assert torch.equal(added, copy)
    opt.zero_grad()
    assert added.grad is None


def test_a_large_layer_added_after_init_is_trained_with_a_warning_that_it_is_not_offloaded(monkeypatch):
    """Parameters added after the block stay whole on the compute device with their Adam states: an adapter's
    few elements are what that is for, an embedding resized after the block is not, so past a size it says so."""
    from infinity.optim import unmanaged

    monkeypatch.setattr(unmanaged, "WARN_NUMEL", 100)
    with infinity.Init({}):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.add_module("small", nn.Linear(4, 4))      # 20 elements: quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = infinity.AdamW(model)
    model.add_module("resized", nn.Linear(4, 30))   # 150 more: past the size
    with pytest.warns(RuntimeWarning, match=r"170 elements of parameters added after infinity.Init exited \(the "
                                            r"largest of shape \(30, 4\)\) are trained whole on the compute device"):
        opt.add_param_group({"params": list(model.resized.parameters())})


def test_fp16_gradients_of_parameters_added_after_init_read_unscaled_as_the_engines_do():
    """In fp16 the engine's gradients read unscaled through ``.grad``; an adapter's stayed scaled until the step,
    so torch's clip_grad_norm_ over model.parameters() (the Trainer's) saw a norm ~1000x too large and cut every
    step to nothing. Now each adapter gradient is divided by the loss scale as it arrives."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.b(h + self.lora(h)).float().pow(2).mean()

    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(1)
    ref.lora = nn.Linear(8, 8)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                        "precision": {"dtype": "float16", "initial_scale": 1024}}):
        model = Net()
    torch.manual_seed(1)
    model.lora = nn.Linear(8, 8).half()
    infinity.AdamW(model, lr=1e-2)
    x = torch.randn(4, 8)
    model(x.half()).backward()
    ref(x).backward()
    assert torch.allclose(model.lora.weight.grad.float(), ref.lora.weight.grad, rtol=2e-2, atol=1e-3)
    total, want = (float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)) for m in (model, ref))
    assert abs(total - want) <= 2e-2 * want, (total, want)
    infinity.release(model)


def test_step_with_closure():
    with infinity.Init({}):
        model = _TwoLayers()
    opt = infinity.AdamW(model)
    model(torch.randn(2, 4)).backward()
    with pytest.raises(EngineError, match="infinity.AdamW.step: closures are not supported with offloaded states"):
        opt.step(lambda: 0.0)


def test_step_during_backward():
    with infinity.Init({}):
        model = _TwoLayers()
    opt = infinity.AdamW(model)
    loss = model(torch.randn(2, 4), hook=lambda grad: opt.step())   # runs when h's gradient is computed
    with pytest.raises(EngineError, match=r"infinity\.AdamW\.step\(\) called while a backward pass is still running"):
        loss.backward()
    # The refused step cut the backward short; the model trains on afterwards, as plain PyTorch would.
    opt.zero_grad()
    torch.manual_seed(0)
    ref = _TwoLayers()
    with infinity.gathered(model):
        ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters())
    x = torch.randn(2, 4)
    _, param_diffs = train_side_by_side(model, opt, ref, ref_opt, [(x, None)] * 3)
    assert all(d <= 1e-6 for d in param_diffs.values()), param_diffs


def test_clip_grad_norm_before_the_optimizer_exists():
    with infinity.Init({}):
        model = _TwoLayers()
    model(torch.randn(2, 4)).backward()
    with pytest.raises(EngineError, match="infinity.clip_grad_norm_: create the infinity optimizer for this "
                                          "model first"):
        infinity.clip_grad_norm_(model, 1.0)


@pytest.mark.parametrize("other, message", [
    # One group more: the counts differ.
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
     r"the state was saved with world size 1 and 1 groups; this model has world size 1 and 2 groups"),
    # As many groups, a wider one: 3001 elements pad to two 2048-element blocks, 20 to one.
    (lambda: nn.Linear(3000, 1),
     r"the state was saved with world size 1 and 1 groups; this model has world size 1 and 1 groups; "
     r"group 0 \('Linear'\) has 4096 elements per shard here, 2048 in the state"),
], ids=["more-groups", "wider-group"])
def test_optimizer_state_of_another_model(other, message):
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    state = infinity.AdamW(model).state_dict()
    with infinity.Init({}):
        different = other()
    with pytest.raises(EngineError, match=r"infinity\.AdamW\.load_state_dict: " + message):
        infinity.AdamW(different).load_state_dict(state)


@pytest.mark.skipif(__import__("os").path.lexists("/local_nvme"), reason="this machine has a /local_nvme")
def test_the_presets_placeholder_path_is_named_as_one_with_the_ways_to_give_a_directory():
    """It said "'/local_nvme' does not exist ...; create it first", which invites mkdir /local_nvme."""
    with pytest.raises(ConfigError) as info:
        with infinity.Init("nvme"):
            nn.Linear(4, 4)
    message = str(info.value)
    assert message.startswith("tiers.nvme_path: '/local_nvme' is the nvme preset's placeholder, not a directory")
    assert 'infinity.Init("nvme", nvme_path=DIR)' in message and "--set tiers.nvme_path=DIR" in message
    assert "create it" not in message


def test_init_takes_the_nvme_directory_beside_the_preset(tmp_path):
    with infinity.Init("nvme", nvme_path=tmp_path) as init:
        model = nn.Linear(4, 4)
    assert init.config.tiers.nvme_path == (str(tmp_path),)
    assert any((tmp_path / "rank0").iterdir())       # the swap files are there
    infinity.release(model)


def test_nvme_path_that_is_a_file_is_refused_when_the_config_is_loaded(tmp_path):
    afile = tmp_path / "swap-here"
    afile.write_text("")
    conf = tmp_path / "offload.toml"
    conf.write_text(f'[tiers]\nparams = "nvme"\nnvme_path = "{afile}"\n')
    with pytest.raises(ConfigError, match=f"^{conf}: tiers.nvme_path: '{afile}' is a file, not a directory"):
        infinity.load_config(conf)


def test_nvme_path_on_a_filesystem_without_o_direct_says_so_at_init(tmp_path, monkeypatch):
    import errno
    import os as _os
    from infinity.config import paths

    real_open = _os.open

    def no_direct(path, flags, *args):
        if flags & _os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(paths.os, "open", no_direct)
    with pytest.raises(ConfigError, match=r"tiers.nvme_path: .* refuses O_DIRECT.*aio.direct = false.*\(rank 0\)"):
        with infinity.Init(_nvme_cfg(tmp_path)):
            nn.Linear(4, 4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".infinity-probe")]


def test_nvme_path_on_a_read_only_file_system_says_so_not_that_the_user_cannot_write(tmp_path, monkeypatch):
    """A read-only mount was called "a directory this user cannot write to", which sends one to chmod."""
    import os as _os
    from types import SimpleNamespace
    from infinity.config import paths

    real_statvfs = _os.statvfs
    monkeypatch.setattr(paths.os, "access", lambda path, mode: False if str(path) == str(tmp_path) else True)
    monkeypatch.setattr(paths.os, "statvfs", lambda path: SimpleNamespace(f_flag=_os.ST_RDONLY)
                        if str(path) == str(tmp_path) else real_statvfs(path))
    with pytest.raises(ConfigError, match=rf"tiers.nvme_path: '{tmp_path}' is on a read-only file system "
                                          r"\(mounted read-only: no user can write there\)"):
        with infinity.Init(_nvme_cfg(tmp_path)):
            nn.Linear(4, 4)


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes to any directory")
def test_nvme_path_not_writable_is_named(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="ro' is a directory this user .* cannot write to"):
        with infinity.Init(_nvme_cfg(locked)):
            nn.Linear(4, 4)


def test_a_shape_changed_inside_gathered_is_refused_naming_the_parameter_and_keeps_the_rest():
    """``p.data = <new shape>`` or a module swapped (``resize_token_embeddings``) inside ``gathered``
    crashed in the write-back ("size of tensor a must match") and left groups in use."""
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(EngineError,
                       match=r"'0.weight' \(8, 8\) -> \(9, 8\).*new shapes inside the infinity.Init block"):
        with infinity.gathered(model):
            model[0].weight.data = torch.zeros(9, 8)
            model[1].bias.data.fill_(3.0)               # stored all the same
    with infinity.gathered(model):
        assert model[0].weight.shape == (8, 8) and torch.equal(model[1].bias, torch.full((2,), 3.0))
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()           # trains on
    opt.step()
    with pytest.raises(EngineError, match=r"parameters infinity does not manage .*\['1.weight', '1.bias'\]"):
        with infinity.gathered(model):
            model[1] = nn.Linear(8, 3)


def test_a_dtype_changed_inside_gathered_is_refused_and_the_fp32_values_are_kept():
    """``model.half()`` / ``model.to(torch.bfloat16)`` inside ``gathered`` (to export in that dtype) wrote the
    rounded values back as edits: the fp32 masters silently lost their low bits."""
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with infinity.gathered(model):
        before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(EngineError, match=r"'0.weight' torch.float32 -> torch.bfloat16.*to export in another dtype"):
        with infinity.gathered(model):
            model.to(torch.bfloat16)
    with infinity.gathered(model):
        assert all(p.dtype == torch.float32 and torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()           # trains on
    opt.step()


def test_pin_memory_always_without_cuda_is_refused_naming_the_key():
    """It was silently "never" whenever the compute device was the CPU."""
    if torch.cuda.is_available():
        pytest.skip("pinning is possible here")
    with pytest.raises(ConfigError, match=r'tiers.pin_memory: "always" needs CUDA'):
        with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu",
                                      "pin_memory": "always"}}):
            nn.Linear(4, 4)


@pytest.mark.parametrize("call, says", [
    (lambda m, x: torch.nn.utils.parametrizations.weight_norm(m[0]),
     r"'0\.weight': a parametrization .*weight_norm's g and v.*Compute the weight in the module's forward"),
    (lambda m, x: torch.nn.utils.prune.l1_unstructured(m[0], "weight", amount=0.5),
     r"'0\.weight': torch\.nn\.utils\.prune: .*Compute the weight in the module's forward"),
    (lambda m, x: torch.autograd.grad(m(x).sum(), list(m.parameters())),
     r"torch\.autograd\.grad with respect to parameters infinity manages.*loss\.backward\(\)"),
    (lambda m, x: m.share_memory(), r"'0\.weight': share_memory .*one rank per process"),
])
def test_torch_tools_that_need_whole_parameters_say_why_they_cannot_have_them(call, says):
    """They failed with the general "it is released ... read it inside infinity.gathered", which would not
    have helped: these need the parameter to stay a whole tensor of their own (or its gradient whole)."""
    import torch.nn.utils.prune  # noqa: F401
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(EngineError, match=says):
        call(model, torch.randn(3, 8))
    infinity.release(model)


def test_a_parametrization_that_reads_nothing_as_it_is_registered_trains_as_plain_torch():
    """The refusal above is for tools that read the values; a parametrization whose registration computes
    nothing from them keeps the managed parameter as its ``original``, gathered with the module."""
    def run(engine: bool) -> list[float]:
        torch.manual_seed(0)
        if engine:
            with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                                "precision": {"dtype": "float32"}}):
                model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        else:
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Identity())
        opt = infinity.AdamW(model, lr=1e-2) if engine else torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for i in range(3):
            loss = model(torch.randn(3, 8, generator=torch.Generator().manual_seed(i))).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if engine:
            infinity.release(model)
        return losses

    assert run(True) == pytest.approx(run(False), rel=1e-6)


def _one_step_matches_plain(model, opt, plain, plain_opt) -> None:
    data = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    for net, o in ((model, opt), (plain, plain_opt)):
        net(data).sum().backward()
        o.step()
        o.zero_grad()
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def _small(engine: bool, units: tuple = ()):
    """``units=("Sequential",)``: the whole model one group, its parameters named by their path in it."""
    torch.manual_seed(0)
    if not engine:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                        "precision": {"dtype": "float32"}, "partition": {"units": list(units)}}):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("differentiate", [
    lambda m, x: m(x).pow(2).sum().backward(create_graph=True),
    lambda m, x: torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)[0].pow(2).sum().backward(),
    lambda m, x: torch.func.grad(lambda z: m(z).sum())(x.detach()),
    lambda m, x: torch.autograd.functional.hessian(lambda z: m(z).pow(2).sum(), x[:1].detach()),
], ids=["create_graph", "gradient penalty", "torch.func.grad", "hessian"])
def test_double_backward_is_refused_before_anything_is_taken_and_training_goes_on_as_plain(differentiate):
    """create_graph=True failed deep in the gradient path ("A view was created in no_grad mode", "setStorage
    ... out of bounds") and left a gradient behind: the next ordinary step moved the weights 2*lr off plain
    torch; torch.func.grad broke every later forward ("Cannot access data pointer")."""
    model, plain = _small(True), _small(False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(EngineError, match=r"create_graph=True or a torch\.func transform that differentiates"):
        differentiate(model, x)
    opt.zero_grad()
    _one_step_matches_plain(model, opt, plain, plain_opt)
    assert torch.func.vmap(model)(torch.randn(2, 3, 8)).shape == (2, 3, 4)     # vmap differentiates nothing
    infinity.release(model)


def test_grad_scaler_is_refused_naming_infinitys_loss_scaling():
    model = _small(True)
    opt = infinity.AdamW(model, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(5, 8)).sum()).backward()
    with pytest.raises(EngineError, match=r"GradScaler.*\[precision\] loss_scale"):
        scaler.unscale_(opt)
    infinity.release(model)


@pytest.mark.parametrize("tool", [
    lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.5),
    lambda m: torch.nn.utils.prune.random_unstructured(m, "weight", amount=0.5),
    lambda m: torch.nn.utils.prune.identity(m, "weight"),
    lambda m: torch.nn.utils.weight_norm(m),
    lambda m: torch.nn.utils.spectral_norm(m),
    lambda m: torch.nn.utils.parametrizations.weight_norm(m),
], ids=["prune.l1_unstructured", "prune.random_unstructured", "prune.identity", "weight_norm (old)",
        "spectral_norm (old)", "parametrizations.weight_norm"])
@pytest.mark.parametrize("units", [(), ("Sequential",)], ids=["a group per layer", "one unit"])
def test_a_refused_reparametrization_leaves_the_module_as_it_was(tool, units):
    """prune moves the weight to ``weight_orig`` and the old weight_norm deletes it before their first read of
    its values, which is refused: the Linear was left without a ``weight`` and every later forward failed
    ("'Linear' object has no attribute 'weight'")."""
    import torch.nn.utils.prune  # noqa: F401
    model, plain = _small(True, units), _small(False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    weight, keys = model[0].weight, list(plain.state_dict())
    with pytest.raises(EngineError, match=r"'0\.weight': .*Compute the weight in the module's forward"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)     # the old weight_norm's deprecation
            tool(model[0])
    assert model[0].weight is weight and [n for n, _ in model.named_parameters()] == keys
    assert not list(model[0].buffers())     # no mask: the step below shows no hook applies one either
    _one_step_matches_plain(model, opt, plain, plain_opt)
    with infinity.gathered(model):
        assert list(model.state_dict()) == keys
    infinity.release(model)


def test_a_registered_parametrization_read_outside_gathered_says_it_is_released():
    """Reads through a parametrization that is in place are ordinary reads (the weight is gathered with its
    module); only registering one that computes from the values gets the parametrization's reason."""
    model = _small(True)
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Identity(), unsafe=True)
    with pytest.raises(EngineError, match=r"'0\.weight': it is released .*infinity\.gathered"):
        model[0].weight.sum()
    with infinity.gathered(model):
        assert model[0].weight.shape == (16, 8)
    infinity.release(model)


@pytest.mark.parametrize("inside_gathered", [False, True], ids=["released", "gathered"])
@pytest.mark.parametrize("compile_", [
    lambda m, x: torch.jit.script(m),
    lambda m, x: torch.jit.trace(m, (x,)),
], ids=["jit.script", "jit.trace"])
def test_torchscript_is_refused_naming_the_way_to_export(compile_, inside_gathered):
    """torch.jit.script failed with "'_EngineHook' object has no attribute '__name__'", torch.jit.trace with a
    TorchScript internal assert (released) or a failed sanity check (gathered); a scripted copy made inside
    gathered would hold parameters released at its exit."""
    model, plain = _small(True), _small(False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with pytest.raises(EngineError, match=r"torch\.jit\.script and torch\.jit\.trace .*infinity\.state_dict\(model\) "
                                          r"into the same model built outside infinity\.Init"):
        if inside_gathered:
            with infinity.gathered(model):
                compile_(model, torch.randn(5, 8))
        else:
            compile_(model, torch.randn(5, 8))
    _one_step_matches_plain(model, opt, plain, plain_opt)
    infinity.release(model)


@pytest.mark.parametrize("register", [
    lambda m, reads: m[0].register_full_backward_hook(lambda mod, gi, go: reads(mod)),
    lambda m, reads: m[2].register_full_backward_pre_hook(lambda mod, go: reads(mod)),
], ids=["full_backward_hook", "full_backward_pre_hook"])
def test_a_backward_hook_reading_weights_says_when_they_can_be_read(register):
    """It got the message for a read outside any pass ("read or change it inside infinity.gathered"), which a
    hook cannot do; a failed backward then leaves nothing behind once the gradients are cleared."""
    model, plain = _small(True), _small(False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    handle = register(model, lambda mod: mod.weight.norm())
    with pytest.raises(EngineError, match=r"'\d\.weight': it is released during backward .*read the gradient "
                                          r"there .*the values in a forward hook"):
        model(torch.randn(5, 8)).sum().backward()
    handle.remove()
    opt.zero_grad()
    _one_step_matches_plain(model, opt, plain, plain_opt)
    infinity.release(model)


class _Table(nn.Module):
    """Parameter-free, with float buffers not exact in float16: a positional-encoding table built first."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("table", torch.arange(width, dtype=torch.float32) / 3 + 1e-4)
        self.register_buffer("steps", torch.arange(3))
        self.register_buffer("cache", torch.full((2,), 0.1), persistent=False)

    def forward(self, x):
        return x + self.table


def _tabled(engine: bool):
    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Sequential(_Table(8), nn.Identity()), nn.Linear(8, 4), _Table(4))  # noqa: E731
    if not engine:
        return build()
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                        "precision": {"dtype": "float32"}}):
        return build()


@pytest.mark.parametrize("convert", [
    lambda m: m.half(), lambda m: m.double(), lambda m: m.bfloat16(), lambda m: m.to(torch.float16),
    lambda m: m.to("meta"), lambda m: m.type(torch.float64)], ids=["half", "double", "bfloat16", "to(float16)",
                                                                   "to(meta)", "type(float64)"])
def test_a_refused_conversion_leaves_the_buffers_converted_before_it_as_they_were(convert):
    """``Module._apply`` converts children first: the parameter-free table built before the first
    parameter was rounded to float16 (or moved to meta) when ``0.weight`` refused."""
    model, plain = _tabled(True), _tabled(False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    kept = {name: buf for name, buf in model.named_buffers()}
    with pytest.raises(EngineError, match=r"'1\.weight': infinity keeps this model's parameters as shards.*"
                                          r"the config's precision\.dtype and tiers\.device"):
        convert(model)
    assert {name: buf for name, buf in model.named_buffers()} == kept     # the very tensors, by identity
    for (name, buf), (_, want) in zip(model.named_buffers(), plain.named_buffers()):
        assert buf.dtype == want.dtype and torch.equal(buf, want), name
    _one_step_matches_plain(model, opt, plain, plain_opt)
    with infinity.gathered(model):
        assert list(model.state_dict()) == list(plain.state_dict())     # the cache still not persistent
    infinity.release(model)


def test_a_refused_conversion_says_what_infinity_does_and_the_config_key_that_does_it():
    """It said the conversion "would change nothing", as if it were harmless, and named no key to set."""
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = nn.Linear(4, 3)
    with pytest.raises(EngineError) as info:
        model.to(torch.bfloat16)
    said = str(info.value)
    assert said.startswith("Tensor.to on parameter 'weight': infinity keeps this model's parameters as shards in its "
                           "tiers, computed in float32 on cpu (the config's precision.dtype and tiers.device), with "
                           "fp32 master weights and Adam states beside them, so converting the model cannot convert "
                           'them: to compute in bfloat16, build the model under infinity.Init with precision.dtype = '
                           '"bfloat16" in its config; for converted copies of the values, convert '
                           "infinity.state_dict(model)"), said
    assert "change nothing" not in said
    with pytest.raises(EngineError, match=r"infinity computes in float32, bfloat16, float16 \(precision\.dtype\), "
                                          r"not float64; infinity computes on cpu or cuda \(tiers\.device\), not meta"):
        model.to("meta", torch.float64)
    infinity.release(model)


def test_init_says_when_accumulating_micro_batches_will_not_fit_the_disk(tmp_path, monkeypatch):
    """bf16 gradients are stored in 2 bytes until a step has two micro-batches, then in fp32 for good; Init
    counted the 2 bytes only, and the run died at the first accumulating step. With the least disk Init
    accepts, it now warns that accumulation will not fit, naming the bytes."""
    usage = namedtuple("usage", "total used free")
    free = [0]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - free[0], free[0]))
    cfg = dict(_nvme_cfg(tmp_path), precision={"dtype": "bfloat16"})

    def fits(nbytes):
        free[0] = nbytes
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with infinity.Init(cfg):
                    model = nn.Linear(256, 256)
        except BudgetError:
            return False
        infinity.release(model)
        return True

    lo, hi = 4096, 1 << 26      # lo does not fit, hi does
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    free[0] = hi
    with pytest.warns(RuntimeWarning, match=r"(?s)accumulating micro-batches moves the gradient keys \(nvme\) from "
                                            r"bfloat16 to fp32.*\+132\.0 KiB\)"):
        with infinity.Init(cfg):
            model = nn.Linear(256, 256)
    infinity.release(model)


def test_the_nvme_io_pool_made_at_its_first_loan_is_in_the_host_budget(tmp_path):
    """The NVMe I/O pool is made when an unaligned transfer first needs it, possibly mid-step: the budget check
    at construction counts it as still to come (it was left out once the pool became lazy, so 512 MiB per rank
    went unchecked)."""
    cfg = _nvme_cfg(tmp_path)
    cfg["tiers"].update(pool_buffer_size="64MiB", pool_buffers=8, host_budget="256MiB")
    with pytest.raises(BudgetError, match=r"(?s)NVMe I/O .*pool.*host_budget"):
        with infinity.Init(cfg):
            nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
