"""HostAllocator: aligned zero-copy tensors, pinning (GPU), NUMA binding (libnuma)."""
from __future__ import annotations

import gc

import pytest
import torch

from tiers import HostAllocator, HostAllocatorError
from tiers.host_alloc import _libnuma

HAS_CUDA = torch.cuda.is_available()
HAS_NUMA = _libnuma() is not None


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 1 << 20])
def test_aligned_zeroed_tensors(nbytes):
    t = HostAllocator(pin="never").empty(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.device.type == "cpu"
    assert t.data_ptr() % 4096 == 0 and int(t.sum()) == 0


def test_larger_alignment_and_views_share_memory():
    alloc = HostAllocator(pin="never")
    t = alloc.empty(10_000, alignment=1 << 21)
    assert t.data_ptr() % (1 << 21) == 0
    as_float = t[:8].view(torch.float32)
    as_float[0] = 1.0  # the float view aliases the same bytes: no copy anywhere
    assert t[:4].tolist() == [0, 0, 128, 63]


def test_memory_is_returned_when_the_last_view_dies():
    alloc = HostAllocator(pin="never")
    t = alloc.empty(3 << 20)
    view = t[100:200]
    del t
    gc.collect()
    assert alloc.stats()["bytes_allocated"] == 3 << 20  # the view keeps it alive
    view.fill_(7)
    del view
    gc.collect()
    stats = alloc.stats()
    assert stats["bytes_allocated"] == 0 and stats["allocations"] == 0 and stats["peak_bytes"] == 3 << 20


def test_zero_bytes_and_bad_arguments():
    alloc = HostAllocator(pin="never")
    assert alloc.empty(0).numel() == 0
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        alloc.empty(-1)
    with pytest.raises(ValueError, match="power of two"):
        alloc.empty(10, alignment=3000)
    with pytest.raises(ValueError, match="pin must be one of"):
        HostAllocator(pin="sometimes")
    with pytest.raises(ValueError, match="numa_node must be"):
        HostAllocator(numa_node=-5)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_without_cuda_auto_does_not_pin_and_always_refuses():
    assert HostAllocator(pin="auto").pinned is False
    with pytest.raises(HostAllocatorError, match="pin='always' needs CUDA"):
        HostAllocator(pin="always")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="pinning (cudaHostRegister) needs a CUDA device")
def test_pinned_memory_is_registered_and_released():
    alloc = HostAllocator(pin="always")
    t = alloc.empty(1 << 20)
    assert alloc.pinned and t.is_pinned() and alloc.stats()["pinned_bytes"] == 1 << 20
    gpu = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
    t.view(torch.float32).copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t.view(torch.float32), gpu.cpu())
    del t
    gc.collect()
    assert alloc.stats()["pinned_bytes"] == 0


def _policy_of(address: int) -> str:
    """The memory policy of the mapping holding ``address``. An unbound anonymous mapping
    may merge with a neighbour, so its numa_maps entry can start below the address: take
    the last entry that starts at or below it (the kernel lists them in address order)."""
    policy = None
    with open("/proc/self/numa_maps") as maps:
        for line in maps:
            start, mode = line.split()[:2]
            if int(start, 16) > address:
                break
            policy = mode
    if policy is None:
        raise AssertionError(f"no numa_maps entry holds {address:#x}")
    return policy


@pytest.mark.skipif(not HAS_NUMA, reason="libnuma is not installed or the kernel has no NUMA support")
def test_numa_binding_shows_in_numa_maps():
    alloc = HostAllocator(pin="never", numa_node=0)
    assert alloc.numa.node == 0
    t = alloc.empty(1 << 20)
    t.fill_(1)
    assert _policy_of(t.data_ptr()) == "bind:0"
    unbound = HostAllocator(pin="never").empty(1 << 20)
    assert _policy_of(unbound.data_ptr()) == "default"


@pytest.mark.skipif(not HAS_NUMA, reason="libnuma is not installed or the kernel has no NUMA support")
def test_numa_node_that_does_not_exist():
    with pytest.raises(HostAllocatorError, match="numa_node=4096 does not exist"):
        HostAllocator(numa_node=4096)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU fallback of numa_node=-1")
def test_gpu_node_without_gpu_is_not_bound():
    alloc = HostAllocator(numa_node=-1)
    assert alloc.numa.node is None and "no GPU" in alloc.numa.reason


def _smaps_field(address: int, field: str) -> int:
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not line.startswith(field):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith(field):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {_thp_mode()}")
def test_large_allocations_get_huge_pages():
    alloc = HostAllocator(pin="never")
    big = alloc.empty((8 << 20) + 5)
    big.fill_(1)
    assert big.data_ptr() % (2 << 20) == 0
    assert _smaps_field(big.data_ptr(), "AnonHugePages:") >= 4 << 10  # kB; the kernel may split some
    small = HostAllocator(pin="never", huge_pages=False).empty(8 << 20)
    small.fill_(1)
    assert _smaps_field(small.data_ptr(), "AnonHugePages:") == 0 or _thp_mode() == "always"


def test_a_region_leaves_the_books_before_its_address_can_be_mapped_again():
    """Another thread may map a new region at the address a dying region just unmapped; the dying one's
    release must not remove the newcomer's entry (seen in CI as a KeyError in ``_Region.__del__``)."""
    from tiers.host_alloc import _Accounting, _Region

    books = _Accounting()
    address, nbytes = 1 << 30, 1 << 20

    class ReusingLibc:
        def munmap(self, at, length):       # the kernel hands the address to another thread's mmap
            books.take(at, nbytes, pinned=False)

    books.take(address, nbytes, pinned=False)
    dying = _Region(address, nbytes, address, nbytes, ReusingLibc(), None, books)
    del dying
    gc.collect()
    assert books.allocations == 1 and books.contains(address, nbytes)
    books.release(address, nbytes, pinned=False)        # the newcomer's own release finds its entry
    assert books.allocations == 0 and not books.contains(address, 1)


def test_staggered_large_tensors_start_apart_and_are_booked_as_their_bytes():
    from tiers.host_alloc import STAGGER_BYTES, STAGGER_MIN_BYTES
    alloc = HostAllocator(pin="never")
    nbytes = STAGGER_MIN_BYTES + 4096
    arrays = [alloc.empty(nbytes, stagger=k) for k in range(4)]
    starts = {t.data_ptr() % (2 << 20) for t in arrays}
    assert starts == {k * STAGGER_BYTES % (2 << 20) for k in range(4)}, "four different starts modulo 2 MiB"
    assert all(t.data_ptr() % 4096 == 0 and t.numel() == nbytes for t in arrays)
    for k, t in enumerate(arrays):
        t.fill_(k + 1)                       # every byte writable, none shared
    assert [int(t[0]) + int(t[-1]) for t in arrays] == [2, 4, 6, 8]
    stats = alloc.stats()
    assert stats["bytes_allocated"] == 4 * nbytes and stats["allocations"] == 4
    assert all(alloc.owns(t) for t in arrays) and alloc.owns(arrays[2][-100:])
    small = alloc.empty(STAGGER_MIN_BYTES - 4096, stagger=3)
    assert small.data_ptr() % (2 << 20) == 0, "small tensors are not staggered"
    del arrays, small, t
    gc.collect()
    assert alloc.stats()["bytes_allocated"] == 0 and alloc.stats()["allocations"] == 0
    with pytest.raises(ValueError, match="stagger must be an int in"):
        alloc.empty(10, stagger=-1)
