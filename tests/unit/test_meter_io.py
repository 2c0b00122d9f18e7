"""NVMe bytes per step from the step meter's windows (see [Note: NVMe bytes per step] in
infinity/examples/meter.py)."""
from __future__ import annotations

import pytest

from infinity.examples.meter import StepMeter, StepRecord


def _record(step: int, read: int, written: int) -> StepRecord:
    return StepRecord(step=step, loss=1.0, tokens=1, seconds=1.0, compute_seconds=1.0, stall_seconds=0.0,
                      optimizer_seconds=0.0, rss_bytes=1, peak_rss_bytes=1, io_read_bytes=read,
                      io_write_bytes=written)


def test_overlapped_updates_cut_anywhere_and_the_first_one_reads_no_moments():
    """Forward and backward read 4 bytes a step; an update reads 8, the first one 6 (no moments yet).
    With the update overlapped, step 2's window holds the first update, and the windows of steps 3-5
    cut the next ones by timing: two updates in one window, none in the next."""
    fb, update, first = 4, 8, 6
    meter = StepMeter(model=None)
    meter.records = [_record(1, fb, 2), _record(2, fb + first, 8), _record(3, fb + 2 * update, 14),
                     _record(4, fb, 2), _record(5, fb + update, 8)]
    summary = meter.summary()
    assert summary["io_read_bytes_per_step"] == pytest.approx(fb + update)
    assert summary["io_write_bytes_per_step"] == pytest.approx(8)


def test_a_short_run_leaves_out_only_the_first_step():
    meter = StepMeter(model=None)
    meter.records = [_record(1, 4, 2), _record(2, 10, 8)]
    assert meter.summary()["io_read_bytes_per_step"] == pytest.approx(10)
    meter.records = meter.records[:1]
    assert meter.summary()["io_read_bytes_per_step"] == pytest.approx(4)
