"""The file side of asynchronous I/O: :class:`AioFile` and :func:`open_file` (re-exported by
``tiers.aio``, whose [Note: aio futures] describes the requests made on them).

A file is opened for requests at file offsets, so only regular files and block devices are
accepted: a FIFO, socket or character device has no offsets (a thread-pool read fails with
"Illegal seek"; an io_uring read from a FIFO waits for a writer forever), and is refused when it
is opened, without blocking, and again by the C core when a request is submitted.
"""
from __future__ import annotations

import errno as errno_mod
import os
import stat
from pathlib import Path
from typing import Any, Callable

__all__ = ["AioFile", "open_file"]


class AioFile:
    """An open file for :class:`tiers.aio.AioHandle` requests; owns its descriptor.

    Attributes
    ----------
    path : str
    fd : int
    mode : str  ("r", "w" or "rw")
    direct : bool  (opened with ``O_DIRECT``)
    """

    __slots__ = ("path", "fd", "mode", "direct", "_pending", "_prune_at", "__weakref__")

    def __init__(self, path: str, fd: int, mode: str, direct: bool) -> None:
        self.path = path
        self.fd = fd
        self.mode = mode
        self.direct = direct
        # Request id -> C core, for every request on this file not yet reaped (its future may be
        # gone). close() waits for them so the descriptor is never closed, and its number reused
        # by another open(), while the kernel still reads or writes through it.
        self._pending: dict[int, Any] = {}
        self._prune_at = _PENDING_PRUNE

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @property
    def pending_requests(self) -> int:
        """Requests on this file not known to be reaped (finished ones are pruned from time to time)."""
        return len(self._pending)

    def track(self, rid: int, core: Any, awaited: Callable[[int], bool]) -> None:
        """Remember request ``rid`` of ``core`` until it is reaped, so ``close`` can wait for it.

        Requests whose futures were dropped unreaped stay listed; the finished ones nobody
        ``awaited`` any more are forgotten. Pruning again only after the list doubles keeps the
        cost amortised O(1) per request.
        """
        if len(self._pending) >= self._prune_at:
            for old_id, old_core in list(self._pending.items()):
                if old_core.done(old_id) and not awaited(old_id):
                    del self._pending[old_id]
            self._prune_at = max(_PENDING_PRUNE, 2 * len(self._pending))
        self._pending[rid] = core

    def untrack(self, rid: int) -> None:
        """Request ``rid`` was reaped."""
        self._pending.pop(rid, None)

    def fileno(self) -> int:
        if self.fd < 0:
            raise ValueError(f"I/O operation on closed file {self.path}")
        return self.fd

    def size(self) -> int:
        """Current size of the file in bytes."""
        return os.fstat(self.fileno()).st_size

    def truncate(self, nbytes: int) -> None:
        """Set the file size (sparse growth); used to lay out swap files."""
        os.ftruncate(self.fileno(), nbytes)

    def close(self) -> None:
        """Close the descriptor; wait for this file's in-flight requests first."""
        if self.fd >= 0:
            pid = os.getpid()
            for rid, core in list(self._pending.items()):
                if core.owner_pid == pid:  # a fork child only closes its copy of the descriptor
                    core.wait(rid, -1.0)
            self._pending.clear()
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass

    def __repr__(self) -> str:
        state = "closed" if self.fd < 0 else f"fd={self.fd}"
        return f"AioFile({self.path!r}, mode={self.mode!r}, direct={self.direct}, {state})"


_MODE_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
_PENDING_PRUNE = 1024


def open_file(path: str | os.PathLike[str], mode: str, *, direct: bool = True, create: bool = False,
              perms: int = 0o644) -> AioFile:
    """Open ``path`` for asynchronous I/O.

    Parameters
    ----------
    path : path to the file.
    mode : ``"r"``, ``"w"`` or ``"rw"``.
    direct : open with ``O_DIRECT`` (bypass the page cache); requests must then be aligned.
    create : create the file when missing (never truncates).

    Raises
    ------
    OSError
        ``FileNotFoundError`` for a missing file or directory, ``PermissionError`` for a read-only
        one, ``OSError(EINVAL)`` when the filesystem refuses ``O_DIRECT`` (the message says to pass
        ``direct=False``), ``OSError(ESPIPE)`` for a FIFO, socket or character device and
        ``IsADirectoryError`` for a directory: requests address file offsets, which only regular
        files and block devices have (opening a FIFO does not block).

    Examples
    --------
    >>> f = open_file("/tmp/swap.bin", "rw", create=True)  # doctest: +SKIP
    """
    if mode not in _MODE_FLAGS:
        raise ValueError(f"open_file: mode must be one of 'r', 'w', 'rw', got {mode!r}")
    spath = os.fspath(path)
    flags = _MODE_FLAGS[mode] | os.O_CLOEXEC | os.O_NONBLOCK   # a FIFO's open would wait for a writer
    if create:
        flags |= os.O_CREAT
    if direct:
        flags |= os.O_DIRECT
    try:
        fd = os.open(spath, flags, perms)     # the umask applies: swap files ask 0600, checkpoints 0644
    except OSError as e:
        if direct and e.errno == errno_mod.EINVAL:
            raise OSError(
                e.errno,
                "the filesystem refuses O_DIRECT (e.g. an old tmpfs or overlayfs); "
                "open with direct=False (config [aio] direct = false)",
                spath,
            ) from e
        if e.errno == errno_mod.ENXIO:           # a FIFO opened for writing with no reader
            _check_kind(spath, os.stat(spath).st_mode)
        if e.errno == errno_mod.ENOENT and not Path(spath).parent.exists():
            raise FileNotFoundError(e.errno, f"directory {Path(spath).parent} does not exist", spath) from e
        raise
    try:
        _check_kind(spath, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return AioFile(spath, fd, mode, direct)


def _check_kind(path: str, st_mode: int) -> None:
    """Refuse what has no file offsets: reads would fail ("Illegal seek") or, on io_uring, never end."""
    if stat.S_ISREG(st_mode) or stat.S_ISBLK(st_mode):
        return
    kind = ("a FIFO" if stat.S_ISFIFO(st_mode) else "a socket" if stat.S_ISSOCK(st_mode)
            else "a character device" if stat.S_ISCHR(st_mode) else "a directory" if stat.S_ISDIR(st_mode)
            else "not a regular file")
    code = errno_mod.EISDIR if stat.S_ISDIR(st_mode) else errno_mod.ESPIPE
    raise OSError(code, f"{kind}: aio reads and writes regular files and block devices only", path)
