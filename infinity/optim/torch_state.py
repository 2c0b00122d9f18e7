"""A ``torch.optim.Adam`` / ``AdamW`` state dict loaded into an infinity optimizer.

[Note: torch.optim state dicts]
A run that trained with plain PyTorch and goes on under infinity (the model outgrew the GPU) has
``torch.save(opt.state_dict())``: per parameter index its ``step`` and whole ``exp_avg`` and
``exp_avg_sq``, and the param groups with their hyper-parameters. ``opt.load_state_dict`` of such a
dict does what torch's does, on the sharded states: parameters map to indices in the order of this
optimizer's param groups (as in torch, the groups must match in number and size); each group's
moments are cut into this rank's shard and written to the optimizer tier (zeros leave a dormant
sub-group dormant: [Note: dormant sub-groups] in infinity/optim/flat_state.py); a parameter the dict
has no state for starts afresh (zero moments, step 0); each parameter's step becomes its Adam step
(the largest is ``step_count``, the others lag: [Note: parameters without a gradient] in
infinity/optim/ranges.py); the hyper-parameters are the dict's (checked as the constructor checks
them). The master weights are the model's, not the optimizer's, in a torch state dict: load them
into the model (inside ``infinity.gathered``). Everything is checked before anything is written: a
parameter whose moments have another shape, an index no parameter has, ``amsgrad`` or ``maximize``
(which the host Adam lacks), the weight decay of the other class (AdamW's into ``infinity.Adam``) or
a hyper-parameter out of range is refused, naming it, and the sub-groups the moments wake are given
their keys at once, so a tier too full for them loses nothing either (the shards wait in host memory
meanwhile: this rank's 8 bytes per parameter).
"""
from __future__ import annotations

import torch

from infinity.errors import EngineError, add_note
from infinity.optim.flat_state import MOMENTS
from infinity.optim.param_groups import check_hyper

# torch's implementation switches, not hyper-parameters: not copied into this optimizer's groups.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


def is_torch_state(state_dict) -> bool:
    """Whether ``state_dict`` is a ``torch.optim`` optimizer's (not an infinity optimizer's)."""
    return isinstance(state_dict, dict) and "shards" not in state_dict and {"state", "param_groups"} <= set(state_dict)


def load(who: str, decoupled: bool, engine, store, param_groups: list[dict], names: dict[int, str],
         state_dict: dict) -> tuple[int, dict[str, int]]:
    """Write the moments of ``state_dict`` (see [Note: torch.optim state dicts]) and set the hyper-parameters
    of ``param_groups``; returns the step count and each parameter's Adam step, by name."""
    what = f"{who}.load_state_dict (a torch.optim state dict)"
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    by_index = _params_by_index(what, saved_groups, param_groups)
    for i, group in enumerate(saved_groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise EngineError(f"{what}: param group {i} has {key}=True, which infinity's host Adam does not "
                                  "implement; nothing was loaded")
        if group.get("weight_decay") and group.get("decoupled_weight_decay", decoupled) != decoupled:
            other = "AdamW (decoupled" if not decoupled else "Adam (L2"
            raise EngineError(f"{what}: param group {i} is torch.optim.{other} weight decay) and this is {who}; "
                              f"use infinity.{'AdamW' if not decoupled else 'Adam'}; nothing was loaded")
    values: dict[int, dict] = {}
    for index, entry in state.items():
        param = by_index.get(int(index))
        if param is None:
            raise EngineError(f"{what}: state for parameter index {index}, which no param group lists; "
                              "nothing was loaded")
        name = names.get(id(param), f"index {index}")
        if "max_exp_avg_sq" in entry:
            raise EngineError(f"{what}: {name} has max_exp_avg_sq (amsgrad), which infinity's host Adam does not "
                              "implement; nothing was loaded")
        for key in (*MOMENTS, "step"):
            if key not in entry:
                raise EngineError(f"{what}: {name} has no {key!r} (not an Adam state); nothing was loaded")
        for key in MOMENTS:
            if tuple(entry[key].shape) != tuple(param.shape):
                raise EngineError(f"{what}: {name}'s {key} has shape {tuple(entry[key].shape)}, the parameter "
                                  f"{tuple(param.shape)}; nothing was loaded")
        values[id(param)] = entry
    merged = []
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        merged.append(dict(group, **{k: v for k, v in saved.items() if k != "params" and k not in _IMPLEMENTATION}))
        merged[-1]["betas"] = tuple(merged[-1]["betas"])
        try:
            check_hyper(merged[-1], what, i)
        except ValueError as exc:
            raise EngineError(f"{exc}; nothing was loaded") from None
    steps = {id(p): int(values[id(p)]["step"]) if id(p) in values else 0 for p in by_index.values()}
    shards = _moment_shards(engine, store, set(steps), values)
    # Sub-groups to wake, all at once (all or none): a tier too full for them keeps nothing loaded.
    try:
        store.wake({p.sub_index for (key, gi), shard in shards.items() for p in store.layout.pieces_of_group[gi]
                    if shard[p.group_offset:p.group_offset + p.numel].any()})
    except BaseException as exc:
        add_note(exc, f"{what}: nothing was loaded")
        raise
    for (key, gi), shard in shards.items():
        store.write_state_shard(key, gi, shard)
    for group, new in zip(param_groups, merged):
        group.update(new)
    step_count = max(steps.values(), default=0)
    return step_count, {names[pid]: step for pid, step in steps.items()}


def _params_by_index(what: str, saved_groups: list[dict], param_groups: list[dict]) -> dict[int, torch.Tensor]:
    """Each index of the saved groups' ``params`` to this optimizer's parameter, as torch maps them."""
    if len(saved_groups) != len(param_groups):
        raise EngineError(f"{what}: the state has {len(saved_groups)} param groups, this optimizer "
                          f"{len(param_groups)}; nothing was loaded")
    out = {}
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise EngineError(f"{what}: param group {i} has {len(group['params'])} parameters here, "
                              f"{len(saved['params'])} in the state; nothing was loaded")
        out.update(zip((int(j) for j in saved["params"]), group["params"]))
    return out


def _moment_shards(engine, store, chosen: set[int], values: dict[int, dict]) -> dict[tuple[str, int], torch.Tensor]:
    """Each group's shard of m and v, by (state, group index): the saved values of its parameters in
    ``chosen`` (zeros for one without state), the stored values of the others (not in this optimizer)."""
    out = {}
    # On NVMe before the first update the moment keys hold nothing: every group is written, from zeros
    # (the update reads them all once the store says they hold data).
    fresh = not store.moments_initialized
    for group in engine.coordinator.groups:
        slots = [s for s in group.slots if id(s.param) in chosen]
        if not slots and not fresh:
            continue
        start = group.rank * group.shard_numel
        for key in MOMENTS:
            shard = (torch.zeros(group.shard_numel) if fresh else store.read_state_shard(key, group.index))
            for slot in slots:
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, start + group.shard_numel)
                if lo >= hi:
                    continue
                saved = values.get(id(slot.param))
                part = shard[lo - start:hi - start]
                if saved is None:
                    part.zero_()
                else:
                    part.copy_(saved[key].detach().reshape(-1)[lo - slot.offset:hi - slot.offset])
            out[key, group.index] = shard
    return out
