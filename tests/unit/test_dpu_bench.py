"""Smoke runs of benchmarks/adam.py, benchmarks/dpu.py and benchmarks/qstates.py at tiny sizes: tables
printed, JSON written."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.benchmarks import load_benchmark


load = load_benchmark


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_adam_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "adam.json"
    load("adam").main(["--sizes", "300K", "--repeats", "2", "--rounds", "1", "--skip", "deepspeed",
                       "--stream-numel", "200K", "--json", str(out)])
    table = capsys.readouterr().out
    for row in ("torch fused, 1 tensor", "torch fused, 100 tensors", "torch foreach, 100 tensors",
                "ours (engine step)", "ours (engine step, torch kernel)", "ours (engine step, bf16 states)", "ours (engine step, int8 states)",
                "kernel fp32", "kernel fp32, bf16 grad + copy", "kernel bf16 moments", "kernel int8 moments",
                "G params/s", "x fp32 ours", "% triad"):
        assert row in table, row
    record = json.loads(out.read_text())
    size = record["sizes"]["300000"]
    assert set(size["raw_seconds"]) >= {"triad", "torch fused, 1 tensor", "ours (engine step)",
                                        "ours (engine step, int8 states)", "kernel fp32", "kernel int8 moments"}
    assert all(len(v) == 2 and min(v) > 0 for v in size["raw_seconds"].values())
    assert 0.5 * 300_000 < size["numel"]["ours"] < 2 * 300_000  # whole layers
    assert record["machine"]["torch"] == torch.__version__
    if "stream triad" in size["raw_seconds"]:    # the C baselines, where the extension is built
        assert "stream triad (C, best)" in table and size["bandwidth_basis"] == "stream triad"
        assert size["stream"]["numel"] == 200_000 and size["stream"]["stream triad"]["gbps"] > 0
        assert size["stream"]["bytes_per_element"] == {"stream triad": 24, "stream copy": 16}


def test_dpu_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "dpu.json"
    load("dpu").main(["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "256", "--seq", "8",
                      "--rounds", "1", "--turn", "2", "--dpu-threads", "1", "--compute-threads", "1",
                      "--optimizer", "host,nvme", "--train-steps", "6", "--train-d-model", "32",
                      "--nvme-dir", str(tmp_path), "--json", str(out)])
    table = capsys.readouterr().out
    assert "optimizer states on host" in table and "optimizer states on nvme" in table
    assert "dpu / sync final loss" in table
    record = json.loads(out.read_text())
    for tier in ("host", "nvme"):
        summary = record[f"step_time_{tier}"]["summary"]
        assert set(summary) == {"sync c1", "dpu w1 c1"}
        assert summary["dpu w1 c1"]["worker_threads"] == 1
        assert len(record[f"step_time_{tier}"]["raw"]["sync c1"]["fb"]) == 1
    runs = record["train"]["runs"]
    assert len(runs["sync"]["losses"]) == len(runs["dpu"]["losses"]) == 6
    assert runs["sync"]["losses"][0] == runs["dpu"]["losses"][0]  # same start, the schedules differ later
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tmp")]  # the swap directories were removed


def test_qstates_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "qstates.json"
    load("qstates").main(["--model", "tiny", "--steps", "4", "--batch", "1", "--seq", "8", "--tail", "2",
                          "--eval-every", "3", "--eval-batch", "2", "--seeds", "0,1", "--threads", "1",
                          "--bytes-steps", "1", "--json", str(out)])
    table = capsys.readouterr().out
    for row in ("state_dtype", "largest gap", "o fp32", "over 2 seed(s)", "NVMe bytes per parameter"):
        assert row in table, row
    record = json.loads(out.read_text())
    assert set(record["runs"]) == {"0", "1"}
    assert set(record["runs"]["0"]) == {"fp32", "fp32~", "bf16", "int8"}
    assert all(len(c["train"]) == 4 and len(c["eval"]) == 2 for r in record["runs"].values() for c in r.values())
    assert record["runs"]["0"]["fp32"]["train"] != record["runs"]["1"]["fp32"]["train"]   # seeds differ
    assert record["figures"]["1"]["fp32"]["final_rel"] == 0.0
    assert len(record["summary"]["int8"]["samples"]) == 2 and record["summary"]["fp32"]["std"] == 0.0
    assert record["settings"]["seeds"] == "0,1" and record["machine"]["threads"] == 1
    assert [r["state_dtype"] for r in record["bytes"]] == ["fp32", "bf16", "int8"]   # no fp32~: same bytes as fp32
    stored = {r["state_dtype"]: r["stored_per_param"] for r in record["bytes"]}
    assert stored["int8"] < stored["bf16"] < stored["fp32"]
    for r in record["bytes"]:     # the plan's arithmetic is the measurement's
        assert abs(r["stored_per_param"] - r["plan_stored_per_param"]) < 0.05 * r["plan_stored_per_param"]
        moved = r["read_per_param_step"] + r["written_per_param_step"]
        assert abs(moved - r["plan_moved_per_param_step"]) < 0.05 * r["plan_moved_per_param_step"]
