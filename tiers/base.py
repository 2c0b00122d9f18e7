"""The one small interface every tier implements (shared/DESIGN.md, "tiers").

[Note: tier keys]
A tier stores opaque byte ranges. ``allocate`` (or ``put``) returns an integer key;
the key's size is fixed at allocation. Reads and writes move a contiguous tensor's
bytes to or from the key, optionally at a byte offset inside it, and return a
future. Tiers never interpret the bytes: the engine keeps dtype and shape.
"""
from __future__ import annotations

import abc
from typing import Iterable, Protocol

import torch


class Future(Protocol):
    """A pending transfer. ``wait()`` returns the byte count or raises ``OSError``."""

    def wait(self) -> int: ...

    def done(self) -> bool: ...


class CompletedFuture:
    """A transfer that finished synchronously (host and CPU device tiers)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def wait(self) -> int:
        return self.nbytes

    def done(self) -> bool:
        return True


def wait_quietly(futures: Iterable[Future]) -> None:
    """Wait for every transfer, ignoring their errors: one is already being raised.

    Used on error paths, so that no transfer outlives the failure into buffers or keys
    that are about to be reused; the error already on its way up is the one that counts.
    """
    for fut in futures:
        try:
            fut.wait()
        except Exception:  # noqa: BLE001 - the error being raised matters more
            pass


class Tier(abc.ABC):
    """A place where tensors' bytes live: ``device``, ``host`` or ``nvme``."""

    kind: str
    """Which of the three places this tier is: "device", "host" or "nvme" (its ``name`` may differ)."""

    name: str

    @abc.abstractmethod
    def allocate(self, nbytes: int, tag: str = "") -> int:
        """Reserve ``nbytes`` and return their key; the content is undefined until written.

        ``tag`` names the owner (e.g. the parameter) for error messages and telemetry.
        """

    def put(self, src: torch.Tensor, tag: str = "") -> int:
        """Allocate a key the size of ``src`` and write ``src`` into it; returns once written."""
        key = self.allocate(src.numel() * src.element_size(), tag)
        self.write(key, src).wait()
        return key

    @abc.abstractmethod
    def write(self, key: int, src: torch.Tensor, offset: int = 0) -> Future:
        """Start copying the contiguous tensor ``src`` into ``key`` at byte ``offset``."""

    @abc.abstractmethod
    def read(self, key: int, dst: torch.Tensor, offset: int = 0) -> Future:
        """Start copying ``dst.nbytes`` bytes of ``key`` from byte ``offset`` into ``dst``."""

    @abc.abstractmethod
    def free(self, key: int) -> None:
        """Release ``key``; an unknown key raises ``KeyError`` naming it."""

    @abc.abstractmethod
    def nbytes(self, key: int) -> int:
        """The size ``key`` was allocated with."""

    @abc.abstractmethod
    def capacity(self) -> int | None:
        """Bytes this tier may hold in all (None: unbounded / unknown)."""

    @abc.abstractmethod
    def bytes_in_use(self) -> int:
        """Bytes currently allocated."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Telemetry: bytes_read, bytes_written, wait_seconds, bytes_in_use, peak_bytes, ..."""

    def close(self) -> None:
        """Release what the tier holds besides its keys' memory (files, locks, threads); idempotent.

        The in-memory tiers hold nothing else; every tier is a context manager that closes on exit.
        """

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TierFullError(MemoryError):
    """An allocation would take a tier past its capacity (or its disk is full)."""


def byte_view(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat ``uint8`` tensor aliasing them (no copy).

    Raises ``ValueError`` naming ``what`` when ``tensor`` is not contiguous, because
    copying silently would defeat zero-copy transfers and hide a layout bug.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
            "call .contiguous() first"
        )
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def format_nbytes(nbytes: int | float) -> str:
    """``38.2 GiB``-style text for error messages and tables."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
