"""Per-tier counters: bytes moved, time spent waiting, bytes held now and at the peak.

[Note: what telemetry counts]
``bytes_read`` / ``bytes_written`` count payload bytes the caller asked for (not the
4096-byte padding direct I/O adds), so figures add up across tiers. ``wait_seconds``
is wall time callers spent blocked in ``Future.wait()``: time the engine could not
hide behind compute. ``bytes_in_use`` / ``peak_bytes`` count allocated key sizes.
"""
from __future__ import annotations

import threading
import time


class TierStats:
    """Thread-safe counters of one tier, read as a plain dict with :meth:`snapshot`.

    Examples
    --------
    >>> stats = TierStats("host")
    >>> stats.allocated(4096); stats.wrote(4096)
    >>> stats.snapshot()["peak_bytes"]
    4096
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        # Every counter, in the order snapshot() lists them.
        self._counts: dict[str, int | float] = {
            "bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0, "wait_seconds": 0.0,
            "bytes_in_use": 0, "peak_bytes": 0, "keys": 0}

    def read(self, nbytes: int) -> None:
        """Count one read of ``nbytes`` payload bytes."""
        with self._lock:
            self._counts["bytes_read"] += nbytes
            self._counts["reads"] += 1

    def wrote(self, nbytes: int) -> None:
        """Count one write of ``nbytes`` payload bytes."""
        with self._lock:
            self._counts["bytes_written"] += nbytes
            self._counts["writes"] += 1

    def waited(self, seconds: float) -> None:
        """Add ``seconds`` a caller spent blocked on a transfer."""
        with self._lock:
            self._counts["wait_seconds"] += seconds

    def allocated(self, nbytes: int) -> None:
        """A key of ``nbytes`` now exists."""
        with self._lock:
            c = self._counts
            c["bytes_in_use"] += nbytes
            c["keys"] += 1
            c["peak_bytes"] = max(c["peak_bytes"], c["bytes_in_use"])

    def released(self, nbytes: int) -> None:
        """A key of ``nbytes`` was freed."""
        with self._lock:
            self._counts["bytes_in_use"] -= nbytes
            self._counts["keys"] -= 1

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._counts["bytes_in_use"]

    def snapshot(self) -> dict:
        """All counters as a JSON-able dict (a copy; later traffic does not change it)."""
        with self._lock:
            return {"name": self.name, **self._counts}


class WaitTimer:
    """Context manager adding the time spent inside it to a :class:`TierStats`."""

    __slots__ = ("_stats", "_start")

    def __init__(self, stats: TierStats) -> None:
        self._stats = stats
        self._start = 0.0

    def __enter__(self) -> "WaitTimer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stats.waited(time.perf_counter() - self._start)
