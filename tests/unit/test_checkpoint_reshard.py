"""The resharding planner against a brute-force model of the saved files, over world sizes and groupings.

Saved "files" are built as the writer lays them out (each rank's shards back to back, padding
marked with a sentinel), the planner's moves and fills are applied, and every new shard must
equal the slice of its group's flat tensor built directly from the parameter values.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from infinity.checkpoint.errors import CheckpointMismatchError
from infinity.checkpoint.reshard import SavedLayout, TargetGroup, TargetSlot, plan_shards
from infinity.param_group import padded_shard_numel

SENTINEL = -7.0


def _values(params):
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(numel).astype(np.float32) + 10 for name, numel in params}


def _saved(groups, values, world):
    """The global manifest and every rank's flat file for ``groups`` (lists of (name, numel)) on ``world`` ranks."""
    manifest = {"world_size": world, "groups": [], "layout": {"group_starts": []}}
    start = 0
    files = [[] for _ in range(world)]
    for group in groups:
        numel = sum(n for _, n in group)
        shard = padded_shard_numel(numel, world)
        full = np.full(shard * world, SENTINEL, dtype=np.float32)
        params, offset = [], 0
        for name, n in group:
            params.append({"names": [name], "shape": [n], "offset": offset, "numel": n})
            full[offset:offset + n] = values[name]
            offset += n
        manifest["groups"].append({"shard_numel": shard, "params": params})
        manifest["layout"]["group_starts"].append(start)
        start += shard
        for r in range(world):
            files[r].append(full[r * shard:(r + 1) * shard])
    return manifest, [np.concatenate(f) for f in files]


def _targets(groups, world):
    out = []
    for index, group in enumerate(groups):
        slots, offset = [], 0
        for name, n in group:
            slots.append(TargetSlot((name,), offset, n, (n,)))
            offset += n
        out.append(TargetGroup(index, padded_shard_numel(offset, world), tuple(slots)))
    return out


def _check(saved_groups, target_groups, old_world, new_world):
    params = [p for g in saved_groups for p in g]
    values = _values(params)
    manifest, files = _saved(saved_groups, values, old_world)
    layout = SavedLayout(manifest)
    targets = _targets(target_groups, new_world)
    for rank in range(new_world):
        moves, fills = plan_shards(layout, targets, rank, new_world)
        shards = {t.index: np.full(t.shard_numel, np.nan, dtype=np.float32) for t in targets}
        for m in moves:
            shards[m.group][m.dst_elem:m.dst_elem + m.numel] = files[m.src_rank][m.src_elem:m.src_elem + m.numel]
        for f in fills:
            assert np.isnan(shards[f.group][f.dst_elem:f.dst_elem + f.numel]).all(), "a fill overlaps a move"
            shards[f.group][f.dst_elem:f.dst_elem + f.numel] = 0.0
        for t, group in zip(targets, target_groups):
            full = np.zeros(t.shard_numel * new_world, dtype=np.float32)
            offset = 0
            for name, n in group:
                full[offset:offset + n] = values[name]
                offset += n
            expected = full[rank * t.shard_numel:(rank + 1) * t.shard_numel]
            np.testing.assert_array_equal(shards[t.index], expected)


ODD = [("a", 1), ("b", 4095), ("c", 4097), ("d", 2048), ("e", 3), ("f", 6150), ("g", 2049), ("h", 7)]
GROUPS = [ODD[0:1], ODD[1:3], ODD[3:4], ODD[4:7], ODD[7:8]]


@pytest.mark.parametrize("old_world, new_world", list(itertools.product((1, 2, 3, 4), (1, 2, 3, 4))))
def test_every_world_size_to_every_other(old_world, new_world):
    _check(GROUPS, GROUPS, old_world, new_world)


def test_regrouped_parameters_are_found_by_name():
    regrouped = [[("h", 7), ("a", 1)], [("b", 4095)], [("c", 4097), ("d", 2048), ("e", 3)], [("g", 2049), ("f", 6150)]]
    _check(GROUPS, regrouped, 2, 3)


def test_random_layouts():
    rng = random.Random(3)
    for _ in range(20):
        names = [(f"p{i}", rng.choice([1, 2, 17, 2047, 2048, 2049, 5000])) for i in range(rng.randint(1, 9))]
        cuts = sorted(rng.sample(range(1, len(names)), rng.randint(0, len(names) - 1))) if len(names) > 1 else []
        groups = [names[a:b] for a, b in zip([0] + cuts, cuts + [len(names)])]
        _check(groups, groups, rng.randint(1, 5), rng.randint(1, 5))


def test_missing_unexpected_and_misshapen_parameters_are_named():
    manifest, _ = _saved(GROUPS, _values([p for g in GROUPS for p in g]), 1)
    layout = SavedLayout(manifest)
    fewer = _targets([ODD[0:1]], 1)
    with pytest.raises(CheckpointMismatchError, match=r"7 parameter\(s\) of the checkpoint are not in the model: 'b'"):
        plan_shards(layout, fewer, 0, 1)
    more = _targets(GROUPS + [[("zz", 5)]], 1)
    with pytest.raises(CheckpointMismatchError, match="not in the checkpoint: 'zz'"):
        plan_shards(layout, more, 0, 1)
    wrong = [TargetGroup(0, 2048, (TargetSlot(("a",), 0, 1, (1, 1)),))]
    with pytest.raises(CheckpointMismatchError, match=r"'a' has shape \(1, 1\) in the model but \(1,\)"):
        plan_shards(layout, wrong, 0, 1)
