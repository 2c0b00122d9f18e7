"""Host memory over many steps: peak RSS and the engine's own tracked bytes, step by step.

    python benchmarks/buffers.py --steps 50 --json buffers.json

The example GPT (``infinity.examples.gpt``), every block behind ``infinity.activation_checkpoint``,
is trained on the CPU (so "device" memory is host memory too) for ``--steps`` steps with
parameters in ``--params`` (host or nvme), the optimizer on the host, groups below
``--persistence-threshold`` elements kept gathered, the checkpointed activations offloaded to
``--activations`` and ``partition.gather_buffer_bytes`` / ``reduce_bucket_bytes`` as given.
After every step it records the resident set, the process's peak resident set so far
(``ru_maxrss``), and the bytes the engine's own allocators hold: the recycled gather arena, the
kept groups' arena, the gradient buckets, the activation arena (slab bytes, and the most lent at
once), and the host allocator's bytes and peak (every tier buffer, pool and staging arena). The
figures of merit: whether the tracked bytes are the same at every step after ``--warmup``, and
how much the peak RSS still moves after it (what the C heap does with torch's own tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

from benchmarks.activations import checkpointed_gpt, rss_now  # noqa: E402

MiB = 1 << 20


def tracked(stats: dict) -> dict:
    """The engine's own allocations: each arena's slab bytes and most lent at once, the host allocator's."""
    gather, host = stats["gather_memory"], stats["tiers"]["host_allocator"]
    act = stats["activations"].get("arena") or {"nbytes": 0, "peak_bytes": 0}
    arenas = {"gather": gather, "kept": gather["kept"], "buckets": stats["reduce_buckets"], "activations": act}
    out = {f"{name}_{k}": a.get(k, 0) for name, a in arenas.items() for k in ("nbytes", "peak_bytes")}
    out.update(host_allocated=host["bytes_allocated"], host_peak=host["peak_bytes"],
               gather_overflows=gather["overflows"])
    # Host bytes the engine holds: its allocator's (tiers, pools, staging) and, with the CPU as device,
    # the device arenas' slabs.
    out["total_nbytes"] = host["bytes_allocated"] + sum(a.get("nbytes", 0) for n, a in arenas.items()
                                                        if n != "activations")
    return out


def run(args: argparse.Namespace, path: str) -> dict:
    import torch

    import infinity

    torch.set_num_threads(args.threads)
    cfg = {"tiers": {"device": "cpu", "params": args.params, "optimizer": "host", "nvme_path": path},
           "aio": {"direct": not args.buffered},
           "partition": {"persistence_threshold": args.persistence_threshold,
                         "gather_buffer_bytes": args.gather_buffer_bytes,
                         "reduce_bucket_bytes": args.reduce_bucket_bytes},
           "activations": {"offload": args.activations}}
    model, opt = checkpointed_gpt(args, cfg)
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        row = {"loss": loss.item(), "rss": rss_now(),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        row.update(tracked(infinity.stats(model)))
        steps.append(row)
    infinity.release(model)
    return {"steps": steps}


def summarize(steps: list[dict], warmup: int) -> dict:
    after = steps[warmup:]
    keys = [k for k in after[0] if k not in ("loss", "rss", "peak_rss")]
    return {"tracked_flat": all(s[k] == after[0][k] for s in after for k in keys),
            "tracked_changed": sorted({k for s in after for k in keys if s[k] != after[0][k]}),
            "total_nbytes": (min(s["total_nbytes"] for s in after), max(s["total_nbytes"] for s in after)),
            "rss": (min(s["rss"] for s in after), max(s["rss"] for s in after)),
            "peak_rss": (after[0]["peak_rss"], after[-1]["peak_rss"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=None, help="directory for NVMe files (default: a temporary one)")
    parser.add_argument("--params", choices=("host", "nvme"), default="host")
    parser.add_argument("--activations", choices=("none", "host", "nvme"), default="host")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the flatness check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--persistence-threshold", type=int, default=2048)
    parser.add_argument("--gather-buffer-bytes", default="8MiB", help="partition.gather_buffer_bytes")
    parser.add_argument("--reduce-bucket-bytes", default="0", help="partition.reduce_bucket_bytes")
    parser.add_argument("--buffered", action="store_true", help="aio.direct = false (file systems without O_DIRECT)")
    parser.add_argument("--every", type=int, default=5, help="print every Nth step")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    for name in ("gather_buffer_bytes", "reduce_bucket_bytes"):
        value = getattr(args, name)
        setattr(args, name, int(value) if value.isdigit() else value)
    with tempfile.TemporaryDirectory() as scratch:
        result = run(args, args.path or scratch)
    steps = result["steps"]
    print(f"GPT {args.layers} x {args.d_model}, vocab {args.vocab}, batch {args.batch} x {args.seq}, params "
          f"{args.params}, activations {args.activations}, gather buffer {args.gather_buffer_bytes}, reduce buckets "
          f"{args.reduce_bucket_bytes}, {args.steps} steps")
    print(f"{'step':>5}{'RSS MiB':>10}{'peak RSS MiB':>14}{'tracked MiB':>13}{'host alloc MiB':>16}"
          f"{'gather peak':>13}{'kept':>9}{'buckets':>9}{'act arena':>11}")
    for i, s in enumerate(steps):
        if i < args.warmup + 1 or i % args.every == args.every - 1 or i == len(steps) - 1:
            print(f"{i + 1:>5}{s['rss'] / MiB:>10.1f}{s['peak_rss'] / MiB:>14.1f}{s['total_nbytes'] / MiB:>13.2f}"
                  f"{s['host_allocated'] / MiB:>16.2f}{s['gather_peak_bytes'] / MiB:>13.2f}"
                  f"{s['kept_nbytes'] / MiB:>9.2f}{s['buckets_nbytes'] / MiB:>9.2f}{s['activations_nbytes'] / MiB:>11.2f}")
    summary = summarize(steps, args.warmup)
    lo, hi = summary["total_nbytes"]
    print(f"after step {args.warmup}: tracked bytes {'flat' if summary['tracked_flat'] else 'CHANGED'} "
          f"({lo / MiB:.2f}..{hi / MiB:.2f} MiB{'' if summary['tracked_flat'] else ', ' + ', '.join(summary['tracked_changed'])}); "
          f"RSS {summary['rss'][0] / MiB:.1f}..{summary['rss'][1] / MiB:.1f} MiB; peak RSS "
          f"{summary['peak_rss'][0] / MiB:.1f} -> {summary['peak_rss'][1] / MiB:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "machine": platform.platform(), "summary": summary, **result}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
