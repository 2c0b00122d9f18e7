"""benchmarks/gpu.py at a tiny size on the CPU: every row in its own process, the ledger in the table and JSON.

DeepSpeed is not installed here: its rows must say how to install it, not vanish. (With a
``--deepspeed-python`` that imports deepspeed they run; see benchmarks/deepspeed_gpt.py.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.benchmarks import load_benchmark


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(script: str):
    return load_benchmark(script[:-3])


PROFILE = {"name": "tiny test box", "device_bytes": 0, "host_bytes": 64 * 2**30, "nvme_bytes": 1e12, "unified": True,
           "device_flops": 2e10, "host_adam_params_per_s": 1e8, "host_memory_gbps": 10.0,
           "disk_read_gbps": 2.0, "disk_write_gbps": 1.0}


def test_gpu_benchmark_rows_ledger_predictions_and_missing_deepspeed(tmp_path):
    out, profile = tmp_path / "gpu.json", tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--sizes", "tiny",
                           "--configs", "torch,device,offload-host,nvme-int8-uib,ds-zero3,auto@tiny", "--steps", "3",
                           "--batch", "2", "--seq", "16", "--dtype", "float32", "--nvme-dir", str(tmp_path / "nvme"),
                           "--deepspeed-python", "/bin/false", "--predict", "--machine", str(profile),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})     # on the CPU on a GPU machine too
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    head = proc.stdout.splitlines()[0].split()
    assert head[:4] == ["size", "config", "s/step", "TFLOPS"] and "H->D" in head
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert result["complete"] and list(rows) == ["torch", "device", "offload-host", "nvme-int8-uib", "ds-zero3", "auto"]
    for name in ("torch", "device", "offload-host", "nvme-int8-uib", "auto"):
        row = rows[name]
        assert row["error"] is None, row["error"]
        assert row["step_seconds"] > 0 and row["tflops"] > 0 and row["peak_rss_bytes"] > 0, row
        assert row["device"] == "cpu" and row["gpu_peak_bytes"] is None
    assert rows["torch"]["transfers"] is None
    assert rows["offload-host"]["nvme_per_parameter"] is None
    # fp32 here: the step writes the compute copy (4 B/param), the master (4) and int8 m and v (2.03);
    # updated during backward, no fp32 gradient (4 more) goes to NVMe.
    nvme = rows["nvme-int8-uib"]["nvme_per_parameter"]
    assert 0 < nvme["written"] < 14 and nvme["read"] > 0, nvme
    device, host = rows["device"]["transfers"], rows["offload-host"]["transfers"]
    assert device["host_to_device"]["bytes"] == 0 and device["device_to_host"]["bytes"] == 0, device
    # offload-host gathers the compute copies in forward and again in backward; gradients leave once.
    assert host["host_to_device"]["bytes"] >= 2 * 4 * rows["offload-host"]["n_params"], host
    assert host["device_to_host"]["bytes"] >= 4 * rows["offload-host"]["n_params"], host
    assert host["unpooled"] == 0 and host["host_waits"]["forward"] == host["host_waits"]["backward"] == 0, host
    assert "pip install deepspeed" in rows["ds-zero3"]["error"] and "/bin/false" in rows["ds-zero3"]["error"]
    assert "pip install deepspeed" in proc.stdout
    # --predict: each infinity row beside the step-time model's step on the given profile, its compute the
    # torch row's step; "auto" predicted with the tiers its run chose.
    compute = rows["torch"]["step_seconds"]
    assert "predicted" not in rows["torch"] and rows["auto"]["tiers"] == ["device", "device"]
    for name in ("device", "offload-host", "nvme-int8-uib", "auto"):
        predicted = rows[name]["predicted"]
        assert predicted["machine"] == "tiny test box" and predicted["compute_s"] == compute, predicted
        assert predicted["step_s"] >= compute / 3 and set(predicted["phases_s"]) == {"forward", "backward", "update"}
    assert rows["nvme-int8-uib"]["predicted"]["schedule"] == "update beside backward"
    assert rows["offload-host"]["tiers"] == ["host", "host"]
    # The NVMe bound: max(compute, the ledger's bytes over the profile's disk rates).
    nvme, n = rows["nvme-int8-uib"]["nvme_per_parameter"], rows["nvme-int8-uib"]["n_params"]
    disk = n * (nvme["read"] / 2e9 + nvme["written"] / 1e9)
    assert rows["nvme-int8-uib"]["nvme_bound_s"] == pytest.approx(max(compute, disk))
    assert "nvme_bound_s" not in rows["offload-host"]
    table = proc.stdout.split("predicted (infinity.plan, s) beside measured")[1]
    assert [line.split()[1] for line in table.strip().splitlines()[1:]] == ["device", "offload-host", "nvme-int8-uib",
                                                                          "auto"]


def test_rows_at_one_size_follow_the_rows_at_every_size():
    gpu = _load("gpu.py")
    assert gpu.row_order(["350M", "1.3B"], ["torch", "auto@6.7B", "device", "device@4B"]) == [
        ("350M", "torch"), ("350M", "device"), ("1.3B", "torch"), ("1.3B", "device"), ("6.7B", "auto"),
        ("4B", "device")]
    assert gpu.main(["--configs", "auto@70B"]) == 2


def _dry_session(tmp_path, **env):
    (tmp_path / ".whl").mkdir(exist_ok=True)
    (tmp_path / ".whl" / "deepspeed-0.19.8-py3-none-any.whl").touch()
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "DRY_RUN": "1", "PHASES": "side-by-side", **env})
    assert proc.returncode == 0, proc.stderr
    return [line[3:] for line in proc.stdout.splitlines() if line.startswith("== ")]


def test_the_side_by_side_session_runs_its_phases_in_order_within_its_deadline(tmp_path):
    """DRY_RUN: each phase's command and bound, DeepSpeed's rows where its wheels are, every gpu.py
    command one its parser takes; the session's deadline (under the device's 600 s a command) cuts phases."""
    phases = [line.split(": ", 1) for line in _dry_session(tmp_path)]
    names = [head.split(" (bound ")[0] for head, _ in phases]
    assert names == ["build", "deepspeed-install", "deepspeed-cpu-adam", "gpu-1.3B-offload", "disk", "gpu-6.7B-auto",
                     "gpu-1.3B-nvme"]
    bounds = [int(head.split(" (bound ")[1].split()[0]) for head, _ in phases]
    assert max(bounds) <= 570 and sum(bounds) <= 700, bounds
    commands = dict(zip(names, (command for _, command in phases)))
    for name in ("gpu-1.3B-offload", "gpu-6.7B-auto", "gpu-1.3B-nvme"):
        gpu = _load("gpu.py")
        argv = commands[name].split()[2:]
        args = gpu.build_parser().parse_args(argv)
        gpu.add_modes(args.mode)
        pairs = gpu.row_order(args.sizes.split(","), args.configs.split(","))
        assert gpu._bad_argument(args, pairs) is None and args.predict, (name, argv)
        assert args.timeout < bounds[names.index(name)]
    assert "offload-optimizer,offload-host,ds-zero2,ds-zero3,oo-uib,oh-uib" in commands["gpu-1.3B-offload"]
    assert "auto@6.7B,device@" in commands["gpu-6.7B-auto"] and "ds-zero2" not in commands["gpu-6.7B-auto"]
    assert "--configs nvme " in commands["gpu-1.3B-nvme"] and "--compute-json" in commands["gpu-1.3B-nvme"]
    with_ds = dict(line.split(": ", 1) for line in _dry_session(tmp_path, NVME_DS="1"))
    assert "nvme,ds-infinity" in next(c for h, c in with_ds.items() if h.startswith("gpu-1.3B-nvme"))
    # A deadline too near for any phase: each is skipped, none runs.
    assert all(line.endswith("s left of the session's 15 s") and ": skipped, " in line
               for line in _dry_session(tmp_path, DEADLINE="15"))


def test_gpu_benchmark_rejects_bad_arguments(capsys):
    bench = _load("gpu.py")
    assert bench.main(["--configs", "zero4"]) == 2
    said = capsys.readouterr().err
    assert "unknown config 'zero4'; choose from torch, " in said
    assert all(f" {name}," in said for name in ("device", "auto", "nvme", "ds-zero2")), said
    assert bench.main(["--steps", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_deepspeed_rows_offload_what_their_infinity_peers_offload():
    ds = _load("deepspeed_gpt.py")
    z2, z3 = ds.ds_config(2, 8, "bfloat16", 1e-3, 0.1), ds.ds_config(3, 8, "float32", 1e-3, 0.1)
    assert z2["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in z2["zero_optimization"] and z2["bf16"] == {"enabled": True}
    assert z3["zero_optimization"]["offload_param"]["device"] == "cpu" and "bf16" not in z3
    assert z2["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
    bench = _load("gpu.py")
    assert bench.PEER == {"offload-optimizer": "ds-zero2", "offload-host": "ds-zero3", "nvme": "ds-infinity",
                          "nvme-int8": "ds-infinity", "nvme-int8-uib": "ds-infinity"}


def test_deepspeed_infinity_row_offloads_both_to_nvme_in_infinity_sized_pieces(tmp_path):
    ds = _load("deepspeed_gpt.py")
    cfg = ds.ds_config(3, 1, "bfloat16", 1e-3, 0.0, nvme_dir=str(tmp_path), largest_param_numel=50304 * 2048)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    # max_in_cpu 0: no parameter kept in host memory for good, as with infinity's nvme preset; each
    # buffer holds the largest parameter (GPT 1.3B's embedding), above DeepSpeed's default 1e8.
    assert zero["offload_param"] == dict(zero["offload_optimizer"], max_in_cpu=0, buffer_size=50304 * 2048)
    small = ds.ds_config(3, 1, "bfloat16", 1e-3, 0.0, nvme_dir=str(tmp_path), largest_param_numel=1000)
    assert small["zero_optimization"]["offload_param"]["buffer_size"] == 10 ** 8
    assert cfg["aio"]["block_size"] == 8 << 20 and cfg["aio"]["queue_depth"] == 32
    assert zero["sub_group_size"] == 32 << 20
    # Parameters released after use, as infinity's prefetch.reuse_distance 0 does: DeepSpeed's default
    # keeps a 350M model's parameters gathered into backward, one NVMe buffer each, and runs out.
    assert zero["stage3_max_reuse_distance"] == 0
    with pytest.raises(ValueError, match="--nvme-dir needs --stage 3"):
        ds.ds_config(2, 1, "bfloat16", 1e-3, 0.0, nvme_dir=str(tmp_path))


def test_gpu_benchmark_mode_rows_set_config_keys():
    gpu = _load("gpu.py")
    gpu.add_modes(["oo-sync=offload-optimizer:dpu.overlap=false,dpu.threads=3"])
    assert gpu.MODES["oo-sync"] == ("offload-optimizer", ["dpu.overlap=false", "dpu.threads=3"])
    assert "oo-sync" in gpu.CONFIGS and gpu.PEER["oo-sync"] == "ds-zero2"
    for bad in ("oo", "oo=no-such-preset:dpu.threads=1", "=offload-host:dpu.threads=1"):
        with pytest.raises(ValueError, match="--mode"):
            gpu.add_modes([bad])
