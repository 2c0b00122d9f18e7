"""Training benchmark: step time, tokens/s, peak host memory and tier bytes, per model size and tier config.

    python benchmarks/train.py --sizes 20M,125M,350M --configs host,opt-host,nvme,nvme-noprefetch,nvme-dpu \\
        --steps 4 --batch 2 --seq 128 --nvme-dir /tmp/nvme --json train.json --plot train.png

Every (size, config) pair trains the example GPT (infinity/examples/gpt.py) for a few
steps in its own process (infinity/examples/runs.py, [Note: one process per
configuration]), so the peak RSS of each row is that configuration's alone. The
configs:

- ``torch``: plain PyTorch, ``torch.optim.AdamW(fused=True)``, no offload; run only where
  the model's 16 B/param of states fit in half the free RAM;
- ``host``: parameters and optimizer states in host memory (infinity's baseline);
- ``opt-host``: parameters on the compute device, optimizer states on the host (ZeRO-Offload);
- ``nvme``: parameters and optimizer states on NVMe, prefetch on;
- ``nvme-noprefetch``: the same with ``prefetch.enabled = false``;
- ``nvme-dpu``: the same with ``dpu.enabled = true`` (delayed parameter update).

``--repeat N`` runs the whole grid N times, alternating configs within each size, and
reports medians: the disks here swing 30-50% minute to minute, so figures compared
with each other are measured side by side. The first step of each run (trace
recording, allocation) is not counted. MFU is reported where a GPU is present.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

import psutil

from infinity.examples.gpt import PRESETS, preset
from infinity.examples.meter import format_bytes
from infinity.examples.runs import run_training
from infinity.examples.train_gpt import machine

CONFIGS: dict[str, list[str]] = {
    "torch": ["--engine", "torch"],
    "host": ["--set", 'tiers.params="host"', "--set", 'tiers.optimizer="host"'],
    "opt-host": ["--set", 'tiers.params="device"', "--set", 'tiers.optimizer="host"'],
    "nvme": ["--set", 'tiers.params="nvme"', "--set", 'tiers.optimizer="nvme"'],
    "nvme-noprefetch": ["--set", 'tiers.params="nvme"', "--set", 'tiers.optimizer="nvme"',
                        "--set", "prefetch.enabled=false"],
    "nvme-dpu": ["--set", 'tiers.params="nvme"', "--set", 'tiers.optimizer="nvme"',
                 "--set", "dpu.enabled=true"],
}
# Bytes on NVMe per parameter with the engine as it stands (fp32 compute copy, master, m, v and
# gradient: 20 measured by scale.py, plus margin): a bound used only to skip sizes the disk
# cannot hold.
NVME_BYTES_PER_PARAM = 21
TORCH_BYTES_PER_PARAM = 16




def skip_reason(size: str, config: str, nvme_dir: str) -> str | None:
    """Why (size, config) is not run on this machine, or None."""
    n = preset(size).n_params
    if config == "torch" and n * TORCH_BYTES_PER_PARAM > psutil.virtual_memory().available // 2:
        return "model states do not fit in half the free RAM"
    if config in ("host", "opt-host") and n * 20 > psutil.virtual_memory().available * 0.7:
        return "model states do not fit in host memory"
    if config.startswith("nvme") and n * NVME_BYTES_PER_PARAM > shutil.disk_usage(nvme_dir).free * 0.9:
        return f"needs ~{format_bytes(n * NVME_BYTES_PER_PARAM)} on {nvme_dir}"
    return None


def run_one(size: str, config: str, args, nvme_dir: str) -> dict:
    flags = ["--model-size", size, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
             "--data", "random", "--set", f'precision.dtype="{args.dtype}"', *CONFIGS[config]]
    swap = tempfile.mkdtemp(prefix=f"train-{size}-{config}-", dir=nvme_dir)
    try:
        result = run_training([*flags, "--nvme-dir", swap], timeout=args.timeout)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    row = {"size": size, "config": config, "n_params": preset(size).n_params,
           "states_nbytes": preset(size).states_nbytes(), "error": result.error,
           "wall_seconds": result.wall_seconds, "peak_rss_sampled_bytes": result.peak_rss_sampled_bytes}
    if result.ok:
        r = result.report
        s = r["summary"]
        row["source"] = r["machine"]["source"]
        row["load_average"] = r["machine"]["load_average"]
        row.update(step_seconds=s["step_seconds_median"], tokens_per_second=s["tokens_per_second"],
                   stall_fraction=s["stall_fraction"], compute_seconds=s["compute_seconds"],
                   stall_seconds=s["stall_seconds"], optimizer_seconds=s["optimizer_seconds"],
                   peak_rss_bytes=s["peak_rss_bytes"], tier_peak_bytes=s["tier_peak_bytes"],
                   io_bytes_per_second=s["io_bytes_per_second"], io_read_bytes_per_step=s["io_read_bytes_per_step"],
                   io_write_bytes_per_step=s["io_write_bytes_per_step"], hit_rate=s.get("hit_rate"),
                   mfu=r["mfu"], construct_seconds=r["construct_seconds"], first_loss=s["first_loss"],
                   last_loss=s["last_loss"], samples=[st["seconds"] for st in r["steps"]])
    return row


def _median_rows(rows: list[dict]) -> dict:
    """One row per (size, config): medians of the repeats' figures, samples kept."""
    ok = [r for r in rows if not r["error"]]
    base = dict(rows[0])
    if not ok:
        return base
    base = dict(ok[0])
    for key in ("step_seconds", "tokens_per_second", "stall_fraction", "compute_seconds", "stall_seconds",
                "optimizer_seconds", "peak_rss_bytes", "io_bytes_per_second", "construct_seconds"):
        base[key] = statistics.median(r[key] for r in ok)
    base["repeats"] = len(ok)
    base["samples"] = [s for r in ok for s in r["samples"]]
    return base


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"


def table(rows: list[dict]) -> str:
    head = ("size", "params", "states", "config", "step s", "tok/s", "stall", "peak RSS", "host peak",
            "nvme peak", "I/O GB/s", "MFU", "vs torch")
    torch_step = {r["size"]: r.get("step_seconds") for r in rows if r["config"] == "torch" and not r["error"]}
    lines = []
    for r in rows:
        if r.get("error"):
            lines.append((r["size"], _params(r["n_params"]), format_bytes(r["states_nbytes"]), r["config"],
                          f"- ({r['error'][:60]})", "", "", "", "", "", "", "", ""))
            continue
        peaks = r["tier_peak_bytes"] or {}
        ref = torch_step.get(r["size"])
        lines.append((r["size"], _params(r["n_params"]), format_bytes(r["states_nbytes"]), r["config"],
                      f"{r['step_seconds']:.3f}", f"{r['tokens_per_second']:,.0f}", f"{100 * r['stall_fraction']:.0f}%",
                      format_bytes(r["peak_rss_bytes"]),
                      format_bytes(peaks.get("host")) if peaks else "-",
                      format_bytes(peaks.get("nvme")) if peaks.get("nvme") else "-",
                      f"{r['io_bytes_per_second'] / 1e9:.2f}" if r["io_bytes_per_second"] else "-",
                      f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-",
                      f"{r['step_seconds'] / ref:.2f}x" if ref else "-"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(row) -> str:  # text columns left-aligned, figures right-aligned
        return "  ".join(str(x).rjust(w) if i >= 4 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def plot(rows: list[dict], path: str) -> None:
    """Step time and peak host RSS against parameter count, one line per config, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["n_params"], r["step_seconds"], r["peak_rss_bytes"]) for r in rows
                     if r["config"] == config and not r.get("error"))
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=config)
        ax2.plot(xs, [p[2] / 2**30 for p in pts], marker="o", label=config)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax, label in ((ax1, "step time (s)"), (ax2, "peak host RSS (GiB)")):
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["n_params"] for r in rows if not r.get("error")}))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _params(int(v))))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax2.axhline(psutil.virtual_memory().total / 2**30, color="grey", linestyle="--", linewidth=1)
    ax2.text(ax2.get_xlim()[0], psutil.virtual_memory().total / 2**30, " RAM", va="bottom", color="grey")
    ax1.legend(fontsize=8)
    fig.suptitle("infinity: training step time and host memory vs model size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="20M,125M,350M", help=f"comma-separated, from {', '.join(PRESETS)}")
    p.add_argument("--configs", default="torch,host,opt-host,nvme,nvme-noprefetch,nvme-dpu",
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is not counted)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeat", type=int, default=1, help="run the grid this many times, alternating")
    p.add_argument("--nvme-dir", default=None, help="parent of the swap directories (default: system temp dir)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("--json", default=None, help="write settings, machine, rows and raw samples here")
    p.add_argument("--plot", default=None, help="write a PNG of step time and peak RSS vs model size")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name, known in ((sizes, PRESETS), (configs, CONFIGS)):
        bad = [x for x in name if x not in known]
        if bad:
            print(f"unknown {'size' if known is PRESETS else 'config'} {bad[0]!r}; choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    os.makedirs(nvme_dir, exist_ok=True)
    raw: list[dict] = []
    for rep in range(args.repeat):
        for size in sizes:
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for config in order:
                reason = skip_reason(size, config, nvme_dir)
                if reason:
                    if rep == 0:
                        raw.append({"size": size, "config": config, "n_params": preset(size).n_params,
                                    "states_nbytes": preset(size).states_nbytes(), "error": f"skipped: {reason}"})
                    continue
                row = run_one(size, config, args, nvme_dir)
                row["repeat"] = rep
                raw.append(row)
                status = row["error"] or f"{row['step_seconds']:.3f} s/step, peak RSS {format_bytes(row['peak_rss_bytes'])}"
                print(f"[{rep + 1}/{args.repeat}] {size:>6} {config:<16} {status}", file=sys.stderr, flush=True)
    rows = [_median_rows([r for r in raw if r["size"] == s and r["config"] == c])
            for s in sizes for c in configs if any(r["size"] == s and r["config"] == c for r in raw)]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "machine": machine(), "rows": rows, "raw": raw}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0 if any(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
