"""The future every asynchronous tier transfer returns (see tiers/base.py, ``Future``).

[Note: one future type over three kinds of pending work]
An NVMe transfer is pending ``AioFuture``s (direct I/O) or a staging job on a worker
thread (pool path); a CUDA copy is pending on an event. :class:`TransferFuture` wraps
any of them behind ``wait()`` / ``done()``, times ``wait()`` into the tier's
telemetry, remembers the outcome (a second ``wait()`` returns the same count or raises
the same error), and runs the tier's completion hook exactly once, which is how the
NVMe tier knows when a freed key's slot may be reused.
"""
from __future__ import annotations

import threading
from typing import Callable

from tiers.telemetry import TierStats, WaitTimer


class TransferFuture:
    """A pending transfer of ``nbytes``; ``wait()`` returns ``nbytes`` or raises ``OSError``.

    Parameters
    ----------
    wait_fn : callable
        Blocks until the work finished; raises on failure. Its return value is ignored.
    done_fn : callable
        True when ``wait_fn`` would not block.
    nbytes : int
        Payload bytes, returned by ``wait()``.
    stats : TierStats
        Receives the seconds spent blocked in ``wait()``.
    on_complete : callable | None
        Called once, with the exception or None, when the outcome is first known.
    """

    __slots__ = ("_wait_fn", "_done_fn", "nbytes", "_stats", "_on_complete", "_lock", "_finished",
                 "_error")

    def __init__(self, wait_fn: Callable[[], object], done_fn: Callable[[], bool], nbytes: int,
                 stats: TierStats, on_complete: Callable[[BaseException | None], None] | None = None) -> None:
        self._wait_fn = wait_fn
        self._done_fn = done_fn
        self.nbytes = nbytes
        self._stats = stats
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None

    def wait(self) -> int:
        """Block until the transfer finished; return its byte count or raise its error."""
        with self._lock:
            if not self._finished:
                try:
                    with WaitTimer(self._stats):
                        self._wait_fn()
                except BaseException as exc:  # re-raised below, after bookkeeping
                    self._error = exc
                self._finished = True
                if self._on_complete is not None:
                    self._on_complete(self._error)
        if self._error is not None:
            raise self._error
        return self.nbytes

    def done(self) -> bool:
        """True when ``wait()`` would return (or raise) without blocking."""
        return self._finished or self._done_fn()

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "pending")
        return f"TransferFuture(nbytes={self.nbytes}, {state})"
