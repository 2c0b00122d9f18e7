"""Peak host memory with checkpointed activations offloaded ("none", "host", "nvme"), each in its own process.

The example GPT (``infinity.examples.gpt``) with every block wrapped by ``infinity.activation_checkpoint``
is trained for ``--steps`` steps on the CPU with its parameters on the device tier and the
optimizer on the host, once per offload setting, each in a fresh process (so one run's heap
cannot hide another's): its peak resident set (``ru_maxrss``), the resident set after every
step, the checkpointed bytes that moved and the stall they caused, and the losses (which must
be identical across settings). The figure of merit: how much the peak drops against "none",
as a fraction of the checkpointed activation bytes. With the CPU as compute device "host"
only copies between two kinds of host memory and cannot lower the peak; "nvme" can.

[Note: measuring peak RSS under glibc]
glibc's malloc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after
which freed activation-sized blocks stay in its heap and are reused in whatever layout the last
step left: the same step's peak RSS then varies by tens of MiB from one step to the next, more
than the bytes offloading takes away. So each child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed
(``--mmap-threshold``, 128 KiB by default: every larger block is a mapping of its own, returned at
free), which makes the peak RSS the peak of live bytes, the same at every step; 0 leaves glibc's
dynamic threshold (the default of a plain process).

Example::

    python benchmarks/activations.py --path /mnt/nvme --layers 4 --d-model 256 --batch 8 --seq 1024 \\
        --vocab 512 --steps 5 --json activations.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

MODES = ("none", "host", "nvme")


def rss_now() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def checkpointed_gpt(args: argparse.Namespace, cfg: dict):
    """The example GPT of ``args``' shape built under ``cfg``, every block activation-checkpointed, and
    its AdamW (lr 1e-4)."""
    import torch

    import infinity
    from infinity.examples.gpt import GPT, GPTConfig

    shape = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64),
                      vocab_size=args.vocab, seq_len=args.seq)
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(shape)
    model.blocks = torch.nn.ModuleList(infinity.activation_checkpoint(b) for b in model.blocks)
    return model, infinity.AdamW(model, lr=1e-4)


def child(args: argparse.Namespace) -> dict:
    """One setting in this process: train, and report memory, movement and losses."""
    import torch

    import infinity

    torch.set_num_threads(args.threads)
    cfg = {"tiers": {"device": "cpu", "params": "device", "optimizer": "host", "nvme_path": args.path,
                     "pool_buffers": args.pool_buffers, "pool_buffer_size": args.pool_buffer_size},
           "aio": {"direct": not args.buffered},
           "activations": {"offload": args.mode, "prefetch_bytes": args.prefetch_bytes,
                           "buffer_bytes": args.buffer_bytes}}
    model, opt = checkpointed_gpt(args, cfg)
    g = torch.Generator().manual_seed(1)
    losses, rss = [], []
    for _ in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rss.append(rss_now())
    opt.synchronize()
    act = infinity.stats(model)["activations"]
    return {"mode": args.mode, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_per_step": rss, "losses": losses, "activations": act}


def _run_child(args: argparse.Namespace, mode: str, path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--path", path]
    for name in ("layers", "d_model", "batch", "seq", "vocab", "steps", "threads", "prefetch_bytes",
                 "buffer_bytes", "pool_buffers", "pool_buffer_size"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.buffered:
        cmd.append("--buffered")
    env = dict(os.environ)
    if args.mmap_threshold:     # see [Note: measuring peak RSS under glibc]
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(_HERE)).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=None, help="directory for the NVMe files (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefetch-bytes", default="8MiB", help="activations.prefetch_bytes")
    parser.add_argument("--buffer-bytes", default="16MiB", help="activations.buffer_bytes")
    parser.add_argument("--pool-buffers", type=int, default=2, help="tiers.pool_buffers")
    parser.add_argument("--pool-buffer-size", default="1MiB", help="tiers.pool_buffer_size")
    parser.add_argument("--buffered", action="store_true", help="aio.direct = false (file systems without O_DIRECT)")
    parser.add_argument("--mmap-threshold", type=int, default=128 << 10,
                        help="MALLOC_MMAP_THRESHOLD_ of each child, bytes; 0: glibc's dynamic default")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes.split(","):
            path = os.path.join(args.path or scratch, f"activations-{mode}")
            os.makedirs(path, exist_ok=True)
            results.append(_run_child(args, mode, path))
    base = next((r for r in results if r["mode"] == "none"), None)
    moved = max(r["activations"].get("checkpoint_nbytes", 0) for r in results)
    mib = 1 << 20
    print(f"GPT {args.layers} x {args.d_model}, vocab {args.vocab}, batch {args.batch} x {args.seq}, "
          f"{args.steps} steps; checkpointed activations {moved / mib:.1f} MiB per step; prefetch "
          f"{args.prefetch_bytes}, staging {args.buffer_bytes}; malloc mmap threshold "
          f"{args.mmap_threshold or 'dynamic (glibc default)'}")
    print(f"{'offload':<8}{'peak RSS MiB':>14}{'drop MiB':>10}{'drop/ckpt':>10}{'stall s':>9}"
          f"{'RSS first..last step MiB':>28}  losses equal")
    for r in results:
        drop = (base["peak_rss"] - r["peak_rss"]) if base else 0
        stall = r["activations"].get("total", {}).get("stall_seconds", 0.0)
        steps = r["rss_per_step"]
        same = base is None or r["losses"] == base["losses"]
        print(f"{r['mode']:<8}{r['peak_rss'] / mib:>14.1f}{drop / mib:>10.1f}"
              f"{(drop / moved if moved else 0):>10.2f}{stall:>9.3f}"
              f"{steps[0] / mib:>14.1f} .. {steps[-1] / mib:<10.1f}  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "machine": platform.platform(), "checkpoint_nbytes": moved,
                       "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
