"""Constant-size buffer pools (ZeRO-R): a fixed number of fixed-size aligned host buffers.

[Note: constant-size buffers]
Every staging buffer the NVMe path needs comes from a pool of ``count`` buffers of
``buffer_nbytes`` each, each made once and kept: nothing is freed or made again, nothing
fragments, and the peak host memory of I/O is at most ``count * buffer_nbytes``, known
from the config. A transfer larger than a buffer is moved in buffer-sized pieces
(tiers/staging.py), never refused. An eager pool makes all of them at start-up in ONE
allocation (one ``mmap``, one pinning: pinning costs ~0.35 s/GiB, see host_alloc). A
pool made ``lazy`` makes each buffer (one allocation, zeroed) at the first loan that
finds no made buffer free, so it holds as many as were ever on loan at once. The NVMe
tier's pool is lazy: only transfers not aligned to 4096 bytes use it (a tensor the
engine does not own, the tail of a key whose size is no multiple of 4096), and the
engine page-aligns the host memory of the transfers it makes while training, at
construction and in checkpoint saves. The demo (GPT 20M on NVMe) made all 8 x 64 MiB,
zeroed and resident, because construction wrote the cast parameter shards and split
masters from unaligned tensors, every step read the gradients for their norm into one
and a checkpoint save read the split masters into them; aligned, it takes no loan. A
budget check counts the buffers not made yet (``nbytes`` less ``made_nbytes``).

When every buffer is out, ``acquire`` waits for one to come back; after ``timeout``
seconds it raises :class:`PoolTimeoutError` naming who holds them, because a silent
hang is the worst way to learn about a leak.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import torch

from tiers.base import format_nbytes
from tiers.host_alloc import ALIGNMENT, HostAllocator


class PoolTimeoutError(TimeoutError):
    """No buffer came back within the timeout; the message names the holders."""


class Loan:
    """Host memory on loan; :meth:`release` gives it back to its lender.

    ``tensor`` is the ``uint8`` memory; it must not be touched after release (the next
    owner may be writing it). Releasing twice is a no-op (safe in ``finally``). Use as a
    context manager. ``give_back`` is called once, by the first release.
    """

    __slots__ = ("_tensor", "_give_back", "nbytes", "owner", "where")

    def __init__(self, tensor: torch.Tensor, give_back: Callable[[], None], owner: str, where: str) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._give_back = give_back
        self.nbytes = tensor.numel()
        self.owner = owner
        self.where = where

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"{self.where} was already released by {self.owner!r}")
        return self._tensor

    def release(self) -> None:
        """Give the memory back. Releasing twice is a no-op."""
        if self._tensor is None:
            return
        self._tensor = None
        self._give_back()

    def __enter__(self) -> "Loan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._tensor is None else "held"
        return f"Loan({self.where}, {self.nbytes} bytes, owner={self.owner!r}, {state})"


PoolBuffer = Loan   # one buffer on loan from a BufferPool


class BufferPool:
    """``count`` buffers of ``buffer_nbytes`` (rounded up to 4096), allocated once.

    Parameters
    ----------
    buffer_nbytes : int
        Size of each buffer; rounded up to a multiple of 4096 so any buffer can be the
        target of an ``O_DIRECT`` transfer.
    count : int
        Number of buffers (>= 1).
    allocator : HostAllocator | None
        Where the memory comes from (pinned / NUMA-bound as configured). None: an
        unpinned, unbound allocator.
    name : str
        Named in errors and telemetry.
    lazy : bool
        Make (and touch) each buffer at the first loan that needs it, not all now (see [Note: constant-size
        buffers]).

    Examples
    --------
    >>> pool = BufferPool(1 << 20, 2, HostAllocator(pin="never"), name="demo")
    >>> with pool.acquire("example") as buf:
    ...     buf.tensor.numel()
    1048576
    """

    def __init__(self, buffer_nbytes: int, count: int, allocator: HostAllocator | None = None,
                 name: str = "pool", lazy: bool = False) -> None:
        if not isinstance(buffer_nbytes, int) or buffer_nbytes <= 0:
            raise ValueError(f"pool {name!r}: buffer_nbytes must be an int > 0, got {buffer_nbytes!r}")
        if not isinstance(count, int) or count <= 0:
            raise ValueError(f"pool {name!r}: count must be an int > 0, got {count!r}")
        self.name = name
        self.buffer_nbytes = -(-buffer_nbytes // ALIGNMENT) * ALIGNMENT
        self.count = count
        self.allocator = allocator if allocator is not None else HostAllocator(pin="never")
        # A lazy pool's buffers are made one at a time (None until then); an eager pool's, in one allocation.
        self._buffers: list[torch.Tensor | None] = [None] * count
        if not lazy:
            self._allocate_all()
        self._free = collections.deque(range(count))
        self._owners: dict[int, str] = {}
        self._cond = threading.Condition()
        self._acquires = 0
        self._waits = 0
        self._wait_seconds = 0.0
        self._peak_in_use = 0

    @property
    def nbytes(self) -> int:
        """Host bytes of all ``count`` buffers: the most the pool holds (a lazy one, once all are made)."""
        return self.buffer_nbytes * self.count

    def acquire(self, owner: str, timeout: float = 60) -> PoolBuffer:
        """Take a buffer, waiting up to ``timeout`` seconds for one to be released.

        ``owner`` says who holds it (e.g. ``"nvme read key 7 (layer3.weight)"``) and is
        named by :class:`PoolTimeoutError` when the pool stays empty.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._free:
                self._waits += 1
                start = time.perf_counter()
                while not self._free:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left) and not self._free:
                        self._wait_seconds += time.perf_counter() - start
                        raise PoolTimeoutError(self._timeout_message(owner, timeout))
                self._wait_seconds += time.perf_counter() - start
            index = self._take(owner)
        return self._lend(index, owner)

    def try_acquire(self, owner: str) -> PoolBuffer | None:
        """A buffer if one is free right now, else None (never waits)."""
        with self._cond:
            if not self._free:
                return None
            index = self._take(owner)
        return self._lend(index, owner)

    def _allocate_all(self) -> None:
        memory = self._zeroed(self.buffer_nbytes * self.count)
        self._buffers = [memory[i * self.buffer_nbytes:(i + 1) * self.buffer_nbytes] for i in range(self.count)]

    def _zeroed(self, nbytes: int) -> torch.Tensor:
        memory = self.allocator.empty(nbytes)
        # Touch every page now: a first-use page fault costs more than the copy it serves,
        # and a buffer's bytes should be resident from its first loan, not grow on the hot path.
        memory.zero_()
        return memory

    @property
    def made(self) -> int:
        """Buffers whose memory exists: ``count`` for an eager pool; a ``lazy`` pool's, as many as were ever on
        loan at once."""
        return sum(buf is not None for buf in self._buffers)

    @property
    def allocated(self) -> bool:
        """Whether all ``count`` buffers exist (a ``lazy`` pool's, once that many were on loan at once)."""
        return self.made == self.count

    def _take(self, owner: str) -> int:
        """Reserve a free buffer's index for ``owner`` (under the lock; the caller checked one is free)."""
        # Last in, first out: the buffer released most recently is warm in cache and TLB, and a lazy
        # pool's made buffers (every one released goes to the right end) are lent before an unmade one.
        index = self._free.pop()
        self._owners[index] = owner
        self._acquires += 1
        self._peak_in_use = max(self._peak_in_use, len(self._owners))
        return index

    def _lend(self, index: int, owner: str) -> PoolBuffer:
        """The loan of reserved buffer ``index``, made first if it never was (outside the lock: zeroing 64 MiB
        should not hold up a release)."""
        if self._buffers[index] is None:
            try:
                self._buffers[index] = self._zeroed(self.buffer_nbytes)
            except BaseException:
                self._return(index)
                raise
        return Loan(self._buffers[index], lambda: self._return(index), owner,
                    f"buffer {index} of pool {self.name!r}")

    def _return(self, index: int) -> None:
        with self._cond:
            del self._owners[index]
            self._free.append(index)
            self._cond.notify()

    def _timeout_message(self, owner: str, timeout: float) -> str:
        held = collections.Counter(self._owners.values())
        holders = ", ".join(f"{name!r} x{n}" if n > 1 else repr(name) for name, n in held.most_common())
        return (
            f"pool {self.name!r}: {owner!r} waited {timeout:g} s for a buffer; all {self.count} buffers "
            f"({format_nbytes(self.buffer_nbytes)} each) are held by: {holders}. A holder never released "
            "its buffer, or the pool is too small for this many concurrent transfers "
            "(raise tiers.pool_buffers)"
        )

    def holders(self) -> list[str]:
        """Owner strings of the buffers out on loan right now."""
        with self._cond:
            return list(self._owners.values())

    def in_use(self) -> int:
        with self._cond:
            return len(self._owners)

    def stats(self) -> dict:
        """``buffers``, ``buffer_nbytes``, ``nbytes`` (all ``buffers``), ``buffers_made`` and ``made_nbytes`` (a lazy
        pool's made so far), ``allocated`` (all made), ``in_use``, ``peak_in_use``, ``acquires``, ``waits``,
        ``wait_seconds``."""
        with self._cond:
            made = self.made
            return {
                "name": self.name,
                "buffers": self.count,
                "buffer_nbytes": self.buffer_nbytes,
                "nbytes": self.nbytes,
                "buffers_made": made,
                "made_nbytes": made * self.buffer_nbytes,
                "allocated": made == self.count,
                "in_use": len(self._owners),
                "peak_in_use": self._peak_in_use,
                "acquires": self._acquires,
                "waits": self._waits,
                "wait_seconds": self._wait_seconds,
            }

    def __repr__(self) -> str:
        return (f"BufferPool(name={self.name!r}, count={self.count}, "
                f"buffer_nbytes={self.buffer_nbytes}, in_use={self.in_use()})")
