"""Type stub for the C core tiers._aio (aio_csrc/aio.c). See tiers/aio.py for the Python face."""
from typing import Any, Sequence

__version__: str
OP_READ: int
OP_WRITE: int

def engines() -> list[str]:
    """Engines this kernel allows, best first: ["io_uring", "threads"] or ["threads"]."""

def buffer_info(obj: Any, writable: bool = ...) -> tuple[int, int]:
    """(address, nbytes) of a C-contiguous buffer-protocol object."""

class Handle:
    """One I/O engine instance; ids are opaque ints, valid until reaped."""

    engine: str  # "io_uring" | "threads"
    queue_depth: int
    threads: int
    block_size: int
    closed: bool
    owner_pid: int  # process that created the handle (a fork child cannot use it)
    active: int  # requests submitted and not yet complete
    pieces_issued: int
    stats: dict[str, float]  # pieces_issued, pieces_done, mean_depth (pieces in flight seen by each completion)
    def __init__(self, engine: str = ..., queue_depth: int = ..., threads: int = ..., block_size: int = ...) -> None: ...
    def submit(self, op: int, fd: int, file_offset: int, buffer: Any) -> int:
        """Start a read/write of a buffer-protocol object (held until reaped)."""
    def submit_ptr(self, op: int, fd: int, file_offset: int, address: int, nbytes: int, owner: Any) -> int:
        """Start a read/write of raw memory; ``owner`` is kept referenced until reaped. Refused: a span
        in the null page or wrapping around, and one leaving ``owner``'s buffer (or a read into a
        read-only one) when ``owner`` has the buffer protocol."""
    def wait(self, id: int, timeout: float = ...) -> bool:
        """Block with the GIL released until ``id`` completes (timeout < 0 or inf: no limit; NaN is a
        ValueError); False on timeout."""
    def done(self, id: int) -> bool: ...
    def reap(self, id: int) -> tuple[int, int]:
        """(nbytes or -errno, failing file offset or -1); frees the id and releases the buffer.
        KeyError for an unknown, released or already reaped id."""
    def release(self, id: int) -> None:
        """Forget ``id``: its buffer is released once it completes. The id is dead from then on: a
        second release does nothing, reap raises KeyError."""
    def wait_any(self, ids: Sequence[int], timeout: float = ...) -> int | None: ...
    def wait_all(self, timeout: float = ...) -> bool: ...
    def drain(self, timeout: float = ...) -> list[int]:
        """Refuse new requests; wait while those in flight progress, cancel them when none finishes for
        ``timeout`` s; return the ids still in flight ``timeout`` s after the cancel."""
    def close(self, timeout: float = ...) -> None:
        """Drain, stop the engine, release every buffer. TimeoutError naming the requests that could
        not be ended: the handle then keeps them and their buffers; close again once they end."""
    def _inject(self, op: int, errno: int, nth: int) -> None:
        """Test hook: the nth next piece of ``op`` (-1: any op) fails with ``errno`` (> 0) instead of
        being issued; nth 0 disarms."""
    def _stall(self, op: int, nth: int, seconds: float) -> None:
        """Test hook: the nth next piece of ``op`` (-1: any op) waits ``seconds`` before it is issued:
        a kernel timer that close cancels (io_uring), a sleep nothing interrupts (threads)."""
