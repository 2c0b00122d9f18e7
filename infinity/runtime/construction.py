"""Building a model sharded: each module's parameters flattened, broadcast, sharded and stored.

``Partitioner`` is what ``infinity.Init`` drives while the model is constructed: it
partitions each module as soon as it is built (one group per owning module), gathers
a group back exactly when construction code touches it (``materialize``) and re-shards
it afterwards, and at the context's exit (``finish``) drops orphaned groups (weight
tying), indexes the modules, checks the budget and moves the initial master weights
into the optimizer's flat state store, which the engine takes over from there.

Until ``finish`` the fp32 master shard of each group waits under a temporary key of
the optimizer tier ([Note: allocation order] in infinity/optim/flat_state.py says why
the moments are allocated only after those keys are freed).

[Note: groups whose values come later]
A loader that will overwrite every parameter (``from_pretrained`` of a checkpoint that
covers them all) builds the model inside ``deferring()``: its groups are partitioned
without values (nothing copied, broadcast or written; the parameter key is allocated
unwritten, no temporary master key), and the loader then gives each a *source*
(``fill_from``), a function that writes this rank's fp32 shard into a buffer. ``finish``
calls it once per group and writes the result straight to the compute copy and the
optimizer store's master: each shard is written once instead of three times (initial
values, loaded values, moved to the store) and never read back. Whatever reads a group
before that (construction code touching a parameter, tiling, weight tying) gets the
source's values; a group touched before it has a source reads zeros (its values are
undefined until the loader writes them, as transformers' own ``no_init_weights`` build
leaves them), and from then on it is an ordinary group with a temporary master key.

[Note: units]
With ``partition.units`` a module whose class matches is partitioned as one group of every
parameter under it, and it alone gathers and releases that group: its children get no group
of their own (``close_groups``), so their forward hooks find nothing to do and the engine's
host work per step follows the number of units, not of layers (a GPT block's six modules with
parameters become one group). Its parameters are partitioned when the unit's outermost
``__init__`` returns: the layers built inside it wait for it (``Init._on_built``), whole, as
the unit's own code builds them. A parameter of a unit that a module outside it uses (a tied
weight) is gathered by that module too. ``"auto"`` takes the class names the model lists in
``_no_split_modules`` (the Hugging Face convention for "keep this module on one device").

[Note: frozen inside a group]
A module's (or unit's) frozen parameters form a group apart from its trainable ones, so that the
frozen group holds its master only ([Note: dormant sub-groups] in infinity/optim/flat_state.py).
Split as the module is partitioned, this saw only what its own ``__init__`` froze; fine-tuning code
freezes after building (BitFit: every weight, the biases trained; a block's base weights beside
adapters it holds), which left one group per module (per block, under the presets' units) that
trains whole: the frozen weights' moments and gradient held, streamed and rewritten at every step.
So the context's exit splits each group whose parameters differ in ``requires_grad`` as they are
then: its values gathered, the group freed, two groups partitioned in its place (the trainable one
first), each gathered with the module (or unit) as the one was. Exact: the values move as fp32.
A unit whose parameters are frozen in part now costs two gathers instead of one. What is frozen
after the context keeps its group (groups are fixed from then on); the optimizer says what that costs.

What the room may touch: the coordinator (partition, groups), the tiers, the ranks'
broadcast and all-gather, and the plan's arithmetic for the budget check.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from infinity.errors import EngineError
from infinity.optim.flat_state import OptimizerStateStore
from infinity.optim.relayout import build_store, frozen_apart
from infinity.param_group import ParamGroup, ParamState
from infinity.plan.census import is_unit, unit_patterns
from infinity.tiling.widened import widened_numel
from tiers.arena import Arena
from tiers.host_alloc import trim_c_heap

# Plan rows (infinity/plan/layout.py) that ``Partitioner.finish`` has yet to allocate.
_NOT_YET_ALLOCATED = frozenset({"adam_moments", "grad_accumulator", "optimizer_subgroup_buffers", "optimizer_scratch",
                                "nvme_staging", "prefetch_arena", "grad_staging", "compute_copy_staging",
                                "activations", "activation_staging", "activation_prefetch", "widened_linear"})


def _move_buffers(owner: nn.Module, device) -> None:
    """``owner``'s own buffers onto a CUDA compute device (``ComputeDevice``); they are not partitioned."""
    if device.is_cuda:
        for name, buf in owner.named_buffers(recurse=False):
            setattr(owner, name, buf.to(device.device))


class Units:
    """Which modules are partitioned whole: ``partition.units`` (see [Note: units])."""

    def __init__(self, units: Sequence[str]) -> None:
        self.units = tuple(units)

    def is_unit(self, module: nn.Module, building: Sequence[nn.Module] = ()) -> bool:
        """Whether ``module`` is a unit; ``building``: the modules being built around it, outermost
        first (the outermost one's ``_no_split_modules`` serves ``"auto"``)."""
        return bool(self.units) and is_unit(module, unit_patterns(self.units, building[0] if building else module))

    def within(self, building: Sequence[nn.Module]) -> bool:
        """Whether one of the modules being built (around the one just built) is a unit."""
        return bool(self.units) and any(self.is_unit(m, building) for m in building)


def _check_max_live(coordinator, partition) -> None:
    """``partition.max_live_parameters`` must hold what stays gathered (persistent groups) and the
    largest group beside it ([Note: live parameters] in infinity/runtime/coordinator.py)."""
    groups, max_live = coordinator.groups, partition.max_live_parameters
    if not max_live or not groups or coordinator.in_place:
        return
    largest = max((g for g in groups if not g.persistent), key=lambda g: g.numel, default=None)
    kept = sum(g.numel for g in groups if g.persistent)
    need = kept + (largest.numel if largest is not None else 0)
    if need > max_live:
        what = f"group {largest.name!r}'s {largest.numel} elements" if largest is not None else "nothing else"
        raise EngineError(
            f"partition.max_live_parameters = {max_live} is below {need}: the {kept} elements of the groups that "
            "stay gathered ("
            + (f"at partition.stage {partition.stage}, every group" if partition.stage < 3 else
               f"at stage 3, those below partition.persistence_threshold = {partition.persistence_threshold}")
            + f") plus {what}, whole on the "
            f"compute device while its module runs. Set it to at least {need}, or 0 (no bound); or lower the "
            "persistence threshold, or split the module ([partition] units, [tiling])")


def _broadcast(ranks, device: torch.device, flat: torch.Tensor) -> None:
    """Rank 0's ``flat`` (host memory) to every rank, through the compute device (collectives take
    device tensors: see [Note: what a collective may be given] in infinity/runtime/ranks.py)."""
    if ranks.world_size == 1:
        return
    on_device = flat.to(device, copy=True)
    ranks.broadcast(on_device, src=0)
    flat.copy_(on_device)


class Partitioner:
    """Partitions the modules built inside one ``infinity.Init`` into the engine's groups and tiers.

    Parameters
    ----------
    engine:
        The engine being built (its ``config``, ``coordinator``, ``ranks``, ``tiers``, ``device``).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.coordinator = engine.coordinator
        self.ranks = engine.ranks
        self.tiers = engine.tiers
        self._master_keys: dict[ParamGroup, int] = {}
        # Groups without values yet, and their sources (None until a loader gives one): see
        # [Note: groups whose values come later].
        self._sources: dict[ParamGroup, Callable[[torch.Tensor], None] | None] = {}
        self._deferring = False
        # A checkpoint in place the model is built from: every group waits for its values, which are
        # already in the adopted swap files ([Note: checkpoints in place] in infinity/checkpoint/in_place.py).
        self._resume = engine.resume
        # Host memory for the flat values of the module being partitioned, reused module after
        # module: construction allocates nothing per module beyond what the model's own code does
        # (else the C allocator's heap grows with every module built). Freed with the partitioner.
        self._scratch = Arena(engine.tiers.allocator.empty, None, 1 << 20, name="partition-scratch")
        self.units = Units(engine.config.partition.units)
        self.unit_of: dict[ParamGroup, nn.Module] = {}     # a unit's groups -> the unit (see [Note: units])

    # -- while modules are built -----------------------------------------------------------------
    def partition_module(self, module: nn.Module, unit: bool = False) -> None:
        """Shard every parameter under ``module`` not yet managed, one group per owning module, or with
        ``unit`` one group of all of them (see [Note: units])."""
        if unit:
            self._partition_unit(module)
            return
        partitioned = False
        for owner in module.modules():
            fresh = [(n, p) for n, p in owner.named_parameters(recurse=False)
                     if p not in self.coordinator.group_of and p.device.type != "meta"]
            if not fresh:
                continue
            partitioned = True
            for trainable in (True, False):
                chosen = [(n, p) for n, p in fresh if p.requires_grad == trainable]
                if chosen:
                    self._partition(type(owner).__name__, chosen)
            _move_buffers(owner, self.engine.device)
        if partitioned:
            trim_c_heap()   # the module's own tensors just freed (see [Note: the C heap] in tiers/host_alloc.py)

    def _partition_unit(self, unit: nn.Module) -> None:
        fresh = [(n, p) for n, p in unit.named_parameters()
                 if p not in self.coordinator.group_of and p.device.type != "meta"]
        for trainable in (True, False):
            chosen = [(n, p) for n, p in fresh if p.requires_grad == trainable]
            if chosen:
                self.unit_of[self._partition(type(unit).__name__, chosen)] = unit
        for owner in unit.modules():
            _move_buffers(owner, self.engine.device)
        if fresh:
            trim_c_heap()

    def _partition(self, name: str, params: list[tuple[str, nn.Parameter]]) -> ParamGroup:
        group = self.coordinator.new_group(name, params)
        group.trainable = all(p.requires_grad for _, p in params)
        if self._deferring or self._resume is not None:
            self.coordinator.partition(group, None)
            self._sources[group] = None
            return group
        with self._scratch.take(4 * group.padded_numel, f"partition {name}") as loan:
            flat = loan.tensor.view(torch.float32)[:group.padded_numel]
            end = 0
            for slot in group.slots:
                end = slot.offset + slot.numel
                flat[slot.offset:end].copy_(slot.param.detach().reshape(-1))
            flat[end:].zero_()
            _broadcast(self.ranks, self.engine.device.device, flat)    # every rank keeps rank 0's values
            self.coordinator.partition(group, flat)
            shard = group.shard_of(flat)
            key = self.tiers.optimizer.allocate(4 * group.shard_numel, tag=f"master-init:{name}")
            self.engine.datapath.write(self.tiers.optimizer, key, shard).wait()
        self._master_keys[group] = key
        return group

    def materialize(self, group: ParamGroup) -> None:
        """Gather a group's exact fp32 values into its parameters (construction-time edits)."""
        if group.state is ParamState.AVAILABLE:
            return
        shard = torch.empty(group.shard_numel, dtype=torch.float32)
        self._values(group, shard)
        # On the host, where the model's own code built it: an edit that draws random numbers
        # (``nn.init.normal_`` in a parent's ``apply``) then draws from the CPU generator, as it
        # does without Init. Materialized on a GPU it drew from the GPU's generator instead, and
        # the same seed gave other weights than plain torch (seen on an H100).
        if self.ranks.world_size == 1:
            full = shard
        else:
            device = self.engine.device.device      # collectives take device tensors
            gathered = torch.empty(group.padded_numel, dtype=torch.float32, device=device)
            self.ranks.all_gather(gathered, shard.to(device))
            full = gathered.to("cpu")
        group.to_inflight(None)
        group.to_available(full)

    @contextmanager
    def deferring(self):
        """Groups partitioned in this block get their values later, from ``fill_from``
        (see [Note: groups whose values come later])."""
        prev, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = prev

    def is_deferred(self, group: ParamGroup) -> bool:
        """Whether ``group`` has no values of its own yet (built in ``deferring()``, not touched since)."""
        return group in self._sources

    def fill_from(self, group: ParamGroup, fill: Callable[[torch.Tensor], None]) -> None:
        """Give a deferred group its source: ``fill(shard)`` writes this rank's fp32 shard into ``shard``
        (``shard_numel`` long). It is called when something reads the group, and once at ``finish``."""
        if group not in self._sources:
            raise EngineError(f"group {group.name!r} was not built in deferring(), or was touched since: it has "
                              "values of its own; load it with load_shard")
        self._sources[group] = fill

    def _values(self, group: ParamGroup, into: torch.Tensor) -> None:
        """This rank's fp32 shard of ``group`` as it stands, into ``into``."""
        if group not in self._sources:
            self.engine.datapath.read(self.tiers.optimizer, self._master_keys[group], into).wait()
        elif self._sources[group] is None:
            into.zero_()        # touched before the loader gave it a source: see the Note
        else:
            self._sources[group](into)

    def _forget(self, group: ParamGroup) -> None:
        """Drop the group's temporary master key or source (the group is going away or moved to the store)."""
        self._sources.pop(group, None)
        key = self._master_keys.pop(group, None)
        if key is not None:
            self.tiers.optimizer.free(key)

    @contextmanager
    def shard_buffer(self, group: ParamGroup):
        """A scratch fp32 tensor of one shard of ``group`` (a loader fills it), for the block's duration."""
        with self._scratch.take(4 * group.shard_numel, f"shard {group.name}") as loan:
            yield loan.tensor.view(torch.float32)[:group.shard_numel]

    def read_master(self, group: ParamGroup, into: torch.Tensor) -> None:
        """This rank's fp32 master shard of ``group`` as it stands, into ``into``."""
        self._values(group, into)

    def load_shard(self, group: ParamGroup, shard: torch.Tensor) -> None:
        """Replace this rank's shard of ``group`` (compute copy and master) with fp32 ``shard``.

        Each rank gives its own shard of the same values (every rank reads the same
        checkpoint), so nothing is broadcast.
        """
        if group.state is not ParamState.NOT_AVAILABLE:
            raise EngineError(f"loading group {group.name!r}: it is {group.state.name}, expected NOT_AVAILABLE "
                              "(re-shard it first)")
        if group in self._sources:
            raise EngineError(f"loading group {group.name!r}: it was built in deferring(); give it a source "
                              "with fill_from instead")
        self.coordinator.shards.write(group, shard).wait()
        self.engine.datapath.write(self.tiers.optimizer, self._master_keys[group], shard).wait()

    def dematerialize(self, group: ParamGroup) -> None:
        """Re-shard a materialized group from its (possibly edited) values, rank 0's winning."""
        if self._resume is not None:    # its values are the checkpoint's, whatever construction did
            group.to_not_available()
            return
        if any(s.param.shape != s.shape for s in group.slots):
            # A new shape (resize_token_embeddings: the rows of added tokens), which the group's layout and
            # shards cannot hold: partitioned again, in its place (groups are fixed at the context's exit).
            at = self.coordinator.groups.index(group)
            self.coordinator.groups[at:at] = self._replace(group, [group.slots])
            return
        # In fp32, whatever the compute dtype: the master weights keep the values construction gave.
        full = group.flatten([s.param.data for s in group.slots], dtype=torch.float32)
        if self.ranks.world_size > 1:
            full = full.to(self.engine.device.device)       # collectives take device tensors
            self.ranks.broadcast(full, src=0)
        shard = group.shard_of(full).to("cpu").contiguous()
        if self._sources.pop(group, False) is not False:     # values of its own from now on
            self._master_keys[group] = self.tiers.optimizer.allocate(4 * group.shard_numel,
                                                                     tag=f"master-init:{group.name}")
        self.coordinator.shards.write(group, shard).wait()
        self.tiers.optimizer.write(self._master_keys[group], shard).wait()
        group.to_not_available()

    def _replace(self, group: ParamGroup, parts: list[list]) -> list[ParamGroup]:
        """Free ``group`` and partition each of ``parts`` (lists of its slots) as a new group, from the values
        as they are now (fp32, exact); the new groups are out of the coordinator's list, for the caller to place."""
        coordinator = self.coordinator
        if parts:
            self.materialize(group)
        values = [[s.param.data.clone() for s in part] for part in parts]
        for s in group.slots:
            coordinator.group_of.pop(s.param, None)
        coordinator.shards.free(group)
        self._forget(group)
        coordinator.groups.remove(group)
        unit = self.unit_of.pop(group, None)
        made = []
        for part, part_values in zip(parts, values):
            for s, v in zip(part, part_values):
                s.param.data = v
            new = self._partition(group.name, [(s.name, s.param) for s in part])
            if unit is not None:
                self.unit_of[new] = unit
            coordinator.groups.remove(new)
            made.append(new)
        return made

    # -- at the context's exit ---------------------------------------------------------------------
    def finish(self, roots: list[nn.Module]) -> OptimizerStateStore:
        """Close construction after ``close_groups``: check the budget and build the store (each rank's own
        work, no collective: ``infinity.Init`` runs it inside an agreement of the ranks)."""
        config = self.engine.config
        # Stages 1 and 2 keep whole parameters on every rank: each group is gathered once after an
        # update and kept (see [Note: ZeRO stages 1 and 2] in infinity/runtime/grads.py).
        # A group gathered in place is its stored shard: keeping it gathered costs no memory, and
        # releasing it after each use would cost host time per module for nothing ([Note: in-use counts]).
        threshold = config.partition.persistence_threshold
        whole = config.partition.stage < 3 or self.coordinator.in_place
        for g in self.coordinator.groups:
            g.persistent = whole or g.numel < threshold
        _check_max_live(self.coordinator, config.partition)
        self._check_budget(roots)
        # No sub-group mixes trainable and frozen groups, as they are now: a module frozen after it was built
        # (in the Init block) is frozen here ([Note: sub-groups apart for frozen groups] in
        # infinity/optim/flat_layout.py). The frozen ones' sub-groups get moments and gradients when they
        # first need them ([Note: dormant sub-groups] in infinity/optim/flat_state.py); one frozen after
        # the block, when the optimizer is created ([Note: frozen after Init] in infinity/optim/relayout.py).
        layout, dormant = frozen_apart(self.coordinator.groups, config)
        store = build_store(self.engine, layout, dormant)
        if self._resume is None:
            self._move_masters(store)
        else:
            self._sources.clear()
        store.allocate_states()
        if self._resume is not None:
            self._resume.settle(self.engine, store)
        self._scratch = None    # its slabs go back to the system
        return store

    def _move_masters(self, store: OptimizerStateStore) -> None:
        """Each group's master shard into ``store``; a deferred group's compute copy is written beside it,
        from the same buffer (its only write: see [Note: groups whose values come later]).

        (Reading the next deferred group on a thread while this one is written was measured on
        a 1.1B-parameter checkpoint: no faster on two busy cores, where the page-cache copies of
        the reads slowed down beside the writes, and it costs a second shard buffer.)
        """
        for g in self.coordinator.groups:
            if self._sources.get(g, True) is None:
                raise EngineError(f"group {g.name!r} was built in deferring() and no loader gave it values "
                                  "(fill_from) before infinity.Init's exit")
            with self._scratch.take(4 * g.shard_numel, f"master {g.name}") as loan:
                shard = loan.tensor.view(torch.float32)[:g.shard_numel]
                self._values(g, shard)
                # split masters write the compute copy themselves (it is the masters' rounding)
                own_copy = g in self._sources and g.index not in store.copy_writers
                written = self.coordinator.shards.write(g, shard) if own_copy else None
                self._forget(g)
                store.write_master_shard(g.index, shard)
                if written is not None:
                    written.wait()

    def _regroup(self, roots: list[nn.Module]) -> None:
        """Re-shard groups some of whose parameters no module references any more (weight tying), and
        split those holding trainable and frozen parameters together ([Note: frozen inside a group])."""
        coordinator = self.coordinator
        live = {id(p) for r in roots for _, p in r.named_parameters(remove_duplicate=False)}
        kept: list[ParamGroup] = []
        for g in list(coordinator.groups):
            alive = [s for s in g.slots if id(s.param) in live]
            parts = [part for part in ([s for s in alive if s.param.requires_grad],
                                       [s for s in alive if not s.param.requires_grad]) if part]
            if len(alive) == len(g.slots) and len(parts) == 1:
                kept.append(g)
                continue
            kept += self._replace(g, parts)
        for i, g in enumerate(kept):
            g.index = i
        coordinator.groups[:] = kept

    def close_groups(self, roots: list[nn.Module]) -> None:
        """Close the groups: parameters left unpartitioned, regrouping (orphaned parameters, frozen ones), then
        each module's groups. Every rank: the regrouping's broadcasts are collectives."""
        for root in roots:
            self.partition_module(root)
        self._regroup(roots)
        named = {}
        units: dict[nn.Module, list[ParamGroup]] = {}
        for g in self.coordinator.groups:
            if g in self.unit_of:
                units.setdefault(self.unit_of[g], []).append(g)
        inside = {id(m): unit for unit in units for m in unit.modules()}     # gathered by their unit
        for root in roots:
            for qualname, module in root.named_modules(remove_duplicate=False):
                groups = list(units.get(module, ()))
                for g in groups:
                    named.setdefault(g, qualname or type(root).__name__)
                for pname, p in module.named_parameters(recurse=False):
                    g = self.coordinator.group_of.get(p)
                    if g is None:
                        # partition_module shards every other parameter, so only meta ones get here.
                        raise EngineError(
                            f"module {qualname or type(root).__name__!r} has parameter {pname!r} on the "
                            f"{p.device.type} device, which infinity cannot shard; build the model on a real "
                            "device inside infinity.Init, or give the parameter values before the context exits")
                    if g in self.unit_of and inside.get(id(module)) is self.unit_of[g]:
                        continue        # its unit gathers it
                    if g not in groups:
                        groups.append(g)
                    named.setdefault(g, qualname or type(root).__name__)
                self.coordinator.module_groups[module] = groups
        for g, qualname in named.items():
            g.name = qualname

    def _check_budget(self, roots: list[nn.Module]) -> None:
        """Check, with infinity-plan's arithmetic, that what ``finish`` is about to allocate fits.

        The shards already exist; what is left is the optimizer states (Adam m and v,
        the gradient accumulator, the sub-group streaming buffers) and the NVMe staging.
        Those rows of the plan of this very model (its groups as partitioned) go through
        ``tiers.budget.check_budget``, so a model that cannot fit fails here, before the
        bulk of its memory or disk is taken, with the numbers.
        """
        from infinity.plan import CensusGroup, ModelCensus, plan
        from tiers.base import format_nbytes
        from tiers.budget import BudgetError, Need, check_budget

        config = self.engine.config
        numel = {id(s.param): s.numel for g in self.coordinator.groups for s in g.slots}   # not the placeholders'
        census = ModelCensus("model", tuple(
            CensusGroup(g.name, tuple(s.numel for s in g.slots), g.has_trainable)
            for g in self.coordinator.groups),
            widened_numel=widened_numel(roots, lambda w: numel.get(id(w), w.numel())))
        the_plan = plan(census, config, world_size=self.ranks.world_size, local_ranks=1, check_fit=False)
        paths = config.tiers.nvme_path or (None,)
        needs = []
        if self._resume is not None:    # the adopted files hold the states already: only growth beyond them
            beyond = sum(r.nbytes for r in the_plan.rows if r.tier == "nvme") - self._resume.adopted_nbytes()
            needs += [Need("model states beyond the checkpoint's swap files", "nvme", max(0, beyond) // len(paths), p)
                      for p in paths]
        pool = self.engine.tiers.pool
        not_yet = _NOT_YET_ALLOCATED | ({"pool_buffers"} if pool is not None and not pool.allocated else set())
        for row in the_plan.rows:
            if row.key not in not_yet or row.nbytes == 0 or (self._resume is not None and row.tier == "nvme"):
                continue
            if row.tier == "nvme":
                needs += [Need(row.what, "nvme", row.nbytes // len(paths), p) for p in paths]
            elif row.key == "pool_buffers":     # the lazy I/O pool: only the buffers its loans have not made yet
                needs.append(Need(row.what, row.tier, max(0, row.nbytes - pool.made * pool.buffer_nbytes)))
            else:
                needs.append(Need(row.what, row.tier, row.nbytes))
        short = check_budget(needs, host_budget=config.tiers.host_budget,
                             device=self.engine.device.device).shortfalls()
        if short:
            per = the_plan.per_parameter()
            raise BudgetError("the configured tiers do not fit:\n  " + "\n  ".join(short) +
                              f"\n  (model states: {per['stored']:.2f} bytes per parameter element, "
                              f"{per['stored_nvme']:.2f} of them on NVMe)")
        # Gradients kept in the compute dtype move to fp32 keys for good at the first step with several
        # micro-batches ([Note: compact gradients] in infinity/optim/compact_grads.py): twice the bytes.
        compact = [r for r in the_plan.rows if r.key == "grad_accumulator" and "accumulate" in r.what and r.nbytes]
        for row in compact:
            more = ([Need(f"fp32 gradient keys once micro-batches accumulate (+{format_nbytes(row.nbytes)})", "nvme",
                          row.nbytes // len(paths), p) for p in paths] if row.tier == "nvme" else
                    [Need(f"fp32 gradient keys once micro-batches accumulate (+{format_nbytes(row.nbytes)})",
                          row.tier, row.nbytes)])
            later = check_budget([n for n in needs if n.tier == row.tier] + more, host_budget=config.tiers.host_budget,
                                 device=self.engine.device.device).shortfalls()
            if later:
                warnings.warn(
                    "infinity.Init: the tiers fit with one micro-batch per step, but accumulating micro-batches "
                    f"moves the gradient keys ({row.tier}) from {config.precision.dtype} to fp32 at its first step, "
                    "which does not fit:\n  " + "\n  ".join(later) + "\n  Free room for it, or keep one "
                    "micro-batch per step", RuntimeWarning, stacklevel=4)
