"""tiers.aio: data round trips, splitting into pieces, futures, both engines."""
from __future__ import annotations

import threading
import weakref

import pytest
import torch

from tiers import _aio, aio, aio_file
from tiers.aio import ALIGNMENT, AioFile, AioHandle, aligned_empty, open_file

ENGINES = aio.available_engines()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


def _random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = aligned_empty(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return out


def test_version_and_engines() -> None:
    assert aio.version() == _aio.__version__
    assert "threads" in ENGINES
    assert set(ENGINES) <= {"io_uring", "threads"}


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, (3 << 20) + 5])
def test_aligned_empty(nbytes: int) -> None:
    t = aligned_empty(nbytes)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
    assert t.numel() == nbytes
    if nbytes:
        assert t.data_ptr() % ALIGNMENT == 0
        t.fill_(3)  # writable, and usable as an ordinary tensor view
        assert int(t.view(torch.uint8)[-1]) == 3


def test_aligned_empty_bad_input() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        aligned_empty(-1)
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, alignment=3000)


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_split_into_pieces(tmp_path, engine: str, direct: bool) -> None:
    # 3 pieces of 12 KiB plus a 4 KiB tail, 2 slots: the request needs several refills.
    nbytes = 10 * 4096
    src = _random_bytes(nbytes)
    with AioHandle(block_size=3 * 4096, queue_depth=2, threads=2, engine=engine) as h:
        assert h.engine == engine
        with open_file(tmp_path / "f.bin", "rw", direct=direct, create=True) as f:
            before = h._core.pieces_issued
            assert h.pwrite(f, src, 4096).wait() == nbytes
            assert h._core.pieces_issued - before == 4
            dst = aligned_empty(nbytes)
            fut = h.pread(f, dst, 4096)
            assert fut.wait() == nbytes
            assert fut.done()
            assert fut.wait() == nbytes  # idempotent
    assert torch.equal(src, dst)


@pytest.mark.parametrize("nbytes,offset", [(1, 0), (4095, 1), (4097, 4095), (12345, 7)])
def test_buffered_odd_sizes(tmp_path, engine: str, nbytes: int, offset: int) -> None:
    src = bytes(range(256)) * (nbytes // 256 + 1)
    src = src[:nbytes]
    with AioHandle(block_size=4096, queue_depth=3, engine=engine, direct=False) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        assert not f.direct
        assert h.pwrite(f, src, offset).wait() == nbytes  # bytes: a read-only buffer is fine to write
        dst = bytearray(nbytes)
        assert h.pread(f, dst, offset).wait() == nbytes
        f.close()
    assert bytes(dst) == src


def test_many_in_flight_and_wait_any(tmp_path, engine: str) -> None:
    n, piece = 24, 8192
    src = _random_bytes(n * piece, seed=1)
    with AioHandle(block_size=4096, queue_depth=4, threads=3, engine=engine) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        writes = [h.pwrite(f, src[i * piece : (i + 1) * piece], i * piece) for i in range(n)]
        assert h.wait_all() == n * piece
        assert all(w.done() for w in writes)
        dst = aligned_empty(n * piece)
        reads = [h.pread(f, dst[i * piece : (i + 1) * piece], i * piece) for i in range(n)]
        seen = set()
        pending = list(reads)
        while pending:
            fut = h.wait_any(pending)
            assert fut is not None and fut.done()
            assert fut.wait() == piece
            seen.add(id(fut))
            pending.remove(fut)
        assert len(seen) == n
        f.close()
    assert torch.equal(src, dst)


def test_wait_all_on_subset_and_typed_buffers(tmp_path, engine: str) -> None:
    with AioHandle(block_size=1 << 16, engine=engine) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        t = aligned_empty(1 << 17).view(torch.float32)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32))
        assert h.wait_all([h.pwrite(f, t, 0)]) == 1 << 17
        back = aligned_empty(1 << 17).view(torch.float32)
        h.pread(f, back, 0).wait()
        assert torch.equal(back, t)
        f.close()


def test_concurrent_waiters_from_threads(tmp_path, engine: str) -> None:
    piece = 1 << 16
    with AioHandle(block_size=4096, queue_depth=8, engine=engine) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        h.pwrite(f, _random_bytes(8 * piece), 0).wait()
        results: list[int] = []
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for _ in range(5):
                    results.append(h.pread(f, aligned_empty(piece), i * piece).wait())
            except BaseException as e:  # surfaced by the assert below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errors and results == [piece] * 40
        f.close()


def test_buffer_dropped_while_in_flight_is_held(tmp_path, engine: str) -> None:
    nbytes = 4 << 20
    with AioHandle(block_size=1 << 20, queue_depth=2, engine=engine) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        h.pwrite(f, _random_bytes(nbytes), 0).wait()
        buf = aligned_empty(nbytes)
        alive = weakref.ref(buf)
        fut = h.pread(f, buf, 0)
        del buf
        # The C core holds the tensor until the request is reaped; it is alive even if the read
        # already completed, and freed right after wait() reaps it.
        assert alive() is not None
        assert fut.wait() == nbytes
        assert alive() is None
        # A future dropped before completion: the request finishes and its buffer is released.
        buf2 = aligned_empty(nbytes)
        alive2 = weakref.ref(buf2)
        h.pread(f, buf2, 0)  # future dropped at once
        del buf2
        h.wait_all()
        h.pwrite(f, aligned_empty(4096), 0).wait()  # the next submit sweeps released requests
        assert alive2() is None
        f.close()


def test_dropped_futures_do_not_grow_the_file_list(tmp_path, engine: str, monkeypatch) -> None:
    monkeypatch.setattr(aio_file, "_PENDING_PRUNE", 16)
    with AioHandle(block_size=4096, engine=engine) as h, open_file(tmp_path / "f.bin", "rw", create=True) as f:
        h.pwrite(f, aligned_empty(4096), 0).wait()
        for _ in range(6):
            for _ in range(10):
                h.pread(f, aligned_empty(4096), 0)  # future dropped unreaped
            h.wait_all()
        assert f.pending_requests <= 20  # 60 dropped requests, pruned as they finished


def test_file_close_waits_for_in_flight(tmp_path, engine: str) -> None:
    with AioHandle(block_size=1 << 20, queue_depth=1, engine=engine) as h:
        f = h.open(tmp_path / "f.bin", "rw", create=True)
        fut = h.pwrite(f, _random_bytes(8 << 20), 0)
        f.close()
        assert fut.done() and fut.wait() == 8 << 20
        assert f.closed and "closed" in repr(f)


def test_close_settles_futures(tmp_path, engine: str) -> None:
    h = AioHandle(block_size=1 << 20, engine=engine)
    f = h.open(tmp_path / "f.bin", "rw", create=True)
    fut = h.pwrite(f, _random_bytes(2 << 20), 0)
    h.close()
    h.close()  # idempotent
    assert h.closed
    assert fut.wait() == 2 << 20
    f.close()


def test_auto_falls_back_when_io_uring_refused(monkeypatch, tmp_path) -> None:
    real = _aio.Handle

    def refusing(engine: str, *args: int) -> object:
        if engine == "io_uring":
            raise PermissionError(1, "Operation not permitted", "io_uring_setup")
        return real(engine, *args)

    monkeypatch.setattr(aio._aio, "Handle", refusing)
    with AioHandle(engine="auto") as h:
        assert h.engine == "threads"
        assert "io_uring_setup refused" in h.fallback_reason
        with open_file(tmp_path / "f.bin", "rw", create=True) as f:
            assert h.pwrite(f, aligned_empty(4096), 0).wait() == 4096
    with pytest.raises(OSError, match="io_uring refused"):
        AioHandle(engine="io_uring")


def test_aiofile_helpers(tmp_path) -> None:
    f = open_file(tmp_path / "f.bin", "w", create=True)
    assert isinstance(f, AioFile) and f.direct and f.mode == "w"
    f.truncate(3 * 4096)
    assert f.size() == 3 * 4096
    assert f.fileno() == f.fd
    f.close()
    with pytest.raises(ValueError, match="closed file"):
        f.fileno()


def _buffered_file(tmp_path, nbytes: int):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(nbytes)  # sparse: reads are page-cache fast and need no disk space
    return open_file(path, "r", direct=False)


def test_gil_released_while_waiting(tmp_path) -> None:
    # With a 10 s switch interval the other thread can only run while wait() has dropped the GIL.
    import sys

    old = sys.getswitchinterval()
    with AioHandle(block_size=4096, threads=1, engine="threads") as h, _buffered_file(tmp_path, 32 << 20) as f:
        seen: list[bool] = []
        fut_box: list[aio.AioFuture] = []
        started = threading.Event()

        def watcher() -> None:
            started.set()
            while not fut_box:
                pass
            seen.append(fut_box[0].done())

        th = threading.Thread(target=watcher)
        th.start()
        started.wait()
        sys.setswitchinterval(10.0)
        try:
            fut_box.append(h.pread(f, bytearray(32 << 20), 0))
            fut_box[0].wait()
        finally:
            sys.setswitchinterval(old)
        th.join(10)
    assert seen == [False]  # the watcher ran, during the wait, before the read finished


def test_wait_returns_for_its_own_request_only(tmp_path) -> None:
    # One worker, 4 KiB pieces: the big request needs 16384 preads, the small one a single pread.
    with AioHandle(block_size=4096, threads=1, engine="threads") as h, _buffered_file(tmp_path, 64 << 20) as f:
        small = h.pread(f, bytearray(4096), 0)
        big = h.pread(f, bytearray(64 << 20), 0)
        assert small.wait() == 4096
        assert not big.done()
        with pytest.raises(TimeoutError, match="still in flight after 0 s"):
            big.wait(timeout=0)
        assert h.wait_any([big], timeout=0) is None
        assert big.wait() == 64 << 20
        assert h.wait_any([big], timeout=0) is big
