"""CRC-32 of every block of the NVMe tier's keys, kept in memory as written, checked on reads.

[Note: swap-file checksums]
With ``verify`` on (config ``[tiers] verify``), the NVMe tier computes the CRC-32 of each
``BLOCK_NBYTES`` block of a key (block ``i`` covers key bytes ``[i*B, (i+1)*B)``, the last one
shorter) as a write hands it over, before the bytes leave for the disk, and checks every
block a read covers whole once the bytes have arrived. A block that a write covers only in
part (an odd offset or length) loses its checksum until a write covers it whole again, so
no read is ever refused for a checksum that was not computed from the bytes written. (The engine writes parameter shards and optimizer states
whole; gradients arrive group by group, so the blocks where two groups meet inside a
gradient key go unchecked.) The sums live only in this process, as the keys do.

What it catches: bytes changed on the disk under the running job (another process writing
into the swap file, a bad disk), which would otherwise reach training as garbage. What it
costs: one CRC pass over the bytes on each side (zlib's CRC-32, which releases the GIL), and
8 bytes of host memory per 64 KiB of swap (128 MiB per TiB). docs/benchmarks/verify.md states the
measured overhead (``python -m benchmarks.verify``).
"""
from __future__ import annotations

import errno
import threading
import zlib
from array import array
from typing import Callable

import torch

BLOCK_NBYTES = 64 << 10
_UNKNOWN = -1


class SwapChecksumError(OSError):
    """Bytes read from a swap file differ from those written; the message names the key, the file and the bytes."""


class BlockChecksums:
    """The CRC-32 of each block of each key of one tier (see [Note: swap-file checksums])."""

    def __init__(self) -> None:
        self._sums: dict[int, array] = {}
        self._lock = threading.Lock()

    def add(self, key: int, nbytes: int) -> None:
        """A new key: no block has a checksum yet (its bytes are undefined until written)."""
        with self._lock:
            self._sums[key] = array("q", [_UNKNOWN]) * (-(-nbytes // BLOCK_NBYTES))

    def drop(self, key: int) -> None:
        with self._lock:
            self._sums.pop(key, None)

    def wrote(self, key: int, offset: int, data: torch.Tensor, key_nbytes: int) -> None:
        """``data`` (uint8, host) is about to be written at byte ``offset`` of ``key``: sum its whole blocks."""
        sums = self._sums.get(key)
        if sums is None:
            return
        view = memoryview(data.numpy())
        end = offset + len(view)
        first, last = offset // BLOCK_NBYTES, -(-end // BLOCK_NBYTES)
        new = {}
        for block in range(first, last):
            a, b = block * BLOCK_NBYTES, min((block + 1) * BLOCK_NBYTES, key_nbytes)
            new[block] = zlib.crc32(view[a - offset:b - offset]) if offset <= a and b <= end else _UNKNOWN
        with self._lock:
            for block, crc in new.items():
                sums[block] = crc

    def bad_blocks(self, key: int, offset: int, data: torch.Tensor, key_nbytes: int) -> list[tuple[int, int, int]]:
        """``(key byte, expected, found)`` of each block that ``data``, just read from ``offset`` of ``key``,
        covers whole and whose CRC-32 differs from the one written."""
        sums = self._sums.get(key)
        if sums is None:
            return []
        view = memoryview(data.numpy())
        end = offset + len(view)
        bad = []
        for block in range(-(-offset // BLOCK_NBYTES), -(-end // BLOCK_NBYTES)):
            a, b = block * BLOCK_NBYTES, min((block + 1) * BLOCK_NBYTES, key_nbytes)
            want = sums[block]
            if b > end or want == _UNKNOWN:
                continue
            found = zlib.crc32(view[a - offset:b - offset])
            if found != want:
                bad.append((a, want, found))
        return bad

    def checked(self, wait: Callable[[], object], key: int, tag: str, offset: int, data: torch.Tensor,
                key_nbytes: int, locate: Callable[[int], tuple[str, int]]) -> Callable[[], None]:
        """``wait`` (a read of ``data`` from ``offset`` of ``key``), then the check of what arrived.

        ``locate(key_byte)`` says in which file and at which file offset a byte of the key lies, for the
        message of :class:`SwapChecksumError`.
        """
        def wait_and_check() -> None:
            wait()
            bad = self.bad_blocks(key, offset, data, key_nbytes)
            if bad:
                start, want, found = bad[0]
                path, file_offset = locate(start)
                more = f" (and {len(bad) - 1} more blocks)" if len(bad) > 1 else ""
                raise SwapChecksumError(
                    errno.EIO, f"bytes {start}..{min(start + BLOCK_NBYTES, key_nbytes)} of key {key} (tag {tag!r}), "
                    f"at offset {file_offset} of the swap file, fail their CRC-32 (written {want:08x}, read "
                    f"{found:08x}){more}: the file was changed on disk under this run", path)
        return wait_and_check

    def nbytes(self) -> int:
        """Host memory the sums take."""
        with self._lock:
            return sum(s.itemsize * len(s) for s in self._sums.values())
