"""The free list of one swap file: aligned slots handed out, holes reused, neighbours merged.

[Note: swap file layout]
A swap file is a header (one 4096-byte block, see tiers/swapfile.py) followed by
slots. Every slot starts and ends on a 4096-byte boundary, so any slot can be read or
written with ``O_DIRECT`` and no two keys ever share a block (a read-modify-write of
one key's partial block cannot touch another key). Freed slots become holes; a new
slot takes the smallest hole that fits (best fit keeps big holes for big keys), else
the file grows at its end. A freed slot merges with the holes on either side, and a
hole that reaches the end of the file shrinks the file, so steady-state reuse neither
fragments nor grows the file.
"""
from __future__ import annotations

import bisect


class FreeList:
    """Slots of ``alignment``-multiple sizes in ``[start, end)``; not thread-safe (the swap file locks).

    Examples
    --------
    >>> fl = FreeList(start=4096)
    >>> a, b = fl.allocate(5000), fl.allocate(4096)
    >>> (a, b, fl.end)
    (4096, 12288, 16384)
    >>> fl.release(a, 5000); fl.allocate(100)
    4096
    """

    def __init__(self, start: int, alignment: int = 4096) -> None:
        if start % alignment:
            raise ValueError(f"FreeList: start {start} is not a multiple of {alignment}")
        self.alignment = alignment
        self.start = start
        self.end = start
        self._hole_offsets: list[int] = []
        self._hole_sizes: dict[int, int] = {}

    def round_up(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the slot granularity (at least one block)."""
        return max(-(-nbytes // self.alignment), 1) * self.alignment

    def allocate(self, nbytes: int) -> int:
        """Offset of a new slot of ``round_up(nbytes)`` bytes (may move :attr:`end`)."""
        size = self.round_up(nbytes)
        best = None
        for offset in self._hole_offsets:
            hole = self._hole_sizes[offset]
            if hole >= size and (best is None or hole < self._hole_sizes[best]):
                best = offset
                if hole == size:
                    break
        if best is None:
            offset, self.end = self.end, self.end + size
            return offset
        hole = self._remove_hole(best)
        if hole > size:
            self._add_hole(best + size, hole - size)
        return best

    def release(self, offset: int, nbytes: int) -> None:
        """Give back the slot at ``offset`` that was allocated with ``nbytes``."""
        size = self.round_up(nbytes)
        if offset < self.start or offset + size > self.end or offset % self.alignment:
            raise ValueError(f"FreeList: slot [{offset}, {offset + size}) is not inside [{self.start}, {self.end})")
        index = bisect.bisect_left(self._hole_offsets, offset)
        if index < len(self._hole_offsets) and self._hole_offsets[index] < offset + size:
            raise ValueError(f"FreeList: slot at {offset} overlaps the hole at {self._hole_offsets[index]} (double free)")
        if index > 0:
            before = self._hole_offsets[index - 1]
            if before + self._hole_sizes[before] > offset:
                raise ValueError(f"FreeList: slot at {offset} overlaps the hole at {before} (double free)")
            if before + self._hole_sizes[before] == offset:
                offset, size = before, size + self._remove_hole(before)
        after = offset + size
        if after in self._hole_sizes:
            size += self._remove_hole(after)
        if offset + size == self.end:
            self.end = offset
        else:
            self._add_hole(offset, size)

    def claim(self, slots: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Take the given ``(offset, nbytes)`` slots at once, on an empty list (a swap file adopted from a
        checkpoint, whose keys already lie at those offsets); returns the holes left between them, as
        ``(offset, size)``, which the caller may give back to the filesystem."""
        if self.end != self.start:
            raise ValueError("FreeList.claim: the list already holds slots; claim only into an empty one")
        position, holes = self.start, []
        for offset, nbytes in sorted(slots):
            size = self.round_up(nbytes)
            if offset % self.alignment or offset < position:
                raise ValueError(f"FreeList.claim: slot [{offset}, {offset + size}) is not aligned to "
                                 f"{self.alignment} or overlaps the one before (which ends at {position})")
            if offset > position:
                self._add_hole(position, offset - position)
                holes.append((position, offset - position))
            position = offset + size
        self.end = position
        return holes

    @property
    def hole_bytes(self) -> int:
        """Bytes inside ``[start, end)`` that are free for reuse."""
        return sum(self._hole_sizes.values())

    @property
    def holes(self) -> int:
        return len(self._hole_offsets)

    def _add_hole(self, offset: int, size: int) -> None:
        bisect.insort(self._hole_offsets, offset)
        self._hole_sizes[offset] = size

    def _remove_hole(self, offset: int) -> int:
        del self._hole_offsets[bisect.bisect_left(self._hole_offsets, offset)]
        return self._hole_sizes.pop(offset)
