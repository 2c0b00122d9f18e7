"""The engine of one model: its parts, and the forward/backward lifecycle the hooks delegate to.

``Engine`` ties together the tiers, the coordinator (parameter availability), the
gradient reducer, the optimizer state store, the prefetcher and, once created, the
optimizer, and implements the lifecycle methods the hooks delegate to. It is created
by ``infinity.Init`` (whose ``Partitioner`` fills it while the model is built) and
found from the model through the registry.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
import warnings
import weakref

import torch
from torch import nn

from infinity.config import Config
from infinity.errors import TORCHSCRIPT, EngineError
from infinity.optim import tier_split
from infinity.optim.flat_state import OptimizerStateStore
from infinity.optim.grad_face import GradFace
from infinity.optim.loss_scale import LossScaler
from infinity.optim.torch_guard import TorchOptimizerGuard
from infinity.param_group import ParamGroup, ParamState
from infinity.prefetch import Prefetcher
from infinity.runtime.activations import ActivationOffload
from infinity.runtime.backward_end import BackwardEnd
from infinity.runtime.backward_holds import BackwardHolds
from infinity.runtime.coordinator import Coordinator, gather_rest
from infinity.runtime.datapath import DataPath, late_copy_polls, with_per_parameter
from infinity.runtime.device import ComputeDevice
from infinity.runtime.foreign import ForeignParamWatch
from infinity.runtime.grads import GradReducer
from infinity.runtime.inputs import explain_dtype_mismatch
from infinity.runtime.placeholder import parameter_free_buffers
from infinity.runtime.hooks import (GradArrivals, install_hooks, install_released_guard, pinned_group_warning,
                                    unhook_idle, watch_backward)
from infinity.runtime.ranks import Ranks
from infinity.runtime.shards import DemandStaging, ParamShards
from infinity.runtime.save_guard import guard_save_pretrained, state_dict_refusal
from infinity.runtime.synced_generate import sync_generate
from infinity.runtime.tier_set import TierSet
from tiers.host_alloc import HeapTrimmer

# With the CPU as compute device, the C heap's free bytes above which a backward's end may give them
# back (see [Note: the C heap] and [Note: trimming once per growth] in tiers/host_alloc.py).
_HEAP_SLACK = 256 << 20


def _calling(module: nn.Module) -> bool:
    """Whether a call of ``module`` is under way besides the one starting now (a module that calls itself,
    recursively): two of torch's ``_call_impl`` frames for it on this thread's stack. Looked at only when
    the module is already the outermost one on the engine's stack, so not on the hot path."""
    calls, frame = 0, inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
            calls += 1
            if calls == 2:
                return True
        frame = frame.f_back
    return False


class Engine:
    """Everything infinity keeps for one model (or for the models built in one ``Init``).

    Parameters
    ----------
    config:
        The loaded config.
    group:
        A ``torch.distributed`` process group (None: the default group, or one rank).
    resume:
        A checkpoint in place to build from (``infinity.checkpoint.in_place.Resume``), or None.
    """

    def __init__(self, config: Config, group=None, resume=None) -> None:
        self.config = config
        self.device = ComputeDevice(config.tiers.compute_device())
        self.ranks = Ranks(group, self.device.device)
        _refuse_a_launch_without_a_group(group, self.ranks)
        if self.ranks.world_size > 1 and (pinned := pinned_group_warning()):
            warnings.warn(pinned, stacklevel=3)
        self.dtype = config.precision.torch_dtype
        self.resume = resume
        # Swap directories are per process: named by the rank in the whole job ([Note: per-rank swap directories]).
        adopt = None if resume is None else resume.files(config, self.ranks.rank, self.ranks.world_size,
                                                         self.ranks.global_rank)
        self.tiers = TierSet(config, self.device, self.ranks.global_rank, adopt=adopt)
        try:   # everything above the tiers: when any of it fails, the tiers close again
            self.ranks.allocator = self.tiers.allocator     # see [Note: what a collective may be given]
            self.datapath = DataPath(self.device, self.tiers.allocator, late_polls=late_copy_polls())
            staging = None
            if config.tiers.params == "nvme":
                staging = DemandStaging(self.tiers.allocator,
                                        lambda: max((g.shard_nbytes for g in self.coordinator.groups), default=4096))
            shards = ParamShards(self.tiers.params, self.dtype, self.datapath, staging)
            self.coordinator = Coordinator(shards, self.ranks, self.device, config.partition.gather_buffer_bytes,
                                           config.partition.max_live_parameters)
            self.reducer = GradReducer(self.coordinator, self.ranks, self.datapath, self.tiers.allocator,
                                       stage=config.partition.stage, bucket_nbytes=config.partition.reduce_bucket_bytes)
            self.activations: ActivationOffload | None = None
            if config.activations.offload != "none":
                self.activations = ActivationOffload(config.activations, self.datapath, self.tiers, self.device.device)
            self.store: OptimizerStateStore | None = None
            self.roots: list[nn.Module] = []
            self.buffer_originals: list = []
            self.hooks = []
            self.optimizer = None
            self.prefetcher: Prefetcher | None = None
            self._updates = None
            self._stack: list[nn.Module] = []
            self._unhooked = False      # the idle modules' forward hooks are gone (hooks.unhook_idle)
            self._backward_active = False
            self._backwards_ended = [0]    # backwards that ended (hooks.watch_backward fires once per one)
            self._end = BackwardEnd()       # the running backward's end ([Note: a resumable end of backward])
            self._heap = HeapTrimmer(_HEAP_SLACK)   # CPU compute: [Note: trimming once per growth] in tiers/host_alloc.py
            self._step_started = None
            self.agree_at_forward = True   # the next forward agrees on the rank-local checks (a step ended)
            # Why the states are a mixture no step may train on, or None ([Note: a load is all or
            # nothing] in infinity/checkpoint/reader.py); check_intact refuses while it is set.
            self.damaged: str | None = None
            # An opt.zero_grad() that raised before it cleared this rank's gradients: (why, its set_to_none), or
            # None. The next forward clears them; check_intact(grads=True) refuses a step before.
            self.clear_owed: tuple[str, bool] | None = None
            self.steps_not_loaded: str | None = None   # a checkpoint loaded before the optimizer existed
            self._foreign = ForeignParamWatch(self.coordinator.group_of, self.on_foreign_use)
            self._arrivals = GradArrivals(self)     # gradients of the groups armed for the coming backward
            several = self.ranks.world_size > 1     # [Note: handed over in order] in infinity/runtime/grads.py
            self._arrivals.every = several and config.partition.stage < 3
            self._arrivals.in_order = several and config.partition.stage == 2
            self.coordinator.in_order = several and config.partition.stage < 3     # [Note: gathered in one order]
            self._arrivals.by_call = several and config.partition.stage == 3   # [Note: handed over at the call's end]
            self._holds = BackwardHolds(self.coordinator, self._arrivals.armed)     # frozen groups' release in backward
            self.step_stats: list[dict] = []
            self.placement = None     # what tiers "auto" chose (infinity.plan.placement.AutoDecision), or None
            self.grad_face: GradFace | None = None      # what torch sees as .grad (made in finalize)
            self.loss_scaler = LossScaler.for_precision(config.precision)     # fp16 only
            self._at_collection: list = []    # what the model's collection (or release) undoes
            self.released = False                       # infinity.release(model) ran (see [Note: releasing])
            self.param_names: dict = {}                 # param -> qualified name, for messages (set in finalize)
        except BaseException:
            self.tiers.close()
            raise

    @property
    def layout(self):
        """The flat layout of this rank's optimizer space (``infinity.optim.flat_state.FlatLayout``)."""
        return self.store.layout

    def finalize(self, roots: list[nn.Module], store: OptimizerStateStore) -> None:
        """Construction is over: take the state store, install the hooks, start the prefetcher."""
        self.store = store
        self.coordinator.memory.size_for(self.coordinator.groups, self.coordinator.in_place)
        self.reducer.attach(store)
        names = {p: n for root in roots for n, p in reversed(list(root.named_parameters(remove_duplicate=False)))}
        self.param_names = names
        self.grad_face = GradFace(self, names)
        self.reducer.mark_grads = self.grad_face.mark
        guard = TorchOptimizerGuard(self, names)      # torch.optim over these parameters raises
        self._at_collection = [weakref.finalize(roots[0], guard.remove)]
        for root in roots:
            self.hooks.append(install_hooks(root, self))
        self.roots = list(roots)
        self.buffer_originals = parameter_free_buffers(roots)   # a refused model.half() puts them back
        # The prefetcher also meters every step (infinity.stats "steps"), so it exists even with
        # prefetch.enabled = false; then it only meters, never fetches.
        self.prefetcher = Prefetcher(self)
        self.coordinator.prefetcher = self.prefetcher
        # [Note: closing the tiers] Swap files, their directory locks and the I/O
        # handle belong to the engine; they are closed when the model they serve is
        # collected (or by Engine.release), so a later model can reuse the directory.
        self._at_collection.append(weakref.finalize(roots[0], _close_parts, self.activations, self.tiers))
        # transformers' generate, synced over the ranks where a forward is a collective ([Note: generating on
        # several ranks] in infinity/runtime/synced_generate.py); release gives each root its own back.
        self._at_collection += [s.remove for s in sync_generate(roots, self.ranks, self.config.partition.stage)]
        self._at_collection += [g.remove for g in guard_save_pretrained(roots, self.coordinator)]   # [Note: ...
        # save_pretrained refused before it writes] in infinity/runtime/save_guard.py

    def attach_optimizer(self, optimizer, updates) -> None:
        """``optimizer`` steps this model; ``updates`` (its ``UpdateScheduler``) hears the lifecycle.

        An overlapped update gates the coordinator's fetches, group by group, and hands
        rewritten shards over through the prefetcher's arena, as does the update during backward.
        """
        self.optimizer = optimizer
        self._updates = updates
        self.coordinator.shards.gate_on_update(updates.overlap, self.prefetcher.arena,
                                               self.config.optimizer.update_in_backward)

    def release(self) -> None:
        """Give back everything the engine holds now (``infinity.release``, and ``Init`` when construction
        fails; idempotent).

        [Note: releasing]
        The engine's swap files, their directory locks, its pinned host buffers and its
        device arenas are freed when the model and its optimizer are collected, which a user
        cannot always arrange (a Trainer, a notebook or a traceback keeps a reference). Release
        does at once what collection would: wait for a running update, remove every hook
        (restoring the model's own), close the tiers (deleting the swap files and unlocking
        their directories, as ``Init`` does when construction fails) and drop the engine's
        parts and the optimizer's, so their buffers go with them. The model keeps its
        placeholders (which refuse reads: [Note: released placeholders] in
        infinity/runtime/placeholder.py) and gets guard hooks in place of the engine's: a forward or a
        ``state_dict()`` raises, as does any infinity call on it or on its optimizer, naming
        ``infinity.release``.
        """
        if self.released:
            return
        self.recover_aborted_backward()
        if self.backward_running:
            raise EngineError("infinity.release: a backward pass is running on this model; release it after "
                              "the backward (and opt.step()) returns")
        if self.optimizer is not None:
            self.optimizer.synchronize()
        for handles in self.hooks:
            handles.remove()
        self.hooks = [install_released_guard(root) for root in self.roots]
        if self.grad_face is not None:
            self.grad_face.forget()
        self._foreign.stop()
        for undo in self._at_collection:    # now, instead of at the model's collection (and only once)
            undo()
        _close_parts(self.activations, self.tiers)
        if self.optimizer is not None:
            self.optimizer.drop_engine_state()
        self.released = True
        self.store = self.prefetcher = self._updates = self.optimizer = self.grad_face = None
        self.coordinator = self.reducer = self.datapath = self.tiers = self.activations = self._holds = None
        self._arrivals.remove()
        self.step_stats = []

    def check_intact(self, what: str, grads: bool = False) -> None:
        """Refuse ``what`` while the states are damaged (a load failed half-way), or with ``grads`` while a
        clear of the gradients is owed, saying how to recover."""
        if self.damaged:
            raise EngineError(f"{what}: refused because {self.damaged}")
        if grads and self.clear_owed is not None:
            raise EngineError(f"{what}: refused because {self.clear_owed[0]}")

    @property
    def backward_running(self) -> bool:
        """Whether a backward pass is under way (gradients arriving or groups held for it)."""
        return self.reducer.pending() or self._backward_active

    # -- the forward / backward lifecycle (called by the hooks) ------------------------------
    def pre_forward(self, module: nn.Module, args=(), kwargs=None):
        """Before ``module``'s forward; returns new ``(args, kwargs)`` for it, or None to leave them."""
        if self._stack and module is self._stack[0] and not _calling(module):
            # The last forward of this module was cut short by a BaseException (Ctrl-C): torch runs the
            # always_call post-hooks that close a forward for an Exception only. Close it as they would
            # have, or every later forward would count as nested in it (no step begun, stale values).
            for stale in reversed(self._stack[:]):
                self.post_forward(stale, None)
        cast = None
        if not self._stack:
            if _differentiating():
                raise EngineError(_CREATE_GRAPH)
            if torch.jit.is_tracing():
                raise EngineError(TORCHSCRIPT)
            self._begin_forward(module)
            if not self._backward_active:      # a forward inside backward recomputes for it
                self.datapath.set_phase("forward")
                if self.activations is not None and torch.is_grad_enabled():
                    self.activations.begin_forward()
        elif not self._foreign.active and not self.prefetcher.following:
            self._foreign.start()              # the step left its trace: watch again
        if self.activations is not None:
            self.activations.module_called(module, args, len(self._stack))
        self._stack.append(module)
        groups = self.coordinator.module_groups.get(module, ())
        ends = None
        if not _quiet(self.prefetcher, groups):
            if self._arrivals.by_call and torch.is_grad_enabled():
                ends = self._arrivals.called(groups, self._backward_active)
            self.coordinator.acquire(module)
            self._arm(groups)
        if ends:    # [Note: handed over at the call's end] in infinity/runtime/grads.py
            return self._arrivals.end_of_call(args, kwargs, ends)
        return cast

    def post_forward(self, module: nn.Module, output, inputs=None) -> None:
        grad = torch.is_grad_enabled()
        # Read while the module's groups are gathered (a released placeholder's requires_grad is a torch call).
        over = self._holds.watcher(module) if grad and inputs is not None else None
        self.coordinator.release(module)
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        if grad and (not self._stack or not _quiet(
                self.prefetcher, self.coordinator.module_groups.get(module, ()))):
            watch_backward(module, output, self.pre_backward, self._backwards_ended, inputs, over)
            if not self._stack and self.loss_scaler is not None and not self._backward_active:
                self.loss_scaler.watch_output(output)      # [Note: loss scaling] in infinity/optim/loss_scale.py
        if not self._stack:
            if output is None:      # torch's always_call hooks run inside its `except`: the forward raised
                explain_dtype_mismatch(sys.exc_info()[1], self.dtype)
            if self.coordinator.in_order:
                gather_rest(self.coordinator)       # [Note: gathered in one order] in infinity/runtime/coordinator.py
                if grad and self._arrivals.every and not self._backward_active:
                    # Every trainable group takes part in every backward ([Note: handed over in order] in
                    # infinity/runtime/grads.py); gathered in group order, a group a module reads without
                    # calling its owner (attention's out_proj) is no foreign use that would arm it.
                    for g in self.coordinator.groups:
                        self._arrivals.arm(g)
            self._foreign.stop()
            if self.activations is not None:
                self.activations.end_forward()
            if not self._backward_active:
                self.datapath.set_phase("idle")
            if self.prefetcher is not None:
                self.prefetcher.end_forward()

    def on_foreign_use(self, group: ParamGroup) -> None:
        """A running module used a parameter it does not own (see [Note: foreign parameters] in
        infinity/runtime/foreign.py)."""
        module = self._stack[-1] if self._stack else None
        if module is None:
            raise EngineError(f"parameter group {group.name!r} was used outside any module's forward while "
                              "released; wrap the access in `with infinity.gathered(model):`")
        if self._arrivals.by_call and torch.is_grad_enabled():     # a second user ([Note: handed over at the call's end])
            self._arrivals.called([group], self._backward_active)
        self.coordinator.adopt(module, group)
        self._arm([group])

    def _begin_forward(self, module: nn.Module) -> None:
        # A step's first forward all-gathers (at stages 1 and 2 the groups the update changed: [Note: gathered in
        # one order] in infinity/runtime/coordinator.py), so every rank runs one: it agrees on the rank-local
        # checks first ([Note: failing together] in infinity/runtime/ranks.py).
        agree = self.agree_at_forward and self.ranks.world_size > 1
        with self.ranks.together("the forward") if agree else contextlib.nullcontext():
            # Closing a backward cut short may fail on one rank alone (its end's tier I/O): inside the agreement,
            # as is the clear every rank asked for and this one's zero_grad() did not finish.
            self.recover_aborted_backward()
            if self.clear_owed is not None and self.optimizer is not None:
                self.optimizer.zero_grad(self.clear_owed[1])
            self.check_intact("forward")
            self.tiers.check()      # before the step's reads: [Note: checking a live swap file] in tiers/swapfile.py
            if self._updates is not None:
                self._updates.before_forward()
        self.agree_at_forward = False       # after the agreement: a forward that failed in it agrees again
        if self.optimizer is not None:
            self.optimizer.unmanaged.hook_unfrozen()
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self.prefetcher is not None:
            self.prefetcher.begin_forward(module)
            if self.prefetcher.following and not self._unhooked and self.activations is None:
                unhook_idle(self.roots, self.hooks, self.coordinator.module_groups)
                self._unhooked = True
        # See [Note: foreign parameters]: once a step follows the recorded trace, the groups each
        # module uses (adopted ones included) are known, and no torch call needs to be watched.
        if self.prefetcher is None or not self.prefetcher.following:
            self._foreign.start()

    def _enter_backward(self) -> None:
        if self.released:       # a graph built before infinity.release: its hooks outlive the engine's parts
            raise EngineError("backward through a graph of a model released (infinity.release) after its forward: "
                              "the engine's tiers and gradients are gone, so nothing can be computed or stored; "
                              "call backward (and opt.step()) before infinity.release(model)")
        if self._backward_active and self._end.failed:
            # A new backward (retain_graph, a second loss) before anything closed the last one, whose end failed
            # ([Note: a resumable end of backward] in infinity/runtime/backward_end.py): that one finishes first.
            self._end_backward(cut_short=True)
        if not self._backward_active:
            if torch.is_grad_enabled():     # autograd records the backward itself: create_graph=True
                raise EngineError(_CREATE_GRAPH)
            self.grad_face.before_backward()    # zero_grad() through .grad, then autograd writes None .grad
            self._backward_active = True
            self._end.begin()
            self.datapath.set_phase("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if self.prefetcher is not None:
                self.prefetcher.begin_backward()
            if self.activations is not None:
                self.activations.begin_backward()

    def pre_backward(self, module: nn.Module | None) -> None:
        """A module's backward starts; ``None``: a gradient the engine does not hand over arrived (a parameter
        added after Init, [Note: unmanaged parameters] in infinity/optim/unmanaged.py), so this backward must
        end through ``_end_backward`` too."""
        self._enter_backward()
        if module is None:
            return
        self.coordinator.hold_for_backward(module)
        self._holds.held(module)
        # Armed by the forward; a second backward through a retained graph (retain_graph=True) arms
        # again, so its gradients accumulate onto the first's as in torch.
        armed = self._arrivals.armed
        for g in self.coordinator.module_groups.get(module, ()):
            if g not in armed:
                self._arrivals.arm(g)

    def _arm(self, groups) -> None:
        """Watch the gradients of gathered ``groups`` in the coming backward (see [Note: one gradient
        hook per group] in infinity/runtime/hooks.py)."""
        if not torch.is_grad_enabled():
            return
        for g in groups:
            self._arrivals.arm(g)

    def on_group_grads(self, group: ParamGroup, params: list, grads) -> None:
        """Every parameter of ``group`` taking part in this backward has its gradient (``grads``)."""
        self._enter_backward()
        if self._updates is not None:
            self._updates.before_grad()
        self.reducer.take(group, params, grads)
        if self._holds.waiting:
            self._holds.arrived(group)

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
            self._end_backward(cut_short=True)

    def _end_backward(self, cut_short: bool = False) -> None:
        """The backward is over (autograd's queued callback, or ``recover_aborted_backward``): run the stages
        of its end not done yet, in order ([Note: a resumable end of backward] in infinity/runtime/backward_end.py).
        """
        def count() -> None:        # watch_backward's hooks fire once per backward that ended
            self._backwards_ended[0] += 1

        optimizer, activations = self.optimizer, self.activations
        stages = (count,
                  self._arrivals.flush,     # groups short of a gradient (a parameter unused in this backward)
                  lambda: self.reducer.finish_backward(cut_short),
                  # after the engine's own collectives, on every rank
                  optimizer.unmanaged.end_backward if optimizer is not None else None,
                  self._holds.clear,
                  self.coordinator.end_backward,
                  activations.end_backward if activations is not None else None)
        self._end.run(stages)
        self._backward_active = False
        self.datapath.set_phase("idle")
        if not self.device.is_cuda:
            self._heap.end_of_step()
        if self.prefetcher is not None:
            self.prefetcher.end_backward()

    # -- whole-model access ----------------------------------------------------------------------
    def before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``state_dict()`` of a released parameter's values is refused: they are only shards.

        (``keep_vars=True`` asks for the parameters themselves, as checkpoints do for the keys.)
        """
        if keep_vars:
            return
        for name, p in module.named_parameters(recurse=False):
            group = self.coordinator.group_of.get(p)
            if group is not None and group.state is not ParamState.AVAILABLE:
                refusal = state_dict_refusal(prefix + name)     # None: the keys alone are asked for
                if refusal is not None:
                    raise EngineError(refusal)
                return

    def write_param_shard(self, group: ParamGroup, full: torch.Tensor, before: torch.Tensor) -> None:
        """Store new full values of a gathered group (``infinity.gathered`` write-back).

        ``before`` is this rank's shard as gathered (compute dtype): in bf16/fp16, only the
        elements that differ from it take the new value as their fp32 master weight; the others
        keep theirs (a compute-dtype value is the master's rounding, not the master).
        """
        shard = group.shard_of(full.detach()).to("cpu").contiguous()
        self.coordinator.shards.write(group, shard).wait()
        master = shard.to(torch.float32)
        if shard.dtype != torch.float32:
            changed = shard != before.to("cpu")
            master = torch.where(changed, master, self.store.read_state_shard("master", group.index))
        self.store.write_master_shard(group.index, master)

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
            "transfers": with_per_parameter(self.datapath.ledger.last,
                                            self.store.layout.total_numel if self.store is not None else 0,
                                            self.tiers),
            "comm": self.ranks.comm.last,
            "gather_memory": self.coordinator.memory.stats(),
            "reduce_buckets": self.reducer.device_buckets.stats(),
            "whole_gradient_bytes": self.reducer.whole_nbytes,
            "loss_scale": self.loss_scaler.as_dict() if self.loss_scaler is not None else None,
            "activations": self.activations.stats() if self.activations is not None else {"offload": "none"},
            "optimizer_tiers": tier_split.shares(self.store) if self.store is not None else None,
        }


def _close_parts(activations, tiers) -> None:
    """Stop the activations' I/O before the tiers it writes to close."""
    if activations is not None:
        activations.close()
    tiers.close()


def _differentiating() -> bool:
    """Whether a torch.func transform that differentiates (grad, vjp, jacrev, jvp) runs this forward: its
    wrapped tensors have no storage, and the gathers made inside one broke every later forward."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    return interpreter is not None and interpreter.key() in (_TransformType.Grad, _TransformType.Jvp)


_TransformType = torch._C._functorch.TransformType
_CREATE_GRAPH = (
    "a backward with create_graph=True or a torch.func transform that differentiates (double backward: gradient "
    "penalties, Hessians; torch.func.grad, vjp, jacrev, jvp) through a "
    "model infinity manages: the parameters' gradients are reduced into shards as backward produces them and "
    "their groups released, so there is no graph of them to differentiate again; nothing was accumulated. Train "
    "with an ordinary loss.backward(), or compute such terms on a model built outside infinity.Init")


def _quiet(prefetcher, groups) -> bool:
    """Whether a module asking for ``groups`` needs no engine work in this step: none of its own, followed
    trace (see [Note: requests without groups] in infinity/prefetch/trace.py). Its backward needs none
    either: the outermost module's output starts the backward."""
    return prefetcher is not None and prefetcher.ignores(groups)


def _refuse_a_launch_without_a_group(group, ranks) -> None:
    """A process that a launcher started as one of several (``WORLD_SIZE`` > 1: torchrun, accelerate launch,
    deepspeed) with no process group yet would build an engine of one rank, and the processes would train
    separate models without a word; the usual cause is a script that builds the model before
    ``TrainingArguments`` or ``Accelerator()``, which create the group."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if group is not None or ranks.enabled or not launched.isdigit() or int(launched) <= 1:
        return
    raise EngineError(
        f"infinity.Init: this process was launched as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={launched}, "
        "but no torch.distributed process group exists yet, so the engine would be one rank's alone and the "
        "processes would train separate models. Create the group before infinity.Init: "
        "torch.distributed.init_process_group(), or build transformers.TrainingArguments(...) / "
        "accelerate.Accelerator() first (they create it)")
