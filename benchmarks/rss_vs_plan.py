"""Peak host RSS of a training run against the plan's host total, every preset and ``auto``, CPU compute.

    python benchmarks/rss_vs_plan.py --sizes 32M,128M --bench-json nvme.json --json out.json

Each run is a process of its own (a heap's high-water mark survives its frees, so runs must not share one):
it imports torch and infinity, trains a tiny model with the same preset for a step and releases it (so that
what a run loads is loaded), and reads its resident set (the interpreter); then it builds the GPT of about that many
parameters (``shape_for_params``) under ``infinity.Init`` with the CPU as compute device (as
benchmarks/plan_vs_measured.py builds it), trains ``--steps`` steps and reads its peak resident set
(``VmHWM``). Beside it, ``infinity.plan.plan`` for the same census, the config Init resolved and the machine
profile: its host total, which on a CPU compute device is the device tier's rows and the host tier's (the
device is host memory; the device prefetch budget is a bound, and the gather arena grows to it when the model
is larger than it: at 128M, offload-host's arena held the whole model's bf16 copies, 235 MiB of a 256 MiB
budget); and the activations, measured in another process of their own: a plain
PyTorch copy of the model in the same compute dtype, its peak resident set during a forward and backward
above its resident set before, less its gradients. Each row: the budget (interpreter + plan + activations)
and the measured peak over it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

PRESETS = ("device", "offload-optimizer", "offload-host", "nvme", "auto")


def _status_bytes(field: str) -> int:
    from tiling import status_bytes

    return status_bytes(field)


def _reset_peak() -> None:
    from tiling import reset_peak_rss

    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: the peak resident set cannot be measured per run")


def _shape(size: str, args):
    from infinity.examples.gpt import shape_for_params
    from infinity.plan.units import parse_count

    return shape_for_params(parse_count(size, "--sizes"), vocab_size=args.vocab, seq_len=args.seq)


def _batches(shape, args):
    import torch

    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        yield torch.randint(0, shape.vocab_size, (args.batch, args.seq + 1), generator=g)


def engine_child(size: str, preset: str, args) -> dict:
    """One engine run in this process: the interpreter's resident set, the plan's host bytes, the peak."""
    import torch

    import infinity
    from infinity.examples.gpt import GPT
    from infinity.plan import plan
    from infinity.plan.probes import machine_profile
    from tiers.host_alloc import trim_c_heap

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plan_vs_measured

    # The interpreter: Python, torch and the code a run loads (a run of a tiny model with the same preset,
    # released), with the heap it freed trimmed.
    tiny = argparse.Namespace(**{**vars(args), "steps": 1})
    with torch.device("meta"):
        tiny_meta = GPT(_shape("100k", tiny))
    with tempfile.TemporaryDirectory(dir=args.workdir) as nvme:
        profile = machine_profile("cpu", "bfloat16", nvme_paths=(nvme,), bench_json=args.bench_json)
        build_args = argparse.Namespace(schedule="engine", sub_group_size=args.sub_group_size)
        warm, warm_opt, *_ = plan_vs_measured.build(preset, _shape("100k", tiny), tiny_meta, profile, build_args, nvme)
        for batch in _batches(_shape("100k", tiny), tiny):
            warm(batch[:, :-1], batch[:, 1:]).backward()
            warm_opt.step()
        warm_opt.synchronize()
        infinity.release(warm)
    del warm, warm_opt
    gc.collect()
    trim_c_heap()
    interpreter = _status_bytes("VmRSS")
    shape = _shape(size, args)
    with torch.device("meta"):
        meta = GPT(shape)
    with tempfile.TemporaryDirectory(dir=args.workdir) as nvme:
        profile = machine_profile("cpu", "bfloat16", nvme_paths=(nvme,), bench_json=args.bench_json)
        build_args = argparse.Namespace(schedule="engine", sub_group_size=args.sub_group_size)
        _reset_peak()
        model, opt, census, _, resolved = plan_vs_measured.build(preset, shape, meta, profile, build_args, nvme)
        rows = plan(census, resolved, machine=profile, check_fit=False).rows
        built, peak_build = _status_bytes("VmRSS"), _status_bytes("VmHWM")
        _reset_peak()
        for batch in _batches(shape, args):
            model(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        peak = _status_bytes("VmHWM")
        infinity.release(model)
    held = {r.key: r.nbytes for r in rows if r.tier in ("device", "host")}
    return {"interpreter": interpreter, "plan_rows": held, "plan_host": sum(held.values()), "peak": peak,
            "built": built, "peak_build": peak_build,
            "tiers": [resolved.tiers.params, resolved.tiers.optimizer], "dtype": resolved.precision.dtype,
            "params": census.num_params}


def plain_child(size: str, dtype: str, args) -> dict:
    """The activations of a plain copy: its peak during forward and backward above what it held before, less
    its gradients (the first step's: later ones reuse the heap the first one left)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plan_vs_measured

    shape = _shape(size, args)
    plain = plan_vs_measured._plain_model(shape, dtype)
    grads = sum(p.numel() * p.element_size() for p in plain.parameters() if p.requires_grad)
    seen = []
    for batch in _batches(shape, args):
        before = _status_bytes("VmRSS")
        _reset_peak()
        plain(batch[:, :-1], batch[:, 1:]).backward()
        seen.append(_status_bytes("VmHWM") - before - grads)
        plain.zero_grad(set_to_none=True)
    return {"activations": max(0, max(seen)), "grads": grads}


def _child(kind: str, size: str, what: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, size, what, "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
           "--sub-group-size", str(args.sub_group_size)]
    cmd += ["--workdir", args.workdir] if args.workdir else []
    cmd += ["--bench-json", args.bench_json] if args.bench_json else []
    env = dict(os.environ)
    if args.mmap_threshold:     # glibc's heap kept from growing by its own policy (benchmarks/activations.py)
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def run(args) -> dict:
    rows = []
    print(f"{'size':>6} {'preset':<18} {'tiers':<14} {'interp GiB':>10} {'plan GiB':>9} {'activ GiB':>9} "
          f"{'budget GiB':>10} {'peak GiB':>9} {'peak/budget':>11} {'build peak GiB':>14}")
    for size in args.sizes.split(","):
        activations = {}
        for preset in args.presets.split(","):
            got = _child("engine", size, preset, args)
            if got["dtype"] not in activations:
                activations[got["dtype"]] = _child("plain", size, got["dtype"], args)["activations"]
            budget = got["interpreter"] + got["plan_host"] + activations[got["dtype"]]
            rows.append({"size": size, "preset": preset, **got, "activations": activations[got["dtype"]],
                         "budget": budget, "ratio": got["peak"] / budget})
            print(f"{size:>6} {preset:<18} {'/'.join(got['tiers']):<14} {_gib(got['interpreter']):>10} "
                  f"{_gib(got['plan_host']):>9} {_gib(activations[got['dtype']]):>9} {_gib(budget):>10} "
                  f"{_gib(got['peak']):>9} {rows[-1]['ratio']:>11.2f} {_gib(got['peak_build']):>14}", flush=True)
    within = sum(r["ratio"] <= 1.0 for r in rows)
    print(f"peak RSS within the budget: {within} of {len(rows)}; peak/budget median "
          f"{statistics.median(r['ratio'] for r in rows):.2f}, range {min(r['ratio'] for r in rows):.2f}-"
          f"{max(r['ratio'] for r in rows):.2f}")
    return {"settings": vars(args), "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32M,128M", help="comma-separated parameter counts (GPT shapes)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sub-group-size", type=int, default=4 << 20)
    ap.add_argument("--bench-json", help="an infinity-bench nvme --json result for the disk rates")
    ap.add_argument("--workdir", help="directory for the NVMe files (default: a temporary one)")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="run the processes with MALLOC_MMAP_THRESHOLD_ fixed at this many bytes (0: glibc's own, "
                         "which raises it as large blocks are freed and keeps their pages in its heap)")
    ap.add_argument("--json", help="write the settings and every row here")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "SIZE", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        kind, size, what = args.child
        got = engine_child(size, what, args) if kind == "engine" else plain_child(size, what, args)
        print(json.dumps(got))
        return got
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
