"""DeviceTier and HostTier specifics: capacity limits, CUDA side-stream copies (GPU only)."""
from __future__ import annotations

import pytest
import torch

from tiers import DeviceTier, HostAllocator, HostTier, TierFullError

HAS_CUDA = torch.cuda.is_available()


def test_capacity_is_enforced_with_numbers():
    tier = DeviceTier("cpu", capacity=10_000, name="dev")
    key = tier.allocate(6000, "a")
    with pytest.raises(TierFullError, match=r"dev tier: allocating 5.9 KiB for 'b' would hold 11.7 KiB > capacity 9.8 KiB"):
        tier.allocate(6000, "b")
    tier.free(key)
    tier.allocate(6000, "b")
    host = HostTier(HostAllocator(pin="never"), capacity=1 << 20)
    with pytest.raises(TierFullError, match="host budget 1.0 MiB"):
        host.allocate(2 << 20, "big")
    assert host.capacity() == 1 << 20 and host.bytes_in_use() == 0
    assert DeviceTier("cpu").capacity() is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA side-stream copies need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_cuda_device_tier_round_trip(dtype):
    tier = DeviceTier("cuda")
    alloc = HostAllocator(pin="auto")
    for numel in (1, 4095, 4097, 300_001):
        raw = alloc.empty(numel * torch.empty(0, dtype=dtype).element_size())
        raw.copy_(torch.randint(0, 2 if dtype == torch.bool else 256, (raw.numel(),), dtype=torch.uint8))
        src = raw.view(dtype)
        key = tier.put(src)
        out = alloc.empty(raw.numel()).view(dtype)
        future = tier.read(key, out)
        future.wait()
        assert torch.equal(out.view(torch.uint8), raw)
        gpu_out = torch.empty(numel, dtype=dtype, device="cuda")
        tier.read(key, gpu_out).wait_on()  # stream-ordered: no host sync needed
        assert torch.equal(gpu_out.cpu().view(torch.uint8), raw)
        assert tier.view(key).device.type == "cuda"
        tier.free(key)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA side-stream copies need a CUDA device")
def test_cuda_copy_waits_for_the_producer_stream():
    tier = DeviceTier("cuda")
    key = tier.allocate(4 << 20)
    src = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    src.fill_(3.0)  # enqueued on the current stream; the copy stream must wait for it
    tier.write(key, src).wait()
    out = torch.empty(1 << 20, dtype=torch.float32)
    tier.read(key, out).wait()
    assert bool((out == 3.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="host-to-device copies from pinned memory need a CUDA device")
def test_host_tier_reads_into_a_gpu_tensor():
    tier = HostTier(HostAllocator(pin="auto"))
    src = torch.arange(1000, dtype=torch.float32)
    key = tier.put(src)
    gpu = torch.empty(1000, dtype=torch.float32, device="cuda")
    tier.read(key, gpu).wait()
    assert torch.equal(gpu.cpu(), src)


def test_large_cpu_keys_streamed_together_start_apart():
    from tiers.host_alloc import STAGGER_BYTES, STAGGER_MIN_BYTES
    tier = DeviceTier("cpu")
    keys = [tier.allocate(STAGGER_MIN_BYTES, f"state{k}", stagger=k) for k in range(3)]
    views = [tier.view(key) for key in keys]
    assert [v.data_ptr() % (2 << 20) for v in views] == [k * STAGGER_BYTES for k in range(3)]
    for k, key in enumerate(keys):
        tier.write(key, torch.full((STAGGER_MIN_BYTES,), k + 1, dtype=torch.uint8)).wait()
    assert [int(v[0]) + int(v[-1]) for v in views] == [2, 4, 6]
    assert tier.bytes_in_use() == 3 * STAGGER_MIN_BYTES
