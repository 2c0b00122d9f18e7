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
bytes read and written per parameter in a steady step (the mean over the steps after the
first two: [Note: NVMe bytes per step] in infinity/examples/meter.py) beside the plan's for the
shape, and the step time; at the end,
how much the peak RSS grew from the smallest to the largest size against how much
the model states grew (flat RSS = the host holds only fixed-size buffers).
``--sizes 125M,1.3B,4B`` (presets or parameter counts) replaces the ladder;
``--fixed-width D`` grows only the depth at d_model = D, so the largest layer (and
the token embedding) stays the same size while the model grows. Llama shapes
(``--sizes llama-6.7B``, infinity/examples/llama.py) run the same way.

``--state-dtype int8`` stores Adam's moments in int8 (``[optimizer] state_dtype``).
``--checkpoint`` saves a checkpoint after each size's steps and resumes it in a new
process for one more step. When the swap files and a copy of the states do not fit the
free disk together (the bytes are checked first), or with ``--in-place``, the checkpoint is
saved in place: the swap files are sealed as the checkpoint and the resumed process adopts
them on the same swap directory ([Note: checkpoints in place] in infinity/checkpoint/in_place.py);
``--reference`` also trains ``steps + 1`` steps uninterrupted, whose last loss the
resumed step must equal. The resumed process's peak RSS and NVMe bytes are reported beside the
training run's: a load adds neither. Before the ladder, the largest model that fits this disk is
printed per moment dtype, from ``infinity.plan``'s stored bytes per parameter.

    python benchmarks/scale.py --nvme-dir /tmp/nvme --sizes llama-6.7B --dtype bfloat16 \
        --state-dtype int8 --seq 128 --steps 3 --lr 1e-4 --checkpoint

Measured on the 2-core, 24 GiB CPU machine of 2026-11-25 (ext4 virtual disk, ~75 GiB free), that command:
llama-6.7B (6,738,415,616 parameters), batch 1 x 128, built in 124 s; losses 11.07 > 5.10 > 1.58
(the same batch each step); steps 53 / 145 / 152 s, the last two split ~75-82 s compute and
~70 s waiting for NVMe reads (the host Adam step runs behind the next forward, so its time is
inside those two); peak RSS 6.3 GiB; swap files 54.1 GB allocated (8.03 B/param, the plan's
50.40 GiB); NVMe 9.0 B/param read + 8.0 written per step (the median of steps 2 and 3, the first
update, which reads no moments, included: about 10.0 steady, the plan's 10.03). A copied checkpoint does not
fit: it stores fp32 master and moments (14 B/param, 94.3 GB), more than the free disk even without the
54 GB of swap beside it; docs/benchmarks/scale-6.7b.md has the run saved and resumed in place. Saved and resumed instead at llama-2B (2.07B,
``--sizes llama-2B``): a 28.9 GB checkpoint (14.00 B/param) in 166 s; the resumed step's loss
10.347456932067871 equals the uninterrupted run's fourth (the same at llama-1B with
``--reference``: 5.609546184539795).
On a CPU without AVX-512, torch's bf16 matmul runs 0.3-20 GFLOP/s: add
``-- --set 'precision.cpu_linear="float32"'`` (linear layers multiplied in fp32; docs/benchmarks/scale-6.7b.md
has that run, saved and resumed, on a 2-core AMD EPYC).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace

import psutil

from infinity.examples.gpt import GPT, PRESETS, shape_for_params
from infinity.examples.llama import LLAMA_PRESETS, Llama, LlamaConfig
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
    if size in LLAMA_PRESETS:
        return replace(LLAMA_PRESETS[size], seq_len=max(seq_len, LLAMA_PRESETS[size].seq_len))
    return shape_for_params(_count(size), vocab_size=vocab, seq_len=seq_len, d_model=d_model)


# Checkpoint bytes per parameter (infinity/checkpoint): the compute copy (dtype bytes), the fp32
# master and Adam m and v decoded to fp32; the files' headers and buffers are measured, not counted.
CHECKPOINT_FP32_BYTES_PER_PARAM = 12


def _train_flags(cfg, args, swap: str, steps: int) -> list[str]:
    return [*shape_args(cfg), "--steps", str(steps), "--batch", str(args.batch), "--seq", str(args.seq),
            "--data", "repeat", "--lr", str(args.lr), "--set", 'tiers.params="nvme"', "--set", 'tiers.optimizer="nvme"',
            "--set", f'precision.dtype="{args.dtype}"', "--set", f'optimizer.state_dtype="{args.state_dtype}"',
            "--nvme-dir", swap, *args.extra]


def _train(cfg, args, nvme_dir: str, label: str, steps: int, more: list[str], swap: str | None = None):
    """One training process; its swap files in ``swap`` (kept), or in a new directory removed after it."""
    own = swap is None
    swap = tempfile.mkdtemp(prefix=f"scale-{label}-", dir=nvme_dir) if own else swap
    try:
        return run_training([*_train_flags(cfg, args, swap, steps), *more], timeout=args.timeout, log_path=args.log)
    finally:
        if own:
            shutil.rmtree(swap, ignore_errors=True)


def checkpoint_need(n_params: int, dtype_bytes: int, swap_bytes_per_param: float) -> dict:
    """The disk a save needs beside the live swap files, per the checkpoint format."""
    ckpt = n_params * (dtype_bytes + CHECKPOINT_FP32_BYTES_PER_PARAM)
    swap = int(n_params * swap_bytes_per_param)
    return {"checkpoint_bytes": ckpt, "swap_bytes": swap, "total_bytes": ckpt + swap}


def _checkpoint_row(cfg, args, nvme_dir: str, label: str, first, swap: str | None = None) -> dict:
    """Resume the checkpoint ``first`` saved for one step in a new process (and the reference run); a
    checkpoint in place is resumed on its own swap directory ``swap``."""
    ck = first.report["checkpoint"]
    out = {"checkpoint_nbytes": ck["nbytes"], "checkpoint_seconds": ck["seconds"],
           "checkpoint_bytes_per_param": ck["nbytes"] / cfg.n_params, "checkpoint_in_place": bool(ck.get("in_place")),
           "checkpoint_sealed_nbytes": ck.get("sealed_nbytes", 0)}
    resumed = _train(cfg, args, nvme_dir, label + "-resume", 1, ["--resume", ck["path"]], swap=swap)
    out.update(resume_error=resumed.error, resume_wall_seconds=resumed.wall_seconds,
               resume_peak_rss_sampled_bytes=resumed.peak_rss_sampled_bytes)
    if resumed.ok:
        summary = resumed.report["summary"]
        # The resumed process's own peaks, the load included: they should be the training run's
        # (a load neither keeps states in host memory nor adds swap beside them).
        out.update(resumed_loss=resumed.report["steps"][0]["loss"], resume_peak_rss_bytes=summary["peak_rss_bytes"],
                   resume_nvme_peak_bytes=(summary.get("tier_peak_bytes") or {}).get("nvme") or 0)
    if args.reference:
        ref = _train(cfg, args, nvme_dir, label + "-ref", args.steps + 1, [])
        out.update(reference_error=ref.error)
        if ref.ok:
            out["reference_losses"] = [st["loss"] for st in ref.report["steps"]]
    return out


def run_size(cfg, args, nvme_dir: str, label: str) -> dict:
    ck_dir, skip, in_place = None, None, args.in_place
    if args.checkpoint:
        need = checkpoint_need(cfg.n_params, 2 if args.dtype != "float32" else 4, args.disk_bytes_per_param)
        free = shutil.disk_usage(nvme_dir).free
        if not in_place and need["total_bytes"] > free - DISK_HEADROOM_BYTES:
            # No room for a copy beside the swap files: the swap files become the checkpoint.
            in_place = True
            print(f"{label:>8}: a checkpoint needs {format_bytes(need['checkpoint_bytes'])} beside "
                  f"{format_bytes(need['swap_bytes'])} of swap files ({format_bytes(need['total_bytes'])} in all), "
                  f"{format_bytes(free)} free on {nvme_dir}: saving it in place", file=sys.stderr, flush=True)
        ck_dir = tempfile.mkdtemp(prefix=f"scale-{label}-ckpt-", dir=nvme_dir)
    # A checkpoint in place is resumed on the swap directory that holds it.
    swap = tempfile.mkdtemp(prefix=f"scale-{label}-", dir=nvme_dir) if in_place and ck_dir else None
    try:
        more = ["--checkpoint", ck_dir] + (["--checkpoint-in-place"] if swap else []) if ck_dir else []
        result = _train(cfg, args, nvme_dir, label, args.steps, more, swap=swap)
        row = _row(cfg, label, result)
        row["checkpoint_skipped"] = skip
        if ck_dir and result.ok:
            row.update(_checkpoint_row(cfg, args, nvme_dir, label, result, swap))
    finally:
        for path in (ck_dir, swap):
            if path:
                shutil.rmtree(path, ignore_errors=True)
    return row


def planned_traffic(cfg, args, nvme_dir: str) -> dict:
    """The plan's NVMe bytes per parameter and step for this shape (built on the meta device) under the
    run's settings (``--set`` flags after ``--`` are not read): reads with the forward keeping pace with
    the overlapped update and, ``read_max``, with the update ending first ([Note: NVMe traffic per step]
    in infinity/plan/layout.py)."""
    import torch

    from infinity.plan import plan

    with torch.device("meta"):
        model = Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)
    p = plan(model, {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme_dir},
                     "precision": {"dtype": args.dtype}, "optimizer": {"state_dtype": args.state_dtype}},
             check_fit=False)
    n = p.shards.shard_numel
    return {"read": p.nvme_read_bytes / n, "read_max": p.nvme_read_bytes_max / n, "written": p.nvme_write_bytes / n}


def _row(cfg, label: str, result) -> dict:
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
                   step_split=[{k: st[k] for k in ("compute_seconds", "stall_seconds", "optimizer_seconds")}
                               for st in r["steps"]],
                   rss_per_step=[st["rss_bytes"] for st in r["steps"]],
                   peak_rss_build_bytes=r["peak_rss_after_build_bytes"],
                   peak_rss_forward_backward_bytes=[st["peak_rss_forward_backward_bytes"] for st in r["steps"]],
                   peak_rss_per_step=[st["peak_rss_bytes"] for st in r["steps"]],
                   source=r["machine"]["source"], load_average=r["machine"]["load_average"])
    return row


def largest_fits(nvme_dir: str, dtype: str) -> list[dict]:
    """Per moment dtype: stored NVMe bytes per parameter (infinity.plan, params and optimizer on NVMe)
    and the largest parameter count whose swap files, alone and beside a checkpoint, fit the free disk."""
    from infinity.config import load_config
    from infinity.plan import plan

    free = shutil.disk_usage(nvme_dir).free - DISK_HEADROOM_BYTES
    dtype_bytes = 4 if dtype == "float32" else 2
    rows = []
    for state in ("fp32", "bf16", "int8"):
        config = load_config(None, overrides={"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme_dir},
                                              "precision": {"dtype": dtype}, "optimizer": {"state_dtype": state}})
        n = 1_000_000_000
        p = plan(n, config, check_fit=False).to_dict()
        stored = p["tier_bytes"]["nvme"] / n
        moved = (p["nvme_read_bytes_per_step"] + p["nvme_write_bytes_per_step"]) / n
        rows.append({"state_dtype": state, "stored_bytes_per_param": stored, "moved_bytes_per_param_step": moved,
                     "largest_params": int(free / stored),
                     "largest_params_with_checkpoint": int(free / (stored + dtype_bytes
                                                                   + CHECKPOINT_FP32_BYTES_PER_PARAM))})
    return rows


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
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary of the ladder's shapes")
    p.add_argument("--fixed-width", type=int, default=None,
                   help="keep d_model fixed and grow only the depth (default: GPT-3-like, both grow)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--disk-bytes-per-param", type=float, default=None,
                   help="NVMe bytes per parameter assumed before the first size is measured "
                        "(default: infinity.plan's stored bytes for --dtype and --state-dtype, plus 2%%)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per size before it is killed")
    p.add_argument("--log", default=None, help="append each run's output (progress lines) to this file")
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="Adam moments' storage ([optimizer] state_dtype)")
    p.add_argument("--checkpoint", action="store_true",
                   help="save a checkpoint after the steps and resume it for one step (when it fits the disk)")
    p.add_argument("--in-place", action="store_true",
                   help="with --checkpoint: save it in place (the swap files become the checkpoint) even when a "
                        "copy would fit; without this flag, only when it would not")
    p.add_argument("--reference", action="store_true",
                   help="with --checkpoint: also train steps + 1 uninterrupted, to compare the resumed loss")
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs="*", help="after --, more train_gpt flags (e.g. --set prefetch.enabled=false)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    os.makedirs(nvme_dir, exist_ok=True)
    limit = _count(args.max_params) if args.max_params else None
    rows: list[dict] = []
    stop = None
    fits = largest_fits(nvme_dir, args.dtype)
    for f in fits:
        print(f"{f['state_dtype']:>5} moments: {f['stored_bytes_per_param']:.2f} B/param stored on NVMe, "
              f"{f['moved_bytes_per_param_step']:.2f} moved per step; largest that fits {nvme_dir}: "
              f"{_label(f['largest_params'])} ({_label(f['largest_params_with_checkpoint'])} beside a copy checkpoint; one in place needs no room)",
              flush=True)
    if args.disk_bytes_per_param is None:
        args.disk_bytes_per_param = 1.02 * next(f["stored_bytes_per_param"] for f in fits
                                                if f["state_dtype"] == args.state_dtype)
    per_param = args.disk_bytes_per_param
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
        row["plan_per_param_step"] = planned_traffic(cfg, args, nvme_dir)
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
    for r in rows:
        if not r["error"]:
            pl = r["plan_per_param_step"]
            print(f"{r['label']} NVMe B/param per step: measured {r['nvme_read_per_param_step']:.2f} read + "
                  f"{r['nvme_written_per_param_step']:.2f} written (mean over the steps after the first two); "
                  f"plan {pl['read']:.2f} read (up to {pl['read_max']:.2f} when the update ends before the "
                  f"forward) + {pl['written']:.2f} written")
        for k in ("step_split",):
            if k in r:
                print(f"{r['label']} per step (compute / waiting for NVMe reads / optimizer, s): " + "; ".join(
                    f"{x['compute_seconds']:.1f} / {x['stall_seconds']:.1f} / {x['optimizer_seconds']:.1f}"
                    for x in r[k]))
        if r.get("checkpoint_skipped"):
            print(f"{r['label']}: {r['checkpoint_skipped']}")
        elif "checkpoint_nbytes" in r:
            kind = (f"in place (sealed swap files {format_bytes(r['checkpoint_sealed_nbytes'])}, no copy; "
                    f"its own files {format_bytes(r['checkpoint_nbytes'])})" if r.get("checkpoint_in_place") else
                    f"{format_bytes(r['checkpoint_nbytes'])} ({r['checkpoint_bytes_per_param']:.2f} B/param)")
            print(f"{r['label']}: checkpoint {kind} saved in {r['checkpoint_seconds']:.1f} s; "
                  f"resumed step loss {r.get('resumed_loss', r.get('resume_error'))}"
                  + (f"; resumed process: peak RSS {format_bytes(r['resume_peak_rss_bytes'])}, NVMe peak "
                     f"{format_bytes(r['resume_nvme_peak_bytes'])} (training: {format_bytes(r['peak_rss_bytes'])}, "
                     f"{format_bytes(r['nvme_peak_bytes'])})" if "resume_peak_rss_bytes" in r else "")
                  + (f"; uninterrupted losses {r.get('reference_losses', r.get('reference_error'))}"
                     if args.reference else ""))
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
            json.dump({"settings": vars(args), "ram_bytes": psutil.virtual_memory().total, "largest_fits": fits,
                       "rows": rows, "flatness": flat, "stopped": stop}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
