"""A new file under a name nobody else can have chosen: for temporary outputs renamed into place later.

[Note: temporary names on a shared disk]
A name like ``OUT.tmp-<pid>`` is predictable: another user of a shared directory (``/scratch``, ``/tmp``)
plants a symlink under it, and opening the name with ``O_CREAT`` then truncates and writes the link's
target, a file of ours. So every temporary output is created here: a random name, ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (``tempfile.mkstemp``: a planted name only makes it draw another), and from then on written
through the descriptor it returns, never reopened by name. The file starts ``0600`` and is then given the
mode an ordinary ``open`` would give it (``0666`` less the umask, as ``torch.save`` does), so the output
renamed into place reads as the user expects.
"""
from __future__ import annotations

import os
import tempfile
import threading

_umask_lock = threading.Lock()


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:       # set and restore: the only way elsewhere
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def create(directory: str, prefix: str, suffix: str = "", private: bool = False) -> tuple[int, str]:
    """A new, empty file in ``directory``, opened read-write: ``(fd, path)``; the caller closes ``fd``.

    ``private``: keep it ``0600`` (swap and lock files); else it gets the umask's mode. See [Note: temporary
    names on a shared disk]."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    if not private:
        try:
            os.fchmod(fd, 0o666 & ~umask())
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
    return fd, path
