"""A trace file drawn as an SVG timeline: ``python -m infinity.timeline.draw step.json step.svg``.

What the room holds: ``draw``, which reads a Chrome trace written by ``infinity.trace`` and draws one
row per thread (track lane) with matplotlib, the plan's phases on a row of their own. What it may touch:
the two files. The SVG is the same bytes for the same trace: a fixed ``svg.hashsalt`` and no date.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infinity.timeline.record import KINDS, PLAN

COLORS = {"compute": "#4c72b0", "copies": "#8172b3", "nvme read": "#55a868", "nvme write": "#c44e52",
          "update": "#dd8452", "host waits": "#937860", PLAN: "#999999"}
# Bars narrower than this share of the step get no label.
_LABEL_SHARE = 0.06


def _rows(events: list[dict]) -> dict[tuple[int, int], tuple[int, int, int, str]]:
    """(pid, tid) -> (row, lane, lanes in the row, row name): the lanes of one track share its row."""
    names, order = {}, {}
    for e in events:
        if e.get("ph") == "M" and "tid" in e:
            if e["name"] == "thread_name":
                names[e["pid"], e["tid"]] = e["args"]["name"]
            elif e["name"] == "thread_sort_index":
                order[e["pid"], e["tid"]] = e["args"]["sort_index"]
    tracks: dict[tuple[int, str], list] = {}
    for key in sorted(names, key=lambda k: (k[0], order.get(k, k[1]))):
        track = names[key].rstrip("0123456789").rstrip() if names[key][-1:].isdigit() else names[key]
        tracks.setdefault((key[0], track), []).append(key)
    out = {}
    for row, ((_, track), keys) in enumerate(tracks.items()):
        for lane, key in enumerate(keys):
            out[key] = (row, lane, len(keys), track)
    return out


def _depths(events: list[dict]) -> tuple[dict[int, int], set[int]]:
    """id(event) -> how deep it nests among the complete events of its thread; and the ids of those with
    another nested in them."""
    out, parents, by_thread = {}, set(), {}
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
        open_spans = by_thread.setdefault((e["pid"], e["tid"]), [])
        while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"]:
            open_spans.pop()
        out[id(e)] = len(open_spans)
        if open_spans:
            parents.add(id(open_spans[-1]))
        open_spans.append(e)
    return out, parents


def draw(trace_path: str | Path, svg_path: str | Path, title: str | None = None) -> Path:
    """Draw the trace at ``trace_path`` as an SVG timeline at ``svg_path``; returns ``svg_path``.

    One row per track, its lanes ([Note: tracks and lanes] in infinity/timeline/record.py) side by side
    in it, a nested span drawn thinner over the one it is in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    rows = _rows(events)
    timed = [e for e in events if e.get("ph") in ("X", "i") and (e["pid"], e["tid"]) in rows]
    if not timed:
        raise ValueError(f"{trace_path}: no events to draw")
    depth, parents = _depths(timed)
    names = sorted({(r[0], r[3]) for r in rows.values()})
    t0 = min(e["ts"] for e in timed)
    span_ms = max((e["ts"] + e.get("dur", 0) - t0) / 1000 for e in timed) or 1.0
    with plt.rc_context({"svg.hashsalt": "infinity-step-trace", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(12, 0.5 * len(names) + 1.6))
        for e in timed:
            row, lane, lanes, _ = rows[e["pid"], e["tid"]]
            height = 0.8 / lanes
            bottom = row - 0.4 + lane * height
            start = (e["ts"] - t0) / 1000
            color = COLORS.get(e.get("cat"), "#333333")
            if e["ph"] == "i":
                ax.plot([start], [row], marker="v", color=color, markersize=7)
                continue
            width = e["dur"] / 1000
            thin = height * 0.7 ** depth[id(e)]
            ax.broken_barh([(start, max(width, span_ms / 2000))], (bottom + (height - thin) / 2, thin),
                           facecolors=color, edgecolors="white", linewidth=0.3)
            if width >= _LABEL_SHARE * span_ms and lanes == 1 and id(e) not in parents:
                ax.text(start + width / 2, row, e["name"], ha="center", va="center", fontsize=6, color="white",
                        clip_on=True)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([name for _, name in names], fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(0, span_ms * 1.01)
        ax.set_xlabel("ms since the first event")
        ax.grid(axis="x", linewidth=0.3)
        handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in (*KINDS, PLAN)]
        fig.legend(handles, [*KINDS, "plan (predicted)"], fontsize=7, ncol=7, loc="lower center", frameon=False)
        ax.set_title(title or Path(trace_path).name, fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.savefig(svg_path, format="svg", metadata={"Date": None})
        plt.close(fig)
    return Path(svg_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infinity.timeline.draw",
                                     description="Draw a trace written by infinity.trace as an SVG timeline.")
    parser.add_argument("trace", help="the trace JSON file")
    parser.add_argument("svg", help="the SVG file to write")
    parser.add_argument("--title", default=None, help="the figure's title (default: the trace's file name)")
    args = parser.parse_args(argv)
    draw(args.trace, args.svg, args.title)
    print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
