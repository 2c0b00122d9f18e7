"""infinity-bench: measure this machine for the offload engine.

``infinity-bench nvme --path DIR`` writes then reads a file of ``--size`` bytes in ``DIR`` with
O_DIRECT, sweeping block size, queue depth, threads and engine (io_uring, threads); prints a table
of decimal GB/s with the best settings marked; and can write those settings into a config file.
Buffered Python file I/O and aiofiles run in the same session as baselines, and with
``--compare-fio`` fio runs the same settings on the same file, alternating with ours.

[Note: interleaving]
The disks these machines use swing 30-50% from minute to minute, so a figure that compares two
things is only meaningful when both were measured in the same window. Each repeat walks every
setting (in reverse order on odd repeats) and, for each, runs ours and fio back to back (fio first
on odd repeats); the table reports the median over repeats and the ratio of the medians.

Examples
--------
    infinity-bench nvme --path /mnt/nvme
    infinity-bench nvme --path /mnt/nvme --size 8GiB --compare-fio --json nvme.json --plot nvme.png
    infinity-bench nvme --path /mnt/nvme --write-config offload.toml
"""
from __future__ import annotations

import argparse
import datetime
import errno
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

from infinity.cli.common import Parser, run, write_text_atomic
from infinity.config.sizes import format_size, parse_size
from tiers import newfile

from . import bench_nvme as nv

DEFAULT_SIZE = "2GiB"
BASELINE_CHUNK = 8 << 20


def _sizes(text: str) -> list[int]:
    try:
        values = [parse_size(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated sizes, e.g. 1MiB,8MiB")
    return values


def _check_output(path: str | None, option: str) -> None:
    """Refuse an output file that cannot be written before the sweep runs (minutes), not after it."""
    if not path:
        return
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise BenchError(f"{option} {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise BenchError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise BenchError(f"{option} {path}: not writable")


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="infinity-bench", description=__doc__.split("\n\n")[0], debug=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser("nvme", help="sweep the aio settings on a directory's disk",
                       description="Write then read a file in --path with O_DIRECT over a sweep of aio settings.")
    p.add_argument("--path", required=True, help="directory on the disk to measure (a temporary file is made there)")
    p.add_argument("--size", type=_size, default=parse_size(DEFAULT_SIZE),
                   help=f"bytes per pass, e.g. 64MiB, 8GiB (default {DEFAULT_SIZE}); more than the disk's cache")
    p.add_argument("--block-sizes", type=_sizes, default=_sizes("128KiB,1MiB,8MiB"), help="default 128KiB,1MiB,8MiB")
    p.add_argument("--queue-depths", type=_ints, default=[8, 32], help="io_uring depths, default 8,32")
    p.add_argument("--threads", type=_ints, default=[1, 4], help="thread-pool sizes, default 1,4")
    p.add_argument("--engines", default=",".join(nv.aio.available_engines()),
                   help="comma-separated, default: every engine this kernel allows")
    p.add_argument("--ops", default="write,read", help="write,read (default), or one of them")
    p.add_argument("--repeats", type=int, default=3, help="passes per setting; the table shows medians (default 3)")
    p.add_argument("--buffered", action="store_true", help="measure without O_DIRECT (filesystems that refuse it)")
    p.add_argument("--no-baselines", action="store_true", help="skip the buffered-Python and aiofiles baselines")
    p.add_argument("--compare-fio", action="store_true", help="also run fio with each setting, alternating with ours")
    p.add_argument("--json", metavar="FILE", help="write the settings, the machine and every raw sample")
    p.add_argument("--write-config", metavar="FILE", help="write the best settings as the [aio] section of FILE")
    p.add_argument("--plot", metavar="FILE.png", help="draw the sweep (needs matplotlib)")
    p.add_argument("--keep-file", action="store_true", help="keep the test file instead of deleting it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked: the message says why and what to change."""


# ----------------------------------------------------------------------------------------------- plan
def settings_from(args: argparse.Namespace) -> list[nv.Setting]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    allowed = nv.aio.available_engines()
    for e in engines:
        if e not in nv.aio.ENGINES:
            raise BenchError(f"--engines: unknown engine {e!r}; choose from {', '.join(nv.aio.ENGINES)}")
        if e not in allowed:
            raise BenchError(f"--engines: {e} is refused on this machine (allowed: {', '.join(allowed)})")
    for bs in args.block_sizes:
        if bs <= 0 or bs % nv.aio.ALIGNMENT or bs > 1 << 30:
            raise BenchError(f"--block-sizes: {bs} must be a positive multiple of 4096 up to 1 GiB")
    direct = not args.buffered
    out = []
    for engine in engines:
        for bs in args.block_sizes:
            if engine == "io_uring":
                out += [nv.Setting(engine, bs, qd, max(args.threads), direct) for qd in args.queue_depths]
            else:
                out += [nv.Setting(engine, bs, t, t, direct) for t in args.threads]
    if not out:
        raise BenchError("nothing to measure: --engines is empty")
    return out


def check_path(path: str, size: int) -> Path:
    d = Path(path)
    if not d.is_dir():
        raise BenchError(f"--path {path}: not a directory (create it first, on the disk to measure)")
    if not os.access(d, os.W_OK):
        raise BenchError(f"--path {path}: not writable by this user")
    free = shutil.disk_usage(d).free
    if free < size + (64 << 20):
        raise BenchError(f"--path {path}: {free / 1e9:.2f} GB free, the test file needs {size / 1e9:.2f} GB (+64 MiB); "
                         "lower --size")
    return d


# ----------------------------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar over bytes moved, or a plain one-line counter when tqdm is missing or disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self._bar, self._last = total, 0, enabled, None, -1
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="nvme", file=sys.stderr)
            except ImportError:
                self._bar = None

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=False)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        elif self.enabled:
            pct = int(100 * self.done / max(self.total, 1))
            if pct != self._last:
                self._last = pct
                print(f"\rnvme: {pct:3d}% of {self.total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


# ----------------------------------------------------------------------------------------------- run
def run_sweep(args: argparse.Namespace, settings: Sequence[nv.Setting], file: str,
              progress: Progress) -> list[nv.Sample]:
    """All samples, interleaved as [Note: interleaving] describes."""
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    buf = nv.make_buffer(max(nv.buffer_size(s, args.size) for s in settings))
    samples: list[nv.Sample] = []
    for r in range(args.repeats):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for setting in order:
            for op in ops:
                runs: list[tuple[str, Callable[[], nv.Sample]]] = [
                    ("ours", lambda s=setting, o=op: nv.measure_ours(file, args.size, o, s, buf, r, progress))]
                if args.compare_fio:
                    runs.append(("fio", lambda s=setting, o=op: nv.measure_fio(file, args.size, o, s, r, progress)))
                    if r % 2:
                        runs.reverse()
                for tool, run in runs:
                    progress.describe(f"{tool} {op} {setting.label()} #{r + 1}")
                    samples.append(run())
        if not args.no_baselines:
            chunk = min(BASELINE_CHUNK, args.size)
            for op in ops:
                progress.describe(f"python {op} #{r + 1}")
                samples.append(nv.measure_python(file, args.size, op, chunk, r, progress))
                progress.describe(f"aiofiles {op} #{r + 1}")
                samples.append(nv.measure_aiofiles(file, args.size, op, chunk, r, progress))
    return samples


def summarize(samples: Iterable[nv.Sample]) -> list[dict[str, object]]:
    """One row per (tool, setting, op): median GB/s and CPU s/GB over repeats."""
    groups: dict[tuple, list[nv.Sample]] = {}
    for s in samples:
        groups.setdefault((s.tool, s.setting, s.op), []).append(s)
    return [
        {"tool": tool, "setting": setting, "op": op, "n": len(group),
         "gb_per_s": statistics.median(x.gb_per_s for x in group),
         "cpu_s_per_gb": statistics.median(x.cpu_s_per_gb for x in group),
         "samples_gb_per_s": [round(x.gb_per_s, 4) for x in group]}
        for (tool, setting, op), group in groups.items()
    ]


def _median(summary: list[dict], tool: str, setting: nv.Setting | None, op: str) -> dict | None:
    return next((row for row in summary if row["tool"] == tool and row["setting"] == setting and row["op"] == op), None)


def best_setting(summary: list[dict], settings: Sequence[nv.Setting], ops: Sequence[str]) -> nv.Setting:
    """The setting with the highest geometric mean of its median read and write bandwidth."""
    def score(s: nv.Setting) -> float:
        rates = [row["gb_per_s"] for op in ops if (row := _median(summary, "ours", s, op))]
        return math.exp(sum(math.log(max(x, 1e-9)) for x in rates) / len(rates)) if rates else 0.0
    return max(settings, key=score)


# ----------------------------------------------------------------------------------------------- output
def render_table(summary: list[dict], settings: Sequence[nv.Setting], ops: Sequence[str], best: nv.Setting,
                 repeats: int, fio: bool, color: bool) -> str:
    head = ["setting"] + [f"{op} GB/s" for op in ops] + [f"CPU s/GB {op}" for op in ops]
    if fio:
        head += [f"fio {op}" for op in ops] + [f"ours/fio {op}" for op in ops] + [f"fio CPU s/GB {op}" for op in ops]
    rows: list[list[str]] = []
    marks: list[bool] = []
    for s in settings:
        ours = [_median(summary, "ours", s, op) for op in ops]
        row = [s.label()] + [f"{r['gb_per_s']:.2f}" if r else "-" for r in ours]
        row += [f"{r['cpu_s_per_gb']:.3f}" if r else "-" for r in ours]
        if fio:
            theirs = [_median(summary, "fio", s, op) for op in ops]
            row += [f"{t['gb_per_s']:.2f}" if t else "-" for t in theirs]
            row += [f"{o['gb_per_s'] / t['gb_per_s']:.2f}x" if o and t and t["gb_per_s"] else "-"
                    for o, t in zip(ours, theirs)]
            row += [f"{t['cpu_s_per_gb']:.3f}" if t else "-" for t in theirs]
        rows.append(row)
        marks.append(s == best)
    for tool, name in (("python", "python buffered 8MiB"), ("aiofiles", "aiofiles 8MiB")):
        found = [_median(summary, tool, None, op) for op in ops]
        if any(found):
            row = [name] + [f"{r['gb_per_s']:.2f}" if r else "-" for r in found]
            row += [f"{r['cpu_s_per_gb']:.3f}" if r else "-" for r in found]
            rows.append(row + ["-"] * (len(head) - len(row)))
            marks.append(False)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [f"Bandwidth in GB/s (decimal: 1 GB = 10^9 bytes), median of {repeats} repeat(s); "
             "CPU s/GB = user+system CPU seconds per GB moved; * = best (geometric mean of read and write)",
             "  " + fmt(head), "  " + "  ".join("-" * w for w in widths)]
    for row, mark in zip(rows, marks):
        line = ("* " if mark else "  ") + fmt(row)
        lines.append(f"\033[1m{line}\033[0m" if mark and color else line)
    return "\n".join(lines)


def machine_info(path: str) -> dict[str, object]:
    """What the JSON needs to make the numbers comparable: host, kernel, CPU, memory, filesystem, versions."""
    info: dict[str, object] = {
        "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "aio_version": nv.aio.version(), "engines": nv.aio.available_engines(),
        "fio": nv.fio_version(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        info["cpu_model"] = None
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        info["memory_bytes"] = None
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            mounts = [ln.split()[:3] for ln in f]
        dev, mnt, fstype = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                               key=lambda m: len(m[1]))
        info["filesystem"] = {"device": dev, "mount": mnt, "type": fstype}
    except (OSError, ValueError):
        info["filesystem"] = None
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def write_config(path: str, best: nv.Setting) -> Path:
    """Put ``best`` into the ``[aio]`` section of ``path`` (TOML or JSON), keeping everything else.

    A TOML file is edited as text so its comments and other sections survive; the result is checked
    with ``infinity.config.load_config`` before it replaces the original.
    """
    out = Path(path)
    tmp = _edited(out, best)
    os.replace(tmp, out)
    return out


def _edited(out: Path, best: nv.Setting) -> Path:
    """``out`` with ``best`` as its ``[aio]`` section, written beside it and checked to load; the caller
    moves it over ``out`` or deletes it. Whatever the old ``[aio]`` held goes: only the rest must load."""
    section = best.aio_section()
    try:
        old = out.read_text() if out.exists() else ""
    except UnicodeDecodeError as e:
        raise BenchError(f"--write-config {out}: the existing file is not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    if out.suffix == ".json":
        try:
            data = json.loads(old) if old else {}
        except json.JSONDecodeError as e:
            raise BenchError(f"--write-config {out}: the existing file is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise BenchError(f"--write-config {out}: the existing file holds a JSON {type(data).__name__}, "
                             "not an object of config sections")
        data["aio"] = {**section, "block_size": format_size(best.block_size)}
        text = json.dumps(data, indent=2) + "\n"
    elif out.suffix == ".toml":
        body = "\n".join([
            "[aio]",
            "# written by infinity-bench nvme",
            f'block_size = "{format_size(best.block_size)}"',
            f"queue_depth = {best.queue_depth}",
            f"threads = {best.threads}",
            f'engine = "{best.engine}"',
            f"direct = {'true' if best.direct else 'false'}",
        ]) + "\n"
        pattern = re.compile(r"^\[aio\][^\n]*\n(?:(?!\[)[^\n]*\n?)*", re.MULTILINE)
        if pattern.search(old):
            text = pattern.sub(lambda _: body + "\n", old, count=1)
        else:
            text = old + ("\n" if old and not old.endswith("\n\n") else "") + body
    else:
        raise BenchError(f"--write-config {out}: expected a .toml or .json file name")
    # A random name written through its descriptor: [Note: temporary names on a shared disk].
    fd, name = newfile.create(str(out.parent), prefix=f".{out.stem}.tmp-", suffix=out.suffix)
    tmp = Path(name)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
    try:
        from infinity.config import load_config
    except ImportError:  # the config module is optional for the benchmark itself
        load_config = None
    try:
        if load_config is not None:
            load_config(tmp)
    except Exception as e:
        tmp.unlink()
        said = str(e).replace(str(tmp), str(out))      # the temporary copy is gone: the file the user named
        raise BenchError(f"--write-config {out}: the updated file would not load: {said}") from e
    return tmp


def plot(path: str, summary: list[dict], settings: Sequence[nv.Setting], ops: Sequence[str], best: nv.Setting) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ops), figsize=(max(6, 0.6 * len(settings) + 3) * len(ops), 4.5), squeeze=False)
    labels = [s.label() for s in settings]
    for ax, op in zip(axes[0], ops):
        ours = [(_median(summary, "ours", s, op) or {}).get("gb_per_s", 0.0) for s in settings]
        bars = ax.bar(range(len(settings)), ours, color=["tab:orange" if s == best else "tab:blue" for s in settings],
                      label="ours")
        fio = [(_median(summary, "fio", s, op) or {}).get("gb_per_s") for s in settings]
        if any(v is not None for v in fio):
            ax.scatter([i for i, v in enumerate(fio) if v is not None], [v for v in fio if v is not None],
                       color="black", marker="_", s=400, label="fio", zorder=3)
        for tool, style in (("python", "--"), ("aiofiles", ":")):
            row = _median(summary, tool, None, op)
            if row:
                ax.axhline(row["gb_per_s"], linestyle=style, color="gray", label=f"{tool} baseline")
        ax.set_xticks(range(len(settings)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (10^9 bytes/s)")
        ax.set_title(f"{op} (median)")
        ax.legend(fontsize=8)
        del bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main
def nvme(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise BenchError(f"--repeats {args.repeats}: must be at least 1")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in ("read", "write") for o in ops):
        raise BenchError(f"--ops {args.ops!r}: expected write, read or write,read")
    if args.write_config and Path(args.write_config).suffix not in (".toml", ".json"):
        raise BenchError(f"--write-config {args.write_config}: expected a .toml or .json file name")
    for option, path in (("--json", args.json), ("--write-config", args.write_config), ("--plot", args.plot)):
        _check_output(path, option)
    settings = settings_from(args)
    if args.write_config and Path(args.write_config).exists():
        # The file it will edit, with one of the settings as [aio], must load (its old [aio] goes).
        try:
            _edited(Path(args.write_config), settings[0]).unlink()
        except BenchError as exc:
            raise BenchError(f"{exc} (checked before measuring: nothing was written)") from None
    largest = max(s.block_size for s in settings)
    size = args.size // largest * largest
    if size <= 0:
        raise BenchError(f"--size {args.size}: must be at least the largest block size ({largest})")
    args.size = size
    if args.compare_fio and nv.fio_version() is None:
        raise BenchError("--compare-fio: fio is not installed (e.g. apt-get install fio)")
    directory = check_path(args.path, size)
    fd, file = tempfile.mkstemp(prefix="infinity-bench-", suffix=".bin", dir=directory)
    os.close(fd)
    per_pass = len(settings) * len(ops) * (2 if args.compare_fio else 1) + (0 if args.no_baselines else 2 * len(ops))
    progress = Progress(size * (1 + args.repeats * per_pass), enabled=not args.no_progress)
    try:
        progress.describe("laying out the file")
        nv.lay_out(file, size, not args.buffered, progress)
        samples = run_sweep(args, settings, file, progress)
    except OSError as e:
        if e.errno == errno.EINVAL and not args.buffered and "O_DIRECT" in str(e):
            raise BenchError(f"--path {args.path}: its filesystem refuses O_DIRECT; measure it with --buffered (and "
                             "give the engine [aio] direct = false there)") from e
        raise
    finally:
        progress.close()
        if args.keep_file:
            print(f"kept {file}", file=sys.stderr)
        else:
            os.unlink(file)
    summary = summarize(samples)
    best = best_setting(summary, settings, ops)
    print(f"infinity-bench nvme: {size / 1e9:.3f} GB file in {args.path}, {'O_DIRECT' if not args.buffered else 'buffered'}")
    print(render_table(summary, settings, ops, best, args.repeats, args.compare_fio, sys.stdout.isatty()))
    print(f"best: {best.label()} -> [aio] " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in best.aio_section().items()))
    if args.json:
        record = {
            "benchmark": "nvme", "args": {k: v for k, v in vars(args).items() if k != "func"},
            "machine": machine_info(args.path), "best": best.aio_section(),
            "samples": [s.to_dict() for s in samples],
            "summary": [{**row, "setting": row["setting"] and dataclasses_asdict(row["setting"])} for row in summary],
            "fio_commands": {s.label(): {op: " ".join(nv.fio_command(file, size, op, s)) for op in ops} for s in settings}
            if args.compare_fio else None,
        }
        write_text_atomic(args.json, json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.write_config:
        print(f"wrote [aio] to {write_config(args.write_config, best)}")
    if args.plot:
        plot(args.plot, summary, settings, ops, best)
        print(f"wrote {args.plot}")
    return 0


def dataclasses_asdict(setting: nv.Setting) -> dict[str, object]:
    return {**setting.aio_section(), "label": setting.label()}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``infinity-bench``: exit 0, 1 (the measurement failed) or 2 (asked wrongly); see
    [Note: command-line errors] in infinity/cli/common.py."""
    args = build_parser().parse_args(argv)
    return run(f"infinity-bench {args.command}", args.debug, lambda: nvme(args), usage=(BenchError,))


if __name__ == "__main__":
    sys.exit(main())
