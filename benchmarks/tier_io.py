"""Tier benchmark: NVMe tier through the pool vs the raw aio handle, and peak host memory.

Two figures, measured side by side in one run:

1. put/get bandwidth of one ``--size`` tensor (default 1 GiB): the raw ``AioHandle`` on
   an aligned buffer, the NVMe tier on an unaligned tensor (so every byte goes through
   the pool: "staged"), and the NVMe tier on an aligned tensor ("direct"); the three
   alternate within each repeat and the table shows medians and ratios to raw.
2. peak RSS (psutil, sampled every 2 ms on a thread) while ``--move`` bytes (default
   8 GiB) go to the NVMe tier and back in ``--chunk`` pieces with a ``--move-pool`` pool
   (default 256 MiB), relative to the RSS before the pool existed.

Example::

    python -m benchmarks.tier_io --path /mnt/nvme --json tiers.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import threading
import time

import psutil
import torch

from tiers import BufferPool, HostAllocator, NVMeTier
from tiers.aio import AioHandle

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 1000, "mib": 1 << 20, "mb": 10**6, "gib": 1 << 30, "gb": 10**9,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"1GiB"`` / ``"64MiB"`` / ``"4096"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64MiB, 1GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth(args: argparse.Namespace, handle: AioHandle) -> dict:
    """Raw handle vs NVMe tier (staged and direct), write and read, alternating."""
    size = args.size
    alloc = HostAllocator(pin=args.pin)
    pool = BufferPool(args.pool_buffer, args.pool_buffers, alloc, name="bench")
    # One memory for all variants: on a VM, two equal buffers can differ by 30% in DMA
    # speed (how the host backs them), which would swamp the comparison. The staged
    # variant uses the same bytes shifted by 64, so it never qualifies for O_DIRECT.
    memory = alloc.empty(size + 4096)
    memory.copy_(torch.randint(0, 256, (size + 4096,), dtype=torch.uint8))
    aligned, unaligned = memory[:size], memory[64:64 + size]
    samples: dict[str, list[float]] = {f"{v} {op}": [] for v in ("raw", "staged", "direct") for op in ("write", "read")}
    with NVMeTier([args.path], handle, pool, name="bench-tier") as tier:
        key = tier.allocate(size, "bench")
        # The raw handle moves the same bytes at the same place of the same swap file as
        # the tier (peeking at its placement), so file layout and disk caching are equal.
        (raw_offset,) = tier._keys.get(key).place.offsets
        raw_file = tier.swap.files[0].file
        variants = {
            "raw": (lambda: handle.pwrite(raw_file, aligned, raw_offset).wait(),
                    lambda: handle.pread(raw_file, aligned, raw_offset).wait()),
            "staged": (lambda: tier.write(key, unaligned).wait(), lambda: tier.read(key, unaligned).wait()),
            "direct": (lambda: tier.write(key, aligned).wait(), lambda: tier.read(key, aligned).wait()),
        }
        for write, read in variants.values():  # warm-up: first touches, file extents
            write()
            read()
        # Writes and reads in separate phases: on disks that cache writes, a read right
        # after a write competes with its flush, which would blur the comparison.
        for op in ("write", "read"):
            for repeat in range(args.repeats):
                order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
                for name in order:
                    samples[f"{name} {op}"].append(_timed(variants[name][op == "read"]))
        _verify(tier, key, handle, raw_file, raw_offset, aligned, unaligned)
        pool_stats = pool.stats()
    medians = {name: _gbps(size, statistics.median(times)) for name, times in samples.items()}
    ratios = {f"{v} {op} / raw": medians[f"{v} {op}"] / medians[f"raw {op}"]
              for v in ("staged", "direct") for op in ("write", "read")}
    # Paired: each repeat's variant against the raw run next to it (within ~1 s), so a
    # disk that drifts between repeats cancels out; the median of those ratios.
    paired = {f"{v} {op} / raw": statistics.median(r / t for r, t in zip(samples[f"raw {op}"], samples[f"{v} {op}"]))
              for v in ("staged", "direct") for op in ("write", "read")}
    return {"size": size, "samples_s": samples, "median_GBps": medians, "ratio": ratios, "paired_ratio": paired,
            "pool": pool_stats, "load_average": os.getloadavg()}


def _verify(tier: NVMeTier, key: int, handle: AioHandle, raw_file, raw_offset: int, aligned: torch.Tensor,
            unaligned: torch.Tensor) -> None:
    """Staged write -> raw read, and raw write -> staged read, must carry the same bytes."""
    expected = torch.randint(0, 256, (aligned.numel(),), dtype=torch.uint8)
    unaligned.copy_(expected)
    tier.write(key, unaligned).wait()
    aligned.zero_()
    handle.pread(raw_file, aligned, raw_offset).wait()
    if not torch.equal(aligned, expected):
        raise RuntimeError("bandwidth benchmark: the raw handle read back other bytes than the tier wrote")
    handle.pwrite(raw_file, aligned, raw_offset).wait()
    unaligned.zero_()
    tier.read(key, unaligned).wait()
    if not torch.equal(unaligned, expected):
        raise RuntimeError("bandwidth benchmark: the tier read back other bytes than the raw handle wrote")


class RssSampler:
    """Samples this process's RSS on a thread; ``peak`` is the highest value seen."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def peak_memory(args: argparse.Namespace, handle: AioHandle) -> dict:
    """Move ``args.move`` bytes to the NVMe tier and back; peak RSS over the pre-pool baseline."""
    chunk = args.chunk
    src = torch.empty(chunk + 64, dtype=torch.uint8)[64:]  # unaligned: the pool path
    dst = torch.empty(chunk + 64, dtype=torch.uint8)[64:]
    src.zero_()
    dst.zero_()
    process = psutil.Process()
    baseline = process.memory_info().rss
    key_nbytes = min(args.move, 1 << 30)
    keys = -(-args.move // key_nbytes)
    with RssSampler() as sampler:
        pool = BufferPool(args.move_pool_buffer, args.move_pool // args.move_pool_buffer,
                          HostAllocator(pin=args.pin), name="move")
        start = time.perf_counter()
        with NVMeTier([args.path], handle, pool, name="bench-move") as tier:
            made = []
            for k in range(keys):
                key = tier.allocate(key_nbytes, f"move{k}")
                made.append(key)
                for offset in range(0, key_nbytes, chunk):
                    src.fill_((k * 131 + offset // chunk) % 251)
                    tier.write(key, src[:min(chunk, key_nbytes - offset)], offset).wait()
            for k, key in enumerate(made):
                for offset in range(0, key_nbytes, chunk):
                    part = dst[:min(chunk, key_nbytes - offset)]
                    tier.read(key, part, offset).wait()
                    expected = (k * 131 + offset // chunk) % 251
                    if part[0].item() != expected or part[-1].item() != expected:
                        raise RuntimeError(f"peak-memory benchmark: key {k} offset {offset} read back wrong bytes")
            moved = 2 * keys * key_nbytes
        seconds = time.perf_counter() - start
        pool_nbytes = pool.nbytes
    return {"moved_bytes": moved, "seconds": seconds, "pool_nbytes": pool_nbytes, "chunk": chunk,
            "baseline_rss": baseline, "peak_rss": sampler.peak, "peak_over_baseline": sampler.peak - baseline,
            "over_pool": sampler.peak - baseline - pool_nbytes, "rss_samples": sampler.samples}


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=os.environ.get("TMPDIR", "/tmp"), help="directory on the drive to test")
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="tensor size for put/get (1GiB)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats per variant (5)")
    parser.add_argument("--pool-buffer", type=parse_size, default=64 << 20, help="pool buffer size (64MiB)")
    parser.add_argument("--pool-buffers", type=int, default=8, help="pool buffers for put/get (8)")
    parser.add_argument("--move", type=parse_size, default=8 << 30, help="bytes moved for peak memory (8GiB)")
    parser.add_argument("--move-pool", type=parse_size, default=256 << 20, help="pool size for peak memory (256MiB)")
    parser.add_argument("--move-pool-buffer", type=parse_size, default=64 << 20, help="its buffer size (64MiB)")
    parser.add_argument("--chunk", type=parse_size, default=64 << 20, help="caller's tensor per transfer (64MiB)")
    parser.add_argument("--block-size", type=parse_size, default=8 << 20, help="aio block size (8MiB)")
    parser.add_argument("--queue-depth", type=int, default=32, help="aio queue depth (32)")
    parser.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    parser.add_argument("--pin", default="auto", choices=["auto", "always", "never"])
    parser.add_argument("--skip", choices=["bandwidth", "memory"], action="append", default=[])
    parser.add_argument("--json", metavar="PATH", help="write settings, machine and raw samples here")
    args = parser.parse_args(argv)

    result: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                "ram": psutil.virtual_memory().total, "torch": torch.__version__}}
    with AioHandle(block_size=args.block_size, queue_depth=args.queue_depth, engine=args.engine) as handle:
        result["machine"]["engine"] = handle.engine
        if "bandwidth" not in args.skip:
            bw = result["bandwidth"] = bandwidth(args, handle)
            print(f"NVMe tier vs raw aio handle: {_mib(bw['size'])} tensor, {args.repeats} alternating repeats, "
                  f"engine {handle.engine}, pool {args.pool_buffers} x {_mib(args.pool_buffer)}")
            print(f"{'variant':<10}{'write GB/s':>11}{'read GB/s':>11}{'write/raw':>11}{'read/raw':>10}"
                  f"{'paired w':>10}{'paired r':>10}")
            for name in ("raw", "staged", "direct"):
                med = bw["median_GBps"]
                cells = ["", "", "", ""] if name == "raw" else [
                    f"{table[f'{name} {op} / raw']:.2f}x" for table in (bw["ratio"], bw["paired_ratio"])
                    for op in ("write", "read")]
                print(f"{name:<10}{med[f'{name} write']:>11.2f}{med[f'{name} read']:>11.2f}{cells[0]:>11}{cells[1]:>10}"
                      f"{cells[2]:>10}{cells[3]:>10}")
            print(f"(load average {bw['load_average'][0]:.1f}; 'paired' = median of per-repeat ratios to the raw run "
                  "beside it)")
        if "memory" not in args.skip:
            mem = result["memory"] = peak_memory(args, handle)
            print(f"\nPeak host memory moving {_mib(mem['moved_bytes'] / 2)} to NVMe and back "
                  f"({_mib(mem['chunk'])} caller tensors, {mem['seconds']:.1f} s):")
            print(f"{'pool':<24}{_mib(mem['pool_nbytes']):>14}")
            print(f"{'peak RSS over baseline':<24}{_mib(mem['peak_over_baseline']):>14}")
            print(f"{'of which beyond pool':<24}{_mib(mem['over_pool']):>14}")
    if args.json:
        with open(args.json, "w") as handle_out:
            json.dump(result, handle_out, indent=2)
    return result


if __name__ == "__main__":
    main()
