"""accelerate's ``prepare`` on an engine model and ``infinity.AdamW``: host memory stays bounded.

``AcceleratedOptimizer.__init__`` runs ``opt.load_state_dict(move_to_device(opt.state_dict()))``.
The optimizer states live on NVMe here, so the structural measure is the bytes read from the
optimizer tier while ``prepare`` runs: none (see [Note: a lazy optimizer state dict]). The
same counter moves by the states' size when a state is looked at, so it can tell.
"""
import io

import pytest
import torch

import infinity
from infinity.registry import engine_of
from tests.support.tiny_gpt import TinyGPT

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
accelerate = pytest.importorskip("accelerate")


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
            for _ in range(n)]


def _build(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "nvme", "nvme_path": str(tmp_path)},
                        "partition": {"sub_group_size": 4096}}):
        model = TinyGPT()
    return model, infinity.AdamW(model, lr=1e-2)


def _steps(model, opt, batches):
    losses = []
    for idx, tgt in batches:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_prepare_reads_no_optimizer_state_and_training_goes_on_unchanged(tmp_path):
    batches = _batches(4)
    model, opt = _build(tmp_path / "a")
    twin, twin_opt = _build(tmp_path / "b")
    _steps(model, opt, batches[:2])
    _steps(twin, twin_opt, batches[:2])

    tier = engine_of(model).tiers.optimizer
    before = tier.stats()["bytes_read"]
    accelerator = accelerate.Accelerator(cpu=True)
    prepared_model, prepared_opt = accelerator.prepare(model, opt)
    read_in_prepare = tier.stats()["bytes_read"] - before

    state_bytes = 4 * sum(g.shard_numel for g in engine_of(model).coordinator.groups)
    before = tier.stats()["bytes_read"]
    moments = torch.cat(opt.state_dict()["shards"]["exp_avg"])
    read_on_access = tier.stats()["bytes_read"] - before
    assert read_in_prepare == 0, f"prepare read {read_in_prepare} bytes of optimizer state"
    assert read_on_access >= state_bytes and moments.abs().sum() > 0

    # The prepared pair trains on exactly as the untouched twin does.
    losses, twin_losses = _steps(prepared_model, prepared_opt, batches[2:]), _steps(twin, twin_opt, batches[2:])
    assert losses == twin_losses


def test_saved_state_dict_holds_tensors_and_loads_back(tmp_path):
    model, opt = _build(tmp_path)
    _steps(model, opt, _batches(2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert type(saved["shards"]) is dict and all(isinstance(t, torch.Tensor) for t in saved["shards"]["master"])
    masters = torch.cat(saved["shards"]["master"])
    _steps(model, opt, _batches(1))
    assert not torch.equal(torch.cat(opt.state_dict()["shards"]["master"]), masters)
    opt.load_state_dict(saved)      # a plain dict of tensors is written back
    assert torch.equal(torch.cat(opt.state_dict()["shards"]["master"]), masters)


def test_save_state_is_refused_naming_infinitys_checkpoints_which_take_the_prepared_pair(tmp_path):
    """accelerator.save_state failed on state_dict() with advice for taking weights, not for checkpointing
    ([Note: accelerate's save_state] in infinity/runtime/save_guard.py); the checkpoint it names takes the
    prepared optimizer and resumes the run exactly."""
    batches = _batches(4)
    model, opt = _build(tmp_path / "nvme")
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    _steps(model, opt, batches[:2])
    with pytest.raises(infinity.errors.EngineError,
                       match=r"^accelerator\.save_state\(\): the model was built in infinity\.Init.*No file was "
                             r"written.*infinity\.save_checkpoint\(dir, model, opt\).*infinity\.load_checkpoint"):
        accelerator.save_state(str(tmp_path / "state"))
    assert list((tmp_path / "state").iterdir()) == []
    infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    went_on = _steps(model, opt, batches[2:])
    infinity.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert _steps(model, opt, batches[2:]) == went_on


def test_load_state_is_refused_naming_infinitys_checkpoints_before_reading_a_file(tmp_path):
    """Given the directory infinity.save_checkpoint wrote, accelerator.load_state stopped at its own missing
    pytorch_model.bin, saying nothing of infinity ([Note: accelerate's load_state] in infinity/optim/checks.py);
    it is refused before anything is read, naming infinity.load_checkpoint, which resumes the run exactly."""
    batches = _batches(4)
    model, opt = _build(tmp_path / "nvme")
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    _steps(model, opt, batches[:2])
    infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    went_on = _steps(model, opt, batches[2:])
    with pytest.raises(infinity.errors.EngineError,
                       match=r"^accelerator\.load_state\('[^']*ckpt'\): the model was built in infinity\.Init.*"
                             r"Nothing was loaded.*infinity\.load_checkpoint\(dir, model, opt\).*is such a checkpoint"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    infinity.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert _steps(model, opt, batches[2:]) == went_on


def test_a_step_infinity_skips_holds_a_prepared_scheduler(tmp_path):
    """A prepared scheduler holds on a step accelerate's step_was_skipped says was skipped, which it learns only
    from its own GradScaler: fp16's overflowing steps, skipped by infinity itself, moved the warmup on. Now the
    prepared optimizer says so ([Note: skipped steps under accelerate] in infinity/optim/checks.py)."""
    tmp_path.mkdir(exist_ok=True)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}, "partition": {"sub_group_size": 4096},
                        "precision": {"dtype": "float16", "initial_scale": 2.0 ** 12, "hysteresis": 1}}):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    skipped = []
    for i, (idx, tgt) in enumerate(_batches(6)):
        loss = model(idx, tgt)
        accelerator.backward(loss * float("inf") if i == 1 else loss)    # step 1 overflows whatever the scale
        opt.step()
        skipped.append(opt.step_was_skipped)
        sched.step()
        opt.zero_grad()
    inner = opt.optimizer
    assert skipped[1] and inner.skipped_steps == sum(skipped) >= 1, skipped
    assert sched.scheduler.last_epoch == inner.step_count == 6 - sum(skipped)
    infinity.release(model)
