"""Lock files: one process's exclusive hold on a directory, visible to every other process.

[Note: lock files]
A lock is a file of its own held with ``fcntl.flock(LOCK_EX | LOCK_NB)`` and stamped with who
holds it, so a second taker fails at once and can name the holder. The kernel drops an flock
when its holder dies, so a crash never leaves a directory locked; the file itself may stay,
unlocked, for the next taker. A holder removes the file when it lets go, which opens a race:
a taker that opened the file just before the holder unlinked it would lock an inode nobody
else can see, while a third process creates a new file and locks that too. So after the flock
the taker checks that the path still names the inode it locked, and starts over if not.
A lock file lives in a directory other users may write (a shared scratch disk): it is opened without
following a symlink (``O_NOFOLLOW``: a planted link would make the taker truncate the link's target),
must be a regular file of this user's, is created ``0600``, and the inode check reads the path itself
(``lstat``).
Users: swap directories ([Note: one owner per directory] in tiers/swapfile.py) and checkpoint
saves ([Note: one saver per directory] in infinity/checkpoint/directory.py).
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat

__all__ = ["LockBusy", "take", "release"]

_ATTEMPTS = 100


class LockBusy(Exception):
    """Another process holds the lock (``holder``: its stamp), or keeps replacing the file (``holder`` None)."""

    def __init__(self, path: str, holder: str | None) -> None:
        super().__init__(path, holder)
        self.path, self.holder = path, holder


def take(path: str, stamp: str) -> int:
    """Lock ``path`` (created when missing) and write ``stamp`` into it; the descriptor that holds it.

    Raises :class:`LockBusy` when another process holds it, and ``OSError`` when the file cannot be
    opened or written (the caller names what the directory was for).
    """
    for _attempt in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "the lock file is a symbolic link (planted by another user on a shared "
                                           "disk?); refusing to follow it", path) from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise OSError(errno.EPERM, f"the lock file is not a regular file of this user's (owner uid "
                                           f"{info.st_uid}); refusing to use it", path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockBusy(path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = _same_file(os.lstat(path), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if same:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{stamp}\n".encode(), 0)
            except BaseException:
                release(path, fd)
                raise
            return fd
        os.close(fd)
    raise LockBusy(path, None)


def release(path: str, fd: int) -> None:
    """Remove ``path`` if it is still the file ``fd`` holds, then drop the lock."""
    try:
        if _same_file(os.lstat(path), os.fstat(fd)):
            os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
