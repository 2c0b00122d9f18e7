"""The demand-read staging buffers of NVMe parameter shards: made as overlapping reads need them, at most
three (see [Note: staging buffers] in infinity/runtime/shards.py)."""
from __future__ import annotations

from infinity.runtime.shards import DEMAND_STAGING_BUFFERS, DemandStaging
from tiers.host_alloc import HostAllocator

LARGEST = 3 * 4096 + 100


def staging():
    allocator = HostAllocator(pin="never")
    return DemandStaging(allocator, lambda: LARGEST), allocator


def test_reads_that_never_overlap_hold_one_buffer():
    pool, allocator = staging()
    assert pool.stats() is None and allocator.stats()["bytes_allocated"] == 0, "nothing before the first read"
    for i in range(5):
        loan = pool.try_acquire(LARGEST - i, owner=f"param:g{i}")
        assert loan is not None and loan.tensor.numel() >= LARGEST
        loan.release()
    stats = pool.stats()
    assert stats["buffers"] == 1 and stats["acquires"] == 5 and stats["in_use"] == 0
    assert allocator.stats()["bytes_allocated"] == 4 * 4096      # one buffer, rounded up to the page


def test_overlapping_reads_get_up_to_three_then_none():
    pool, allocator = staging()
    loans = [pool.try_acquire(4096, owner=f"param:g{i}") for i in range(DEMAND_STAGING_BUFFERS)]
    assert all(loan is not None for loan in loans)
    assert len({loan.tensor.data_ptr() for loan in loans}) == DEMAND_STAGING_BUFFERS
    assert pool.try_acquire(4096, owner="param:one too many") is None     # the caller reads into its own memory
    assert pool.stats()["in_use"] == DEMAND_STAGING_BUFFERS == pool.stats()["peak_in_use"]
    second = loans[1].tensor.data_ptr()
    loans[1].release()
    again = pool.try_acquire(4096, owner="param:again")
    assert again is not None and again.tensor.data_ptr() == second
    assert allocator.stats()["bytes_allocated"] == DEMAND_STAGING_BUFFERS * 4 * 4096


def test_a_shard_above_the_largest_bypasses_the_buffers():
    pool, allocator = staging()
    assert pool.try_acquire(LARGEST + 4096, owner="param:grown") is None
    assert allocator.stats()["bytes_allocated"] == 0
    pool.try_acquire(10, owner="param:small").release()
    assert pool.try_acquire(LARGEST + 4096, owner="param:grown") is None


def test_a_buffer_that_cannot_be_made_is_named_with_its_size_and_what_to_change(monkeypatch):
    pool, allocator = staging()
    first = pool.try_acquire(4096, owner="param:g0")

    def refuse(*args, **kwargs):
        raise MemoryError("cannot allocate 16384 bytes")
    monkeypatch.setattr(allocator, "empty", refuse)
    try:
        pool.try_acquire(4096, owner="param:g1")
    except MemoryError as exc:
        said = str(exc)
    else:
        raise AssertionError("no error")
    assert "staging buffer 2 of 3" in said and f"{-(-LARGEST // 4096) * 4096:,} bytes" in said and "param:g1" in said, said
    assert "tiling.modules" in said and "tiers.host_budget" in said, said
    first.release()
    assert pool.stats()["buffers"] == 1      # the failed one is not counted, the made one still lends
    assert pool.try_acquire(4096, owner="param:g2") is not None
