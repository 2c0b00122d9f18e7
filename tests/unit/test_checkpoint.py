"""Checkpoints on one rank: exact resume across tier layouts, the commit protocol, consolidation, damage.

The resume tests train a tiny GPT, save at step k, keep training (the uninterrupted run), then
build a fresh model with other weights, load, train the same steps, and require the losses, the
gathered parameters, the optimizer shards, the step count and the RNG draws to be identical.
"""
from __future__ import annotations

import os
import random
import threading
import warnings
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import infinity
from infinity.checkpoint import (CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError,
                                 verify_checkpoint)
from infinity.checkpoint.consolidate import consolidate
from infinity.checkpoint import directory
from infinity.checkpoint.directory import SavedCheckpoint
from tests.support.tiny_gpt import BufferedGPT as GPT


def config(tmp_path, tag, params="host", optimizer="host", **sections):
    nvme = tmp_path / f"nvme-{tag}"
    nvme.mkdir(exist_ok=True)
    cfg = {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(nvme),
                     "pool_buffer_size": "256KiB", "pool_buffers": 4},
           # Small sub-groups: groups straddle them, so the streaming crosses key boundaries.
           "partition": {"sub_group_size": 8192}, "prefetch": {"nvme_bytes": "2MiB"},
           # The thread engine: io_uring's first writes into fresh swap slots are slow in containers.
           "aio": {"engine": "threads"},
           # Small buffers and chunks: every file takes several pieces and several checksums.
           "checkpoint": {"buffer_size": "64KiB"}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def build(cfg, seed=0, lr=1e-2):
    torch.manual_seed(seed)
    with infinity.Init(cfg):
        model = GPT()
    return model, infinity.AdamW(model, lr=lr, weight_decay=0.01)


def train(model, opt, steps, device="cpu"):
    """Steps on batches from the global RNG (so restoring it matters); returns the losses."""
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 16))
        tgt = torch.randint(0, 64, (4, 16))
        loss = model(idx.to(device), tgt.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, opt):
    with infinity.gathered(model):
        params = {k: v.clone() for k, v in model.state_dict().items()}
    shards = opt.state_dict()["shards"]
    return params, {s: torch.cat(shards[s]) for s in ("master", "exp_avg", "exp_avg_sq")}


def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for s in sa:
        assert torch.equal(sa[s], sb[s]), s


def wait_for_cleanup():
    """Join the threads deleting retired versions (see [Note: deleting old versions])."""
    for thread in threading.enumerate():
        if thread.name == "infinity-checkpoint-cleanup":
            thread.join()


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# -- exact resume ------------------------------------------------------------------------------------
RESUME = [
    pytest.param(("host", "host"), ("nvme", "nvme"), {}, id="host-to-nvme"),
    pytest.param(("nvme", "nvme"), ("device", "host"), {}, id="nvme-to-device-host"),
    pytest.param(("host", "host"), ("host", "host"), {"precision": {"dtype": "bfloat16"}}, id="bf16"),
    pytest.param(("host", "host"), ("host", "host"), {"dpu": {"enabled": True, "warmup_steps": 1}}, id="dpu"),
]


@pytest.mark.parametrize("saved_tiers, loaded_tiers, extra_cfg", RESUME)
def test_resume_matches_uninterrupted_run(tmp_path, saved_tiers, loaded_tiers, extra_cfg):
    model, opt = build(config(tmp_path, "a", *saved_tiers, **extra_cfg))
    with torch.no_grad():
        model.pos_scale.fill_(0.5)
    seed_all(1)
    train(model, opt, 2)
    ckpt = tmp_path / "ckpt"
    version = infinity.save_checkpoint(ckpt, model, opt, extra={"epoch": 7})
    assert os.path.basename(version).startswith("step00000002-")
    expected_draws = draws()
    expected_losses = train(model, opt, 2)
    expected = snapshot(model, opt)

    resumed, ropt = build(config(tmp_path, "b", *loaded_tiers, **extra_cfg), seed=5, lr=0.5)
    assert infinity.load_checkpoint(ckpt, resumed, ropt) == {"epoch": 7}
    assert ropt.step_count == 2 and ropt.param_groups[0]["lr"] == 1e-2
    assert ropt.param_groups[0]["betas"] == (0.9, 0.999)
    assert torch.equal(resumed.pos_scale, torch.full((16, 1), 0.5))
    assert draws() == expected_draws
    assert train(resumed, ropt, 2) == expected_losses
    assert ropt.step_count == opt.step_count == 4
    assert_same(snapshot(resumed, ropt), expected)


def groups_of(model):
    from infinity import registry

    return registry.engine_of(model).coordinator.groups


@pytest.mark.parametrize("saved_units, loaded_units", [([], ["Block"]), (["Block"], [])], ids=["into-units", "out-of-units"])
def test_a_load_into_a_model_grouped_otherwise_keeps_every_value(tmp_path, saved_units, loaded_units):
    """Loaded into other groups, one saved group's bytes go to two new groups' keys and two saved groups'
    bytes meet inside one 4096-byte block of a new key: both writes of that block must land (in flight
    together on the NVMe tier's worker threads they used to put back each other's old bytes, silently)."""
    def cfg(tag, units):
        return config(tmp_path, tag, "nvme", "nvme", partition={"units": units, "sub_group_size": 1 << 20},
                      checkpoint={"buffer_size": "1MiB"})

    model, opt = build(cfg("a", saved_units))
    seed_all(1)
    train(model, opt, 2)
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt)
    with infinity.gathered(model):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    seed_all(2)
    expected_losses = train(model, opt, 2)

    for trial in range(3):
        loaded, lopt = build(cfg(f"b{trial}", loaded_units), seed=5)
        assert len(groups_of(loaded)) != len(groups_of(model))
        infinity.load_checkpoint(ckpt, loaded, lopt)
        with infinity.gathered(loaded):
            wrong = [k for k, v in loaded.state_dict().items() if not torch.equal(v, saved[k])]
        assert not wrong, f"trial {trial}: {len(wrong)} of {len(saved)} tensors differ after the load: {wrong}"
        seed_all(2)
        assert train(loaded, lopt, 2) == expected_losses     # the moments and master weights came back too
        infinity.release(loaded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: parameters in GPU memory (the device tier)")
def test_resume_with_parameters_on_the_gpu(tmp_path):
    cfg = config(tmp_path, "a", "device", "host", tiers={"device": "cuda"})
    model, opt = build(cfg)
    seed_all(1)
    train(model, opt, 2, "cuda")
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    expected_losses = train(model, opt, 2, "cuda")
    expected = snapshot(model, opt)
    resumed, ropt = build(config(tmp_path, "b", "nvme", "nvme", tiers={"device": "cuda"}), seed=5)
    infinity.load_checkpoint(tmp_path / "ckpt", resumed, ropt)
    assert train(resumed, ropt, 2, "cuda") == expected_losses
    assert_same(snapshot(resumed, ropt), expected)


def test_load_fp32_checkpoint_into_bf16_model(tmp_path):
    model, opt = build(config(tmp_path, "a"))
    train(model, opt, 1)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    masters = snapshot(model, opt)[1]["master"]
    bf16, bopt = build(config(tmp_path, "b", precision={"dtype": "bfloat16"}), seed=3)
    infinity.load_checkpoint(tmp_path / "ckpt", bf16, bopt)
    assert torch.equal(snapshot(bf16, bopt)[1]["master"], masters)
    with infinity.gathered(model), infinity.gathered(bf16):
        for (name, p), (_, q) in zip(model.named_parameters(), bf16.named_parameters()):
            assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16)), name


def assert_trains_alike(model, opt, other, other_opt):
    """Two steps of each on the same batches (the same RNG draws) give the same losses."""
    seed_all(2)
    losses = train(model, opt, 2)
    seed_all(2)
    assert train(other, other_opt, 2) == losses


def test_save_before_the_first_step_and_without_optimizer(tmp_path):
    model, opt = build(config(tmp_path, "a", "nvme", "nvme"))
    infinity.save_checkpoint(tmp_path / "ckpt", model, None)
    other, oopt = build(config(tmp_path, "b", "nvme", "nvme"), seed=9)
    infinity.load_checkpoint(tmp_path / "ckpt", other, oopt)
    assert oopt.step_count == 0
    assert_trains_alike(model, opt, other, oopt)


def test_a_load_before_the_optimizer_exists_is_said_when_it_is_created(tmp_path):
    """load_checkpoint(path, model) before infinity.AdamW: the moments (the engine's) were loaded and the step
    counts had nowhere to go, silently: the optimizer created next stepped trained moments from step 0. Now
    it says so and how to load them; a load with the optimizer restores everything, as before."""
    model, opt = build(config(tmp_path, "a"))
    seed_all(1)
    train(model, opt, 3)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    torch.manual_seed(0)
    with infinity.Init(config(tmp_path, "b")):
        other = GPT()
    infinity.load_checkpoint(tmp_path / "ckpt", other)
    with pytest.warns(RuntimeWarning, match=r"ckpt \(step 3\) was loaded into this model before an optimizer "
                                            r"existed.*infinity.load_checkpoint\(path, model, opt\)"):
        oopt = infinity.AdamW(other, lr=1e-2, weight_decay=0.01)
    assert oopt.step_count == 0
    infinity.load_checkpoint(tmp_path / "ckpt", other, oopt)
    assert oopt.step_count == 3
    assert_trains_alike(model, opt, other, oopt)
    infinity.release(model)
    infinity.release(other)
    torch.manual_seed(0)
    with infinity.Init(config(tmp_path, "c")):     # a checkpoint saved before any step: nothing to say
        fresh = GPT()
    infinity.save_checkpoint(tmp_path / "early", fresh, None)
    infinity.load_checkpoint(tmp_path / "early", fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infinity.AdamW(fresh, lr=1e-2)
    infinity.release(fresh)


# -- the directory and its commit protocol -----------------------------------------------------------
def test_versions_latest_pointer_and_cleanup(tmp_path):
    model, opt = build(config(tmp_path, "a"))
    ckpt = tmp_path / "ckpt"
    v1 = infinity.save_checkpoint(ckpt, model, opt, extra=1)
    (ckpt / ".tmp-deadbeef" / "rank0").mkdir(parents=True)      # a save killed earlier
    (ckpt / "latest.tmp-deadbeef").write_text("junk")
    train(model, opt, 1)
    v2 = infinity.save_checkpoint(ckpt, model, opt, extra=2, keep=2)
    train(model, opt, 1)
    v3 = infinity.save_checkpoint(ckpt, model, opt, extra=3, keep=2)
    assert not os.path.exists(v1)               # retired at once, deleted in the background
    wait_for_cleanup()
    entries = sorted(os.listdir(ckpt))
    assert entries == sorted(["latest", os.path.basename(v2), os.path.basename(v3)])
    assert (ckpt / "latest").read_text().strip() == os.path.basename(v3)
    assert sorted(os.listdir(v3)) == ["COMMIT", "manifest.json", "rank0"]
    assert sorted(os.listdir(os.path.join(v3, "rank0"))) == [
        "buffers.bin", "exp_avg.bin", "exp_avg_sq.bin", "extra.pt", "manifest.json", "master.bin", "params.bin"]
    other, oopt = build(config(tmp_path, "b"), seed=4)
    assert infinity.load_checkpoint(ckpt, other, oopt) == 3
    assert infinity.load_checkpoint(v2, other, oopt) == 2 and oopt.step_count == 1
    summary = verify_checkpoint(ckpt)
    assert summary["step"] == 2 and summary["world_size"] == 1 and summary["files"] == 6


def test_nothing_committed_is_not_found(tmp_path):
    model, opt = build(config(tmp_path, "a"))
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        infinity.load_checkpoint(tmp_path / "nowhere", model, opt)
    (tmp_path / "ckpt" / ".tmp-0123").mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError, match="interrupted"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    (tmp_path / "ckpt" / "latest").write_text("")      # a file given for the directory: said so
    with pytest.raises(CheckpointNotFoundError, match=r"it is a file, not a checkpoint directory \(it is the "
                                                      r"checkpoint's latest file: pass the directory"):
        infinity.load_checkpoint(tmp_path / "ckpt" / "latest", model, opt)


def test_a_latest_that_is_not_a_file_is_named_by_load_and_save_before_a_save_writes(tmp_path):
    """Loads said "neither COMMIT nor latest there"; a save wrote its whole version, failed at the commit
    naming a temporary file, and deleted the version again."""
    model, opt = build(config(tmp_path, "a"))
    first = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    os.unlink(tmp_path / "ckpt" / "latest")
    (tmp_path / "ckpt" / "latest").mkdir()
    with pytest.raises(infinity.checkpoint.CheckpointCorruptError,
                       match=rf"latest is not a file.*committed versions found: {os.path.basename(first)}"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    before = sorted(os.listdir(tmp_path / "ckpt"))
    with pytest.raises(infinity.checkpoint.CheckpointWriteError, match=r"latest is not a file.*nothing was written"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    infinity.load_checkpoint(first, model, opt)     # the version itself still loads


def test_a_parameter_assigned_after_init_is_refused_by_a_save_naming_it(tmp_path):
    """The save used to leave it out without a word (or, replacing a managed one, blame the root passed)."""
    model, opt = build(config(tmp_path, "a"))
    name, param = next(iter(model.named_parameters()))
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(torch.zeros(param.shape)))
    with pytest.raises(infinity.checkpoint.CheckpointError, match=rf"parameter '{name}' of the .* is not managed "
                                                                  r"by infinity.*nothing was written"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert not (tmp_path / "ckpt").exists()
    setattr(module, attr, param)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)


def test_a_save_into_another_models_checkpoint_is_refused_and_retires_nothing(tmp_path):
    """It committed and retired the other model's only checkpoint (``keep=1``) without a word."""
    model, opt = build(config(tmp_path, "a"))
    first = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    with infinity.Init(config(tmp_path, "b")):
        other = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(CheckpointMismatchError, match=r"holds a checkpoint of another model .*no parameter name in "
                                                      r"common.*Save elsewhere"):
        infinity.save_checkpoint(tmp_path / "ckpt", other)
    assert directory.resolve(tmp_path / "ckpt") == first and os.listdir(tmp_path / "ckpt").count(
        os.path.basename(first)) == 1
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)     # the same model saves on as before
    infinity.save_checkpoint(tmp_path / "ckpt", torch.compile(model), opt)     # through compile's wrapper too
    infinity.release(other)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(infinity.checkpoint.CheckpointWriteError, match=r"a-file is a file, not a directory"):
        infinity.save_checkpoint(tmp_path / "a-file", model, opt)


def test_rejects_a_foreign_optimizer_and_bad_keep(tmp_path):
    model, _ = build(config(tmp_path, "a"))
    other, other_opt = build(config(tmp_path, "b"))
    with pytest.raises(infinity.checkpoint.CheckpointError, match="not the infinity optimizer of this model"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, other_opt)
    with pytest.raises(ValueError, match="keep"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, None, keep=0)


# -- consolidation -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consolidate")
    model, opt = build(config(tmp, "a", "nvme", "nvme"))
    with torch.no_grad():
        model.pos_scale.fill_(0.25)
    train(model, opt, 2)
    infinity.save_checkpoint(tmp / "ckpt", model, opt)
    with infinity.gathered(model):
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    return tmp, gathered


def test_consolidated_weights_equal_gathered_and_load_strictly(trained):
    tmp, gathered = trained
    summary = consolidate(tmp / "ckpt", tmp / "model.pt", buffer_size=8192)
    assert summary["format"] == "torch" and summary["tensors"] == len(gathered)
    sd = torch.load(tmp / "model.pt", weights_only=True)
    assert list(sd) == list(gathered)           # the plain model's state-dict order, aliases included
    for k in gathered:
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], gathered[k]), k
    assert sd["head.weight"].data_ptr() == sd["wte.weight"].data_ptr()    # tied: one storage, as torch.save
    plain = GPT()
    plain.load_state_dict(sd, strict=True)
    assert torch.equal(plain.pos_scale, torch.full((16, 1), 0.25))
    assert zipfile.ZipFile(tmp / "model.pt").testzip() is None        # CRCs filled in
    mapped = torch.load(tmp / "model.pt", weights_only=True, mmap=True)
    assert torch.equal(mapped["wpe"], gathered["wpe"])


def test_the_package_attribute_consolidate_stays_the_function():
    """``infinity.checkpoint.consolidate`` is imported lazily; importing its submodule set the package
    attribute of that name to the module, so a second call raised "'module' object is not callable".
    (A fresh interpreter: here the submodule is imported already.)"""
    import subprocess
    import sys
    code = ("import infinity.checkpoint as c\n"
            "first, second = c.consolidate, c.consolidate\n"
            "assert callable(first) and second is first, (first, second)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_consolidate_cli_dtype_and_safetensors(trained, capsys):
    from infinity.cli.consolidate import main

    tmp, gathered = trained
    assert main([str(tmp / "ckpt"), str(tmp / "half.pt"), "--dtype", "bfloat16"]) == 0
    assert "tensors" in capsys.readouterr().out
    sd = torch.load(tmp / "half.pt", weights_only=True)
    for k in gathered:
        assert torch.equal(sd[k], gathered[k].to(torch.bfloat16)), k
    assert main([str(tmp / "ckpt"), str(tmp / "model.safetensors"), "--dtype", "float16"]) == 0
    header_len = int.from_bytes((tmp / "model.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0
    assert main([str(tmp / "missing"), str(tmp / "x.pt")]) == 1
    assert "no checkpoint" in capsys.readouterr().err


def test_safetensors_output_loads_with_the_package(trained):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed")
    tmp, gathered = trained
    consolidate(tmp / "ckpt", tmp / "st.safetensors", torch.float32, safetensors=True)
    sd = safetensors_torch.load_file(str(tmp / "st.safetensors"))
    assert sd.keys() == gathered.keys()
    for k in gathered:
        assert torch.equal(sd[k], gathered[k]), k
    GPT().load_state_dict(sd, strict=True)


class Tagger(nn.Module):
    """An untied embedding (tiled by columns) and a linear layer (tiled by rows)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.fc = nn.Linear(24, 30)
        self.ln = nn.LayerNorm(30)

    def forward(self, idx):
        return self.ln(self.fc(self.emb(idx))).square().mean()


def test_consolidating_tiled_layers_gives_the_plain_state_dict(tmp_path):
    for make, modules in ((Tagger, ["emb", "fc"]), (GPT, ["wte", "head", "blocks.1.mlp.0"])):
        torch.manual_seed(0)
        with infinity.Init(config(tmp_path, make.__name__, tiling={"modules": modules, "tiles": 3})):
            model = make()
        assert any(".tiles.2." in name for name, _ in model.named_parameters())
        opt = infinity.AdamW(model)
        loss = model(torch.randint(0, 40, (2, 16))) if make is Tagger else model(*[torch.randint(0, 64, (2, 16))] * 2)
        loss.backward()
        opt.step()
        infinity.save_checkpoint(tmp_path / make.__name__, model, opt)
        joins = SavedCheckpoint(tmp_path / make.__name__).manifest["joins"]
        assert {j["dim"] for j in joins} == ({0, 1} if make is Tagger else {0})    # columns: strided writes
        with infinity.gathered(model):
            expected = {k: v.clone() for k, v in model.state_dict().items()}
        for safetensors in (False, True):
            out = tmp_path / f"{make.__name__}.{'safetensors' if safetensors else 'pt'}"
            consolidate(tmp_path / make.__name__, out, safetensors=safetensors)
            if safetensors:
                sd = pytest.importorskip("safetensors.torch").load_file(str(out))
            else:
                sd = torch.load(out, weights_only=True)
            assert sd.keys() == expected.keys()
            for k in expected:
                assert torch.equal(sd[k], expected[k]), k
            make().load_state_dict(sd, strict=True)
        if make is GPT:
            sd = torch.load(tmp_path / f"{make.__name__}.pt", weights_only=True)
            assert sd["head.weight"].data_ptr() == sd["wte.weight"].data_ptr()


# -- damage ------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, opt = build(config(tmp_path, "a"))
    train(model, opt, 1)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fopt = build(config(tmp_path, "b"), seed=2)
    return version, fresh, fopt


def test_a_flipped_byte_is_caught_naming_the_file(saved):
    version, model, opt = saved
    path = os.path.join(version, "rank0", "exp_avg.bin")
    with open(path, "r+b") as f:
        f.seek(70_000)
        byte = f.read(1)
        f.seek(70_000)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match=r"rank0/exp_avg\.bin: bytes 65536\.\.131072 fail their CRC"):
        infinity.load_checkpoint(version, model, opt)
    with pytest.raises(CheckpointCorruptError, match=r"exp_avg\.bin"):
        verify_checkpoint(version)


def test_a_truncated_or_missing_file_is_caught_naming_it(saved):
    version, model, opt = saved
    path = os.path.join(version, "rank0", "master.bin")
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(CheckpointCorruptError, match=r"rank0/master\.bin: .* bytes, the manifest says \d+ \(truncated\)"):
        infinity.load_checkpoint(version, model, opt)
    with pytest.raises(CheckpointCorruptError, match=r"master\.bin"):
        consolidate(version, os.path.join(os.path.dirname(os.path.dirname(version)), "x.pt"))
    os.unlink(os.path.join(version, "rank0", "params.bin"))
    with pytest.raises(CheckpointCorruptError, match=r"rank0/params\.bin: missing"):
        verify_checkpoint(version)


def test_an_altered_manifest_is_caught(saved):
    version, model, opt = saved
    path = os.path.join(version, "rank0", "manifest.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.replace('"rank": 0', '"rank":  0'))
    with pytest.raises(CheckpointCorruptError, match=r"rank0/manifest\.json: the manifest of rank 0 fails its CRC"):
        infinity.load_checkpoint(version, model, opt)


def test_a_different_model_is_a_mismatch(tmp_path, saved):
    version, _, _ = saved
    torch.manual_seed(0)
    with infinity.Init(config(tmp_path, "c")):
        wider = GPT(d=48)
    with pytest.raises(CheckpointMismatchError, match=r"'wte.weight' has shape \(64, 48\) in the model"):
        infinity.load_checkpoint(version, wider, infinity.AdamW(wider))
    with infinity.Init(config(tmp_path, "d")):
        deeper = GPT(n=3)
    with pytest.raises(CheckpointMismatchError, match=r"parameter\(s\) of the model are not in the checkpoint: "
                                                      r"'blocks\.2\.ln1\.weight'"):
        infinity.load_checkpoint(version, deeper, infinity.AdamW(deeper))


def config_for_crash():
    """The config of the child processes of test_checkpoint_crash.py (they import this module)."""
    return {"tiers": {"params": "host", "optimizer": "host"}, "partition": {"sub_group_size": 8192},
            "aio": {"engine": "threads"}, "checkpoint": {"buffer_size": "64KiB"}}


def test_benchmark_smoke(tmp_path, capsys):
    import json

    from benchmarks.checkpoint import main

    out = tmp_path / "bench.json"
    assert main(["--path", str(tmp_path), "--numel", "3000000", "--layers", "2", "--repeats", "1",
                 "--buffer-size", "256KiB", "--pool-buffer-size", "256KiB", "--aio-engine", "threads",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "raw copy" in text and "peak RSS during save" in text
    record = json.loads(out.read_text())
    sample = record["samples"][0]
    assert record["settings"]["checkpoint_nbytes"] > 0 and sample["save_s"] > 0 and sample["load_s"] > 0
    # Streaming holds the checkpoint's buffers (3 x 256 KiB here, 0.8 MiB measured), not the 48 MB
    # of states: a save that gathered them would pass 16 MiB.
    assert 0 <= sample["save_rss_peak"] - sample["save_rss_before"] <= 16 << 20
    assert os.listdir(tmp_path) == ["bench.json"]          # swap files and checkpoints removed


@pytest.mark.parametrize("tiers,sections", [
    (("host", "host"), {}),
    (("nvme", "nvme"), {"precision": {"dtype": "bfloat16"}, "optimizer": {"state_dtype": "int8"}}),
    (("host", "nvme"), {"precision": {"dtype": "bfloat16"}}),
], ids=["host-fp32", "nvme-bf16-int8", "split-master-bf16"])
def test_a_weights_only_load_takes_the_weights_and_leaves_the_optimizer_and_rng(tmp_path, tiers, sections):
    """load_checkpoint(..., weights_only=True): the checkpoint's parameters and masters (as load_state_dict would
    take them); moments, step counts, hyper-parameters and RNG states go on as they were, and training on from
    there steps from the checkpoint's masters."""
    cfg = config(tmp_path, "a", *tiers)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    model, opt = build(cfg)
    seed_all(1)
    train(model, opt, 3)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"at": 3})
    saved_weights = [v.clone() for v in infinity.state_dict(model).values()]
    train(model, opt, 2)
    before = {state: [t.clone() for t in opt.state_dict()["shards"][state]] for state in ("exp_avg", "exp_avg_sq")}
    for group in opt.param_groups:
        group["lr"] = 1e-3     # a schedule's value, which the load must not take back
    seed_all(7)
    assert infinity.load_checkpoint(tmp_path / "ckpt", model, opt, weights_only=True) is None
    drawn = torch.rand(3)
    seed_all(7)
    assert torch.equal(drawn, torch.rand(3))    # the RNG was not restored
    assert all(torch.equal(a, b) for a, b in zip(infinity.state_dict(model).values(), saved_weights))
    assert opt.step_count == 5 and all(g["lr"] == 1e-3 for g in opt.param_groups)
    after = opt.state_dict()["shards"]
    assert all(torch.equal(a, b) for state, values in before.items() for a, b in zip(values, after[state]))
    assert any(t.abs().sum() > 0 for t in before["exp_avg"])
    for group in opt.param_groups:
        group["lr"] = 0.0       # a step writes the compute copies from the masters: those of the checkpoint
    train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(infinity.state_dict(model).values(), saved_weights))
    infinity.release(model)


def test_a_weights_only_load_does_not_mend_damaged_states(tmp_path):
    """The weights alone leave the moments as they are: over states a failed step left damaged it would have
    cleared the damage and trained on those moments. Refused, naming the whole load; which then mends them."""
    model, opt = build(config(tmp_path, "a"))
    seed_all(1)
    train(model, opt, 2)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine = infinity.registry.engine_of(model)
    engine.damaged = "opt.step() call 3 failed part-way (injected): load a checkpoint"
    with pytest.raises(infinity.checkpoint.CheckpointError, match=r"weights_only=True\): the states are damaged .*"
                                                                    r"load the checkpoint whole"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt, weights_only=True)
    assert engine.damaged
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert engine.damaged is None
    infinity.release(model)


def test_a_weights_only_load_does_not_drop_half_a_step_taken_in_backward(tmp_path):
    """With the update during backward, sub-groups stepped before opt.step(): a whole load replaces their
    moments too, the weights alone would leave half a step in them. Refused until the step is taken."""
    cfg = config(tmp_path, "a", "host", "nvme")
    cfg["optimizer"] = {"update_in_backward": True}
    cfg["partition"]["sub_group_size"] = 1024
    model, opt = build(cfg)
    seed_all(1)
    train(model, opt, 1)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))).backward()
    assert opt.updates.in_backward.stepped
    with pytest.raises(infinity.errors.EngineError, match=r"weights_only=True\): .* already stepped during backward"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt, weights_only=True)
    opt.step()
    opt.zero_grad()
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt, weights_only=True)
    infinity.release(model)
