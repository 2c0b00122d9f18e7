"""One training run in a fresh process: what the benchmarks measure with.

[Note: one process per configuration]
Peak host RSS is a per-process high-water mark, and the allocator, the page
cache of a previous model and torch's own caches all linger in a process. So each
configuration the benchmarks compare runs ``python -m infinity.examples.train_gpt``
in its own subprocess and reports through ``--json``; the parent only reads the
JSON. A run that fails, is killed for memory or runs past its time limit becomes
a row with its error instead of ending the benchmark.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

from infinity.examples.gpt import GPTConfig
from infinity.examples.llama import LlamaConfig


@dataclass(frozen=True)
class RunResult:
    """The outcome of one subprocess run: its report, or why there is none."""

    argv: tuple[str, ...]
    report: dict | None
    error: str | None
    wall_seconds: float
    peak_rss_sampled_bytes: int

    @property
    def ok(self) -> bool:
        return self.report is not None and self.error is None


def shape_args(cfg: GPTConfig | LlamaConfig) -> list[str]:
    """train_gpt flags that reproduce ``cfg`` exactly (from the ``tiny`` or ``llama-tiny`` preset,
    every field overridden)."""
    if isinstance(cfg, LlamaConfig):
        return ["--model-size", "llama-tiny", "--layers", str(cfg.n_layer), "--d-model", str(cfg.d_model),
                "--heads", str(cfg.n_head), "--intermediate", str(cfg.intermediate), "--vocab",
                str(cfg.vocab_size), "--seq-len", str(cfg.seq_len)]
    return ["--model-size", "tiny", "--layers", str(cfg.n_layer), "--d-model", str(cfg.d_model),
            "--heads", str(cfg.n_head), "--vocab", str(cfg.vocab_size), "--seq-len", str(cfg.seq_len)]


def run_training(args: list[str], *, timeout: float | None = None, log_path: str | None = None,
                 env: dict | None = None, poll_seconds: float = 0.2) -> RunResult:
    """Run ``train_gpt`` with ``args`` (plus ``--json``) in a subprocess and return its report.

    Parameters
    ----------
    args:
        Command-line flags for ``python -m infinity.examples.train_gpt``.
    timeout:
        Seconds before the run is killed (None: no limit).
    log_path:
        File the child's stdout and stderr are appended to (None: a temporary file, deleted).
    env:
        Extra environment variables for the child.
    poll_seconds:
        How often the parent samples the child's RSS (a cross-check of the child's own peak).
    """
    with tempfile.TemporaryDirectory(prefix="infinity-run-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        argv = [sys.executable, "-m", "infinity.examples.train_gpt", *args, "--json", report_path,
                "--progress", "plain", "--quiet"]
        log = log_path or os.path.join(tmp, "log.txt")
        child_env = {**os.environ, **(env or {})}
        t0 = time.perf_counter()
        peak = 0
        with open(log, "a") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env)
            ps = psutil.Process(proc.pid)
            error = None
            while proc.poll() is None:
                try:
                    peak = max(peak, ps.memory_info().rss)
                except psutil.Error:
                    pass
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    proc.kill()
                    proc.wait()
                    error = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(poll_seconds)
        wall = time.perf_counter() - t0
        if error is None and proc.returncode != 0:
            error = f"exit status {proc.returncode}: {_tail(log)}"
        report = None
        if error is None:
            try:
                with open(report_path) as f:
                    report = json.load(f)
            except (OSError, ValueError) as exc:
                error = f"no report ({exc}): {_tail(log)}"
        return RunResult(tuple(argv), report, error, wall, peak)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def _tail(path: str, lines: int = 6) -> str:
    """The child's error: from the last line naming an exception to the end, else its last lines."""
    try:
        with open(path) as f:
            text = f.read().strip().splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(text) if _EXCEPTION_LINE.match(line)]
    picked = text[starts[-1]:] if starts else text[-lines:]
    return " | ".join(line.strip() for line in picked[:lines])
