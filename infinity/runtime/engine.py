"""The engine of one model: partitioning, the forward/backward lifecycle, and its parts.

``Engine`` ties together the coordinator (parameter availability), the gradient
reducer, the optimizer state store and the tiers, and implements the lifecycle
methods the hooks delegate to. It is created by ``infinity.Init`` and found from
the model through the registry.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from infinity.config import Config
from infinity.errors import EngineError
from infinity.runtime.coordinator import Coordinator
from infinity.runtime.device import ComputeDevice
from infinity.runtime.ranks import Ranks
from infinity.runtime.grads import GradReducer
from infinity.runtime.hooks import install_hooks
from infinity.optim.flat_state import FlatLayout, OptimizerStateStore
from infinity.param_group import ParamGroup, ParamState
from infinity.runtime.tier_set import TierSet


def _return_freed_memory_to_the_os() -> None:
    """[Note: glibc mmap threshold]
    glibc serves large allocations with mmap, but after such a block is freed it
    raises its mmap threshold to that block's size, so later blocks of the same size
    come from the heap, whose free space is rarely given back to the OS. The engine
    allocates and frees module-sized blocks all the time (gathered groups, gradient
    buffers), so without this the resident set creeps up towards the model size.
    Fixing the threshold at 1 MiB turns that dynamic adjustment off: every block of a
    MiB or more is mapped on allocation and unmapped on free.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


_M_MMAP_THRESHOLD = -3


# Plan rows (infinity/plan/layout.py) that Engine.finalize has yet to allocate.
_NOT_YET_ALLOCATED = frozenset({"adam_moments", "grad_accumulator", "optimizer_subgroup_buffers",
                                "nvme_staging", "prefetch_arena"})


class Engine:
    """Everything infinity keeps for one model (or for the models built in one ``Init``).

    Parameters
    ----------
    config:
        The loaded config.
    group:
        A ``torch.distributed`` process group (None: the default group, or one rank).
    """

    def __init__(self, config: Config, group=None) -> None:
        _return_freed_memory_to_the_os()
        self.config = config
        self.ranks = Ranks(group)
        self.device = ComputeDevice(config.tiers.device)
        self.dtype = config.precision.torch_dtype
        self.tiers = TierSet(config, self.device, self.ranks.rank)
        staging = None
        if config.tiers.params == "nvme":
            staging = _LazyStaging(self)
        self.coordinator = Coordinator(self.tiers.params, self.ranks, self.device, self.dtype, staging)
        self.reducer = GradReducer(self.coordinator, self.ranks)
        self.store: OptimizerStateStore | None = None
        self.layout: FlatLayout | None = None
        self.roots: list[nn.Module] = []
        self.hooks = []
        self.optimizer = None
        self.prefetcher = None
        self._master_keys: dict[ParamGroup, int] = {}
        self._stack: list[nn.Module] = []
        self._backward_active = False
        self._step_started = None
        self._touch = _ForwardTouchMode(self)
        self.step_stats: list[dict] = []
        self.finalized = False

    # -- construction ------------------------------------------------------------------------
    def partition_module(self, module: nn.Module) -> None:
        """Shard every parameter under ``module`` not yet managed, one group per owning module."""
        for owner in module.modules():
            fresh = [(n, p) for n, p in owner.named_parameters(recurse=False)
                     if p not in self.coordinator.group_of and p.device.type != "meta"]
            if not fresh:
                continue
            for trainable in (True, False):
                chosen = [(n, p) for n, p in fresh if p.requires_grad == trainable]
                if chosen:
                    self._partition(type(owner).__name__, chosen)
            if self.device.is_cuda:
                for name, buf in owner.named_buffers(recurse=False):
                    owner._buffers[name] = buf.to(self.device.device)

    def _partition(self, name: str, params: list[tuple[str, nn.Parameter]]) -> ParamGroup:
        values = []
        for _, p in params:
            v = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
            self.ranks.broadcast(v, src=0)
            values.append(v)
        group, fp32_shard = self.coordinator.partition(name, params, values)
        group.trainable = all(p.requires_grad for _, p in params)
        self._master_keys[group] = self.tiers.optimizer.put(fp32_shard, tag=f"master-init:{name}")
        return group

    def materialize(self, group: ParamGroup) -> None:
        """Gather a group's exact fp32 values into its parameters (construction-time edits)."""
        if group.state is ParamState.AVAILABLE:
            return
        shard = self._read_master(group)
        full = torch.empty(group.padded_numel, dtype=torch.float32)
        self.ranks.all_gather(full, shard)
        group.to_inflight(None)
        group.to_available(full)

    def dematerialize(self, group: ParamGroup) -> None:
        """Re-shard a materialized group from its (possibly edited) values, rank 0's winning."""
        full = group.flatten([s.param.data.to(torch.float32) for s in group.slots]).to(
            device="cpu", dtype=torch.float32)
        self.ranks.broadcast(full, src=0)
        shard = group.shard_of(full).contiguous()
        self.coordinator.write_shard(group, shard).wait()
        self._write_master(group, shard)
        group.to_not_available()

    def _read_master(self, group: ParamGroup) -> torch.Tensor:
        if self.store is not None:
            return self.store.read_state_shard("master", group.index)
        out = torch.empty(group.shard_numel, dtype=torch.float32)
        self.tiers.optimizer.read(self._master_keys[group], out).wait()
        return out

    def _write_master(self, group: ParamGroup, shard: torch.Tensor) -> None:
        if self.store is not None:
            self.store.write_master_shard(group.index, shard)
        else:
            self.tiers.optimizer.write(self._master_keys[group], shard).wait()

    def finalize(self, roots: list[nn.Module]) -> None:
        """Close construction: drop orphaned parameters, lay out the optimizer states, install hooks."""
        for root in roots:
            self.partition_module(root)
        self._drop_orphans(roots)
        self._index_modules(roots)
        threshold = self.config.partition.persistence_threshold
        for g in self.coordinator.groups:
            g.persistent = g.numel < threshold
        self._check_budget()
        self.layout = FlatLayout([g.shard_numel for g in self.coordinator.groups],
                                 self.config.partition.sub_group_size)
        for g, start in zip(self.coordinator.groups, self.layout.group_starts):
            g.flat_offset = start
        self.store = OptimizerStateStore(self.tiers.optimizer, self.layout, self.tiers.allocator,
                                         defer_states=True)
        for g in self.coordinator.groups:
            key = self._master_keys.pop(g)
            shard = torch.empty(g.shard_numel, dtype=torch.float32)
            self.tiers.optimizer.read(key, shard).wait()
            self.tiers.optimizer.free(key)
            self.store.write_master_shard(g.index, shard)
        self.store.allocate_states()
        self.reducer.store = self.store
        self.reducer.index()
        params = [s.param for g in self.coordinator.groups for s in g.slots]
        for root in roots:
            self.hooks.append(install_hooks(root, self, params if root is roots[0] else []))
        self.roots = list(roots)
        self.finalized = True
        # Issue 6: the prefetcher also meters every step (infinity.stats "steps"), so it
        # exists even with prefetch.enabled = false; then it only meters, never fetches.
        from infinity.prefetch.prefetcher import Prefetcher

        self.prefetcher = Prefetcher(self)
        self.coordinator.prefetcher = self.prefetcher
        # [Note: closing the tiers] Swap files, their directory locks and the I/O
        # handle belong to the engine; they are closed when the model they serve is
        # collected (or by Engine.close), so a later model can reuse the directory.
        weakref.finalize(roots[0], self.tiers.close)

    def close(self) -> None:
        """Wait for background work, then close the tiers (files, locks, I/O threads)."""
        if self.optimizer is not None:
            self.optimizer.synchronize()
        self.tiers.close()

    def _drop_orphans(self, roots: list[nn.Module]) -> None:
        """Re-shard groups some of whose parameters no module references any more (weight tying)."""
        live = {id(p) for r in roots for _, p in r.named_parameters(remove_duplicate=False)}
        kept: list[ParamGroup] = []
        for g in list(self.coordinator.groups):
            alive = [s for s in g.slots if id(s.param) in live]
            if len(alive) == len(g.slots):
                kept.append(g)
                continue
            if alive:
                self.materialize(g)
                values = [s.param.data.clone() for s in alive]
            for s in g.slots:
                self.coordinator.group_of.pop(s.param, None)
            self.tiers.params.free(g.param_key)
            self.tiers.optimizer.free(self._master_keys.pop(g))
            self.coordinator.groups.remove(g)
            if alive:
                for s, v in zip(alive, values):
                    s.param.data = v
                new = self._partition(g.name, [(s.name, s.param) for s in alive])
                self.coordinator.groups.remove(new)
                kept.append(new)
        for i, g in enumerate(kept):
            g.index = i
        self.coordinator.groups[:] = kept

    def _index_modules(self, roots: list[nn.Module]) -> None:
        named = {}
        for root in roots:
            for qualname, module in root.named_modules(remove_duplicate=False):
                groups = []
                for pname, p in module.named_parameters(recurse=False):
                    g = self.coordinator.group_of.get(p)
                    if g is None:
                        # partition_module shards every other parameter, so only meta ones get here.
                        raise EngineError(
                            f"module {qualname or type(root).__name__!r} has parameter {pname!r} on the "
                            f"{p.device.type} device, which infinity cannot shard; build the model on a real "
                            "device inside infinity.Init, or give the parameter values before the context exits")
                    if g not in groups:
                        groups.append(g)
                    named.setdefault(g, qualname or type(root).__name__)
                self.coordinator.module_groups[module] = groups
        for g, qualname in named.items():
            g.name = qualname

    def _check_budget(self) -> None:
        """Check, with infinity-plan's arithmetic, that what finalize is about to allocate fits.

        The shards already exist; what is left is the optimizer states (Adam m and v,
        the gradient accumulator, the sub-group streaming buffers) and the NVMe staging.
        Those rows of the plan of this very model (its groups as partitioned) go through
        ``tiers.budget.check_budget``, so a model that cannot fit fails here, before the
        bulk of its memory or disk is taken, with the numbers.
        """
        from infinity.plan import CensusGroup, ModelCensus, plan
        from tiers.budget import Need, check_budget

        census = ModelCensus("model", tuple(
            CensusGroup(g.name, tuple(s.numel for s in g.slots), bool(g.trainable))
            for g in self.coordinator.groups))
        the_plan = plan(census, self.config, world_size=self.ranks.world_size, local_ranks=1,
                        check_fit=False)
        paths = self.config.tiers.nvme_path or (None,)
        needs = []
        for row in the_plan.rows:
            if row.key not in _NOT_YET_ALLOCATED or row.nbytes == 0:
                continue
            if row.tier == "nvme":
                needs += [Need(row.what, "nvme", row.nbytes // len(paths), p) for p in paths]
            else:
                needs.append(Need(row.what, row.tier, row.nbytes))
        check_budget(needs, host_budget=self.config.tiers.host_budget,
                     device=self.device.device).raise_if_short()

    # -- the forward / backward lifecycle (called by the hooks) ------------------------------
    def pre_forward(self, module: nn.Module) -> None:
        if not self._stack:
            self.recover_aborted_backward()
            self._begin_forward(module)
        self._stack.append(module)
        self.coordinator.acquire(module)

    def post_forward(self, module: nn.Module, output) -> None:
        self.coordinator.release(module)
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        if torch.is_grad_enabled():
            self._watch_backward(module, output)
        if not self._stack:
            self._touch.stop()
            if self.prefetcher is not None:
                self.prefetcher.end_forward()

    def on_foreign_use(self, group: ParamGroup) -> None:
        """A running module used a parameter it does not own (see [Note: foreign parameters])."""
        module = self._stack[-1] if self._stack else None
        if module is None:
            raise EngineError(f"parameter group {group.name!r} was used outside any module's forward while "
                              "released; wrap the access in `with infinity.gathered(model):`")
        self.coordinator.adopt(module, group)

    def _begin_forward(self, module: nn.Module) -> None:
        self._touch.start()
        if self.optimizer is not None:
            self.optimizer._before_forward()
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self.prefetcher is not None:
            self.prefetcher.begin_forward(module)

    def _watch_backward(self, module: nn.Module, output) -> None:
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if not tensors:
            return
        fired = [False]

        def on_output_grad(grad):
            if not fired[0]:
                fired[0] = True
                self.pre_backward(module)

        for t in tensors:
            t.register_hook(on_output_grad)

    def _enter_backward(self) -> None:
        if not self._backward_active:
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if self.prefetcher is not None:
                self.prefetcher.begin_backward()

    def pre_backward(self, module: nn.Module) -> None:
        self._enter_backward()
        self.coordinator.hold_for_backward(module)

    def on_grad(self, param: nn.Parameter) -> None:
        self._enter_backward()
        if self.optimizer is not None:
            self.optimizer._before_grad()
        self.reducer.on_grad(param)

    def recover_aborted_backward(self) -> None:
        """Close a backward that an exception cut short.

        [Note: aborted backward]
        The end of a backward runs from a callback queued on autograd's engine, and autograd
        drops queued callbacks when a hook raises (an error in the model's backward, or a
        refused ``opt.step()`` called from a hook). Without this the engine would believe that
        backward still runs and refuse every later ``step()``. ``step()``, ``zero_grad()`` and
        the start of a forward call this: when autograd runs no graph task at all (not merely
        another one: a reentrant checkpoint runs a nested backward inside ours), the backward
        is over, and the end-of-backward work runs now: the gradients that had arrived are
        reduced and kept, as ``torch`` keeps the ``.grad`` a cut-short backward accumulated,
        and the groups held for backward are released. ``zero_grad()`` then drops them, as it
        would in plain PyTorch.
        """
        if self._backward_active and torch._C._current_graph_task_id() == -1:
            self._end_backward()

    def _end_backward(self) -> None:
        self.reducer.finish_backward()
        self.coordinator.end_backward()
        self._backward_active = False
        if self.prefetcher is not None:
            self.prefetcher.end_backward()

    # -- whole-model access ----------------------------------------------------------------------
    def groups_of(self, model: nn.Module) -> list[ParamGroup]:
        seen = []
        for m in model.modules():
            for g in self.coordinator.module_groups.get(m, ()):
                if g not in seen:
                    seen.append(g)
        return seen

    def write_param_shard(self, group: ParamGroup, full: torch.Tensor) -> None:
        """Store new full values of a gathered group (``infinity.gathered`` write-back)."""
        full32 = full.detach().to(device="cpu", dtype=torch.float32)
        shard = group.shard_of(full32).contiguous()
        self.coordinator.write_shard(group, shard).wait()
        self._write_master(group, shard)

    def stats(self) -> dict:
        """Telemetry of the engine: per-step records, fetch counters, tier statistics."""
        return {
            "rank": self.ranks.rank,
            "world_size": self.ranks.world_size,
            "fetch": self.coordinator.stats.as_dict(),
            "tiers": self.tiers.stats(),
            "steps": list(self.step_stats),
            "prefetch": self.prefetcher.stats() if self.prefetcher is not None else None,
            "gathered_bytes_now": self.coordinator.available_nbytes(),
        }

    @contextmanager
    def no_hooks_active(self):
        """Run engine-internal forward calls without the lifecycle bookkeeping."""
        stack, self._stack = self._stack, []
        try:
            yield
        finally:
            self._stack = stack


class _ForwardTouchMode(TorchFunctionMode):
    """Catches parameters used by a module other than their owner, during forward.

    [Note: foreign parameters]
    Some modules compute with a sub-module's parameters without calling that
    sub-module (``nn.MultiheadAttention`` uses ``self.out_proj.weight`` directly), or
    with a parameter of an unrelated module. While a forward runs, this mode looks at
    the arguments of every torch call; a managed parameter that is not gathered is
    fetched on the spot and adopted by the running module, so from then on it is
    gathered with that module's own parameters (and prefetched along the trace) and
    is available during that module's backward.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.active = False

    def start(self) -> None:
        if not self.active:
            self.__enter__()
            self.active = True

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        group_of = self.engine.coordinator.group_of
        for a in _tensor_args(args, kwargs):
            group = group_of.get(a)
            if group is not None and group.state is ParamState.NOT_AVAILABLE:
                self.engine.on_foreign_use(group)
        return func(*args, **kwargs)


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, nn.Parameter):
                    yield b


DEMAND_STAGING_BUFFERS = 3


class _LazyStaging:
    """Aligned staging buffers for NVMe shard reads, sized once the largest shard is known.

    [Note: staging buffers]
    Direct (O_DIRECT) reads need page-aligned destinations. The pool is created at the
    first fetch after construction, with DEMAND_STAGING_BUFFERS buffers as large as the
    largest shard but no larger than ``tiers.pool_buffer_size`` (one being read, one being
    gathered, one spare), and reused for the rest of training: no allocation on the hot
    path. Shards larger than a buffer (a big embedding) are read through the tier's own
    pool into ordinary memory, so these buffers do not grow with the model's width. Reads issued ahead by the
    prefetcher land in their own arena of ``prefetch.nvme_bytes`` (staging_arena.py).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pool = None

    def _ensure(self):
        if self._pool is None:
            from tiers.pool import BufferPool

            groups = self.engine.coordinator.groups
            largest = max((g.shard_nbytes for g in groups), default=4096)
            size = min(largest, self.engine.config.tiers.pool_buffer_size)
            self._pool = BufferPool(size, DEMAND_STAGING_BUFFERS, self.engine.tiers.allocator,
                                    name="param-staging")
        return self._pool

    @property
    def buffer_nbytes(self) -> int:
        if not self.engine.finalized:
            return 0
        return self._ensure().buffer_nbytes

    def try_acquire(self, owner: str):
        return self._ensure().try_acquire(owner=owner)

    def stats(self) -> dict | None:
        return None if self._pool is None else self._pool.stats()
