"""``infinity.release(model)``: swap files, pinned buffers and directory locks go at once."""
import gc
import os

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import EngineError
from infinity.registry import engine_of


def _cfg(path):
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(path)}}


def _build(path):
    with infinity.Init(_cfg(path)):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model


def _train_step(model, opt):
    loss = model(torch.randn(3, 8)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _swap_files(path):
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def test_release_frees_files_buffers_and_lock_at_once(tmp_path):
    torch.manual_seed(0)
    model = _build(tmp_path)
    opt = infinity.AdamW(model, lr=1e-2)
    _train_step(model, opt)
    allocator = engine_of(model).tiers.allocator
    assert _swap_files(tmp_path)
    assert allocator.stats()["bytes_allocated"] > 0

    infinity.release(model)
    gc.collect()
    # model and opt are still referenced here: release alone let go of every file and buffer.
    assert _swap_files(tmp_path) == []
    assert allocator.stats()["bytes_allocated"] == 0

    # The same directory serves a new engine right away, in the same process.
    again = _build(tmp_path)
    opt2 = infinity.AdamW(again, lr=1e-2)
    assert torch.isfinite(torch.tensor(_train_step(again, opt2)))
    infinity.release(again)


def test_every_later_use_names_release(tmp_path):
    model = _build(tmp_path)
    opt = infinity.AdamW(model, lr=1e-2)
    _train_step(model, opt)
    infinity.release(model)
    released = "released by infinity.release"
    with pytest.raises(EngineError, match=f"Sequential.forward.*{released}"):
        model(torch.randn(2, 8))
    with pytest.raises(EngineError, match=released):
        model[0](torch.randn(2, 8))
    with pytest.raises(EngineError, match=released):
        model.state_dict()
    with pytest.raises(EngineError, match=f"infinity.stats.*{released}"):
        infinity.stats(model)
    with pytest.raises(EngineError, match=released):
        with infinity.gathered(model):
            pass
    with pytest.raises(EngineError, match=f"infinity.AdamW.*{released}"):
        opt.step()
    with pytest.raises(EngineError, match=released):
        opt.zero_grad()
    with pytest.raises(EngineError, match=released):
        infinity.release(model)
    # torch's own optimizers over the released parameters are no longer the engine's business.
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_release_waits_for_the_overlapped_update(tmp_path):
    # On NVMe the update runs beside the next forward (dpu.overlap): release waits for it, so
    # no write lands in a closed file, and a checkpoint taken before release is intact.
    torch.manual_seed(1)
    model = _build(tmp_path)
    opt = infinity.AdamW(model, lr=1e-2)
    for _ in range(3):
        loss = model(torch.randn(3, 8)).square().mean()
        loss.backward()
        opt.step()
        assert _swap_files(tmp_path)
    infinity.release(model)
    assert _swap_files(tmp_path) == []


def test_init_that_raises_frees_its_files_at_once(tmp_path):
    with pytest.raises(ValueError, match="model code failed"):
        with infinity.Init(_cfg(tmp_path)):
            nn.Linear(8, 16)
            raise ValueError("model code failed")
    assert _swap_files(tmp_path) == []
    model = _build(tmp_path)
    infinity.release(model)


def test_init_without_parameters_frees_its_files_at_once(tmp_path):
    with pytest.raises(RuntimeError, match="no module with parameters"):
        with infinity.Init(_cfg(tmp_path)):
            nn.ReLU()
    assert _swap_files(tmp_path) == []


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_a_model_dropped_without_release_takes_its_engine_with_it(tmp_path, params):
    """The engine's backward hooks live in autograd's nodes, which the garbage collector cannot see into: a
    hook holding the tensors it watches made a cycle nothing collects, and every engine (its buffers, swap
    files and threads) of a model trained once stayed to the process's end."""
    import weakref

    cfg = {"tiers": {"params": params, "optimizer": params, "nvme_path": str(tmp_path)}}
    with infinity.Init(cfg):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = infinity.AdamW(model, lr=1e-2)
    for _ in range(3):
        _train_step(model, opt)
    with torch.no_grad():
        model(torch.randn(3, 8))
    # The forward waits only for the updates it reads, so the background update's thread may still hold its
    # optimizer (and the engine) here; once synchronize() returns it holds nothing.
    opt.synchronize()
    engine = weakref.ref(engine_of(model))
    del model, opt
    gc.collect()
    assert engine() is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_backward_after_release_names_release(tmp_path, stage):
    """A graph from a forward before ``infinity.release`` keeps the engine's hooks: its backward gave
    ``AttributeError: 'NoneType' object has no attribute 'before_backward'``; now the error says what happened
    and what to do, every time it is tried, and the swap files stay gone."""
    cfg = _cfg(tmp_path)
    cfg["partition"] = {"stage": stage}
    if stage < 3:       # whole parameters on the compute device, the optimizer's states on NVMe
        cfg["tiers"]["params"] = "device"
    with infinity.Init(cfg):
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    infinity.AdamW(model, lr=1e-2)
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    infinity.release(model)
    for _ in range(2):
        with pytest.raises(EngineError, match=r"released \(infinity\.release\) after its forward.*call backward "
                                              r"\(and opt\.step\(\)\) before infinity\.release\(model\)"):
            loss.backward(retain_graph=True)
    assert _swap_files(tmp_path) == []
