"""Swap files kept as a checkpoint: sealing, adopting, consuming ([Note: sealed swap files], tiers/swapfile.py)."""
from __future__ import annotations

import os

import pytest
import torch

from tiers import BufferPool, HostAllocator, NVMeTier, SwapDirectoryLockedError, UnwrittenKeyError
from tiers.aio import AioHandle
from tiers.freelist import FreeList
from tiers.nvme import SealedTierError
from tiers.swapfile import SwapFileDamagedError

BUFFER = 64 << 10


@pytest.fixture(scope="module")
def handle():
    with AioHandle(block_size=1 << 20) as h:
        yield h


@pytest.fixture(scope="module")
def pool():
    return BufferPool(BUFFER, 4, HostAllocator(pin="never"), name="sealed-test")


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _read(tier: NVMeTier, key: int) -> torch.Tensor:
    out = torch.empty(tier.nbytes(key), dtype=torch.uint8)
    tier.read(key, out).wait()
    return out


def _blocks(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _saved(dirs, handle, pool, sizes, label="ck1"):
    """A tier with one key per size, sealed as ``label``; a negative size is a key that is written but not
    part of the checkpoint (a gradient): the adopting run does not take it."""
    tier = NVMeTier(dirs, handle, pool, name="t")
    keys, data = [], {}
    for i, n in enumerate(sizes):
        key = tier.allocate(abs(n) or 1, tag=f"k{i}")
        value = _bytes(abs(n) or 1, seed=i)
        tier.write(key, value).wait()
        keys.append(key)
        if n > 0:
            data[i] = value
    placements = {i: tier.placement(keys[i]) for i in data}
    paths = tier.seal(label)
    return tier, data, placements, paths


def test_a_sealed_tier_keeps_its_file_refuses_writes_and_still_reads(tmp_path, handle, pool):
    tier, data, placements, paths = _saved([str(tmp_path)], handle, pool, [5000, 70000])
    assert paths == [str(tmp_path / "t.ck1.sealed")]
    assert not (tmp_path / "t.swap").exists()
    key = next(k for k, _ in tier._keys.items())
    with pytest.raises(SealedTierError, match="sealed as checkpoint 'ck1'"):
        tier.write(key, _bytes(5000, 9))
    with pytest.raises(SealedTierError, match="ck1"):
        tier.allocate(10, tag="new")
    assert torch.equal(_read(tier, key), data[0])
    tier.close()
    assert os.path.exists(paths[0])           # closing leaves the checkpoint
    assert not (tmp_path / ".t.lock").exists()


def test_an_adopting_tier_reads_the_sealed_bytes_and_places_new_keys_around_them(tmp_path, handle, pool):
    sizes = [5000, -300000, 70000, 9000]
    tier, data, placements, paths = _saved([str(tmp_path)], handle, pool, sizes)
    tier.close()
    before = _blocks(paths[0])
    with NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=paths) as new:
        keys = {i: new.allocate(n.numel(), tag=f"k{i}") for i, n in data.items()}
        with pytest.raises(UnwrittenKeyError, match="has not placed its keys"):
            _read(new, keys[0])
        new.settle({keys[i]: placements[i] for i in data})
        for i in data:
            assert new.placement(keys[i]) == placements[i]
            assert torch.equal(_read(new, keys[i]), data[i])
        # The key not taken over gave its blocks back to the filesystem, and a new key reuses its slot.
        assert _blocks(paths[0]) <= before - 290000
        grad = new.allocate(300000, tag="grad")
        assert new.placement(grad).offsets[0] == 4096 + 8192
        with pytest.raises(UnwrittenKeyError):
            _read(new, grad)                   # a new key is unwritten, as ever
        assert os.path.exists(paths[0]) and not (tmp_path / "t.swap").exists()
        new.write(grad, _bytes(300000, 5)).wait()      # the first write consumes the checkpoint
        assert not os.path.exists(paths[0]) and (tmp_path / "t.swap").exists()
        assert torch.equal(_read(new, keys[2]), data[2])
    assert not (tmp_path / "t.swap").exists()     # now an ordinary swap file, deleted at close


def test_a_run_that_adopts_and_stops_before_writing_leaves_the_checkpoint(tmp_path, handle, pool):
    tier, data, placements, paths = _saved([str(tmp_path)], handle, pool, [5000, 70000])
    tier.close()
    for _ in range(2):
        with NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=paths) as new:
            keys = {i: new.allocate(n.numel(), tag=f"k{i}") for i, n in data.items()}
            new.settle({keys[i]: placements[i] for i in data})
            assert torch.equal(_read(new, keys[1]), data[1])
        assert os.path.exists(paths[0])
    # An ordinary run on the same directory leaves the sealed file alone.
    with NVMeTier([str(tmp_path)], handle, pool, name="t") as other:
        other.write(other.allocate(4096, tag="x"), _bytes(4096, 1)).wait()
    assert os.path.exists(paths[0])


def test_striped_keys_over_two_directories_are_adopted(tmp_path, handle, pool):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in dirs:
        os.makedirs(d)
    tier, data, placements, paths = _saved(dirs, handle, pool, [3 * BUFFER + 100, 5000, 2 * BUFFER])
    assert len(paths) == 2 and len(placements[0].files) == 2
    tier.close()
    with NVMeTier(dirs, handle, pool, name="t", adopt=paths) as new:
        keys = {i: new.allocate(n.numel(), tag=f"k{i}") for i, n in data.items()}
        new.settle({keys[i]: placements[i] for i in data})
        for i in data:
            assert torch.equal(_read(new, keys[i]), data[i])


def test_adopting_refuses_what_does_not_match(tmp_path, handle, pool):
    tier, data, placements, paths = _saved([str(tmp_path)], handle, pool, [5000])
    with pytest.raises(SwapDirectoryLockedError):       # the sealing tier still holds the directory
        NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=paths)
    tier.close()
    with NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=paths) as new:
        key = new.allocate(6000, tag="k0")
        with pytest.raises(ValueError, match="holds 6000 bytes, and the checkpoint's slot for it 5000"):
            new.settle({key: placements[0]})
    with pytest.raises(FileNotFoundError, match="missing"):
        NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=[str(tmp_path / "t.other.sealed")])
    with open(paths[0], "r+b") as f:
        f.write(b"garbage")
    with pytest.raises(SwapFileDamagedError, match="not an infinity swap header"):
        NVMeTier([str(tmp_path)], handle, pool, name="t", adopt=paths)


def test_claim_takes_slots_and_returns_the_holes_between():
    fl = FreeList(start=4096)
    holes = fl.claim([(16384, 5000), (4096, 4096)])
    assert holes == [(8192, 8192)] and fl.end == 16384 + 8192
    assert fl.allocate(8192) == 8192
    with pytest.raises(ValueError, match="empty"):
        fl.claim([(65536, 1)])
    with pytest.raises(ValueError, match="overlaps"):
        FreeList(start=4096).claim([(4096, 8192), (8192, 10)])
