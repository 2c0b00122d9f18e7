"""What one training step cost: time split, memory, bytes per tier, I/O rate.

``StepMeter`` reads ``infinity.stats(model)`` before and after each step and keeps
the differences, so it works from the cumulative counters every engine version
has (fetch stall seconds, bytes read and written per tier, current and peak bytes
per tier) and picks up newer per-step fields (``stats()["steps"]``) when present.
With a plain PyTorch model (no engine) the tier figures are simply absent.

[Note: step time breakdown]
A step is split into three parts that add up to its wall time:
- stall: seconds the forward/backward spent waiting for parameter reads
  (``fetch.stall_seconds`` grown during the step);
- compute: the rest of forward + backward;
- optimizer: ``opt.step()`` and ``opt.zero_grad()``, timed around the calls.
With delayed parameter update (DPU) the host step runs in the background, so
``opt.step()`` returns early and any waiting for it shows up in the next forward.

[Note: peak RSS]
The peak host RSS is the kernel's high-water mark for the process
(``getrusage(RUSAGE_SELF).ru_maxrss``): it covers construction, every step and
the moments between samples. The current RSS (``psutil``) is sampled at step ends.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass, field

import psutil

TIERS = ("device", "host", "nvme")

# Dense peak FLOP/s of common GPUs (vendor data sheets; SXM parts), for MFU.
_PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "float32": 31.2e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
}


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes (see [Note: peak RSS])."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """The process's current resident set size, in bytes."""
    return psutil.Process(os.getpid()).memory_info().rss


def gpu_peak_flops(dtype_name: str) -> float | None:
    """Peak dense FLOP/s of this process's GPU for ``dtype_name``, or None (no GPU, unknown part)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for part, table in _PEAK_FLOPS.items():
        if part in name:
            return table.get(dtype_name)
    return None


@dataclass(frozen=True)
class StepRecord:
    """The figures of one training step (seconds, bytes; see [Note: step time breakdown])."""

    step: int
    loss: float
    tokens: int
    seconds: float
    compute_seconds: float
    stall_seconds: float
    optimizer_seconds: float
    rss_bytes: int
    peak_rss_bytes: int
    peak_rss_forward_backward_bytes: int = 0
    tier_bytes: dict = field(default_factory=dict)
    tier_peak_bytes: dict = field(default_factory=dict)
    host_buffer_peak_bytes: int = 0
    """infinity's host memory beside the model states (I/O pool, read-ahead arena, optimizer sub-groups, the
    host tier's storage): the host allocator's peak, a part of ``peak_rss_bytes``."""
    io_read_bytes: int = 0
    io_write_bytes: int = 0
    hit_rate: float | None = None
    engine_step: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def io_bytes_per_second(self) -> float:
        return (self.io_read_bytes + self.io_write_bytes) / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(tokens_per_second=self.tokens_per_second, stall_fraction=self.stall_fraction,
                   io_bytes_per_second=self.io_bytes_per_second)
        return out


def engine_stats(model) -> dict | None:
    """``infinity.stats(model)``, or None when ``model`` is not managed by infinity."""
    from infinity import registry

    try:
        return registry.engine_of(model, "StepMeter").stats()
    except registry.NotManagedError:
        return None


def _tier_counters(stats: dict | None) -> dict:
    """{tier: (bytes_read, bytes_written, bytes_in_use, peak_bytes)} from an engine stats dict."""
    out = {}
    tiers = (stats or {}).get("tiers") or {}
    for name in TIERS:
        t = tiers.get(name)
        if isinstance(t, dict):
            out[name] = (int(t.get("bytes_read", 0)), int(t.get("bytes_written", 0)),
                         int(t.get("bytes_in_use", 0)), int(t.get("peak_bytes", 0)))
    return out


def _delta(before: dict, after: dict, tier: str, column: int) -> int:
    """Growth of one counter of one tier between two readings (0 when the tier is absent)."""
    if tier not in after:
        return 0
    return after[tier][column] - before.get(tier, (0, 0, 0, 0))[column]


def _fetch(stats: dict | None) -> dict:
    return (stats or {}).get("fetch") or {}


class StepMeter:
    """Times training steps and reads the engine's counters around them.

    Parameters
    ----------
    model:
        The model being trained (built in ``infinity.Init`` or plain).
    sync:
        Called before each clock reading (``torch.cuda.synchronize`` on a GPU), or None.

    Examples
    --------
    >>> meter = StepMeter(model)                        # doctest: +SKIP
    >>> meter.begin()                                   # doctest: +SKIP
    >>> loss = model(x, y); loss.backward()             # doctest: +SKIP
    >>> meter.forward_backward_done()                   # doctest: +SKIP
    >>> opt.step(); opt.zero_grad()                     # doctest: +SKIP
    >>> record = meter.end(loss=loss.item(), tokens=x.numel())   # doctest: +SKIP
    """

    def __init__(self, model, sync=None) -> None:
        self.model = model
        self.sync = sync or (lambda: None)
        self.records: list[StepRecord] = []
        self._t0 = self._t1 = 0.0
        self._peak_fb = 0
        self._before: dict | None = None

    def _now(self) -> float:
        self.sync()
        return time.perf_counter()

    def begin(self) -> None:
        """A step starts now."""
        self._before = engine_stats(self.model)
        self._t0 = self._now()

    def forward_backward_done(self) -> None:
        """Forward and backward are finished; the optimizer step starts now."""
        self._t1 = self._now()
        self._peak_fb = peak_rss_bytes()

    def end(self, loss: float, tokens: int) -> StepRecord:
        """The step (including ``zero_grad``) is finished: record it."""
        t2 = self._now()
        after = engine_stats(self.model)
        before_fetch, after_fetch = _fetch(self._before), _fetch(after)
        stall = float(after_fetch.get("stall_seconds", 0.0)) - float(before_fetch.get("stall_seconds", 0.0))
        fetches = int(after_fetch.get("fetches", 0)) - int(before_fetch.get("fetches", 0))
        hits = int(after_fetch.get("prefetch_hits", 0)) - int(before_fetch.get("prefetch_hits", 0))
        c0, c1 = _tier_counters(self._before), _tier_counters(after)
        fb = self._t1 - self._t0
        stall = min(max(stall, 0.0), fb)
        steps = (after or {}).get("steps") or []
        # The kernel books the peak lazily (per-thread page counters are folded in batches), so
        # read just after the current size it can trail it by a few pages: the peak is at least that.
        rss = rss_bytes()
        peak = max(peak_rss_bytes(), rss)
        record = StepRecord(
            step=len(self.records) + 1, loss=float(loss), tokens=int(tokens), seconds=t2 - self._t0,
            compute_seconds=fb - stall, stall_seconds=stall, optimizer_seconds=t2 - self._t1,
            rss_bytes=rss, peak_rss_bytes=peak, peak_rss_forward_backward_bytes=self._peak_fb,
            tier_bytes={k: v[2] for k, v in c1.items()},
            tier_peak_bytes={k: v[3] for k, v in c1.items()},
            host_buffer_peak_bytes=int((((after or {}).get("tiers") or {}).get("host_allocator") or {})
                                       .get("peak_bytes", 0)),
            io_read_bytes=_delta(c0, c1, "nvme", 0),
            io_write_bytes=_delta(c0, c1, "nvme", 1),
            hit_rate=(hits / fetches) if fetches else None,
            engine_step=steps[-1] if steps and isinstance(steps[-1], dict) else None)
        self.records.append(record)
        return record

    def summary(self, skip_first: int = 1) -> dict:
        """Medians over the steps after the first ``skip_first`` (warm-up), peaks over all.

        The step time and its breakdown are those of the median step (the lower middle
        one for an even count). NVMe bytes per step are a mean, not a median, over the steps
        after the first two (see [Note: NVMe bytes per step]).
        """
        recs = self.records[skip_first:] if len(self.records) > skip_first else self.records
        if not recs:
            return {}
        last = self.records[-1]
        total_s = sum(r.seconds for r in recs)
        io = sum(r.io_read_bytes + r.io_write_bytes for r in recs)
        # The breakdown is that of the median step, so its three parts add up to its time.
        mid = sorted(recs, key=lambda r: r.seconds)[(len(recs) - 1) // 2]
        return {
            "steps_measured": len(recs),
            "step_seconds": mid.seconds,
            "compute_seconds": mid.compute_seconds,
            "stall_seconds": mid.stall_seconds,
            "optimizer_seconds": mid.optimizer_seconds,
            "stall_fraction": mid.stall_fraction,
            "step_seconds_median": _median([r.seconds for r in recs]),
            "step_seconds_min": min(r.seconds for r in recs),
            "tokens_per_second": _median([r.tokens_per_second for r in recs]),
            "io_read_bytes_per_step": io_per_step(self.records, "io_read_bytes"),
            "io_write_bytes_per_step": io_per_step(self.records, "io_write_bytes"),
            "io_bytes_per_second": io / total_s if total_s > 0 else 0.0,
            "hit_rate": _median([r.hit_rate for r in recs if r.hit_rate is not None]),
            "peak_rss_bytes": max(r.peak_rss_bytes for r in self.records),
            "tier_peak_bytes": dict(last.tier_peak_bytes),
            "host_buffer_peak_bytes": max(r.host_buffer_peak_bytes for r in self.records),
            "first_loss": self.records[0].loss,
            "last_loss": last.loss,
        }


IO_WARMUP_STEPS = 2


def io_per_step(records: list[StepRecord], field_name: str) -> float | None:
    """Mean bytes of ``field_name`` per step over the steps after the first ``IO_WARMUP_STEPS``
    (after the first one only, when there are no more).

    [Note: NVMe bytes per step]
    A step's record counts the bytes that moved between its ``begin`` and its ``end``. With the
    overlapped update (``dpu.overlap``) the update of step t runs after ``opt.step()`` returns,
    beside the forward of step t+1, and where a window cuts it depends on timing: one step's window
    may hold two updates and the next none. A median of such windows is not a step's traffic; their
    sum over consecutive steps is (each cut moves bytes from one window to the next), so this is a
    mean. And the first update reads no Adam moments (they start at zero: 2 bytes per parameter fewer
    with int8 moments) and, overlapped, lands in the second step's window, so the first two steps
    are left out. (The 6.7B run reported 9.03 B/param read per step as the median of steps 2 and 3,
    the first update included; the steady figure is about 1 B/param more.)
    """
    skip = IO_WARMUP_STEPS if len(records) > IO_WARMUP_STEPS else min(1, len(records) - 1)
    recs = records[skip:]
    if not recs:
        return None
    return sum(getattr(r, field_name) for r in recs) / len(recs)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def format_bytes(n: float | None) -> str:
    """``1.5 GiB`` style, for tables and progress lines."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
