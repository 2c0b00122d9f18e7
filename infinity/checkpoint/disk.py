"""What the disk said during a save, in words: the file, the bytes wanted, the bytes free.

[Note: save errors name the bytes]
A full disk used to surface as a bare ``[Errno 28] No space left on device`` for the
manifest, ``COMMIT`` and ``latest`` writes, with no path and no size. Every write, fsync,
rename and directory creation of a save runs inside :func:`writing`, which turns an
``OSError`` into a :class:`CheckpointWriteError` naming the file, its bytes, what this rank's
save needs in all and what its filesystem has free, with a hint for the usual causes
(``ENOSPC``, ``EDQUOT``, ``EFBIG`` from a file size limit). Before anything is written, each
rank also checks that its filesystem has room for its share (:func:`check_room`), so an
obviously full disk fails before the first byte.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager

from infinity.checkpoint.errors import CheckpointError, CheckpointWriteError

_HINTS = {
    errno.ENOSPC: "the disk is full: free space there or save elsewhere",
    errno.EDQUOT: "the user's disk quota is used up",
    errno.EFBIG: "the file is larger than this process may write (the file size limit, `ulimit -f`)",
    errno.EROFS: "the filesystem is mounted read-only",
    errno.EACCES: "this user may not write there",
    errno.EIO: "the disk reported an I/O error",
}


def human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def free_bytes(path: str) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (or of its nearest existing parent)."""
    probe = os.path.abspath(path)
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


class SaveSize:
    """The bytes one rank's save writes in all, to say beside any error of one of its files."""

    def __init__(self, root: str, nbytes: int, rank: int) -> None:
        self.root, self.nbytes, self.rank = root, nbytes, rank

    def describe(self, exc: OSError, path: str, nbytes: int | None, what: str) -> str:
        reason = exc.strerror or str(exc)
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "?"
        free = free_bytes(path)
        size = f"writing {human(nbytes)} ({nbytes} bytes)" if nbytes is not None else "during the save"
        room = f"{human(free)} ({free} bytes) free there" if free is not None else "free space unknown"
        hint = _HINTS.get(exc.errno)
        return (f"{what} {path}: {reason} ({code}) {size}; rank {self.rank}'s save of checkpoint {self.root} "
                f"needs {human(self.nbytes)} ({self.nbytes} bytes) in all, {room}"
                + (f"; {hint}" if hint else "") + ". The previous checkpoint is intact")


@contextmanager
def writing(size: SaveSize, path: str, nbytes: int | None, what: str = "checkpoint file"):
    """Run a write (or fsync, rename, mkdir) of ``path``; an ``OSError`` becomes a ``CheckpointWriteError``
    naming ``path``, ``nbytes``, the save's size and the free space (see [Note: save errors name the bytes])."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointWriteError(size.describe(exc, path, nbytes, what), exc.errno) from exc


def check_room(size: SaveSize) -> None:
    """Refuse a save whose rank's share does not fit the free space, before it writes anything."""
    free = free_bytes(size.root)
    if free is not None and free < size.nbytes:
        raise CheckpointWriteError(
            f"checkpoint {size.root}: rank {size.rank}'s save needs {human(size.nbytes)} ({size.nbytes} bytes), "
            f"its filesystem has {human(free)} ({free} bytes) free; nothing was written and the previous "
            "checkpoint is intact: free space there or save elsewhere", errno.ENOSPC)
