"""Scale benchmark: the largest model this machine trains with everything on NVMe, and host RSS per size.

    python benchmarks/scale.py --nvme-dir /tmp/nvme --start 50M --factor 2 --json scale.json

Starting from ``--start`` parameters, each size is ``--factor`` times the last (GPT
shapes from ``shape_for_params``: depth and width grow together), and trains
``--steps`` step(s) with parameters and optimizer states on NVMe, in its own process
(infinity/examples/runs.py, [Note: one process per configuration]). The ladder stops
at the first size whose NVMe files would not fit in the free disk (bytes per
parameter measured on the previous size, ``--disk-bytes-per-param`` before the
first), above ``--max-params``, or at the first failure. For each size it reports
the model states (fp32 master + Adam m, v + compute copy: 16 B/param) against the
machine's RAM, the peak host RSS, the NVMe bytes used (and per parameter), the NVMe
bytes read and written per parameter in a steady step (the median over the steps after
the first) and the step time; at the end,
how much the peak RSS grew from the smallest to the largest size against how much
the model states grew (flat RSS = the host holds only fixed-size buffers).
``--sizes 125M,1.3B,4B`` (presets or parameter counts) replaces the ladder;
``--fixed-width D`` grows only the depth at d_model = D, so the largest layer (and
the token embedding) stays the same size while the model grows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import psutil

from infinity.examples.gpt import PRESETS, shape_for_params
from infinity.examples.meter import format_bytes
from infinity.examples.runs import run_training, shape_args


# Left free on the NVMe path beyond the estimate (which already carries 2% over the bytes per
# parameter measured on the last size): the files are preallocated, so the estimate is close.
DISK_HEADROOM_BYTES = 1 << 30


def _count(text: str) -> int:
    """``"50M"``, ``"1.3B"``, ``"4e9"`` -> parameters."""
    t = text.strip()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:].upper())
    try:
        return int(float(t[:-1]) * scale) if scale else int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a parameter count like 50M, 1.3B or 4e9") from None


def _label(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def shape_of(size: str, vocab: int, seq_len: int, d_model: int | None = None):
    """A preset name, or a parameter count turned into a shape."""
    if size in PRESETS:
        return PRESETS[size]
    return shape_for_params(_count(size), vocab_size=vocab, seq_len=seq_len, d_model=d_model)


def run_size(cfg, args, nvme_dir: str, label: str) -> dict:
    swap = tempfile.mkdtemp(prefix=f"scale-{label}-", dir=nvme_dir)
    flags = [*shape_args(cfg), "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
             "--data", "repeat", "--lr", "1e-3", "--set", 'tiers.params="nvme"', "--set", 'tiers.optimizer="nvme"',
             "--set", f'precision.dtype="{args.dtype}"', "--nvme-dir", swap, *args.extra]
    try:
        result = run_training(flags, timeout=args.timeout, log_path=args.log)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    ram = psutil.virtual_memory().total
    row = {"label": label, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_params": cfg.n_params,
           "states_nbytes": cfg.states_nbytes(), "states_over_ram": cfg.states_nbytes() / ram,
           "error": result.error, "wall_seconds": result.wall_seconds,
           "peak_rss_sampled_bytes": result.peak_rss_sampled_bytes}
    if result.ok:
        r, s = result.report, result.report["summary"]
        nvme_peak = (s.get("tier_peak_bytes") or {}).get("nvme") or 0
        row.update(peak_rss_bytes=s["peak_rss_bytes"], nvme_peak_bytes=nvme_peak,
                   nvme_bytes_per_param=nvme_peak / cfg.n_params,
                   nvme_read_per_param_step=(s.get("io_read_bytes_per_step") or 0) / cfg.n_params,
                   nvme_written_per_param_step=(s.get("io_write_bytes_per_step") or 0) / cfg.n_params, construct_seconds=r["construct_seconds"],
                   step_seconds=[st["seconds"] for st in r["steps"]], losses=[st["loss"] for st in r["steps"]],
                   rss_per_step=[st["rss_bytes"] for st in r["steps"]],
                   peak_rss_build_bytes=r["peak_rss_after_build_bytes"],
                   peak_rss_forward_backward_bytes=[st["peak_rss_forward_backward_bytes"] for st in r["steps"]],
                   peak_rss_per_step=[st["peak_rss_bytes"] for st in r["steps"]],
                   source=r["machine"]["source"], load_average=r["machine"]["load_average"])
    return row


def table(rows: list[dict]) -> str:
    head = ("size", "layers x d", "params", "states", "states/RAM", "peak RSS", "RSS/RAM", "peak in build",
            "NVMe used", "NVMe B/param", "NVMe r+w B/param/step", "build s", "step s", "loss", "status")
    ram = psutil.virtual_memory().total
    out = []
    for r in rows:
        ok = not r["error"]
        out.append((r["label"], f"{r['n_layer']} x {r['d_model']}", _label(r["n_params"]),
                    format_bytes(r["states_nbytes"]), f"{r['states_over_ram']:.2f}",
                    format_bytes(r["peak_rss_bytes"]) if ok else "-",
                    f"{r['peak_rss_bytes'] / ram:.3f}" if ok else "-",
                    format_bytes(r["peak_rss_build_bytes"]) if ok else "-",
                    format_bytes(r["nvme_peak_bytes"]) if ok else "-",
                    f"{r['nvme_bytes_per_param']:.2f}" if ok else "-",
                    (f"{r['nvme_read_per_param_step']:.1f}+{r['nvme_written_per_param_step']:.1f}="
                     f"{r['nvme_read_per_param_step'] + r['nvme_written_per_param_step']:.1f}") if ok else "-",
                    f"{r['construct_seconds']:.1f}" if ok else "-",
                    f"{r['step_seconds'][-1]:.1f}" if ok else "-",
                    " > ".join(f"{x:.3f}" for x in r["losses"]) if ok else "-",
                    "ok" if ok else r["error"][:70]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *out)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in (head, ["-" * w for w in widths], *out)]
    return "\n".join(lines)


def flatness(rows: list[dict]) -> dict | None:
    """RSS growth vs states growth between the smallest and the largest size that trained."""
    ok = [r for r in rows if not r["error"]]
    if len(ok) < 2:
        return None
    lo, hi = min(ok, key=lambda r: r["n_params"]), max(ok, key=lambda r: r["n_params"])
    return {"smallest": lo["label"], "largest": hi["label"],
            "states_growth": hi["states_nbytes"] / lo["states_nbytes"],
            "rss_growth": hi["peak_rss_bytes"] / lo["peak_rss_bytes"] - 1.0,
            "largest_states_over_ram": hi["states_over_ram"], "largest_peak_rss_bytes": hi["peak_rss_bytes"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nvme-dir", default=None, help="where the swap files go (default: system temp dir)")
    p.add_argument("--start", default="50M", help="first size, in parameters (default 50M)")
    p.add_argument("--factor", type=float, default=2.0, help="each size is this many times the last")
    p.add_argument("--max-params", default=None, help="stop above this many parameters (default: disk-bound)")
    p.add_argument("--sizes", default=None, help="explicit comma-separated sizes (presets or counts) instead")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary of the ladder's shapes")
    p.add_argument("--fixed-width", type=int, default=None,
                   help="keep d_model fixed and grow only the depth (default: GPT-3-like, both grow)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--disk-bytes-per-param", type=float, default=21.0,
                   help="NVMe bytes per parameter assumed before the first size is measured")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per size before it is killed")
    p.add_argument("--log", default=None, help="append each run's output (progress lines) to this file")
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs="*", help="after --, more train_gpt flags (e.g. --set prefetch.enabled=false)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    os.makedirs(nvme_dir, exist_ok=True)
    limit = _count(args.max_params) if args.max_params else None
    per_param = args.disk_bytes_per_param
    rows: list[dict] = []
    stop = None
    if args.sizes:
        plan = [(s.strip(), shape_of(s.strip(), args.vocab, args.seq, args.fixed_width))
                for s in args.sizes.split(",") if s.strip()]
    else:
        plan = None
    target = _count(args.start)
    while True:
        if plan is not None:
            if len(rows) == len(plan):
                break
            label, cfg = plan[len(rows)]
        else:
            cfg = shape_for_params(target, vocab_size=args.vocab, seq_len=args.seq, d_model=args.fixed_width)
            label = _label(cfg.n_params)
            if limit is not None and cfg.n_params > limit:
                stop = f"next size {label} is above --max-params"
                break
        free = shutil.disk_usage(nvme_dir).free
        need = cfg.n_params * per_param
        if need > free - DISK_HEADROOM_BYTES:
            stop = (f"next size {label} needs ~{format_bytes(need)} on {nvme_dir} "
                    f"({per_param:.1f} B/param), {format_bytes(free)} free")
            break
        row = run_size(cfg, args, nvme_dir, label)
        rows.append(row)
        status = row["error"] or (f"peak RSS {format_bytes(row['peak_rss_bytes'])}, NVMe "
                                  f"{format_bytes(row['nvme_peak_bytes'])}, step {row['step_seconds'][-1]:.1f} s")
        print(f"{label:>8}: {status}", file=sys.stderr, flush=True)
        if row["error"]:
            stop = f"{label} failed: {row['error']}"
            break
        if row["nvme_bytes_per_param"]:
            per_param = max(row["nvme_bytes_per_param"] * 1.02, 16.0)
        target = int(target * args.factor)
    print(table(rows))
    ok = [r for r in rows if not r["error"]]
    if ok:
        big = max(ok, key=lambda r: r["n_params"])
        print(f"largest trained: {big['label']} ({big['n_params'] / 1e9:.2f}B params, states "
              f"{format_bytes(big['states_nbytes'])} = {big['states_over_ram']:.2f} x RAM), "
              f"peak host RSS {format_bytes(big['peak_rss_bytes'])}")
    flat = flatness(rows)
    if flat:
        print(f"peak RSS grew {100 * flat['rss_growth']:+.1f}% from {flat['smallest']} to {flat['largest']} "
              f"while model states grew {flat['states_growth']:.1f}x")
    if stop:
        print(f"stopped: {stop}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "ram_bytes": psutil.virtual_memory().total,
                       "rows": rows, "flatness": flat, "stopped": stop}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
