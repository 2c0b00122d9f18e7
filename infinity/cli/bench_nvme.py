"""The measurements behind ``infinity-bench nvme``: our aio engines, fio, and two Python baselines.

Each ``measure_*`` function moves the whole test file once (a sequential write or read of ``size``
bytes) and returns one :class:`Sample` with the wall time and the CPU time it cost. The CLI in
``infinity.cli.bench`` decides the order (interleaved, see [Note: interleaving]) and the reporting.

[Note: page cache]
Reads must come from the disk, not from memory. Our engines and fio use ``O_DIRECT``. The buffered
baselines (Python file objects, aiofiles) go through the page cache by design, so before each of
their reads the file's cached pages are dropped with ``posix_fadvise(DONTNEED)`` (after an fsync),
and their writes are timed up to the end of an ``fsync`` so that dirty pages still in memory are not
counted as written.

[Note: buffer footprint]
How much memory the I/O streams through changes the result on a virtual disk: the host copies
each write out of guest memory, and a small buffer stays in its caches. 128 KiB writes at depth 32
from a 96 MiB buffer ran at 0.78x of fio, which cycles through 32 buffers of 128 KiB (4 MiB); from
4 MiB they ran level or ahead. So "the same settings" includes the same footprint: our requests are
one window (queue_depth x block_size) long and all use the same window-sized buffer. The pieces in
flight are always consecutive, at most one window, so no two of them ever share memory.

[Note: CPU per GB]
CPU time is ``getrusage`` user+system (``RUSAGE_SELF``) around the timed pass for our engines and
the baselines (the C worker and completion threads belong to this process). For fio it is fio's own
per-job figure (usr_cpu + sys_cpu over the job's runtime): ``RUSAGE_CHILDREN`` would also count
fio's start-up, which fills its buffers with random bytes and costs more than a 1 GB pass itself.
It is reported as CPU seconds per decimal GB moved, the cost the I/O takes from the cores the
optimizer needs.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import time
from typing import Callable

import torch

from tiers import aio

GB = 10**9
QUEUED_BYTES = 32 << 20
"""Bytes the benchmark keeps submitted beyond the request in flight (the C core splits them)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the sweep.

    ``queue_depth`` is the pieces in flight for io_uring; the thread pool keeps ``threads`` pieces
    in flight, so for it ``queue_depth`` equals ``threads``.
    """

    engine: str
    block_size: int
    queue_depth: int
    threads: int
    direct: bool = True

    def label(self) -> str:
        depth = f"qd{self.queue_depth}" if self.engine == "io_uring" else f"t{self.threads}"
        return f"{self.engine} {_short_size(self.block_size)} {depth}"

    def aio_section(self) -> dict[str, object]:
        """The ``[aio]`` config keys that reproduce this setting."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "threads": self.threads,
            "engine": self.engine,
            "direct": self.direct,
        }


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed pass over the file."""

    tool: str  # "ours" | "fio" | "python" | "aiofiles"
    op: str  # "read" | "write"
    setting: Setting | None
    repeat: int
    nbytes: int
    seconds: float
    cpu_seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_seconds / (self.nbytes / GB) if self.nbytes else 0.0

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["gb_per_s"] = self.gb_per_s
        out["cpu_s_per_gb"] = self.cpu_s_per_gb
        return out


def _short_size(nbytes: int) -> str:
    for name, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return f"{nbytes}B"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def request_size(setting: Setting, size: int) -> int:
    """Bytes per submitted request: the engine's window (pieces in flight x block_size), so that the
    pieces in flight at any moment, being consecutive, sit in distinct parts of one window-sized
    buffer, as fio's in-flight I/Os each sit in one of its ``iodepth`` buffers (see
    [Note: buffer footprint])."""
    in_flight = setting.queue_depth if setting.engine == "io_uring" else setting.threads
    return max(setting.block_size, min(in_flight * setting.block_size, size // setting.block_size * setting.block_size))


def requests_ahead(setting: Setting, size: int) -> int:
    """Requests kept submitted: at least ``QUEUED_BYTES`` beyond the one in flight, so that a late
    Python wake-up on a busy machine never leaves the engine's queue empty."""
    return max(2, -(-QUEUED_BYTES // request_size(setting, size))) + 1


def buffer_size(setting: Setting, size: int) -> int:
    """Bytes of memory one pass reads into or writes from: one request, shared by all of them."""
    return request_size(setting, size)


def make_buffer(nbytes: int) -> torch.Tensor:
    """An aligned buffer of random bytes (random, so no layer below can compress or dedupe it)."""
    buf = aio.aligned_empty(nbytes)
    gen = torch.Generator().manual_seed(1234)
    buf.view(torch.int32)[:] = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=gen)
    return buf


def measure_ours(path: str, size: int, op: str, setting: Setting, buf: torch.Tensor, repeat: int = 0,
                 progress: Callable[[int], None] | None = None) -> Sample:
    """Move ``size`` bytes through our engine, ``requests_ahead`` requests kept submitted.

    Every request uses the first ``buffer_size(setting, size)`` bytes of ``buf``; see
    [Note: buffer footprint].
    """
    request = request_size(setting, size)
    ahead = requests_ahead(setting, size)
    if buf.numel() < request:
        raise ValueError(f"measure_ours: buffer of {buf.numel()} bytes, {request} needed")
    window = buf[:request]
    with aio.AioHandle(block_size=setting.block_size, queue_depth=setting.queue_depth, threads=setting.threads,
                       engine=setting.engine, direct=setting.direct) as handle, \
            aio.open_file(path, "r" if op == "read" else "w", direct=setting.direct) as file:
        submit = handle.pread if op == "read" else handle.pwrite
        pending: collections.deque[aio.AioFuture] = collections.deque()
        cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
        for offset in range(0, size, request):
            if len(pending) == ahead:
                done = pending.popleft()
                done.wait()
                if progress:
                    progress(done.nbytes)
            pending.append(submit(file, window[: min(request, size - offset)], offset))
        while pending:
            done = pending.popleft()
            done.wait()
            if progress:
                progress(done.nbytes)
        seconds = time.perf_counter() - t0
        cpu = _cpu(resource.RUSAGE_SELF) - cpu0
    return Sample("ours", op, setting, repeat, size, seconds, cpu)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_python(path: str, size: int, op: str, chunk: int, repeat: int = 0,
                   progress: Callable[[int], None] | None = None) -> Sample:
    """Baseline: an unbuffered Python file object, ``readinto`` / ``write`` of ``chunk`` bytes."""
    buf = bytearray(make_buffer(chunk).numpy().tobytes())
    _drop_cache(path)
    cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    with open(path, "rb" if op == "read" else "r+b", buffering=0) as f:
        for offset in range(0, size, chunk):
            view = memoryview(buf)[: min(chunk, size - offset)]
            n = f.readinto(view) if op == "read" else f.write(view)
            if n != len(view):
                raise OSError(f"python baseline: {op} of {len(view)} bytes at {offset} of {path} moved {n}")
            if progress:
                progress(n)
        if op == "write":
            os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    return Sample("python", op, None, repeat, size, seconds, _cpu(resource.RUSAGE_SELF) - cpu0)


def measure_aiofiles(path: str, size: int, op: str, chunk: int, repeat: int = 0,
                     progress: Callable[[int], None] | None = None) -> Sample:
    """Baseline: aiofiles (a thread pool behind asyncio), sequential ``read`` / ``write`` of ``chunk``."""
    import aiofiles  # optional dependency of the benchmark only

    data = make_buffer(chunk).numpy().tobytes()

    async def run() -> None:
        async with aiofiles.open(path, "rb" if op == "read" else "r+b", buffering=0) as f:
            for offset in range(0, size, chunk):
                n = min(chunk, size - offset)
                if op == "read":
                    got = len(await f.read(n))
                else:
                    got = await f.write(data[:n])
                if got != n:
                    raise OSError(f"aiofiles baseline: {op} of {n} bytes at {offset} of {path} moved {got}")
                if progress:
                    progress(n)
            if op == "write":
                await f.flush()
                await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())

    _drop_cache(path)
    cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    asyncio.run(run())
    seconds = time.perf_counter() - t0
    return Sample("aiofiles", op, None, repeat, size, seconds, _cpu(resource.RUSAGE_SELF) - cpu0)


def fio_version() -> str | None:
    """fio's version string, or None when fio is not installed."""
    exe = shutil.which("fio")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def fio_command(path: str, size: int, op: str, setting: Setting) -> list[str]:
    """The fio command line equivalent to ``measure_ours`` with ``setting``.

    io_uring: one job with ``iodepth=queue_depth``. Thread pool: ``threads`` psync jobs, each
    streaming its own contiguous share of the file, which is what our pool's workers do together.
    """
    cmd = ["fio", "--name=infinity", f"--filename={path}", f"--rw={op}", f"--bs={setting.block_size}",
           f"--direct={int(setting.direct)}", "--output-format=json", "--thread", "--group_reporting",
           "--fallocate=none", "--invalidate=1"]
    if setting.engine == "io_uring":
        cmd += ["--ioengine=io_uring", f"--iodepth={setting.queue_depth}", f"--size={size}"]
    else:
        share = size // setting.threads // setting.block_size * setting.block_size
        cmd += ["--ioengine=psync", f"--numjobs={setting.threads}", f"--size={share}",
                f"--offset_increment={share}"]
    return cmd


def measure_fio(path: str, size: int, op: str, setting: Setting, repeat: int = 0,
                progress: Callable[[int], None] | None = None) -> Sample:
    """Run fio with the same settings on the same file; bytes and time are fio's own report."""
    cmd = fio_command(path, size, op, setting)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = proc.stdout
    if proc.returncode != 0 or "{" not in text:
        raise RuntimeError(f"fio failed (exit {proc.returncode}) running {' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    report = json.loads(text[text.index("{"):])
    job = report["jobs"][0]
    nbytes, runtime_ms = int(job[op]["io_bytes"]), float(job[op]["runtime"])
    cpu = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100.0 * runtime_ms / 1000.0
    if nbytes == 0 or runtime_ms <= 0:
        raise RuntimeError(f"fio moved no bytes running {' '.join(cmd)}")
    if progress:
        progress(size)
    return Sample("fio", op, setting, repeat, nbytes, runtime_ms / 1000.0, cpu)


def lay_out(path: str, size: int, direct: bool = True, progress: Callable[[int], None] | None = None) -> None:
    """Write the whole test file once, so that timed writes overwrite allocated blocks like fio's."""
    engine = "io_uring" if "io_uring" in aio.available_engines() else "threads"
    setting = Setting(engine, min(8 << 20, size), 16, 4, direct)
    buf = make_buffer(buffer_size(setting, size))
    with open(path, "ab"):
        pass
    measure_ours(path, size, "write", setting, buf, progress=progress)
