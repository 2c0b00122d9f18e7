"""``infinity.gathered``: the whole parameters of a model, readable and writable, for a while; and
``infinity.state_dict``: the model's state dict in host memory, gathered a module at a time.

[Note: a state dict a module at a time]
``with infinity.gathered(model): model.state_dict()`` holds every parameter on the compute device at once:
a model trained because it does not fit there cannot be saved that way (``save_pretrained`` of a 13B model
on a 24 GiB GPU). ``state_dict`` walks the module tree instead and gathers the largest subtrees whose groups
together hold no more elements than the model's largest group (the most a forward already gathers at once),
taking each one's ``state_dict()`` (so a module's own state-dict code, a tiled layer's joined weights, runs
as usual) and copying it to host memory before the next is gathered. A subtree's groups are those that hold
its parameters, not those its modules gather: the modules inside a unit gather nothing (the unit does), and
a unit frozen in part (LoRA's base weights, a layer frozen in every block) holds two groups, together more
than the largest, so its children are walked, each reading one of the unit's groups; a group the next
subtree reads too stays gathered rather than be gathered again. A module too big for that gives its own
parameters and buffers (``_save_to_state_dict``) and its children are walked; its state-dict hooks, if it
has any, do not run. A parameter under two names (tied weights) is copied once: both keys hold the same host
tensor, which ``save_pretrained`` recognises as tied. Host memory holds the whole state dict (on rank 0 only
with ``rank0_only``); for a model bigger than that, ``infinity.save_pretrained`` writes each subtree's
tensors to their files as it is gathered (infinity/runtime/hf_save.py), and ``infinity-consolidate`` writes
a checkpoint's tensor by tensor.

[Note: tensors that outlive a block]
Tensors made inside ``gathered`` from the parameters share the gathered memory: ``sd = model.state_dict()``,
``w = p.data``, a graph's saved weights. Released at the block's exit, that memory went back to the engine and
theirs held nothing: reading them crashed the process, and ``torch.save(sd, f)`` after the block wrote empty
storages without an error. So at the exit a group whose memory has users besides the engine's own (its flat
tensor, its cached views, its parameters: the storage's use count says) leaves it to them, with a copy of its
bytes in memory of their own (``GatherMemory.give_away``), and takes new memory at its next gather. They keep
the values the block ended with, where a plain model's views would follow later updates too; one copy of
those groups, only when something kept them (with no memory for the copy, a warning, and they go empty as
before). A tensor taken in a forward hook from a module's parameter outside ``gathered`` still shares memory
released after that module's forward: clone it there; so does a storage object kept alone
(``p.untyped_storage()``), and, with a torch too old to lend memory, a group gathered in place (its stored
shard itself, on one rank and the device tier), whose tensors then follow it.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

from infinity import registry
from infinity.errors import EngineError
from infinity.optim.grad_face import untaken
from infinity.runtime.hooks import engine_work


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
    with engine.ranks.together("infinity.gathered"):   # before the gathers: [Note: failing together]
        engine.tiers.check()    # a swap file cut under the run: said here, on every rank, not between the gathers
        if engine.optimizer is not None:
            engine.optimizer.synchronize()
    coordinator = engine.coordinator
    groups = _groups_of(engine.coordinator, model)
    with engine_work():     # [Note: the engine's work under inference mode] in infinity/runtime/hooks.py
        coordinator.use(groups)
        snapshots = {g: g.shard_of(g.full).clone() for g in groups}
    marks = _recording_marks(engine)
    unmanaged = _unmanaged(coordinator, model)      # held before the block: not this block's doing
    completed = False
    try:
        yield model
        completed = True
    finally:
        reshaped, failed = [], None
        with torch.no_grad(), engine_work():
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
                if failed is None and not torch.equal(g.shard_of(current), snapshots[g]):
                    try:
                        engine.write_param_shard(g, current, snapshots[g])
                    except Exception as exc:    # the rest are broadcast, not written: raised below, on every rank
                        failed = _written_in_part(engine, g, exc)
                try:
                    g.part_with_escaped()
                except (MemoryError, torch.OutOfMemoryError) as exc:     # no room for their copy: they go empty
                    warnings.warn(f"infinity.gathered: no memory to keep the tensors taken inside the block from "
                                  f"group {g.name!r} ({exc}); they are empty after it: clone what must outlive it",
                                  RuntimeWarning, stacklevel=3)
                coordinator.unuse(g)
        _discard_recordings(marks)
        engine.grad_face.stray += _stray_grads(model, groups)
        _write_back_agreed(engine, failed)
        if completed:
            _refuse_new_shapes(coordinator, model, reshaped, unmanaged)


def _written_in_part(engine, group, exc: Exception) -> Exception:
    """A write-back failed at ``group`` (tier I/O): the groups before it hold the block's values, the rest do not,
    and this one may hold them in part: the states are damaged."""
    engine.damaged = (f"infinity.gathered could not write the block's values back (group {group.name!r}: {exc!r}): "
                      "the parameters and master weights hold them in part; load a checkpoint")
    return exc


def _write_back_agreed(engine, failed: Exception | None) -> None:
    """Every rank raises when the write-back failed on one ([Note: failing together] in infinity/runtime/ranks.py;
    with ``modifier_rank`` after the broadcasts every rank issued): one rank's states are damaged now, so the next
    forward agrees first, where that rank's refusal reaches the others."""
    try:
        with engine.ranks.together("infinity.gathered's write-back"):
            if failed is not None:
                raise failed
    except BaseException:
        engine.agree_at_forward = True
        raise


def _recording_marks(engine) -> list:
    """Where each trace's recording stands (the training steps' and the inference passes'), before a block."""
    return [(t, t.recorded()) for t in engine.prefetcher.traces] if engine.prefetcher is not None else []


def _discard_recordings(marks: list) -> None:
    """A recording that took requests inside the block is not adopted (``Trace.discard_recording``)."""
    for trace, recorded in marks:
        trace.discard_recording(recorded)


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
            "infinity.Init block that builds or loads the model (resize_token_embeddings there); to export in "
            "another dtype, convert copies (save_pretrained(d, state_dict=infinity.state_dict(model, "
            "dtype=dtype)))")
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


def state_dict(model: nn.Module, *, rank0_only: bool = False, dtype: torch.dtype | None = None,
               keep: bool | None = None) -> dict:
    """``model.state_dict()``, every tensor a copy in host memory, gathered a module at a time (see [Note: a
    state dict a module at a time]): the compute device never holds more than the model's largest group.

    Every rank calls it (the gathers are collectives), as ``infinity.gathered``.

    Parameters
    ----------
    model:
        A model built inside ``infinity.Init``, or any of its sub-modules (keys relative to it).
    rank0_only:
        Only rank 0 keeps the copies; the others return an empty dict (host memory for one copy, not N).
    dtype:
        Floating-point tensors converted to it (the model's compute dtype otherwise).
    keep:
        Whether this rank keeps the copies, in place of ``rank0_only``'s choice (every rank still gathers):
        the ranks that write, such as the first of each node with the Trainer's ``save_on_each_node``.

    Examples
    --------
    >>> model.save_pretrained("out", state_dict=infinity.state_dict(model))    # doctest: +SKIP
    """
    engine = registry.engine_of(model, "infinity.state_dict")
    if keep is None:
        keep = not rank0_only or engine.ranks.rank == 0
    owner_of = {prefix + name: p for prefix, module in _prefixed(model)
                for name, p in module.named_parameters(recurse=False)}
    copies: dict[int, torch.Tensor] = {}    # a parameter's host copy, by the parameter (tied weights: one)
    out: dict[str, torch.Tensor] = {}
    for part in state_dict_parts(engine, model):
        for key, value in part.items():
            if not keep:
                continue
            param = owner_of.get(key)
            copy = copies.get(id(param)) if param is not None else None
            if copy is None:
                wanted = dtype if dtype is not None and value.is_floating_point() else value.dtype
                copy = value.detach().to("cpu", dtype=wanted, copy=True)
                if param is not None:
                    copies[id(param)] = copy
            out[key] = copy
    return out


def state_dict_parts(engine, model: nn.Module, skip=None):
    """Yield ``model``'s state dict a subtree at a time (see [Note: a state dict a module at a time]), each
    part's values gathered only until the next part is asked for; every rank iterates to the end.

    ``skip(prefix)``: a subtree (its keys begin with ``prefix``) whose values are not wanted, not gathered."""
    if engine.optimizer is not None:
        with engine.ranks.together("a state dict of the model"):     # [Note: failing together]
            engine.optimizer.synchronize()
    coordinator = engine.coordinator
    bound = max((g.numel for g in coordinator.groups), default=0)

    held = _Held(coordinator)

    def walk(module: nn.Module, prefix: str):
        if skip is not None and skip(prefix):
            return
        groups = _groups_holding(coordinator, module)
        if sum(g.numel for g in groups) <= bound or type(module).state_dict is not nn.Module.state_dict:
            held.only(groups)
            yield module.state_dict(prefix=prefix)
            return
        held.only(list(dict.fromkeys(coordinator.group_of[p] for p in module.parameters(recurse=False)
                                     if p in coordinator.group_of)))
        part: dict = {}
        module._save_to_state_dict(part, prefix, False)
        yield part
        # Every child under each of its names, as state_dict() walks them (named_children() gives each once).
        for name, child in module.named_modules(remove_duplicate=False):
            if name and "." not in name:
                yield from walk(child, prefix + name + ".")

    marks = _recording_marks(engine)
    try:
        yield from walk(model, "")
    finally:
        held.only([])
        _discard_recordings(marks)


class _Held:
    """The groups the walk holds gathered for reading (nothing written back): those of the part it gives now.

    A group the next part reads too stays gathered (the children of a unit frozen in part read its two
    groups by turns, each several times); the others are released before the next part's are gathered, so
    no more than one part's groups are ever gathered at once."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.groups: list = []

    def only(self, groups: list) -> None:
        with engine_work():     # [Note: the engine's work under inference mode] in infinity/runtime/hooks.py
            for g in self.groups:
                if g not in groups:
                    self.coordinator.unuse(g)
            self.coordinator.use([g for g in groups if g not in self.groups])
        self.groups = list(groups)


def _groups_holding(coordinator, module: nn.Module) -> list:
    """The groups that hold ``module``'s parameters (each once, in parameter order): what reading them takes.

    Not the groups its modules gather (``_groups_of``): a unit gathers the groups of every module under it
    ([Note: units] in infinity/runtime/construction.py), so a module inside a unit gathers none, and a unit
    frozen in part holds two groups together larger than the largest one ([Note: frozen inside a group]).
    The walk then descends into the unit's children, each of which reads a group of the unit's."""
    group_of = coordinator.group_of
    return list(dict.fromkeys(group_of[p] for p in module.parameters() if p in group_of))


def _prefixed(model: nn.Module):
    for name, module in model.named_modules(remove_duplicate=False):
        yield (name + "." if name else ""), module
