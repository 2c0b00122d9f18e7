"""The trace state machine, divergence detection and re-recording; the staging arena; the log line."""
import pytest

from tiers.arena import Arena
from infinity.telemetry import summary_line
from infinity.prefetch.trace import Divergence, Trace, TraceEntry, TraceMode, TraceStateError
from tiers.host_alloc import HostAllocator

STEP = [("forward", "", (0,)), ("forward", "a", (1,)), ("forward", "b", (2, 3)),
        ("backward", "b", (2, 3)), ("backward", "a", (1,)), ("backward", "", (0,))]


def _record(trace, requests=STEP):
    trace.begin_step()
    for r in requests:
        assert trace.observe(*r) is None
    assert trace.end_step() is None


def test_first_step_records_second_follows():
    t = Trace()
    assert t.mode is TraceMode.RECORDING
    _record(t)
    assert [(e.phase, e.name, e.groups) for e in t.entries] == STEP
    t.begin_step()
    assert t.mode is TraceMode.FOLLOWING and t.cursor == 0 and t.recordings == 1
    for i, r in enumerate(STEP):
        assert t.observe(*r) is None
        assert t.cursor == i + 1
    assert t.end_step() is None
    t.begin_step()
    assert t.mode is TraceMode.FOLLOWING and t.cursor == 0 and t.recordings == 1


def test_other_module_diverges_then_records_anew():
    t = Trace()
    _record(t)
    t.begin_step()
    t.observe(*STEP[0])
    found = t.observe("forward", "b", (2, 3))           # "a" was skipped
    assert isinstance(found, Divergence)
    assert (found.position, found.expected.name, found.got.name) == (1, "a", "b")
    assert "forward a" in found.describe() and "forward b" in found.describe()
    assert t.mode is TraceMode.DIVERGED and t.divergences == 1
    assert t.observe("backward", "zzz", ()) is None      # the rest of the step is ignored
    assert t.end_step() is None
    t.begin_step()
    assert t.mode is TraceMode.RECORDING and t.entries == []
    other = [STEP[0], STEP[2], STEP[3], STEP[5]]
    _record(t, other)
    t.begin_step()
    assert t.mode is TraceMode.FOLLOWING
    assert [(e.phase, e.name, e.groups) for e in t.entries] == other


def test_phase_matters():
    t = Trace()
    _record(t)
    t.begin_step()
    found = t.observe("backward", "", (0,))
    assert found is not None and found.expected.phase == "forward" and found.got.phase == "backward"


def test_step_ending_early_is_a_divergence():
    t = Trace()
    _record(t)
    t.begin_step()
    for r in STEP[:3]:                                  # a no-grad forward: no backward requests
        t.observe(*r)
    found = t.end_step()
    assert found is not None and found.got is None and found.expected.label() == "backward b"
    assert "the end of the step" in found.describe()
    assert t.mode is TraceMode.DIVERGED
    t.begin_step()
    assert t.mode is TraceMode.RECORDING


def test_step_going_past_the_trace_is_a_divergence():
    t = Trace()
    _record(t, STEP[:3])
    t.begin_step()
    for r in STEP[:3]:
        t.observe(*r)
    found = t.observe(*STEP[3])
    assert found is not None and found.expected is None and found.got.label() == "backward b"


def test_grown_groups_update_the_entry_without_divergence():
    t = Trace()
    _record(t)
    t.begin_step()
    t.observe(*STEP[0])
    assert t.observe("forward", "a", (1, 7)) is None     # "a" adopted group 7
    assert t.entries[1].groups == (1, 7) and t.mode is TraceMode.FOLLOWING


def test_refresh_applies_to_a_fresh_recording():
    t = Trace()
    _record(t)
    t.begin_step(refresh=lambda e: e.groups + (9,) if e.name == "a" else e.groups)
    assert [e.groups for e in t.entries if e.name == "a"] == [(1, 9), (1, 9)]


def test_divergence_keys_identify_distinct_divergences():
    a = Divergence(1, 1, TraceEntry("forward", "a", (1,)), TraceEntry("forward", "b", (2,)))
    b = Divergence(5, 1, TraceEntry("forward", "a", (1, 4)), TraceEntry("forward", "b", ()))
    c = Divergence(5, 1, TraceEntry("forward", "a", (1,)), None)
    assert a.key() == b.key() != c.key()


def test_invalid_transitions_raise_naming_both_modes():
    t = Trace()
    with pytest.raises(TraceStateError, match="cannot become DIVERGED from RECORDING"):
        t.to_diverged()
    with pytest.raises(TraceStateError, match="no recorded entries"):
        t.to_following()
    with pytest.raises(TraceStateError, match="cannot become RECORDING from RECORDING"):
        t.to_recording()
    with pytest.raises(ValueError, match="phase must be one of"):
        TraceEntry("sideways", "a", ())


def test_ahead_walks_from_the_cursor_and_stops_at_a_new_forward():
    t = Trace()
    accumulate = STEP + STEP                              # gradient accumulation: two micro-batches
    _record(t, accumulate)
    t.begin_step()
    assert [p for p, _ in t.ahead()] == list(range(6))    # stops before the second forward
    for r in accumulate[:4]:
        t.observe(*r)
    assert [p for p, _ in t.ahead()] == [4, 5]
    assert [p for p, _ in t.ahead(stop_at_new_forward=False)] == list(range(4, 12))
    for r in accumulate[4:7]:
        t.observe(*r)
    assert [p for p, _ in t.ahead()] == [7, 8, 9, 10, 11]


def test_ahead_is_empty_unless_following():
    t = Trace()
    _record(t)
    assert list(t.ahead()) == []


def test_next_use_distances():
    t = Trace()
    _record(t)
    t.begin_step()
    sizes = {0: 1, 1: 10, 2: 100, 3: 1000}
    d = t.next_use_distances(lambda g: sizes[g])
    assert d[2] == {2: 0, 3: 0}                  # b forward -> b backward right after
    assert d[1] == {1: 1100 + 1100}              # a forward -> a backward, b twice in between
    assert d[0] == {0: 10 + 1100 + 1100 + 10}    # root forward -> root backward
    assert d[5] == {0: None}                     # last use


# -- the staging arena ---------------------------------------------------------------------------
def _arena(nbytes):
    return Arena(HostAllocator(pin="never").empty, nbytes)


def test_arena_slices_are_aligned_and_bounded():
    arena = _arena(4 * 4096)
    a = arena.take(1, "a")
    b = arena.take(4097, "b")
    assert a.tensor.data_ptr() % 4096 == 0 and b.tensor.data_ptr() % 4096 == 0
    assert a.tensor.numel() == 4096 and b.tensor.numel() == 8192
    assert arena.bytes_in_use == 3 * 4096
    assert arena.take(8192, "c") is None and arena.refused == 1
    c = arena.take(4095, "c")
    assert c is not None and arena.bytes_in_use == arena.capacity == 4 * 4096
    for s in (a, b, c):
        s.release()
        s.release()                               # a second release is a no-op
    assert arena.bytes_in_use == 0 and arena.slices_out == 0 and arena.peak_bytes == 4 * 4096
    with pytest.raises(RuntimeError, match="already released"):
        a.tensor


def test_arena_refuses_when_fragmented_and_reuses_holes():
    arena = _arena(3 * 4096)
    a, b, c = (arena.take(4096, n) for n in "abc")
    a.release()
    c.release()
    assert arena.bytes_in_use == 4096
    assert arena.take(8192, "big") is None        # 8 KiB free, but in two holes
    big = arena.take(4096, "fits")
    assert big is not None and ("offset 0 " in big.where or "offset 8192 " in big.where)
    assert arena.stats()["refused"] == 1


def test_arena_allocates_lazily_and_rejects_bad_sizes():
    arena = _arena(1 << 30)
    assert arena.stats()["allocated"] is False
    with pytest.raises(ValueError, match="asked for 0 bytes"):
        arena.take(0, "zero")
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        _arena(-1)


def test_summary_line():
    record = {"step": 12, "seconds": 2.0, "stall_seconds": 0.5, "stall_fraction": 0.25, "hit_rate": 0.9,
              "late": 1, "misses": 2, "trace": "following",
              "tiers": {"nvme": {"bytes_read": 2 * 10**9, "bytes_written": 10**9, "read_GBps": 1.0,
                                 "write_GBps": 0.5},
                        "host": {"bytes_read": 0, "bytes_written": 0, "read_GBps": 0.0, "write_GBps": 0.0}}}
    line = summary_line(record)
    assert line.startswith("infinity step 12: 2.000 s, stall 0.500 s (25.0%), prefetch hit 90%")
    assert "nvme read 2.00 GB (1.00 GB/s) written 1.00 GB (0.50 GB/s)" in line
    assert "host" not in line and line.endswith("trace following")


def test_slots_link_each_group_to_its_previous_and_next_use_and_stop_at_a_new_forward():
    t = Trace()
    _record(t, STEP + STEP)
    t.begin_step()
    slots = t.slots()
    assert slots.group == [0, 1, 2, 3, 2, 3, 1, 0] * 2
    assert slots.start[:7] == [0, 1, 2, 4, 6, 7, 8]
    assert slots.previous[:8] == [-1, -1, -1, -1, 2, 3, 1, 0]
    assert slots.following[:8] == [7, 6, 4, 5, 10, 11, 9, 8]
    assert slots.stop[0] == 6 and slots.stop[4] == 6 and slots.stop[6] == 6 and slots.stop[7] == 12
    assert slots.upcoming(3) == {3: 3, 2: 4, 1: 6, 0: 7}
    assert slots.revision == t.revision
    t.observe(*STEP[0])
    t.observe("forward", "a", (1, 3))                     # a adopts group 3: the trace changes in place
    assert t.revision != slots.revision
