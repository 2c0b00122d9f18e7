"""This machine's rates, measured once and cached: the inputs of ``auto`` placement's step-time model.

[Note: machine probes]
Short probes (about ``seconds`` each, 0.2 by default) measure what the step-time model divides by:
a copy each way through a pinned buffer on a GPU (a memory copy with the CPU as compute device), torch's
fused AdamW (``torch._fused_adamw_``, the update pass's kernel, fp32 states) on the host and on the GPU, a matmul in the dtype
the model's linear layers run in, and a large host memory copy (bandwidth counts the bytes read and
written). Disk rates come from an ``infinity-bench nvme --json`` file when one is given ([Note: reading
infinity-bench JSON] in infinity/plan/bandwidth.py), and are kept with the rest. The rates are cached in
``~/.cache/infinity/machine.json`` under a key of hostname, CPU model, GPU name and compute dtype, so
later runs probe nothing; memory sizes (device free, host available, NVMe free) are read fresh each
time, since they change between runs (the device's free memory counts what this process's caching
allocator holds unused: it is this run's to use). Tests never probe: they give a ``MachineProfile``.

A probe taken while other work loads the cores reads the machine slower than it is, and the cache kept
it for every later run: one taken during a test suite on a 2-core VM read the host AdamW at 0.33 G
params/s and the matmul at 33 GFLOP/s where the quiet machine gives 1.8-2.1 and 160-190, so the step model
took the update for five times its time. So each probe records the load per core it ran beside (the
one-minute load average over the cores this process may use), and a cached probe taken at a load of
``BUSY`` or more is taken again once the load is under it; one taken on a busy machine is kept while
the machine stays busy (a probe then would read no better).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import time
from pathlib import Path

import torch

from infinity.plan.bandwidth import Bandwidth
from infinity.plan.machine import MachineProfile

CACHE_PATH = Path.home() / ".cache" / "infinity" / "machine.json"
BUSY = 0.5
"""Load per core at which a probe counts as taken beside other work (see [Note: machine probes])."""
_PROBE_NUMEL = 1 << 24          # 16Mi fp32 elements per AdamW pass (256 MiB of states): past any CPU cache
_COPY_BYTES = 64 << 20


def machine_key(device: str, dtype: str) -> str:
    """What identifies this machine's rates: hostname, CPU model, GPU name, compute device and dtype."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "no gpu"
    return f"{socket.gethostname()} | {cpu} | {gpu} | {device} {dtype}"


def load_per_core() -> float:
    """The one-minute load average over the cores this process may run on (0 where unknown)."""
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return os.getloadavg()[0] / max(1, cores)
    except OSError:
        return 0.0


def _timed(fn, seconds: float, sync=lambda: None) -> float:
    """Seconds per call of ``fn``, the best of calls over about ``seconds`` after one warm-up call."""
    fn()
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def device_free_bytes() -> float:
    """The current GPU's memory this process can still use: free on the device, and what its own caching
    allocator holds reserved but unused (another process's, and the CUDA context, are not ours)."""
    free, _ = torch.cuda.mem_get_info()
    return float(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def probe_rates(device: str, dtype: str, seconds: float = 0.2) -> dict[str, float]:
    """Measure the rates of [Note: machine probes] (takes about 5 x ``seconds``)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=cuda)
    other = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    h2d = _COPY_BYTES / _timed(lambda: other.copy_(host, non_blocking=True), seconds, sync) / 1e9
    d2h = _COPY_BYTES / _timed(lambda: host.copy_(other, non_blocking=True), seconds, sync) / 1e9
    big = torch.empty(4 * _COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(big)
    memory = 2 * big.numel() / _timed(lambda: dst.copy_(big), seconds) / 1e9
    def adam_rate(on: str) -> float:
        p, g, m, v = (torch.rand(_PROBE_NUMEL, device=on) for _ in range(4))
        steps = torch.zeros((), dtype=torch.float32, device=on)

        def adam() -> None:
            torch._fused_adamw_([p], [g], [m], [v], [], [steps], lr=1e-3, beta1=0.9, beta2=0.999,
                                weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        return _PROBE_NUMEL / _timed(adam, seconds, sync if on != "cpu" else (lambda: None))

    host_adam = adam_rate("cpu")
    mm_dtype = getattr(torch, dtype) if cuda else torch.float32
    a = torch.randn(2048, 2048, device=device, dtype=mm_dtype)
    flops = 2 * 2048**3 / _timed(lambda: a @ a, seconds, sync)
    return {"h2d_gbps": h2d, "d2h_gbps": d2h, "host_memory_gbps": memory, "host_adam_params_per_s": host_adam,
            "device_flops": flops, "device_update_params_per_s": adam_rate(device) if cuda else host_adam}


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def machine_profile(device: str, dtype: str, *, ranks: int = 1, nvme_paths: tuple[str, ...] = (),
                    host_budget: int = 0, bench_json: str | Path | None = None, cache: Path | None = CACHE_PATH,
                    seconds: float = 0.2, refresh: bool = False, keep_busy: bool = False) -> MachineProfile:
    """This machine's profile: rates from the cache (probed and cached when missing), sizes read now.

    Parameters
    ----------
    device, dtype : str
        The compute device ("cpu" or "cuda") and ``precision.dtype``.
    ranks : int
        Ranks on this machine.
    nvme_paths : tuple of str
        ``tiers.nvme_path``; their free space is the NVMe room (none: no NVMe tier).
    host_budget : int
        ``tiers.host_budget`` (0: the memory available now).
    bench_json : path, optional
        An ``infinity-bench nvme --json`` result; its rates replace the cached disk rates.
    cache : Path or None
        The cache file; None probes without reading or writing one.
    refresh : bool
        Probe again and replace the cached rates (a probe taken while other jobs loaded the machine
        reads it slower than it is; the disk rates are kept). A cached probe that recorded a load of
        ``BUSY`` per core or more, or none (cached by an earlier version), is taken again by itself once the
        load is lower, unless ``keep_busy``.
    """
    key = machine_key(device, dtype)
    data = _read_cache(cache) if cache is not None else {}
    entry = dict(data[key]) if isinstance(data.get(key), dict) else None     # a copy: compared with the cached one
    load = load_per_core()
    # A probe cached before probes recorded their load is as doubtful as a busy one (the one that read 5x low had none).
    busy_then = not keep_busy and entry is not None and float(entry.get("load_per_core", BUSY)) >= BUSY > load
    if refresh or busy_then or entry is None or not isinstance(entry.get("rates"), dict):
        entry = {**(entry or {}), "rates": probe_rates(device, dtype, seconds),
                 "probed": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_per_core": round(load, 2)}
    if bench_json is not None:
        bw = Bandwidth.from_bench_json(bench_json)
        entry["disk"] = {"disk_read_gbps": bw.read_gbps, "disk_write_gbps": bw.write_gbps, "source": bw.source}
    if cache is not None and data.get(key) != entry:
        data[key] = entry
        _write_cache(cache, data)
    import psutil

    host = float(host_budget or psutil.virtual_memory().available)
    device_bytes = device_free_bytes() if device == "cuda" and torch.cuda.is_available() else 0.0
    disk = entry.get("disk") or {}
    nvme = float(sum(shutil.disk_usage(p).free for p in nvme_paths if os.path.isdir(p))) if disk else 0.0
    return MachineProfile(
        name=key, device_bytes=device_bytes, host_bytes=host, nvme_bytes=nvme, ranks=ranks,
        unified=device != "cuda", source=f"probed, cached in {cache}" if cache else "probed",
        disk_read_gbps=float(disk.get("disk_read_gbps", 0.0)), disk_write_gbps=float(disk.get("disk_write_gbps", 0.0)),
        **{k: float(v) for k, v in entry["rates"].items()})


def cached_profile(device: str, dtype: str, *, ranks: int = 1, nvme_paths: tuple[str, ...] = (),
                   host_budget: int = 0, cache: Path | None = None) -> MachineProfile | None:
    """This machine's profile when its rates are cached, else None: what a caller that must not spend
    a second probing (``infinity.trace``) reads. Arguments as :func:`machine_profile`'s; ``cache``
    None reads ``CACHE_PATH``."""
    cache = CACHE_PATH if cache is None else cache
    entry = _read_cache(cache).get(machine_key(device, dtype))
    if not isinstance(entry, dict) or not isinstance(entry.get("rates"), dict):
        return None
    return machine_profile(device, dtype, ranks=ranks, nvme_paths=nvme_paths, host_budget=host_budget, cache=cache,
                           keep_busy=True)


__all__ = ["CACHE_PATH", "cached_profile", "machine_key", "machine_profile", "probe_rates"]
