"""The spans of one traced step, and their Chrome trace file.

What the room holds: ``Timeline``, which the probes (``infinity.timeline.probes``) tell what started and
ended when, and which lays those spans out as Chrome's trace event format (``traceEvents``: ``"X"``
complete events, ``"M"`` events naming each process and thread) and writes the file atomically. What it
may touch: the clock and the file it is asked to write; it knows nothing of the engine.

[Note: tracks and lanes]
Each kind of work has its own track (a "thread" of the trace's process): ``compute`` (a parameter
group's forward and backward), ``copies`` (gathers, releases, host<->device copies), ``nvme read`` and
``nvme write`` (each request from its submission to its completion), ``update`` (each optimizer
sub-group's Adam step) and ``host waits`` (every place the host blocks: a tier read or write, a device
event, a read back of a device value, an overlapped update). A viewer draws the ``"X"`` events of one
thread as a stack, so they must nest; NVMe requests overlap without nesting (many are in flight), and a
group's backward may outlast its parent's. So a track is cut into lanes at write time: a span goes to
the first lane whose open spans all end before it starts or enclose it, and each lane is a thread of
its own ("nvme read", "nvme read 2", ...), sorted under its track.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from tiers import newfile

# The tracks, in the order a viewer lists them ([Note: tracks and lanes]).
KINDS = ("compute", "copies", "nvme read", "nvme write", "update", "host waits")
PLAN = "plan"
_STEP_PID, _PLAN_PID = 1, 2
_LANES = 100    # tids of a track: its index * _LANES + its lane


class Timeline:
    """Spans recorded from any thread, in microseconds since the trace began.

    Examples
    --------
    >>> timeline = Timeline()
    >>> t0 = timeline.now()
    >>> timeline.span("compute", "forward blocks.0", t0, timeline.now())
    >>> [e["name"] for e in timeline.chrome()["traceEvents"] if e["ph"] == "X"]
    ['forward blocks.0']
    """

    def __init__(self) -> None:
        self._origin = time.perf_counter_ns()
        self._lock = threading.Lock()
        self.spans: list[tuple[str, str, float, float, dict]] = []   # (kind, name, start_us, end_us, args)
        self.planned: list[tuple[str, float, float, dict]] = []        # (name, start_us, dur_us, args)
        self.meta: dict = {}

    def now(self) -> float:
        """Microseconds since the trace began."""
        return (time.perf_counter_ns() - self._origin) / 1000.0

    def span(self, kind: str, name: str, start_us: float, end_us: float, args: dict | None = None) -> None:
        """Record one piece of work of ``kind`` (one of ``KINDS``)."""
        if kind not in KINDS:
            raise ValueError(f"a span's kind must be one of {list(KINDS)}, got {kind!r}")
        entry = (kind, name, start_us, max(end_us, start_us), dict(args or {}, thread=threading.current_thread().name))
        with self._lock:
            self.spans.append(entry)

    def plan(self, name: str, start_us: float, dur_us: float, args: dict | None = None) -> None:
        """Record one predicted phase on the plan's own track (``dur_us`` 0: a figure with no duration)."""
        with self._lock:
            self.planned.append((name, start_us, dur_us, dict(args or {})))

    # -- the file ------------------------------------------------------------------------------
    def chrome(self) -> dict:
        """The trace as Chrome's trace event format (a JSON-able dict)."""
        with self._lock:
            spans, planned = list(self.spans), list(self.planned)
        events: list[dict] = [_meta("process_name", _STEP_PID, None, "infinity step"),
                              _meta("process_sort_index", _STEP_PID, None, 0, key="sort_index")]
        for k, kind in enumerate(KINDS):
            mine = sorted((s for s in spans if s[0] == kind), key=lambda s: (s[2], -s[3]))
            for lane, members in enumerate(_lanes(mine)):
                tid = k * _LANES + lane + 1
                events.append(_meta("thread_name", _STEP_PID, tid, kind if lane == 0 else f"{kind} {lane + 1}"))
                events.append(_meta("thread_sort_index", _STEP_PID, tid, tid, key="sort_index"))
                events += [{"name": name, "cat": kind, "ph": "X", "ts": _us(start), "dur": _us(end - start),
                            "pid": _STEP_PID, "tid": tid, "args": args}
                           for _, name, start, end, args in members]
        if planned:
            events += [_meta("process_name", _PLAN_PID, None, "plan (predicted)"),
                       _meta("process_sort_index", _PLAN_PID, None, 1, key="sort_index")]
            phases = sorted(((PLAN, name, start, start + dur, args) for name, start, dur, args in planned),
                            key=lambda s: (s[2], -s[3]))
            for lane, members in enumerate(_lanes(phases)):
                events.append(_meta("thread_name", _PLAN_PID, lane + 1, PLAN if lane == 0 else f"{PLAN} {lane + 1}"))
                for _, name, start, end, args in members:
                    event = {"name": name, "cat": PLAN, "ph": "X", "ts": _us(start), "dur": _us(end - start),
                             "pid": _PLAN_PID, "tid": lane + 1, "args": args}
                    if end <= start:      # a figure with no duration: an instant
                        del event["dur"]
                        event.update(ph="i", s="t")
                    events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(self.meta)}

    def write(self, path: str | os.PathLike) -> Path:
        """Write ``chrome()`` to ``path`` under a temporary name, then rename it into place: a reader
        never sees half a file, and a failed write leaves what was there (see [Note: temporary names on a
        shared disk] in tiers/newfile.py)."""
        path = Path(path)
        text = json.dumps(self.chrome(), separators=(",", ":"))
        fd, tmp = newfile.create(str(path.parent.resolve()), prefix=f".{path.name}.tmp-")
        try:
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def _us(value: float) -> float:
    return round(value, 3)


def _meta(what: str, pid: int, tid: int | None, value, key: str = "name") -> dict:
    event = {"name": what, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _lanes(spans: list) -> list[list]:
    """Spans sorted by start (longest first at a tie) cut into lanes whose spans nest ([Note: tracks and lanes])."""
    lanes: list[list] = []
    open_ends: list[list[float]] = []      # per lane, the ends of its spans still open, innermost last
    for span in spans:
        start, end = span[2], span[3]
        for lane, ends in enumerate(open_ends):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                ends.append(end)
                lanes[lane].append(span)
                break
        else:
            open_ends.append([end])
            lanes.append([span])
    return lanes
