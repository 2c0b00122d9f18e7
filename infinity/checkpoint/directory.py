"""The checkpoint directory on disk: versions, the ``latest`` pointer, and how a save is committed.

[Note: checkpoint layout]
``save_checkpoint(path, ...)`` treats ``path`` as a directory it owns::

    path/
      latest                      text: the name of the current version ("step00000120-3f9c...")
      step00000120-3f9c.../       one committed version
        COMMIT                    written last: id, step, world size, CRC-32 of every manifest
        manifest.json             global: config, groups and parameter names, layout, optimizer
        rank0/manifest.json       per rank: file records (size, chunk CRCs), RNG states
        rank0/params.bin          compute-copy shards of every group, back to back, group order
        rank0/master.bin          fp32 master shards: this rank's flat optimizer space
        rank0/exp_avg.bin, rank0/exp_avg_sq.bin
        rank0/buffers.bin         module buffers (rank 0 only)
        rank0/extra.pt            ``extra`` of this rank (torch.save), when given
        rank1/...
      .tmp-<id>/                  a save in progress (or killed): never read, removed by the next save

[Note: commit protocol]
Every rank writes its files under ``path/.tmp-<id>/rank<r>/`` and fsyncs them and its
directory. The ranks then agree (an all-reduce) that all of them succeeded. Only
rank 0 goes on: it writes the global manifest and ``COMMIT`` (fsynced), renames the
temporary directory to ``step<k>-<id>`` (fsync of ``path``), then writes
``latest.tmp-<id>`` and renames it over ``latest`` (fsync of ``path``). That last
rename is the commit point: ``rename(2)`` replaces ``latest`` atomically, so at every
instant ``latest`` names either the previous version or the new one, both complete.
Only then are older versions (beyond ``keep``) and leftovers of killed saves retired.

[Note: deleting old versions]
A retired directory is first renamed to ``.trash-<name>`` (atomic: a half-deleted
version never looks committed), then deleted on a background thread, so the save
returns as soon as the new version is committed. Freeing a multi-GB version can
take seconds on a busy disk (measured: up to 9 s for 3 GB here, while the save
itself took 1.9 s), which training need not wait for. The thread is not a daemon:
the interpreter finishes the deletion before exiting; if the process is killed, the
next save removes the ``.trash-*`` leftovers. A process reading the previous version
while a save retires it keeps the files it has open but finds the others gone: jobs
that read checkpoints beside training (evaluation) should save with ``keep >= 2``.

We chose this over writing ``path.tmp``, renaming ``path`` to ``path.old`` and the new
directory to ``path``: ``rename(2)`` cannot replace a non-empty directory, so that
scheme has a moment where ``path`` does not exist at all and a crash there leaves
the reader to guess between two directories. With the pointer there is one atomic
step, ``path`` always exists, and a version directory (named explicitly) can be
loaded or consolidated on its own. Ranks must share the filesystem holding ``path``
(rank 0 reads every rank's manifest to commit); one job writes to a ``path`` at a time.

[Note: one saver per directory]
A save writes under the checkpoint directory and then retires what it finds there (older
versions, leftovers of killed saves): two jobs saving to one directory at once would retire
each other's files. So rank 0 holds ``.save-lock`` (``flock``, exclusive, non-blocking) from
before any rank writes until its commit is done, and a second saver fails at once with
:class:`CheckpointLockedError` naming the holder; the kernel drops the lock when its holder
dies, so a killed save never leaves the directory locked. The lock file is removed when the
save ends (a killed save leaves it, unlocked, for the next save to take and remove); taking and
dropping it: [Note: lock files] in tiers/lockfile.py.
Holding the lock, a save first removes the leftovers of failed or killed saves (``.tmp-*``,
``latest.tmp-*``, and versions newer than the one ``latest`` names, which a save that failed
between its two renames left behind; ``.trash-*`` too when the disk is short of room for the
save, else they stay with the background deletion), so that their bytes do not fill the disk
the retry needs.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import threading
import time
import zlib

from infinity.checkpoint import schema
from infinity.checkpoint.disk import SaveSize, writing
from infinity.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLockedError,
                                        CheckpointMismatchError, CheckpointNotFoundError, CheckpointWriteError)
from infinity.checkpoint.manifest import (COMMIT, FORMAT, LATEST, MANIFEST, VERSION, FileRecord, dump_json,
                                          fsync_dir, inside, load_json, sync_files, write_bytes, write_durably)
from tiers import lockfile

_TMP = ".tmp-"
_TRASH = ".trash-"
_LOCK = ".save-lock"


def tmp_dir(root: str, save_id: str) -> str:
    return os.path.join(root, f"{_TMP}{save_id}")


def version_name(step: int, save_id: str) -> str:
    return f"step{step:08d}-{save_id}"


def rank_dir(version: str, rank: int) -> str:
    return os.path.join(version, f"rank{rank}")


def commit(root: str, tmp: str, name: str, record: dict, keep: int, size: SaveSize) -> str:
    """Rank 0: make the finished temporary directory the current version (see [Note: commit protocol]).

    When it fails before ``latest`` names the new version, nothing of it is left behind.
    """
    manifests = {}
    for rel in _manifest_paths(tmp, record["world_size"]):
        path = os.path.join(tmp, rel)
        try:
            with open(path, "rb") as f:
                manifests[rel] = zlib.crc32(f.read())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path} is missing at commit: every rank must write to a filesystem "
                                  "shared with rank 0") from exc
    body = dump_json(dict(record, format=FORMAT, version=VERSION, committed=time.time(), manifests=manifests))
    with writing(size, os.path.join(tmp, COMMIT), len(body), "commit record"):
        write_bytes(os.path.join(tmp, COMMIT), body)
        sync_files([os.path.join(tmp, MANIFEST), os.path.join(tmp, COMMIT)])
        fsync_dir(tmp)
    final = os.path.join(root, name)
    with writing(size, final, None, "renaming the new version to"):
        os.rename(tmp, final)
    pointer = os.path.join(root, f"{LATEST}.tmp-{record['id']}")
    try:
        with writing(size, pointer, len(name) + 1, "pointer to the new version"):
            fsync_dir(root)
            write_durably(pointer, (name + "\n").encode())
            os.replace(pointer, os.path.join(root, LATEST))
            fsync_dir(root)
    except BaseException:
        if current_name(root) != name:      # not committed: leave nothing of it
            _unlink(pointer)
            shutil.rmtree(final, ignore_errors=True)
        raise
    _clean(root, name, keep)
    return final


def current_name(root: str) -> str | None:
    """The version ``root/latest`` names, or None."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def refuse_another_model(root: str, groups: list[dict]) -> None:
    """A save retires the versions in ``root``: refuse when the current one is of another model (no
    parameter name in common, or one of another shape), whose only checkpoint it would delete."""
    name = current_name(root)
    if name is None or os.sep in name:
        return
    try:
        saved = load_json(os.path.join(root, name, MANIFEST), "global manifest")
    except CheckpointError:
        return      # unreadable: a broken version is retired as before
    def plain(name: str) -> str:      # a model saved through torch.compile's wrapper is the same model
        return name.replace("_orig_mod.", "")
    theirs = {plain(n): tuple(p["shape"]) for g in saved.get("groups", ()) for p in g.get("params", ())
              for n in p["names"]}
    ours = {plain(n): tuple(p["shape"]) for g in groups for p in g["params"] for n in p["names"]}
    common = theirs.keys() & ours.keys()
    other = next((n for n in sorted(common) if theirs[n] != ours[n]), None)
    if theirs and (other is not None or not common):
        why = (f"parameter {other!r} has shape {ours[other]} here and {theirs[other]} there" if other is not None
               else f"no parameter name in common (there: {sorted(theirs)[:3]}, here: {sorted(ours)[:3]})")
        raise CheckpointMismatchError(
            f"infinity.save_checkpoint: {root} holds a checkpoint of another model ({name}: {why}); saving "
            "would retire it. Save elsewhere, or remove that checkpoint first")


class SaveLock:
    """Rank 0's exclusive hold on a checkpoint directory for one save (see [Note: one saver per directory]).

    Parameters
    ----------
    root:
        The checkpoint directory (created when missing).
    size:
        The save's size, for the message of an OS error.
    """

    def __init__(self, root: str, size: SaveSize) -> None:
        self.path = os.path.join(root, _LOCK)
        if os.path.exists(root) and not os.path.isdir(root):
            raise CheckpointWriteError(f"infinity.save_checkpoint: {root} is a file, not a directory: save to a "
                                       "directory (created when missing)", errno.ENOTDIR)
        pointer = os.path.join(root, LATEST)
        if os.path.lexists(pointer) and not os.path.isfile(pointer):    # else the commit fails, its work lost
            raise CheckpointWriteError(f"infinity.save_checkpoint: {pointer} is not a file: a save commits by "
                                       "replacing it with the file naming the newest version; move it away or "
                                       "save elsewhere (nothing was written)", errno.EISDIR)
        with writing(size, root, None, "creating the checkpoint directory"):
            os.makedirs(root, exist_ok=True)
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            with writing(size, self.path, None, "lock file"):
                self._fd = lockfile.take(self.path, f"pid {os.getpid()} on {socket.gethostname()} since {when}")
        except lockfile.LockBusy as busy:
            if busy.holder is None:
                raise CheckpointLockedError(f"checkpoint directory {root}: lock file {self.path} keeps being "
                                            "replaced; another process is saving there") from None
            raise CheckpointLockedError(
                f"checkpoint directory {root} is being saved to by {busy.holder} (lock file {self.path}); "
                "two jobs must not save to one directory: wait for that save, or save elsewhere") from None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        lockfile.release(self.path, self._fd)
        self._fd = -1


def clear_leftovers(root: str, with_trash: bool = True) -> list[str]:
    """Remove what failed or killed saves left in ``root`` (call holding the :class:`SaveLock`); their names.

    Leftovers are ``.tmp-*``, ``latest.tmp-*``, committed versions newer than the one ``latest``
    names (a save that failed between renaming its version and moving ``latest``) and, when
    ``with_trash``, ``.trash-*`` (retired versions whose deletion was cut short). They are deleted
    now, not in the background: the save about to run may need their space. Without
    ``with_trash``, retired versions are left to the background deletion of the commit.
    """
    current = current_name(root)
    newest = _committed_at(os.path.join(root, current)) if current else None
    removed = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        orphan = (entry.startswith("step") and entry != current and newest is not None
                  and os.path.isfile(os.path.join(path, COMMIT)) and _committed_at(path) > newest)
        if entry.startswith(_TMP) or (with_trash and entry.startswith(_TRASH)) or orphan:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(entry)
        elif entry.startswith(f"{LATEST}.tmp-"):
            _unlink(path)
            removed.append(entry)
    return removed


def _committed_at(version: str) -> float:
    try:
        return float(load_json(os.path.join(version, COMMIT), "commit record").get("committed", 0.0))
    except (CheckpointCorruptError, TypeError, ValueError):
        return 0.0


def _manifest_paths(version: str, world_size: int) -> list[str]:
    return [MANIFEST] + [os.path.join(f"rank{r}", MANIFEST) for r in range(world_size)]


def _clean(root: str, current: str, keep: int) -> None:
    """Retire leftovers of killed saves and committed versions beyond the newest ``keep``.

    See [Note: deleting old versions].
    """
    versions, trash = [], []
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry.startswith(_TRASH):
            trash.append(path)
        elif entry.startswith(_TMP):
            trash.append(_retire(root, entry))
        elif entry.startswith(f"{LATEST}.tmp-"):
            _unlink(path)
        elif entry.startswith("step") and entry != current and os.path.isfile(os.path.join(path, COMMIT)):
            versions.append((_committed_at(path), entry))
    versions.sort(reverse=True)
    trash += [_retire(root, entry) for _, entry in versions[max(keep - 1, 0):]]
    if trash:
        threading.Thread(target=_delete, args=(trash,), name="infinity-checkpoint-cleanup").start()


def _retire(root: str, entry: str) -> str:
    """Rename a directory to ``.trash-<entry>`` (atomic: it stops being a version at once)."""
    trash = os.path.join(root, f"{_TRASH}{entry}")
    try:
        os.rename(os.path.join(root, entry), trash)
    except OSError:
        return os.path.join(root, entry)
    return trash


def _delete(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def resolve(path: str | os.PathLike) -> str:
    """The committed version directory ``path`` designates: itself, or what its ``latest`` names."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, COMMIT)):
        return path
    pointer = os.path.join(path, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        version = os.path.join(path, name)
        if not name or os.sep in name or not os.path.isfile(os.path.join(version, COMMIT)):
            raise CheckpointCorruptError(f"{pointer} names {name!r}, which is not a committed checkpoint "
                                         f"(no {os.path.join(version, COMMIT)})")
        return version
    if os.path.lexists(pointer) and os.path.isdir(path):
        raise CheckpointCorruptError(f"{pointer} is not a file: a checkpoint's {LATEST} is the file naming its "
                                     f"newest committed version{_versions_hint(path)}")
    if os.path.exists(path) and not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        hint = (f" (it is the checkpoint's {os.path.basename(path)} file: pass the directory {parent})"
                if os.path.basename(path) in (LATEST, COMMIT) else "")
        raise CheckpointNotFoundError(f"no checkpoint at {path}: it is a file, not a checkpoint directory{hint}")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    raise CheckpointNotFoundError(f"no committed checkpoint at {path}: neither {COMMIT} nor {LATEST} there "
                                  f"(a save that was interrupted leaves only .tmp-* directories){_versions_hint(path)}")


def _versions_hint(path: str) -> str:
    found = sorted(e for e in os.listdir(path) if os.path.isfile(os.path.join(path, e, COMMIT)))
    return f"; committed versions found: {', '.join(found)} (pass one of them)" if found else ""


MAX_WORLD_SIZE = 1 << 20     # a checkpoint's ranks: checked before a list of their manifests is built


class SavedCheckpoint:
    """A committed checkpoint opened for reading: its commit record and manifests, verified.

    Parameters
    ----------
    path:
        The checkpoint directory (its ``latest`` version is opened) or a version directory.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.directory = resolve(path)
        self.commit = load_json(os.path.join(self.directory, COMMIT), "commit record")
        if self.commit.get("format") != FORMAT or self.commit.get("version") != VERSION:
            raise CheckpointCorruptError(
                f"{os.path.join(self.directory, COMMIT)}: format {self.commit.get('format')!r} version "
                f"{self.commit.get('version')!r}; this infinity reads {FORMAT!r} version {VERSION}")
        self._crcs = self.commit.get("manifests", {})
        world_size = self.commit.get("world_size")
        if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE or not isinstance(self._crcs, dict) \
                or len(self._crcs) != world_size + 1:
            raise CheckpointCorruptError(f"{os.path.join(self.directory, COMMIT)}: world size {str(world_size)[:20]} "
                                         f"is not 1 to {MAX_WORLD_SIZE}, or no table of manifests")
        self.world_size = world_size
        schema.check_commit(self.commit, os.path.join(self.directory, COMMIT))
        if sorted(self._crcs) != sorted(_manifest_paths(self.directory, self.world_size)):
            raise CheckpointCorruptError(f"{os.path.join(self.directory, COMMIT)}: lists manifests "
                                         f"{sorted(self._crcs)} for world size {self.world_size}")
        self.manifest = self._load(MANIFEST, "global manifest")
        schema.check_global(self.manifest, os.path.join(self.directory, MANIFEST), self.world_size)
        self._ranks: dict[int, dict] = {}

    def _load(self, rel: str, what: str) -> dict:
        try:
            return load_json(os.path.join(self.directory, rel), what, expect_crc=int(self._crcs[rel]))
        except CheckpointCorruptError:
            self.refuse_retired()
            raise

    def refuse_retired(self) -> None:
        """Raise when this version is gone as a whole: another job's save (``keep``) retired it while it was
        read. Not damage: its newer version is the checkpoint now."""
        if not os.path.isfile(os.path.join(self.directory, COMMIT)):
            raise CheckpointError(f"{self.directory}: this version was retired while it was being read (a save "
                                  "into the same directory committed a newer one and kept fewer); nothing was "
                                  "loaded. Read the checkpoint directory again for its current version")

    def rank_manifest(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"{self.directory}: no rank {rank} (saved with world size {self.world_size})")
        if rank not in self._ranks:
            rel = os.path.join(f"rank{rank}", MANIFEST)
            manifest = self._load(rel, f"manifest of rank {rank}")
            schema.check_rank(manifest, os.path.join(self.directory, rel), rank, self.world_size)
            self._ranks[rank] = manifest
        return self._ranks[rank]

    def file(self, rank: int, name: str, needed: bool = False) -> FileRecord | None:
        """The record of data file ``name`` ("master", "buffers", ...) of ``rank``; None if not saved, an error
        when ``needed``."""
        data = self.rank_manifest(rank).get("files", {}).get(name)
        where = os.path.join(self.directory, f"rank{rank}", MANIFEST)
        if data is None and needed:
            raise CheckpointCorruptError(f"{where}: rank {rank} lists no {name!r} file, which this checkpoint needs")
        return None if data is None else FileRecord.from_json(data, where)

    def refuse_in_place(self, what: str) -> None:
        """Raise when this is a checkpoint in place, which only a model built from it can load."""
        if self.manifest.get("in_place"):
            raise CheckpointMismatchError(
                f"{what}: {self.directory} is a checkpoint in place: its states are the sealed swap files of the "
                "run that saved it, not files of its own. Build the model with infinity.Init(config, resume=<this "
                "checkpoint>) and then call infinity.load_checkpoint; it cannot be resharded or consolidated")

    def path_of(self, record: FileRecord) -> str:
        """Where ``record``'s file is, refused when it resolves outside this version ([Note: a checkpoint is
        data] in infinity/checkpoint/reader.py)."""
        return inside(self.directory, record.path)

    @property
    def step(self) -> int:
        return int(self.commit.get("step", 0))

