"""Issue-3 figures: our aio engine vs fio, in alternating pairs on the same file.

For each block size and direction, ``--pairs`` pairs of passes over one ``--size`` file run back to
back, ours then fio, with the order flipped on every other pair, so both see the same minute of a
disk that swings 30-50% (see [Note: interleaving] in infinity/cli/bench.py). The table reports the
median of each, the ratio of the medians, and the median of the per-pair ratios (the figure least
moved by drift), plus CPU seconds per GB for both. ``infinity-bench nvme`` is the user-facing sweep;
this tool measures the issue's acceptance figures.

Example::

    python -m benchmarks.nvme --path /mnt/nvme --size 1GiB --pairs 11 --json nvme_vs_fio.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from infinity.config.sizes import parse_size
from infinity.cli import bench_nvme as nv
from infinity.cli.bench import machine_info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nvme", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="directory on the disk to measure")
    p.add_argument("--size", default="1GiB", help="bytes per pass (default 1GiB)")
    p.add_argument("--pairs", type=int, default=11, help="ours/fio pairs per figure (default 11)")
    p.add_argument("--engine", default="io_uring", choices=nv.aio.ENGINES)
    p.add_argument("--queue-depth", type=int, default=32, help="io_uring depth (default 32)")
    p.add_argument("--threads", type=int, default=4, help="thread-pool size (default 4)")
    p.add_argument("--block-sizes", default="8MiB,1MiB,128KiB")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if nv.fio_version() is None:
        print("benchmarks.nvme: fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    blocks = [parse_size(b) for b in args.block_sizes.split(",")]
    depth = args.queue_depth if args.engine == "io_uring" else args.threads
    settings = [nv.Setting(args.engine, b, depth, args.threads) for b in blocks]
    fd, path = tempfile.mkstemp(prefix="infinity-bench-", suffix=".bin", dir=args.path)
    os.close(fd)
    rows = []
    try:
        nv.lay_out(path, size)
        buf = nv.make_buffer(max(nv.buffer_size(s, size) for s in settings))
        print(f"{size / 1e9:.3f} GB passes, {args.pairs} alternating pairs; GB/s is decimal (10^9 B/s); medians")
        print(f"{'setting':22s} {'op':5s} {'ours':>6s} {'fio':>6s} {'ratio':>6s} {'pair-med':>8s} "
              f"{'CPU s/GB ours':>13s} {'fio':>6s}")
        for s in settings:
            for op in ("write", "read"):
                ours: list[nv.Sample] = []
                fio: list[nv.Sample] = []
                for i in range(args.pairs):
                    runs = [lambda: ours.append(nv.measure_ours(path, size, op, s, buf, i)),
                            lambda: fio.append(nv.measure_fio(path, size, op, s, i))]
                    for run in runs if i % 2 == 0 else runs[::-1]:
                        run()
                med = statistics.median
                og, fg = [x.gb_per_s for x in ours], [x.gb_per_s for x in fio]
                row = {"setting": s.label(), "op": op, "ours": med(og), "fio": med(fg), "ratio": med(og) / med(fg),
                       "pair_median_ratio": med(a / b for a, b in zip(og, fg)),
                       "ours_cpu_s_per_gb": med(x.cpu_s_per_gb for x in ours),
                       "fio_cpu_s_per_gb": med(x.cpu_s_per_gb for x in fio),
                       "ours_samples": og, "fio_samples": fg, "fio_command": " ".join(nv.fio_command(path, size, op, s))}
                rows.append(row)
                print(f"{s.label():22s} {op:5s} {row['ours']:6.2f} {row['fio']:6.2f} {row['ratio']:5.2f}x "
                      f"{row['pair_median_ratio']:7.2f}x {row['ours_cpu_s_per_gb']:13.3f} {row['fio_cpu_s_per_gb']:6.3f}",
                      flush=True)
    finally:
        os.unlink(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine_info(args.path), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
