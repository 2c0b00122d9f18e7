"""The key table every tier keeps: key -> (where the bytes are, size, tag), with checked lookups.

Keys are never reused within a tier (a counter), so a stale key held by mistake fails
loudly with ``KeyError`` instead of reading someone else's bytes.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

Place = TypeVar("Place")


@dataclass(frozen=True)
class Entry(Generic[Place]):
    """One key: ``place`` (tier-specific: a tensor, a list of slots), ``nbytes`` and ``tag``."""

    place: Place
    nbytes: int
    tag: str


class KeyTable(Generic[Place]):
    """Thread-safe map of integer keys to :class:`Entry`; errors name the tier and the key."""

    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._entries: dict[int, Entry[Place]] = {}
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, place: Place, nbytes: int, tag: str) -> int:
        with self._lock:
            key = next(self._counter)
            self._entries[key] = Entry(place, nbytes, tag)
            return key

    def get(self, key: int) -> Entry[Place]:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(self._unknown(key))
        return entry

    def pop(self, key: int) -> Entry[Place]:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            raise KeyError(self._unknown(key))
        return entry

    def span(self, key: int, offset: int, nbytes: int, verb: str) -> Entry[Place]:
        """The entry of ``key`` after checking ``[offset, offset + nbytes)`` lies inside it."""
        entry = self.get(key)
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > entry.nbytes:
            raise ValueError(
                f"{self.tier_name} tier: cannot {verb} {nbytes} bytes at offset {offset} of key {key} "
                f"(tag {entry.tag!r}), which holds {entry.nbytes} bytes"
            )
        return entry

    def place(self, key: int, place: Place) -> Entry[Place]:
        """Give ``key`` its place (a key allocated before its place was known); returns the new entry."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(self._unknown(key))
            self._entries[key] = entry = Entry(place, entry.nbytes, entry.tag)
            return entry

    def items(self) -> list[tuple[int, Entry[Place]]]:
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _unknown(self, key: object) -> str:
        return f"{self.tier_name} tier: unknown key {key!r} (never allocated here, or already freed)"

    def validate_nbytes(self, nbytes: object, tag: str) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"{self.tier_name} tier: nbytes for {tag!r} must be an int >= 0, got {nbytes!r}")
        return nbytes
