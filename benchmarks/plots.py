"""Figures of the stored benchmark runs, drawn as SVG from their JSON.

    python benchmarks/plots.py                              # docs/benchmarks/data/*.json -> docs/benchmarks/img/
    python benchmarks/plots.py --out /tmp/img gpu.json      # a run just written by benchmarks/gpu.py --json

An input file is either one run as a benchmark writes it with ``--json``, or a collection of such runs,
``{"source": ..., "runs": [run, ...]}`` (docs/benchmarks/data/ holds one collection per page). Every run
carries ``"provenance"``: the ``date``, the ``machine``, the ``commit`` (null where none was noted) and the
``command`` that measured it; a row may add to it or override it with a ``"provenance"`` of its own. A row
whose provenance lacks one of those is refused, naming the file, the run and the row: a figure without a
date, a machine and a command cannot be compared with anything.

What is drawn, from which runs:

- ``<input>-step-seconds.svg``, for an input holding runs of benchmarks/gpu.py or benchmarks/train.py
  (their ``"rows"``): seconds per step of every configuration, plain torch and DeepSpeed beside the
  presets; one panel per model size (and dtype, batch), in it one group of bars per run, since a
  comparison holds within one run on one machine, not across them. Bars are on a log scale; a range the
  record gives is a hatched bar from its low to its high end, the repeats of a median are dots on its bar,
  a run that failed is marked where its bar would stand.
- ``bytes-per-parameter.svg``, over all inputs: the bytes per parameter and step that each mode moves
  through each tier, stacked (NVMe read, NVMe written, and host->device, device->host where a run's
  transfer ledger was recorded), one panel per run: benchmarks/gpu.py rows (``nvme_per_parameter``,
  ``transfers``), benchmarks/qstates.py's ``"bytes"`` and benchmarks/in_backward.py's ``"modes"``.

The SVGs are deterministic (fixed hash salt, fonts and metadata, text kept as text), so
tests/unit/test_benchmark_plots.py can redraw them and compare with the committed files.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "docs" / "benchmarks" / "data"
IMG_DIR = ROOT / "docs" / "benchmarks" / "img"
PROVENANCE_KEYS = ("date", "machine", "commit", "command")
BYTES_FIGURE = "bytes-per-parameter.svg"
# Each configuration's legend label and colour, in the order the bars stand: the baselines first.
CONFIGS = {
    "torch": ("plain torch", "#7f7f7f"),
    "ds-zero2": ("DeepSpeed ZeRO-2 offload", "#f4a582"),
    "ds-zero3": ("DeepSpeed ZeRO-3 offload", "#d6604d"),
    "ds-infinity": ("DeepSpeed ZeRO-Infinity (NVMe)", "#b2182b"),
    "device": ("device", "#c7e9c0"),
    "offload-optimizer": ("offload-optimizer", "#92c5de"),
    "offload-host": ("offload-host", "#4393c3"),
    "nvme": ("nvme", "#2166ac"),
    "nvme-int8": ("nvme, int8 moments", "#5e3c99"),
    "nvme-int8-uib": ("nvme, int8 moments, update in backward", "#b2abd2"),
}
OTHER_COLOURS = ("#1b9e77", "#d95f02", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")
TIERS = {"nvme_read": ("NVMe read", "#2166ac"), "nvme_written": ("NVMe written", "#92c5de"),
         "host_to_device": ("host->device", "#b2182b"), "device_to_host": ("device->host", "#f4a582")}
# Deterministic SVG: matplotlib names clip paths and glyphs by hashes salted at random and stamps
# the date and its version into the file; a fixed salt, no date, a fixed creator and text written as text
# (not as glyph outlines of whatever font is installed) make the same data give the same bytes.
RC = {"svg.hashsalt": "infinity-benchmarks", "svg.fonttype": "none", "font.family": "DejaVu Sans",
      "font.size": 8, "axes.titlesize": 8, "legend.fontsize": 7}
METADATA = {"Date": None, "Creator": "benchmarks/plots.py"}


class ProvenanceError(ValueError):
    """A stored row without the date, machine, commit and command that measured it."""


class Run:
    """One run of a benchmark, as its ``--json`` wrote it, and where it was read from (compared by identity:
    a group of bars is one run)."""

    def __init__(self, file: str, index: int, record: dict, provenance: dict):
        self.file, self.index, self.record, self.provenance = file, index, record, provenance

    def label(self) -> str:
        """Date, commit and machine, wrapped to sit under a group of bars or above a panel."""
        p = self.provenance
        head = f"{p['date'][:10]} {p['commit'] or ''}".strip()
        return head + "\n" + textwrap.shorten(p["machine"].split(",")[0], 40, placeholder="...")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _rows_of(record: dict) -> list[tuple[str, dict]]:
    """(name, row) of each row a run holds, whichever benchmark wrote it."""
    rows = [(f"{r.get('size', '')} {r.get('config', '')}".strip(), r) for r in record.get("rows", [])]
    rows += [(f"state_dtype {r.get('state_dtype')}", r) for r in record.get("bytes", [])]
    rows += [(f"mode {name}", r) for name, r in record.get("modes", {}).items()]
    return rows


def _checked_provenance(file: str, index: int, record: dict) -> dict:
    """The provenance a run's figures are labelled with (its first row's), after checking that each of its rows
    has all of it (a row's own keys win over the run's)."""
    base = record.get("provenance") or {}
    rows = _rows_of(record)
    if not rows:
        raise ProvenanceError(f"{file}: run {index} holds no rows, bytes or modes to draw")
    for number, (name, row) in enumerate(rows):
        merged = {**base, **(row.get("provenance") or {})}
        missing = [k for k in PROVENANCE_KEYS if k not in merged or (k != "commit" and not merged[k])]
        if missing:
            raise ProvenanceError(
                f"{file}: run {index}, row {number} ({name}): provenance lacks {', '.join(missing)}; every stored "
                f"row needs {', '.join(PROVENANCE_KEYS)} (commit null where none was noted), in the run's or the "
                f"row's \"provenance\"")
    return {**base, **(rows[0][1].get("provenance") or {})}


def load(paths: list[Path]) -> list[Run]:
    """Every run of the given files, each checked for provenance (``ProvenanceError`` names the row)."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        records = doc["runs"] if "runs" in doc else [doc]
        for index, record in enumerate(records):
            runs.append(Run(_shown(path), index, record, _checked_provenance(_shown(path), index, record)))
    return runs


def _bytes_text(value: float) -> str:
    """Bytes per parameter as the tables write them (14.00, 10.351): two decimals, three where the record
    has them."""
    for digits in (2, 3):
        text = f"{value:.{digits}f}"
        if float(text) == value:
            return text
    return f"{value:.2f}"


def _config_order(names: set[str]) -> list[str]:
    known = [c for c in CONFIGS if c in names]
    return known + sorted(names - set(CONFIGS))


def _colour(config: str, order: list[str]) -> str:
    if config in CONFIGS:
        return CONFIGS[config][1]
    others = [c for c in order if c not in CONFIGS]
    return OTHER_COLOURS[others.index(config) % len(OTHER_COLOURS)]


def _panel_key(run: Run, row: dict) -> str:
    s = run.record.get("settings", {})
    parts = [f"GPT {row['size']}", s.get("dtype"), f"batch {s['batch']} x {s['seq']}" if "batch" in s else None]
    return ", ".join(p for p in parts if p)


def _bar(ax, x: float, width: float, row: dict, colour: str, floor: list) -> None:
    """One configuration's bar in a group: its median, the range a record gives, or a failure mark."""
    if row.get("step_seconds") is not None:
        value = row["step_seconds"]
        ax.bar(x, value, width, color=colour, edgecolor="black", linewidth=0.3)
        repeats = row.get("step_seconds_per_repeat") or []
        if len(repeats) > 1:
            ax.plot([x] * len(repeats), repeats, "o", color="black", markersize=1.8)
        ax.text(x, max([value, *repeats]) * 1.06, f"{value:g}", ha="center", va="bottom", rotation=90, fontsize=5.5)
    elif row.get("step_seconds_range"):
        low, high = row["step_seconds_range"]
        ax.bar(x, low, width, color=colour, edgecolor="black", linewidth=0.3, hatch="////")
        ax.plot([x, x], [low, high], color="black", linewidth=0.8)
        ax.text(x, high * 1.06, f"{low:g}-{high:g}", ha="center", va="bottom", rotation=90, fontsize=5.5)
    else:
        floor.append(x)


def _heights(row: dict) -> list[float]:
    values = [row.get("step_seconds"), *(row.get("step_seconds_per_repeat") or []),
              *(row.get("step_seconds_range") or [])]
    return [v for v in values if v is not None]


def _scale(ax, values: list[float]) -> None:
    """Linear from zero; logarithmic where a panel spans more than a decade (a 0.07 s step beside a 12 s one),
    its floor a third of the smallest bar so that every bar shows."""
    from matplotlib.ticker import FuncFormatter

    if not values:
        return
    low, high = min(values), max(values)
    if high / low > 10:
        ax.set_yscale("log")
        ax.set_ylim(low / 3, high * 3)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.set_ylim(0, high * 1.3)


def draw_step_seconds(runs: list[Run], path: Path) -> bool:
    """s/step per configuration, one panel per model size, one group per run; False when no run has rows."""
    panels: dict[str, list[tuple[Run, dict]]] = {}
    for run in runs:
        for row in run.record.get("rows", []):
            if "config" in row and "size" in row:
                panels.setdefault(_panel_key(run, row), []).append((run, row))
    if not panels:
        return False
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    order = _config_order({row["config"] for rows in panels.values() for _, row in rows})
    fig = Figure(figsize=(10, 3.1 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels.items()):
        groups = list(dict.fromkeys(run for run, _ in rows))
        configs = [c for c in order if any(row["config"] == c for _, row in rows)]
        width = 0.8 / len(configs)
        failed: list[tuple[float, str]] = []
        for g, run in enumerate(groups):
            for run_, row in rows:
                if run_ is run:
                    x = g - 0.4 + width * (configs.index(row["config"]) + 0.5)
                    floor: list[float] = []
                    _bar(ax, x, width, row, _colour(row["config"], order), floor)
                    failed += [(fx, row["config"]) for fx in floor]
        _scale(ax, [v for _, row in rows for v in _heights(row)])
        floor_y = ax.get_ylim()[0] * 1.1 if ax.get_yscale() == "log" else 0
        for x, config in failed:
            ax.text(x, floor_y, "failed", ha="center", va="bottom", rotation=90, fontsize=5.5,
                    color=_colour(config, order))
        ax.set_xticks(range(len(groups)), [run.label() for run in groups], fontsize=6)
        ax.set_xlim(-0.5, len(groups) - 0.5)
        ax.set_ylabel("s/step" + (" (log scale)" if ax.get_yscale() == "log" else ""))
        ax.set_title(title)
        ax.grid(axis="y", which="major", linewidth=0.3)
    handles = [Rectangle((0, 0), 1, 1, color=_colour(c, order)) for c in order]
    fig.legend(handles, [CONFIGS.get(c, (c,))[0] for c in order], loc="upper center", ncol=min(6, len(order)),
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.1 * len(panels))))
    fig.savefig(path, format="svg", metadata=METADATA)
    return True


def _gpu_traffic(row: dict) -> dict[str, float]:
    out = {}
    if row.get("nvme_per_parameter"):
        out.update(nvme_read=row["nvme_per_parameter"]["read"], nvme_written=row["nvme_per_parameter"]["written"])
    ledger, n_params = row.get("transfers"), row.get("n_params")
    if ledger and n_params:
        out.update(host_to_device=ledger["host_to_device"]["bytes"] / n_params,
                   device_to_host=ledger["device_to_host"]["bytes"] / n_params)
    return out


def traffic(run: Run) -> tuple[str, list[tuple[str, dict[str, float]]]]:
    """A panel title and (mode, bytes per parameter and step per tier) for each row of a run that has them."""
    record, settings = run.record, run.record.get("settings", {})
    bars = []
    for row in record.get("rows", []):
        if not row.get("error") and _gpu_traffic(row):
            bars.append((CONFIGS.get(row["config"], (row["config"],))[0], _gpu_traffic(row)))
    if bars:
        size = record["rows"][0].get("size", "")
        return f"benchmarks/gpu.py, GPT {size}, {settings.get('dtype', '')}", bars
    for row in record.get("bytes", []):
        bars.append((f"{row['state_dtype']} moments",
                     {"nvme_read": row["read_per_param_step"], "nvme_written": row["written_per_param_step"]}))
    if bars:
        return "benchmarks/qstates.py: Adam states on NVMe by state_dtype, bf16", bars
    names = {"ordinary": "ordinary step", "in_backward": "update during backward"}
    for mode, figures in record.get("modes", {}).items():
        per = figures["per_parameter"]
        bars.append((names.get(mode, mode), {"nvme_read": per["nvme_read"], "nvme_written": per["nvme_written"]}))
    title = f"benchmarks/in_backward.py, GPT {settings.get('model', '')}, {settings.get('state_dtype', '')} moments"
    return title, bars


def draw_bytes_per_parameter(runs: list[Run], path: Path) -> bool:
    """Bytes per parameter and step per tier, one panel per run; False when no run recorded any."""
    panels = [(run, *traffic(run)) for run in runs]
    panels = [p for p in panels if p[2]]
    if not panels:
        return False
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    heights = [len(bars) + 1.8 for _, _, bars in panels]
    fig = Figure(figsize=(8, 0.27 * sum(heights) + 0.8))
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True, gridspec_kw={"height_ratios": heights})
    for ax, (run, title, bars) in zip(axes[:, 0], panels):
        for y, (_, tiers) in enumerate(bars):
            left = 0.0
            for tier, (_, colour) in TIERS.items():
                if tier in tiers:
                    ax.barh(y, tiers[tier], left=left, color=colour, edgecolor="black", linewidth=0.3, height=0.7)
                    left += tiers[tier]
            parts = " + ".join(_bytes_text(tiers[t]) for t in TIERS if t in tiers)
            ax.text(left + 0.3, y, parts, va="center", fontsize=6)
        ax.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=6.5)
        ax.set_ylim(len(bars) - 0.4, -0.6)
        ax.set_title(f"{title}\n{run.label().replace(chr(10), ', ')} ({Path(run.file).name}, run {run.index})",
                     loc="left", fontsize=6.5)
        ax.grid(axis="x", linewidth=0.3)
    widest = max(sum(tiers.values()) for _, _, bars in panels for _, tiers in bars)
    axes[-1, 0].set_xlim(0, widest * 1.25)
    axes[-1, 0].set_xlabel("bytes per parameter and step (read + written [+ host->device + device->host])")
    shown = [t for t in TIERS if any(t in tiers for _, _, bars in panels for _, tiers in bars)]
    handles = [Rectangle((0, 0), 1, 1, color=TIERS[t][1]) for t in shown]
    fig.legend(handles, [TIERS[t][0] for t in shown], loc="upper center", ncol=len(shown), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (0.27 * sum(heights) + 0.8)))
    fig.savefig(path, format="svg", metadata=METADATA)
    return True


def draw(paths: list[Path], out: Path) -> list[Path]:
    """Every figure the runs in ``paths`` give, written into ``out``; the paths written."""
    import matplotlib

    runs = load(paths)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context(RC):
        for path in paths:
            target = out / f"{path.stem}-step-seconds.svg"
            if draw_step_seconds([r for r in runs if r.file == _shown(path)], target):
                written.append(target)
        if draw_bytes_per_parameter(runs, out / BYTES_FIGURE):
            written.append(out / BYTES_FIGURE)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", type=Path, help=f"JSON runs or collections (default: {_shown(DATA_DIR)}/*.json)")
    p.add_argument("--out", type=Path, default=IMG_DIR, help=f"where the SVGs go (default: {_shown(IMG_DIR)})")
    args = p.parse_args(argv)
    paths = args.files or sorted(DATA_DIR.glob("*.json"))
    try:
        written = draw(paths, args.out)
    except ProvenanceError as exc:
        print(exc, file=sys.stderr)
        return 2
    for path in written:
        print(_shown(path.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
