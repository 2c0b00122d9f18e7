"""What ``[tiers] verify`` costs: the NVMe tier with and without swap-file checksums, side by side.

One run writes ``--total`` bytes to an NVMe tier in ``--block`` transfers (8 MiB: the default
``aio.block_size``), then reads them back, once with checksums off and once on, alternating
which goes first in each of ``--repeats`` repeats; it prints median GB/s of each and the
paired overhead (median over repeats of on/off time - 1), and the speed of zlib's CRC-32 alone
on one core. Both tiers use the same directory, the same pool and the same aio handle.

Example::

    python -m benchmarks.verify --path /mnt/nvme --total 1GiB --json verify.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import zlib

import torch

from benchmarks.tier_io import parse_size
from tiers import BufferPool, HostAllocator, NVMeTier
from tiers.aio import AioHandle


def _timed(start_one, blocks: list[torch.Tensor], block: int) -> float:
    """Seconds to move every block with ``start_one(data, offset)``, 4 transfers in flight."""
    start = time.perf_counter()
    pending = []
    for i, data in enumerate(blocks):
        pending.append(start_one(data, i * block))
        if len(pending) >= 4:
            pending.pop(0).wait()
    for fut in pending:
        fut.wait()
    return time.perf_counter() - start


def _pass(tier: NVMeTier, key: int, blocks: list[torch.Tensor], block: int) -> tuple[float, float]:
    """Seconds to write every block, then to read every block back (each transfer waited in turn, 4 in flight)."""
    wrote = _timed(lambda data, offset: tier.write(key, data, offset), blocks, block)
    return wrote, _timed(lambda data, offset: tier.read(key, data, offset), blocks, block)


def measure(args: argparse.Namespace) -> dict:
    block, count = args.block, max(1, args.total // args.block)
    alloc = HostAllocator(pin="never")
    blocks = [alloc.empty(block) for _ in range(count)]
    for i, data in enumerate(blocks):
        data.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    samples: dict[str, list[float]] = {f"{mode} {op}": [] for mode in ("off", "on") for op in ("write", "read")}
    with AioHandle(block_size=block, queue_depth=32, engine=args.engine) as handle:
        pool = BufferPool(block, 4, alloc, name="verify-bench")
        with NVMeTier([args.path], handle, pool, name="bench-plain") as plain, \
                NVMeTier([args.path], handle, pool, name="bench-verify", verify=True) as checked:
            tiers = {"off": plain, "on": checked}
            keys = {mode: tier.allocate(block * count, f"bench-{mode}") for mode, tier in tiers.items()}
            for mode, tier in tiers.items():           # warm-up: extents, first touches
                _pass(tier, keys[mode], blocks, block)
            for repeat in range(args.repeats):
                for mode in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
                    wrote, read = _pass(tiers[mode], keys[mode], blocks, block)
                    samples[f"{mode} write"].append(wrote)
                    samples[f"{mode} read"].append(read)
            engine = handle.engine
    nbytes = block * count
    start = time.perf_counter()
    for data in blocks:
        zlib.crc32(memoryview(data.numpy()))
    crc_gbps = nbytes / (time.perf_counter() - start) / 1e9
    median = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    overhead = {op: statistics.median(on / off for on, off in zip(samples[f"on {op}"], samples[f"off {op}"])) - 1
                for op in ("write", "read")}
    return {"block": block, "blocks": count, "nbytes": nbytes, "engine": engine, "samples_s": samples,
            "median_GBps": median, "overhead": overhead, "crc32_GBps_one_core": crc_gbps,
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=os.environ.get("TMPDIR", "/tmp"), help="directory on the drive to test")
    parser.add_argument("--total", type=parse_size, default=512 << 20, help="bytes written and read per pass (512MiB)")
    parser.add_argument("--block", type=parse_size, default=8 << 20, help="bytes per transfer (8MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats (5)")
    parser.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    parser.add_argument("--json", metavar="PATH", help="write settings, machine and raw samples here")
    args = parser.parse_args(argv)
    result = measure(args)
    result["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
    med = result["median_GBps"]
    print(f"NVMe tier, [tiers] verify off vs on: {result['blocks']} transfers of {args.block / 2**20:.0f} MiB, "
          f"{args.repeats} alternating repeats, engine {result['engine']}")
    print(f"{'':<8}{'off GB/s':>10}{'on GB/s':>10}{'overhead':>10}")
    for op in ("write", "read"):
        print(f"{op:<8}{med[f'off {op}']:>10.2f}{med[f'on {op}']:>10.2f}{result['overhead'][op]:>+10.1%}")
    print(f"(zlib CRC-32 alone: {result['crc32_GBps_one_core']:.2f} GB/s on one core; load average "
          f"{result['load_average'][0]:.1f}; overhead = median of per-repeat on/off time ratios - 1)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return result


if __name__ == "__main__":
    main()
