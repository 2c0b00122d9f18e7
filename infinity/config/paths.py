"""What a configured ``nvme_path`` is on this machine, said before anything is allocated there.

[Note: checking nvme_path]
A config may be written on one machine and used on another, so ``load_config`` refuses
only what is wrong everywhere the path could be meant: an ``nvme_path`` entry that exists
and is not a directory (a file). ``Init`` (through the tier set) and ``infinity-plan`` check
the rest, on the machine that will use the path: that it exists, is a directory this user
can write to and, when ``aio.direct`` is on, that its filesystem accepts ``O_DIRECT`` (a
probe file is created and removed). Each problem is a ``ConfigError`` on
``tiers.nvme_path`` that says which of these the path is.

[Note: the preset's placeholder path]
The ``nvme`` preset must name some ``nvme_path`` to be a whole config, and no directory is
right on every machine, so it names ``PRESET_PLACEHOLDER``. Left in place and missing, that
path is said to be the placeholder, with the ways to give a real directory
(``infinity.Init("nvme", nvme_path=DIR)``, ``infinity-plan --set tiers.nvme_path=DIR``, the
config file), not "create it first": a directory made at the root of the filesystem because an
error asked for it is the wrong disk more often than not. A ``/local_nvme`` that exists is used
like any other directory.
"""
from __future__ import annotations

import errno
import os
import uuid

from infinity.config.values import ConfigError

PRESET_PLACEHOLDER = "/local_nvme"
"""The ``tiers.nvme_path`` the ``nvme`` preset ships with ([Note: the preset's placeholder path])."""


def not_a_directory(path: str) -> str | None:
    """Why an existing ``path`` cannot hold swap files (a file, a device...), or None."""
    if not os.path.lexists(path) or os.path.isdir(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path!r} is a dangling symbolic link (to {os.readlink(path)!r}), not a directory"
    kind = "a file" if os.path.isfile(path) else "not a directory"
    return f"{path!r} is {kind}, not a directory; give the directory to keep swap files in"


def problem(path: str, direct: bool) -> str | None:
    """What is wrong with ``path`` as a swap directory on this machine, in words, or None."""
    if not os.path.lexists(path):
        if path == PRESET_PLACEHOLDER:
            return (f"{path!r} is the nvme preset's placeholder, not a directory on this machine: give your own "
                    "directory on a fast local disk, as infinity.Init(\"nvme\", nvme_path=DIR) (also "
                    "infinity.load_config and infinity.from_pretrained), infinity-plan --set tiers.nvme_path=DIR, "
                    "or set tiers.nvme_path in your config file")
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        return f"{path!r} does not exist (the nearest existing parent is {parent!r}); create it first"
    wrong = not_a_directory(path)
    if wrong:
        return wrong
    if not os.access(path, os.W_OK | os.X_OK):
        if _read_only(path):
            return (f"{path!r} is on a read-only file system (mounted read-only: no user can write there); give "
                    "a directory on a writable local disk")
        return f"{path!r} is a directory this user (uid {os.getuid()}) cannot write to"
    if direct:
        return _refuses_direct_io(path)
    return None


def _read_only(path: str) -> bool:
    """Whether ``path``'s file system is mounted read-only (statvfs's ST_RDONLY), where permissions are not the
    cause of a refused write and changing them would not help."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _refuses_direct_io(path: str) -> str | None:
    """Open a probe file with O_DIRECT in ``path``; the reason when the filesystem refuses it."""
    probe = os.path.join(path, f".infinity-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return (f"{path!r} is on a filesystem that refuses O_DIRECT (tmpfs or overlayfs on older "
                    "kernels); set aio.direct = false, or use a directory on a local disk")
        return f"{path!r}: cannot create a file there ({exc.strerror})"
    os.close(fd)
    try:
        os.unlink(probe)
    except FileNotFoundError:
        pass
    return None


def check_nvme_paths(paths, direct: bool, rank: int | None = None) -> None:
    """Raise a ``ConfigError`` on ``tiers.nvme_path`` for the first entry of ``paths`` that cannot be used."""
    for path in paths:
        why = problem(path, direct)
        if why:
            where = f" (rank {rank})" if rank is not None else ""
            raise ConfigError(why + where, "tiers.nvme_path")
