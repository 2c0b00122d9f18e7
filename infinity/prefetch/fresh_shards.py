"""Shards the overlapped optimizer step has just rewritten, held in host memory for the next forward."""
from __future__ import annotations

import threading

import torch

from infinity.param_group import ParamGroup


class FreshShards:
    """Shards the overlapped optimizer step has just rewritten, kept in host memory for the next forward.

    [Note: fresh shards]
    The overlapped step (``dpu.overlap``) writes each updated group's new compute copy to
    the NVMe parameter tier just before the next forward reads it back. So the step also
    copies it into a slice of the prefetcher's staging arena (the ``prefetch.nvme_bytes``
    budget reads ahead already use, so no memory is added), and the group's next fetch
    takes that slice instead of reading the shard: one NVMe read less per group and
    step, and the forward need not wait for the write to land. When the arena is full
    the group is simply read from NVMe as before. A shard is served once (the backward
    reads the written copy); complete ones not taken by the end of the next backward give
    their slices back (``clear``), and the next update starts from an empty set (``reset``,
    which also drops shards a failed update left half filled). Writing a group's shard any
    other way (``ParamShards.write``: loading a state or a checkpoint) discards its
    fresh copy.

    ``offer`` runs on the update's thread, everything else on the main thread; ``reset``
    only while no update runs.
    """

    def __init__(self, arena) -> None:
        self.arena = arena
        self._lock = threading.Lock()
        self._filling: dict[int, list] = {}     # group index -> [slice, elements missing]
        self._complete: dict[int, object] = {}  # group index -> arena slice holding the whole shard
        self._refused: set[int] = set()
        self.served = 0

    def offer(self, group: ParamGroup, offset_numel: int, values: torch.Tensor) -> None:
        """Copy ``values`` (compute dtype) into the group's fresh shard at ``offset_numel``."""
        gi = group.index
        with self._lock:
            entry = self._filling.get(gi)
            if entry is None:
                if gi in self._complete or gi in self._refused:
                    return
                piece = self.arena.take(group.shard_nbytes, f"fresh {group.name}")
                if piece is None:
                    self._refused.add(gi)
                    return
                entry = self._filling[gi] = [piece, group.shard_numel]
        n = values.numel()
        entry[0].tensor[:group.shard_nbytes].view(values.dtype)[offset_numel:offset_numel + n].copy_(values)
        with self._lock:
            entry[1] -= n
            if entry[1] == 0:
                del self._filling[gi]
                self._complete[gi] = entry[0]

    def has(self, group: ParamGroup) -> bool:
        return group.index in self._complete

    @property
    def held_bytes(self) -> int:
        """Arena bytes held by fresh shards not yet taken (complete or being filled)."""
        with self._lock:
            return (sum(piece.nbytes for piece in self._complete.values())
                    + sum(entry[0].nbytes for entry in self._filling.values()))

    def take(self, group: ParamGroup):
        """The group's complete fresh shard (an arena slice the caller releases), or None."""
        with self._lock:
            piece = self._complete.pop(group.index, None)
        if piece is not None:
            self.served += 1
        return piece

    def discard(self, group: ParamGroup) -> None:
        """Give back the group's fresh shard, if any (its stored shard is being rewritten)."""
        with self._lock:
            piece = self._complete.pop(group.index, None)
        if piece is not None:
            piece.release()

    def clear(self) -> None:
        """Give back every complete fresh shard not taken (end of a backward)."""
        with self._lock:
            done, self._complete = self._complete, {}
        for piece in done.values():
            piece.release()

    def reset(self) -> None:
        """Give back every shard, complete or not, and forget refusals (before an update starts)."""
        with self._lock:
            pieces = list(self._complete.values()) + [entry[0] for entry in self._filling.values()]
            self._complete, self._filling, self._refused = {}, {}, set()
        for piece in pieces:
            piece.release()
