"""A base frozen after ``infinity.Init``, before the optimizer is created, costs what one frozen inside it
does: the optimizer builds the flat store again with the frozen groups apart ([Note: frozen after Init]
in infinity/optim/relayout.py), exactly, or keeps it and says why.
"""
from __future__ import annotations

import pytest
import torch

import infinity
from tests.integration.test_dormant_states import SHARD, WIDTH, Stack, _config, _held, _run, _step


def _built(cfg, frozen: int, inside: bool, before_step=None):
    """The stack with its first ``frozen`` layers frozen inside ``infinity.Init`` or just after it."""
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Stack()
        if inside:
            model.layers[:frozen].requires_grad_(False)
    if not inside:
        model.layers[:frozen].requires_grad_(False)
    if before_step is not None:
        before_step(model)
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("params, optimizer, dtype, state_dtype, sections", [
    (None, "host", "float32", "fp32", {}),
    (None, "nvme", "float32", "fp32", {}),
    (None, "host", "bfloat16", "fp32", {}),       # the base's masters rest split
    (None, "nvme", "bfloat16", "fp32", {}),       # masters split anyway
    ("device", "host", "bfloat16", "fp32", {}),   # offload-optimizer: copies on the device
    ("nvme", "host", "bfloat16", "fp32", {}),     # copies on NVMe, masters in host memory
    (None, "nvme", "float32", "int8", {}),
    (None, "host", "float32", "fp32", {"dpu": {"enabled": True, "warmup_steps": 1}}),    # (never unfrozen)
    (None, "nvme", "bfloat16", "fp32", {"optimizer": {"update_in_backward": True}}),
])
def test_a_base_frozen_before_the_optimizer_holds_and_trains_as_one_frozen_inside_init(
        tmp_path, params, optimizer, dtype, state_dtype, sections):
    runs = {}
    for inside in (True, False):
        path = tmp_path / str(inside)
        path.mkdir()
        cfg = _config(path, optimizer, state_dtype, dtype, params)
        for name, keys in sections.items():
            cfg.setdefault(name, {}).update(keys)
        model, opt = _built(cfg, 3, inside)
        held = _held(model, optimizer)
        losses = _run(model, opt, range(5), unfreeze_at=None if "dpu" in sections else 3)
        opt.synchronize()
        runs[inside] = held, losses, _held(model, optimizer)
        infinity.release(model)
    assert runs[False] == runs[True]


def test_the_saving_matches_what_the_dormant_sub_groups_leave_out(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    awake, awake_opt = _built(_config(tmp_path / "a", "host"), 0, True)
    model, opt = _built(_config(tmp_path / "b", "host"), 2, False)
    awake.layers[:2].requires_grad_(False)     # after its optimizer: the layout stays
    _step(awake, awake_opt, 0)
    _step(model, opt, 0)
    assert _held(awake, "host") - _held(model, "host") == (4 + 4 + 4) * 2 * SHARD
    infinity.release(awake)
    infinity.release(model)


def _save_two_steps(tmp_path, cfg) -> None:
    """``tmp_path / "ckpt"``: two steps of the stack with every group trained (swap files under ``cfg("save")``;
    ``cfg("inside")`` and ``cfg("after")`` get their directories too)."""
    for name in ("save", "inside", "after"):
        (tmp_path / name).mkdir()
    model, opt = _built(cfg("save"), 0, True)
    _run(model, opt, range(2))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.release(model)


@pytest.mark.parametrize("optimizer, state_dtype", [("host", "fp32"), ("nvme", "fp32"), ("nvme", "int8")])
def test_moments_a_checkpoint_brought_move_with_the_masters(tmp_path, optimizer, state_dtype):
    """A checkpoint of a run that trained every group, loaded after the optimizer built the store again:
    the base frozen after Init takes its nonzero moments as one frozen inside Init does (it wakes)."""
    cfg = lambda name: _config(tmp_path / name, optimizer, state_dtype)  # noqa: E731
    _save_two_steps(tmp_path, cfg)
    runs = {}
    for inside in (True, False):
        model, opt = _built(cfg("inside" if inside else "after"), 1, inside)
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
        runs[inside] = _run(model, opt, range(2, 5), unfreeze_at=3), _held(model, optimizer)
        infinity.release(model)
    assert runs[False] == runs[True]


def _trains_as_frozen_inside_init(tmp_path, optimizer: str, model, opt) -> None:
    """``model`` (its first 2 layers frozen) trains as the same frozen inside ``infinity.Init``; both released."""
    (tmp_path / "ref").mkdir()
    ref, ref_opt = _built(_config(tmp_path / "ref", optimizer), 2, True)
    assert _run(model, opt, range(3)) == _run(ref, ref_opt, range(3))
    infinity.release(model)
    infinity.release(ref)


def test_a_tier_too_full_for_both_layouts_keeps_the_old_one_and_says_so(tmp_path):
    (tmp_path / "probe").mkdir()
    probe, probe_opt = _built(_config(tmp_path / "probe", "host"), 0, True)
    _step(probe, probe_opt, 0)
    held = _held(probe, "host")
    infinity.release(probe)
    cfg = _config(tmp_path, "host")
    cfg["tiers"]["host_budget"] = held + 4096
    with pytest.warns(RuntimeWarning, match=r"kept the optimizer's flat layout.*inside the infinity.Init block") as got:
        model, opt = _built(cfg, 2, False)
    assert got[0].filename == __file__      # the user's line
    assert _held(model, "host") == held
    _trains_as_frozen_inside_init(tmp_path, "host", model, opt)


@pytest.mark.parametrize("refusal", ["budget", "pinning"])
def test_host_memory_too_short_for_the_new_stores_buffers_keeps_the_layout_and_frees_its_keys(tmp_path,
                                                                                             monkeypatch, refusal):
    """States on NVMe: the new store's keys are on the disk, its sub-group buffers in host memory. A host
    budget that refuses the buffers keeps the old layout and leaves no key of the new store on the disk
    (they were allocated before the buffers, and nothing freed them). So does a host that cannot pin them
    (cudaHostRegister out of memory: the optimizer's creation failed)."""
    from tiers.base import TierFullError
    from tiers.host_alloc import HostAllocatorError

    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, "nvme")):
        model = Stack()
    model.layers[:2].requires_grad_(False)
    held = _held(model, "nvme")
    allocator = infinity.registry.engine_of(model).tiers.allocator
    empty = allocator.empty

    def short(nbytes, stagger=None, **kwargs):
        if stagger is not None:     # the optimizer store's sub-group buffers
            error = TierFullError if refusal == "budget" else HostAllocatorError
            raise error(f"host budget: no room for {nbytes} bytes")
        return empty(nbytes, **kwargs)

    monkeypatch.setattr(allocator, "empty", short)
    with pytest.warns(RuntimeWarning, match=r"kept the optimizer's flat layout.*no room for"):
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    monkeypatch.undo()
    assert _held(model, "nvme") == held
    _trains_as_frozen_inside_init(tmp_path, "nvme", model, opt)


def test_a_gradient_taken_before_the_optimizer_keeps_the_layout_and_its_gradient(tmp_path):
    """Gradients are never moved: one that arrived before the optimizer was created is stepped from the
    store it is in."""
    def backward(model):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
        model(x).backward()

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.warns(RuntimeWarning, match="gradients arrived before it was created"):
        model, opt = _built(_config(tmp_path / "a", "host"), 2, False, before_step=backward)
    torch.manual_seed(0)
    plain = Stack()
    plain.layers[:2].requires_grad_(False)
    backward(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    awake, _ = _built(_config(tmp_path / "b", "host"), 0, True)
    assert _held(model, "host") == _held(awake, "host")
    opt.step()
    plain_opt.step()
    opt.zero_grad()
    plain_opt.zero_grad()
    assert _step(model, opt, 1) == pytest.approx(_step(plain, plain_opt, 1), rel=1e-5)
    infinity.release(model)
    infinity.release(awake)


def test_a_checkpoint_adopted_in_place_keeps_its_layout_until_loaded(tmp_path):
    """A model built from a checkpoint in place (``Init(resume=)``) holds the checkpoint's keys until
    ``load_checkpoint`` verifies them: the optimizer created in between keeps that layout."""
    for name in ("ref", "nvme"):
        (tmp_path / name).mkdir()
    model, opt = _built(_config(tmp_path / "ref"), 0, True)
    reference = _run(model, opt, range(2))
    model.layers[:1].requires_grad_(False)
    reference += _run(model, opt, range(2, 4))
    infinity.release(model)
    cfg = _config(tmp_path / "nvme")
    model, opt = _built(cfg, 0, True)
    assert _run(model, opt, range(2)) == reference[:2]
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    torch.manual_seed(0)
    with infinity.Init(cfg, resume=tmp_path / "ckpt"):
        model = Stack()
    model.layers[:1].requires_grad_(False)
    with pytest.warns(RuntimeWarning, match="the model holds a checkpoint in place"):
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert _run(model, opt, range(2, 4)) == reference[2:]
    infinity.release(model)


@pytest.mark.parametrize("optimizer, state_dtype, dtype", [("host", "fp32", "float32"), ("nvme", "fp32", "float32"),
                                                          ("nvme", "fp32", "bfloat16"), ("host", "fp32", "bfloat16"),
                                                          ("nvme", "int8", "float32")])
def test_moments_loaded_before_the_optimizer_move_exactly_or_keep_the_layout(tmp_path, optimizer, state_dtype,
                                                                             dtype):
    """``load_checkpoint(path, model)`` before the optimizer brings nonzero moments into the store the
    optimizer builds again: copied as stored (the base, its moments nonzero, wakes); int8 moments would be
    quantized again, so their layout stays, with a warning, and training is the same either way."""
    cfg = lambda name: _config(tmp_path / name, optimizer, state_dtype, dtype)  # noqa: E731
    _save_two_steps(tmp_path, cfg)
    runs = {}
    for inside in (True, False):
        torch.manual_seed(0)
        with infinity.Init(cfg("inside" if inside else "after")):
            model = Stack()
            if inside:
                model.layers[:1].requires_grad_(False)
        infinity.load_checkpoint(tmp_path / "ckpt", model)      # moments in, no optimizer yet
        if not inside:
            model.layers[:1].requires_grad_(False)
        if state_dtype == "int8" and not inside:
            with pytest.warns(RuntimeWarning, match="stored as int8 and would be encoded again"):
                opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
        else:
            opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
        runs[inside] = _run(model, opt, range(2, 5), unfreeze_at=3), _held(model, optimizer)
        infinity.release(model)
    assert runs[False][0] == runs[True][0]
    if state_dtype != "int8":
        assert runs[False][1] == runs[True][1]
