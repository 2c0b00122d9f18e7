"""Every tier returns every engine dtype bit-exact, at awkward sizes and offsets."""
from __future__ import annotations

import pytest
import torch

from tiers import BufferPool, DeviceTier, HostAllocator, HostTier, NVMeTier
from tiers.aio import AioHandle

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
# Element counts: 1 byte, 4095 / 4097 bytes for the 1-byte dtypes, odd counts for the rest,
# and one that spans many 64 KiB pool buffers (and several stripes).
NUMELS = [1, 3, 511, 4095, 4097, 65537, 300_001]
POOL_BUFFER = 64 << 10


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    element = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * element,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # every bit pattern, NaNs and denormals included


def _placed(tensor: torch.Tensor, aligned: bool, alloc: HostAllocator) -> torch.Tensor:
    """A copy of ``tensor`` whose memory starts 4096-aligned, or 1 byte past alignment."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = alloc.empty(nbytes + 4096)
    start = 0 if aligned else 1 if tensor.element_size() == 1 else tensor.element_size()
    out = raw[start:start + nbytes].view(tensor.dtype)
    out.copy_(tensor)
    return out


@pytest.fixture(scope="module")
def tiers_by_kind(tmp_path_factory):
    alloc = HostAllocator(pin="never")
    handle = AioHandle(block_size=1 << 20)
    pool = BufferPool(POOL_BUFFER, 4, alloc, name="roundtrip")
    one = tmp_path_factory.mktemp("nvme1")
    two = [tmp_path_factory.mktemp("nvme2a"), tmp_path_factory.mktemp("nvme2b")]
    made = {
        "device-cpu": DeviceTier("cpu"),
        "host": HostTier(alloc),
        "nvme": NVMeTier([str(one)], handle, pool, name="rt"),
        "nvme-striped": NVMeTier([str(p) for p in two], handle, pool, name="rt2", stripe_nbytes=POOL_BUFFER),
    }
    yield made, alloc
    made["nvme"].close()
    made["nvme-striped"].close()
    handle.close()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["device-cpu", "host", "nvme", "nvme-striped"])
def test_round_trip_bit_exact(tiers_by_kind, kind, dtype, aligned):
    made, alloc = tiers_by_kind
    tier = made[kind]
    gen = torch.Generator().manual_seed(hash((kind, str(dtype), aligned)) % 2**31)
    for numel in NUMELS:
        src = _placed(_random(numel, dtype, gen), aligned, alloc)
        key = tier.put(src, tag=f"{dtype}x{numel}")
        assert tier.nbytes(key) == numel * src.element_size()
        dst = _placed(torch.zeros(numel, dtype=dtype), aligned, alloc)
        assert tier.read(key, dst).wait() == numel * src.element_size()
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), f"{kind} {dtype} numel={numel}"
        tier.free(key)
    assert tier.bytes_in_use() == 0


@pytest.mark.parametrize("kind", ["device-cpu", "host", "nvme", "nvme-striped"])
def test_partial_reads_and_writes_at_odd_offsets(tiers_by_kind, kind):
    made, _alloc = tiers_by_kind
    tier = made[kind]
    gen = torch.Generator().manual_seed(7)
    nbytes = 3 * POOL_BUFFER + 4097
    expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    key = tier.put(expected.clone(), tag="partial")
    # Overwrites that start and end mid-block, cross a pool buffer and a stripe boundary.
    for offset, length in [(1, 1), (4095, 2), (POOL_BUFFER - 3, 4099), (5000, 2 * POOL_BUFFER + 1),
                           (nbytes - 1, 1), (0, nbytes)]:
        patch = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen)
        tier.write(key, patch, offset).wait()
        expected[offset:offset + length] = patch
        got = torch.empty(length, dtype=torch.uint8)
        tier.read(key, got, offset).wait()
        assert torch.equal(got, patch), f"{kind}: read back at offset {offset}"
    whole = torch.empty(nbytes, dtype=torch.uint8)
    tier.read(key, whole).wait()
    assert torch.equal(whole, expected), f"{kind}: bytes around the partial writes were not kept"
    tier.free(key)


@pytest.mark.parametrize("kind", ["device-cpu", "host", "nvme"])
def test_zero_byte_key(tiers_by_kind, kind):
    tier = tiers_by_kind[0][kind]
    key = tier.put(torch.empty(0, dtype=torch.float32))
    assert tier.nbytes(key) == 0
    assert tier.read(key, torch.empty(0)).wait() == 0
    tier.free(key)


@pytest.mark.parametrize("kind", ["device-cpu", "host", "nvme"])
def test_multidimensional_and_scalar_tensors(tiers_by_kind, kind):
    tier = tiers_by_kind[0][kind]
    for src in (torch.arange(24, dtype=torch.float16).reshape(2, 3, 4), torch.tensor(3.5)):
        key = tier.put(src)
        out = torch.empty_like(src)
        tier.read(key, out).wait()
        assert torch.equal(out, src)
        tier.free(key)


@pytest.mark.parametrize("kind", ["device-cpu", "host", "nvme"])
def test_bad_inputs_name_the_key(tiers_by_kind, kind):
    tier = tiers_by_kind[0][kind]
    key = tier.put(torch.arange(10, dtype=torch.int64), tag="weights.7")
    with pytest.raises(ValueError, match=rf"key {key} \(tag 'weights.7'\), which holds 80 bytes"):
        tier.read(key, torch.empty(11, dtype=torch.int64))
    with pytest.raises(ValueError, match="offset 79"):
        tier.write(key, torch.zeros(2, dtype=torch.uint8), 79)
    with pytest.raises(ValueError, match="must be contiguous"):
        tier.write(key, torch.zeros(4, 4)[:, 1])
    with pytest.raises(ValueError, match="nbytes .* must be an int >= 0"):
        tier.allocate(-1, "neg")
    tier.free(key)
    with pytest.raises(KeyError, match=rf"unknown key {key}"):
        tier.free(key)
    with pytest.raises(KeyError, match="unknown key 123456"):
        tier.read(123456, torch.empty(1))
    with pytest.raises(KeyError, match="unknown key 123456"):
        tier.nbytes(123456)


def test_views_alias_stored_bytes(tiers_by_kind):
    made, _ = tiers_by_kind
    for kind in ("host", "device-cpu"):
        tier = made[kind]
        key = tier.put(torch.zeros(8, dtype=torch.uint8))
        view = tier.view(key)
        view[3] = 42  # writing through the view changes the stored bytes: no copy
        out = torch.empty(8, dtype=torch.uint8)
        tier.read(key, out).wait()
        assert out[3].item() == 42 and view.data_ptr() == tier.view(key).data_ptr()
        tier.free(key)


def test_host_view_is_page_aligned(tiers_by_kind):
    tier = tiers_by_kind[0]["host"]
    key = tier.allocate(4097)
    assert tier.view(key).data_ptr() % 4096 == 0
    tier.free(key)


def test_telemetry_counts_bytes_and_peak(tiers_by_kind):
    for kind, tier in tiers_by_kind[0].items():
        before = tier.stats()
        a = tier.put(torch.zeros(1000, dtype=torch.uint8))
        b = tier.put(torch.zeros(3000, dtype=torch.uint8))
        tier.read(a, torch.empty(1000, dtype=torch.uint8)).wait()
        mid = tier.stats()
        tier.free(a)
        tier.free(b)
        after = tier.stats()
        assert mid["bytes_written"] - before["bytes_written"] == 4000, kind
        assert mid["bytes_read"] - before["bytes_read"] == 1000, kind
        assert mid["bytes_in_use"] == before["bytes_in_use"] + 4000, kind
        assert mid["peak_bytes"] >= before["bytes_in_use"] + 4000, kind
        assert after["bytes_in_use"] == before["bytes_in_use"], kind
        assert mid["tier"] in ("device", "host", "nvme"), kind
        if mid["tier"] == "nvme":   # waiting on a file read is counted; a memcpy tier may finish first
            assert mid["wait_seconds"] > before["wait_seconds"], kind
        assert after["wait_seconds"] >= mid["wait_seconds"], kind
