"""tiers.aio bad input: each a clear Python exception, no crash, no hang, no partial success."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tiers import _aio, aio
from tiers.aio import AioHandle, AlignmentError, ShortReadError, aligned_empty, open_file

ENGINES = aio.available_engines()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def handle(engine: str):
    with AioHandle(block_size=2 * 4096, queue_depth=2, threads=2, engine=engine) as h:
        yield h


def _file_with(tmp_path: Path, nbytes: int) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    return path


# ---------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize(
    "what,buf_start,nbytes,offset",
    [("buffer address", 1, 4096, 0), ("file_offset", 0, 4096, 512), ("length", 0, 4097, 0), ("length", 0, 1, 0)],
)
def test_unaligned_direct_request_is_explained(tmp_path, handle, what, buf_start, nbytes, offset) -> None:
    base = aligned_empty(3 * 4096)
    buf = base[buf_start : buf_start + nbytes]
    with open_file(_file_with(tmp_path, 8192), "rw") as f:
        for submit in (handle.pread, handle.pwrite):
            with pytest.raises(AlignmentError, match=f"multiples of 4096 bytes: {what}") as info:
                submit(f, buf, offset)
            assert "data.bin" in str(info.value) and "aligned_empty" in str(info.value)
    assert handle._core.active == 0  # nothing was submitted


def test_buffered_needs_no_alignment(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 8192), "r", direct=False) as f:
        buf = bytearray(4097)
        assert handle.pread(f, memoryview(buf)[1:], 3).wait() == 4096
    assert buf[1:5] == bytes([3, 4, 5, 6])


def test_is_aligned(tmp_path) -> None:
    t = aligned_empty(8192)
    assert aio.is_aligned(t, 4096)
    assert not aio.is_aligned(t[1:4097], 0)
    assert not aio.is_aligned(t, 100)
    assert not aio.is_aligned(t[:100], 0)


# ---------------------------------------------------------------------------------- short reads
@pytest.mark.parametrize("direct", [True, False])
def test_read_past_end_of_file(tmp_path, handle, direct: bool) -> None:
    with open_file(_file_with(tmp_path, 3 * 4096), "r", direct=direct) as f:
        with pytest.raises(ShortReadError) as info:
            handle.pread(f, aligned_empty(4096), 5 * 4096).wait()
        assert info.value.errno == errno.ENODATA and info.value.filename == f.path
        assert "offset 20480" in str(info.value) and "12288 bytes" in str(info.value)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("file_size", [3 * 4096, 3 * 4096 + 100])
def test_read_across_end_of_file_is_an_error(tmp_path, handle, direct: bool, file_size: int) -> None:
    # Asking for 4 pages of a 3-page (or 3-page-and-a-bit) file must not report success.
    with open_file(_file_with(tmp_path, file_size), "r", direct=direct) as f:
        fut = handle.pread(f, aligned_empty(4 * 4096), 0)
        with pytest.raises(ShortReadError, match=f"end of the file at offset {file_size}"):
            fut.wait()
        with pytest.raises(ShortReadError):  # the error stays with the future
            fut.wait()
        assert fut.done()


# ---------------------------------------------------------------------------------- files
def test_missing_directory(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        open_file(tmp_path / "nope" / "f.bin", "rw", create=True)
    assert info.value.filename.endswith("f.bin")
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "missing.bin", "r")


def _try_mount(args: list[str], target: Path) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args, str(target)], capture_output=True).returncode == 0


def test_read_only_directory(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    # [Note: read-only test directory] root ignores permission bits, so as root the directory is a
    # read-only tmpfs mount (EROFS); otherwise mode 0555 (EACCES). Both are real kernel refusals.
    mounted = _try_mount(["-t", "tmpfs", "-o", "ro,size=64k", "tmpfs"], ro)
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("running as root without permission to mount a read-only tmpfs")
        ro.chmod(0o555)
    try:
        with pytest.raises(OSError) as info:
            open_file(ro / "f.bin", "rw", create=True)
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        assert info.value.filename.endswith("f.bin")
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o755)


def test_wrong_access_mode(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 4096), "r") as f:
        with pytest.raises(OSError, match="not open for writing") as info:
            handle.pwrite(f, aligned_empty(4096), 0)
        assert info.value.errno == errno.EBADF and info.value.filename == f.path


def test_closed_file(tmp_path, handle) -> None:
    f = open_file(_file_with(tmp_path, 4096), "r")
    f.close()
    with pytest.raises(ValueError, match="closed file"):
        handle.pread(f, aligned_empty(4096), 0)


# ---------------------------------------------------------------------------------- full disk
def test_enospc_injected(tmp_path, handle) -> None:
    # The C test hook fails the 2nd write piece with ENOSPC: the request reports the error and the
    # offset of the failed piece, never the bytes of the pieces that did land.
    with open_file(tmp_path / "f.bin", "rw", create=True) as f:
        handle._core._inject(_aio.OP_WRITE, errno.ENOSPC, 2)
        fut = handle.pwrite(f, aligned_empty(6 * 4096), 0)
        with pytest.raises(OSError, match="failed at offset 8192: No space left on device") as info:
            fut.wait()
        assert info.value.errno == errno.ENOSPC and info.value.filename == f.path
        assert "disk is full" in str(info.value)
        assert handle.pwrite(f, aligned_empty(4096), 0).wait() == 4096  # the handle still works


def test_enospc_real_tmpfs(tmp_path, engine: str) -> None:
    small = tmp_path / "small"
    small.mkdir()
    if not _try_mount(["-t", "tmpfs", "-o", "size=64k", "tmpfs"], small):
        pytest.skip("mounting a 64 KiB tmpfs needs root; ENOSPC is covered by test_enospc_injected")
    try:
        with AioHandle(block_size=4096, queue_depth=4, engine=engine) as h, open_file(
            small / "f.bin", "rw", create=True
        ) as f:
            with pytest.raises(OSError) as info:
                h.pwrite(f, aligned_empty(1 << 20), 0).wait()
            assert info.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_kernel_einval_for_unchecked_direct_request(tmp_path, handle) -> None:
    # Bypassing the Python alignment check, the kernel's own EINVAL still comes back as an errno.
    with open_file(_file_with(tmp_path, 4096), "r") as f:
        rid = handle._core.submit(_aio.OP_READ, f.fd, 0, memoryview(bytearray(8192))[1:4097])
        assert handle._core.wait(rid, 10.0)
        assert handle._core.reap(rid) == (-errno.EINVAL, 0)


def test_injected_eio_on_read(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 8 * 4096), "r") as f:
        handle._core._inject(_aio.OP_READ, errno.EIO, 3)
        with pytest.raises(OSError, match="failed at offset 16384: Input/output error") as info:
            handle.pread(f, aligned_empty(8 * 4096), 0).wait()
        assert info.value.errno == errno.EIO


def test_wait_all_raises_first_error_after_settling_all(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 4 * 4096), "r") as f:
        good = handle.pread(f, aligned_empty(4096), 0)
        bad = handle.pread(f, aligned_empty(4096), 8 * 4096)
        with pytest.raises(ShortReadError):
            handle.wait_all()
        assert good.done() and bad.done() and good.wait() == 4096


# ---------------------------------------------------------------------------------- handle
def test_closed_handle(tmp_path, engine: str) -> None:
    h = AioHandle(engine=engine)
    h.close()
    with open_file(_file_with(tmp_path, 4096), "r") as f:
        with pytest.raises(ValueError, match="closed AioHandle"):
            h.pread(f, aligned_empty(4096), 0)
        with pytest.raises(ValueError, match="closed aio handle"):
            h._core.submit(_aio.OP_READ, f.fd, 0, bytearray(4096))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 1000}, "multiple of 4096"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"block_size": 2 << 30}, "at most 1 GiB"),
        ({"queue_depth": 0}, "queue_depth must be a positive int"),
        ({"threads": -1}, "threads must be a positive int"),
        ({"engine": "libaio"}, "engine must be"),
    ],
)
def test_bad_handle_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AioHandle(**kwargs)


def test_bad_core_settings() -> None:
    with pytest.raises(ValueError, match="engine must be 'io_uring' or 'threads', got 'x'"):
        _aio.Handle("x")
    with pytest.raises(ValueError, match="queue_depth"):
        _aio.Handle("threads", 0)


def test_bad_buffers_and_offsets(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 4 * 4096), "rw") as f:
        with pytest.raises(ValueError, match="contiguous"):
            handle.pread(f, aligned_empty(8 * 4096).view(2, -1)[:, :4096], 0)
        with pytest.raises(ValueError, match="writable"):
            handle.pread(f, bytes(4096), 0)
        with pytest.raises(TypeError, match="buffer protocol"):
            handle.pread(f, 12, 0)
        with pytest.raises(ValueError, match="file_offset must be an int >= 0"):
            handle.pread(f, aligned_empty(4096), -4096)
        with pytest.raises(TypeError, match="AioFile"):
            handle.pread(f.fd, aligned_empty(4096), 0)
        with pytest.raises(OSError) as info:  # a descriptor that is not open
            handle._core.submit(_aio.OP_READ, 10_000, 0, bytearray(4096))
        assert info.value.errno == errno.EBADF
    assert handle._core.active == 0


def test_core_reap_misuse(handle, tmp_path) -> None:
    with open_file(_file_with(tmp_path, 4096), "r", direct=False) as f:
        rid = handle._core.submit(_aio.OP_READ, f.fd, 0, bytearray(4096))
        assert handle._core.wait(rid, 10.0)
        assert handle._core.reap(rid) == (4096, -1)
        with pytest.raises(KeyError, match="already reaped"):
            handle._core.reap(rid)
        assert handle._core.done(rid)  # a stale id reads as done, never blocks
        assert handle._core.wait(rid, -1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to build a device tensor")
@pytest.mark.gpu
def test_device_tensor_is_refused(tmp_path, handle) -> None:
    with open_file(_file_with(tmp_path, 4096), "r") as f:
        with pytest.raises(ValueError, match="CPU tensors"):
            handle.pread(f, torch.empty(4096, dtype=torch.uint8, device="cuda"), 0)


def test_handle_used_after_fork(tmp_path, engine: str) -> None:
    # A forked child inherits the handle's memory but not its threads: it gets a clear error, and
    # closing (or dropping) the handle there neither hangs nor touches the parent's I/O.
    with AioHandle(block_size=4096, engine=engine) as h, open_file(_file_with(tmp_path, 8192), "r") as f:
        fut = h.pread(f, aligned_empty(8192), 0)
        pid = os.fork()
        if pid == 0:  # child: exit code reports what happened
            code = 1
            try:
                h.pread(f, aligned_empty(4096), 0)
            except ValueError as e:
                code = 0 if "after fork" in str(e) else 2
            try:
                h.close()
                f.close()
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert fut.wait() == 8192  # the parent's request is untouched
        assert h.pread(f, aligned_empty(4096), 0).wait() == 4096


# ---------------------------------------------------------------------------------- raw spans, limits, misuse
def test_submit_ptr_refuses_spans_it_can_see_are_wrong(tmp_path, handle) -> None:
    # Before: the span was trusted, so a length past the owner's buffer read or wrote whatever lay
    # beyond it. (The file is 4096 bytes, so that before the fix these reads wrote nothing past it.)
    core = handle._core
    with open_file(_file_with(tmp_path, 4096), "rw", direct=False) as f:
        owner = bytearray(4096)
        address, _ = _aio.buffer_info(owner, True)
        for op in (_aio.OP_READ, _aio.OP_WRITE):
            with pytest.raises(ValueError, match=r"submit_ptr: 8192 bytes at address 0x[0-9a-f]+ leave the owner's "
                                                 r"buffer \(a bytearray of 4096 bytes at 0x"):
                core.submit_ptr(op, f.fd, 0, address, 8192, owner)
            with pytest.raises(ValueError, match=r"start in the null page \(a NULL pointer\?\)"):
                core.submit_ptr(op, f.fd, 0, 16, 4096, None)
            with pytest.raises(ValueError, match="run past the address space"):
                core.submit_ptr(op, f.fd, 0, (1 << 64) - 4096, 8192, None)
        with pytest.raises(ValueError, match="leave the owner's buffer"):
            core.submit_ptr(_aio.OP_WRITE, f.fd, 0, address - 1, 4096, owner)
        frozen = bytes(4096)
        with pytest.raises(ValueError, match="the owner, a bytes, is read-only: a read would write into it"):
            core.submit_ptr(_aio.OP_READ, f.fd, 0, _aio.buffer_info(frozen)[0], 4096, frozen)
        assert core.active == 0
        rid = core.submit_ptr(_aio.OP_READ, f.fd, 0, address + 96, 4000, owner)   # inside the owner: fine
        assert core.wait(rid, 10.0) and core.reap(rid) == (4000, -1)
        assert owner[96:100] == bytes([0, 1, 2, 3])


def test_limits_of_the_config_are_the_cores(engine: str) -> None:
    from infinity.config import Config, ConfigError

    # Before: the config took queue_depth up to 32768 and threads up to 1024, and the core refused
    # above 4096 and 256 with a traceback that named no key.
    for key, most in (("queue_depth", aio.MAX_QUEUE_DEPTH), ("threads", aio.MAX_THREADS)):
        assert getattr(Config(aio={key: most}).aio, key) == most
        with pytest.raises(ConfigError, match=rf"aio\.{key}: expected an integer <= {most}, got {most + 1}"):
            Config(aio={key: most + 1})
        with pytest.raises(ValueError, match=f"AioHandle: {key} must be at most {most}, got {most + 1}"):
            AioHandle(**{key: most + 1})
    _aio.Handle(engine, aio.MAX_QUEUE_DEPTH, aio.MAX_THREADS, 4096).close()
    with pytest.raises(ValueError, match=r"queue_depth must be in \[1, 4096\]"):
        _aio.Handle(engine, aio.MAX_QUEUE_DEPTH + 1)
    with pytest.raises(ValueError, match=r"threads must be in \[1, 256\]"):
        _aio.Handle(engine, 32, aio.MAX_THREADS + 1)


def test_wait_all_takes_futures_only(handle) -> None:
    # Before: AttributeError: 'int' object has no attribute 'wait'.
    with pytest.raises(TypeError, match=r"wait_all: expected the AioFutures that pread/pwrite returned, got int 1"):
        handle.wait_all([1, 2])
