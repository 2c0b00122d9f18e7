"""Streaming a tensor's bytes to or from files through pool buffers, piece by piece.

[Note: staged transfers]
``O_DIRECT`` needs the memory address, the file offset and the length to be multiples
of 4096. Ordinary torch tensors are 64-byte aligned and their sizes are arbitrary, so
the NVMe tier moves them through :class:`~tiers.pool.BufferPool` buffers (always
aligned): each file-contiguous :class:`Run` is cut into pieces of at most one buffer,
over the 4096-aligned window around it. Pieces rotate through a small ring of buffers
(at least two: double buffering), so the disk reads piece i+1 while the CPU copies
piece i out (and, writing, copies piece i+1 in while piece i is written). Each buffer
is cut into slots of ``piece_nbytes`` (16 MiB): while one slot is being copied the
others keep the disk's queue full, and the copy that cannot be hidden (the first
piece of a write, the last of a read) is one slot, not one buffer. The ring takes up
to ``depth`` = 4 buffers by default: measured on the test machine (1 GiB, 7 alternating
repeats, 64 MiB buffers), 2 buffers (128 MiB in flight) read at 0.74x the raw handle,
4 buffers at 0.93x; the disk wants about as much in flight as the handle's
``queue_depth * block_size`` (256 MiB by default). Only the
first buffer is waited for; more are taken only if free right now, so two transfers
each holding one buffer can never deadlock waiting for a second.

A write whose window is wider than its data (an unaligned offset or length) first
reads the partial edge blocks into the buffer, then copies the data over them
(read-modify-write), so the bytes around the data are kept. Two such writes of one
key that meet inside a block (a checkpoint loaded into a regrouped model writes one
parameter's bytes up to byte 3072 and the next one's from there, on two worker threads)
would each put back the other's old bytes, so a write holds its partial edge blocks
(:class:`_EdgeBlocks`) from the edge read until the block is on disk; a second write
of one of them waits. Whole blocks need no such order: two writes covering one whole
block overlap, and which one lands is the caller's business. Different keys never
share a block.

Aligned transfers skip all of this (:func:`split_direct`): the tier hands the caller's
memory straight to the aio handle.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
from dataclasses import dataclass

import torch

from tiers.aio import ALIGNMENT, AioFile, AioFuture, AioHandle
from tiers.base import wait_quietly
from tiers.pool import BufferPool, PoolBuffer


@dataclass(frozen=True)
class Run:
    """``nbytes`` contiguous bytes at ``file_offset`` of ``file`` <-> at ``mem_offset`` of the memory."""

    file: AioFile
    file_offset: int
    mem_offset: int
    nbytes: int


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two contiguous CPU ``uint8`` tensors of one size, on this thread only.

    [Note: single-threaded piece copies]
    ``Tensor.copy_`` splits a large copy over torch's intra-op threads. With the disk
    busy on the other core(s), one of those threads is often descheduled and the whole
    copy waits for it: measured on the 2-core test machine, a staged 1 GiB read spent
    0.6-1.0 s copying instead of 0.1 s, and fell to 0.4x of the raw handle. A plain
    ``memmove`` (ctypes releases the GIL) on the staging thread does not straggle.
    """
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def _floor(value: int) -> int:
    return value - value % ALIGNMENT


def _ceil(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


def split_direct(runs: list[Run], memory: torch.Tensor) -> tuple[list[Run], list[Run]]:
    """Split ``runs`` into those the handle can move straight from/to ``memory`` and the rest.

    A run is direct when its memory address and file offset are aligned; its whole
    blocks go direct and a partial last block (if any) is left to the staged path.
    """
    base = memory.data_ptr()
    direct: list[Run] = []
    staged: list[Run] = []
    for run in runs:
        if (base + run.mem_offset) % ALIGNMENT or run.file_offset % ALIGNMENT or run.nbytes < ALIGNMENT:
            staged.append(run)
            continue
        whole = _floor(run.nbytes)
        direct.append(Run(run.file, run.file_offset, run.mem_offset, whole))
        if whole < run.nbytes:
            staged.append(Run(run.file, run.file_offset + whole, run.mem_offset + whole, run.nbytes - whole))
    return direct, staged


@dataclass(frozen=True)
class _Piece:
    """The aligned window ``[window_start, window_end)`` of ``run.file`` one buffer moves."""

    run: Run
    window_start: int
    window_end: int

    @property
    def data_start(self) -> int:
        return max(self.window_start, self.run.file_offset)

    @property
    def data_end(self) -> int:
        return min(self.window_end, self.run.file_offset + self.run.nbytes)

    def memory(self, memory: torch.Tensor) -> torch.Tensor:
        start = self.run.mem_offset + self.data_start - self.run.file_offset
        return memory[start:start + self.data_end - self.data_start]

    def buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """The part of the window's buffer that holds the data bytes."""
        return buffer[self.data_start - self.window_start:self.data_end - self.window_start]


def _pieces(runs: list[Run], piece_nbytes: int) -> list[_Piece]:
    pieces = []
    for run in runs:
        window = _floor(run.file_offset)
        end = _ceil(run.file_offset + run.nbytes)
        while window < end:
            pieces.append(_Piece(run, window, min(window + piece_nbytes, end)))
            window += piece_nbytes
    return pieces


class _EdgeBlocks:
    """The partial blocks that staged writes are reading, modifying and writing back (see [Note: staged
    transfers]): a write takes all of its own at once, or waits, so no two of them interleave and no
    two writes can each hold one block the other waits for."""

    def __init__(self) -> None:
        self._held: set[tuple[AioFile, int]] = set()
        self._changed = threading.Condition()

    @staticmethod
    def of(runs: list[Run]) -> set[tuple[AioFile, int]]:
        blocks = set()
        for run in runs:
            end = run.file_offset + run.nbytes
            if run.file_offset % ALIGNMENT:
                blocks.add((run.file, _floor(run.file_offset)))
            if end % ALIGNMENT:
                blocks.add((run.file, _floor(end)))
        return blocks

    @contextlib.contextmanager
    def held(self, blocks: set[tuple[AioFile, int]]):
        if not blocks:
            yield
            return
        with self._changed:
            while not self._held.isdisjoint(blocks):
                self._changed.wait()
            self._held |= blocks
        try:
            yield
        finally:
            with self._changed:
                self._held -= blocks
                self._changed.notify_all()


class Staging:
    """Moves runs between memory and files through a ring of up to ``depth`` pool buffers.

    Both methods block until done (the NVMe tier runs them on worker threads) and raise
    the first ``OSError``; buffers go back to the pool only once no I/O is in flight on them.

    Examples
    --------
    >>> staging = Staging(handle, pool)                                  # doctest: +SKIP
    >>> staging.write([Run(f, 4096, 0, 10)], torch.arange(10, dtype=torch.uint8), "demo")  # doctest: +SKIP
    10
    """

    def __init__(self, handle: AioHandle, pool: BufferPool, depth: int = 4,
                 piece_nbytes: int = 16 << 20, acquire_timeout: float = 60) -> None:
        if depth < 1:
            raise ValueError(f"Staging: depth must be >= 1, got {depth}")
        if piece_nbytes < ALIGNMENT:
            raise ValueError(f"Staging: piece_nbytes must be >= {ALIGNMENT}, got {piece_nbytes}")
        self.handle = handle
        self.pool = pool
        self.depth = depth
        # Pieces smaller than a buffer keep the disk busy while one piece is copied (more
        # requests in flight) and shorten the unhidden first / last copy; see [Note: staged transfers].
        slots = max(1, pool.buffer_nbytes // _floor(min(piece_nbytes, pool.buffer_nbytes)))
        self.piece_nbytes = _floor(pool.buffer_nbytes // slots)
        self._slots_per_buffer = slots
        self.acquire_timeout = acquire_timeout
        self._edges = _EdgeBlocks()

    def _slots(self, ring: list[PoolBuffer]) -> list[torch.Tensor]:
        """The ring's buffers cut into piece-sized slots, last slot first (popped first)."""
        size = self.piece_nbytes
        slots = [buf.tensor[i * size:(i + 1) * size] for buf in ring for i in range(self._slots_per_buffer)]
        return slots[::-1]

    def _ring(self, owner: str, pieces: int) -> list[PoolBuffer]:
        ring = [self.pool.acquire(owner, self.acquire_timeout)]
        while len(ring) < min(self.depth, -(-pieces // self._slots_per_buffer)):
            extra = self.pool.try_acquire(owner)
            if extra is None:
                break
            ring.append(extra)
        return ring

    @contextlib.contextmanager
    def _lent(self, owner: str, pieces: int):
        """A ring of pool buffers for ``pieces`` pieces: yields its free slots and the in-flight queue.

        On the way out, normal or not, in-flight I/O is waited for (ignoring its errors: one is
        already on its way up) before the buffers go back to the pool.
        """
        ring = self._ring(owner, pieces)
        inflight: collections.deque[tuple[_Piece, torch.Tensor, AioFuture]] = collections.deque()
        try:
            yield self._slots(ring), inflight
        finally:
            wait_quietly(future for _piece, _buffer, future in inflight)
            for buf in ring:
                buf.release()

    def read(self, runs: list[Run], memory: torch.Tensor, owner: str) -> int:
        """Fill ``memory`` (flat ``uint8``, CPU) from ``runs``; returns the bytes moved."""
        pieces = _pieces(runs, self.piece_nbytes)
        if not pieces:
            return 0
        todo = iter(pieces)
        with self._lent(owner, len(pieces)) as (free, inflight):
            while True:
                for piece in todo:
                    buffer = free.pop()
                    window = buffer[:piece.window_end - piece.window_start]
                    inflight.append((piece, buffer, self.handle.pread(piece.run.file, window, piece.window_start)))
                    if not free:
                        break
                if not inflight:
                    break
                piece, buffer, future = inflight.popleft()
                future.wait()
                _copy(piece.memory(memory), piece.buffer(buffer))
                free.append(buffer)
        return sum(run.nbytes for run in runs)

    def write(self, runs: list[Run], memory: torch.Tensor, owner: str) -> int:
        """Write ``memory`` (flat ``uint8``, CPU) to ``runs``; returns the bytes moved."""
        pieces = _pieces(runs, self.piece_nbytes)
        if not pieces:
            return 0
        with self._edges.held(_EdgeBlocks.of(runs)), self._lent(owner, len(pieces)) as (free, inflight):
            for piece in pieces:
                if not free:
                    _done, buffer, future = inflight.popleft()
                    future.wait()
                    free.append(buffer)
                buffer = free.pop()
                window = buffer[:piece.window_end - piece.window_start]
                self._read_edges(piece, window)
                _copy(piece.buffer(window), piece.memory(memory))
                inflight.append((piece, buffer, self.handle.pwrite(piece.run.file, window, piece.window_start)))
            while inflight:
                inflight.popleft()[2].wait()
        return sum(run.nbytes for run in runs)

    def _read_edges(self, piece: _Piece, window: torch.Tensor) -> None:
        """Read-modify-write: load the partial first / last blocks the data does not cover."""
        size = window.numel()
        head = piece.data_start > piece.window_start
        tail = piece.data_end < piece.window_end
        if head:
            self.handle.pread(piece.run.file, window[:ALIGNMENT], piece.window_start).wait()
        if tail and not (head and size == ALIGNMENT):
            self.handle.pread(piece.run.file, window[size - ALIGNMENT:], piece.window_end - ALIGNMENT).wait()

