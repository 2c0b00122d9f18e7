"""The NVMe tier: keys kept in swap files on one or several directories (drives).

Where a key's bytes lie in the swap files is ``SwapSpace``'s business (tiers/swapspace.py,
[Note: placement and striping]); this module moves the bytes and keeps the keys.

[Note: adopting a checkpoint]
A tier built with ``adopt=`` (a sealed swap file per directory: [Note: sealed swap files] in
tiers/swapfile.py) takes over keys whose bytes are already in those files. Until ``settle``
its keys are allocated without a place: no slot, no disk, and any read or write of them
is refused. The owner then calls ``settle({key: placement})`` once: the named keys take
their recorded placements (counted as written), every other key gets a new slot in the
space left, and from then on the tier is an ordinary one. The first write renames the
adopted files to this run's swap files; until then they are still the checkpoint.
``seal(label)`` is the other end: once no transfer is in flight it flushes and renames
the files, and the tier refuses any further write or key (reads still work).

[Note: when a freed slot is reused]
``free`` forgets the key at once (any later use raises ``KeyError``), but if reads or
writes of it are still in flight, its slots return to the free list only when the last
of them completes (when its future's ``wait()`` returns), so a new key can never be
written over bytes a pending read is still fetching.
"""
from __future__ import annotations

import concurrent.futures
import threading
import uuid
from typing import Sequence

import torch

from tiers.aio import AioFuture, AioHandle
from tiers.base import CompletedFuture, Future, Tier, byte_view, wait_quietly
from tiers.checksums import BlockChecksums
from tiers.future import TransferFuture
from tiers.keytable import Entry, KeyTable
from tiers.pool import BufferPool
from tiers.staging import Run, Staging, split_direct
from tiers.swapspace import Placement, SwapSpace
from tiers.telemetry import TierStats


class SealedTierError(RuntimeError):
    """A write or a new key on a tier whose swap files were sealed as a checkpoint."""


class NVMeIOError(OSError):
    """A read or write of a key failed; the message names the key, its tag, the file and why."""


class UnwrittenKeyError(KeyError):
    """A key was read before anything was written to it (its bytes are undefined)."""


class NVMeTier(Tier):
    """Keys in swap files under ``paths``, moved with ``handle`` through ``pool``.

    Parameters
    ----------
    paths : sequence of str
        Existing directories, one per drive (several add up; see [Note: placement and striping]).
    handle : AioHandle
        Does the I/O; the tier does not close it.
    pool : BufferPool
        Staging buffers for tensors that are not 4096-aligned (see tiers/staging.py).
    name : str
        Names the swap files and the telemetry; two live tiers of one name cannot share a directory.
    stale : {"remove", "refuse"}
        What to do with swap files left by a crashed run (tiers/swapfile.py).
    stripe_nbytes : int | None
        Stripe size for keys spread over several directories (default: ``pool.buffer_nbytes``).
    workers : int | None
        Threads running staged transfers (default: ``max(1, pool.count // 2)``).
    staging_depth : int
        Most pool buffers one staged transfer uses (>= 2 gives double buffering; more are
        taken only when free, see tiers/staging.py).
    verify : bool
        Keep the CRC-32 of every 64 KiB block written and check it on reads (see [Note: swap-file
        checksums] in tiers/checksums.py).
    adopt : sequence of str | None
        Per directory, a sealed swap file to take over (see [Note: adopting a checkpoint]).

    Examples
    --------
    >>> with AioHandle() as handle, NVMeTier(["/tmp"], handle, BufferPool(1 << 20, 4)) as tier:  # doctest: +SKIP
    ...     key = tier.put(torch.arange(10.0))
    ...     out = torch.empty(10); tier.read(key, out).wait()
    40
    """

    kind = "nvme"

    def __init__(self, paths: Sequence[str], handle: AioHandle, pool: BufferPool, name: str = "nvme", *,
                 stale: str = "remove", stripe_nbytes: int | None = None, workers: int | None = None,
                 staging_depth: int = 4, verify: bool = False, adopt: Sequence[str] | None = None) -> None:
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ValueError(f"nvme tier {name!r}: needs at least one directory in paths")
        stripe = pool.buffer_nbytes if stripe_nbytes is None else stripe_nbytes
        if stripe <= 0 or stripe % 4096:
            raise ValueError(f"nvme tier {name!r}: stripe_nbytes must be a positive multiple of 4096, got {stripe}")
        self.name = name
        self.handle = handle
        self.pool = pool
        self.run_id = uuid.uuid4().hex
        self.stripe_nbytes = stripe
        self.swap = SwapSpace(paths, name, self.run_id, handle, stale, stripe, adopt=adopt)
        self._staging = Staging(handle, pool, depth=staging_depth)
        self._workers = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers or max(1, pool.count // 2), thread_name_prefix=f"{name}-staging")
        self._keys: KeyTable[Placement] = KeyTable(name)
        self._stats = TierStats(name)
        self._lock = threading.Lock()
        self._inflight: dict[int, int] = {}
        self._jobs: set[concurrent.futures.Future] = set()     # staged transfers running (a seal waits)
        self._freed_busy: dict[int, Entry[Placement]] = {}
        self._written: set[int] = set()
        self._sums = BlockChecksums() if verify else None
        self._closed = False
        # Keys allocated before ``settle`` (an adopting tier), and whether the adopted files are still the
        # checkpoint; the label the files were sealed with ([Note: adopting a checkpoint]).
        self._unplaced: set[int] | None = set() if adopt is not None else None
        self._adopted_unwritten = adopt is not None
        self.sealed: str | None = None

    # -- placement ---------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str = "") -> int:
        nbytes = self._keys.validate_nbytes(nbytes, tag)
        if self._closed:
            raise RuntimeError(f"nvme tier {self.name!r} is closed")
        _refuse_if_sealed(self, f"allocate a key tagged {tag!r}")
        if self._unplaced is not None:
            with self._lock:
                key = self._keys.add(None, nbytes, tag)
                self._unplaced.add(key)
        else:
            placement = self.swap.place(nbytes, f"key tagged {tag!r}" if tag else "a new key")
            key = self._keys.add(placement, nbytes, tag)
        self._stats.allocated(nbytes)
        if self._sums is not None:
            self._sums.add(key, nbytes)
        return key

    # -- checkpoints in the swap files (see [Note: adopting a checkpoint]) ---------------------
    def placement(self, key: int) -> Placement:
        """Where ``key``'s bytes lie (what a sealed checkpoint records)."""
        place = self._keys.get(key).place
        if place is None:
            raise KeyError(f"{self.name} tier: key {key} has no place yet (settle the adopted keys first)")
        return place

    def settle(self, adopted: dict[int, Placement]) -> None:
        """Give the keys of an adopting tier their places: ``adopted`` keys the recorded ones (their bytes
        are the checkpoint's), every other key a new slot."""
        if self._unplaced is None:
            raise RuntimeError(f"nvme tier {self.name!r} adopts nothing, or has settled already")
        with self._lock:
            for key, placement in adopted.items():
                entry = self._keys.get(key)
                if key not in self._unplaced:
                    raise ValueError(f"{self.name} tier: key {key} (tag {entry.tag!r}) is not an unplaced key")
                if sum(placement.sizes) != entry.nbytes:
                    raise ValueError(f"{self.name} tier: key {key} (tag {entry.tag!r}) holds {entry.nbytes} bytes, "
                                     f"and the checkpoint's slot for it {sum(placement.sizes)}")
            self.swap.claim(list(adopted.values()))
            for key, placement in adopted.items():
                self._keys.place(key, placement)
                self._written.add(key)
            rest = sorted(self._unplaced - set(adopted))
            self._unplaced = None
        for key in rest:
            entry = self._keys.get(key)
            self._keys.place(key, self.swap.place(entry.nbytes, f"key tagged {entry.tag!r}"))

    def seal(self, label: str | None) -> list[str]:
        """Flush the swap files and keep them as checkpoint ``label`` (renamed ``<name>.<label>.sealed``);
        the tier refuses writes and new keys from now on. Returns the files' paths. ``None`` undoes it (the
        checkpoint failed): the files are this run's swap files again."""
        if label is None:
            if self.sealed is not None:
                self.swap.unseal()
                self.sealed = None
            return [swap.path for swap in self.swap.files]
        _refuse_if_sealed(self, "seal it again")
        # Transfers their owners started and have not waited for yet (the engine overlaps them) land first:
        # the staged ones, then every request of the handle.
        concurrent.futures.wait(list(self._jobs))
        self.handle.wait_all()
        paths = self.swap.seal(label)
        self.sealed = label
        return paths

    # -- transfers ---------------------------------------------------------------------------
    def write(self, key: int, src: torch.Tensor, offset: int = 0) -> Future:
        data = _host_bytes(src, f"{self.name} tier write source")
        entry = self._begin(key, offset, data.numel(), "write")
        if self._sums is not None:
            self._sums.wrote(key, offset, data, entry.nbytes)
        self._stats.wrote(data.numel())
        return self._transfer("write", key, entry, offset, data)

    def read(self, key: int, dst: torch.Tensor, offset: int = 0) -> Future:
        data = _host_bytes(dst, f"{self.name} tier read destination")
        entry = self._begin(key, offset, data.numel(), "read")
        self._stats.read(data.numel())
        return self._transfer("read", key, entry, offset, data)

    def _begin(self, key: int, offset: int, nbytes: int, verb: str) -> Entry[Placement]:
        if self._closed:
            raise RuntimeError(f"nvme tier {self.name!r} is closed")
        if verb == "write":
            _refuse_if_sealed(self, f"write key {key}")
            consume = False
            with self._lock:
                if self._adopted_unwritten:
                    if self._unplaced is not None:
                        raise RuntimeError(f"nvme tier {self.name!r}: a write before the adopted keys were settled")
                    self._adopted_unwritten, consume = False, True
            if consume:     # the first write: the adopted files stop being the checkpoint
                self.swap.consume()
        with self._lock:
            entry = self._keys.span(key, offset, nbytes, verb)
            if entry.place is None:
                raise UnwrittenKeyError(f"{self.name} tier: cannot {verb} key {key} (tag {entry.tag!r}) yet: the "
                                        "tier is adopting a checkpoint's swap files and has not placed its keys "
                                        "(settle)")
            if verb == "read" and key not in self._written:
                raise UnwrittenKeyError(f"{self.name} tier: key {key} (tag {entry.tag!r}) was allocated but "
                                        "never written; its bytes are undefined")
            if verb == "write":
                self._written.add(key)
            self._inflight[key] = self._inflight.get(key, 0) + 1
        return entry

    def _end(self, key: int) -> None:
        with self._lock:
            left = self._inflight.pop(key) - 1
            if left:
                self._inflight[key] = left
                return
            entry = self._freed_busy.pop(key, None)
        if entry is not None:
            self.swap.release(entry.place)

    def _transfer(self, op: str, key: int, entry: Entry[Placement], offset: int, data: torch.Tensor) -> Future:
        nbytes = data.numel()
        try:
            runs = self.swap.runs(entry.place, offset, nbytes)
            direct, staged = split_direct(runs, data)
            if not staged:
                futures = _submit_direct(self, op, direct, data)
                if not futures:
                    self._end(key)
                    return CompletedFuture(0)
                wait, done = (lambda: _wait_direct(self, futures, op, key, entry, offset),
                              lambda: all(f.done() for f in futures))
            else:
                job = self._workers.submit(self._staged_job, op, key, entry, offset, data, direct, staged)
                self._jobs.add(job)
                job.add_done_callback(self._jobs.discard)
                wait, done = job.result, job.done
        except BaseException:
            self._end(key)
            raise
        if op == "read" and self._sums is not None:
            def locate(key_byte: int) -> tuple[str, int]:
                run = self.swap.runs(entry.place, key_byte, 1)[0]
                return run.file.path, run.file_offset

            wait = self._sums.checked(wait, key, entry.tag, offset, data, entry.nbytes, locate)
        return TransferFuture(wait, done, nbytes, self._stats, lambda _error: self._end(key))

    def _staged_job(self, op: str, key: int, entry: Entry[Placement], offset: int, data: torch.Tensor,
                    direct: list[Run], staged: list[Run]) -> int:
        futures = _submit_direct(self, op, direct, data)
        owner = f"{self.name} {op} key {key} ({entry.tag})" if entry.tag else f"{self.name} {op} key {key}"
        try:
            move = self._staging.read if op == "read" else self._staging.write
            move(staged, data, owner)
        except BaseException as exc:
            wait_quietly(futures)       # whatever the error, the direct runs end before it leaves
            if isinstance(exc, OSError):
                raise _io_error(self, exc, op, key, entry, offset, data.numel()) from exc
            raise
        _wait_direct(self, futures, op, key, entry, offset)
        return data.numel()

    # -- bookkeeping -------------------------------------------------------------------------
    def free(self, key: int) -> None:
        with self._lock:
            entry = self._keys.pop(key)
            self._written.discard(key)
            if self._unplaced is not None:
                self._unplaced.discard(key)
            if self._sums is not None:
                self._sums.drop(key)
            busy = key in self._inflight
            if busy:
                self._freed_busy[key] = entry
        self._stats.released(entry.nbytes)
        if not busy and entry.place is not None:
            self.swap.release(entry.place)

    def nbytes(self, key: int) -> int:
        return self._keys.get(key).nbytes

    def capacity(self) -> int | None:
        """Free disk plus this tier's swap files, summed over distinct filesystems."""
        return self.swap.capacity()

    def bytes_in_use(self) -> int:
        return self._stats.bytes_in_use

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        snapshot.update(tier="nvme", engine=self.handle.engine, run_id=self.run_id,
                        files=[swap.stats() for swap in self.swap.files], pool=self.pool.stats(),
                        checksum_nbytes=self._sums.nbytes() if self._sums is not None else 0)
        return snapshot

    def verify(self) -> list[str]:
        """Problems found with the swap files (removed, replaced, truncated, header overwritten)."""
        return self.swap.diagnose()

    def check(self) -> None:
        """Raise ``SwapFileDamagedError`` when a swap file was cut or overwritten under this run (see
        [Note: checking a live swap file] in tiers/swapfile.py); cheap enough to call every step."""
        if not self._closed:
            self.swap.check()

    def close(self) -> None:
        """Finish staged transfers, delete the swap files and release the directory locks."""
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown(wait=True)
        with self._lock:
            pending = bool(self._inflight)
        if pending:
            # Futures nobody waited for: their I/O must end before the files close.
            try:
                self.handle.wait_all()
            except OSError:
                pass
        self.swap.close()

    def __repr__(self) -> str:
        paths = [swap.directory for swap in self.swap.files]
        return f"NVMeTier(paths={paths}, name={self.name!r}, keys={len(self._keys)})"


def _host_bytes(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The bytes of a host tensor (``byte_view``); a device tensor is refused, naming ``what``."""
    data = byte_view(tensor, what)
    if data.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor (got one on {data.device}); "
                         "stage device tensors through a host buffer")
    return data


def _submit_direct(tier: NVMeTier, op: str, runs: list[Run], data: torch.Tensor) -> list[AioFuture]:
    """Start the aligned runs; if one cannot start, those already started end before the error leaves (the
    key's slot may be reused once it does)."""
    submit = tier.handle.pread if op == "read" else tier.handle.pwrite
    futures: list[AioFuture] = []
    try:
        for run in runs:
            futures.append(submit(run.file, data[run.mem_offset:run.mem_offset + run.nbytes], run.file_offset))
    except BaseException:
        wait_quietly(futures)
        raise
    return futures


def _wait_direct(tier: NVMeTier, futures: list[AioFuture], op: str, key: int, entry: Entry[Placement],
                 offset: int) -> None:
    first: OSError | None = None
    for future in futures:
        try:
            future.wait()
        except OSError as exc:
            first = first or exc
    if first is not None:
        raise _io_error(tier, first, op, key, entry, offset, sum(f.nbytes for f in futures)) from first


def _io_error(tier: NVMeTier, exc: OSError, op: str, key: int, entry: Entry[Placement], offset: int,
              nbytes: int) -> NVMeIOError:
    """The error of a failed transfer, naming the key, its tag, the bytes and what is wrong with the files."""
    causes = tier.swap.diagnose(entry.place)
    why = "; ".join(causes) if causes else "no damage to the swap files found"
    message = (f"{tier.name} tier: {op} of {nbytes} bytes at offset {offset} of key {key} "
               f"(tag {entry.tag!r}, {entry.nbytes} bytes) failed: {exc.strerror or exc}. {why}")
    return NVMeIOError(exc.errno, message, exc.filename)


def _refuse_if_sealed(tier: NVMeTier, what: str) -> None:
    if tier.sealed is not None:
        raise SealedTierError(f"nvme tier {tier.name!r}: cannot {what}: its swap files were sealed as checkpoint "
                              f"{tier.sealed!r} and are kept unchanged; resume from that checkpoint in a new model "
                              "to go on training")
