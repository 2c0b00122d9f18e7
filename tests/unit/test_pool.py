"""BufferPool: fixed buffers, waiting instead of failing, errors that name the holders."""
from __future__ import annotations

import threading
import time

import pytest

from tiers import BufferPool, HostAllocator, PoolTimeoutError


@pytest.fixture
def pool():
    return BufferPool(10_000, 3, HostAllocator(pin="never"), name="test-pool")


def test_buffers_are_fixed_aligned_and_distinct(pool):
    assert pool.buffer_nbytes == 12288 and pool.nbytes == 3 * 12288  # rounded up to 4096
    bufs = [pool.acquire(f"user{i}") for i in range(3)]
    ptrs = {b.tensor.data_ptr() for b in bufs}
    assert len(ptrs) == 3 and all(p % 4096 == 0 for p in ptrs)
    assert all(b.tensor.numel() == 12288 for b in bufs)
    assert sorted(pool.holders()) == ["user0", "user1", "user2"]
    for b in bufs:
        b.release()
    again = [pool.acquire("again") for _ in range(3)]
    assert {b.tensor.data_ptr() for b in again} == ptrs  # reused, never reallocated
    assert pool.allocator.stats()["allocations"] == 1  # one allocation for the whole pool


def test_acquire_waits_for_a_release(pool):
    held = [pool.acquire("slow holder") for _ in range(3)]
    threading.Timer(0.1, held[0].release).start()
    start = time.monotonic()
    with pool.acquire("waiter", timeout=10) as buf:
        assert buf.owner == "waiter"
        assert time.monotonic() - start >= 0.05
    stats = pool.stats()
    assert stats["waits"] == 1 and stats["wait_seconds"] > 0 and stats["peak_in_use"] == 3


def test_timeout_names_the_holders(pool):
    pool.acquire("nvme read key 3 (layer1.weight)")
    pool.acquire("nvme read key 3 (layer1.weight)")
    pool.acquire("optimizer step")
    with pytest.raises(PoolTimeoutError, match=r"pool 'test-pool': 'late' waited 0.05 s for a buffer; all 3 "
                       r"buffers \(12.0 KiB each\) are held by: 'nvme read key 3 \(layer1.weight\)' x2, "
                       r"'optimizer step'"):
        pool.acquire("late", timeout=0.05)
    assert isinstance(PoolTimeoutError("x"), TimeoutError)


def test_try_acquire_never_waits(pool):
    held = [pool.try_acquire("a") for _ in range(3)]
    assert all(h is not None for h in held)
    assert pool.try_acquire("b") is None
    held[1].release()
    assert pool.try_acquire("b") is not None


def test_release_is_idempotent_and_use_after_release_raises(pool):
    buf = pool.acquire("once")
    buf.release()
    buf.release()
    assert pool.in_use() == 0
    with pytest.raises(RuntimeError, match="already released by 'once'"):
        buf.tensor


def test_context_manager_releases_on_error(pool):
    with pytest.raises(ZeroDivisionError):
        with pool.acquire("boom"):
            1 / 0
    assert pool.in_use() == 0


@pytest.mark.parametrize("nbytes,count", [(0, 1), (-5, 1), (4096, 0), (4096, 1.5)])
def test_bad_sizes(nbytes, count):
    with pytest.raises(ValueError, match="pool 'p'"):
        BufferPool(nbytes, count, name="p")


def test_many_threads_share_a_small_pool(pool):
    counter = {"max": 0, "now": 0}
    lock = threading.Lock()

    def worker():
        for _ in range(20):
            with pool.acquire("worker", timeout=10):
                with lock:
                    counter["now"] += 1
                    counter["max"] = max(counter["max"], counter["now"])
                time.sleep(0.001)
                with lock:
                    counter["now"] -= 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter["max"] <= 3 and pool.in_use() == 0 and pool.stats()["acquires"] == 120


def test_a_lazy_pool_makes_a_buffer_only_when_no_made_one_is_free():
    allocator = HostAllocator(pin="never")
    pool = BufferPool(10_000, 3, allocator, name="lazy-pool", lazy=True)
    assert pool.made == 0 and allocator.stats()["bytes_allocated"] == 0
    assert pool.nbytes == 3 * 12288 and pool.stats()["buffers"] == 3     # its peak, known before
    first = pool.acquire("first")
    assert pool.made == 1 and not pool.allocated and allocator.stats()["bytes_allocated"] == 12288
    assert first.tensor.data_ptr() % 4096 == 0 and int(first.tensor.sum()) == 0
    ptr = first.tensor.data_ptr()
    first.release()
    for _ in range(3):      # one at a time: the made buffer again, nothing new
        with pool.acquire("again") as buf:
            assert buf.tensor.data_ptr() == ptr
    assert pool.made == 1 and allocator.stats()["allocations"] == 1
    held = [pool.acquire("a"), pool.try_acquire("b"), pool.acquire("c")]
    assert pool.allocated and pool.try_acquire("d") is None and len({b.tensor.data_ptr() for b in held}) == 3
    for buf in held:
        buf.release()
    [pool.acquire(f"e{i}") for i in range(3)]
    stats = pool.stats()
    assert allocator.stats()["allocations"] == 3 and stats["buffers_made"] == 3     # each made once, kept
    assert stats["made_nbytes"] == stats["nbytes"] == 3 * 12288 and stats["allocated"]


def test_an_eager_pool_makes_every_buffer_in_one_allocation():
    allocator = HostAllocator(pin="never")
    pool = BufferPool(10_000, 3, allocator, name="eager-pool")
    assert pool.made == 3 and pool.allocated and allocator.stats()["allocations"] == 1
