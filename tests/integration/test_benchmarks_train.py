"""benchmarks/train.py and benchmarks/scale.py smoke-run at a tiny size, each config in its own process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.benchmarks import load_benchmark


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_train_benchmark_table_json_and_plot(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    proc = _run("train.py", "--sizes", "tiny", "--configs", "torch,nvme-noprefetch", "--steps", "3", "--batch", "2",
                "--seq", "16", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out), "--plot", str(png))
    head = proc.stdout.splitlines()[0].split()
    assert head[:4] == ["size", "params", "states", "config"] and "vs" in head
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"torch", "nvme-noprefetch"}
    for row in rows.values():
        assert row["error"] is None, row["error"]
        assert row["step_seconds"] > 0 and row["peak_rss_bytes"] > 0 and len(row["samples"]) == 3
        assert row["n_params"] == report["rows"][0]["n_params"]
    assert rows["torch"]["tier_peak_bytes"] == {}
    assert rows["nvme-noprefetch"]["tier_peak_bytes"]["nvme"] > 0 and rows["nvme-noprefetch"]["io_read_bytes_per_step"] > 0
    assert report["machine"]["cpus"] >= 1 and report["settings"]["steps"] == 3 and len(report["raw"]) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "nvme") == [], "each run's swap directory is removed"


def _load(script: str):
    return load_benchmark(script[:-3])


def test_train_benchmark_rejects_an_unknown_config_or_size(capsys):
    bench = _load("train.py")
    assert bench.main(["--configs", "ram"]) == 2
    assert "unknown config 'ram'; choose from torch, host" in capsys.readouterr().err
    assert bench.main(["--sizes", "9B"]) == 2
    assert "unknown size '9B'" in capsys.readouterr().err


def test_scale_benchmark_sizes_and_flatness_arithmetic():
    scale = _load("scale.py")
    assert scale._count("1.3B") == 1_300_000_000 and scale._count("4e9") == 4_000_000_000
    assert scale.shape_of("125M", 50304, 1024).n_layer == 12
    rows = [{"label": "a", "n_params": 1, "states_nbytes": 100, "peak_rss_bytes": 1000, "states_over_ram": 0.1,
             "error": None},
            {"label": "b", "n_params": 9, "states_nbytes": 900, "peak_rss_bytes": 1050, "states_over_ram": 0.9,
             "error": None},
            {"label": "c", "n_params": 20, "states_nbytes": 2000, "error": "exit status -9"}]
    flat = scale.flatness(rows)
    assert flat["states_growth"] == 9.0 and abs(flat["rss_growth"] - 0.05) < 1e-12 and flat["largest"] == "b"


def test_scale_benchmark_ladder_reports_rss_against_states(tmp_path):
    out = tmp_path / "scale.json"
    proc = _run("scale.py", "--start", "2e5", "--factor", "4", "--max-params", "1.5e6", "--vocab", "512",
                "--seq", "16", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out))
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert len(rows) == 2 and all(r["error"] is None for r in rows), [r["error"] for r in rows]
    assert rows[1]["n_params"] > 3 * rows[0]["n_params"]
    for r in rows:
        assert r["peak_rss_bytes"] > 0 and r["nvme_peak_bytes"] >= r["states_nbytes"]
        assert r["states_over_ram"] == r["states_nbytes"] / report["ram_bytes"]
    flat = report["flatness"]
    assert flat["states_growth"] == rows[1]["states_nbytes"] / rows[0]["states_nbytes"]
    assert "is above --max-params" in report["stopped"]
    assert "largest trained" in proc.stdout and "peak RSS grew" in proc.stdout
    assert rows[0]["plan_per_param_step"]["read"] <= rows[0]["plan_per_param_step"]["read_max"]


def test_scale_benchmark_resumes_within_the_training_runs_swap(tmp_path):
    """A resumed process's NVMe peak is the training run's: a load adds no keys beside the states
    (bf16 with both tiers on NVMe splits the masters; int8 moments are re-encoded)."""
    out = tmp_path / "scale.json"
    _run("scale.py", "--sizes", "llama-tiny", "--dtype", "bfloat16", "--state-dtype", "int8", "--seq", "16",
         "--steps", "2", "--checkpoint", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out))
    row = json.loads(out.read_text())["rows"][0]
    assert row["error"] is None and row.get("resume_error") is None, (row["error"], row.get("resume_error"))
    assert row["resume_nvme_peak_bytes"] == row["nvme_peak_bytes"]
