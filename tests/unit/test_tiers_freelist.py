"""FreeList: aligned slots, best-fit reuse, merging, shrinking, double-free detection."""
from __future__ import annotations

import random

import pytest

from tiers.freelist import FreeList


def test_slots_are_aligned_and_grow_the_end():
    fl = FreeList(start=4096)
    assert [fl.allocate(n) for n in (1, 4096, 4097)] == [4096, 8192, 12288]
    assert fl.end == 20480


def test_neighbours_merge_and_the_tail_shrinks():
    fl = FreeList(start=4096)
    a, b, c, d = (fl.allocate(4096) for _ in range(4))
    fl.release(b, 4096)
    fl.release(c, 4096)
    assert fl.holes == 1 and fl.hole_bytes == 8192
    fl.release(d, 4096)  # touches the end: everything after a is gone
    assert fl.end == a + 4096 and fl.holes == 0
    fl.release(a, 4096)
    assert fl.end == 4096


def test_best_fit_keeps_big_holes():
    fl = FreeList(start=0)
    slots = [fl.allocate(size) for size in (8192, 4096, 16384, 4096)]
    fl.release(slots[0], 8192)
    fl.release(slots[2], 16384)
    assert fl.allocate(8192) == slots[0]  # the exact fit, not the first big hole
    assert fl.allocate(16384) == slots[2]


def test_double_free_and_foreign_slots_raise():
    fl = FreeList(start=4096)
    a = fl.allocate(4096)
    fl.allocate(4096)
    fl.release(a, 4096)
    with pytest.raises(ValueError, match="double free"):
        fl.release(a, 4096)
    with pytest.raises(ValueError, match="not inside"):
        fl.release(1 << 30, 4096)
    with pytest.raises(ValueError, match="not a multiple"):
        FreeList(start=100)


def test_random_churn_never_overlaps():
    rng = random.Random(3)
    fl = FreeList(start=4096)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            fl.release(offset, live.pop(offset))
        else:
            size = rng.randint(1, 40_000)
            offset = fl.allocate(size)
            live[offset] = size
        spans = sorted((o, o + fl.round_up(s)) for o, s in live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        assert fl.hole_bytes + sum(fl.round_up(s) for s in live.values()) == fl.end - 4096
    for offset, size in list(live.items()):
        fl.release(offset, size)
    assert fl.end == 4096 and fl.holes == 0
