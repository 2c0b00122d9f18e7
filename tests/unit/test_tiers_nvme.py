"""The NVMe tier's own behaviour: locks, stale files, full disks, removed and damaged files, reuse."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tiers import (
    BufferPool,
    HostAllocator,
    NVMeIOError,
    NVMeSpaceError,
    NVMeTier,
    StaleSwapFileError,
    SwapDirectoryError,
    SwapDirectoryLockedError,
    UnwrittenKeyError,
)
from tiers.aio import AioHandle, aligned_empty
from tiers.swapfile import SwapFileDamagedError

BUFFER = 64 << 10


@pytest.fixture(scope="module")
def handle():
    with AioHandle(block_size=1 << 20) as h:
        yield h


@pytest.fixture(scope="module")
def pool():
    return BufferPool(BUFFER, 4, HostAllocator(pin="never"), name="nvme-test")


@pytest.fixture
def tier(tmp_path, handle, pool):
    with NVMeTier([str(tmp_path)], handle, pool, name="t") as t:
        yield t


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _read(tier: NVMeTier, key: int) -> torch.Tensor:
    out = torch.empty(tier.nbytes(key), dtype=torch.uint8)
    tier.read(key, out).wait()
    return out


def test_files_are_created_and_removed_on_close(tmp_path, handle, pool):
    t = NVMeTier([str(tmp_path)], handle, pool, name="life")
    assert sorted(os.listdir(tmp_path)) == [".life.lock", "life.swap"]
    t.put(_bytes(5000))
    t.close()
    t.close()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        t.allocate(10)


def test_freed_slots_are_reused_and_the_file_shrinks(tier):
    keys = [tier.put(_bytes(100_000, i)) for i in range(4)]
    size = tier.stats()["files"][0]["file_nbytes"]
    tier.free(keys[1])
    tier.free(keys[2])  # merges with the hole keys[1] left
    assert tier.stats()["files"][0]["holes"] == 1
    again = tier.put(_bytes(150_000, 9))  # fits the merged hole: the file does not grow
    assert tier.stats()["files"][0]["file_nbytes"] == size
    assert torch.equal(_read(tier, keys[0]), _bytes(100_000, 0))
    assert torch.equal(_read(tier, keys[3]), _bytes(100_000, 3))
    assert torch.equal(_read(tier, again), _bytes(150_000, 9))
    for key in (keys[0], keys[3], again):
        tier.free(key)
    stats = tier.stats()["files"][0]
    assert stats["file_nbytes"] == 4096 and stats["holes"] == 0
    assert os.path.getsize(stats["path"]) == 4096  # only the header is left on disk


def _disk_nbytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_freed_slot_inside_the_file_gives_its_blocks_back_and_reuse_reserves_them(tier):
    keys = [tier.put(_bytes(1 << 20, i)) for i in range(3)]
    path = tier.stats()["files"][0]["path"]
    before = _disk_nbytes(path)
    tier.free(keys[1])                                  # a hole in the middle: the file keeps its size
    assert os.path.getsize(path) == tier.stats()["files"][0]["file_nbytes"]
    if _disk_nbytes(path) == before:
        pytest.skip("this filesystem does not punch holes (fallocate PUNCH_HOLE)")
    assert _disk_nbytes(path) == before - (1 << 20)
    again = tier.put(_bytes(1 << 20, 7))                # reuses the hole and reserves it again
    assert _disk_nbytes(path) == before
    for key, seed in ((keys[0], 0), (again, 7), (keys[2], 2)):
        assert torch.equal(_read(tier, key), _bytes(1 << 20, seed))


def test_keys_stripe_over_directories(tmp_path, handle, pool):
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in dirs:
        d.mkdir()
    with NVMeTier([str(d) for d in dirs], handle, pool, name="s") as t:
        big = t.put(_bytes(10 * BUFFER + 123, 1))
        sizes = [f["file_nbytes"] - 4096 for f in t.stats()["files"]]
        assert all(s >= 3 * BUFFER for s in sizes), sizes  # every drive holds a share
        small = [t.put(_bytes(100, i)) for i in range(3)]  # small keys take turns
        assert [f["file_nbytes"] - 4096 for f in t.stats()["files"]] != sizes
        assert torch.equal(_read(t, big), _bytes(10 * BUFFER + 123, 1))
        for i, key in enumerate(small):
            assert torch.equal(_read(t, key), _bytes(100, i))


def test_unknown_and_unwritten_keys(tier):
    with pytest.raises(KeyError, match="t tier: unknown key 99 "):
        tier.free(99)
    key = tier.allocate(4096, tag="never.written")
    with pytest.raises(UnwrittenKeyError, match=r"key \d+ \(tag 'never.written'\) was allocated but never written"):
        tier.read(key, torch.empty(4096, dtype=torch.uint8))
    tier.free(key)
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        tier.write(tier.allocate(4), torch.zeros(4, dtype=torch.uint8, device="meta"))


def test_concurrent_reads_of_one_key_and_threads_putting(tier):
    data = _bytes(3 * BUFFER + 17, 4)
    key = tier.put(data)
    outs = [torch.empty_like(data) for _ in range(4)]
    futures = [tier.read(key, out) for out in outs]  # all in flight at once
    assert [f.wait() for f in futures] == [data.numel()] * 4
    assert all(torch.equal(out, data) for out in outs)

    errors = []

    def worker(seed: int) -> None:
        try:
            for i in range(5):
                src = _bytes(5000 + seed * 100 + i, seed * 10 + i)
                k = tier.put(src)
                assert torch.equal(_read(tier, k), src)
                tier.free(k)
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.bytes_in_use() == data.numel()


def test_free_during_a_read_defers_slot_reuse(tier, pool):
    data = _bytes(4 * BUFFER + 1, 5)
    key = tier.put(data)
    out = torch.empty_like(data)
    held = [pool.acquire("test holds every buffer") for _ in range(pool.count)]
    future = tier.read(key, out)  # staged: waits for a pool buffer, so it is surely in flight
    tier.free(key)
    size = tier.stats()["files"][0]["file_nbytes"]
    other_data = HostAllocator(pin="never").empty(4 * BUFFER + 4096)  # aligned: needs no pool buffer
    other = tier.put(other_data)
    assert tier.stats()["files"][0]["file_nbytes"] > size  # the busy slot was not handed out
    assert not future.done()
    for buf in held:
        buf.release()
    assert future.wait() == data.numel()
    assert torch.equal(out, data)
    assert torch.equal(_read(tier, other), other_data)
    with pytest.raises(KeyError):
        tier.read(key, out)
    tier.free(other)
    assert tier.stats()["files"][0]["file_nbytes"] == 4096  # the deferred slot came back after wait()


def test_second_tier_in_this_process_is_refused(tier, tmp_path, handle, pool):
    with pytest.raises(SwapDirectoryLockedError, match=rf"{tmp_path} is locked by this process \(pid {os.getpid()}"):
        NVMeTier([str(tmp_path)], handle, pool, name="t")
    with NVMeTier([str(tmp_path)], handle, pool, name="other-name") as t2:  # another name is another file
        assert t2.put(_bytes(10)) >= 1


_CHILD = textwrap.dedent("""
    import os, sys
    from tiers import BufferPool, NVMeTier, SwapDirectoryLockedError
    from tiers.aio import AioHandle, aligned_empty
    import torch
    path, mode = sys.argv[1], sys.argv[2]
    handle, pool = AioHandle(), BufferPool(1 << 16, 2)
    if mode == "lock":
        try:
            NVMeTier([path], handle, pool, name="t")
        except SwapDirectoryLockedError as exc:
            print("LOCKED:", exc)
    else:
        tier = NVMeTier([path], handle, pool, name="t")
        tier.put(torch.ones(10000, dtype=torch.uint8))
        print("PID", os.getpid(), flush=True)
        os._exit(0)  # a crash: no close, the swap file stays behind
""")


def _child(path: str, mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", _CHILD, path, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_second_process_gets_a_clear_error(tier, tmp_path):
    out = _child(str(tmp_path), "lock")
    assert f"LOCKED: nvme_path {tmp_path} is locked by another process (pid {os.getpid()} run {tier.run_id})" in out


def test_stale_file_of_a_crashed_run_is_removed_never_read(tmp_path, handle, pool):
    crashed_pid = _child(str(tmp_path), "crash").split()[1]
    assert os.path.getsize(tmp_path / "t.swap") > 4096
    with pytest.raises(StaleSwapFileError, match=rf"stale swap file {tmp_path}/t.swap .*pid {crashed_pid}"):
        NVMeTier([str(tmp_path)], handle, pool, name="t", stale="refuse")
    with pytest.warns(RuntimeWarning, match=rf"removed stale swap file .*pid {crashed_pid}"):
        t = NVMeTier([str(tmp_path)], handle, pool, name="t")
    with t:
        with pytest.raises(KeyError, match="unknown key 1 "):  # the crashed run's key 1 is not data here
            t.read(1, torch.empty(10000, dtype=torch.uint8))
        assert t.stats()["files"][0]["file_nbytes"] == 4096


def test_corrupted_stale_file_is_reported_as_such(tmp_path, handle, pool):
    (tmp_path / "t.swap").write_bytes(b"garbage" * 1000)
    with pytest.raises(StaleSwapFileError, match="not an infinity swap header"):
        NVMeTier([str(tmp_path)], handle, pool, name="t", stale="refuse")


def test_full_disk_fails_allocation_and_loses_nothing(tier, monkeypatch):
    kept = _bytes(50_000, 6)
    key = tier.put(kept, tag="kept")
    size = tier.stats()["files"][0]["file_nbytes"]

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(NVMeSpaceError, match=r"no space left on nvme_path .* for key tagged 'big' \(1.0 MiB\).*"
                       r"existing keys are intact"):
        tier.allocate(1 << 20, tag="big")
    assert tier.stats()["files"][0]["file_nbytes"] == size
    monkeypatch.undo()
    assert torch.equal(_read(tier, key), kept)
    assert torch.equal(_read(tier, tier.put(_bytes(1 << 20, 7))), _bytes(1 << 20, 7))


def test_striped_allocation_rolls_back_on_a_full_disk(tmp_path, handle, pool, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with NVMeTier([str(tmp_path / "a"), str(tmp_path / "b")], handle, pool, name="s") as t:
        real = os.posix_fallocate
        calls = []

        def second_fails(fd, offset, length):
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "full")
            return real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", second_fails)
        with pytest.raises(NVMeSpaceError):
            t.allocate(8 * BUFFER, tag="striped")
        assert [f["file_nbytes"] for f in t.stats()["files"]] == [4096, 4096]


def test_missing_directory_is_a_clear_error(tmp_path, handle, pool):
    with pytest.raises(SwapDirectoryError, match="nvme_path directory does not exist") as info:
        NVMeTier([str(tmp_path / "nope")], handle, pool)
    assert info.value.filename == str(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SwapDirectoryError, match="not a directory"):
        NVMeTier([str(tmp_path / "file")], handle, pool)


def test_removed_directory_loses_nothing(tmp_path, handle, pool):
    d = tmp_path / "swap"
    d.mkdir()
    t = NVMeTier([str(d)], handle, pool, name="r")
    data = _bytes(3 * BUFFER + 5, 8)
    key = t.put(data)
    shutil.rmtree(d)
    assert "was removed" in t.verify()[0]
    assert torch.equal(_read(t, key), data)  # the open descriptor still holds the bytes
    new = t.put(_bytes(777, 9))
    assert torch.equal(_read(t, new), _bytes(777, 9))
    t.close()


def test_truncated_swap_file_names_key_and_cause(tier):
    early = tier.put(_bytes(4096, 1), tag="early")
    late = tier.put(_bytes(5 * BUFFER, 2), tag="late")
    os.truncate(tier.stats()["files"][0]["path"], 3 * 4096)
    with pytest.raises(NVMeIOError, match=r"read of 327680 bytes at offset 0 of key \d+ \(tag 'late'.*truncated to 12288"):
        _read(tier, late)
    assert torch.equal(_read(tier, early), _bytes(4096, 1))  # keys before the cut are intact


def test_overwritten_header_is_detected(tier):
    with open(tier.stats()["files"][0]["path"], "r+b") as f:
        f.write(b"\xff" * 16)
    assert "header" in tier.verify()[0] and "corrupted" in tier.verify()[0]


def test_constructor_validation(tmp_path, handle, pool):
    with pytest.raises(ValueError, match="at least one directory"):
        NVMeTier([], handle, pool)
    with pytest.raises(ValueError, match="multiple of 4096"):
        NVMeTier([str(tmp_path)], handle, pool, stripe_nbytes=1000)
    with pytest.raises(ValueError, match="stale must be one of"):
        NVMeTier([str(tmp_path)], handle, pool, stale="keep")
    assert os.listdir(tmp_path) == []  # a failed construction leaves no lock behind


def test_small_key_skips_a_full_directory(tmp_path, handle, pool, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "free").mkdir()
    with NVMeTier([str(tmp_path / "full"), str(tmp_path / "free")], handle, pool, name="k") as t:
        full_fd = t.swap.files[0].file.fd
        real = os.posix_fallocate

        def first_is_full(fd, offset, length):
            if fd == full_fd:
                raise OSError(errno.ENOSPC, "full")
            return real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", first_is_full)
        keys = [t.put(_bytes(1000, i)) for i in range(3)]  # round robin would put one in "full"
        assert [f["file_nbytes"] for f in t.stats()["files"]] == [4096, 4096 + 3 * 4096]
        assert all(torch.equal(_read(t, k), _bytes(1000, i)) for i, k in enumerate(keys))
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, o, n: (_ for _ in ()).throw(OSError(errno.ENOSPC, "x")))
        with pytest.raises(NVMeSpaceError, match="no directory has room for a new key:") as info:
            t.allocate(10)
        assert f"nvme_path {tmp_path / 'full'} " in str(info.value) and f"nvme_path {tmp_path / 'free'} " in str(info.value)


def _overwrite(path: str, file_offset: int, data: bytes) -> None:
    """Write into a swap file behind the tier's back, through the page cache (another process would)."""
    with open(path, "r+b") as f:
        f.seek(file_offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_truncated_swap_file_fails_the_check_naming_the_file(tier):
    tier.put(_bytes(3 * BUFFER, 1), tag="a")
    tier.check()
    path = tier.stats()["files"][0]["path"]
    os.truncate(path, 8192)
    with pytest.raises(SwapFileDamagedError, match=rf"truncated under this run to 8192 bytes.*: '{path}'"):
        tier.check()


def test_overwritten_header_fails_the_check(tier):
    path = tier.stats()["files"][0]["path"]
    _overwrite(path, 0, b"\xff" * 16)
    with pytest.raises(SwapFileDamagedError, match="header of this run's swap file was overwritten"):
        tier.check()


def test_removed_swap_file_only_warns_once(tmp_path, handle, pool):
    d = tmp_path / "swap"
    d.mkdir()
    with NVMeTier([str(d)], handle, pool, name="w") as t:
        key = t.put(_bytes(5000, 3))
        os.unlink(t.stats()["files"][0]["path"])
        with pytest.warns(RuntimeWarning, match="was removed.*open descriptor"):
            t.check()
        t.check()                                  # once
        assert torch.equal(_read(t, key), _bytes(5000, 3))


@pytest.mark.parametrize("size", [1, 4095, 4097, 3 * BUFFER + 5])
def test_verify_catches_bytes_changed_on_disk_naming_key_file_and_offset(tmp_path, handle, pool, size):
    from tiers.checksums import BLOCK_NBYTES, SwapChecksumError

    with NVMeTier([str(tmp_path)], handle, pool, name="v", verify=True) as t:
        key = t.put(_bytes(size, 4), tag="victim")
        assert torch.equal(_read(t, key), _bytes(size, 4))          # no false alarm
        path = t.stats()["files"][0]["path"]
        where = min(size - 1, BLOCK_NBYTES + 7)
        _overwrite(path, 4096 + where, b"\x7f")                      # slots start after the 4 KiB header
        with pytest.raises(SwapChecksumError, match=rf"of key {key} \(tag 'victim'\), at offset \d+ of the swap "
                                                    rf"file, fail their CRC-32.*changed on disk.*: '{path}'"):
            _read(t, key)


def test_verify_skips_blocks_written_in_part_and_checks_them_once_rewritten_whole(tmp_path, handle, pool):
    from tiers.checksums import BLOCK_NBYTES, SwapChecksumError

    size = 2 * BLOCK_NBYTES + 100
    with NVMeTier([str(tmp_path)], handle, pool, name="p", verify=True) as t:
        key = t.put(_bytes(size, 5))
        t.write(key, _bytes(10, 6), offset=BLOCK_NBYTES + 3).wait()   # block 1 now written in part
        expected = _bytes(size, 5)
        expected[BLOCK_NBYTES + 3:BLOCK_NBYTES + 13] = _bytes(10, 6)
        assert torch.equal(_read(t, key), expected)
        path = t.stats()["files"][0]["path"]
        _overwrite(path, 4096 + BLOCK_NBYTES + 50, b"\x7f")           # block 1: unchecked, so unnoticed
        _read(t, key)
        half = torch.empty(BLOCK_NBYTES // 2, dtype=torch.uint8)
        t.read(key, half, offset=0).wait()                            # a read covering no block whole
        t.write(key, _bytes(size, 7)).wait()                          # whole again: checked again
        _overwrite(path, 4096 + BLOCK_NBYTES + 50, b"\x7f")
        with pytest.raises(SwapChecksumError, match=rf"bytes {BLOCK_NBYTES}\.\.{2 * BLOCK_NBYTES} of key"):
            _read(t, key)
        assert t.stats()["checksum_nbytes"] == 3 * 8


@pytest.mark.parametrize("engine", ["threads", "auto"])
def test_concurrent_writes_sharing_a_partial_block_both_land(tmp_path, engine):
    """Two writes in flight to one key that meet inside a 4096-byte block ([0, 3072) and [3072, 8192)): each
    is a read-modify-write of that block on its own worker thread, so unless the tier orders them the later
    one puts back the other's old bytes (a checkpoint loaded into a regrouped model lost parameters so)."""
    pool = BufferPool(BUFFER, 8, HostAllocator(pin="never"), name="edge-test")
    with AioHandle(block_size=1 << 20, engine=engine) as handle, \
            NVMeTier([str(tmp_path)], handle, pool, name="edges", workers=8) as tier:
        keys = [tier.allocate(8192) for _ in range(8)]
        lost = 0
        for trial in range(40):
            old, new = _bytes(8192, seed=2 * trial), _bytes(8192, seed=2 * trial + 1)
            for key in keys:
                tier.write(key, old).wait()
            futures = []
            for key in keys:
                futures.append(tier.write(key, new[:3072], 0))
                futures.append(tier.write(key, new[3072:], 3072))
            for fut in futures:
                fut.wait()
            lost += sum(not torch.equal(_read(tier, key), new) for key in keys)
        assert lost == 0, f"{lost} of {40 * len(keys)} keys lost one of two writes that share a block"


@pytest.mark.parametrize("staged", [False, True], ids=["aligned", "with-a-staged-edge"])
def test_a_run_that_cannot_start_ends_the_started_ones_first(tmp_path, handle, pool, staged):
    """A key striped over two drives is written as two runs; when the second cannot be submitted, the first
    is still in flight, and the error must not leave (letting a ``free`` hand the slot to another key)
    before it ends."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    events = []

    class Tracked:
        def __init__(self, inner):
            self.inner = inner

        def wait(self):
            out = self.inner.wait()
            events.append("first run ended")
            return out

        def done(self):
            return self.inner.done()

    class FailingSecond:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def pwrite(self, f, data, offset):
            self.calls += 1
            if self.calls == 2:
                events.append("second run refused")
                raise OSError(errno.EIO, "injected: submit refused")
            return Tracked(self.inner.pwrite(f, data, offset))

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with NVMeTier([str(d) for d in dirs], handle, pool, name="sub") as t:
        nbytes = 2 * BUFFER + (100 if staged else 0)
        key = t.allocate(nbytes)
        t.handle = FailingSecond(handle)
        data = aligned_empty(nbytes)        # aligned memory: the whole blocks go straight to the handle
        data.copy_(_bytes(nbytes))
        with pytest.raises(OSError, match="injected"):
            t.write(key, data).wait()
        assert events == ["second run refused", "first run ended"], events
        t.handle = handle
        t.free(key)


def test_a_reservation_that_fails_part_way_gives_back_what_it_took(tier, monkeypatch):
    """posix_fallocate can reserve some blocks before the disk runs out (ext4 does): they went to the swap
    file and stayed, and the error said "0 B free". Now the file is back to its size and blocks."""
    tier.put(_bytes(50_000, 6), tag="kept")
    path = tier.stats()["files"][0]["path"]
    before = os.stat(path)
    real = os.posix_fallocate

    def half_then_full(fd, offset, length):
        real(fd, offset, length // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", half_then_full)
    with pytest.raises(NVMeSpaceError, match="existing keys are intact"):
        tier.allocate(4 << 20, tag="big")
    after = os.stat(path)
    assert (after.st_size, after.st_blocks) == (before.st_size, before.st_blocks), (before, after)
