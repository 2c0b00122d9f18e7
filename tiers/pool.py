"""Constant-size buffer pools (ZeRO-R): a fixed number of fixed-size aligned host buffers.

[Note: constant-size buffers]
Every staging buffer the NVMe path needs comes from a pool made once, at start-up:
``count`` buffers of ``buffer_nbytes`` each, carved out of ONE allocation (one
``mmap``, one pinning: pinning costs ~0.35 s/GiB, see host_alloc). In the steady
state nothing is allocated, nothing fragments, and the peak host memory of I/O is
``count * buffer_nbytes``, known from the config. A transfer larger than a buffer is
moved in buffer-sized pieces (tiers/staging.py), never refused. A pool made ``lazy``
makes its one allocation at the first loan instead: the NVMe tier's, which only
transfers not aligned to 4096 bytes use, and the engine aligns every key it moves
while training (GPT 1B fp32 on NVMe: no loan in four steps, where the 512 MiB made
and zeroed at start-up were all resident). When every buffer is
out, ``acquire`` waits for one to come back; after ``timeout`` seconds it raises
:class:`PoolTimeoutError` naming who holds them, because a silent hang is the worst
way to learn about a leak.
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
        Allocate (and touch) the memory at the first loan, not now (see [Note: constant-size buffers]).

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
        self._buffers: list = []
        if not lazy:
            self._allocate()
        self._free = collections.deque(range(count))
        self._owners: dict[int, str] = {}
        self._cond = threading.Condition()
        self._acquires = 0
        self._waits = 0
        self._wait_seconds = 0.0
        self._peak_in_use = 0

    @property
    def nbytes(self) -> int:
        """Host bytes held by the pool in all (its fixed peak)."""
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
            return self._lend(owner)

    def try_acquire(self, owner: str) -> PoolBuffer | None:
        """A buffer if one is free right now, else None (never waits)."""
        with self._cond:
            return self._lend(owner) if self._free else None

    def _allocate(self) -> None:
        memory = self.allocator.empty(self.buffer_nbytes * self.count)
        # Touch every page now: a first-use page fault costs more than the copy it serves,
        # and the pool's peak should be real from the start, not grow on the hot path.
        memory.zero_()
        self._buffers = [memory[i * self.buffer_nbytes:(i + 1) * self.buffer_nbytes] for i in range(self.count)]

    @property
    def allocated(self) -> bool:
        """Whether the pool's memory exists (a ``lazy`` pool's, from its first loan on)."""
        return bool(self._buffers)

    def _lend(self, owner: str) -> PoolBuffer:
        if not self._buffers:
            self._allocate()
        # Last in, first out: the buffer released most recently is warm in cache and TLB.
        index = self._free.pop()
        self._owners[index] = owner
        self._acquires += 1
        self._peak_in_use = max(self._peak_in_use, len(self._owners))
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
        """``buffers``, ``buffer_nbytes``, ``nbytes``, ``allocated`` (False: a lazy pool before its first loan),
        ``in_use``, ``peak_in_use``, ``acquires``, ``waits``, ``wait_seconds``."""
        with self._cond:
            return {
                "name": self.name,
                "buffers": self.count,
                "buffer_nbytes": self.buffer_nbytes,
                "nbytes": self.nbytes,
                "allocated": self.allocated,
                "in_use": len(self._owners),
                "peak_in_use": self._peak_in_use,
                "acquires": self._acquires,
                "waits": self._waits,
                "wait_seconds": self._wait_seconds,
            }

    def __repr__(self) -> str:
        return (f"BufferPool(name={self.name!r}, count={self.count}, "
                f"buffer_nbytes={self.buffer_nbytes}, in_use={self.in_use()})")
