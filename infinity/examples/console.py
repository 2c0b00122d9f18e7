"""What the examples print: a progress bar while training, a summary table at the end.

The bar is tqdm's when tqdm is installed and the output is a terminal or tqdm is
asked for; otherwise one plain line per step (or every ``every`` steps), which is
also what ends up readable in a log file.
"""
from __future__ import annotations

import sys

from infinity.examples.meter import TIERS, StepRecord, format_bytes


def step_fields(record: StepRecord) -> str:
    """``loss 5.41 | 812 tok/s | stall 7% | states nvme 1.2 GiB | rss 0.9 GiB``: the model states each tier
    holds (tiers holding none left out), then the whole process's resident memory."""
    tiers = " ".join(f"{name} {format_bytes(record.tier_bytes[name])}"
                     for name in TIERS if record.tier_bytes.get(name))
    parts = [f"loss {record.loss:.4f}", f"{record.tokens_per_second:,.0f} tok/s",
             f"stall {100 * record.stall_fraction:.0f}%"]
    if tiers:
        parts.append(f"states {tiers}")
    if record.io_read_bytes or record.io_write_bytes:
        parts.append(f"io {record.io_bytes_per_second / 1e9:.2f} GB/s")
    parts.append(f"rss {format_bytes(record.rss_bytes)}")
    return " | ".join(parts)


class Progress:
    """A progress bar over training steps.

    Parameters
    ----------
    total:
        Number of steps.
    stream:
        Where to print (default: stdout).
    use_tqdm:
        True / False, or None: tqdm when it is installed and ``stream`` is a terminal.
    every:
        Plain mode prints every ``every``-th step (and the last).
    """

    def __init__(self, total: int, stream=None, use_tqdm: bool | None = None, every: int = 1) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.every = max(1, every)
        self._bar = None
        if use_tqdm is None:
            use_tqdm = bool(getattr(self.stream, "isatty", lambda: False)())
        if use_tqdm:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True)

    def update(self, record: StepRecord) -> None:
        text = step_fields(record)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        elif record.step % self.every == 0 or record.step == self.total:
            print(f"step {record.step:>4}/{self.total} {record.seconds:7.2f} s | {text}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _seconds(value: float | None, total: float | None) -> str:
    if value is None:
        return "-"
    share = f"  ({100 * value / total:4.1f}%)" if total else ""
    return f"{value:8.3f} s{share}"


def summary_table(report: dict) -> str:
    """The end-of-run table from a ``train_gpt`` report dict."""
    s = report.get("summary") or {}
    model = report.get("model") or {}
    total = s.get("step_seconds")
    peaks = s.get("tier_peak_bytes") or {}
    rows = [
        ("model", f"{model.get('size', '?')}: {model.get('n_params', 0) / 1e6:,.1f} M params, "
                  f"states {format_bytes(model.get('states_nbytes'))} (16 B/param)"),
        ("tiers", report.get("tiers_text", "-")),
        (f"step time (median of {s.get('steps_measured', 0)})", _seconds(total, None)),
        ("  compute", _seconds(s.get("compute_seconds"), total)),
        ("  waiting for reads (stall)", _seconds(s.get("stall_seconds"), total)),
        ("  optimizer", _seconds(s.get("optimizer_seconds"), total)),
        ("tokens/s", f"{s.get('tokens_per_second') or 0:,.0f}"),
        # RSS is the whole process (torch, Python, activations, infinity's buffers); the tiers' figures are the
        # model states alone, so "host 0 B" (every state on NVMe) beside a large RSS is no contradiction.
        ("peak host RSS", format_bytes(s.get("peak_rss_bytes")) + " (the whole process)"),
        ("  of it infinity's buffers", f"{format_bytes(s.get('host_buffer_peak_bytes'))} (I/O pool, read-ahead, "
                                       "optimizer sub-groups, host-tier states: infinity-plan lists them)"
         if s.get("host_buffer_peak_bytes") else "-"),
        ("model states per tier (peak)", " / ".join(f"{t} {format_bytes(peaks.get(t))}" for t in TIERS if t in peaks)
         or "-"),
        ("NVMe I/O per step", f"read {format_bytes(s.get('io_read_bytes_per_step'))}, "
                              f"written {format_bytes(s.get('io_write_bytes_per_step'))}"),
        ("achieved I/O", f"{(s.get('io_bytes_per_second') or 0) / 1e9:.2f} GB/s"),
    ]
    if s.get("hit_rate") is not None:
        rows.append(("prefetch hit rate", f"{100 * s['hit_rate']:.0f}%"))
    if report.get("mfu") is not None:
        rows.append(("model FLOPs utilisation", f"{100 * report['mfu']:.1f}%"))
    if s:
        rows.append(("loss", f"{s.get('first_loss', 0):.4f} -> {s.get('last_loss', 0):.4f}"))
    ckpt = report.get("checkpoint") or {}
    if ckpt.get("path"):
        rows.append(("checkpoint", f"{ckpt['path']} ({format_bytes(ckpt.get('nbytes'))}, "
                                   f"{ckpt.get('seconds', 0):.1f} s)"))
    else:
        rows.append(("checkpoint", ckpt.get("note") or "not requested"))
    if report.get("json_path"):
        rows.append(("JSON report", report["json_path"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
