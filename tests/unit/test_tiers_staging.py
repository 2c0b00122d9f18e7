"""Staging: pieces through pool buffers, edge blocks kept, buffers returned even on errors."""
from __future__ import annotations

import pytest
import torch

from tiers import BufferPool, HostAllocator
from tiers.aio import AioHandle, open_file
from tiers.staging import Run, Staging, split_direct


@pytest.fixture
def setup(tmp_path):
    handle = AioHandle(block_size=1 << 16)
    pool = BufferPool(8192, 3, HostAllocator(pin="never"), name="stage")
    file = open_file(tmp_path / "data.bin", "rw", create=True)
    base = torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    aligned = HostAllocator(pin="never").empty(65536)
    aligned.copy_(base)
    handle.pwrite(file, aligned, 0).wait()
    yield handle, pool, file, base
    file.close()
    handle.close()


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("file_offset,nbytes", [(0, 1), (1, 4095), (4095, 2), (100, 30_000), (0, 65536)])
def test_write_keeps_surrounding_bytes_and_read_returns_them(setup, depth, file_offset, nbytes):
    handle, pool, file, base = setup
    staging = Staging(handle, pool, depth=depth)
    patch = torch.randint(0, 256, (nbytes + 3,), dtype=torch.uint8)[3:]  # deliberately unaligned memory
    assert staging.write([Run(file, file_offset, 0, nbytes)], patch, "test write") == nbytes
    expected = base.clone()
    expected[file_offset:file_offset + nbytes] = patch
    whole = torch.empty(65536, dtype=torch.uint8)
    assert staging.read([Run(file, 0, 0, 65536)], whole, "test read") == 65536
    assert torch.equal(whole, expected)
    assert pool.in_use() == 0 and pool.stats()["peak_in_use"] <= depth


def test_several_runs_into_one_memory(setup):
    handle, pool, file, base = setup
    out = torch.zeros(300, dtype=torch.uint8)
    runs = [Run(file, 50_000, 0, 100), Run(file, 7, 100, 200)]
    Staging(handle, pool).read(runs, out, "gather")
    assert torch.equal(out[:100], base[50_000:50_100]) and torch.equal(out[100:], base[7:207])


def test_split_direct_sends_aligned_blocks_straight():
    memory = HostAllocator(pin="never").empty(3 * 4096 + 10)
    run = Run(None, 8192, 0, 3 * 4096 + 10)
    direct, staged = split_direct([run], memory)
    assert direct == [Run(None, 8192, 0, 3 * 4096)]
    assert staged == [Run(None, 8192 + 3 * 4096, 3 * 4096, 10)]
    assert split_direct([run], memory[1:]) == ([], [run])
    assert split_direct([Run(None, 100, 0, 8192)], memory) == ([], [Run(None, 100, 0, 8192)])


def test_errors_return_every_buffer(setup, tmp_path):
    handle, pool, file, _ = setup
    short = open_file(tmp_path / "short.bin", "rw", create=True)  # empty: every read is short
    with pytest.raises(OSError, match="short read"):
        Staging(handle, pool).read([Run(short, 0, 0, 30_000)], torch.empty(30_000, dtype=torch.uint8), "x")
    assert pool.in_use() == 0
    short.close()
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Staging(handle, pool, depth=0)
