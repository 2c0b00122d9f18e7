"""The flat layout of a rank's optimizer states: groups in sub-groups, and sub-groups kept apart at breaks.

See [Note: sub-groups apart for frozen groups] in infinity/optim/flat_layout.py: the engine starts a sub-group
wherever the groups change between trainable and frozen, so the update, which streams whole sub-groups,
never moves a frozen group's states beside a trainable one's.
"""
from __future__ import annotations

import torch
from torch import nn

import infinity
from infinity import registry
from infinity.optim.flat_layout import FlatLayout


def _check_tiling(layout: FlatLayout) -> None:
    """Sub-groups tile the flat space in order; each group's pieces cover its shard exactly."""
    pos = 0
    for start, numel in layout.sub_ranges:
        assert start == pos and 0 < numel <= layout.sub_group_size
        pos += numel
    assert pos == layout.total_numel
    for gi, pieces in enumerate(layout.pieces_of_group):
        assert sum(p.numel for p in pieces) == layout.shard_numels[gi]
        for p in pieces:
            s0, _ = layout.sub_ranges[p.sub_index]
            assert s0 + p.sub_offset == layout.group_starts[gi] + p.group_offset


def test_sub_groups_are_cut_by_size_and_at_every_break():
    plain = FlatLayout([4096, 2048, 6144, 2048], 8192)
    assert plain.sub_ranges == [(0, 8192), (8192, 6144)]
    broken = FlatLayout([4096, 2048, 6144, 2048], 8192, breaks=[2, 3])
    assert broken.sub_ranges == [(0, 6144), (6144, 6144), (12288, 2048)]
    assert [[p.sub_index for p in ps] for ps in broken.pieces_of_group] == [[0], [0], [1], [2]]
    for layout in (plain, broken, FlatLayout([10240, 2048, 4096], 4096, breaks=[1])):
        _check_tiling(layout)


def test_sub_pieces_walk_the_sub_groups_a_flat_range_crosses():
    layout = FlatLayout([4096, 2048, 6144, 2048], 8192, breaks=[2, 3])
    assert list(layout.sub_pieces(4096, 6144)) == [(0, 4096, 2048, 0), (1, 0, 4096, 2048)]
    assert list(layout.sub_pieces(12288, 2048)) == [(2, 0, 2048, 0)]


def test_a_block_frozen_in_init_shares_no_sub_group_with_trainable_groups():
    with infinity.Init({"tiers": {"params": "host", "device": "cpu"}, "partition": {"sub_group_size": 1 << 20}}):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
        model[1].requires_grad_(False)
    engine = registry.engine_of(model)
    layout = engine.store.layout
    _check_tiling(layout)
    subs = [{p.sub_index for p in layout.pieces_of_group[g.index]} for g in engine.coordinator.groups]
    assert subs[1].isdisjoint(subs[0] | subs[2]), (layout.sub_ranges, subs)
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    infinity.release(model)
