"""Checkpoints in place: the swap files sealed as the checkpoint, adopted by the run that resumes
([Note: checkpoints in place] in infinity/checkpoint/in_place.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import infinity
from infinity.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from infinity.errors import EngineError

WIDTH, LAYERS = 96, 4


class Stack(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x).float().pow(2).mean()


def _config(nvme, dtype="float32", state_dtype="fp32", **partition):
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(nvme), "device": "cpu",
                      "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "precision": {"dtype": dtype}, "optimizer": {"state_dtype": state_dtype},
            "partition": {"sub_group_size": 4096, **partition}, "aio": {"engine": "threads"},
            "checkpoint": {"buffer_size": "1MiB"}}


def _build(cfg, resume=None, width=WIDTH):
    torch.manual_seed(0)
    with infinity.Init(cfg, resume=resume):
        model = Stack(width)
    return model, infinity.AdamW(model, lr=1e-2)


def _step(model, opt, i, dtype):
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i)).to(dtype)
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _swap_files(nvme):
    return sorted(f for _, _, files in os.walk(nvme) for f in files if not f.startswith("."))


@pytest.mark.parametrize("dtype,state_dtype", [("float32", "fp32"), ("bfloat16", "int8")])
def test_a_run_resumed_from_its_sealed_swap_files_trains_on_exactly(tmp_path, dtype, state_dtype):
    torch_dtype = getattr(torch, dtype)
    (tmp_path / "ref").mkdir()
    model, opt = _build(_config(tmp_path / "ref", dtype, state_dtype))
    reference = [_step(model, opt, i, torch_dtype) for i in range(5)]
    infinity.release(model)

    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = _config(nvme, dtype, state_dtype)
    model, opt = _build(cfg)
    assert [_step(model, opt, i, torch_dtype) for i in range(3)] == reference[:3]
    infinity.save_checkpoint(ckpt, model, opt, extra={"data": 3}, in_place=True)
    summary = infinity.checkpoint.verify_checkpoint(ckpt)      # the sealed files, state by state
    assert summary["nbytes"] > sum(p.numel() for p in model.parameters()) * (2 if dtype == "bfloat16" else 8)
    files = _swap_files(nvme)
    assert len(files) == 1 and files[0].endswith(".sealed"), files      # renamed: the run's swap file is gone
    checkpoint_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt) for f in fs)
    assert checkpoint_bytes < 64 << 10         # no copy of the states: a few manifests and the buffers
    with pytest.raises(EngineError, match="sealed as a checkpoint in place"):
        _step(model, opt, 3, torch_dtype)
    with pytest.raises(EngineError, match="sealed"):
        infinity.save_checkpoint(tmp_path / "again", model, opt, in_place=True)
    infinity.release(model)
    assert any(n.endswith(".sealed") for n in _swap_files(nvme))

    model, opt = _build(cfg, resume=ckpt)
    with pytest.raises(EngineError, match="call infinity.load_checkpoint"):
        _step(model, opt, 3, torch_dtype)
    assert infinity.load_checkpoint(ckpt, model, opt) == {"data": 3}
    assert opt.step_count == 3 and float(model.calls) == 3.0
    assert any(n.endswith(".sealed") for n in _swap_files(nvme))     # not consumed until written
    assert [_step(model, opt, i, torch_dtype) for i in (3, 4)] == reference[3:]
    assert not any(n.endswith(".sealed") for n in _swap_files(nvme))
    infinity.release(model)


def test_a_resume_that_stops_before_training_leaves_the_checkpoint(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = _config(nvme)
    model, opt = _build(cfg)
    _step(model, opt, 0, torch.float32)
    infinity.save_checkpoint(ckpt, model, opt, in_place=True)
    infinity.release(model)
    for _ in range(2):
        model, opt = _build(cfg, resume=ckpt)
        infinity.load_checkpoint(ckpt, model, opt)
        infinity.release(model)
    model, opt = _build(cfg, resume=ckpt)
    infinity.load_checkpoint(ckpt, model, opt)
    assert opt.step_count == 1
    _step(model, opt, 1, torch.float32)
    infinity.release(model)
    with pytest.raises(FileNotFoundError, match="consumed"):
        _build(cfg, resume=ckpt)


def test_what_cannot_resume_is_refused_by_name(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = _config(nvme)
    model, opt = _build(cfg)
    _step(model, opt, 0, torch.float32)
    infinity.save_checkpoint(ckpt, model, opt, in_place=True)
    infinity.release(model)

    with pytest.raises(CheckpointMismatchError, match="partition.sub_group_size"):
        _build(_config(nvme, sub_group_size=8192), resume=ckpt)
    with pytest.raises(CheckpointMismatchError, match="does not have the checkpoint's states|holds"):
        _build(cfg, resume=ckpt, width=WIDTH + 32)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(CheckpointMismatchError, match="give the same tiers.nvme_path"):
        _build(_config(other), resume=ckpt)
    model, opt = _build(_config(other))
    with pytest.raises(CheckpointMismatchError, match="checkpoint in place"):
        infinity.load_checkpoint(ckpt, model, opt)     # built without resume=
    with pytest.raises(CheckpointError, match="in_place=False"):
        infinity.save_checkpoint(tmp_path / "x", *_build({"tiers": {"params": "host", "device": "cpu"}}),
                                 in_place=True)
    infinity.save_checkpoint(tmp_path / "plain", model, opt)
    with pytest.raises(CheckpointError, match="ordinary checkpoint"):
        infinity.Init(cfg, resume=tmp_path / "plain")
    infinity.release(model)

    # Bytes changed in the sealed file after the save: found before anything is restored.
    with open(ckpt / "latest") as f:
        swap = json.load(open(ckpt / f.read().strip() / "rank0" / "manifest.json"))["swap"]
    with open(swap["files"][0], "r+b") as f:
        f.seek(swap["roles"]["exp_avg:0"]["placement"]["offsets"][0] + 8)
        f.write(b"\x7f" * 50)
    with pytest.raises(CheckpointCorruptError, match="exp_avg:0 in rank 0's sealed swap files changed"):
        infinity.checkpoint.verify_checkpoint(ckpt)
    model, opt = _build(cfg, resume=ckpt)
    with pytest.raises(CheckpointCorruptError, match="changed since the save"):
        infinity.load_checkpoint(ckpt, model, opt)
    with pytest.raises(EngineError, match="call infinity.load_checkpoint"):
        _step(model, opt, 1, torch.float32)
    infinity.release(model)


def test_a_save_in_place_that_fails_after_sealing_gives_the_files_back(tmp_path, monkeypatch):
    from infinity.checkpoint import directory

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    model, opt = _build(_config(nvme))
    first = _step(model, opt, 0, torch.float32)

    def broken_commit(*args, **kwargs):
        raise OSError(5, "commit failed (test)")

    monkeypatch.setattr(directory, "commit", broken_commit)
    with pytest.raises(OSError, match="commit failed"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    assert not any(n.endswith(".sealed") for n in _swap_files(nvme))
    assert _step(model, opt, 1, torch.float32) != first      # trains on, on its own swap files
    monkeypatch.undo()
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    model, opt = _build(_config(nvme), resume=tmp_path / "ckpt")
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert opt.step_count == 2
    infinity.release(model)


def test_tiled_layers_and_delayed_updates_resume_in_place_as_from_an_ordinary_checkpoint(tmp_path):
    """A tiled layer's groups are made at Init's exit and DPU keeps a second key per group: the roles the
    resume adopts are the same, and it continues as a load of an ordinary checkpoint saved at that step."""
    def config(nvme):
        nvme.mkdir()
        return _config(nvme) | {"tiling": {"modules": ["layers.1"], "tiles": 3},
                                "dpu": {"enabled": True, "warmup_steps": 1}}

    cfg, plain_cfg = config(tmp_path / "nvme"), config(tmp_path / "plain-nvme")
    model, opt = _build(cfg)
    for i in range(3):
        _step(model, opt, i, torch.float32)
    infinity.save_checkpoint(tmp_path / "plain", model, opt)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)

    model, opt = _build(plain_cfg)
    infinity.load_checkpoint(tmp_path / "plain", model, opt)
    expected = [_step(model, opt, i, torch.float32) for i in (3, 4, 5)]
    infinity.release(model)
    model, opt = _build(cfg, resume=tmp_path / "ckpt")
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert [_step(model, opt, i, torch.float32) for i in (3, 4, 5)] == expected
    infinity.release(model)


def test_states_striped_over_two_directories_are_verified_and_adopted(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    cfg = _config(dirs[0])
    cfg["tiers"]["nvme_path"] = [str(d) for d in dirs]      # 256 KiB stripes; a 400 x 400 weight is 640 KB
    cfg["partition"]["sub_group_size"] = 1 << 18

    def build(resume=None):
        torch.manual_seed(0)
        with infinity.Init(cfg, resume=resume):
            model = nn.Sequential(nn.Linear(400, 400), nn.Tanh(), nn.Linear(400, 1))
        return model, infinity.AdamW(model, lr=1e-2)

    def step(model, opt, i):
        loss = model(torch.randn(4, 400, generator=torch.Generator().manual_seed(i))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = build()
    reference = [step(model, opt, i) for i in range(4)]
    infinity.release(model)
    for d in dirs:
        for root, _, files in os.walk(d):
            assert not files
    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    assert all(any(f.endswith(".sealed") for f in _swap_files(d)) for d in dirs)
    assert infinity.checkpoint.verify_checkpoint(tmp_path / "ckpt")["nbytes"] > 400 * 400 * 12
    model, opt = build(resume=tmp_path / "ckpt")
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert [step(model, opt, i) for i in (2, 3)] == reference[2:]
    infinity.release(model)


_KILLED_RESUME = """
import os, signal, sys, torch, infinity
from tests.integration.test_checkpoint_in_place import _build, _config
model, opt = _build(_config(sys.argv[1]), resume=sys.argv[2])
infinity.load_checkpoint(sys.argv[2], model, opt)
with torch.no_grad():
    model(torch.randn(4, 96))                  # reads the adopted files; writes nothing
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_resume_killed_before_its_first_backward_leaves_the_checkpoint(tmp_path):
    import subprocess
    import sys

    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    model, opt = _build(_config(nvme))
    reference = [_step(model, opt, i, torch.float32) for i in range(3)]
    infinity.release(model)
    nvme2 = tmp_path / "nvme2"
    nvme2.mkdir()
    model, opt = _build(_config(nvme2))
    for i in range(2):
        _step(model, opt, i, torch.float32)
    infinity.save_checkpoint(ckpt, model, opt, in_place=True)
    infinity.release(model)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _KILLED_RESUME, str(nvme2), str(ckpt)], cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    infinity.checkpoint.verify_checkpoint(ckpt)
    model, opt = _build(_config(nvme2), resume=ckpt)
    infinity.load_checkpoint(ckpt, model, opt)
    assert _step(model, opt, 2, torch.float32) == reference[2]
    infinity.release(model)


def test_verifying_reads_only_the_files_the_checkpoint_sealed(tmp_path):
    """The rank manifest names the sealed files by absolute path, and anyone can edit it (the CRC-32s in COMMIT
    are recomputed in a minute): verify_checkpoint opened whatever it named and said the CRC-32 of its bytes,
    an oracle for any file the process could read. Now only a file the checkpoint sealed is opened, never
    through a symlink, and a failed check says no CRC-32 found."""
    import json
    import zlib

    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    model, opt = _build(_config(nvme))
    _step(model, opt, 0, torch.float32)
    version = infinity.save_checkpoint(ckpt, model, opt, in_place=True)
    infinity.release(model)
    rel = os.path.join("rank0", "manifest.json")
    original = json.loads(open(os.path.join(version, rel)).read())
    sealed = original["swap"]["files"][0]
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(1 << 16))
    planted = os.path.join(os.path.dirname(sealed), "x." + os.path.basename(sealed).split(".", 1)[1])
    os.symlink(sealed, planted)     # a link under a sealed file's own name pattern
    infinity.checkpoint.verify_checkpoint(version)

    def edited(path: str) -> None:
        manifest = json.loads(json.dumps(original))
        manifest["swap"]["files"][0] = path
        raw = (json.dumps(manifest) + "\n").encode()
        open(os.path.join(version, rel), "wb").write(raw)
        commit = json.loads(open(os.path.join(version, "COMMIT")).read())
        commit["manifests"][rel] = zlib.crc32(raw)
        open(os.path.join(version, "COMMIT"), "w").write(json.dumps(commit))

    for path, said in ((str(secret), "is not a file this checkpoint sealed"),
                       (os.path.join(os.path.dirname(sealed), "..", "..", "secret"), "is not a file this checkpoint"),
                       (planted, "cannot be opened .*a symbolic link is not followed")):
        edited(path)
        with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match=said) as info:
            infinity.checkpoint.verify_checkpoint(version)
        assert "0x" not in str(info.value), str(info.value)
    edited(sealed)
    infinity.checkpoint.verify_checkpoint(version)


def test_tiers_auto_resumes_a_checkpoint_in_place_as_it_was_saved(tmp_path):
    """"auto" was decided before the checkpoint was opened, from this run's room and rates: on a machine with
    more room it chose shares or tiers the resume then refused, with a fix an "auto" config cannot take (set the
    shares: refused beside "auto"), and the sealed files counted as used disk. A checkpoint in place holds every
    state on NVMe, where it lies: "auto" now resumes it so, without searching, and trains on exactly."""
    from infinity.plan.machine import MachineProfile

    (tmp_path / "ref").mkdir()
    model, opt = _build(_config(tmp_path / "ref"))
    reference = [_step(model, opt, i, torch.float32) for i in range(4)]
    infinity.release(model)
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = _config(nvme)
    model, opt = _build(cfg)
    assert [_step(model, opt, i, torch.float32) for i in range(2)] == reference[:2]
    infinity.save_checkpoint(ckpt, model, opt, in_place=True)
    infinity.release(model)
    roomy = MachineProfile(name="roomy", device_bytes=2**40, host_bytes=2**40, nvme_bytes=0, unified=True)
    auto = {**cfg, "tiers": {**cfg["tiers"], "params": "auto", "optimizer": "auto"}}
    with pytest.raises(CheckpointMismatchError, match=r"config tiers\.params is .device."):    # what "auto" chose: refused
        with infinity.Init(infinity.plan.placement.resolve_auto(infinity.load_config(auto), 10**5,
                                                                machine=roomy)[0], resume=ckpt):
            Stack()
    torch.manual_seed(0)
    init = infinity.Init(auto, resume=ckpt, machine=roomy)    # no model= either: nothing is searched
    with init:
        model = Stack()
    opt = infinity.AdamW(model, lr=1e-2)
    t = init.config.tiers
    assert (t.params, t.optimizer, t.optimizer_device_share, t.optimizer_host_share, init.placement) == (
        "nvme", "nvme", 0.0, 0.0, None)
    infinity.load_checkpoint(ckpt, model, opt)
    assert [_step(model, opt, i, torch.float32) for i in (2, 3)] == reference[2:]
    infinity.release(model)
    with infinity.Init(auto, machine=roomy, model=10**5):     # a save in place refused says what to give
        model = Stack()
    opt = infinity.AdamW(model, lr=1e-2)
    with pytest.raises(CheckpointError, match=r'as tiers "auto" chose them: give tiers.params = tiers.optimizer = "nvme"'):
        infinity.save_checkpoint(tmp_path / "refused", model, opt, in_place=True)
    infinity.release(model)
