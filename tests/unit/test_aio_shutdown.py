"""tiers.aio waits, releases and shutdown: every wait ends, every id is freed once, close never hangs.

Scenarios that hung or corrupted the request table before they were fixed run in a fresh
interpreter with a time limit, so that a regression fails the test (naming what hung) instead of
hanging the suite.
"""
from __future__ import annotations

import errno
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tiers import _aio, aio
from tiers.aio import AioHandle, aligned_empty, open_file

ENGINES = aio.available_engines()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


def run_isolated(code: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh interpreter; its stdout. A hang or a crash fails the test."""
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s; its output so far: {e.stdout!r}")
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


# ---------------------------------------------------------------------------------- timeouts
def test_a_huge_or_infinite_timeout_waits_until_done(tmp_path, engine: str) -> None:
    # Before: the deadline overflowed, pthread_cond_timedwait failed with EINVAL at once and the
    # waiter spun holding the handle's mutex, so the completion was never delivered. Each request
    # is in flight when waited on: 16 MiB written 4 KiB at a time, one piece after another.
    out = run_isolated(f"""
    import math, os
    from tiers import _aio
    h = _aio.Handle("{engine}", 1, 1, 4096)
    fd = os.open(os.path.join("{tmp_path}", "slow.bin"), os.O_RDWR | os.O_CREAT)
    for timeout in (math.inf, 1e10, 1e300):
        rid = h.submit(_aio.OP_WRITE, fd, 0, bytearray(16 << 20))
        print(h.wait(rid, timeout), h.reap(rid))
        rid = h.submit(_aio.OP_WRITE, fd, 0, bytearray(16 << 20))
        print(h.wait_any([rid], timeout) == rid, h.reap(rid))
        rid = h.submit(_aio.OP_WRITE, fd, 0, bytearray(16 << 20))
        print(h.wait_all(timeout), h.reap(rid))
    h.close()
    """)
    assert out.splitlines() == [f"True ({16 << 20}, -1)"] * 9


def test_nan_and_negative_timeouts_are_refused(tmp_path, engine: str) -> None:
    with AioHandle(engine=engine) as h, open_file(tmp_path / "f.bin", "rw", direct=False, create=True) as f:
        fut = h.pwrite(f, aligned_empty(4096), 0)
        for bad in (math.nan, -1, -0.5):
            with pytest.raises(ValueError, match=r"timeout must be None \(no limit\) or a number of seconds >= 0"):
                fut.wait(bad)
            with pytest.raises(ValueError, match="timeout must be None"):
                h.wait_any([fut], bad)
        for call in (lambda: h._core.wait(fut.rid, math.nan), lambda: h._core.wait_any([fut.rid], math.nan),
                     lambda: h._core.wait_all(math.nan), lambda: h._core.drain(math.nan)):
            with pytest.raises(ValueError, match="timeout must be a number of seconds"):
                call()
        assert fut.wait() == 4096 and fut.wait(0) == 4096 and fut.wait(math.inf) == 4096


# ---------------------------------------------------------------------------------- release
def test_a_released_request_is_freed_once(tmp_path, engine: str) -> None:
    # Before: release() of a request in flight, then reap() or a second release(), freed its slot
    # while it was also on the zombie list; the sweep freed it again, the free list looped, one id
    # went to two live requests, a completion was lost and close() hung.
    out = run_isolated(f"""
    import os
    from tiers import _aio
    h = _aio.Handle("{engine}", 2, 2, 4096)
    fd = os.open(os.path.join("{tmp_path}", "f.bin"), os.O_RDWR | os.O_CREAT)
    for then in ("reap", "release"):
        rid = h.submit(_aio.OP_WRITE, fd, 0, bytearray(16 << 20))
        h.release(rid)
        print(h.wait(rid, -1.0), h.done(rid))            # a released id reads as done at once
        if then == "reap":
            try:
                h.reap(rid)
            except KeyError as e:
                print("KeyError", "released" in str(e))
        else:
            print(h.release(rid))                          # a no-op
        h.wait_all(-1.0)
        ids = [h.submit(_aio.OP_WRITE, fd, 4096 * k, bytearray(4096)) for k in range(130)]
        print(len(set(ids)), sorted({{h.reap(i)[0] for i in ids if h.wait(i, 10.0)}}))
    h.close(5.0)
    print("closed")
    """)
    assert out.splitlines() == ["True True", "KeyError True", "130 [4096]", "True True", "None", "130 [4096]",
                                "closed"]


# ---------------------------------------------------------------------------------- files without offsets
def test_a_fifo_is_refused_at_open_without_blocking(tmp_path) -> None:
    # Before: open_file(fifo, "r") waited for a writer forever; with one, an io_uring read waited
    # for data forever and close() and interpreter exit hung with it.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = run_isolated(f"""
    from tiers.aio_file import open_file
    for mode in ("r", "w", "rw"):
        try:
            open_file("{fifo}", mode, direct=False)
            print("opened")
        except OSError as e:
            print(e.errno, e.filename.endswith("fifo"), e.strerror)
    """, timeout=30)
    assert out.splitlines() == [f"{errno.ESPIPE} True a FIFO: aio reads and writes regular files and block "
                                "devices only"] * 3


def test_directories_devices_and_sockets_are_refused_at_open(tmp_path) -> None:
    with pytest.raises(IsADirectoryError, match="a directory: aio reads and writes regular files"):
        open_file(tmp_path, "r", direct=False)
    with pytest.raises(OSError, match="a character device") as info:
        open_file("/dev/null", "rw", direct=False)
    assert info.value.errno == errno.ESPIPE and info.value.filename == "/dev/null"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError):      # a socket cannot be open()ed: refused by the kernel first
            open_file(tmp_path / "sock", "r", direct=False)


def test_the_core_refuses_descriptors_without_offsets(tmp_path, engine: str) -> None:
    r, w = os.pipe()
    a, b = socket.socketpair()
    null = os.open("/dev/null", os.O_RDWR)
    os.write(w, bytes(4096)), b.send(bytes(4096))    # before the fix, so that these reads ended
    try:
        with AioHandle(engine=engine) as h:
            for fd, what in ((r, "a FIFO or pipe"), (w, "a FIFO or pipe"), (a.fileno(), "a socket"),
                             (null, "a character device")):
                with pytest.raises(OSError, match=f"fd {fd} is {what}: aio reads and writes regular files") as info:
                    h._core.submit(_aio.OP_READ if fd != w else _aio.OP_WRITE, fd, 0, bytearray(4096))
                assert info.value.errno == errno.ESPIPE
            assert h._core.active == 0
    finally:
        os.close(r), os.close(w), os.close(null), a.close(), b.close()


# ---------------------------------------------------------------------------------- close
def test_close_cancels_what_stalls_on_io_uring(tmp_path) -> None:
    if "io_uring" not in ENGINES:
        pytest.skip("io_uring is refused here")
    with open_file(tmp_path / "f.bin", "rw", direct=False, create=True) as f:
        h = AioHandle(block_size=4096, queue_depth=4, engine="io_uring")
        h._core._stall(_aio.OP_WRITE, 1, 3600.0)       # a kernel timer in place of the first piece
        stalled = h.pwrite(f, aligned_empty(4096), 0)
        fine = h.pwrite(f, aligned_empty(4096), 4096)
        start = time.monotonic()
        h.close(timeout=0.2)                           # no progress for 0.2 s: IORING_OP_ASYNC_CANCEL
        assert time.monotonic() - start < 5.0
        assert fine.wait() == 4096
        with pytest.raises(OSError, match=r"failed at offset 0: Operation canceled") as info:
            stalled.wait()
        assert info.value.errno == errno.ECANCELED and h.closed


def test_close_reports_what_it_cannot_cancel_and_keeps_the_buffer(tmp_path) -> None:
    # A pool thread inside pread/pwrite cannot be interrupted: the stalled write is reported, its
    # buffer kept, and it lands when the stall ends; a second close of the core then finishes.
    with open_file(tmp_path / "f.bin", "rw", direct=False, create=True) as f:
        h = AioHandle(block_size=4096, threads=1, engine="threads")
        core = h._core
        core._stall(_aio.OP_WRITE, 1, 1.0)
        buf = aligned_empty(4096).fill_(7)
        stalled = h.pwrite(f, buf, 0)
        queued = h.pwrite(f, aligned_empty(4096), 4096)     # never issued: cancelled
        del buf
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"1 request\(s\) still in flight 0.2 s after they were cancelled "
                                               rf"\(write of 4096 bytes at offset 0 of {f.path}\)"):
            h.close(timeout=0.2)
        assert time.monotonic() - start < 0.9
        with pytest.raises(OSError) as info:
            queued.wait()
        assert info.value.errno == errno.ECANCELED
        assert not stalled.done() and core.active == 1
        assert stalled.wait(10.0) == 4096
        assert os.pread(f.fd, 4096, 0) == bytes([7]) * 4096    # the kept buffer was written
        core.close(1.0)


def test_close_never_cuts_a_healthy_queue_short(tmp_path, engine: str) -> None:
    # Each finished piece restarts close's clock: 16384 pieces over far longer than the timeout.
    with open_file(tmp_path / "f.bin", "rw", direct=False, create=True) as f:
        h = AioHandle(block_size=4096, queue_depth=1, threads=1, engine=engine)
        futs = [h.pwrite(f, aligned_empty(16 << 20), k << 24) for k in range(4)]
        h.close(timeout=0.05)
        assert [fut.wait() for fut in futs] == [16 << 20] * 4


def test_core_close_names_what_it_kept(tmp_path) -> None:
    with open_file(tmp_path / "f.bin", "rw", direct=False, create=True) as f:
        core = _aio.Handle("threads", 4, 1, 4096)
        core._stall(-1, 1, 0.5)
        rid = core.submit(_aio.OP_WRITE, f.fd, 8192, bytearray(4096))
        with pytest.raises(TimeoutError, match=rf"aio close: 1 request is still in flight 0.1 s after it was "
                                               rf"cancelled \(write of 4096 bytes at offset 8192 of fd {f.fd}\)"):
            core.close(0.1)
        assert core.wait(rid, 10.0) and core.reap(rid) == (4096, -1)
        core.close(0.1)
        assert core.closed


def test_test_hooks_refuse_nonsense(engine: str) -> None:
    with AioHandle(engine=engine) as h:
        # Before: _inject(op, -5, 1) made the piece "complete" with 5 bytes moved.
        for args in ((_aio.OP_READ, -5, 1), (_aio.OP_READ, 0, 1), (_aio.OP_READ, 5000, 1)):
            with pytest.raises(ValueError, match="errno must be a positive errno value"):
                h._core._inject(*args)
        with pytest.raises(ValueError, match="op must be -1"):
            h._core._inject(7, errno.EIO, 1)
        with pytest.raises(ValueError, match="nth in"):
            h._core._inject(-1, errno.EIO, -1)
        with pytest.raises(ValueError, match="seconds must be in"):
            h._core._stall(-1, 1, -1.0)
