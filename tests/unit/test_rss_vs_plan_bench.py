"""Smoke run of benchmarks/rss_vs_plan.py at a tiny size: each run in a process of its own, its peak resident set
beside the budget of the interpreter, the plan's host total and the activations."""
from __future__ import annotations

import json

from tests.support.benchmarks import load_benchmark


def test_rss_vs_plan_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    monkeypatch.setenv("HOME", str(tmp_path))      # the runs' processes probe the machine and cache it there
    out = tmp_path / "out.json"
    result = load_benchmark("rss_vs_plan").main(["--sizes", "300k", "--presets", "offload-host,nvme", "--steps", "1",
                                                 "--seq", "16", "--vocab", "256", "--workdir", str(tmp_path),
                                                 "--json", str(out)])
    host, nvme = result["rows"]
    assert host["tiers"] == ["host", "host"] and nvme["tiers"] == ["nvme", "nvme"]
    for row in (host, nvme):
        assert row["budget"] == row["interpreter"] + row["plan_host"] + row["activations"]
        assert row["peak"] > row["interpreter"] > 0 and row["ratio"] == row["peak"] / row["budget"]
        assert row["plan_host"] == sum(row["plan_rows"].values()) > 0
    # the host tier holds the states of offload-host; NVMe holds them for nvme, whose host rows are buffers
    assert "master" in host["plan_rows"] and "master" not in nvme["plan_rows"]
    assert json.loads(out.read_text())["rows"][1]["preset"] == "nvme"
    assert "peak RSS within the budget" in capsys.readouterr().out
