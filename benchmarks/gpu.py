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

A ``--configs`` entry ``CONFIG@SIZE`` runs at that size only (``auto@6.7B,device@4B``), after the
entries run at every ``--sizes`` size, in the order given.

``--predict`` sets beside each infinity row what ``infinity.plan``'s step-time model predicts for it
([Note: step-time model] in infinity/plan/step_model.py): the machine profile is probed once, in a
process of its own so that this one never touches the GPU (or read from ``--machine``; disk rates from
``--bench-json``, an ``infinity-bench nvme --json`` file), the config is the row's own, with ``auto``
tiers as its run resolved them, and the compute term is the ``torch`` row's measured step at that
size (its AdamW included; from ``--compute-json``, an earlier run's JSON, when this run has none), else
FLOPs over the probed rate. Rows with NVMe bytes get the bound max(compute, NVMe bytes read / read
rate + written / write rate), the bytes their own ledger's. A table of predicted phases follows the
rows. The JSON is rewritten after every row, so a run cut short keeps the rows it finished.
"""
from __future__ import annotations

import argparse
import json
import os
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
from infinity.examples.train_gpt import machine, provenance

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
    tiers = [r["config"]["tiers"]["params"], r["config"]["tiers"]["optimizer"]] if config != "torch" else None
    transfers = (r.get("engine_stats") or {}).get("transfers")
    per = (transfers or {}).get("per_parameter") or {}
    nvme = {"read": per["nvme_read"], "written": per["nvme_written"]} if per.get("stored_nvme") else None
    return {"error": None, "step_seconds": s["step_seconds_median"], "tokens_per_second": s["tokens_per_second"],
            "peak_rss_bytes": s["peak_rss_bytes"], "gpu_peak_bytes": r.get("gpu_peak_bytes"),
            "flops_per_token": r["model"]["flops_per_token"], "transfers": transfers, "nvme_per_parameter": nvme,
            "tiers": tiers, "first_loss": s["first_loss"], "last_loss": s["last_loss"], "device": r["machine"]["gpu"] or "cpu",
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


def _against(row: dict, seconds: float | None) -> str:
    """A predicted or bounding step and the measured one over it: "0.412 (1.21x)"."""
    return f"{seconds:.3f} ({row['step_seconds'] / seconds:.2f}x)" if seconds else "-"


def table(rows: list[dict]) -> str:
    head = ("size", "config", "s/step", "TFLOPS", "GPU peak", "host RSS", "vs torch", "vs peer",
            "H->D", "D->H", "NVMe r/w", "NVMe B/param r/w", "unpooled / f+b waits", "predicted", "NVMe bound")
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
                      h2d, d2h, nvme_bytes, _nvme_per_parameter(r.get("nvme_per_parameter")), waits,
                      _against(r, (r.get("predicted") or {}).get("step_s")), _against(r, r.get("nvme_bound_s"))))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(row) -> str:
        return "  ".join(str(x).rjust(w) if i >= 2 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def probed_profile(dtype: str, nvme_dir: str, bench_json: str | None):
    """This machine's profile (``infinity.plan.probes``: cached rates, sizes read now), probed in a child
    process, so that this one, which only starts the rows, never holds a CUDA context."""
    from infinity.plan import MachineProfile

    code = ("import json, sys\nfrom infinity.config import load_config\nfrom infinity.plan.probes import machine_profile\n"
            "p = machine_profile(load_config(None).tiers.compute_device(), sys.argv[1], nvme_paths=(sys.argv[2],), "
            "bench_json=sys.argv[3] or None)\nprint(json.dumps(p.to_dict()))")
    out = subprocess.run([sys.executable, "-c", code, dtype, nvme_dir, bench_json or ""], capture_output=True,
                         text=True, timeout=300, env=_child_env())
    if out.returncode != 0:
        raise RuntimeError(f"probing the machine failed: {out.stderr.strip()[-500:]}")
    return MachineProfile.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))


class Predictor:
    """``infinity.plan``'s predicted step and the NVMe bound beside each row (see ``--predict`` above)."""

    def __init__(self, args, nvme_dir: str) -> None:
        from infinity.plan import MachineProfile

        self.args, self.nvme_dir = args, nvme_dir
        self.profile = (MachineProfile.from_file(args.machine) if args.machine
                        else probed_profile(args.dtype, nvme_dir, args.bench_json))
        self.compute: dict[str, float] = {}      # size -> the torch row's step
        if args.compute_json:
            with open(args.compute_json) as f:
                self.compute = {r["size"]: r["step_seconds"] for r in json.load(f)["rows"]
                                if r["config"] == "torch" and not r.get("error")}

    def annotate(self, row: dict, raw: list[dict]) -> None:
        """Add ``predicted`` (infinity rows) and ``nvme_bound_s`` (rows with NVMe bytes) to ``row``."""
        if row["config"] == "torch":
            self.compute[row["size"]] = row["step_seconds"]
        compute = self.compute.get(row["size"], 0.0)
        if row["config"] not in DEEPSPEED and row["config"] != "torch":
            row["predicted"] = self.predict(row, compute)
        nvme, prof = row.get("nvme_per_parameter"), self.profile
        if nvme and prof.disk_read_gbps > 0 and prof.disk_write_gbps > 0:
            disk = row["n_params"] * (nvme["read"] / (prof.disk_read_gbps * 1e9) +
                                      nvme["written"] / (prof.disk_write_gbps * 1e9))
            row["nvme_bound_s"] = max(compute, disk)
            row["nvme_bound_terms_s"] = {"compute": compute, "nvme": disk}

    def predict(self, row: dict, compute_s: float) -> dict:
        """The step-time model's prediction for the row's config, model and tokens."""
        import torch

        from infinity.config import load_config
        from infinity.examples.train_gpt import build_model, parse_overrides
        from infinity.plan import Workload, plan
        from infinity.plan.census import take_census

        base, extra = MODES.get(row["config"], (row["config"], []))
        overrides = parse_overrides([f'precision.dtype="{self.args.dtype}"', *extra])
        tiers = overrides.setdefault("tiers", {})
        tiers["nvme_path"] = self.nvme_dir
        if row.get("tiers"):        # "auto" as the run resolved it
            tiers.update(params=row["tiers"][0], optimizer=row["tiers"][1])
        cfg = load_config(base, overrides=overrides)
        shape = preset(row["size"])
        with torch.device("meta"):
            meta = build_model(preset(row["size"], seq_len=max(shape.seq_len, self.args.seq)))
        census = take_census(meta, cfg, cfg.precision.itemsize)
        workload = Workload(tokens=self.args.batch * self.args.seq, compute_s=compute_s)
        predicted = plan(census, cfg, machine=self.profile, check_fit=False, workload=workload).prediction
        return {**predicted.to_dict(), "compute_s": compute_s, "machine": self.profile.name,
                "compute_from": "the torch row's step" if compute_s else "FLOPs / the probed device_flops"}


def prediction_table(rows: list[dict]) -> str:
    """Per infinity row: the tiers, the predicted phases, schedule and governing resource, predicted and
    measured step."""
    head = ("size", "config", "params/optimizer", "forward", "backward", "update", "schedule", "governs",
            "predicted", "measured", "measured/predicted", "compute from")
    lines = []
    for r in rows:
        p = r.get("predicted")
        if r.get("error") or not p:
            continue
        ph = p["phases_s"]
        lines.append((r["size"], r["config"], "/".join(r.get("tiers") or ["-"]), f"{ph['forward']:.3f}",
                      f"{ph['backward']:.3f}", f"{ph['update']:.3f}", p["schedule"], p["governing"],
                      f"{p['step_s']:.3f}", f"{r['step_seconds']:.3f}", f"{r['step_seconds'] / p['step_s']:.2f}x",
                      p["compute_from"]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    return "\n".join(["", "predicted (infinity.plan, s) beside measured",
                      *("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *lines])])


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
    p.add_argument("--predict", action="store_true",
                   help="set infinity.plan's predicted step (and the NVMe bound) beside each row")
    p.add_argument("--machine", default=None, help="with --predict: a machine profile file (default: probed)")
    p.add_argument("--bench-json", default=None,
                   help="with --predict: an infinity-bench nvme --json file, the disk's rates")
    p.add_argument("--compute-json", default=None,
                   help="with --predict: an earlier gpu.py --json whose torch rows give the compute term")
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


def row_order(sizes: list[str], entries: list[str]) -> list[tuple[str, str]]:
    """(size, config) in running order: plain entries at every size (size by size), then ``CONFIG@SIZE``
    entries as given."""
    plain = [e for e in entries if "@" not in e]
    return [(s, c) for s in sizes for c in plain] + [tuple(reversed(e.split("@", 1))) for e in entries if "@" in e]


def _bad_argument(args, pairs) -> str | None:
    for names, known, what in (([s for s, _ in pairs], PRESETS, "size"), ([c for _, c in pairs], CONFIGS, "config")):
        bad = [x for x in names if x not in known]
        if bad:
            return f"unknown {what} {bad[0]!r}; choose from {', '.join(known)}"
    if args.steps < 2:
        return f"--steps {args.steps}: at least 2 (the first step is not counted)"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        add_modes(args.mode)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    pairs = row_order(sizes, [c.strip() for c in args.configs.split(",") if c.strip()])
    said = _bad_argument(args, pairs)
    if said:
        print(said, file=sys.stderr)
        return 2
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    os.makedirs(nvme_dir, exist_ok=True)
    no_deepspeed = deepspeed_missing(args.deepspeed_python) if any(c in DEEPSPEED for _, c in pairs) else None
    predictor = None
    if args.predict:
        try:
            predictor = Predictor(args, nvme_dir)
        except (RuntimeError, OSError, ValueError) as exc:     # the rows still run, without predictions
            print(f"--predict: {exc}", file=sys.stderr)
    raw: list[dict] = []
    for rep in range(args.repeat):
        for size, config in pairs if rep % 2 == 0 else list(reversed(pairs)):
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
            if predictor is not None and not row["error"]:
                try:
                    predictor.annotate(row, raw)
                except Exception as exc:     # noqa: BLE001  a prediction that fails leaves the row measured
                    row["predicted_error"] = f"{type(exc).__name__}: {exc}"
                    print(f"--predict {size} {config}: {row['predicted_error']}", file=sys.stderr)
            write_json(args, argv, raw, pairs, complete=False)
    rows = _rows(raw, pairs)
    print(table(rows))
    if predictor is not None:
        print(prediction_table(rows))
    write_json(args, argv, raw, pairs, complete=True)
    return 0 if any(not r.get("error") for r in rows) else 1


def _rows(raw: list[dict], pairs) -> list[dict]:
    return [median_row([r for r in raw if (r["size"], r["config"]) == pair])
            for pair in dict.fromkeys(pairs) if any((r["size"], r["config"]) == pair for r in raw)]


def _measured_on(raw: list[dict]) -> dict:
    """``machine()`` without asking CUDA here, whose context would take GPU memory from every later row:
    the GPU is the one the rows so far ran on."""
    import platform

    import psutil
    import torch

    from infinity.examples.train_gpt import source_revision

    gpu = next((r["device"] for r in raw if r.get("device") not in (None, "cpu")), None)
    return {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total, "load_average": os.getloadavg(),
            "source": source_revision(), "gpu": gpu}


def write_json(args, argv: list[str], raw: list[dict], pairs, complete: bool) -> None:
    """The settings, machine, rows and raw runs so far (``complete`` false: the run goes on, or was cut)."""
    if not args.json:
        return
    measured_on = machine() if complete else _measured_on(raw)
    tmp = f"{args.json}.tmp"
    with open(tmp, "w") as f:
        json.dump({"provenance": provenance("benchmarks/gpu.py", argv, measured_on), "settings": vars(args), "machine": measured_on,
                   "complete": complete, "rows": _rows(raw, pairs), "raw": raw}, f, indent=1)
    os.replace(tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
