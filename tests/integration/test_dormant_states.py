"""Groups frozen at ``infinity.Init``'s exit hold master weights only, until they train.

Adapters or a head trained on a frozen base used to cost the base 16 bytes per parameter in the
optimizer tier (master, m, v, gradient: 12 of them never used). Their sub-groups are now dormant
([Note: dormant sub-groups] in infinity/optim/flat_state.py): no moment or gradient keys until a
gradient arrives (the group was unfrozen) or a load brings them nonzero moments. Training and
checkpoints stay exact whichever way the frozen sets of the saving and the resuming run differ.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import infinity
import infinity.optim.moments
from infinity.checkpoint import CheckpointMismatchError

WIDTH, LAYERS = 96, 4
# Each linear layer is one group: 96 x 96 + 96 elements, a shard of 10240 (a multiple of 2048).
SHARD = 10240


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x).float().pow(2).mean()


def _config(nvme, optimizer="nvme", state_dtype="fp32", dtype="float32", params=None, **sections):
    params = params or ("nvme" if optimizer == "nvme" else "host")
    return {"tiers": {"params": params, "optimizer": optimizer,
                      "nvme_path": str(nvme), "device": "cpu", "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "precision": {"dtype": dtype}, "optimizer": {"state_dtype": state_dtype},
            "partition": {"sub_group_size": 4096}, "aio": {"engine": "threads"},
            "checkpoint": {"buffer_size": "1MiB"}, **sections}


def _build(cfg, frozen: int = 2, resume=None):
    """The stack with its first ``frozen`` layers frozen inside ``infinity.Init``, and its optimizer."""
    torch.manual_seed(0)
    with infinity.Init(cfg, resume=resume):
        model = Stack()
        model.layers[:frozen].requires_grad_(False)
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)


def _plain(frozen: int = 2):
    torch.manual_seed(0)
    model = Stack()
    model.layers[:frozen].requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, i: int) -> float:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    loss = model(x.to(model.layers[0].weight.dtype))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _held(model, tier: str) -> int:
    return infinity.stats(model)["tiers"][tier]["bytes_in_use"]


def _run(model, opt, steps, unfreeze_at=None) -> list[float]:
    losses = []
    for i in steps:
        if i == unfreeze_at:
            model.requires_grad_(True)
        losses.append(_step(model, opt, i))
    return losses


@pytest.mark.parametrize("params, optimizer, dtype, saved", [
    (None, "host", "float32", 4 + 4 + 4),     # m, v, an fp32 gradient
    (None, "nvme", "float32", 4 + 4 + 4),
    (None, "host", "bfloat16", 2 + 4 + 4 + 2),    # half the master (split while dormant), m, v, a bf16 gradient
    (None, "nvme", "bfloat16", 4 + 4 + 2),        # the masters are split anyway
    ("device", "host", "bfloat16", 2 + 4 + 4 + 2),    # offload-optimizer: the copies on the device
    ("device", "nvme", "bfloat16", 2 + 4 + 4 + 2),
])
def test_frozen_groups_hold_no_moments_or_gradients_until_unfrozen(tmp_path, params, optimizer, dtype, saved):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole, whole_opt = _build(_config(tmp_path / "a", optimizer, dtype=dtype, params=params), frozen=0)
    _step(whole, whole_opt, 0)
    model, opt = _build(_config(tmp_path / "b", optimizer, dtype=dtype, params=params))
    plain, plain_opt = _plain()
    got, want = _step(model, opt, 0), _step(plain, plain_opt, 0)
    if dtype == "float32":
        assert got == pytest.approx(want, rel=1e-6)
    # bytes per element of the two frozen layers' shards
    assert _held(whole, optimizer) - _held(model, optimizer) == saved * 2 * SHARD
    for net in (model, plain):
        net.requires_grad_(True)
    for i in (1, 2, 3):
        got, want = _step(model, opt, i), _step(plain, plain_opt, i)
        if dtype == "float32":
            assert got == pytest.approx(want, rel=1e-5), i
    assert _held(model, optimizer) == _held(whole, optimizer)
    infinity.release(model)
    infinity.release(whole)


@pytest.mark.parametrize("params, optimizer, state_dtype, dtype", [
    (None, "nvme", "fp32", "float32"), (None, "nvme", "int8", "float32"), (None, "host", "fp32", "float32"),
    (None, "host", "fp32", "bfloat16"), ("device", "host", "fp32", "bfloat16")])
def test_checkpoints_are_exact_across_runs_that_froze_different_groups(tmp_path, params, optimizer, state_dtype,
                                                                       dtype):
    """A run that unfroze its base saves moments a model built with the base frozen takes (it wakes);
    a run that never did saves zeros, which a model built with the base trainable takes and a model
    built with it frozen leaves dormant (in bf16 with its masters split meanwhile)."""
    cfg = lambda name: _config(tmp_path / name, optimizer, state_dtype, dtype, params)  # noqa: E731
    # int8 moments are encoded again on load: each block's scale within a rounding of the saved one
    # ([Note: moments in checkpoints] in infinity/checkpoint/moments.py).
    same = (lambda got, want: got == want) if state_dtype == "fp32" else (  # noqa: E731
        lambda got, want: got == pytest.approx(want, rel=1e-5))
    for name in ("ref", "a", "b", "c", "d", "e"):
        (tmp_path / name).mkdir()
    model, opt = _build(cfg("ref"))
    reference = _run(model, opt, range(6), unfreeze_at=2)
    infinity.release(model)

    model, opt = _build(cfg("a"))
    assert _run(model, opt, range(4), unfreeze_at=2) == reference[:4]
    woken = _held(model, optimizer)
    infinity.save_checkpoint(tmp_path / "woken", model, opt)
    infinity.release(model)
    model, opt = _build(cfg("b"))       # the base dormant: the load wakes it
    infinity.load_checkpoint(tmp_path / "woken", model, opt)
    assert _held(model, optimizer) == woken
    assert same(_run(model, opt, (4, 5), unfreeze_at=4), reference[4:])
    infinity.release(model)

    model, opt = _build(cfg("c"))
    assert _run(model, opt, range(2)) == reference[:2]
    dormant = _held(model, optimizer)
    infinity.save_checkpoint(tmp_path / "frozen", model, opt)
    infinity.release(model)
    model, opt = _build(cfg("d"), frozen=0)      # built trainable: takes the zeros
    infinity.load_checkpoint(tmp_path / "frozen", model, opt)
    assert same(_run(model, opt, range(2, 6)), reference[2:])
    infinity.release(model)
    model, opt = _build(cfg("e"))       # built frozen: stays dormant until unfrozen
    infinity.load_checkpoint(tmp_path / "frozen", model, opt)
    assert _held(model, optimizer) == dormant
    assert same(_run(model, opt, range(2, 6), unfreeze_at=2), reference[2:])
    infinity.release(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])     # bf16: split masters, the base's remainders too
def test_a_checkpoint_in_place_adopts_the_states_of_groups_unfrozen_after_init(tmp_path, dtype):
    for name in ("ref", "nvme"):
        (tmp_path / name).mkdir()
    model, opt = _build(_config(tmp_path / "ref", dtype=dtype))
    reference = _run(model, opt, range(5), unfreeze_at=2)
    infinity.release(model)

    cfg = _config(tmp_path / "nvme", dtype=dtype)
    model, opt = _build(cfg)
    assert _run(model, opt, range(3), unfreeze_at=2) == reference[:3]
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    model, opt = _build(cfg, resume=tmp_path / "ckpt")      # built frozen: the saved moments wake the base
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert _run(model, opt, (3, 4), unfreeze_at=3) == reference[3:]
    infinity.release(model)


def test_resuming_in_place_with_groups_trainable_that_the_save_kept_frozen_is_refused_naming_why(tmp_path):
    cfg = _config(tmp_path)
    model, opt = _build(cfg)
    _run(model, opt, range(2))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    with pytest.raises(CheckpointMismatchError, match="exp_avg:.*frozen, and never unfrozen, in the saving run"):
        _build(cfg, frozen=0, resume=tmp_path / "ckpt")


def test_delayed_updates_with_the_first_group_frozen(tmp_path, monkeypatch):
    """The first sub-group dormant: DPU's background steps run beside the next backward, as without it
    (the check that a backward does not write the gradient keys a running step reads compared the first
    sub-group's keys: None and None)."""
    def slow(kernel):
        def run(*args, **kwargs):
            time.sleep(0.05)    # the background step still runs when the next backward starts
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "_fused_adamw_", slow(torch._fused_adamw_))
    monkeypatch.setattr(infinity.optim.moments, "fused_fp32_step", slow(infinity.optim.moments.fused_fp32_step))
    cfg = _config(tmp_path, "host", dpu={"enabled": True, "warmup_steps": 1})
    model, opt = _build(cfg, frozen=1)
    losses = _run(model, opt, range(5))
    opt.synchronize()
    assert opt.stats()["delayed_steps"] >= 3
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == len(losses)
    infinity.release(model)


@pytest.mark.parametrize("params, optimizer", [(None, "host"), (None, "nvme"), ("device", "host")])
def test_a_dormant_base_trains_bit_for_bit_as_one_frozen_after_init(tmp_path, params, optimizer):
    """bf16, gradients accumulated over two micro-batches (the gradient keys widen to fp32 while the base
    is dormant), then the base unfrozen: the same losses as a base that had its states all along."""
    def build(name, dormant):
        cfg = _config(tmp_path / name, optimizer, params=params, precision={"dtype": "bfloat16"})
        (tmp_path / name).mkdir()
        model, opt = _build(cfg, frozen=2 if dormant else 0)
        if not dormant:
            model.layers[:2].requires_grad_(False)
        return model, opt

    runs = [build("dormant", True), build("awake", False)]
    losses = []
    for model, opt in runs:
        out = []
        for i in range(5):
            if i == 2:
                model.requires_grad_(True)
            for micro in range(2):
                x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + micro))
                loss = model(x.bfloat16())
                loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses.append(out)
        infinity.release(model)
    assert losses[0] == losses[1]


def test_unfreezing_past_the_host_budget_raises_naming_why_and_loses_nothing(tmp_path):
    """The frozen base's moments were not counted when the model was built: a host budget that fits the
    model as built refuses them at the first gradient after unfreezing, says why, and keeps the model
    as it was (frozen again, it trains on)."""
    probe, probe_opt = _build(_config(tmp_path, "host"))
    _step(probe, probe_opt, 0)
    held = _held(probe, "host")
    infinity.release(probe)
    model, opt = _build(_config(tmp_path, "host", tiers={"params": "host", "optimizer": "host",
                                                          "device": "cpu", "host_budget": held + 4096}))
    _step(model, opt, 0)
    model.requires_grad_(True)
    with pytest.raises(Exception, match="would hold") as raised:
        _step(model, opt, 1)
    assert any("frozen when infinity.Init exited" in note for note in getattr(raised.value, "__notes__", []))
    assert _held(model, "host") == held
    opt.zero_grad()
    model.layers[:2].requires_grad_(False)
    plain, plain_opt = _plain()
    _step(plain, plain_opt, 0)
    assert _step(model, opt, 2) == pytest.approx(_step(plain, plain_opt, 2), rel=1e-5)
    infinity.release(model)


def test_a_base_woken_while_the_update_during_backward_runs_trains_as_one_awake(tmp_path, monkeypatch):
    """States on NVMe, bf16 copies in host memory (the base's masters rest split), the update during
    backward: the first step's update streams every sub-group not dormant on a worker thread while the
    main thread wakes the base. A sub-group leaves ``dormant`` only once its keys are whole (it used to
    leave first: the worker read a master key of None). Delays widen the window."""
    import infinity.optim.split_master
    import infinity.optim.update

    def slow(fn, seconds, times=None):
        calls = []

        def run(*args, **kwargs):
            calls.append(None)
            if times is None or len(calls) <= times:
                time.sleep(seconds)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(infinity.optim.split_master.SplitMasters, "read_sub",
                        slow(infinity.optim.split_master.SplitMasters.read_sub, 0.5, times=1))
    monkeypatch.setattr(infinity.optim.update.UpdatePass, "run", slow(infinity.optim.update.UpdatePass.run, 0.03))

    def run(name: str, dormant: bool) -> list[float]:
        (tmp_path / name).mkdir()
        cfg = _config(tmp_path / name, "nvme", dtype="bfloat16")
        cfg["tiers"]["params"] = "host"
        cfg["optimizer"]["update_in_backward"] = True
        model, opt = _build(cfg, frozen=2 if dormant else 0)
        if not dormant:
            model.layers[:2].requires_grad_(False)
        model.requires_grad_(True)
        losses = _run(model, opt, range(2))
        infinity.release(model)
        return losses

    assert run("dormant", True) == run("awake", False)


@pytest.mark.parametrize("optimizer, dtype", [("host", "float32"), ("host", "bfloat16"), ("nvme", "float32")])
def test_an_optimizer_state_dict_round_trip_leaves_a_frozen_base_dormant(tmp_path, optimizer, dtype):
    """``opt.load_state_dict`` of a saved state writes the base's moments: zeros, which it holds already."""
    model, opt = _build(_config(tmp_path, optimizer, dtype=dtype))
    _step(model, opt, 0)
    held = _held(model, optimizer)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert _held(model, optimizer) == held
    infinity.release(model)


def test_a_dpu_spare_key_that_does_not_fit_leaves_the_base_dormant(tmp_path):
    """With DPU a woken sub-group also gets a second gradient key: when only the store's keys fit the
    budget, neither is kept (the spare set used to keep None for an awake sub-group: a crash later)."""
    def build(budget=None):
        cfg = _config(tmp_path, "host", dpu={"enabled": True, "warmup_steps": 1})
        if budget is not None:
            cfg["tiers"]["host_budget"] = budget
        model, opt = _build(cfg)
        return model, opt

    model, opt = build()
    _run(model, opt, range(2))
    opt.synchronize()
    held = _held(model, "host")
    infinity.release(model)
    model, opt = build(held + 3 * 4096 * 12 + 2048)     # layer 1's 3 sub-groups: m, v, an fp32 gradient
    _run(model, opt, range(2))
    opt.synchronize()
    model.layers[1].requires_grad_(True)
    with pytest.raises(Exception, match="grad-next") as raised:
        _step(model, opt, 2)
    assert any("frozen when infinity.Init exited" in note for note in getattr(raised.value, "__notes__", []))
    assert _held(model, "host") == held
    opt.zero_grad()
    model.layers[1].requires_grad_(False)
    assert all(torch.isfinite(torch.tensor(_run(model, opt, range(3, 6)))))
    infinity.release(model)


class Bf16Stack(Stack):
    """``Stack`` whose values are bf16 numbers, as a base loaded from bf16 weights has."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(p.bfloat16().float())


def _build_bf16(cfg, frozen: int = 2):
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Bf16Stack()
        model.layers[:frozen].requires_grad_(False)
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("params, optimizer", [(None, "host"), ("device", "host"), ("host", "nvme"),
                                               ("nvme", "nvme")])     # the last: split masters
def test_a_frozen_base_of_bf16_values_holds_no_remainders_and_trains_bit_for_bit(tmp_path, params, optimizer):
    """[Note: zero remainders] in infinity/optim/split_master.py: the base's masters are its bf16 copies."""
    cfg = lambda name: _config(tmp_path / name, optimizer, dtype="bfloat16", params=params)  # noqa: E731
    for name in ("random", "zero", "after"):
        (tmp_path / name).mkdir()
    random, _ = _build(cfg("random"))
    model, opt = _build_bf16(cfg("zero"))
    assert _held(random, optimizer) - _held(model, optimizer) == 2 * 2 * SHARD     # no remainder keys
    infinity.release(random)
    awake, awake_opt = _build_bf16(cfg("after"), frozen=0)
    awake.layers[:2].requires_grad_(False)
    assert _run(model, opt, range(5), unfreeze_at=2) == _run(awake, awake_opt, range(5), unfreeze_at=2)
    assert _held(model, optimizer) == _held(awake, optimizer)
    infinity.release(model)
    infinity.release(awake)


def test_zero_remainders_through_checkpoints(tmp_path):
    """A save joins the masters from the copies alone; a load of bf16 values keeps the keys away; a load
    of values bf16 cannot hold allocates the remainder keys and keeps them exactly."""
    from infinity.checkpoint.consolidate import consolidate
    cfg = lambda name: _config(tmp_path / name, "host", dtype="bfloat16")  # noqa: E731
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    model, opt = _build_bf16(cfg("a"))
    _run(model, opt, range(2))
    held = _held(model, "host")
    infinity.save_checkpoint(tmp_path / "bf16", model, opt)
    infinity.release(model)
    model, opt = _build(cfg("b"))      # fp32 values: remainders
    _run(model, opt, range(2))
    infinity.save_checkpoint(tmp_path / "fp32", model, opt)
    infinity.release(model)

    model, opt = _build_bf16(cfg("c"))
    infinity.load_checkpoint(tmp_path / "bf16", model, opt)
    assert _held(model, "host") == held
    infinity.load_checkpoint(tmp_path / "fp32", model, opt)
    assert _held(model, "host") - held == 2 * 2 * SHARD        # the frozen layers' remainder keys
    infinity.save_checkpoint(tmp_path / "again", model, opt)
    infinity.release(model)
    for name in ("bf16", "fp32", "again"):
        consolidate(tmp_path / name, tmp_path / f"{name}.pt")
    bf16, fp32, again = (torch.load(tmp_path / f"{name}.pt") for name in ("bf16", "fp32", "again"))
    for name, value in fp32.items():
        assert torch.equal(again[name], value), name
    torch.manual_seed(0)
    for name, value in Bf16Stack().state_dict().items():
        if name.startswith(("layers.0.", "layers.1.")):
            assert torch.equal(bf16[name], value), name      # the frozen bf16 values, bit for bit


@pytest.mark.parametrize("values", ["bf16", "fp32"])
def test_split_masters_of_a_frozen_base_through_a_checkpoint_in_place(tmp_path, values):
    """Parameters and states on NVMe, bf16: a frozen base of bf16 values has no remainder keys, so its
    checkpoint in place has no roles for them; one of fp32 values has both, and the resuming model (whose
    base starts without keys) adopts them."""
    build = _build_bf16 if values == "bf16" else _build
    cfg = _config(tmp_path / "nvme", "nvme", dtype="bfloat16")
    for name in ("ref", "nvme"):
        (tmp_path / name).mkdir()
    model, opt = build(_config(tmp_path / "ref", "nvme", dtype="bfloat16"))
    reference = _run(model, opt, range(5), unfreeze_at=3)
    infinity.release(model)
    model, opt = build(cfg)
    assert _run(model, opt, range(2)) == reference[:2]
    held = _held(model, "nvme")
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    torch.manual_seed(0)
    with infinity.Init(cfg, resume=tmp_path / "ckpt"):
        model = Stack()
        model.layers[:2].requires_grad_(False)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert _held(model, "nvme") == held
    assert _run(model, opt, range(2, 5), unfreeze_at=3) == reference[2:]
    infinity.release(model)


def test_a_wake_that_fails_writing_keeps_nothing(tmp_path):
    """Split masters: waking writes zero remainders into the new keys. A write that failed left the
    moment keys in place, the sub-groups dormant, and the next wake allocated them all again (a leak)."""
    model, opt = _build_bf16(_config(tmp_path, "nvme", dtype="bfloat16"))
    store = opt.engine.store
    subs, held = sorted(store.dormant), _held(model, "nvme")
    real = store.split.io

    class Failing:
        read = staticmethod(real.read)

        @staticmethod
        def write(*args, **kwargs):
            raise OSError("injected write error")

    store.split.io = Failing()
    with pytest.raises(OSError, match="injected") as raised:
        store.wake(subs)
    assert any("nothing kept" in note for note in raised.value.__notes__)
    store.split.io = real
    assert _held(model, "nvme") == held and sorted(store.dormant) == subs
    assert all(store.keys["exp_avg"][sub] is None for sub in subs)
    store.wake(subs)
    numel = sum(store.layout.sub_ranges[sub][1] for sub in subs)
    assert _held(model, "nvme") - held == (4 + 4 + 2 + 2) * numel     # m, v, a bf16 gradient, the remainder
    infinity.release(model)
