"""infinity-report: what this machine offers the engine, on one screen (``--json`` for machines).

Versions; CUDA, the GPUs and pinned memory; which I/O engines work here (io_uring, the
thread pool, GPUDirect Storage through kvikio and cuFile), each probed with a real 4 KiB
write and read in ``--path``; whether that path takes O_DIRECT and how much room it has;
NUMA nodes and libnuma. Every probe catches its own failure and reports it as a finding,
so the report always completes.

Examples
--------
    infinity-report --path /mnt/nvme
    infinity-report --path /mnt/nvme --json report.json   # the screen, and JSON in a file
    infinity-report --json                                # JSON on stdout only
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import importlib
import importlib.util
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from infinity.cli.common import Parser, UsageError, check_output, run, write_text_atomic
from infinity.config.sizes import human_size
from tiers import newfile

PROBE_NBYTES = 4096
ENGINES = ("io_uring", "threads")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _module_version(name: str) -> str | None:
    try:
        return getattr(importlib.import_module(name), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken optional module is a finding, not a crash
        return None


def versions() -> dict[str, Any]:
    """Python, kernel, and the versions of infinity, torch, numpy, psutil and the aio core."""
    import infinity

    out = {"python": platform.python_version(), "kernel": platform.release(), "infinity": infinity.__version__}
    for name in ("torch", "numpy", "psutil"):
        out[name] = _module_version(name)
    out["aio_core"] = _module_version("tiers._aio")
    return out


def _gpu_numa_node(props: Any) -> int | None:
    """The NUMA node of a GPU, from its PCI address in sysfs (None when unknown)."""
    try:
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        return node if node >= 0 else None
    except (AttributeError, OSError, ValueError):
        return None


def cuda() -> dict[str, Any]:
    """CUDA availability, the GPUs, and whether pinned host memory can be allocated."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "error": _error(exc), "gpus": [], "pinned_memory": False}
    out: dict[str, Any] = {"available": torch.cuda.is_available(), "cuda_version": torch.version.cuda, "gpus": []}
    if not out["available"]:
        out["pinned_memory"] = False
        out["pinned_detail"] = "needs CUDA" if torch.version.cuda else "torch is built without CUDA"
        return out
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out["gpus"].append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                            "capability": f"{props.major}.{props.minor}", "numa_node": _gpu_numa_node(props)})
    try:
        out["pinned_memory"] = bool(torch.empty(PROBE_NBYTES, dtype=torch.uint8, pin_memory=True).is_pinned())
        out["pinned_detail"] = "allocated and pinned 4 KiB"
    except Exception as exc:  # noqa: BLE001
        out["pinned_memory"], out["pinned_detail"] = False, _error(exc)
    return out


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(file system type, device) of the mount holding ``path``, from /proc/mounts."""
    best: tuple[int, str, str] | None = None
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount_point, fstype = fields[0], fields[1].replace("\\040", " "), fields[2]
        inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > best[0]):
            best = (len(mount_point), fstype, device)
    return None if best is None else (best[1], best[2])


def _try_direct(directory: Path) -> tuple[bool, str]:
    """Open a new file with O_DIRECT in ``directory`` and write one aligned 4 KiB block to it."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    # Created anew under a random name, then O_DIRECT set on that descriptor: never reopened by name (a name
    # can be swapped for a symlink on a shared disk: [Note: temporary names on a shared disk]).
    fd, name = newfile.create(str(directory), prefix=".infinity-report-", private=True)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        os.close(fd)
        os.unlink(name)
        return False, f"open refused: {exc.strerror}"
    try:
        with mmap.mmap(-1, PROBE_NBYTES) as block:  # anonymous mappings are page-aligned
            os.write(fd, block)
        return True, "opened and wrote 4 KiB"
    except OSError as exc:
        return False, f"write refused: {exc.strerror}"
    finally:
        os.close(fd)
        os.unlink(name)


def path_info(path: str | os.PathLike) -> dict[str, Any]:
    """Free space, file system and O_DIRECT support of a directory."""
    directory = Path(path).resolve()
    out: dict[str, Any] = {"path": str(directory)}
    usage = shutil.disk_usage(directory)
    out["free_bytes"], out["total_bytes"] = usage.free, usage.total
    mount = _mount_of(directory)
    out["fstype"], out["device"] = mount if mount else (None, None)
    try:
        out["o_direct"], out["o_direct_detail"] = _try_direct(directory)
    except OSError as exc:
        out["o_direct"], out["o_direct_detail"] = False, f"cannot create a file here: {exc.strerror}"
    return out


def _probe_engine(engine: str, directory: Path, direct: bool) -> tuple[bool, str]:
    """Write 4 KiB with ``engine`` and read it back; (works, detail)."""
    import torch

    from tiers import aio

    fd, name = tempfile.mkstemp(prefix=".infinity-report-", dir=directory)
    os.close(fd)
    try:
        with aio.AioHandle(block_size=PROBE_NBYTES, queue_depth=2, threads=1, engine=engine, direct=direct) as handle:
            with aio.open_file(name, "rw", direct=direct) as file:
                data = aio.aligned_empty(PROBE_NBYTES)
                data.copy_(torch.arange(PROBE_NBYTES) % 251)
                back = aio.aligned_empty(PROBE_NBYTES)
                handle.pwrite(file, data, 0).wait()
                handle.pread(file, back, 0).wait()
                if not bool((back == data).all()):
                    return False, "read back different bytes"
        return True, f"4 KiB written and read back{' with O_DIRECT' if direct else ''}"
    except Exception as exc:  # noqa: BLE001 - the reason an engine fails is the finding
        return False, _error(exc)
    finally:
        os.unlink(name)


def _gpudirect() -> dict[str, Any]:
    """GPUDirect Storage: kvikio importable, libcufile present, and kvikio not in compat mode."""
    out: dict[str, Any] = {"kvikio": _module_version("kvikio"), "cufile": ctypes.util.find_library("cufile")}
    if out["kvikio"] is None:
        out["works"], out["detail"] = False, "kvikio not installed (pip install '.[gpu]')"
        return out
    try:
        import kvikio.defaults

        compat = kvikio.defaults.compat_mode()
        out["compat_mode"] = str(getattr(compat, "name", compat))
        compat_on = out["compat_mode"] not in ("False", "OFF")
    except Exception as exc:  # noqa: BLE001
        out["compat_mode"], compat_on = _error(exc), True
    out["works"] = bool(out["cufile"]) and not compat_on
    out["detail"] = ("kvikio uses cuFile" if out["works"] else
                     "libcufile not found" if not out["cufile"] else f"kvikio in compat mode ({out['compat_mode']})")
    return out


def io_engines(directory: str | os.PathLike, direct: bool) -> dict[str, Any]:
    """Which engines the aio core allows, and whether each works for a real write and read."""
    out: dict[str, Any] = {}
    have_face = False
    try:
        try:
            from tiers import aio

            listed, out["listed_by"], have_face = aio.available_engines(), "tiers.aio.available_engines()", True
        except ImportError:
            from tiers import _aio

            listed, out["listed_by"] = list(_aio.engines()), "tiers._aio.engines()"
    except Exception as exc:  # noqa: BLE001 - no aio core at all is a finding
        listed, out["listed_by"] = [], _error(exc)
    for engine in ENGINES:
        entry: dict[str, Any] = {"allowed": engine in listed}
        if not entry["allowed"]:
            entry["works"], entry["detail"] = False, "not allowed by this kernel or container"
        elif not have_face:
            entry["works"], entry["detail"] = None, "allowed; not probed (tiers.aio missing)"
        else:
            entry["works"], entry["detail"] = _probe_engine(engine, Path(directory), direct)
        out[engine] = entry
    out["gpudirect"] = _gpudirect()
    return out


def _libnuma() -> dict[str, Any]:
    name = ctypes.util.find_library("numa")
    out: dict[str, Any] = {"library": name, "loads": False, "py_libnuma": importlib.util.find_spec("numa") is not None}
    if name:
        try:
            lib = ctypes.CDLL(name)
            out["loads"] = True
            out["numa_available"] = int(lib.numa_available())
        except (OSError, AttributeError) as exc:
            out["error"] = _error(exc)
    return out


def numa() -> dict[str, Any]:
    """NUMA nodes (cpus and memory each) from /sys/devices/system/node, and libnuma."""
    nodes = []
    root = Path("/sys/devices/system/node")
    for node_dir in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        node: dict[str, Any] = {"node": int(node_dir.name[4:])}
        try:
            node["cpus"] = (node_dir / "cpulist").read_text().strip()
            for line in (node_dir / "meminfo").read_text().splitlines():
                if "MemTotal:" in line:
                    node["memory_bytes"] = int(line.split()[-2]) * 1024
        except (OSError, ValueError):
            pass
        nodes.append(node)
    return {"nodes": nodes, "libnuma": _libnuma()}


def host() -> dict[str, Any]:
    """Host RAM, CPU count and the locked-memory limit (which caps pinning without CUDA's help)."""
    import psutil

    memory = psutil.virtual_memory()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {"memory_total_bytes": memory.total, "memory_available_bytes": memory.available,
            "cpus": os.cpu_count(), "memlock_limit_bytes": None if soft == resource.RLIM_INFINITY else soft}


def gather(path: str | os.PathLike) -> dict[str, Any]:
    """Everything the report shows, as plain JSON-able data."""
    where = path_info(path)
    return {"versions": versions(), "cuda": cuda(), "path": where,
            "io": io_engines(where["path"], direct=where["o_direct"]), "numa": numa(), "host": host()}


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "unknown" if flag is None else "no"


def render(report: dict[str, Any]) -> str:
    """The one-screen, human-readable form of ``gather()``'s result."""
    v, c, p, io, n, h = (report[k] for k in ("versions", "cuda", "path", "io", "numa", "host"))
    lines = [" · ".join(f"{name} {v[key] or 'missing'}" for name, key in
                        (("infinity", "infinity"), ("aio core", "aio_core"), ("Python", "python"),
                         ("torch", "torch"), ("numpy", "numpy"), ("Linux", "kernel"))), "", "Compute"]
    lines.append(f"  CUDA         {'yes, CUDA ' + str(c.get('cuda_version')) if c['available'] else 'no'}"
                 f"{'' if c['available'] else ' (' + c.get('pinned_detail', c.get('error', '')) + ')'}")
    for gpu in c["gpus"]:
        node = "" if gpu["numa_node"] is None else f", NUMA node {gpu['numa_node']}"
        lines.append(f"  GPU {gpu['index']:<8} {gpu['name']}, {human_size(gpu['memory_bytes'])}, "
                     f"compute {gpu['capability']}{node}")
    lines.append(f"  pinned mem   {_yes(c['pinned_memory'])} ({c.get('pinned_detail', '')})")
    lines += ["", f"I/O engines (a 4 KiB write and read in {p['path']}; listed by {io['listed_by']})"]
    for engine in ENGINES:
        lines.append(f"  {engine:<12} {'works' if io[engine]['works'] else 'no'}: {io[engine]['detail']}")
    lines.append(f"  {'GPUDirect':<12} {'works' if io['gpudirect']['works'] else 'no'}: {io['gpudirect']['detail']}")
    lines += ["", f"Path {p['path']}",
              f"  file system  {p['fstype'] or 'unknown'} on {p['device'] or 'unknown'}",
              f"  free         {human_size(p['free_bytes'])} of {human_size(p['total_bytes'])}",
              f"  O_DIRECT     {_yes(p['o_direct'])} ({p['o_direct_detail']})", "", "Host"]
    memlock = "unlimited" if h["memlock_limit_bytes"] is None else human_size(h["memlock_limit_bytes"])
    lines.append(f"  memory       {human_size(h['memory_total_bytes'])} total, "
                 f"{human_size(h['memory_available_bytes'])} available; {h['cpus']} CPUs; memlock limit {memlock}")
    nodes = ", ".join(f"node{x['node']} (cpus {x.get('cpus', '?')}, {human_size(x.get('memory_bytes', 0))})"
                      for x in n["nodes"]) or "none listed"
    lines.append(f"  NUMA         {len(n['nodes'])} node{'s' if len(n['nodes']) != 1 else ''}: {nodes}")
    lib = n["libnuma"]
    libnuma = (f"{lib['library']} loads, numa_available() = {lib.get('numa_available')}" if lib["loads"]
               else f"{lib['library']} found but does not load" if lib["library"] else "not found")
    lines.append(f"  libnuma      {libnuma}; py-libnuma {'installed' if lib['py_libnuma'] else 'not installed'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``infinity-report``: exit 0, 1 (gathering failed) or 2 (a --path that is not a directory);
    see [Note: command-line errors] in infinity/cli/common.py."""
    parser = Parser(prog="infinity-report", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--path", default=tempfile.gettempdir(),
                        help="directory to check for O_DIRECT, free space and I/O engines (default: %(default)s)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the report as JSON to PATH; alone, print only JSON to stdout")
    args = parser.parse_args(argv)
    return run("infinity-report", args.debug, lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    if not Path(args.path).is_dir():
        what = "does not exist" if not os.path.lexists(args.path) else "is not a directory"
        raise UsageError(f"--path {args.path} {what}")
    check_output(args.json, "--json")
    report = gather(args.path)
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    print(render(report))
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
