"""Smoke run of benchmarks/prefetch.py at a tiny size: it runs, prints its table, writes its JSON."""
import json
import os

import pytest
import torch

from tests.support.benchmarks import load_benchmark


@pytest.fixture
def bench():
    return load_benchmark("prefetch")


def test_prefetch_benchmark_tiny(bench, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "prefetch.json"
    try:
        rc = bench.main(["--path", str(tmp_path), "--vocab", "256", "--d-model", "32", "--heads", "2",
                         "--layers", "2", "--seq", "16", "--steps", "1", "--warmup", "1", "--block", "2", "--threads", "1",
                         "--bw-bytes", str(8 << 20), "--modes", "prefetch", "no-prefetch", "compute-only",
                         "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    table = capsys.readouterr().out
    assert "step(prefetch) / max(compute-only, I/O)" in table and "speed-up of prefetch" in table
    assert "(paired per round)" in table
    result = json.loads(out.read_text())
    summary = result["summary"]
    for key in ("read_GBps", "write_GBps", "io_seconds", "compute_only_seconds", "ratio[prefetch]",
                "speedup_over_no_prefetch", "stall_fraction[prefetch]", "hit_rate[prefetch]"):
        assert summary[key] is not None and summary[key] == summary[key], key
    assert set(summary["paired"]) == {"ratio[prefetch]", "speedup_over_no_prefetch"}
    assert result["params"] == sum(p.numel() for p in bench.GPT(256, 32, 2, 2, 16).parameters())
    prefetch = result["modes"]["prefetch"]
    assert len(prefetch["samples"]) == 4 and [s["trace"] for s in prefetch["samples"]] == \
        ["recording", "following", "following", "following"]
    assert [s["lead_in"] for s in prefetch["samples"]] == [True, False, True, False]
    assert prefetch["median"]["nvme_read"] > 0 and result["modes"]["compute-only"]["median"]["nvme_read"] == 0
    assert [p for p in os.listdir(tmp_path) if p.startswith("infinity-prefetch-")] == []   # cleaned up
