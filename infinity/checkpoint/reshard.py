"""Which saved bytes make up each new shard: loading onto any world size and any grouping.

[Note: resharding by parameter]
A group's shards are slices of its padded flat tensor: element ``i`` of group ``g``
lives on rank ``i // S_g`` at position ``i % S_g`` of its shard, where ``S_g`` is the
shard length (which depends on the world size, ``padded_shard_numel``). Every
rank's data files hold its shards back to back (the rank's flat space), so element
``i`` is at flat element ``start_g + i % S_g`` of rank ``i // S_g``'s file. To load,
each new rank walks the parameters of each of its groups, finds every parameter's
saved group and offset by name, clips it to the new shard's range, and turns the
result into *moves* (contiguous runs of elements from one saved rank's file), with
adjacent parameters merged; what no parameter covers is padding and is *filled*
with zeros. Each rank reads only the bytes of its own new shards, straight from
the files (no collective, no whole-group buffer), so a load onto a different world
size costs the same I/O as one onto the same world size. Matching by name, not by
group index, also loads a checkpoint into a model whose parameters are grouped
differently (for instance tiled after saving) as long as names and shapes agree.
"""
from __future__ import annotations

from dataclasses import dataclass

from infinity.checkpoint.errors import CheckpointMismatchError


@dataclass(frozen=True)
class SavedParam:
    """A parameter as saved: its group, offset in the group's flat tensor, size, shape and names."""

    group: int
    offset: int
    numel: int
    shape: tuple[int, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class TargetSlot:
    """A parameter of the model being loaded: its names (aliases), offset in its group, size, shape."""

    names: tuple[str, ...]
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TargetGroup:
    index: int
    shard_numel: int
    slots: tuple[TargetSlot, ...]


@dataclass(frozen=True)
class Move:
    """``numel`` elements from flat element ``src_elem`` of saved rank ``src_rank``'s files to
    element ``dst_elem`` of the new shard of group ``group``."""

    group: int
    src_rank: int
    src_elem: int
    dst_elem: int
    numel: int


@dataclass(frozen=True)
class Fill:
    """``numel`` zero elements at element ``dst_elem`` of the new shard of group ``group`` (padding)."""

    group: int
    dst_elem: int
    numel: int


class SavedLayout:
    """The sharding a checkpoint was saved with, read from its global manifest."""

    def __init__(self, manifest: dict) -> None:
        self.world_size = int(manifest["world_size"])
        self.group_starts = [int(s) for s in manifest["layout"]["group_starts"]]
        self.shard_numels = [int(g["shard_numel"]) for g in manifest["groups"]]
        self.params: list[SavedParam] = []
        self.by_name: dict[str, SavedParam] = {}
        for gi, group in enumerate(manifest["groups"]):
            for p in group["params"]:
                sp = SavedParam(gi, int(p["offset"]), int(p["numel"]), tuple(int(d) for d in p["shape"]),
                                tuple(p["names"]))
                self.params.append(sp)
                for name in sp.names:
                    self.by_name[name] = sp

    def locate(self, group: int, start: int, numel: int):
        """Yield ``(rank, flat_elem, rel, n)``: elements ``[start, start + numel)`` of a saved group's
        flat tensor are at ``flat_elem`` of ``rank``'s files; ``rel`` is the offset from ``start``."""
        shard = self.shard_numels[group]
        base = self.group_starts[group]
        i, end = start, start + numel
        while i < end:
            rank, within = divmod(i, shard)
            take = min(shard - within, end - i)
            yield rank, base + within, i - start, take
            i += take


def _segments(group: TargetGroup, saved: SavedLayout, used: set, missing: list):
    """(new_offset, saved_group, saved_offset, numel) per run of parameters, adjacent ones merged."""
    segments: list[list[int]] = []
    for slot in group.slots:
        found = next((saved.by_name[n] for n in slot.names if n in saved.by_name), None)
        if found is None:
            missing.append(slot.names[0])
            continue
        if found.shape != tuple(slot.shape):
            raise CheckpointMismatchError(
                f"parameter {slot.names[0]!r} has shape {tuple(slot.shape)} in the model but "
                f"{found.shape} in the checkpoint")
        used.add((found.group, found.offset))
        last = segments[-1] if segments else None
        if last and last[0] + last[3] == slot.offset and last[1] == found.group and last[2] + last[3] == found.offset:
            last[3] += slot.numel
        else:
            segments.append([slot.offset, found.group, found.offset, slot.numel])
    return segments


def plan_shards(saved: SavedLayout, groups: list[TargetGroup], rank: int, world_size: int
                ) -> tuple[list[Move], list[Fill]]:
    """The moves and fills that build ``rank``'s new shards of ``groups`` (see [Note: resharding by parameter])."""
    moves: list[Move] = []
    fills: list[Fill] = []
    used: set = set()
    missing: list[str] = []
    for group in groups:
        lo = rank * group.shard_numel
        hi = lo + group.shard_numel
        covered = []
        for new_offset, saved_group, saved_offset, numel in _segments(group, saved, used, missing):
            a, b = max(new_offset, lo), min(new_offset + numel, hi)
            if a >= b:
                continue
            for src_rank, src_elem, rel, n in saved.locate(saved_group, saved_offset + a - new_offset, b - a):
                moves.append(Move(group.index, src_rank, src_elem, a - lo + rel, n))
            covered.append((a - lo, b - lo))
        position = 0
        for a, b in sorted(covered):
            if a > position:
                fills.append(Fill(group.index, position, a - position))
            position = max(position, b)
        if position < group.shard_numel:
            fills.append(Fill(group.index, position, group.shard_numel - position))
    unused = [p.names[0] for p in saved.params if (p.group, p.offset) not in used]
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) of the model are not in the checkpoint: {_few(missing)}")
        if unused:
            parts.append(f"{len(unused)} parameter(s) of the checkpoint are not in the model: {_few(unused)}")
        raise CheckpointMismatchError("the checkpoint does not fit this model: " + "; ".join(parts))
    return moves, fills


def _few(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
