"""GPU training benchmark: plain torch, every infinity preset and DeepSpeed ZeRO offload, side by side.

    python benchmarks/gpu.py --sizes 350M,1.3B --batch 8 --seq 1024 --dtype bfloat16 \\
        --steps 6 --repeat 3 --json gpu.json

Rows, all training the example GPT (infinity/examples/gpt.py) on the same batches with
AdamW, each in its own process ([Note: one process per configuration] in
infinity/examples/runs.py), alternating within each repeat:

- ``torch``: plain PyTorch on the GPU, fused AdamW, autocast to ``--dtype``;
- ``device``, ``offload-optimizer``, ``offload-host``, ``nvme``: infinity's shipped presets
  (``infinity-config --preset NAME`` shows each);
- ``nvme-int8``, ``nvme-int8-uib``: the ``nvme`` preset with int8 Adam moments, and with
  them stepped during backward too (``MODES``: the ``--set`` keys each adds);
- ``ds-zero2``: DeepSpeed ZeRO-2 with ``offload_optimizer`` on the CPU (the peer of
  ``offload-optimizer``); ``ds-zero3``: ZeRO-3 with params and optimizer offloaded to the CPU
  (the peer of ``offload-host``); ``ds-infinity``: ZeRO-3 with both offloaded to NVMe, swap
  files under ``--nvme-dir`` (ZeRO-Infinity, the peer of the NVMe rows); see
  benchmarks/deepspeed_gpt.py. They run with
  ``--deepspeed-python`` (default: this interpreter) when it imports ``deepspeed``, else their
  rows say how to install it.

Per row: seconds per step (median of the steps after the first, median over repeats),
achieved TFLOPS (6N + attention FLOPs per token), GPU peak memory allocated, host peak RSS,
and for infinity rows the transfer ledger of the last step (``infinity.stats(model)["transfers"]``:
bytes host->device, device->host, NVMe->host, host->NVMe; copies not from the pinned pools; host
waits in forward/backward). NVMe rows add NVMe bytes read / written per parameter and step:
infinity's from that ledger (``per_parameter``), DeepSpeed's from the bytes its process read from
and wrote to storage (``/proc/self/io``), a mean over the steps after the first two. Ratios:
against ``torch``, and each preset against its DeepSpeed peer. Without a GPU everything runs on
the CPU, which checks the benchmark itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from infinity.config import presets
from infinity.examples.gpt import PRESETS, preset
from infinity.examples.meter import format_bytes
from infinity.examples.runs import run_training
from infinity.examples.train_gpt import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# DeepSpeed row: (ZeRO stage, where it offloads).
DEEPSPEED = {"ds-zero2": (2, "cpu"), "ds-zero3": (3, "cpu"), "ds-infinity": (3, "nvme")}
# infinity rows beyond the presets: (preset, --set flags added to it).
MODES = {
    "nvme-int8": ("nvme", ['optimizer.state_dtype="int8"']),
    "nvme-int8-uib": ("nvme", ['optimizer.state_dtype="int8"', "optimizer.update_in_backward=true"]),
}
PEER = {"offload-optimizer": "ds-zero2", "offload-host": "ds-zero3",
        "nvme": "ds-infinity", "nvme-int8": "ds-infinity", "nvme-int8-uib": "ds-infinity"}
CONFIGS = ["torch", *presets(), *MODES, *DEEPSPEED]
INSTALL_DEEPSPEED = ("deepspeed is not importable by {python}: pip install deepspeed==0.19.8 "
                     "(DS_BUILD_OPS=0 builds its CPU Adam at first use), or pass --deepspeed-python")


def deepspeed_missing(python: str) -> str | None:
    """Why ``python`` cannot run the DeepSpeed rows, or None when it imports deepspeed."""
    try:
        out = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True, timeout=300,
                             env=_child_env())
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python}: {exc}"
    return None if out.returncode == 0 else INSTALL_DEEPSPEED.format(python=python)


def _child_env() -> dict:
    """This checkout first on the child's path, so an interpreter of its own still imports infinity."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def run_deepspeed(size: str, config: str, args, nvme_dir: str) -> dict:
    """One DeepSpeed row: benchmarks/deepspeed_gpt.py in its own process, its report or its error."""
    stage, offload = DEEPSPEED[config]
    with tempfile.TemporaryDirectory(prefix="gpu-ds-") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"gpu-{size}-{config}-", dir=nvme_dir) as swap:
        report_path, log = os.path.join(tmp, "report.json"), os.path.join(tmp, "log.txt")
        argv = [args.deepspeed_python, os.path.join(HERE, "deepspeed_gpt.py"), "--stage", str(stage),
                "--model-size", size, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                "--dtype", args.dtype, "--json", report_path]
        if offload == "nvme":
            argv += ["--nvme-dir", swap]
        t0 = time.perf_counter()
        with open(log, "w") as out:
            try:
                proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=_child_env(),
                                      timeout=args.timeout)
                error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.timeout:.0f} s"
        if error:
            with open(log) as f:
                tail = " | ".join(line.strip() for line in f.read().strip().splitlines()[-4:])
            return {"error": f"{error}: {tail}", "wall_seconds": time.perf_counter() - t0}
        with open(report_path) as f:
            report = json.load(f)
    s = report["summary"]
    n_params = report["model"]["n_params"]
    nvme = None
    if offload == "nvme":
        nvme = {"read": s["disk_read_bytes_per_step"] / n_params, "written": s["disk_write_bytes_per_step"] / n_params}
    return {"error": None, "step_seconds": s["step_seconds_median"], "tokens_per_second": s["tokens_per_second"],
            "peak_rss_bytes": report["peak_rss_bytes"], "gpu_peak_bytes": report["gpu_peak_bytes"],
            "flops_per_token": report["model"]["flops_per_token"], "transfers": None, "nvme_per_parameter": nvme,
            "first_loss": s["first_loss"], "last_loss": s["last_loss"], "device": report["machine"]["gpu"] or "cpu",
            "deepspeed_version": report["deepspeed_version"], "samples": [st["seconds"] for st in report["steps"]],
            "losses": [st.get("loss") for st in report["steps"]]}


def run_infinity(size: str, config: str, args, nvme_dir: str) -> dict:
    """One torch, preset or mode row: train_gpt in its own process."""
    flags = ["--model-size", size, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
             "--data", "random", "--set", f'precision.dtype="{args.dtype}"']
    if config == "torch":
        flags += ["--engine", "torch"]
    else:
        config_name, extra = MODES.get(config, (config, []))
        flags += ["--config", config_name]
        for item in extra:
            flags += ["--set", item]
    swap = tempfile.mkdtemp(prefix=f"gpu-{size}-{config}-", dir=nvme_dir)
    try:
        result = run_training([*flags, "--nvme-dir", swap], timeout=args.timeout)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if not result.ok:
        return {"error": result.error, "wall_seconds": result.wall_seconds}
    r = result.report
    s = r["summary"]
    transfers = (r.get("engine_stats") or {}).get("transfers")
    per = (transfers or {}).get("per_parameter") or {}
    nvme = {"read": per["nvme_read"], "written": per["nvme_written"]} if per.get("stored_nvme") else None
    return {"error": None, "step_seconds": s["step_seconds_median"], "tokens_per_second": s["tokens_per_second"],
            "peak_rss_bytes": s["peak_rss_bytes"], "gpu_peak_bytes": r.get("gpu_peak_bytes"),
            "flops_per_token": r["model"]["flops_per_token"], "transfers": transfers, "nvme_per_parameter": nvme,
            "first_loss": s["first_loss"], "last_loss": s["last_loss"], "device": r["machine"]["gpu"] or "cpu",
            "samples": [st["seconds"] for st in r["steps"]], "losses": [st["loss"] for st in r["steps"]]}


def median_row(rows: list[dict]) -> dict:
    """One row per (size, config): medians over repeats of the timings and memory, the last ledger."""
    ok = [r for r in rows if not r["error"]]
    if not ok:
        return dict(rows[-1])
    out = dict(ok[-1])
    for key in ("step_seconds", "tokens_per_second", "peak_rss_bytes"):
        out[key] = statistics.median(r[key] for r in ok)
    if all(r.get("gpu_peak_bytes") is not None for r in ok):
        out["gpu_peak_bytes"] = statistics.median(r["gpu_peak_bytes"] for r in ok)
    out["tflops"] = out["flops_per_token"] * out["tokens_per_second"] / 1e12
    out["repeats"] = len(ok)
    out["step_seconds_per_repeat"] = [r["step_seconds"] for r in ok]
    return out


def _ledger(t: dict | None) -> tuple[str, str, str, str]:
    """(h->d, d->h, nvme r/w, unpooled / waits) cells of a transfer ledger."""
    if not t:
        return "-", "-", "-", "-"
    waits = t["host_waits"]
    return (format_bytes(t["host_to_device"]["bytes"]), format_bytes(t["device_to_host"]["bytes"]),
            f"{format_bytes(t['nvme_to_host']['bytes'])}/{format_bytes(t['host_to_nvme']['bytes'])}",
            f"{t['unpooled']} / {waits['forward'] + waits['backward']}")


def _nvme_per_parameter(nvme: dict | None) -> str:
    """The "read/written" NVMe bytes per parameter and step of an NVMe row, "-" for the others."""
    return f"{nvme['read']:.2f}/{nvme['written']:.2f}" if nvme else "-"


def table(rows: list[dict]) -> str:
    head = ("size", "config", "s/step", "TFLOPS", "GPU peak", "host RSS", "vs torch", "vs peer",
            "H->D", "D->H", "NVMe r/w", "NVMe B/param r/w", "unpooled / f+b waits")
    step = {(r["size"], r["config"]): r.get("step_seconds") for r in rows if not r.get("error")}
    lines = []
    for r in rows:
        if r.get("error"):
            lines.append((r["size"], r["config"], f"- ({r['error'][:90]})", *[""] * (len(head) - 3)))
            continue
        ref, peer = step.get((r["size"], "torch")), step.get((r["size"], PEER.get(r["config"])))
        h2d, d2h, nvme_bytes, waits = _ledger(r.get("transfers"))
        lines.append((r["size"], r["config"], f"{r['step_seconds']:.3f}", f"{r['tflops']:.2f}",
                      format_bytes(r["gpu_peak_bytes"]) if r.get("gpu_peak_bytes") is not None else "-",
                      format_bytes(r["peak_rss_bytes"]),
                      f"{r['step_seconds'] / ref:.2f}x" if ref else "-",
                      f"{r['step_seconds'] / peer:.2f}x" if peer else "-",
                      h2d, d2h, nvme_bytes, _nvme_per_parameter(r.get("nvme_per_parameter")), waits))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(row) -> str:
        return "  ".join(str(x).rjust(w) if i >= 2 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="350M,1.3B", help=f"comma-separated, from {', '.join(PRESETS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is not counted)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeat", type=int, default=1, help="run every row this many times, alternating the order")
    p.add_argument("--nvme-dir", default=None, help="parent of the swap directories (default: system temp dir)")
    p.add_argument("--deepspeed-python", default=sys.executable,
                   help="interpreter for the DeepSpeed rows (one that imports deepspeed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("--json", default=None, help="write settings, machine, rows and raw runs here")
    p.add_argument("--mode", action="append", default=[], metavar="NAME=PRESET:SECTION.KEY=VALUE[,...]",
                   help="an extra row: a preset with config keys set, e.g. "
                        "oo-sync=offload-optimizer:dpu.overlap=false (repeatable; name it in --configs)")
    return p


def add_modes(specs: list[str]) -> None:
    """Register each ``--mode`` as a row (``MODES``, ``CONFIGS``, its preset's DeepSpeed peer)."""
    for spec in specs:
        name, eq, rest = spec.partition("=")
        base, colon, keys = rest.partition(":")
        if not eq or not name or base not in presets():
            raise ValueError(f"--mode {spec!r}: expected NAME=PRESET:SECTION.KEY=VALUE[,...] with PRESET one of "
                             f"{', '.join(presets())}")
        MODES[name] = (base, [k for k in keys.split(",") if k] if colon else [])
        if name not in CONFIGS:
            CONFIGS.append(name)
        if base in PEER:
            PEER[name] = PEER[base]


def provenance(argv: list[str], measured_on: dict) -> dict:
    """When, on what, at which commit and by which command a run was measured: what every stored run in
    docs/benchmarks/data/ carries, so this file can be added there as it is (benchmarks/plots.py)."""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{measured_on['gpu'] or 'CPU'}, {measured_on['cpus']} cores, {measured_on['host']}",
            "commit": measured_on["source"], "command": shlex.join(["python", "benchmarks/gpu.py", *argv])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        add_modes(args.mode)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for names, known, what in ((sizes, PRESETS, "size"), (configs, CONFIGS, "config")):
        bad = [x for x in names if x not in known]
        if bad:
            print(f"unknown {what} {bad[0]!r}; choose from {', '.join(known)}", file=sys.stderr)
            return 2
    if args.steps < 2:
        print(f"--steps {args.steps}: at least 2 (the first step is not counted)", file=sys.stderr)
        return 2
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    os.makedirs(nvme_dir, exist_ok=True)
    no_deepspeed = deepspeed_missing(args.deepspeed_python) if any(c in DEEPSPEED for c in configs) else None
    raw: list[dict] = []
    for rep in range(args.repeat):
        for size in sizes:
            for config in configs if rep % 2 == 0 else list(reversed(configs)):
                if config in DEEPSPEED and no_deepspeed:
                    if rep == 0:
                        raw.append({"size": size, "config": config, "repeat": rep, "error": no_deepspeed})
                    continue
                row = (run_deepspeed(size, config, args, nvme_dir) if config in DEEPSPEED
                       else run_infinity(size, config, args, nvme_dir))
                row.update(size=size, config=config, repeat=rep, n_params=preset(size).n_params)
                raw.append(row)
                status = row["error"] or f"{row['step_seconds']:.3f} s/step"
                print(f"[{rep + 1}/{args.repeat}] {size:>6} {config:<18} {status}", file=sys.stderr, flush=True)
    rows = [median_row([r for r in raw if r["size"] == s and r["config"] == c])
            for s in sizes for c in configs if any(r["size"] == s and r["config"] == c for r in raw)]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            measured_on = machine()
            json.dump({"provenance": provenance(argv, measured_on), "settings": vars(args), "machine": measured_on,
                       "rows": rows, "raw": raw}, f, indent=1)
    return 0 if any(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
