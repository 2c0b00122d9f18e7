"""Faults in the middle of a step (issue: a full disk, an interrupt or a preemption loses nothing).

Each fault is injected at every call of its kind in a step, in turn: the k-th new gradient key while the
gradients widen to fp32 (the disk full), the k-th write there (an I/O error), the k-th group's gradient
hand-off in backward (an I/O error, or Ctrl-C). After each the error names what failed, ``opt.zero_grad()``
and the redone step train exactly (bit for bit) as a run that never met the fault, and a checkpoint saves.
"""
from __future__ import annotations

import errno

import pytest
import torch

import infinity
from infinity import registry
from infinity.optim import delayed, flat_state
from tests.support.tiny_gpt import TinyGPT, batches


def _config(tmp_path, dtype, dpu=False):
    nvme = tmp_path / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(nvme),
                      "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "partition": {"sub_group_size": 4096}, "precision": {"dtype": dtype},
            "prefetch": {"nvme_bytes": "1MiB"}, "aio": {"engine": "threads"},
            "dpu": {"enabled": dpu, "warmup_steps": 0}}


class _Fault:
    """Raises ``error`` at the ``k``-th call of what it wraps while armed (k from 1); counts the calls."""

    def __init__(self, k: int, error: BaseException) -> None:
        self.k, self.error, self.calls, self.armed, self.fired = k, error, 0, False, False

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            if self.armed:
                self.calls += 1
                if self.calls == self.k:
                    self.armed, self.fired = False, True
                    raise self.error
            return fn(*args, **kwargs)
        return wrapped


def _train(tmp_path, dtype, fault=None, where=None, save=None, at_step=1, dpu=False):
    """Three steps of two micro-batches; ``where(engine, fault)`` installs ``fault`` for the first try of
    step ``at_step``, which is redone after ``opt.zero_grad()``. Returns the weights, the error seen and the
    calls."""
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, dtype, dpu)):
        model = TinyGPT(d=48)
    engine = registry.engine_of(model, "test")
    opt = infinity.AdamW(model, lr=1e-2)
    if fault is not None:
        where(engine, fault)
    data = batches(6, 4)
    said = None
    for step in range(3):
        for attempt in range(2):
            if fault is not None:
                fault.armed = step == at_step and attempt == 0
            try:
                for mb in range(2):
                    x, y = data[2 * step + mb]
                    model(x, y).backward()
                opt.step()
                opt.zero_grad()
                break
            except (OSError, KeyboardInterrupt, infinity.errors.EngineError) as exc:
                assert attempt == 0, f"the redone step {step} failed too: {exc!r}"
                said = exc
                if fault is not None:
                    fault.armed = False
                if save is not None:
                    save(model, opt)
                opt.zero_grad()
    with infinity.gathered(model):
        weights = [p.detach().float().clone() for p in model.parameters()]
    infinity.release(model)
    return weights, said, fault.calls if fault is not None else 0


def _allocations(engine, fault):
    flat_state.allocate_key = delayed.allocate_key = fault.wrap(_ORIGINAL_ALLOCATE)


def _grad_writes(engine, fault):
    io = engine.store.io
    io.write = fault.wrap(io.write)


def _hand_offs(engine, fault):
    engine.reducer.take = fault.wrap(engine.reducer.take)


_ORIGINAL_ALLOCATE = flat_state.allocate_key


@pytest.fixture(autouse=True)
def _restore_allocate():
    yield
    flat_state.allocate_key = delayed.allocate_key = _ORIGINAL_ALLOCATE


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["disk full at a new key", "I/O error at a write", "disk full, DPU"])
def test_a_fault_while_gradients_widen_loses_nothing_at_every_call(tmp_path, kind):
    """bf16, states on NVMe, several sub-groups: the first step with two micro-batches moves the gradient keys
    to fp32. A failure at any new key or write of that move used to leave the store with keys freed and not
    replaced ('unknown key' at every later call); now the keys widened so far are narrowed back, and the step
    redone after zero_grad() trains exactly as without the fault."""
    dpu = "DPU" in kind     # its spare set of gradient keys widens first, and back
    reference, _, _ = _train(tmp_path / "ref", "bfloat16", dpu=dpu)
    error = OSError(errno.ENOSPC, "No space left on device") if kind.startswith("disk") else \
        OSError(errno.EIO, "Input/output error")
    where = _allocations if kind.startswith("disk") else _grad_writes
    k, tried = 1, 0
    while True:
        fault = _Fault(k, error)
        got, said, calls = _train(tmp_path / f"k{k}", "bfloat16", fault, where, at_step=0, dpu=dpu)   # step 0 widens
        if not fault.fired:
            break
        tried += 1
        assert said is not None and str(error.strerror) in str(said), (k, said)
        assert _same(got, reference), f"{kind} at call {k} changed the weights"
        k += 1
    assert tried >= 4, f"only {tried} fault points"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), KeyboardInterrupt()],
                         ids=["EIO", "Ctrl-C"])
def test_a_fault_at_any_gradient_hand_off_loses_nothing_and_a_save_works(tmp_path, dtype, error):
    """A failure while the engine takes a group's gradient in backward used to leave the group's parameters
    holding autograd's ``.grad``, which ``opt.zero_grad()`` did not clear and the redone step added in. At every
    hand-off of the step, in turn: save_checkpoint right after the fault works (a backward cut short is closed
    first), and the redone step trains exactly as without the fault."""
    reference, _, _ = _train(tmp_path / "ref", dtype)
    k, tried = 1, 0

    def save(model, opt):
        infinity.save_checkpoint(tmp_path / f"ckpt{k}", model, opt)

    while True:
        fault = _Fault(k, error)
        got, said, calls = _train(tmp_path / f"k{k}", dtype, fault, _hand_offs, save)
        if not fault.fired:
            break
        tried += 1
        assert _same(got, reference), f"{error!r} at hand-off {k} changed the weights"
        k += 3      # every third hand-off: the first, middle and last groups of both micro-batches are among them
    assert tried >= 8, f"only {tried} fault points"


def _engine_hooks(engine, fault):
    """Every place a step enters the engine from torch: each module's gather (forward and backward), the end of
    each module's forward, the start of each module's backward and each group's gradients."""
    engine.coordinator.acquire = fault.wrap(engine.coordinator.acquire)
    engine.coordinator.hold_for_backward = fault.wrap(engine.coordinator.hold_for_backward)
    engine.post_forward = fault.wrap(engine.post_forward)
    engine.pre_backward = fault.wrap(engine.pre_backward)
    engine.on_group_grads = fault.wrap(engine.on_group_grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ctrl_c_at_every_engine_hook_of_a_step_loses_nothing(tmp_path, dtype):
    """KeyboardInterrupt raised at each engine hook of a step in turn (forward, backward, gradient hand-off):
    a save right after it works, and after opt.zero_grad() the redone step trains exactly as without it."""
    reference, _, _ = _train(tmp_path / "ref", dtype)
    k, tried = 1, 0

    def save(model, opt):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt, keep=1)

    while True:
        fault = _Fault(k, KeyboardInterrupt())
        got, said, calls = _train(tmp_path / f"k{k}", dtype, fault, _engine_hooks, save)
        if not fault.fired:
            break
        tried += 1
        assert isinstance(said, KeyboardInterrupt), (k, said)
        assert _same(got, reference), f"Ctrl-C at engine hook {k} of {calls} changed the weights"
        k += 1 if k < 8 else 5      # the first hooks one by one, then every fifth
    assert tried >= 12, f"only {tried} fault points"
