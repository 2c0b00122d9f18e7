"""The example GPT, train_gpt and the demo, end to end at the tiny size (NVMe files in tmp_path)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

import infinity
from infinity.examples import demo
from infinity.examples.gpt import GPT, preset
from infinity.examples.train_gpt import TrainOptions, train

NVME = {"tiers": {"params": "nvme", "optimizer": "nvme"}}


def test_gpt_in_init_matches_plain_pytorch(tmp_path):
    """Same seed, same weights; three AdamW steps give the same losses as torch.optim.AdamW."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {**NVME["tiers"], "nvme_path": str(tmp_path)}}):
        model = GPT(cfg)
    with infinity.gathered(model):
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.detach().cpu(), q.detach()), name
    assert sum(p.numel() for p in ref.parameters()) == cfg.n_params
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x, x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)


def test_train_gpt_on_nvme_reports_a_falling_loss_and_its_numbers(tmp_path):
    out = tmp_path / "report.json"
    report = train(TrainOptions(config="nvme", model_size="tiny", steps=4, batch=2, seq=32, data="repeat",
                                lr=1e-2, nvme_dir=str(tmp_path / "swap"), json=str(out),
                                overrides=('precision.dtype="float32"',)))
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(report["summary"]))
    s = report["summary"]
    assert s["last_loss"] < s["first_loss"]
    assert len(report["steps"]) == 4
    for step in report["steps"]:
        parts = step["compute_seconds"] + step["stall_seconds"] + step["optimizer_seconds"]
        assert parts == pytest.approx(step["seconds"], rel=1e-6)
        assert step["tier_bytes"]["nvme"] > 0 and step["io_read_bytes"] > 0 and step["io_write_bytes"] > 0
    # Every byte of the 16 B/param states lives on NVMe; nothing in the host tier.
    assert s["tier_peak_bytes"]["nvme"] >= preset("tiny").states_nbytes()
    assert s["tier_peak_bytes"]["host"] == 0
    assert s["peak_rss_bytes"] > 0 and report["model"]["n_params"] == preset("tiny").n_params
    assert report["tiers_text"].startswith("params nvme, optimizer nvme")


def test_train_gpt_plain_torch_engine_has_no_tiers(tmp_path):
    report = train(TrainOptions(engine="torch", model_size="tiny", steps=3, batch=2, seq=16, data="repeat", lr=1e-2))
    assert report["summary"]["last_loss"] < report["summary"]["first_loss"]
    assert report["summary"]["tier_peak_bytes"] == {} and report["engine_stats"] is None
    assert report["steps"][0]["stall_seconds"] == 0.0


def test_demo_prints_progress_summary_and_where_things_went(tmp_path, capsys):
    swap_parent = tmp_path / "tmp"
    swap_parent.mkdir()
    code = demo.main(["--model-size", "tiny", "--steps", "4", "--seq", "32", "--tmpdir", str(swap_parent),
                      "--json", str(tmp_path / "demo.json"), "--checkpoint", str(tmp_path / "ckpt"),
                      "--progress", "plain"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("step    4/4", "tok/s", "stall", "nvme", "step time (median of 3)", "waiting for reads (stall)",
                 "optimizer", "peak host RSS", "model states per tier (peak)", "achieved I/O", "JSON report",
                 "checkpoint"):
        assert text in out, text
    # "host 0 B" (every state on NVMe) stood beside "rss 1.5 GiB" with nothing to say what each counts.
    assert "(the whole process)" in out and "of it infinity's buffers" in out and "| states nvme " in out
    assert 0 < json.loads((tmp_path / "demo.json").read_text())["summary"]["host_buffer_peak_bytes"]
    assert str(tmp_path / "demo.json") in out
    assert os.listdir(swap_parent) == [], "the temporary swap directory must be removed"
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["options"]["data"] == "text" and report["summary"]["last_loss"] < report["summary"]["first_loss"]
    ckpt = report["checkpoint"]
    if ckpt["path"] is None:  # infinity.checkpoint not in this build: said so, nothing pretended
        assert "infinity.checkpoint" in ckpt["note"] and "not written" in out
    else:
        assert os.listdir(ckpt["path"])


def test_train_gpt_command_line_with_torchrun_two_ranks(tmp_path):
    """torchrun launches two gloo ranks; both train, rank 0 writes the report."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "infinity.examples.train_gpt", "--config", "nvme", "--model-size", "tiny", "--steps", "3",
           "--batch", "2", "--seq", "16", "--data", "repeat", "--lr", "1e-2", "--nvme-dir", str(tmp_path / "swap"),
           "--json", str(out), "--progress", "plain"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["rank"] == 0
    assert sorted(os.listdir(tmp_path / "swap")) == ["rank0", "rank1"]
    assert report["summary"]["last_loss"] < report["summary"]["first_loss"]
    assert "step time" in proc.stdout


def test_checkpoint_then_resume_continues_where_training_stopped(tmp_path):
    """2 steps + checkpoint, then --resume and 1 step: the same loss as step 3 of an unbroken run."""
    common = dict(config="nvme", model_size="tiny", batch=2, seq=16, data="repeat", lr=1e-2,
                  overrides=('precision.dtype="float32"',))
    whole = train(TrainOptions(steps=3, nvme_dir=str(tmp_path / "a"), **common))
    first = train(TrainOptions(steps=2, nvme_dir=str(tmp_path / "b"), checkpoint=str(tmp_path / "ckpt"), **common))
    if first["checkpoint"]["path"] is None:
        pytest.skip(first["checkpoint"]["note"])
    resumed = train(TrainOptions(steps=1, nvme_dir=str(tmp_path / "c"), resume=str(tmp_path / "ckpt"), **common))
    assert [s["loss"] for s in first["steps"]] == [s["loss"] for s in whole["steps"][:2]]
    assert resumed["steps"][0]["loss"] == pytest.approx(whole["steps"][2]["loss"], rel=1e-6)


def test_demo_multiplies_bf16_in_fp32_only_where_torchs_bf16_matmul_is_slow(monkeypatch):
    from infinity.tiling import widened

    for slow, want in ((True, ("precision.cpu_linear=float32",)), (False, ())):
        monkeypatch.setattr(demo, "slow_narrow_matmul", lambda slow=slow: slow)
        assert demo.cpu_linear_overrides("auto") == want
        assert demo.cpu_linear_overrides("native") == ()
        assert demo.cpu_linear_overrides("float32") == ("precision.cpu_linear=float32",)
    assert demo.build_parser().parse_args([]).cpu_linear == "auto"
    assert widened.slow_narrow_matmul() == ("AVX512" not in torch.backends.cpu.get_cpu_capability()
                                            and platform.machine().lower() in ("x86_64", "amd64"))
