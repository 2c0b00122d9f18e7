"""The optimizer's flat state store, built at ``infinity.Init``'s exit and built again, frozen groups
apart, when the optimizer is created.

[Note: frozen after Init]
The flat layout keeps frozen groups in sub-groups of their own, which hold masters only ([Note:
dormant sub-groups] in infinity/optim/flat_state.py). ``infinity.Init`` cuts it by what is frozen when
it exits; a training script often freezes a base only after building the model. So the first
``infinity.AdamW`` (or ``Adam``) over a model looks again: when groups frozen now would make
sub-groups dormant that are not, it builds a new store cut by the current flags, moves every master
into it (and the moments, when a checkpoint loaded any: zeros leave a sub-group dormant) and frees
the old one. It is exact: each state is copied as it is stored, and steps then match those of a base
frozen inside ``Init`` bit for bit.

It runs only where it is exact and nothing can be lost or doubled: before any gradient arrived (no
gradient is ever moved), not on a model holding a checkpoint in place (``Init(resume=)``: its keys
lie where the save put them, and a resume in place needs the layout the save had, so a run that
saves in place freezes inside ``Init``), and not over nonzero moments stored compressed
(``state_dtype`` int8 or bf16, loaded before the optimizer: they would be quantized again). The
ranks decide together: when one keeps its layout, all do. The old store is freed only once the new
one holds everything, so for a moment the optimizer tier holds both (the new one is the masters plus
the trained groups' states); a tier too full for that (or a host that cannot pin the new buffers)
keeps the layout, with a warning that says what it would have saved and how to get it (freeze inside
the ``infinity.Init`` block). One pass over the masters: the cost of ``Init``'s exit once more, before
the first step.
"""
from __future__ import annotations

import inspect
import warnings

import torch

from tiers.base import format_nbytes
from tiers.host_alloc import HostAllocatorError
from infinity.optim import tier_split
from infinity.optim.compact_grads import grad_dtype_for
from infinity.optim.flat_layout import FlatLayout
from infinity.optim.flat_state import MOMENTS, OptimizerStateStore
from infinity.optim.moments import MomentFormat
from infinity.optim.split_master import ZERO, CopyAccess, rest_split, use_split_master
from infinity.runtime.ranks import RanksFailedError

_PER_ELEMENT = 12     # what a dormant sub-group does not hold per element: fp32 m, v and gradient (at most)


def frozen_apart(groups, config) -> tuple[FlatLayout, list[int]]:
    """The flat layout with sub-groups broken where the groups change between trainable and frozen (as
    ``requires_grad`` says now), and its dormant sub-groups ([Note: sub-groups apart for frozen groups]
    in infinity/optim/flat_layout.py); broken too where ``config`` splits the optimizer states over tiers
    ([Note: optimizer states over tiers] in infinity/optim/tier_split.py)."""
    training = [g.has_trainable for g in groups]
    numels = [g.shard_numel for g in groups]
    breaks = [i for i in range(1, len(groups)) if training[i] != training[i - 1]]
    breaks += tier_split.breaks(tier_split.cuts_for(config, numels))
    layout = FlatLayout(numels, config.partition.sub_group_size, breaks)
    dormant = [sub for sub, pieces in enumerate(layout.pieces_of_sub)
               if not any(training[p.group_index] for p in pieces)]
    return layout, dormant


def build_store(engine, layout: FlatLayout, dormant) -> OptimizerStateStore:
    """An empty store over ``layout`` in ``engine``'s optimizer tier: master keys only (the states come
    with ``allocate_states``), the masters split where the tiers and dtype ask ([Note: split master] in
    infinity/optim/split_master.py)."""
    coordinator, tiers, config = engine.coordinator, engine.tiers, engine.config
    copies = dormant_copies = None
    cuts = tier_split.cuts_for(config, [g.shard_numel for g in coordinator.groups])
    _warn_empty_shares(config, cuts, coordinator.groups)
    per_sub = tier_split.sub_tiers(layout, cuts, tiers.by_name, config.tiers.optimizer)
    kinds = (coordinator.dtype, tiers.params.kind, tiers.optimizer.kind)
    if per_sub is not None:     # split over tiers: fp32 masters ([Note: optimizer states over tiers])
        pass
    elif use_split_master(*kinds):
        copies = CopyAccess(coordinator.shards, coordinator.groups)
    elif rest_split(*kinds):
        dormant_copies = CopyAccess(coordinator.shards, coordinator.groups)
    fastest = per_sub[0].kind if per_sub else tiers.optimizer.kind    # a device share keeps fp32 gradients
    return OptimizerStateStore(tiers.optimizer, layout, tiers.allocator, defer_states=True,
                               datapath=engine.datapath, copies=copies, sub_tiers=per_sub,
                               grad_dtype=grad_dtype_for(coordinator.dtype, fastest),
                               moment_format=MomentFormat(config.optimizer.state_dtype,
                                                          config.optimizer.state_block_size),
                               dormant=dormant, dormant_copies=dormant_copies)


def _warn_empty_shares(config, cuts, groups) -> None:
    """A share the rounding to group boundaries left without a group is said, not silent."""
    if cuts is None:
        return
    t, d, h = config.tiers, *cuts
    total = sum(g.shard_numel for g in groups)
    for key, share, empty, at in (("optimizer_device_share", t.optimizer_device_share, d == 0, 0),
                                  ("optimizer_host_share", t.optimizer_host_share, h == d, d)):
        if share > 0 and empty:
            where = (f"the group there has {groups[at].shard_numel:,} elements" if at < len(groups)
                     else "the shares before it took every group")
            _warn(f"tiers.{key} = {share:g} holds no parameter group: the states are cut at group boundaries, "
                  f"each cut at the one nearest its share of this rank's {total:,} elements, and both of its cuts "
                  f"fell on the same boundary ({where}); raise it, or leave it 0 "
                  f"(infinity.stats(model)['optimizer_tiers'] says what each tier got)")


class _Reencoded(Exception):
    """Compressed moments that are not all zero: moving them would quantize them a second time."""


def _free(store: OptimizerStateStore) -> None:
    """Free every key ``store`` holds in its tier (after its writes, even failed ones); it is unusable
    from here on."""
    try:
        store.flush()
    finally:
        _free_keys(store)


def _free_keys(store: OptimizerStateStore) -> None:
    for keys in store.keys.values():
        for sub, key in enumerate(keys):
            if key is not None and key != ZERO:
                store.sub_tiers[sub].free(key)
            keys[sub] = None
    if store.resting is not None:
        for sub, key in enumerate(store.resting.keys):
            if key is not None:
                store.resting.free(sub)


def _warn(message: str) -> None:
    level, frame = 2, inspect.currentframe().f_back
    while frame is not None and frame.f_globals.get("__name__", "").startswith("infinity.") and not \
            frame.f_globals["__name__"].startswith("infinity.examples."):
        level, frame = level + 1, frame.f_back     # the warning names the user's line, not the engine's
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def _kept(who: str, why: str, gain: int, tier: str) -> None:
    _warn(f"{who}: kept the optimizer's flat layout of infinity.Init's exit, whose sub-groups mix trainable "
          f"groups with groups frozen since: moving them apart would save up to "
          f"{format_nbytes(gain * _PER_ELEMENT)} of the {tier} tier, but {why}. Freeze those parameters "
          "inside the infinity.Init block to have it from the start.")


def warn_frozen_in_part(engine, who: str) -> None:
    """Say what frozen parameters beside trainable ones of their group (``requires_grad`` changed after
    ``infinity.Init``) cost: a group trains whole ([Note: frozen inside a group] in
    infinity/runtime/construction.py)."""
    numel, first = 0, None
    for g in engine.coordinator.groups:
        frozen = sum(s.numel for s in g.slots if not s.param.requires_grad) if g.has_trainable else 0
        if frozen:
            numel, first = numel + frozen, first or g.name
    if numel:
        per_rank = -(-numel // engine.ranks.world_size)
        _warn(f"{who}: {numel:,} frozen parameters share parameter groups with trainable ones ({first!r} "
              f"first; requires_grad changed after infinity.Init): a group trains whole, so they keep their Adam "
              f"moments and gradient (up to {format_nbytes(per_rank * _PER_ELEMENT)} of the "
              f"{tier_split.named(engine.store)} tier per rank) and move with it at every step. Set requires_grad as "
              "training has it inside the infinity.Init block: its exit puts frozen parameters in groups of "
              "their own, which hold their masters only.")


def relayout_frozen(engine, who: str) -> bool:
    """Build ``engine``'s store again with the groups frozen now apart, when that makes more of it
    dormant ([Note: frozen after Init]). Returns whether it did."""
    old = engine.store
    groups = engine.coordinator.groups
    # Frozen elements in sub-groups that have held states since the store was built (not those a load
    # woke: their moments are nonzero, and would wake them again): apart, their sub-groups are dormant.
    # Both are this rank's alone (``woken`` comes from its shard's values), and the ranks keep one layout:
    # they decide together, every rank calling each all-reduce below once, whatever it found.
    gain = sum(p.numel for sub, pieces in enumerate(old.layout.pieces_of_sub)
               if sub not in old.dormant and sub not in old.woken
               for p in pieces if not groups[p.group_index].has_trainable)
    why = ("gradients arrived before it was created (they are never moved)" if old.has_grad else
           "the model holds a checkpoint in place (its keys lie where the save put them)" if engine.damaged
           else None)
    any_gain, any_why = _any_rank(engine, gain > 0, why is not None)
    if not any_gain:
        return False
    if any_why:
        if gain:
            _kept(who, why or _ANOTHER_RANK, gain, tier_split.named(old))
        return False
    layout, dormant = frozen_apart(groups, engine.config)
    new, kept, failed = None, None, None
    try:
        new = build_store(engine, layout, dormant)     # its master keys: all of them or none
        for g in groups:
            new.write_master_shard(g.index, old.read_state_shard("master", g.index))
        new.allocate_states()
        if old.moments_initialized:     # on the host tier always; on NVMe once a load or a step wrote them
            for state in MOMENTS:
                for g in groups:
                    values = old.read_state_shard(state, g.index)
                    if old.moment_format.compressed and values.any():
                        raise _Reencoded
                    new.write_state_shard(state, g.index, values)
    except _Reencoded:
        kept = (f"its moments, loaded before it, are stored as {old.moment_format.dtype} and would be encoded "
                "again (not exact)")
    except (MemoryError, HostAllocatorError, torch.OutOfMemoryError) as exc:     # a full tier (the device's too,
        # with a device share), or unpinnable memory: the old store is whole
        kept = f"it needs both layouts in the tier for a moment ({exc})"
    except BaseException as exc:    # raised below, once the other ranks know: every rank raises
        failed = exc
    any_kept, any_failed = _any_rank(engine, kept is not None, failed is not None)
    if (any_kept or any_failed) and kept is None:
        kept = _ANOTHER_RANK
    if kept is not None:
        if new is not None:
            _free(new)
        if failed is not None:
            raise failed
        if any_failed:
            raise RanksFailedError(f"rank {engine.ranks.rank}: another rank failed while {who} moved the groups "
                                   "frozen after infinity.Init apart (see the error raised there); this rank "
                                   "keeps its layout and stops too")
        if gain:
            _kept(who, kept, gain, tier_split.named(old))
        return False
    _free(old)
    engine.store = new
    engine.reducer.attach(new)
    return True


_ANOTHER_RANK = "another rank keeps it (the ranks keep one layout: a checkpoint in place needs that)"


def _any_rank(engine, *mine: bool) -> tuple[bool, ...]:
    """Whether each of ``mine`` holds on any rank (one collective: every rank calls it)."""
    if engine.ranks.world_size == 1:
        return mine
    flags = torch.tensor([1.0 if m else 0.0 for m in mine], device=engine.device.device)
    engine.ranks.all_reduce_max(flags)
    return tuple(bool(f) for f in flags.tolist())
