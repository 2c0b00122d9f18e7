"""What ``infinity.trace`` costs: steady steps of the tiny example GPT on a preset, traced and not, side by side.

    python benchmarks/step_trace.py --steps 8 --json trace-overhead.json
    python benchmarks/step_trace.py --steps 3 --trace step.json --nvme-bandwidth bench.json
    python -m infinity.timeline.draw step.json step.svg

Steps alternate, one plain then one traced (each traced step writes its file), after two warm-up steps,
so both kinds see the same disk cache and the same neighbours; the table gives the median and the least
wall time of each, and the CPU time of the process (every thread: the trace's own poller included);
"in the block" is the traced step alone, without the plan made before it and the file written after.
On a shared, loaded machine the least is the steadier figure. ``--trace PATH`` keeps the last traced
step's file (the one the docs draw, docs/img/step-trace.svg). The plain steps are what a run without tracing costs: the trace module
installs nothing outside its block.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinity
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset


def run(steps: int, layers: int, config: str, nvme_dir: Path, trace_out: Path | None, bandwidth) -> dict:
    """Time ``steps`` plain and ``steps`` traced steps, interleaved; returns the samples and the settings."""
    shape = preset("tiny", n_layer=layers)
    torch.manual_seed(0)
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(nvme_dir)}, "precision": {"dtype": "bfloat16"}}
    with infinity.Init(load_config(config, overrides=overrides)):
        model = GPT(shape)
    opt = infinity.AdamW(model, lr=1e-3)
    data = batches("random", 4, 32, shape.vocab_size, seed=0)

    def step() -> None:
        x, y = next(data)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()       # the traced step waits for its update: so does the plain one

    step()
    step()
    plain, traced, events, plain_cpu, traced_cpu, inside = [], [], [], [], [], []
    scratch = Path(tempfile.mkdtemp(prefix="step-trace-"))
    try:
        for i in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            plain.append(time.perf_counter() - t0)
            plain_cpu.append(time.process_time() - c0)
            path = trace_out if trace_out is not None and i == steps - 1 else scratch / "step.json"
            t0, c0 = time.perf_counter(), time.process_time()
            with infinity.trace(model, path, nvme_bandwidth=bandwidth) as timeline:
                t1 = time.perf_counter()
                step()
                inside.append(time.perf_counter() - t1)
            traced.append(time.perf_counter() - t0)
            traced_cpu.append(time.process_time() - c0)
            events.append(len(timeline.spans))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        infinity.release(model)
    return {"plain_s": plain, "traced_s": traced, "plain_cpu_s": plain_cpu, "traced_cpu_s": traced_cpu,
            "inside_s": inside,
            "spans": events}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="plain and traced steps each (default 6)")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the tiny GPT (default 2)")
    parser.add_argument("--config", default="nvme", help="preset or config file (default nvme)")
    parser.add_argument("--nvme", type=Path, default=None, help="NVMe directory (default: a temporary one)")
    parser.add_argument("--trace", type=Path, default=None, help="keep the last traced step's file here")
    parser.add_argument("--nvme-bandwidth", default=None,
                        help="for the plan track: READ,WRITE GB/s or an infinity-bench nvme --json file")
    parser.add_argument("--json", type=Path, default=None, help="write the settings and raw samples here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    bandwidth = args.nvme_bandwidth
    if bandwidth is not None and "," in bandwidth:
        bandwidth = tuple(float(v) for v in bandwidth.split(","))
    nvme = args.nvme or Path(tempfile.mkdtemp(prefix="step-trace-nvme-"))
    nvme.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args.steps, args.layers, args.config, nvme, args.trace, bandwidth)
    finally:
        if args.nvme is None:
            shutil.rmtree(nvme, ignore_errors=True)
    plain, traced = statistics.median(result["plain_s"]), statistics.median(result["traced_s"])
    ratios = [t / p for p, t in zip(result["plain_s"], result["traced_s"])]
    print(f"{'':>12} {'median s':>9} {'min s':>8} {'CPU s (median)':>15}")
    for name in ("plain", "traced"):
        wall, cpu = result[f"{name}_s"], result[f"{name}_cpu_s"]
        print(f"{name:>12} {statistics.median(wall):>9.4f} {min(wall):>8.4f} {statistics.median(cpu):>15.4f}")
    inside = result["inside_s"]
    print(f"{'in the block':>12} {statistics.median(inside):>9.4f} {min(inside):>8.4f} {'':>15}")
    print(f"paired wall ratio (median) {statistics.median(ratios):.3f}; min traced / min plain "
          f"{min(result['traced_s']) / min(result['plain_s']):.3f}; spans per traced step "
          f"{statistics.median(result['spans']):.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "settings": {"steps": args.steps, "layers": args.layers, "config": args.config,
                         "nvme_bandwidth": args.nvme_bandwidth},
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "platform": platform.platform(), "cpus": torch.get_num_threads()},
            "samples": result, "median_plain_s": plain, "median_traced_s": traced,
            "median_paired_ratio": statistics.median(ratios)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
