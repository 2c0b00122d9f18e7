"""The GPU data path on a real GPU: parity with plain torch per preset, the ledger, and what the profiler sees.

The CPU suite checks the same contract through the transfer ledger (tests/unit/test_datapath.py);
here CUDA confirms it: every preset trains like plain ``torch.optim.AdamW`` on the GPU; in a
steady-state step the ledger shows no unpooled copy and no host wait in forward or backward;
torch.profiler sees no copy through pageable memory anywhere in a step and no device, stream or
event synchronize (nor a scalar read) during forward and backward. Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity.config import load_config
from tests.support.tiny_gpt import TinyGPT, batches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PRESETS = ["device", "offload-optimizer", "offload-host", "nvme"]
# The optimizer states split over tiers ([Note: optimizer states over tiers] in infinity/optim/tier_split.py):
# a preset, then tiers keys. The device share is stepped on the GPU inside opt.step(), the rest on the host.
SPLITS = ["offload-host:optimizer_device_share=0.5",
          "nvme:params=device+optimizer_device_share=0.3+optimizer_host_share=0.3",
          "nvme:optimizer_host_share=0.5",
          "nvme:optimizer_device_share=0.3"]    # copies on NVMe written from the device share through host memory
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _config(tmp_path, preset: str, **sections):
    name, _, rest = preset.partition(":")
    tiers = {k: (float(v) if k.endswith("_share") else v) for k, _, v in
             (item.partition("=") for item in filter(None, rest.split("+")))}
    overrides = {"tiers": {"device": "cuda", "nvme_path": str(tmp_path), "pool_buffer_size": "1MiB",
                           "pool_buffers": 4, **tiers},
                 "partition": {"sub_group_size": 8192},
                 "prefetch": {"nvme_bytes": "4MiB", "device_bytes": "1MiB"}, **sections}
    return load_config(name, overrides=overrides)


def _cuda_batches(n: int):
    return [(idx.cuda(), tgt.cuda()) for idx, tgt in batches(n, 2)]


# The update during backward with splits: its worker's stream, held NVMe-share gradients, the device share in
# opt.step() ([Note: update during backward] in infinity/optim/in_backward.py).
IN_BACKWARD = [(split, {"optimizer": {"update_in_backward": True}}) for split in SPLITS[1:3]]


@pytest.mark.parametrize("preset,sections", [(p, {}) for p in PRESETS + SPLITS] + IN_BACKWARD,
                         ids=PRESETS + SPLITS + [f"{s}+update_in_backward" for s, _ in IN_BACKWARD])
def test_every_preset_trains_like_plain_torch_on_the_gpu(tmp_path, preset, sections):
    # fp32 compute on both sides (the presets compute in bf16): differences are the engine's, not rounding.
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, preset, precision={"dtype": "float32"}, **sections)):
        model = TinyGPT()
    torch.manual_seed(0)
    ref = TinyGPT().cuda()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for idx, tgt in _cuda_batches(4):
        loss, ref_loss = model(idx, tgt), ref(idx, tgt)
        assert loss.device.type == "cuda"
        assert abs(loss.item() - ref_loss.item()) <= 1e-4, (preset, loss.item(), ref_loss.item())
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    named = dict(ref.named_parameters(remove_duplicate=False))
    with infinity.gathered(model):
        worst = max(float((p.detach() - named[n].detach()).abs().max())
                    for n, p in model.named_parameters(remove_duplicate=False))
    assert worst <= 1e-4, (preset, worst)


def _steady(tmp_path, preset: str, **sections):
    """A model after three steps (trace recorded, updates landed), its optimizer and a batch."""
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, preset, **sections)):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-3)
    data = _cuda_batches(4)
    for idx, tgt in data[:3]:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    return model, opt, data[3]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_ledger_of_a_steady_gpu_step(tmp_path, preset):
    model, opt, (idx, tgt) = _steady(tmp_path, preset)
    model(idx, tgt).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    ledger = infinity.stats(model)["transfers"]
    assert ledger["unpooled"] == 0 and ledger["per_parameter_calls"] == 0, ledger
    assert ledger["host_waits"]["forward"] == 0 and ledger["host_waits"]["backward"] == 0, ledger
    if preset == "device":
        assert ledger["host_to_device"]["bytes"] == ledger["device_to_host"]["bytes"] == 0, ledger
    # A step's device memory above what it kept: its activations at least, read off CUDA's peak counter.
    first = infinity.stats(model)["steps"][0]["device_transient_peak"]
    assert first is None or first > 0, first


def _names(prof) -> list[str]:
    return [e.name for e in prof.events()]


def _within(prof, region: str) -> list[str]:
    """Names of the host events that begin inside the ``record_function(region)`` range.

    The profiler's own exit synchronizes the device (torch.autograd.profiler.profile.__exit__):
    that cudaDeviceSynchronize is in its events too, after the region, and is not the engine's.
    """
    events = prof.events()
    # The range shows twice: the host's, and its annotation on the GPU's timeline (which ends when the
    # device finishes, after the host's, and could take in the profiler's own exit synchronize).
    (span,) = [e.time_range for e in events if e.name == region and e.device_type == torch.autograd.DeviceType.CPU]
    return [e.name for e in events if e.name != region and span.start <= e.time_range.start <= span.end]


@pytest.mark.parametrize("preset", PRESETS + SPLITS)
def test_the_profiler_sees_no_pageable_copy_and_no_sync_in_forward_and_backward(tmp_path, preset):
    # Synchronous updates, so that nothing of the step runs on a worker thread during the profiled
    # forward and backward (the overlapped update's own waits belong to the step).
    model, opt, (idx, tgt) = _steady(tmp_path, preset, dpu={"overlap": False})
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as fwd_bwd:
        with torch.profiler.record_function("forward-backward"):
            model(idx, tgt).backward()
    with torch.profiler.profile(activities=activities) as step:
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    names = _within(fwd_bwd, "forward-backward")
    assert "aten::mm" in names or "aten::addmm" in names, sorted(set(names))[:20]   # the region holds the work
    assert not [n for n in names if any(s in n for s in SYNCS)], sorted(set(n for n in names if "ynchron" in n))
    pageable = [n for n in _names(fwd_bwd) + _names(step) if "Pageable" in n]
    assert not pageable, sorted(set(pageable))



@pytest.mark.parametrize("preset", PRESETS + SPLITS)
def test_a_bf16_run_repeats_bit_for_bit_with_deterministic_kernels(tmp_path, preset):
    # A race between a copy stream and the compute stream shows as runs that differ: on the H100 the
    # uploads into freshly resized gathered memory did not wait for the compute stream, and
    # offload-host's bf16 losses differed from run to run by 0.01-0.1% from the third step.
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    runs = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        out = subprocess.run([sys.executable, "-m", "tests.gpu.repro_losses", preset, str(tmp_path / str(i))],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["losses"] == runs[1]["losses"], (preset, runs)


@pytest.mark.parametrize("preset", ["offload-optimizer", "offload-host"])
def test_a_frozen_base_keeps_its_fp32_masters_bit_for_bit_on_the_gpu(tmp_path, preset):
    # Frozen inside Init, a block's masters rest as its bf16 copy (on the GPU with offload-optimizer)
    # plus a remainder in host memory ([Note: dormant sub-groups] in infinity/optim/flat_state.py):
    # joined back through a device read at the checkpoint's save, they are the constructor's values.
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, preset)):      # the presets compute in bf16
        model = TinyGPT()
        model.blocks[0].requires_grad_(False)
    torch.manual_seed(0)
    want = {n: p.detach().clone() for n, p in TinyGPT().blocks[0].named_parameters()}
    opt = infinity.AdamW(model, lr=1e-3)
    for idx, tgt in _cuda_batches(2):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt")
    for name, value in want.items():
        assert torch.equal(saved[f"blocks.0.{name}"].view(torch.int32), value.view(torch.int32)), name
    model.requires_grad_(True)          # wakes the block: its first update starts from those masters
    for idx, tgt in _cuda_batches(2):
        loss = model(idx, tgt)
        assert torch.isfinite(loss).all()
        loss.backward()
        opt.step()
        opt.zero_grad()
    infinity.release(model)
