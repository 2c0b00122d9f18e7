"""The checkpoint's own words about itself: file records, checksums, dtypes, JSON on disk.

[Note: checksums]
Every data file is checksummed in fixed chunks of ``chunk_nbytes`` (4 MiB, or the
save's buffer size when smaller): the manifest of the rank that wrote it lists one
CRC-32 per chunk. The CRCs are computed as the bytes stream to the file, so saving
reads nothing twice, and a reader that needs only part of a file (a resharded load
reads a slice of another rank's shard; consolidation reads one tensor) verifies just
the chunks it reads. zlib's CRC-32 runs at ~5 GB/s on one core here, above the
disk's bandwidth, and catches every burst error up to 32 bits and any truncation or
zeroed block; it is not a defence against deliberate tampering (use a signed
manifest for that). The manifests themselves are covered by the CRCs in ``COMMIT``.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass

import torch

from infinity.checkpoint.errors import CheckpointCorruptError
from tiers.swapfile import fsync_dir  # noqa: F401  (the checkpoint's files and renames use the tiers' own)

FORMAT = "infinity-checkpoint"
VERSION = 1
CHUNK_NBYTES = 4 << 20
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
LATEST = "latest"
STATE_FILES = ("params", "master", "exp_avg", "exp_avg_sq")
"""The per-rank data files: the compute copy shards, then the fp32 master and Adam moments."""

_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names the manifest uses)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointCorruptError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {', '.join(_DTYPES)}")
    return name


def dtype_of(name: str, where: str = "manifest") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; an unknown name is a corrupt manifest."""
    if name not in _DTYPES:
        raise CheckpointCorruptError(f"{where}: unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return getattr(torch, name)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint: its path inside the version directory, size and chunk CRCs."""

    path: str
    """Relative to the version directory (``rank0/params.bin``)."""

    nbytes: int
    """Size of the file, checked before a load reads it (a truncated file shows here)."""

    chunk_nbytes: int
    """The checksums cover chunks of this many bytes (the last may be shorter)."""

    crc32: tuple[int, ...]
    """CRC-32 of each chunk, in order (see [Note: checksums])."""

    def to_json(self) -> dict:
        return {"path": self.path, "nbytes": self.nbytes, "chunk_nbytes": self.chunk_nbytes,
                "crc32": list(self.crc32)}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "FileRecord":
        """A record read from a manifest, every field checked before use ([Note: a checkpoint is data] in
        infinity/checkpoint/reader.py): a path the writer makes (``rank<N>/<name>``, nothing that leaves the
        version directory), a size, a chunk size a save can write and 32-bit checksums, consistent."""
        if not isinstance(data, dict) or not isinstance(data.get("path"), str) or \
                not isinstance(data.get("crc32"), list) or len(data["crc32"]) > _MAX_CHUNKS:
            raise CheckpointCorruptError(f"{where}: malformed file record (a path, a size, a chunk size and a list "
                                         "of checksums expected)")
        path = data["path"]
        if not _RECORD_PATH.fullmatch(path):
            raise CheckpointCorruptError(f"{where}: file record path {path[:80]!r} is not rank<N>/<name> inside the "
                                         "checkpoint; nothing is read outside it")
        try:
            record = cls(path, _int(data["nbytes"]), _int(data["chunk_nbytes"]), tuple(_int(c) for c in data["crc32"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed file record of {path} ({exc})") from exc
        if not 0 <= record.nbytes <= _MAX_FILE_NBYTES:
            raise CheckpointCorruptError(f"{where}: file record of {path}: size {record.nbytes} out of range")
        chunk = record.chunk_nbytes
        if not (MIN_CHUNK_NBYTES <= chunk <= CHUNK_NBYTES and chunk % MIN_CHUNK_NBYTES == 0):
            raise CheckpointCorruptError(f"{where}: file record of {path}: chunk size {record.chunk_nbytes} is not one "
                                         f"a save writes (a multiple of {MIN_CHUNK_NBYTES} up to {CHUNK_NBYTES})")
        if any(not 0 <= c < 1 << 32 for c in record.crc32):
            raise CheckpointCorruptError(f"{where}: file record of {path}: a checksum is not a 32-bit value")
        expected = -(-record.nbytes // record.chunk_nbytes)
        if expected != len(record.crc32):
            raise CheckpointCorruptError(f"{where}: file record of {path} lists {len(record.crc32)} "
                                         f"checksums for {record.nbytes} bytes in chunks of {record.chunk_nbytes}")
        return record


_RECORD_PATH = re.compile(r"rank[0-9]{1,7}/[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")     # no "..": cannot start with "."
MIN_CHUNK_NBYTES = 4096
_MAX_FILE_NBYTES = 1 << 50
_MAX_CHUNKS = _MAX_FILE_NBYTES // MIN_CHUNK_NBYTES


def _int(value) -> int:
    """A JSON integer (not a bool, float or string that int() would take)."""
    if type(value) is not int:
        raise TypeError(f"{type(value).__name__} where an integer belongs")
    return value


def inside(directory: str, relpath: str) -> str:
    """``directory``/``relpath``, refused when it resolves outside ``directory`` (a symlink planted in a
    checkpoint); the caller then opens that path."""
    path = os.path.join(directory, relpath)
    real, base = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, base]) != base:
        raise CheckpointCorruptError(f"{path}: leads outside the checkpoint (a symlink?); nothing is read there")
    return path


class ChunkChecksum:
    """CRC-32 of each ``chunk_nbytes`` chunk of a stream of bytes fed in order (see [Note: checksums])."""

    def __init__(self, chunk_nbytes: int) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.crcs: list[int] = []
        self.nbytes = 0
        self._crc = 0
        self._filled = 0

    def feed(self, data) -> None:
        """Add the next bytes (any C-contiguous buffer: numpy array, bytes, memoryview)."""
        view = memoryview(data).cast("B")
        position = 0
        while position < len(view):
            take = min(self.chunk_nbytes - self._filled, len(view) - position)
            self._crc = zlib.crc32(view[position:position + take], self._crc)
            self._filled += take
            position += take
            if self._filled == self.chunk_nbytes:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0
        self.nbytes += len(view)

    def finish(self) -> tuple[int, ...]:
        if self._filled:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0
        return tuple(self.crcs)


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to a new file; make it durable later with :func:`sync_files` (batched)."""
    with open(path, "wb") as f:
        f.write(data)


def sync_files(paths: list[str]) -> None:
    """fsync every file, all at once from a few threads.

    Why in parallel: each fsync waits for a journal commit and a disk cache flush; issued
    together, the filesystem folds them into one or two commits (10 files: ~2-9 ms instead
    of ~30-40 ms here, and far more on a busy disk).
    """
    import concurrent.futures

    def one(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if len(paths) <= 1:
        for path in paths:
            one(path)
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), 16), thread_name_prefix="ckpt-fsync") as pool:
        for future in [pool.submit(one, path) for path in paths]:
            future.result()


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it (the caller fsyncs the directory)."""
    write_bytes(path, data)
    sync_files([path])


def write_small_file(directory: str, relpath: str, data: bytes, chunk_nbytes: int) -> FileRecord:
    """Write a small data file (buffers, extra) and return its record (the caller syncs it)."""
    write_bytes(os.path.join(directory, relpath), data)
    checksum = ChunkChecksum(chunk_nbytes)
    checksum.feed(data)
    return FileRecord(relpath, len(data), chunk_nbytes, checksum.finish())


def read_small_file(directory: str, record: FileRecord) -> bytes:
    """Read a small data file whole and verify it against its record."""
    path = inside(directory, record.path)
    try:
        data = _read_regular(path, record.nbytes)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path}: missing from the checkpoint") from exc
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CheckpointCorruptError(f"{path}: a symbolic link; not followed") from None
    if len(data) != record.nbytes:
        raise CheckpointCorruptError(f"{path}: not the {record.nbytes} bytes the manifest says (truncated, or "
                                     "longer)")
    checksum = ChunkChecksum(record.chunk_nbytes)
    checksum.feed(data)
    found = checksum.finish()
    for index, (want, got) in enumerate(zip(record.crc32, found)):
        if want != got:
            start = index * record.chunk_nbytes
            raise CheckpointCorruptError(
                f"{path}: bytes {start}..{min(start + record.chunk_nbytes, record.nbytes)} fail their CRC-32 "
                f"(expected {want:08x}); the file is corrupt")
    return data


def dump_json(data: dict) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=False) + "\n").encode()


def _read_regular(path: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file (not followed through a final symlink; a FIFO would block, a
    device never end) of at most ``limit`` bytes, checked before anything is read or allocated."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointCorruptError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise CheckpointCorruptError(f"{path}: larger than the {limit} bytes expected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


_MAX_MANIFEST_NBYTES = 256 << 20


def load_json(path: str, what: str, expect_crc: int | None = None) -> dict:
    """Read a JSON manifest; a missing, unreadable or (given ``expect_crc``) altered one is corrupt."""
    try:
        raw = _read_regular(path, _MAX_MANIFEST_NBYTES)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointCorruptError(f"{path}: the {what} is a symbolic link; not followed") from None
        if isinstance(exc, FileNotFoundError):
            raise CheckpointCorruptError(f"{path}: the {what} is missing") from exc
        raise
    if expect_crc is not None and zlib.crc32(raw) != expect_crc:
        raise CheckpointCorruptError(f"{path}: the {what} fails its CRC-32 recorded in COMMIT "
                                     f"(expected {expect_crc:08x}); it was altered")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: the {what} is nested too deeply to be a manifest") from None
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path}: the {what} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path}: the {what} is not a JSON object")
    return data
