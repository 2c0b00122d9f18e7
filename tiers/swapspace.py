"""Where each key of the NVMe tier lies: slots in the swap files of one or several directories.

[Note: placement and striping]
A key no larger than one stripe (``stripe_nbytes``, default: one pool buffer) lives in
one slot of one directory; directories take turns (round robin), and one whose disk
is full is skipped. A larger key is striped RAID-0 style over all directories: chunk
``c`` of ``stripe_nbytes`` bytes goes to directory ``(c mod m)`` of the key's list, at
``(c div m) * stripe_nbytes`` inside that directory's slot. Reading it pipelines
through chunks in order, so consecutive pieces hit different drives and their
bandwidth adds up. Stripes are multiples of 4096, so an aligned transfer stays
aligned in every file.

What the room may touch: the swap files (tiers/swapfile.py) of its directories; it moves
no bytes itself (``NVMeTier`` does, along the runs this module computes).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from tiers.aio import AioHandle
from tiers.staging import Run
from tiers.swapfile import NVMeSpaceError, SwapFile


@dataclass(frozen=True)
class Placement:
    """Where a key's bytes are: slot ``offsets[j]`` of ``sizes[j]`` bytes in swap file ``files[j]``."""

    files: tuple[int, ...]
    """Indices of the swap files (directories) holding the key, in stripe order."""

    offsets: tuple[int, ...]
    """Byte offset of the key's slot in each of those files (4096-aligned)."""

    sizes: tuple[int, ...]
    """Bytes of the key in each file: the whole key, or its stripes there."""

    stripe_nbytes: int
    """Stripe size when the key is spread over several files."""


def _striped_sizes(nbytes: int, ways: int, stripe: int) -> list[int]:
    """Bytes of a key of ``nbytes`` that land in each of ``ways`` directories."""
    chunks = -(-nbytes // stripe)
    sizes = [len(range(j, chunks, ways)) * stripe for j in range(ways)]
    sizes[(chunks - 1) % ways] -= chunks * stripe - nbytes
    return sizes


class SwapSpace:
    """The swap files of one tier, one per directory, and the placement of keys in them.

    Parameters
    ----------
    paths : sequence of str
        Existing directories, one per drive (duplicates are dropped).
    name : str
        The tier's name (names the swap files and their locks).
    run_id : str
        This run, written in each file's header.
    handle : AioHandle
        Opens the files.
    stale : {"remove", "refuse"}
        What to do with swap files left by a crashed run (tiers/swapfile.py).
    stripe_nbytes : int
        Stripe size of keys spread over several directories, a multiple of 4096.
    adopt : sequence of str | None
        Per directory, the sealed swap file to take over ([Note: sealed swap files] in tiers/swapfile.py).
    """

    def __init__(self, paths: Sequence[str], name: str, run_id: str, handle: AioHandle, stale: str,
                 stripe_nbytes: int, adopt: Sequence[str] | None = None) -> None:
        self.name = name
        self.stripe_nbytes = stripe_nbytes
        self.files: list[SwapFile] = []
        paths = list(dict.fromkeys(str(p) for p in paths))
        if adopt is not None and len(adopt) != len(paths):
            raise ValueError(f"nvme tier {name!r}: {len(adopt)} sealed swap files to adopt for {len(paths)} "
                             "directories; a checkpoint is adopted with the nvme_path it was saved with")
        try:
            for i, path in enumerate(paths):
                self.files.append(SwapFile(path, name, run_id, handle, stale,
                                           adopt=None if adopt is None else adopt[i]))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._next_file = 0

    def place(self, nbytes: int, what: str) -> Placement:
        """Slots for a new key of ``nbytes`` (see [Note: placement and striping])."""
        with self._lock:
            start = self._next_file
            self._next_file = (self._next_file + 1) % len(self.files)
        ways = min(len(self.files), max(1, -(-nbytes // self.stripe_nbytes)))
        if ways == 1:
            return self._place_whole(nbytes, start, what)
        return self._place_striped(nbytes, start, ways, what)

    def _place_whole(self, nbytes: int, start: int, what: str) -> Placement:
        errors = []
        for step in range(len(self.files)):
            index = (start + step) % len(self.files)
            try:
                offset = self.files[index].allocate(nbytes, what)
            except NVMeSpaceError as exc:
                if len(self.files) == 1:
                    raise
                errors.append(str(exc))
                continue
            return Placement((index,), (offset,), (nbytes,), self.stripe_nbytes)
        raise NVMeSpaceError(f"nvme tier {self.name!r}: no directory has room for {what}:\n  " + "\n  ".join(errors))

    def _place_striped(self, nbytes: int, start: int, ways: int, what: str) -> Placement:
        files = tuple((start + j) % len(self.files) for j in range(ways))
        sizes = _striped_sizes(nbytes, ways, self.stripe_nbytes)
        offsets: list[int] = []
        try:
            for index, size in zip(files, sizes):
                offsets.append(self.files[index].allocate(size, f"{what} (stripe over {ways} directories)"))
        except NVMeSpaceError:
            for index, offset, size in zip(files, offsets, sizes):
                self.files[index].release(offset, size)
            raise
        return Placement(files, tuple(offsets), tuple(sizes), self.stripe_nbytes)

    def runs(self, placement: Placement, key_offset: int, nbytes: int) -> list[Run]:
        """The file runs holding bytes [key_offset, key_offset + nbytes) of a key placed at ``placement``."""
        files = [self.files[i].file for i in placement.files]
        if len(files) == 1:
            return [Run(files[0], placement.offsets[0] + key_offset, 0, nbytes)] if nbytes else []
        stripe, ways = placement.stripe_nbytes, len(files)
        runs, position, end = [], key_offset, key_offset + nbytes
        while position < end:
            chunk, within = divmod(position, stripe)
            length = min(stripe - within, end - position)
            j = chunk % ways
            runs.append(Run(files[j], placement.offsets[j] + (chunk // ways) * stripe + within,
                            position - key_offset, length))
            position += length
        return runs

    def release(self, placement: Placement) -> None:
        """Give a key's slots back to their files."""
        for index, offset, size in zip(placement.files, placement.offsets, placement.sizes):
            self.files[index].release(offset, size)

    def claim(self, placements: Sequence[Placement]) -> None:
        """Take the slots of adopted keys in their files (every file adopted: those without keys end up empty)."""
        slots: list[list[tuple[int, int]]] = [[] for _ in self.files]
        for placement in placements:
            if placement.stripe_nbytes != self.stripe_nbytes and len(placement.files) > 1:
                raise ValueError(f"nvme tier {self.name!r}: a key striped in {placement.stripe_nbytes}-byte stripes "
                                 f"cannot be adopted by a tier striping in {self.stripe_nbytes}")
            for index, offset, size in zip(placement.files, placement.offsets, placement.sizes):
                if not 0 <= index < len(self.files):
                    raise ValueError(f"nvme tier {self.name!r}: an adopted key lies in swap file {index}, "
                                     f"and the tier has {len(self.files)}")
                slots[index].append((offset, size))
        for swap, taken in zip(self.files, slots):
            swap.claim(taken)

    def consume(self) -> None:
        """Before the first write: adopted files become this run's swap files."""
        for swap in self.files:
            swap.consume()

    def seal(self, label: str) -> list[str]:
        """Seal every swap file as checkpoint ``label``; their new paths, in directory order."""
        return [swap.seal(label) for swap in self.files]

    def unseal(self) -> None:
        for swap in self.files:
            if not swap.owned:
                swap.unseal()

    def diagnose(self, placement: Placement | None = None) -> list[str]:
        """Problems found with the swap files (of one key's placement, or all): removed, replaced, truncated."""
        indices = range(len(self.files)) if placement is None else placement.files
        return [cause for i in indices if (cause := self.files[i].diagnose())]

    def check(self) -> None:
        """Raise ``SwapFileDamagedError`` naming the first swap file cut or overwritten under this run."""
        for swap in self.files:
            swap.check()

    def capacity(self) -> int:
        """Free disk plus these swap files, summed over distinct filesystems."""
        by_filesystem: dict[int, int] = {}
        for swap in self.files:
            fs = swap.filesystem()
            by_filesystem[fs] = by_filesystem.get(fs, swap.disk_free()) + swap.file_nbytes
        return sum(by_filesystem.values())

    def close(self) -> None:
        """Delete the swap files and release their directory locks."""
        for swap in self.files:
            swap.close()
