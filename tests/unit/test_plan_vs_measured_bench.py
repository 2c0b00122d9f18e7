"""Smoke run of benchmarks/plan_vs_measured.py at a tiny size: every row pairs the plan's prediction with a
measured step of the same model, and ``auto`` runs the tiers Init resolved."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "benchmarks" / "plan_vs_measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_vs_measured_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    box = tmp_path / "box.json"
    box.write_text(json.dumps({"name": "test box", "device_bytes": 0, "host_bytes": 4 * 2**30, "unified": True,
                               "device_flops": 1e10, "host_adam_params_per_s": 1e8}))
    out = tmp_path / "out.json"
    result = _bench().main(["--sizes", "2e5", "--vocab", "256", "--seq", "16", "--batch", "1", "--steps", "2",
                            "--warmup", "0", "--presets", "offload-host,auto,device", "--machine", str(box),
                            "--workdir", str(tmp_path), "--json", str(out)])
    rows = result["rows"]
    assert [r["preset"] for r in rows] == ["offload-host", "auto", "device"]
    # Each run's compute term is a plain model in its own compute dtype: the device preset's is fp32.
    assert [r["compute_dtype"] for r in rows] == ["bfloat16", "bfloat16", "float32"]
    assert rows[0]["plain_s"] == rows[1]["plain_s"] != rows[2]["plain_s"]
    for row in rows:
        assert len(row["steps_s"]) == 2 and row["measured_s"] > 0 and row["compute_s"] > 0
        assert row["ratio"] == row["measured_s"] / row["predicted_s"] and row["paired_ratio"] > 0
        assert row["predicted_s"] >= row["compute_s"]    # the compute measured is a floor of the prediction
    assert rows[0]["tiers"] == ["host", "host"]
    # 4 GiB for a 200k-parameter model: everything fits the (CPU) device, which nothing beats.
    assert rows[1]["tiers"] == ["device", "device"]
    assert json.loads(out.read_text())["profile"]["name"] == "test box"
    assert "within 15%" in capsys.readouterr().out


def test_plan_vs_measured_engine_schedule_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    box = tmp_path / "box.json"
    box.write_text(json.dumps({"name": "test box", "device_bytes": 0, "host_bytes": 4 * 2**30, "unified": True}))
    result = _bench().main(["--sizes", "2e5", "--vocab", "256", "--seq", "16", "--batch", "1", "--steps", "2",
                            "--warmup", "1", "--presets", "offload-host", "--schedule", "engine",
                            "--machine", str(box), "--workdir", str(tmp_path)])
    (row,) = result["rows"]
    assert len(row["steps_s"]) == 2 and len(row["plain_s"]) == 2 and row["paired_ratio"] == row["ratio"]
    assert row["predicted_s"] >= row["compute_s"] > 0


def test_disk_beside_predicts_each_nvme_run_with_the_disk_measured_around_it(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    bench = _bench()
    measured = bench.disk_now(str(tmp_path), size="16MiB")     # infinity-bench itself, on a small file
    assert measured.read_gbps > 0 and measured.write_gbps > 0
    readings = iter([(1.0, 2.0), (3.0, 4.0)])
    monkeypatch.setattr(bench, "disk_now", lambda path, aio=None: bench.Bandwidth(*next(readings), source="test"))
    box = tmp_path / "box.json"
    box.write_text(json.dumps({"name": "test box", "device_bytes": 0, "host_bytes": 4 * 2**30, "unified": True,
                               "nvme_bytes": 1e12, "disk_read_gbps": 0.001, "disk_write_gbps": 0.001}))
    result = bench.main(["--sizes", "2e5", "--vocab", "256", "--seq", "16", "--batch", "1", "--steps", "2",
                         "--warmup", "1", "--presets", "offload-host,nvme", "--schedule", "engine", "--disk-beside",
                         "--machine", str(box), "--workdir", str(tmp_path)])
    host, nvme = result["rows"]
    assert host["disk_beside"] is None, "a run without NVMe is predicted with the profile's disk"
    assert nvme["disk_beside"] == {"read_gbps": [1.0, 3.0], "write_gbps": [2.0, 4.0]}
    # at 1 MB/s the profile's disk would make the step seconds long; the readings beside it make it short
    assert nvme["predicted_s"] < 1.0 and next(readings, None) is None


def test_disk_beside_measures_with_each_runs_own_aio_settings(tmp_path, monkeypatch):
    """Two NVMe runs side by side with different ``[aio]`` block sizes: the disk is measured with each run's
    settings before and after the block, and each run is predicted with the readings of its own settings."""
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    bench = _bench()
    calls = []

    def disk_now(path, aio=None):
        calls.append(aio.block_size)
        rate = {2**20: 1.0, 8 * 2**20: 2.0}[aio.block_size] + len(calls) / 100    # each reading its own
        return bench.Bandwidth(rate, 2 * rate, source="test")

    monkeypatch.setattr(bench, "disk_now", disk_now)
    box = tmp_path / "box.json"
    box.write_text(json.dumps({"name": "test box", "device_bytes": 0, "host_bytes": 4 * 2**30, "unified": True,
                               "nvme_bytes": 1e12, "disk_read_gbps": 0.001, "disk_write_gbps": 0.001}))
    result = bench.main(["--sizes", "2e5", "--vocab", "256", "--seq", "16", "--batch", "1", "--steps", "2",
                         "--warmup", "1", "--presets", "nvme,nvme:aio.block_size=1MiB", "--disk-beside",
                         "--machine", str(box), "--workdir", str(tmp_path)])
    assert sorted(calls) == [2**20, 2**20, 8 * 2**20, 8 * 2**20], "each setting before and after the block"
    eight, one = result["rows"]
    assert [round(r) for r in eight["disk_beside"]["read_gbps"]] == [2, 2]
    assert [round(r) for r in one["disk_beside"]["read_gbps"]] == [1, 1]
    assert eight["disk_beside"]["write_gbps"] == [2 * r for r in eight["disk_beside"]["read_gbps"]]
