"""Where every group's shard sits in a rank's flat fp32 space, and how that space is cut into sub-groups.

[Note: flat layout]
On each rank the fp32 shards of all parameter groups are placed back to back
into one flat space (group order, each shard a multiple of ALIGN_NUMEL long).
That space is cut into sub-groups of ``partition.sub_group_size`` elements; a
group may straddle two sub-groups. Master weights, ``exp_avg``, ``exp_avg_sq`` and
the gradient accumulator each live as one flat tensor per sub-group in the
optimizer tier, so the host Adam kernel runs on a few large flat tensors (about
35% faster than on many small ones) and the NVMe traffic is a few large
sequential transfers (``infinity.optim.flat_state.OptimizerStateStore``).

What the room may touch: nothing but numbers (shard lengths, offsets).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """A run of elements shared by one group's shard and one sub-group."""

    group_index: int
    sub_index: int
    group_offset: int
    sub_offset: int
    numel: int


class FlatLayout:
    """Where every group's shard sits in the rank's flat fp32 space and in the sub-groups.

    [Note: sub-groups apart for frozen groups]
    Sub-groups are consecutive runs of at most ``sub_group_size`` elements, and a new one starts at
    each group of ``breaks``: the engine breaks where the groups change between trainable and frozen
    when ``infinity.Init`` exits (and again when the optimizer is created: [Note: frozen after Init] in
    infinity/optim/relayout.py), so no sub-group mixes them. The update streams and steps whole sub-groups that hold a
    group with gradients; a frozen group sharing one with trainable groups had its states read and
    written at every step for nothing (with adapters trained on a frozen base: most of the bytes).

    Parameters
    ----------
    shard_numels:
        Shard length of each group, in group order.
    sub_group_size:
        Sub-group length in elements (rounded up to the groups' alignment).
    breaks:
        Indices of groups that start a sub-group.
    """

    def __init__(self, shard_numels: list[int], sub_group_size: int, breaks=()) -> None:
        self.group_starts, start = [], 0
        for n in shard_numels:
            self.group_starts.append(start)
            start += n
        self.shard_numels = list(shard_numels)
        self.total_numel = start
        size = max(2048, -(-sub_group_size // 2048) * 2048)
        self.sub_group_size = min(size, max(start, 2048))
        edges = sorted({0, start} | {self.group_starts[g] for g in breaks if 0 < g < len(shard_numels)})
        self.sub_ranges = [(s, min(self.sub_group_size, b - s))
                           for a, b in zip(edges, edges[1:]) for s in range(a, b, self.sub_group_size)]
        self.pieces_of_group: list[list[Piece]] = [[] for _ in shard_numels]
        self.pieces_of_sub: list[list[Piece]] = [[] for _ in self.sub_ranges]
        si = 0
        for gi, (g0, n) in enumerate(zip(self.group_starts, shard_numels)):
            pos = g0
            while pos < g0 + n:
                while pos >= sum(self.sub_ranges[si]):
                    si += 1
                s0, sn = self.sub_ranges[si]
                take = min(g0 + n, s0 + sn) - pos
                piece = Piece(gi, si, pos - g0, pos - s0, take)
                self.pieces_of_group[gi].append(piece)
                self.pieces_of_sub[si].append(piece)
                pos += take

    def sub_pieces(self, flat: int, numel: int):
        """``(sub, offset in it, n, offset from flat)`` of elements ``[flat, flat + numel)`` of the flat space."""
        si = bisect.bisect_right([s for s, _ in self.sub_ranges], flat) - 1
        done = 0
        while done < numel:
            s0, sn = self.sub_ranges[si]
            within = flat + done - s0
            take = min(sn - within, numel - done)
            yield si, within, take, done
            done += take
            si += 1

    @property
    def num_subs(self) -> int:
        return len(self.sub_ranges)
