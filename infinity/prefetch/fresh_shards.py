"""Shards an optimizer update has just rewritten, held in host memory for the next forward."""
from __future__ import annotations

import threading

import torch

from infinity.param_group import ParamGroup


class FreshShards:
    """Shards an optimizer update has just rewritten, kept in host memory for the next forward.

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

    The update during backward (``optimizer.update_in_backward``, see [Note: update during
    backward] in infinity/optim/in_backward.py) offers its shards the same way, but earlier:
    its update starts at the first sub-group stepped in a backward (``reset`` with
    ``outlive_backward``), so the end of that backward keeps them (``clear`` keeps them once)
    and ``opt.step()`` adds those of the sub-groups left for it without a second ``reset``.
    Its shards then wait through the rest of the backward for the next forward, and it
    offers them in reverse group order (the last groups first), while the forward wants the
    first groups first. So the arena is shared by priority, the shard needed soonest winning:
    an offer that finds no room displaces complete shards of groups after its own (needed
    later by the forward), the last first; and in backward, a read ahead that finds no room
    displaces complete shards of groups after the one it reads (``take_slice``), since this
    backward needs that read before the next forward needs any of them. A displaced group
    is read from NVMe by the next forward, as when the arena is full. With the groups in
    forward order (the order of their creation, as the overlapped update writes them), the
    arena ends the backward holding the first groups the forward needs, up to its size, and
    the backward's reads ahead are never starved by the shards.

    ``offer`` runs on the update's thread, everything else on the main thread; ``reset``
    only while no update runs.
    """

    def __init__(self, arena) -> None:
        self.arena = arena
        self._lock = threading.Lock()
        self._filling: dict[int, list] = {}     # group index -> [slice, elements missing]
        self._complete: dict[int, object] = {}  # group index -> arena slice holding the whole shard
        self._refused: set[int] = set()
        self._outlive_backward = False         # the running update began in a backward (update in backward)
        self.served = 0
        self.displaced = 0

    def offer(self, group: ParamGroup, offset_numel: int, values: torch.Tensor) -> None:
        """Copy ``values`` (compute dtype) into the group's fresh shard at ``offset_numel``."""
        gi = group.index
        with self._lock:
            entry = self._filling.get(gi)
            if entry is None:
                if gi in self._complete or gi in self._refused:
                    return
                piece = self._take(group.shard_nbytes, f"fresh {group.name}", gi)
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

    def take_slice(self, nbytes: int, owner: str, index: int):
        """An arena slice for a read ahead of group ``index`` in backward, displacing complete fresh
        shards of later groups when the arena has no room (None: still no room)."""
        with self._lock:
            return self._take(nbytes, owner, index)

    def _take(self, nbytes: int, owner: str, index: int):
        """An arena slice, displacing complete shards of groups after ``index``, the last first (lock held).

        Nothing is displaced when that could not make room (a shard larger than what they and the free
        bytes add up to: the largest groups, such as an embedding, may not fit the arena at all).
        """
        piece = self.arena.take(nbytes, owner)
        if piece is None:
            later = sorted((gi for gi in self._complete if gi > index), reverse=True)
            free = self.arena.capacity - self.arena.bytes_in_use
            if free + sum(self._complete[gi].nbytes for gi in later) < nbytes:
                return None
            for gi in later:
                self._complete.pop(gi).release()
                self.displaced += 1
                piece = self.arena.take(nbytes, owner)
                if piece is not None:
                    break
        return piece

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
        """Give back every complete fresh shard not taken (end of a backward), unless the running update
        began in this backward: its shards are for the next forward (kept once)."""
        with self._lock:
            if self._outlive_backward:
                self._outlive_backward = False
                return
            done, self._complete = self._complete, {}
        for piece in done.values():
            piece.release()

    def reset(self, outlive_backward: bool = False) -> None:
        """Give back every shard, complete or not, and forget refusals (before an update starts).

        ``outlive_backward``: the update starts during a backward, and the end of that backward keeps
        its shards (see [Note: fresh shards]).
        """
        with self._lock:
            pieces = list(self._complete.values()) + [entry[0] for entry in self._filling.values()]
            self._complete, self._filling, self._refused = {}, {}, set()
            self._outlive_backward = outlive_backward
        for piece in pieces:
            piece.release()
