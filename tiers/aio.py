"""Asynchronous file I/O: the Python face of the ``tiers._aio`` C core (shared/DESIGN.md, "aio_csrc").

[Note: aio futures]
``AioHandle.pread`` / ``pwrite`` return an :class:`AioFuture` at once; the C core splits the request
into ``block_size`` pieces and keeps up to ``queue_depth`` of them in flight (``threads`` for the
thread-pool engine). ``AioFuture.wait()`` blocks with the GIL released until *its own* request is
complete, returns the byte count, or raises ``OSError`` naming the errno, the file and the offset
where it failed. A read that finds the end of the file before the buffer is full is an error
(:class:`ShortReadError`), never a silent short count. The buffer (a tensor or any writable
buffer-protocol object) stays referenced by the C core until the request is reaped, so dropping the
last Python reference while I/O is in flight is safe.

[Note: O_DIRECT alignment]
With ``O_DIRECT`` (the default) the kernel moves bytes straight between the disk and the buffer,
which requires the buffer address, the file offset and the length to be multiples of the logical
block size. We check against :data:`ALIGNMENT` (4096, the page size, which covers every NVMe
logical block size in use) before submitting, so a misaligned request fails with an
:class:`AlignmentError` saying which of the three is off instead of an opaque ``EINVAL``.

Example
-------
>>> from tiers.aio import AioHandle, aligned_empty, open_file
>>> buf = aligned_empty(1 << 20)
>>> with AioHandle() as h, open_file("/tmp/x.bin", "rw", create=True) as f:  # doctest: +SKIP
...     h.pwrite(f, buf, 0).wait()
...     h.pread(f, buf, 0).wait()
1048576
1048576
"""
from __future__ import annotations

import errno as errno_mod
import math
import os
import threading
import weakref
from typing import Any, Iterable, Sequence

import torch

from tiers import _aio
from tiers.aio_file import AioFile, open_file

ALIGNMENT = 4096
"""Alignment (bytes) required of buffer address, file offset and length under ``O_DIRECT``."""

MAX_QUEUE_DEPTH = 4096
"""Most pieces one handle keeps in flight: the C core's ring and slot table (aio_csrc/lifecycle.h)."""

MAX_THREADS = 256
"""Most worker threads of the thread-pool engine (aio_csrc/lifecycle.h)."""

CLOSE_TIMEOUT_S = 10.0
"""Seconds without any progress after which ``close`` cancels what is in flight ([Note: shutdown] in
aio_csrc/lifecycle.h)."""

ENGINES = ("io_uring", "threads")

__all__ = [
    "ALIGNMENT",
    "CLOSE_TIMEOUT_S",
    "MAX_QUEUE_DEPTH",
    "MAX_THREADS",
    "AioFile",
    "AioFuture",
    "AioHandle",
    "AlignmentError",
    "ShortReadError",
    "aligned_empty",
    "available_engines",
    "is_aligned",
    "open_file",
    "version",
]


class AlignmentError(ValueError):
    """An ``O_DIRECT`` request whose address, file offset or length is not a multiple of ALIGNMENT."""


class ShortReadError(OSError):
    """A read reached the end of the file before filling its buffer (errno ``ENODATA``)."""


def version() -> str:
    """Version string of the C core."""
    return _aio.__version__


def available_engines() -> list[str]:
    """Engines this kernel allows, best first (``io_uring`` is absent where it is refused)."""
    return list(_aio.engines())


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> torch.Tensor:
    """A CPU ``uint8`` tensor of ``nbytes`` whose data pointer is a multiple of ``alignment``.

    The tensor is a view into a slightly larger allocation (no copy), so it can be handed to
    ``O_DIRECT`` I/O and used as any other tensor (``.view(dtype)``, ``.copy_()``).

    Examples
    --------
    >>> t = aligned_empty(4097)
    >>> t.numel(), t.data_ptr() % 4096
    (4097, 0)
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two, got {alignment}")
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    return raw[start : start + nbytes]


def _buffer_span(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, owner) of a contiguous CPU tensor or a buffer-protocol object."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"aio buffers must be CPU tensors, got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError(f"aio buffers must be contiguous, got strides {tuple(buf.stride())}")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    try:
        address, nbytes = _aio.buffer_info(buf, writable)
    except BufferError as e:
        need = "writable, C-contiguous" if writable else "C-contiguous"
        raise ValueError(f"aio buffers must be {need}: {e}") from e
    except TypeError as e:
        raise TypeError(f"aio buffers must be a CPU tensor or support the buffer protocol, got {type(buf).__name__}") from e
    return address, nbytes, buf


def is_aligned(buf: Any, file_offset: int = 0, alignment: int = ALIGNMENT) -> bool:
    """Whether ``buf`` (tensor or buffer) at ``file_offset`` meets the ``O_DIRECT`` rules."""
    address, nbytes, _ = _buffer_span(buf, writable=False)
    return address % alignment == 0 and file_offset % alignment == 0 and nbytes % alignment == 0


def _check_alignment(file: AioFile, address: int, nbytes: int, file_offset: int, op: str) -> None:
    bad = [
        f"{name} {value:#x} is {value % ALIGNMENT} bytes past a multiple of {ALIGNMENT}"
        if name == "buffer address"
        else f"{name} {value} is {value % ALIGNMENT} bytes past a multiple of {ALIGNMENT}"
        for name, value in (("buffer address", address), ("file_offset", file_offset), ("length", nbytes))
        if value % ALIGNMENT
    ]
    if bad:
        raise AlignmentError(
            f"{op} of {nbytes} bytes at offset {file_offset} of {file.path} with O_DIRECT needs the "
            f"buffer address, file offset and length to be multiples of {ALIGNMENT} bytes: "
            + "; ".join(bad)
            + ". Allocate with tiers.aio.aligned_empty(), pad the length, or open the file with direct=False."
        )


class AioFuture:
    """A pending read or write; see [Note: aio futures].

    Attributes
    ----------
    file : AioFile
    file_offset : int
    nbytes : int
    op : "read" | "write"
    """

    __slots__ = ("_handle", "rid", "file", "file_offset", "nbytes", "op", "_result", "_error", "__weakref__")

    def __init__(self, handle: AioHandle, rid: int, file: AioFile, file_offset: int, nbytes: int, op: str) -> None:
        self._handle = handle
        self.rid = rid
        self.file = file
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.op = op
        self._result: int | None = None
        self._error: OSError | None = None

    @property
    def settled(self) -> bool:
        """Whether the outcome was reaped (``wait`` returns or raises at once)."""
        return self._result is not None or self._error is not None

    def done(self) -> bool:
        """True once the request has completed (successfully or not); never blocks."""
        return self.settled or self._handle.request_done(self.rid)

    def wait(self, timeout: float | None = None) -> int:
        """Block (GIL released) until this request completes; return the byte count.

        ``timeout``: None (or ``math.inf``) waits until it completes; else seconds >= 0.

        Raises
        ------
        ValueError
            for a negative or NaN ``timeout``.
        OSError
            with ``errno``, a message naming the offset, and ``filename`` = the file's path.
            :class:`ShortReadError` (``ENODATA``) when a read ran past the end of the file.
        TimeoutError
            when ``timeout`` seconds pass first (the request stays in flight).
        """
        if not self.settled:
            if not self._handle.wait_request(self.rid, timeout):
                raise TimeoutError(
                    f"{self.op} of {self.nbytes} bytes at offset {self.file_offset} of {self.file.path} "
                    f"still in flight after {timeout} s"
                )
            self._handle.reap(self)
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def settle(self, result: int, err_offset: int) -> None:
        """Record the reaped outcome (called by the handle, once)."""
        if result >= 0:
            self._result = result
        else:
            self._error = _make_error(self, -result, err_offset)

    def __del__(self) -> None:
        if not self.settled:
            try:
                self._handle.release_request(self.rid)
            except Exception:  # interpreter shutdown: the handle's close releases everything
                pass

    def __repr__(self) -> str:
        state = "done" if self.settled else "pending"
        return f"AioFuture({self.op} {self.nbytes} B at {self.file_offset} of {self.file.path!r}, {state})"


def _make_error(fut: AioFuture, err: int, err_offset: int) -> OSError:
    what = f"{fut.op} of {fut.nbytes} bytes at offset {fut.file_offset}"
    if err == errno_mod.ENODATA and fut.op == "read":
        try:
            size = f"the file is {os.fstat(fut.file.fd).st_size} bytes"
        except OSError:
            size = "the file size is unknown"
        return ShortReadError(
            err, f"short read: {what} reached the end of the file at offset {err_offset} ({size})", fut.file.path
        )
    hint = ""
    if err == errno_mod.ENOSPC:
        hint = " (the disk is full: free space or point nvme_path elsewhere)"
    elif err == errno_mod.EINVAL and fut.file.direct:
        hint = " (O_DIRECT refused: check the filesystem supports it and its block size divides 4096)"
    return OSError(err, f"{what} failed at offset {err_offset}: {os.strerror(err)}{hint}", fut.file.path)


def _check_positive(name: str, value: int, most: int, spelled: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"AioHandle: {name} must be a positive int, got {value!r}")
    if value > most:
        raise ValueError(f"AioHandle: {name} must be at most {spelled}, got {value}")


def _seconds(timeout: float | None) -> float:
    """A timeout for the C core: None is no limit (-1.0 there); else seconds >= 0, ``inf`` included."""
    if timeout is None:
        return -1.0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None (no limit) or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


class AioHandle:
    """Submits reads and writes and keeps many in flight; see [Note: aio futures].

    Parameters
    ----------
    block_size : bytes per piece a request is split into (multiple of 4096).
    queue_depth : pieces in flight at once (io_uring engine).
    threads : worker threads (threads engine).
    engine : ``"auto"`` (io_uring when the kernel allows it, else threads), ``"io_uring"``, ``"threads"``.
    direct : default ``direct`` for :meth:`open`.

    Examples
    --------
    >>> with AioHandle(block_size=1 << 20) as h:  # doctest: +SKIP
    ...     f = h.open("/tmp/x.bin", "rw", create=True)
    ...     futs = [h.pwrite(f, aligned_empty(1 << 20), i << 20) for i in range(8)]
    ...     h.wait_all()
    """

    def __init__(
        self,
        block_size: int = 8 << 20,
        queue_depth: int = 32,
        threads: int = 4,
        engine: str = "auto",
        direct: bool = True,
    ) -> None:
        _check_positive("block_size", block_size, 1 << 30, "1 GiB")
        _check_positive("queue_depth", queue_depth, MAX_QUEUE_DEPTH, str(MAX_QUEUE_DEPTH))
        _check_positive("threads", threads, MAX_THREADS, str(MAX_THREADS))
        if block_size % ALIGNMENT:
            raise ValueError(f"AioHandle: block_size must be a multiple of {ALIGNMENT}, got {block_size}")
        if engine not in ("auto",) + ENGINES:
            raise ValueError(f"AioHandle: engine must be 'auto', 'io_uring' or 'threads', got {engine!r}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self.direct = bool(direct)
        self.fallback_reason: str | None = None
        self._lock = threading.Lock()
        self._futures: weakref.WeakValueDictionary[int, AioFuture] = weakref.WeakValueDictionary()
        self._core = self._make_core(engine)

    def _make_core(self, engine: str) -> Any:
        if engine in ("auto", "io_uring"):
            try:
                return _aio.Handle("io_uring", self.queue_depth, self.threads, self.block_size)
            except OSError as e:
                if engine == "io_uring":
                    raise OSError(e.errno, f"io_uring refused by this kernel or container: {e.strerror}; "
                                  "use engine='threads' or 'auto'") from e
                self.fallback_reason = f"io_uring_setup refused ({e.strerror}); using the thread pool"
        return _aio.Handle("threads", self.queue_depth, self.threads, self.block_size)

    @property
    def engine(self) -> str:
        """The engine in use: ``"io_uring"`` or ``"threads"``."""
        return self._core.engine

    @property
    def closed(self) -> bool:
        return self._core.closed

    def open(self, path: str | os.PathLike[str], mode: str, *, create: bool = False, perms: int = 0o644) -> AioFile:
        """:func:`open_file` with this handle's ``direct`` setting."""
        return open_file(path, mode, direct=self.direct, create=create, perms=perms)

    def pread(self, file: AioFile, buf: Any, file_offset: int) -> AioFuture:
        """Start reading ``nbytes(buf)`` bytes at ``file_offset`` of ``file`` into ``buf``.

        A read-only buffer (``bytes``, a read-only memoryview or array) is refused. A tensor carries
        no such flag: one made over read-only memory (``torch.frombuffer(some_bytes)``, which torch
        warns about) cannot be told from a writable tensor here, and would be written into.
        """
        return self._submit(_aio.OP_READ, "read", file, buf, file_offset)

    def pwrite(self, file: AioFile, buf: Any, file_offset: int) -> AioFuture:
        """Start writing all of ``buf`` at ``file_offset`` of ``file``."""
        return self._submit(_aio.OP_WRITE, "write", file, buf, file_offset)

    def _submit(self, op: int, opname: str, file: AioFile, buf: Any, file_offset: int) -> AioFuture:
        if self._core.closed:
            raise ValueError("I/O operation on a closed AioHandle")
        if not isinstance(file, AioFile):
            raise TypeError(f"AioHandle.p{opname}: file must be an AioFile from open_file(), got {type(file).__name__}")
        if file.fd < 0:
            raise ValueError(f"I/O operation on closed file {file.path}")
        if not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"{opname} at offset {file_offset!r} of {file.path}: file_offset must be an int >= 0")
        address, nbytes, owner = _buffer_span(buf, writable=op == _aio.OP_READ)
        if file.direct:
            _check_alignment(file, address, nbytes, file_offset, opname)
        try:
            rid = self._core.submit_ptr(op, file.fd, file_offset, address, nbytes, owner)
        except ValueError as e:
            raise ValueError(f"I/O operation on a closed AioHandle ({e})") from e
        except OSError as e:
            raise OSError(e.errno, f"cannot {opname} {file.path}: {e.strerror}", file.path) from e
        fut = AioFuture(self, rid, file, file_offset, nbytes, opname)
        self._futures[rid] = fut
        file.track(rid, self._core, self._futures.__contains__)
        return fut

    def wait_any(self, futures: Sequence[AioFuture], timeout: float | None = None) -> AioFuture | None:
        """Block until one of ``futures`` is done and return it (None when ``timeout`` passes; as in
        :meth:`AioFuture.wait`, None or ``math.inf`` is no limit)."""
        for f in futures:
            if f.settled:
                return f
        if not futures:
            raise ValueError("wait_any needs at least one future")
        rid = self._core.wait_any([f.rid for f in futures], _seconds(timeout))
        if rid is None:
            return None
        return next(f for f in futures if f.rid == rid)

    def wait_all(self, futures: Iterable[AioFuture] | None = None) -> int:
        """Wait for every request in flight (or just ``futures``); return total bytes moved.

        Every outstanding future is settled; the first error is raised after all have completed.
        """
        if futures is None:
            self._core.wait_all(-1.0)
            futures = list(self._futures.values())
        futures = list(futures)
        for fut in futures:
            if not isinstance(fut, AioFuture):
                raise TypeError(f"AioHandle.wait_all: expected the AioFutures that pread/pwrite returned, got "
                                f"{type(fut).__name__} {fut!r}")
        total = 0
        first: OSError | None = None
        for fut in futures:
            try:
                total += fut.wait()
            except OSError as e:
                first = first or e
        if first is not None:
            raise first
        return total

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait for all requests, settle their futures, stop the engine. Idempotent.

        Requests are waited for as long as they make progress; when none does for ``timeout``
        seconds (None: never give up), the rest are cancelled and their futures raise ``OSError``
        (``ECANCELED``). A request still in flight ``timeout`` seconds after that raises
        ``TimeoutError`` naming its file, and the handle keeps its buffer ([Note: shutdown] in
        aio_csrc/lifecycle.h).
        """
        if self._core.closed:
            return
        if self._core.owner_pid != os.getpid():
            self._core.close()  # a fork child: see [Note: fork] in aio_csrc/lifecycle.h
            return
        left = set(self._core.drain(_seconds(timeout)))
        for fut in list(self._futures.values()):
            if not fut.settled and fut.rid not in left:
                self.reap(fut)
        if left:
            stuck = [f"{fut.op} of {fut.nbytes} bytes at offset {fut.file_offset} of {fut.file.path}"
                     for fut in self._futures.values() if fut.rid in left]
            raise TimeoutError(f"AioHandle.close: {len(left)} request(s) still in flight {timeout} s after they "
                               f"were cancelled ({'; '.join(stuck[:4])}); the handle keeps them and their "
                               "buffers, which the kernel or a pool thread may still write into")
        self._core.close()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AioHandle(engine={self.engine!r}, block_size={self.block_size}, queue_depth={self.queue_depth}, "
            f"threads={self.threads}, direct={self.direct}{', closed' if self.closed else ''})"
        )

    # -- used by AioFuture ------------------------------------------------------------------
    def request_done(self, rid: int) -> bool:
        """Whether request ``rid`` has completed (never blocks)."""
        return self._core.done(rid)

    def wait_request(self, rid: int, timeout: float | None) -> bool:
        """Block until request ``rid`` completes; False when ``timeout`` seconds pass first."""
        return self._core.wait(rid, _seconds(timeout))

    def reap(self, fut: AioFuture) -> None:
        """Collect a completed request's outcome into ``fut`` (once)."""
        # Two threads may wait on one future; the lock makes exactly one of them reap it.
        with self._lock:
            if not fut.settled:
                result, err_offset = self._core.reap(fut.rid)
                fut.settle(result, err_offset)
                self._futures.pop(fut.rid, None)
                fut.file.untrack(fut.rid)

    def release_request(self, rid: int) -> None:
        """A future was dropped unreaped: the core may forget the request once it completes."""
        if not self._core.closed:
            self._core.release(rid)
