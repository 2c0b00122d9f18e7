"""Which parameter groups keep their optimizer states in which tier, when the states are split over tiers.

[Note: optimizer states over tiers]
``tiers.optimizer_device_share`` and ``tiers.optimizer_host_share`` keep fractions of each rank's optimizer
states (masters, Adam's m and v, the gradient accumulator) on the compute device and in host memory, the
rest in ``tiers.optimizer``: what ``auto`` placement predicts fastest when the whole does not fit the
fastest tier ([Note: auto placement] in infinity/plan/placement.py). The cuts fall between parameter
groups, in model order, fastest tier first: the first groups are the ones the next forward needs first and
backward reaches last, so their update (on the device: the same AdamW, exact, inside ``opt.step()`` on the
compute stream) is done before the forward starts, while the host or NVMe share's update runs beside the
forward as before (``dpu.overlap``), its groups needed last. Each share is rounded to the nearest group
boundary; the flat layout starts a sub-group at each cut, so every sub-group and every group is in one tier.
The cuts come from the shard lengths alone, which every rank has alike, so all ranks cut alike.

Each sub-group's tier decides how it is stepped (``UpdatePass`` runs one lane per kind: device, or host
for host memory and NVMe) and how its gradient arrives. Checkpoint files do not record tiers: a split run
loads a uniform run's checkpoint and the other way round. A split store keeps fp32 masters and fp32
gradients when a share is on the device; the delayed update and checkpoints in place take one tier and are
refused with a split. The update during backward steps the host and NVMe shares' sub-groups as their gradients
complete, and leaves the device share to ``opt.step()`` ([Note: update during backward] in
infinity/optim/in_backward.py).

What the room may touch: shard lengths and the config's shares; the tiers only by kind.
"""
from __future__ import annotations

from typing import Sequence

from infinity.errors import EngineError

KINDS = ("device", "host", "nvme")


def cut_groups(shard_numels: Sequence[int], device_share: float, host_share: float) -> tuple[int, int]:
    """``(d, h)``: groups ``[0, d)`` keep their states on the device, ``[d, h)`` in host memory, the rest in
    ``tiers.optimizer``; each cut the group boundary nearest its share of the elements."""
    starts, total = [], 0
    for n in shard_numels:
        starts.append(total)
        total += n
    starts.append(total)

    def nearest(fraction: float) -> int:
        if fraction <= 0:
            return 0
        target = fraction * total
        return min(range(len(starts)), key=lambda g: (abs(starts[g] - target), g))

    d = nearest(device_share)
    return d, max(d, nearest(device_share + host_share))


def cuts_for(config, shard_numels: Sequence[int]) -> tuple[int, int] | None:
    """The cuts ``config`` asks for (``cut_groups``), or None when the states are in one tier."""
    t = config.tiers
    if not (t.optimizer_device_share or t.optimizer_host_share):
        return None
    return cut_groups(shard_numels, t.optimizer_device_share, t.optimizer_host_share)


def breaks(cuts: tuple[int, int] | None) -> list[int]:
    """The groups that start a sub-group at the cuts."""
    return [] if cuts is None else sorted(set(cuts))


def group_kind(cuts: tuple[int, int], base: str, group_index: int) -> str:
    d, h = cuts
    return "device" if group_index < d else "host" if group_index < h else base


def sub_tiers(layout, cuts: tuple[int, int] | None, by_name: dict, base: str) -> list | None:
    """Each sub-group's tier (``by_name``: kind -> tier), or None when the states are in one tier. Every
    sub-group's groups are on one side of each cut (``breaks``)."""
    if cuts is None:
        return None
    kinds = [group_kind(cuts, base, pieces[0].group_index) for pieces in layout.pieces_of_sub]
    for sub, pieces in enumerate(layout.pieces_of_sub):
        if any(group_kind(cuts, base, p.group_index) != kinds[sub] for p in pieces):
            raise EngineError(f"sub-group {sub} straddles a tier cut (internal error: the layout has no break there)")
    return [by_name[k] for k in kinds]


def group_tier(store, group_index: int):
    """The tier of one group's states in ``store`` (a split store cuts at group boundaries: one tier per group)."""
    return store.sub_tiers[store.layout.pieces_of_group[group_index][0].sub_index]


def named(store) -> str:
    """The kinds of the tiers ``store``'s states are in, for messages: "host", "device and host"."""
    return " and ".join(t.kind for t in store.tiers)


def shares(store) -> dict[str, dict]:
    """Per tier kind holding optimizer states: this rank's ``elements`` of the flat space there, their
    ``fraction``, and the parameter ``groups`` (``infinity.stats(model)["optimizer_tiers"]``: what each tier
    got once the shares were rounded to group boundaries)."""
    total = max(1, store.layout.total_numel)
    out: dict[str, dict] = {}
    for gi, pieces in enumerate(store.layout.pieces_of_group):
        if not pieces:
            continue
        kind = store.sub_tiers[pieces[0].sub_index].kind
        entry = out.setdefault(kind, {"elements": 0, "fraction": 0.0, "groups": 0})
        entry["elements"] += store.layout.shard_numels[gi]
        entry["groups"] += 1
    for entry in out.values():
        entry["fraction"] = entry["elements"] / total
    return out
