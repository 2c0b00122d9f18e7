"""Checkpoint benchmark: save and load GB/s of NVMe-resident states vs the disk's raw aio bandwidth.

A stack of square linear layers (``--numel`` parameters in all, default 200M: 3.2 GB of
checkpoint in fp32) is built with parameters and optimizer states on NVMe under ``--path``,
trained for one step (so the Adam moments exist), then, ``--repeats`` times, alternating in
one run (the disk's bandwidth drifts by tens of percent from minute to minute):

- raw aio write, read, and copy (read one file while writing another, ``DEPTH`` buffers of
  ``--buffer-size`` in flight: the pattern of a save or load, with no checksums and no tiers)
  of as many bytes as the checkpoint holds, O_DIRECT, fsync included;
- ``infinity.save_checkpoint`` (reads the swap files through the tiers, writes the checkpoint)
  and ``infinity.load_checkpoint`` (reads it back into the tiers), each with the peak RSS
  (psutil, sampled every 2 ms on a thread) above the RSS just before the call.

The table shows medians and the ratio of each median to the raw copy's (and to raw write /
read). Example::

    python -m benchmarks.checkpoint --path /mnt/nvme --json checkpoint.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import statistics
import threading
import time

import psutil
import torch
from torch import nn

import infinity
from infinity.config.sizes import parse_count, parse_size
from infinity.checkpoint.stream import DEPTH


class RssPeak:
    """Peak resident set size of this process, sampled on a thread while the block runs."""

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.peak = 0
        self.before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RssPeak":
        proc = psutil.Process()
        self.before = self.peak = proc.memory_info().rss

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


def _model(numel: int, layers: int) -> nn.Module:
    d = max(64, int((numel / layers) ** 0.5) // 64 * 64)
    return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])


class RawDisk:
    """Sequential O_DIRECT transfers of ``nbytes`` with ``DEPTH`` buffers in flight, as a save moves them."""

    def __init__(self, directory: str, nbytes: int, buffer_nbytes: int, aio) -> None:
        from tiers.aio import AioHandle, aligned_empty

        self.a = os.path.join(directory, "raw-a.bin")
        self.b = os.path.join(directory, "raw-b.bin")
        self.nbytes = nbytes
        self.block = buffer_nbytes
        self.handle = AioHandle(block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads,
                                engine=aio.engine)
        self.buffers = [aligned_empty(buffer_nbytes) for _ in range(DEPTH)]
        for buf in self.buffers:
            buf.copy_(torch.randint(0, 256, (buffer_nbytes,), dtype=torch.uint8))

    def _pieces(self):
        for k, offset in enumerate(range(0, self.nbytes, self.block)):
            yield k, offset, min(self.block, self.nbytes - offset)

    def write(self, path: str | None = None) -> float:
        from tiers.aio import open_file

        start = time.perf_counter()
        with open_file(path or self.a, "w", create=True) as f:
            inflight = collections.deque()
            for k, offset, n in self._pieces():
                if len(inflight) >= DEPTH:
                    inflight.popleft().wait()
                inflight.append(self.handle.pwrite(f, self.buffers[k % DEPTH][:n], offset))
            while inflight:
                inflight.popleft().wait()
            os.fsync(f.fd)
        return time.perf_counter() - start

    def read(self) -> float:
        from tiers.aio import open_file

        start = time.perf_counter()
        with open_file(self.a, "r") as f:
            inflight = collections.deque()
            for k, offset, n in self._pieces():
                if len(inflight) >= DEPTH:
                    inflight.popleft().wait()
                inflight.append(self.handle.pread(f, self.buffers[k % DEPTH][:n], offset))
            while inflight:
                inflight.popleft().wait()
        return time.perf_counter() - start

    def copy(self) -> float:
        """Read ``a`` into a buffer, write it to ``b``; the next read is issued before this write is waited for."""
        from tiers.aio import open_file

        start = time.perf_counter()
        with open_file(self.a, "r") as src, open_file(self.b, "w", create=True) as dst:
            writes = [None] * DEPTH
            reads = collections.deque()
            for k, offset, n in self._pieces():
                slot = k % DEPTH
                if writes[slot] is not None:
                    writes[slot].wait()
                reads.append((slot, offset, n, self.handle.pread(src, self.buffers[slot][:n], offset)))
                if len(reads) > 1:
                    s, o, m, fut = reads.popleft()
                    fut.wait()
                    writes[s] = self.handle.pwrite(dst, self.buffers[s][:m], o)
            while reads:
                s, o, m, fut = reads.popleft()
                fut.wait()
                writes[s] = self.handle.pwrite(dst, self.buffers[s][:m], o)
            for fut in writes:
                if fut is not None:
                    fut.wait()
            os.fsync(dst.fd)
        return time.perf_counter() - start

    def remove(self) -> None:
        for path in (self.a, self.b):
            if os.path.exists(path):
                os.unlink(path)

    def close(self) -> None:
        self.handle.close()
        self.remove()


def _wait_for_cleanup() -> None:
    """The previous version is deleted in the background after a save; keep it out of the next timing."""
    for thread in threading.enumerate():
        if thread.name == "infinity-checkpoint-cleanup":
            thread.join()


def _data_nbytes(version: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(version):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names if n.endswith(".bin"))
    return total


def run(args: argparse.Namespace) -> dict:
    work = os.path.join(args.path, f"infinity-ckpt-bench-{os.getpid()}")
    swap = os.path.join(work, "swap")
    os.makedirs(swap)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": swap,
                     "pool_buffer_size": args.pool_buffer_size},
           "aio": {"engine": args.aio_engine}, "checkpoint": {"buffer_size": args.buffer_size}}
    if args.sub_group_size:
        cfg["partition"] = {"sub_group_size": args.sub_group_size}
    try:
        t0 = time.perf_counter()
        with infinity.Init(cfg) as init:
            model = _model(args.numel, args.layers)
        opt = infinity.AdamW(model, lr=1e-4)
        x = torch.randn(1, model[0].in_features)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        setup_s = time.perf_counter() - t0
        engine = init.engine
        numel = sum(g.numel for g in engine.coordinator.groups)
        ckpt = os.path.join(work, "ckpt")
        version = infinity.save_checkpoint(ckpt, model, opt)       # warm-up: imports, first allocations
        _wait_for_cleanup()
        nbytes = _data_nbytes(version)
        raw = RawDisk(work, nbytes, args.buffer_size, engine.config.aio)
        samples = []
        try:
            for repeat in range(args.repeats):
                row = {"repeat": repeat, "raw_write_s": raw.write(), "raw_read_s": raw.read(),
                       "raw_copy_s": raw.copy()}
                raw.remove()            # disk room for the two versions a save holds at its end
                with RssPeak() as rss:
                    t = time.perf_counter()
                    infinity.save_checkpoint(ckpt, model, opt)
                    row["save_s"] = time.perf_counter() - t
                row.update(save_rss_before=rss.before, save_rss_peak=rss.peak)
                t = time.perf_counter()
                _wait_for_cleanup()
                row["cleanup_s"] = time.perf_counter() - t
                with RssPeak() as rss:
                    t = time.perf_counter()
                    infinity.load_checkpoint(ckpt, model, opt)
                    row["load_s"] = time.perf_counter() - t
                row.update(load_rss_before=rss.before, load_rss_peak=rss.peak)
                samples.append(row)
        finally:
            raw.close()
            engine.tiers.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"settings": {"path": args.path, "numel": numel, "layers": args.layers, "buffer_size": args.buffer_size,
                         "depth": DEPTH, "aio_engine": args.aio_engine, "repeats": args.repeats,
                         "sub_group_size": engine.layout.sub_group_size, "checkpoint_nbytes": nbytes},
            "machine": {"cpus": os.cpu_count(), "memory": psutil.virtual_memory().total,
                        "kernel": platform.release(), "python": platform.python_version(),
                        "torch": torch.__version__, "aio_engine": raw.handle.engine},
            "setup_s": setup_s, "samples": samples}


def table(record: dict) -> str:
    s, samples = record["settings"], record["samples"]
    nbytes = s["checkpoint_nbytes"]
    med = {k: statistics.median(r[k] for r in samples)
           for k in ("raw_write_s", "raw_read_s", "raw_copy_s", "save_s", "load_s")}
    ratio = {k: statistics.median(r["raw_copy_s"] / r[k] for r in samples)
             for k in ("save_s", "load_s")}
    gb = nbytes / 1e9
    lines = [f"checkpoint of {s['numel'] / 1e6:.0f}M parameters on NVMe: {gb:.2f} GB "
             f"(params + fp32 master + 2 moments), buffers {DEPTH} x {s['buffer_size'] >> 20} MiB, "
             f"aio {record['machine']['aio_engine']}, {len(samples)} repeat(s), medians",
             f"{'what':<12}{'seconds':>9}{'GB/s':>8}{'vs raw copy':>13}   (GB/s over raw copy's, same repeat; median)"]
    for key, name in (("raw_write_s", "raw write"), ("raw_read_s", "raw read"), ("raw_copy_s", "raw copy"),
                      ("save_s", "save"), ("load_s", "load")):
        vs = f"{ratio[key]:.2f}" if key in ratio else ("1.00" if key == "raw_copy_s" else "")
        lines.append(f"{name:<12}{med[key]:>9.2f}{gb / med[key]:>8.2f}{vs:>13}")
    mib = 1 << 20
    lines.append(f"deleting the previous version after a save (background): "
                 f"{statistics.median(r['cleanup_s'] for r in samples):.2f} s median")
    for what in ("save", "load"):
        before = statistics.median(r[f"{what}_rss_before"] for r in samples)
        delta = max(r[f"{what}_rss_peak"] - r[f"{what}_rss_before"] for r in samples)
        lines.append(f"peak RSS during {what}: +{delta / mib:.0f} MiB over {before / mib:.0f} MiB before "
                     f"(streaming buffers: {DEPTH * s['buffer_size'] / mib:.0f} MiB)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="directory on the drive to test (swap files and checkpoint)")
    p.add_argument("--numel", type=parse_count, default=200_000_000, help="parameters in all (default 200M)")
    p.add_argument("--layers", type=int, default=12, help="square linear layers (default 12)")
    p.add_argument("--buffer-size", type=parse_size, default=64 << 20, help="checkpoint.buffer_size (default 64MiB)")
    p.add_argument("--sub-group-size", type=parse_count, default=0, help="partition.sub_group_size (default: config's)")
    p.add_argument("--pool-buffer-size", type=parse_size, default=64 << 20,
                   help="tiers.pool_buffer_size of the NVMe tier (default 64MiB, the config's)")
    p.add_argument("--aio-engine", default="auto", choices=("auto", "io_uring", "threads"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write settings, machine and raw samples here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = run(args)
    print(table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
