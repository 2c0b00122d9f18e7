"""Moving bytes between tiers and checkpoint files through a few bounded, aligned buffers.

[Note: bounded streaming]
A save never holds a whole shard: each data file is written from a list of spans
(a byte range of one tier key, or zeros), cut into pieces of at most
``checkpoint.buffer_size`` bytes. A piece is read from its tier into one of
``DEPTH`` aligned host buffers, its CRC is computed, and it is written to the
file with asynchronous direct I/O; the next piece's tier read is issued before
this piece's write is waited for, so the disk reads and writes overlap. Keys of
the host tier are written straight from their memory (no copy, no buffer). A load
is the mirror image: a file is read in chunk-aligned windows of at most
``buffer_size`` bytes, the chunks are verified, and each window is scattered to the
tier ranges ("runs") that need its bytes. The host memory a save or load adds is
therefore ``DEPTH * buffer_size`` (3 x 64 MiB by default), plus 1 MiB of zeros for
padding, whatever the model size.
"""
from __future__ import annotations

import collections
import errno
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.checkpoint.errors import CheckpointCorruptError
from infinity.checkpoint.manifest import ChunkChecksum, FileRecord
from tiers.base import wait_quietly

DEPTH = 3
"""Buffers one stream cycles through: one being read, one being checksummed, one being written."""
ALIGN = 4096
ZEROS_NBYTES = 1 << 20
_MAX_WRITES_IN_FLIGHT = 8


class Future(Protocol):
    def wait(self): ...


class _Done:
    """A transfer that already happened (synchronous fallbacks)."""

    def wait(self) -> None:
        return None


@dataclass(frozen=True)
class TierSpan:
    """``nbytes`` bytes of ``key`` in ``tier`` from byte ``offset``."""

    tier: object
    key: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ZeroSpan:
    """``nbytes`` zero bytes (states that do not exist yet, such as moments before the first step)."""

    nbytes: int


class Dest(Protocol):
    """Where a load puts bytes: ``write(dest_offset, data)`` starts the transfer and returns a future."""

    def write(self, dest_offset: int, data: torch.Tensor) -> Future: ...


@dataclass(frozen=True)
class Run:
    """Bytes ``[src_offset, src_offset + nbytes)`` of file ``src`` go to ``dest`` at ``dest_offset``.

    ``dest`` None only verifies the bytes (``verify_checkpoint``).
    """

    src: str
    src_offset: int
    nbytes: int
    dest: Dest | None
    dest_offset: int = 0


class StreamIO:
    """The aio handle and the aligned buffers of one save, load or consolidation.

    Parameters
    ----------
    aio:
        The config's ``[aio]`` section (block size, queue depth, threads, engine, direct).
    buffer_nbytes:
        Size of each buffer (``checkpoint.buffer_size``).
    allocator:
        ``tiers.HostAllocator`` for the buffers (pinned when the engine pins), or None.
    """

    def __init__(self, aio, buffer_nbytes: int, allocator=None) -> None:
        from tiers.aio import AioHandle

        self.handle = AioHandle(block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads,
                                engine=aio.engine, direct=aio.direct)
        self.direct = bool(aio.direct)
        self.buffer_nbytes = buffer_nbytes
        self._allocator = allocator
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._zeros: torch.Tensor | None = None

    def _empty(self, nbytes: int) -> torch.Tensor:
        if self._allocator is not None:
            return self._allocator.empty(nbytes)
        from tiers.aio import aligned_empty

        return aligned_empty(nbytes)

    def has_free(self) -> bool:
        return bool(self._free) or self._made < DEPTH

    def take(self) -> torch.Tensor:
        if not self._free:
            self._made += 1
            return self._empty(self.buffer_nbytes)
        return self._free.pop()

    def give(self, buf: torch.Tensor) -> None:
        if buf.numel() < self.buffer_nbytes:
            self._made -= 1        # made before the buffers had to grow: let it go
            return
        self._free.append(buf)

    def grow(self, nbytes: int) -> None:
        """Buffers of at least ``nbytes`` from now on (a checkpoint saved with larger checksum chunks)."""
        if nbytes > self.buffer_nbytes:
            self.buffer_nbytes = nbytes
            self._made -= len(self._free)
            self._free.clear()

    @property
    def zeros(self) -> torch.Tensor:
        """An aligned block of ``ZEROS_NBYTES`` zero bytes (padding, moments before the first step)."""
        if self._zeros is None:
            self._zeros = self._empty(ZEROS_NBYTES)
            self._zeros.zero_()
        return self._zeros

    def open(self, path: str, mode: str, direct: bool):
        """Open with O_DIRECT when asked and allowed; a filesystem refusing it falls back to buffered I/O."""
        from tiers.aio import open_file

        if direct and self.direct:
            try:
                return open_file(path, mode, direct=True, create=mode != "r")
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        return open_file(path, mode, direct=False, create=mode != "r")

    def close(self) -> None:
        self._free.clear()
        self._zeros = None
        self.handle.close()

    def __enter__(self) -> "StreamIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_view(tier, key: int) -> torch.Tensor | None:
    view = getattr(tier, "view", None)
    if view is None:
        return None
    data = view(key)
    return data if data.device.type == "cpu" else None


def write_file(io: StreamIO, directory: str, relpath: str, spans: list, chunk_nbytes: int) -> FileRecord:
    """Stream ``spans`` into a new file ``directory/relpath`` and return its record (the caller syncs it)."""
    path = os.path.join(directory, relpath)
    direct = all(s.nbytes % ALIGN == 0 for s in spans)
    f = io.open(path, "w", direct)
    checksum = ChunkChecksum(chunk_nbytes)
    reads: collections.deque = collections.deque()
    writes: collections.deque = collections.deque()
    position = 0

    def retire() -> None:
        buf, fut, _data = writes[0]
        fut.wait()
        writes.popleft()
        if buf is not None:
            io.give(buf)

    def emit() -> None:
        nonlocal position
        buf, data, fut = reads.popleft()
        if fut is not None:
            fut.wait()
        checksum.feed(data.numpy())
        if f.direct:
            fut = io.handle.pwrite(f, data, position)
        else:
            _pwrite_all(f.fd, data, position)
            fut = _Done()
        writes.append((buf, fut, data))
        position += data.numel()
        while len(writes) > _MAX_WRITES_IN_FLIGHT:
            retire()

    def take() -> torch.Tensor:
        while not io.has_free():
            retire() if writes else emit()
        return io.take()

    try:
        for span in spans:
            piece = ZEROS_NBYTES if isinstance(span, ZeroSpan) else io.buffer_nbytes
            for start in range(0, span.nbytes, piece):
                n = min(piece, span.nbytes - start)
                if isinstance(span, ZeroSpan):
                    reads.append((None, io.zeros[:n], None))
                elif hasattr(span, "fill"):     # bytes made on the host (decoded compressed moments)
                    buf = take()
                    span.fill(start, buf[:n])
                    reads.append((buf, buf[:n], None))
                else:
                    view = _host_view(span.tier, span.key)
                    if view is not None:
                        view = view[span.offset + start:span.offset + start + n]
                    if view is not None and not (f.direct and view.data_ptr() % ALIGN):
                        reads.append((None, view, None))
                    else:
                        buf = take()
                        dst = buf[:n]
                        reads.append((buf, dst, span.tier.read(span.key, dst, span.offset + start)))
                if len(reads) > 1:
                    emit()
        while reads:
            emit()
        while writes:
            retire()
    finally:
        wait_quietly([fut for _, fut, _ in writes] + [fut for _, _, fut in reads if fut is not None])
        for buf in [buf for buf, _, _ in writes] + [buf for buf, _, _ in reads]:
            if buf is not None:
                io.give(buf)
        f.close()
    return FileRecord(relpath, position, chunk_nbytes, checksum.finish())


def _pwrite_all(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def check_sizes(files: dict[str, tuple[str, FileRecord]], names) -> None:
    """Every file a load will read exists with the size its record says (truncation shows here)."""
    for name in names:
        path, record = files[name]
        try:
            size = os.stat(path).st_size
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{path}: missing from the checkpoint") from exc
        if size != record.nbytes:
            raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {record.nbytes} "
                                         f"({'truncated' if size < record.nbytes else 'grown'}); the file is corrupt")


def read_runs(io: StreamIO, files: dict[str, tuple[str, FileRecord]], runs: list[Run]) -> None:
    """Read, verify and scatter every run (see [Note: bounded streaming]); file by file, in order."""
    by_file: dict[str, list[Run]] = collections.defaultdict(list)
    for run in runs:
        if run.nbytes:
            by_file[run.src].append(run)
    check_sizes(files, by_file)
    for name, file_runs in by_file.items():
        path, record = files[name]
        file_runs.sort(key=lambda r: r.src_offset)
        _read_file(io, path, record, file_runs)


def _windows(runs: list[Run], chunk: int, window: int, size: int) -> list[tuple[int, int]]:
    """Chunk-aligned ranges covering every run, merged, cut to at most ``window`` bytes."""
    spans: list[list[int]] = []
    for run in runs:
        start = run.src_offset // chunk * chunk
        end = min(-(-(run.src_offset + run.nbytes) // chunk) * chunk, size)
        if run.src_offset + run.nbytes > size:
            raise CheckpointCorruptError(f"a run reads bytes {run.src_offset}..{run.src_offset + run.nbytes} "
                                         f"of a {size}-byte file {run.src}: the manifest is inconsistent")
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(s, min(s + window, e)) for s, e in spans for s in range(s, e, window)]


def _read_file(io: StreamIO, path: str, record: FileRecord, runs: list[Run]) -> None:
    chunk = record.chunk_nbytes
    window = max(chunk, io.buffer_nbytes // chunk * chunk)
    io.grow(window)
    windows = _windows(runs, chunk, window, record.nbytes)
    direct = record.nbytes % ALIGN == 0 and chunk % ALIGN == 0
    f = io.open(path, "r", direct)
    reads: collections.deque = collections.deque()
    pending: collections.deque = collections.deque()
    first = 0

    def retire() -> None:
        buf, futures = pending[0]
        for fut in futures:
            fut.wait()      # on an error, the finally below waits for the rest of them
        pending.popleft()
        io.give(buf)

    def process() -> None:
        nonlocal first
        buf, (w0, w1), fut = reads.popleft()
        fut.wait()
        data = buf[:w1 - w0]
        _verify(path, record, data, w0)
        futures = []
        pending.append((buf, futures))      # from here on, the finally below waits for what was started
        while first < len(runs) and runs[first].src_offset + runs[first].nbytes <= w0:
            first += 1
        for run in runs[first:]:
            if run.src_offset >= w1:
                break
            a, b = max(run.src_offset, w0), min(run.src_offset + run.nbytes, w1)
            if a < b and run.dest is not None:
                futures.append(run.dest.write(run.dest_offset + a - run.src_offset, data[a - w0:b - w0]))

    try:
        for w0, w1 in windows:
            while not io.has_free():
                retire() if pending else process()
            buf = io.take()
            if f.direct:
                fut = io.handle.pread(f, buf[:w1 - w0], w0)
            else:
                _pread_exact(f.fd, buf[:w1 - w0], w0, path)
                fut = _Done()
            reads.append((buf, (w0, w1), fut))
            if len(reads) > 1:
                process()
        while reads:
            process()
        while pending:
            retire()
    finally:
        wait_quietly([fut for _, _, fut in reads] + [fut for _, futures in pending for fut in futures])
        for buf in [buf for buf, _, _ in reads] + [buf for buf, _ in pending]:
            io.give(buf)
        f.close()


def _pread_exact(fd: int, buf: torch.Tensor, offset: int, path: str) -> None:
    view = memoryview(buf.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointCorruptError(f"{path}: ends at byte {offset + done}, expected {offset + len(view)}")
        done += n


def _verify(path: str, record: FileRecord, data: torch.Tensor, start: int) -> None:
    import zlib

    chunk = record.chunk_nbytes
    array = data.numpy()
    for index in range(start // chunk, -(-(start + data.numel()) // chunk)):
        a = index * chunk - start
        b = min(a + chunk, data.numel())
        found = zlib.crc32(array[a:b])
        if found != record.crc32[index]:
            raise CheckpointCorruptError(
                f"{path}: bytes {index * chunk}..{index * chunk + b - a} fail their CRC-32 (expected "
                f"{record.crc32[index]:08x}); the file is corrupt: load an older version "
                "or a checkpoint saved elsewhere")
