"""``infinity.gathered``: the whole parameters of a model, readable and writable, for a while."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from infinity import registry
from infinity.errors import EngineError
from infinity.optim.grad_face import untaken


@contextmanager
def gathered(model: nn.Module, modifier_rank: int | None = None):
    """Gather every parameter of ``model`` (or of a sub-module) for the duration of the block.

    Inside, parameters have their full shapes and values and can be read (export,
    evaluation) or changed in place (custom initialisation), directly or through any
    view: ``p.data``, the tensors of ``model.state_dict()`` (a tiled layer's joined
    weight included), ``load_state_dict``. On exit, groups whose values changed are
    written back to their shards and fp32 master weights; in bf16/fp16 only the
    elements that changed get new masters, the rest keep their fp32 values.
    Outside the block, a released parameter refuses to be read (see [Note: released
    placeholders] in infinity/runtime/placeholder.py).

    Parameters
    ----------
    model:
        A model built inside ``infinity.Init``, or any of its sub-modules.
    modifier_rank:
        When set, that rank's values are broadcast to all ranks on exit; otherwise each
        rank writes back its own slice (every rank should make the same changes).

    Examples
    --------
    >>> with infinity.gathered(model):                       # doctest: +SKIP
    ...     torch.nn.init.zeros_(model.head.bias)
    ...     sd = {k: v.clone() for k, v in model.state_dict().items()}
    """
    engine = registry.engine_of(model, "infinity.gathered")
    if engine.optimizer is not None:
        engine.optimizer.synchronize()
    coordinator = engine.coordinator
    groups = _groups_of(engine.coordinator, model)
    coordinator.use(groups)
    snapshots = {g: g.shard_of(g.full).clone() for g in groups}
    trace = engine.prefetcher.trace if engine.prefetcher is not None else None
    recorded = trace.recorded() if trace is not None else None
    unmanaged = _unmanaged(coordinator, model)      # held before the block: not this block's doing
    completed = False
    try:
        yield model
        completed = True
    finally:
        reshaped = []
        with torch.no_grad():
            for g in groups:
                for slot in g.slots:    # a shape or dtype the group cannot hold: that parameter keeps its values
                    if slot.param.shape != slot.shape or slot.param.dtype != g.dtype:
                        shape, dtype = slot.param.shape, slot.param.dtype
                        change = [f"{tuple(slot.shape)} -> {tuple(shape)}"] * (shape != slot.shape)
                        change += [f"{g.dtype} -> {dtype}"] * (dtype != g.dtype)
                        reshaped.append((slot.param, ", ".join(change)))
                        slot.param.data = g.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                current = g.flatten()
                if modifier_rank is not None:
                    engine.ranks.broadcast(current, src=modifier_rank)
                if not torch.equal(g.shard_of(current), snapshots[g]):
                    engine.write_param_shard(g, current, snapshots[g])
                coordinator.unuse(g)
        if trace is not None:
            trace.discard_recording(recorded)
        engine.grad_face.stray += _stray_grads(model, groups)
        if completed:
            _refuse_new_shapes(coordinator, model, reshaped, unmanaged)


def _stray_grads(model: nn.Module, groups) -> list:
    """``(param, name)`` of the parameters whose ``.grad`` the engine did not take: set by hand inside the
    block, or left by a backward there through a module that does not own them (only a forward outside
    ``gathered`` sees that: [Note: foreign parameters] in infinity/runtime/foreign.py). Autograd keeps them as
    without the engine; ``opt.step()`` refuses them rather than skip them (``GradFace.before_step``)."""
    managed = {id(s.param) for g in groups for s in g.slots}
    return [(p, name) for name, p in model.named_parameters() if id(p) in managed and untaken(p)]


def _unmanaged(coordinator, model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters() if p not in coordinator.group_of}


def _refuse_new_shapes(coordinator, model: nn.Module, reshaped: list, before: set[int]) -> None:
    """Shapes or dtypes changed (``resize_token_embeddings``, ``model.half()``) or parameters replaced inside the
    block: refused, naming them.
    ``before``: the parameters not managed by infinity that the model held when the block began."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    unmanaged = [name for name, p in model.named_parameters()
                 if p not in coordinator.group_of and id(p) not in before]
    if reshaped:
        which = "; ".join(f"{names.get(id(p), '?')!r} {change}" for p, change in reshaped[:3])
        raise EngineError(
            f"infinity.gathered: parameters changed shape or dtype inside the block ({which}); an "
            "engine model's parameters keep the shapes they were built with and the compute dtype of its "
            "config ([precision] dtype), so these kept their values (the other writes were stored; what else "
            "the code changed, a config's vocab_size, say, stays changed). Give new shapes inside the "
            "infinity.Init block that builds or loads the model (resize_token_embeddings there); to export in another dtype, convert copies (save_pretrained(d, "
            "state_dict={k: v.to(dtype) for k, v in model.state_dict().items()}))")
    if unmanaged:
        raise EngineError(
            f"infinity.gathered: the model holds parameters infinity does not manage after the block "
            f"({unmanaged[:3]}; a module replaced): they would never be offloaded, sharded or updated. Build "
            "or replace modules inside the infinity.Init block that builds the model")


def _groups_of(coordinator, model) -> list:
    """The groups of ``model``'s modules (each once, in module order)."""
    seen = []
    for m in model.modules():
        for g in coordinator.module_groups.get(m, ()):
            if g not in seen:
                seen.append(g)
    return seen
