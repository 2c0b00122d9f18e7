"""One NVMe directory's swap file: its lock, its header, its slots (shared/DESIGN.md, "tiers").

[Note: one owner per directory]
Each swap directory holds ``.<tier>.lock`` and ``<tier>.swap``. The lock file is held
with ``fcntl.flock(LOCK_EX | LOCK_NB)`` for the life of the tier and names the holder
(pid, run id), so a second process (or a second tier of the same name in this
process) fails at once with :class:`SwapDirectoryLockedError` naming the directory and
the holder, instead of clobbering its slots. flock is released by the kernel when the
holder dies, so a crash never leaves a directory locked ([Note: lock files] in tiers/lockfile.py).

[Note: stale swap files]
Keys live only in the memory of the process that wrote them: a swap file is never
reopened as data. A swap file found while taking the lock was left by a run that
crashed (a clean close deletes it). Its header (magic, run id, pid, time) is read
only to say whose it was; then it is removed (``stale="remove"``, with a warning) or
refused (``stale="refuse"``, :class:`StaleSwapFileError`). A corrupted header is
reported as such and treated the same way. While running, :meth:`SwapFile.diagnose`
explains I/O errors: the file removed, replaced, truncated, or its header overwritten.

[Note: checking a live swap file]
Keys' bytes are lost when something outside the process cuts or overwrites the swap file:
a truncated file reads back short, and worse, a later write past the cut grows it again
with a hole where other keys were, which then reads as zeros. So the identity of the file
(inode and device) is checked when it is opened (the descriptor and the path must name one
file), and :meth:`SwapFile.check`, which the engine calls before each step's reads, raises
:class:`SwapFileDamagedError` naming the file when it is shorter than this run's slots or
its header was overwritten. A file removed or replaced at its path only warns (once): the
open descriptor still reaches this run's bytes, which live only as long as the run anyway.

[Note: sealed swap files]
A swap file can outlive its run as a checkpoint ("the swap files are the checkpoint", for a
model whose states fill the disk so that no copy fits beside them). ``seal(label)`` flushes
the file and renames it ``<tier>.<label>.sealed`` in its directory: a later run's stale-file
check looks only at ``<tier>.swap``, so it never removes a sealed file, and closing the
sealing tier leaves it. A later run *adopts* it (``adopt=`` the sealed path): it takes the
directory's lock, checks the header, and opens the file where it lies, without writing
anything; ``claim`` then marks the slots of the keys it takes over as used and gives the
space between them back to the filesystem (bytes no key of the checkpoint holds). The file
keeps its name, and so stays a valid checkpoint, until the first write into it:
``consume`` renames it ``<tier>.swap`` and writes this run's header. A run that adopts and
fails before writing (or is killed) leaves the checkpoint as it found it.

[Note: disk blocks follow the live slots]
A freed slot inside the file (not at its end) has its blocks handed back to the
filesystem with ``fallocate(PUNCH_HOLE)``, and a slot that reuses a hole reserves its
blocks again with ``posix_fallocate`` before any data moves. So the disk holds the
bytes of the live keys (plus the header), not the file's high-water mark: a model
whose construction frees temporary keys in the middle of the file (the initial
masters) does not keep their blocks, which at the scale of a disk-sized model is
the difference between fitting and ENOSPC. Filesystems that cannot punch holes keep
the old behaviour (holes are reused, blocks stay allocated).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import socket
import threading
import time
import warnings

import torch

from tiers.aio import ALIGNMENT, AioHandle, aligned_empty
from tiers.base import TierFullError, format_nbytes
from tiers import lockfile
from tiers.freelist import FreeList

_MAGIC = b"INFINITY-SWAP-1\n"
_HEADER_NBYTES = ALIGNMENT
_STALE_CHOICES = ("remove", "refuse")
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _libc_fallocate():
    """libc's ``fallocate(fd, mode, offset, len)`` (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


class SwapDirectoryError(OSError):
    """The swap directory is missing, not a directory, or not writable."""


class SwapDirectoryLockedError(RuntimeError):
    """Another process (or another tier in this one) holds the directory's lock."""


class StaleSwapFileError(RuntimeError):
    """A swap file left by an earlier run was found and ``stale="refuse"``."""


class SwapFileDamagedError(OSError):
    """A swap file was cut or overwritten under the running job; the message names the file and what changed."""


class NVMeSpaceError(TierFullError):
    """The filesystem of a swap directory has no room for a new slot (``errno`` is ENOSPC)."""

    errno = errno.ENOSPC


def sealed_name(tier_name: str, label: str) -> str:
    """The file name a swap file of ``tier_name`` takes when sealed as checkpoint ``label``."""
    return f"{tier_name}.{label}.sealed"


def has_swap_header(fd: int) -> bool:
    """Whether the open file ``fd`` starts with an infinity swap header (a file a tier made), read by pread."""
    try:
        return os.pread(fd, len(_MAGIC), 0) == _MAGIC
    except OSError:
        return False


def _read_header(path: str) -> str:
    """Who wrote the swap file at ``path``, in words (never trusted as data)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(_HEADER_NBYTES)
    except OSError as exc:
        return f"unreadable header ({exc.strerror})"
    if not raw.startswith(_MAGIC):
        return f"not an infinity swap header ({len(raw)} bytes: corrupted, truncated or foreign)"
    try:
        meta = json.loads(raw[len(_MAGIC):].rstrip(b"\0 \n").decode())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta["created"]))
        return f"run {meta['run_id']} (pid {meta['pid']} on {meta['host']}, started {when})"
    except (ValueError, KeyError, TypeError):
        return "an infinity swap header whose metadata is corrupted"


def _new_header(run_id: str, tier_name: str) -> torch.Tensor:
    """A header block naming this run (magic, run id, pid, host, time): never trusted as data."""
    meta = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(),
            "created": time.time(), "tier": tier_name, "slot_alignment": ALIGNMENT}
    raw = _MAGIC + json.dumps(meta).encode() + b"\n"
    header = aligned_empty(_HEADER_NBYTES)
    header.zero_()
    header[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return header


def _adoptable(directory: str, path: str) -> str:
    """``path``, absolute, once it is a sealed swap file in ``directory`` with an infinity header."""
    path = os.path.abspath(path)
    if os.path.dirname(path) != directory:
        raise ValueError(f"sealed swap file {path} is not in nvme_path directory {directory}; a swap "
                         "file is adopted where it was sealed")
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "sealed swap file of the checkpoint is missing (deleted, or "
                                "already consumed by a run that resumed from it and trained)", path)
    whose = _read_header(path)
    if whose.startswith(("not an", "unreadable", "an infinity swap header whose")):
        raise SwapFileDamagedError(errno.EINVAL, f"sealed swap file cannot be adopted: {whose}", path)
    return path


def _header_of(path: str) -> torch.Tensor:
    """The header block of the file at ``path`` (an adopted file keeps its own until consumed)."""
    header = aligned_empty(_HEADER_NBYTES)
    with open(path, "rb") as handle:
        raw = handle.read(_HEADER_NBYTES)
    header.zero_()
    header[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return header


class DirectoryLock:
    """The lock of one swap directory ([Note: one owner per directory]): taken at construction, ``release``d."""

    def __init__(self, directory: str, tier_name: str, run_id: str) -> None:
        self.directory, self.tier_name, self.run_id = directory, tier_name, run_id
        self.path = os.path.join(directory, f".{tier_name}.lock")
        self._fd = self._take()

    def _take(self) -> int:
        try:
            return lockfile.take(self.path, f"pid {os.getpid()} run {self.run_id}")
        except lockfile.LockBusy as busy:
            if busy.holder is None:
                raise SwapDirectoryLockedError(f"nvme_path {self.directory}: lock file {self.path} keeps "
                                               "being replaced by another process; cannot take the lock") from None
            raise SwapDirectoryLockedError(self._message(busy.holder)) from None

    def _message(self, holder: str) -> str:
        who = holder
        fields = holder.split()
        if len(fields) >= 2 and fields[0] == "pid" and fields[1] == str(os.getpid()):
            who = f"this process ({holder}): another tier named {self.tier_name!r} is open on it; close it first"
        else:
            who = f"another process ({holder})"
        return (f"nvme_path {self.directory} is locked by {who}; lock file {self.path}. "
                "Two processes must not share swap files: give each process (rank) its own nvme_path "
                "or tier name, or stop the other process")

    def release(self) -> None:
        if self._fd < 0:
            return
        lockfile.release(self.path, self._fd)
        self._fd = -1


class SwapFile:
    """The swap file of one directory, locked for this process, with aligned slots.

    Parameters
    ----------
    directory : str
        An existing, writable directory (the config's ``nvme_path`` entry).
    tier_name : str
        Names the files (``<tier_name>.swap``, ``.<tier_name>.lock``).
    run_id : str
        Written into the header and the lock file.
    handle : AioHandle
        Opens the file (with its ``direct`` setting) and writes the header.
    stale : {"remove", "refuse"}
        What to do with a swap file left by a crashed run; see [Note: stale swap files].
    adopt : str | None
        A sealed swap file in ``directory`` to take over instead of creating a new one (see
        [Note: sealed swap files]); its slots are taken with :meth:`claim`.
    """

    def __init__(self, directory: str, tier_name: str, run_id: str, handle: AioHandle,
                 stale: str = "remove", adopt: str | None = None) -> None:
        if stale not in _STALE_CHOICES:
            raise ValueError(f"stale must be one of {_STALE_CHOICES}, got {stale!r}")
        self.directory = os.path.abspath(directory)
        self._check_directory()
        self.path = os.path.join(self.directory, f"{tier_name}.swap")
        self.tier_name = tier_name
        self.run_id = run_id
        self._lock = threading.Lock()
        self._can_punch = _fallocate is not None
        self._warned = False
        # Whether the file at ``self.path`` is this run's own swap file, deleted at close; not once sealed,
        # nor while an adopted checkpoint has not been written to ([Note: sealed swap files]).
        self.owned = adopt is None
        self._dir_lock = DirectoryLock(self.directory, tier_name, run_id)
        self.lock_path = self._dir_lock.path
        try:
            self._clear_stale(stale)
            if adopt is None:
                self.file = handle.open(self.path, "rw", create=True, perms=0o600)   # the weights: this user's
                self._identity = self._check_identity()
                self._header = _new_header(run_id, tier_name)
                handle.pwrite(self.file, self._header, 0).wait()
            else:
                self.path = _adoptable(self.directory, adopt)
                self.file = handle.open(self.path, "rw")
                self._identity = self._check_identity()
                self._header = _header_of(self.path)
        except BaseException:
            self._dir_lock.release()
            raise
        self._slots = FreeList(start=_HEADER_NBYTES, alignment=ALIGNMENT)
        self._handle = handle

    def _check_directory(self) -> None:
        if not os.path.exists(self.directory):
            raise SwapDirectoryError(errno.ENOENT, "nvme_path directory does not exist (create it first, "
                                     "or fix the path in [tiers] nvme_path)", self.directory)
        if not os.path.isdir(self.directory):
            raise SwapDirectoryError(errno.ENOTDIR, "nvme_path is not a directory", self.directory)
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise SwapDirectoryError(errno.EACCES, "nvme_path directory is not writable by this user",
                                     self.directory)

    def _check_identity(self) -> tuple[int, int]:
        """(inode, device) of the opened file, which must be the one at ``self.path`` ([Note: checking a live
        swap file])."""
        opened = os.fstat(self.file.fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        if named is None or (named.st_ino, named.st_dev) != (opened.st_ino, opened.st_dev):
            self.file.close()
            raise SwapFileDamagedError(errno.ESTALE, "swap file was removed or replaced by another process while "
                                       "this one opened it; is another job using this nvme_path?", self.path)
        return opened.st_ino, opened.st_dev

    def _clear_stale(self, stale: str) -> None:
        if not os.path.lexists(self.path):
            return
        whose = _read_header(self.path)
        if stale == "refuse":
            raise StaleSwapFileError(
                f"stale swap file {self.path} from an earlier run that did not close cleanly ({whose}); "
                "its contents are never reused. Delete it, or construct the tier with stale='remove'"
            )
        os.unlink(self.path)
        warnings.warn(f"removed stale swap file {self.path} left by {whose}; its contents are not reused",
                      RuntimeWarning, stacklevel=4)

    # -- slots --------------------------------------------------------------------------------
    def allocate(self, nbytes: int, what: str) -> int:
        """File offset of a new slot of ``nbytes`` (rounded up to 4096), space reserved on disk.

        Raises :class:`NVMeSpaceError` when the filesystem is full; nothing changes then.
        """
        with self._lock:
            old_end = self._slots.end
            offset = self._slots.allocate(nbytes)
            # A reused hole (its blocks maybe punched out) or new blocks at the end: reserve either way.
            try:
                self._reserve(offset, self._slots.round_up(nbytes), old_end)
            except OSError as exc:
                self._slots.release(offset, nbytes)
                # posix_fallocate may have reserved some blocks before the disk ran out (ext4 does): past the
                # old end the file is cut back, a reused hole punched again. Best effort: the slot is free anyway.
                size = self._slots.round_up(nbytes)
                try:
                    if offset + size > old_end and os.fstat(self.file.fd).st_size > old_end:
                        os.ftruncate(self.file.fd, old_end)
                    if offset < old_end:
                        self._punch(offset, min(size, old_end - offset))
                except OSError:
                    pass
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NVMeSpaceError(
                        f"no space left on nvme_path {self.directory} for {what} "
                        f"({format_nbytes(nbytes)}): {format_nbytes(self.disk_free())} free. Nothing "
                        "was written; existing keys are intact. Free space or add another nvme_path"
                    ) from exc
                raise OSError(exc.errno, f"cannot reserve swap file space for {what}: {exc.strerror}",
                              self.path) from exc
            return offset

    def claim(self, slots: list[tuple[int, int]]) -> None:
        """Take the ``(offset, nbytes)`` slots of an adopted file's keys; the space between them and past
        the last is given back to the filesystem (no key of the checkpoint holds it)."""
        if self.owned:
            raise RuntimeError(f"swap file {self.path}: claim is for an adopted sealed file")
        with self._lock:
            holes = self._slots.claim(slots)
            for offset, size in holes:
                self._punch(offset, size)
            if os.fstat(self.file.fd).st_size > self._slots.end:
                os.ftruncate(self.file.fd, self._slots.end)

    def consume(self) -> None:
        """Before the first write into an adopted file: it stops being a checkpoint and becomes this
        run's ``<tier>.swap``, with this run's header ([Note: sealed swap files])."""
        with self._lock:
            if self.owned:
                return
            final = os.path.join(self.directory, f"{self.tier_name}.swap")
            os.rename(self.path, final)
            fsync_dir(self.directory)
            self.path = final
            self._header = _new_header(self.run_id, self.tier_name)
            self._handle.pwrite(self.file, self._header, 0).wait()
            self.owned = True

    def seal(self, label: str) -> str:
        """Flush the file and rename it ``<tier>.<label>.sealed``; closing then leaves it (the caller
        writes no more into it). Returns the new path ([Note: sealed swap files])."""
        with self._lock:
            if not self.owned:
                raise RuntimeError(f"swap file {self.path} is already a checkpoint (sealed or adopted and not "
                                   "written since); it cannot be sealed again")
            os.fsync(self.file.fd)
            sealed = os.path.join(self.directory, sealed_name(self.tier_name, label))
            os.rename(self.path, sealed)
            fsync_dir(self.directory)
            self.path = sealed
            self.owned = False
        return sealed

    def unseal(self) -> None:
        """Undo :meth:`seal` (a save that failed after it): the file is this run's ``<tier>.swap`` again."""
        with self._lock:
            final = os.path.join(self.directory, f"{self.tier_name}.swap")
            os.rename(self.path, final)
            fsync_dir(self.directory)
            self.path = final
            self.owned = True

    def _reserve(self, offset: int, size: int, old_end: int) -> None:
        # posix_fallocate reserves the blocks now, so a full disk fails here, before any
        # data moves, rather than in the middle of a write; reads of reserved but unwritten
        # blocks return zeros. A slot reusing a hole reserves it again: its blocks may have
        # been punched (see [Note: disk blocks follow the live slots]). Filesystems without
        # fallocate get a sparse file instead.
        try:
            os.posix_fallocate(self.file.fd, offset, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            if offset + size > old_end:
                os.ftruncate(self.file.fd, offset + size)

    def release(self, offset: int, nbytes: int) -> None:
        """Return a slot: at the end of the file the file shrinks, inside it the blocks are punched out."""
        with self._lock:
            old_end = self._slots.end
            self._slots.release(offset, nbytes)
            if self._slots.end < old_end:
                os.ftruncate(self.file.fd, self._slots.end)
            else:
                self._punch(offset, self._slots.round_up(nbytes))

    def _punch(self, offset: int, size: int) -> None:
        if not self._can_punch:
            return
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if _fallocate(self.file.fd, mode, offset, size) != 0:
            # The slot is free either way and nothing is lost: only its blocks stay allocated
            # (the hole is still reused). Stop trying on this file.
            err = ctypes.get_errno()
            self._can_punch = False
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                warnings.warn(f"swap file {self.path}: cannot give freed blocks back to the filesystem "
                              f"({os.strerror(err)}); freed slots keep their disk space", RuntimeWarning,
                              stacklevel=3)

    def disk_free(self) -> int:
        """Free bytes on this directory's filesystem."""
        stat = os.fstatvfs(self.file.fd)
        return stat.f_bavail * stat.f_frsize

    def filesystem(self) -> int:
        return os.fstat(self.file.fd).st_dev

    def stats(self) -> dict:
        with self._lock:
            return {"path": self.path, "file_nbytes": self._slots.end, "hole_bytes": self._slots.hole_bytes,
                    "holes": self._slots.holes}

    @property
    def file_nbytes(self) -> int:
        with self._lock:
            return self._slots.end

    # -- health -------------------------------------------------------------------------------
    def diagnose(self) -> str | None:
        """Why I/O on this file may fail, in words, or None when it looks healthy."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return (f"swap file {self.path} was removed (directory deleted?); its data stays readable "
                    "through the open descriptor until the tier closes")
        if (stat.st_ino, stat.st_dev) != self._identity:
            return f"swap file {self.path} was replaced by another file"
        size = os.fstat(self.file.fd).st_size
        if size < self.file_nbytes:
            return (f"swap file {self.path} was truncated to {size} bytes; this run's slots reach "
                    f"{self.file_nbytes} bytes: data past the cut is lost")
        with open(self.path, "rb") as handle:
            if handle.read(_HEADER_NBYTES) != bytes(self._header.numpy()):
                return f"the header of swap file {self.path} was overwritten (the file is corrupted)"
        return None

    def check(self) -> None:
        """Raise :class:`SwapFileDamagedError` when this run's bytes in the file were cut or overwritten; warn
        once when its path no longer names it (see [Note: checking a live swap file])."""
        with self._lock:
            size = os.fstat(self.file.fd).st_size
            end = self._slots.end
        if size < end:
            raise SwapFileDamagedError(
                errno.EIO, f"swap file was truncated under this run to {size} bytes; its slots reach {end} "
                f"bytes, so the keys past byte {size} are lost. Something outside this process cut the file: "
                "give each job its own nvme_path", self.path)
        try:   # the descriptor's own file, without O_DIRECT, even if the path now names another
            with open(f"/proc/self/fd/{self.file.fd}", "rb") as handle:
                header = handle.read(_HEADER_NBYTES)
        except OSError:
            header = None
        if header is not None and header != bytes(self._header.numpy()):
            raise SwapFileDamagedError(errno.EIO, "the header of this run's swap file was overwritten: something "
                                       "outside this process writes into it, so its keys cannot be trusted", self.path)
        moved = self.diagnose()     # by now only: removed or replaced at its path
        if moved and not self._warned:
            self._warned = True
            warnings.warn(f"{moved}; this run keeps using its own file through the open descriptor",
                          RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Close and delete the swap file (not a checkpoint: sealed, or adopted and unwritten), then release
        the directory lock."""
        if self.file.closed:
            return
        self.file.close()
        try:
            named = os.stat(self.path)
            if self.owned and (named.st_ino, named.st_dev) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._dir_lock.release()

    def __repr__(self) -> str:
        return f"SwapFile({self.path!r}, nbytes={self.file_nbytes})"


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
