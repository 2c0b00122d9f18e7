"""The one host allocator: page-aligned, optionally pinned and NUMA-bound memory as torch tensors.

[Note: why mmap and not torch.empty]
``O_DIRECT`` needs buffers aligned to the logical block size (4096 here), torch's CPU
allocator aligns to 64 bytes. An anonymous ``mmap`` is page-aligned by definition, is
zero-filled lazily (so ``mbind`` can place the pages before the first touch), and we
control the order of teardown: ``cudaHostUnregister`` must run before ``munmap``,
which a Python ``mmap.mmap`` object does not allow (it unmaps before its weak
references are told). The tensor is made with ``torch.frombuffer`` over a ctypes
array that keeps the mapping alive, so there is no copy and the memory goes back to
the kernel when the last tensor viewing it dies.

[Note: huge pages]
With THP in "madvise" mode (the common default) anonymous memory gets 4 KiB pages
unless asked. Large buffers ask: measured here on 1 GiB, memmove went from 7.0 to
9.4 GB/s, and O_DIRECT reads into the buffer from 2.9 to 3.4 GB/s (the kernel pins
the buffer's pages for every request; fewer, larger pages are cheaper to pin).

[Note: staggered starts]
Huge-page-aligned arrays all start at the same address modulo 2 MiB, and equal-sized ones that
are mapped one after the other often modulo far more. A kernel that streams several of them
element by element (Adam reads master, gradient, m and v at the same index) then hits the
same cache sets and DRAM banks with every stream at once: torch's fused AdamW over four 128 MiB
arrays, 2 threads, ran at 1.00 G params/s with 2 MiB-aligned arrays and 1.95 with their starts
132 KiB apart (measured here, 2026-11-27). So ``empty(nbytes, stagger=k)`` starts the tensor
``k * STAGGER_BYTES`` into its mapping when it is large (``STAGGER_MIN_BYTES``); the caller that
knows which arrays are streamed together gives each a different ``k``. The skipped bytes are
never touched, so they hold no memory beyond the huge page the tensor's start shares with them,
and the books count only the tensor's bytes.

[Note: pinning cost]
Registering (pinning) or ``mbind``-ing memory faults in and locks every page: about
0.35 s per GiB on these machines. Allocate buffers once (pools, flat sub-group
buffers) and reuse them; never allocate pinned memory on the hot path.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import threading
import warnings
from dataclasses import dataclass

import torch

ALIGNMENT = 4096
_PAGE = os.sysconf("SC_PAGE_SIZE")
_HUGE_PAGE = 2 << 20
STAGGER_BYTES = 33 * 4096            # see [Note: staggered starts]
STAGGER_MIN_BYTES = 16 << 20
_MADV_HUGEPAGE = 14
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_MPOL_BIND = 2
_PIN_CHOICES = ("auto", "always", "never")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None     # not glibc, or a glibc older than 2.33: nothing to give back this way


_LIBC = _glibc()


def trim_c_heap(min_free: int = 0) -> bool:
    """Give the C heap's free pages back to the system when more than ``min_free`` bytes are free.

    [Note: the C heap]
    Memory torch allocates for ordinary tensors comes from the C library's heap, which keeps
    a freed block for reuse; a block whose neighbours are still live cannot be handed back,
    and when small allocations land in it, it cannot even be reused for a block of its
    old size. Building a model frees one module-sized tensor per module (the engine keeps
    its shards elsewhere), and with the CPU as the compute device every step frees its
    gradients and activations: the resident set then grows by about a module per module,
    up to the model's size, though none of it is in use. ``malloc_trim(0)`` returns the
    free pages of those blocks (their address space stays reserved) without changing how
    anything is allocated afterwards: no process-wide setting is touched. The engine calls
    it after partitioning each module, and with the CPU as compute device at the end of a
    backward when the heap holds more than a few hundred MiB free; its own buffers never
    come from this heap (tiers/arena.py, tiers/pool.py). Returns whether it trimmed.
    """
    free = c_heap_free()
    if free is None or (min_free and free <= min_free):
        return False
    _LIBC.malloc_trim(0)
    return True


def c_heap_free() -> int | None:
    """The C heap's free bytes (glibc's ``mallinfo2().fordblks``), or None where it cannot say."""
    return None if _LIBC is None else _LIBC.mallinfo2().fordblks


class HeapTrimmer:
    """``trim_c_heap`` at the end of each step, when the heap's free bytes are above ``slack`` and have grown by
    more than a quarter since the last trim.

    [Note: trimming once per growth]
    A step on a CPU compute device frees what it allocated (activations, gradients, widened weights) and the
    next step allocates as much again. Trimmed at every step's end, those pages went back to the system and
    were faulted in again, zeroed, by the next step: with 6 models in one process (benchmarks/plan_vs_measured.py)
    the heap held more than the slack free after every backward, 133 trims in 216 steps, and the in-memory
    presets ran 24-44% slower at 8-16M parameters than with none (2-core VM). What the trim is for is growth
    (the heap's free blocks multiplying as small allocations split them, [Note: the C heap]): a heap whose
    free bytes only return to where the last trim found them is the next step's memory, kept as plain torch
    keeps it.
    """

    def __init__(self, slack: int) -> None:
        self.slack = slack
        self.trimmed_at = 0     # the free bytes the last trim found

    def end_of_step(self) -> bool:
        """Trim if the heap has grown (see the class docstring); returns whether it trimmed."""
        free = c_heap_free()
        if free is None or not trim_c_heap(max(self.slack, self.trimmed_at * 5 // 4)):
            return False
        self.trimmed_at = free
        return True


class HostAllocatorError(RuntimeError):
    """The allocator cannot honour its settings (pinning without CUDA, a missing NUMA node, ...)."""


@dataclass(frozen=True)
class NumaPlacement:
    """Where an allocator puts its pages.

    node : int | None
        The NUMA node allocations are bound to, or None when they are not bound.
    reason : str
        Why they are (or are not) bound, for reports.
    """

    node: int | None
    reason: str


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _libnuma() -> ctypes.CDLL | None:
    """libnuma when installed and the kernel supports NUMA policy, else None."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if lib.numa_available() < 0:
        return None
    lib.mbind.restype = ctypes.c_long
    lib.mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                          ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong, ctypes.c_uint]
    return lib


def _gpu_numa_node() -> int | None:
    """The NUMA node of the current CUDA device's PCI slot, or None when unknown."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus_id = (f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
              f"{props.pci_device_id:02x}.0")
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as handle:
            node = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class _Region:
    """One mapping; unregisters and unmaps itself when the last tensor on it dies."""

    __slots__ = ("address", "length", "start", "nbytes", "_libc", "_cudart", "_on_release")

    def __init__(self, address: int, length: int, start: int, nbytes: int, libc: ctypes.CDLL,
                 cudart: object | None, on_release: "_Accounting") -> None:
        # The mapping is [address, address + length); the tensor's nbytes start at ``start``.
        self.address, self.length, self.start, self.nbytes = address, length, start, nbytes
        self._libc, self._cudart, self._on_release = libc, cudart, on_release

    def __del__(self) -> None:
        # Out of the books before the kernel can hand the address out again: another thread's
        # mapping made between munmap and this release would be booked at the same address, and
        # this release would then remove its entry (a KeyError at its own release).
        self._on_release.release(self.start, self.nbytes, pinned=self._cudart is not None)
        if self._cudart is not None:
            self._cudart.cudaHostUnregister(self.address)
        self._libc.munmap(self.address, self.length)


class _Accounting:
    """Live / peak bytes of one allocator, and where its live regions are; shared with its regions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.allocations = 0
        self.bytes_allocated = 0
        self.peak_bytes = 0
        self.pinned_bytes = 0
        self._starts: list[int] = []          # sorted start addresses of the live regions
        self._ends: dict[int, int] = {}

    def take(self, address: int, nbytes: int, pinned: bool) -> None:
        with self._lock:
            self.allocations += 1
            self.bytes_allocated += nbytes
            self.pinned_bytes += nbytes if pinned else 0
            self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)
            bisect.insort(self._starts, address)
            self._ends[address] = address + nbytes

    def release(self, address: int, nbytes: int, pinned: bool) -> None:
        with self._lock:
            self.allocations -= 1
            self.bytes_allocated -= nbytes
            self.pinned_bytes -= nbytes if pinned else 0
            del self._starts[bisect.bisect_left(self._starts, address)]
            del self._ends[address]

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one live region."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            return i >= 0 and address + nbytes <= self._ends[self._starts[i]]


class HostAllocator:
    """Page-aligned host memory as ``uint8`` tensors, pinned and NUMA-bound when asked.

    Parameters
    ----------
    pin : {"auto", "always", "never"}
        ``auto`` pins (``cudaHostRegister``) when CUDA is available; ``always`` raises
        :class:`HostAllocatorError` without CUDA; ``never`` leaves memory pageable.
    numa_node : int | None
        Bind pages to this node (``mbind(MPOL_BIND)`` through libnuma). ``-1`` means the
        current GPU's node; ``None`` leaves placement to the kernel. Without libnuma (or
        without a GPU for ``-1``) memory is not bound and :attr:`numa` says why.
    huge_pages : bool
        Ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``, 2 MiB-aligned) for
        allocations of 2 MiB and more; see [Note: huge pages].

    Examples
    --------
    >>> alloc = HostAllocator(pin="never")
    >>> buf = alloc.empty(10_000)
    >>> buf.dtype, buf.numel(), buf.data_ptr() % 4096
    (torch.uint8, 10000, 0)
    """

    def __init__(self, pin: str = "auto", numa_node: int | None = None, huge_pages: bool = True) -> None:
        if pin not in _PIN_CHOICES:
            raise ValueError(f"pin must be one of {_PIN_CHOICES}, got {pin!r}")
        if pin == "always" and not torch.cuda.is_available():
            raise HostAllocatorError(
                "pin='always' needs CUDA to register host memory, but torch.cuda.is_available() "
                "is False; use pin='auto' or 'never' on a machine without a GPU"
            )
        self.pin = pin
        self.huge_pages = huge_pages
        self._cudart = torch.cuda.cudart() if pin != "never" and torch.cuda.is_available() else None
        # Registration happens in the context of the thread's current device; a buffer made later on a worker
        # thread (whose current device is 0) must still go to this rank's GPU.
        self._device = torch.cuda.current_device() if self._cudart is not None else None
        self._libc = _libc()
        self._numa_lib: ctypes.CDLL | None = None
        self.numa = self._place(numa_node)
        self._accounting = _Accounting()

    @property
    def pinned(self) -> bool:
        """Whether allocations are registered with CUDA (page-locked)."""
        return self._cudart is not None

    def _place(self, numa_node: int | None) -> NumaPlacement:
        if numa_node is None:
            return NumaPlacement(None, "not requested")
        if not isinstance(numa_node, int) or numa_node < -1:
            raise ValueError(f"numa_node must be None, -1 (GPU's node) or a node id >= 0, got {numa_node!r}")
        lib = _libnuma()
        if lib is None:
            reason = f"numa_node={numa_node} asked but libnuma is missing or NUMA is unavailable"
            warnings.warn(f"HostAllocator: {reason}; memory is not bound", RuntimeWarning, stacklevel=3)
            return NumaPlacement(None, reason)
        if numa_node == -1:
            node = _gpu_numa_node()
            if node is None:
                return NumaPlacement(None, "numa_node=-1 (GPU's node) but no GPU or no node affinity")
            numa_node = node
        max_node = lib.numa_max_node()
        if numa_node > max_node:
            raise HostAllocatorError(f"numa_node={numa_node} does not exist: this machine has nodes 0..{max_node}")
        self._numa_lib = lib
        return NumaPlacement(numa_node, "bound with mbind(MPOL_BIND) via libnuma")

    def empty(self, nbytes: int, alignment: int = ALIGNMENT, stagger: int = 0) -> torch.Tensor:
        """A new ``uint8`` tensor of ``nbytes`` whose first byte is ``alignment``-aligned.

        The content is zero (fresh anonymous pages). The memory is freed when the last
        tensor viewing it is garbage. ``nbytes == 0`` gives an empty tensor. ``stagger``: a
        large tensor starts ``stagger * STAGGER_BYTES`` into its mapping (see [Note: staggered
        starts]; ``alignment`` up to a page).
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if not isinstance(stagger, int) or not 0 <= stagger <= 64:
            raise ValueError(f"stagger must be an int in [0, 64], got {stagger!r}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        skip = stagger * STAGGER_BYTES if nbytes >= STAGGER_MIN_BYTES and alignment <= _PAGE else 0
        huge = self.huge_pages and nbytes >= _HUGE_PAGE
        align = max(alignment, _HUGE_PAGE if huge else _PAGE)
        # Page-rounded, not huge-page-rounded: THP covers the whole 2 MiB stretches and
        # the tail keeps 4 KiB pages, so an odd size never costs a spare 2 MiB of RAM.
        length = -(-(skip + nbytes) // _PAGE) * _PAGE
        address = self._map_aligned(length, align)
        try:
            if huge:
                # Best effort: with THP off ("never") madvise fails and 4 KiB pages serve.
                self._libc.madvise(address, length, _MADV_HUGEPAGE)
            self._bind(address, length)
            self._register(address, length)
        except BaseException:
            self._libc.munmap(address, length)
            raise
        region = _Region(address, length, address + skip, nbytes, self._libc, self._cudart, self._accounting)
        self._accounting.take(address + skip, nbytes, pinned=self._cudart is not None)
        array = (ctypes.c_uint8 * nbytes).from_address(address + skip)
        # The ctypes array keeps the region alive; torch.frombuffer keeps the array alive.
        array.region = region  # type: ignore[attr-defined]
        return torch.frombuffer(array, dtype=torch.uint8)

    def _map_aligned(self, length: int, align: int) -> int:
        """``mmap`` ``length`` bytes starting at a multiple of ``align``; the excess is unmapped."""
        slack = align - _PAGE if align > _PAGE else 0
        base = self._libc.mmap(None, length + slack, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
        if base is None or base == _MAP_FAILED:
            err = ctypes.get_errno()
            raise MemoryError(f"HostAllocator: mmap of {length + slack} bytes failed: {os.strerror(err)}")
        address = -(-base // align) * align
        if address > base:
            self._libc.munmap(base, address - base)
        tail = base + length + slack - (address + length)
        if tail:
            self._libc.munmap(address + length, tail)
        return address

    def _bind(self, base: int, length: int) -> None:
        if self._numa_lib is None or self.numa.node is None:
            return
        words = self.numa.node // 64 + 1
        mask = (ctypes.c_ulong * words)()
        mask[self.numa.node // 64] = 1 << (self.numa.node % 64)
        # maxnode counts bits; the kernel reads maxnode - 1 of them, hence the + 1.
        if self._numa_lib.mbind(base, length, _MPOL_BIND, mask, words * 64 + 1, 0) != 0:
            err = ctypes.get_errno()
            raise HostAllocatorError(
                f"mbind of {length} bytes to NUMA node {self.numa.node} failed: {os.strerror(err)}"
            )

    def _register(self, base: int, length: int) -> None:
        if self._cudart is None:
            return
        with torch.cuda.device(self._device):
            status = self._cudart.cudaHostRegister(base, length, 0)
        if int(status) != 0:
            raise HostAllocatorError(
                f"cudaHostRegister of {length} bytes failed with CUDA error {int(status)}; "
                "use pin_memory='never' if the system cannot lock this much memory"
            )

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes are memory this allocator made (pinned when it pins), still live.

        The data path counts a host<->device copy whose host side is not such memory as
        ``unpooled`` (pageable on a GPU). An empty tensor is owned by nobody.
        """
        nbytes = tensor.nbytes      # (``is_cpu`` and ``nbytes``: the data path asks this for every copy)
        return nbytes > 0 and tensor.is_cpu and self._accounting.contains(tensor.data_ptr(), nbytes)

    def stats(self) -> dict:
        """``allocations``, ``bytes_allocated``, ``peak_bytes``, ``pinned_bytes``, ``pinned``, ``numa_node``."""
        acc = self._accounting
        return {
            "allocations": acc.allocations,
            "bytes_allocated": acc.bytes_allocated,
            "peak_bytes": acc.peak_bytes,
            "pinned_bytes": acc.pinned_bytes,
            "pinned": self.pinned,
            "numa_node": self.numa.node,
            "numa_reason": self.numa.reason,
        }

    def __repr__(self) -> str:
        return f"HostAllocator(pin={self.pin!r}, pinned={self.pinned}, numa_node={self.numa.node})"
