"""Every hook the engine puts on a model, installed in one place.

Hook bodies only delegate to the engine's lifecycle methods (``pre_forward``,
``post_forward``, ``pre_backward``, ``on_group_grads``); the returned ``HookHandles``
removes the module hooks, restoring the model's hooks exactly.

[Note: one gradient hook per group]
A group's gradients are handed over once per backward, when every parameter of the
group has its whole gradient (all its uses summed): each managed parameter has one
post-accumulate-grad hook, registered once, and a group armed for the coming backward
(when a forward gathers it) counts its parameters' arrivals; the last one hands the
group's gradients to the engine, read from ``.grad`` where autograd just stored them.
So the engine runs once per group, never once per parameter, and arming costs a dict
entry, not hook registrations: ``torch.autograd.graph.register_multi_grad_hook``, armed
per group and forward as before, cost about 0.1 ms per group and forward on the CPU
(its ``view_as`` per parameter, a hook, a handle and a lock each; 15-30% of the
``device`` preset's host work per step).

A parameter whose hook never fires (unused in this backward: a branch not taken) leaves
its group short; the end of the backward hands such groups over with ``None`` for the
missing gradients (``GradArrivals.flush``). A group no forward armed (a backward inside
``infinity.gathered``) is left to autograd, as without the engine. The hooks live on the
parameters (their ``_post_accumulate_grad_hooks``), so they outlast every release and
gather: ``.data`` swaps keep a tensor's hooks.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from infinity.errors import TORCHSCRIPT, EngineError, released_message

# [Note: torch._dynamo and the default process group]
# The module hooks are wrapped by torch.compiler.disable, which needs torch._dynamo; importing
# that imports torch.distributed.nn, whose functions take ``group=group.WORLD`` as a default
# argument, evaluated once, at that import. Imported after init_process_group, those defaults
# hold the default process group for the rest of the process: dist.destroy_process_group()
# unregisters it but cannot free it, and its backend's worker threads live on into the
# interpreter's teardown. A gloo worker that drops its last collective's tensors there needs
# the GIL, is stopped mid-C++ by the finalizing interpreter, and the process aborts
# ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489). Seen in 8
# of 67 runs of a two-rank benchmarks/stages.py that exits right after its last step.
# So torch._dynamo is imported with this module: a script that imports the engine before it
# makes the group (``from infinity import Init``) leaves the group free to go. An engine over
# several ranks built where the import came after the group says so (``pinned_group_warning``).


def _import_dynamo() -> bool:
    """Import torch._dynamo; True when that import is what made torch.distributed.nn hold the default group."""
    before = dist.is_available() and dist.is_initialized() and "torch.distributed.nn" not in sys.modules
    import torch._dynamo  # noqa: F401

    return before and "torch.distributed.nn" in sys.modules


_DYNAMO_HOLDS_DEFAULT_GROUP = _import_dynamo()


def pinned_group_warning() -> str | None:
    """What to tell a multi-rank run whose default group torch keeps alive (see the note above); None if not."""
    if not _DYNAMO_HOLDS_DEFAULT_GROUP:
        return None
    return ("infinity.Init was first imported after dist.init_process_group(): the import of torch._dynamo it "
            "needs (for torch.compiler.disable on its hooks) made torch.distributed.nn keep the default process "
            "group as a default argument, so dist.destroy_process_group() cannot stop the group's worker threads "
            "and a rank that exits right after a collective can abort in interpreter teardown (SIGABRT, "
            "pytorch/pytorch#190489). Import it before making the group: `from infinity import Init` (or "
            "`import torch._dynamo`) at the top of the script.")


class GradArrivals:
    """The post-accumulate-grad hook of every managed parameter, and the groups armed for the coming
    backward (see [Note: one gradient hook per group]). Holds the engine weakly.

    [Note: hooks held from C++]
    A parameter's grad hooks are kept alive by the C++ tensor, out of sight of
    Python's cycle collector; a hook holding the engine strongly would make the
    engine, the model and its swap files immortal. The module hooks live in the
    modules' own dicts and may hold the engine strongly.
    """

    def __init__(self, lifecycle) -> None:
        self.engine = weakref.ref(lifecycle)
        self.armed: dict = {}       # group -> [params, their gradients so far, arrivals]
        self._hooked: dict = {}     # id(parameter) -> its hook's handle (the model holds the parameters)
        self._slot: dict = {}       # id(parameter) -> (its group, its place in the group's armed list)
        self.handed: set = set()    # groups handed over in this backward, or waiting their turn (see ``arm``)
        self.reopened: set = set()  # ... and armed again in it: ``flush`` hands them over even without a gradient
        # Several ranks at stages 1 and 2 ([Note: handed over in order]): every trainable group is handed
        # over in every backward (``every``), and at stage 2, whose hand-overs are collectives, in ``_order``.
        self.every = False
        self.in_order = False
        self._order: list | None = None     # this backward's trainable groups, in hand-over order
        self._due = 0                       # the place in ``_order`` of the next group to hand over
        self._complete: dict = {}           # group -> (params, gradients): complete, waiting for its turn
        self._in_order_set: set = set()     # ``_order``'s groups
        self._taken: set = set()            # groups the engine took in this backward
        # Several ranks at stage 3 ([Note: handed over at the call's end]): a group one watched call used in
        # this forward is handed over when that call's backward is over.
        self.by_call = False
        self._calls: dict = {}              # group -> forward calls (outermost) that used it since the backward
        self._watched: set = set()          # groups whose one call's backward end is watched
        self._in_forward: set = set()       # groups a forward call (outside backward) counted
        self._fresh: set = set()            # groups first used inside the backward (a reentrant recomputation)

    def arm(self, group) -> None:
        """Count ``group``'s gradients in the coming backward."""
        if group in self.armed:
            return
        params = [s.param for s in group.slots if s.param.requires_grad]
        if not params:
            return
        waiting = self._complete.pop(group, None)
        if waiting is not None:     # complete and waiting its turn: armed again (a reentrant checkpoint) takes it now
            self._give(group, *waiting)
        if group in self.handed:    # called again inside the backward that took its gradients
            self.handed.discard(group)
            self.reopened.add(group)
            engine = self.engine()
            if engine is not None:
                engine.reducer.reopen(group)
        for i, p in enumerate(params):
            if id(p) not in self._hooked:   # once per parameter (and again if it becomes trainable)
                self._hooked[id(p)] = p.register_post_accumulate_grad_hook(self)
            self._slot[id(p)] = (group, i)
        self.armed[group] = [params, [None] * len(params), 0]

    def __call__(self, param) -> None:
        # Once per parameter and backward: dict lookups by id only (a tensor's __hash__ is Python).
        group, i = self._slot.get(id(param), (None, 0))
        entry = self.armed.get(group)
        if entry is None:
            if group in self._taken:    # handed over at its call's end or in turn, and a gradient came after
                self._late(param, group)
            return          # not armed: autograd keeps the gradient in .grad, as without the engine
        grads = entry[1]
        if grads[i] is None:
            entry[2] += 1
        grads[i] = param.grad
        if entry[2] == len(grads):
            del self.armed[group]
            self.handed.add(group)
            if self.by_call and group not in self.reopened:
                if group in self._watched and self._calls.get(group) == 1:
                    self._complete[group] = (entry[0], grads)   # until its call's backward is over (``call_over``)
                    return
                if group not in self._fresh:
                    self._complete[group] = (entry[0], grads)   # until the end of the backward (``flush``)
                    return
            if not self.in_order or group in self.reopened:
                self._give(group, entry[0], grads)
                return
            self._complete[group] = (entry[0], grads)
            order = self._trainable_order()
            while self._due < len(order):
                due = order[self._due]
                if due in self._complete:
                    self._due += 1
                    self._give(due, *self._complete.pop(due))
                elif due in self._taken:    # taken out of turn (armed again while waiting)
                    self._due += 1
                else:
                    break
            if group in self._complete and group not in self._in_order_set:    # trainable since the order was made
                self._give(group, *self._complete.pop(group))

    def _late(self, param, group) -> None:
        engine = self.engine()
        name = engine.param_names.get(param, "?") if engine is not None else "?"
        raise EngineError(
            f"parameter {name!r}: its gradient arrived after its group {group.name!r} was handed over in this "
            "backward (a module that reads it without owning it, which infinity did not see in the forward: "
            "[Note: handed over at the call's end] in infinity/runtime/grads.py); the gradient would be lost, so "
            "the backward stops. Call opt.zero_grad() and report the model to infinity")

    def called(self, groups, in_backward: bool) -> list:
        """A forward call uses ``groups``; returns those it is the outermost user of, whose gradients it may
        hand over at its backward's end ([Note: handed over at the call's end]). Inside the backward only
        groups no forward used count (a reentrant checkpoint's recomputation, whose backward runs)."""
        engine = self.engine()
        in_use = engine.coordinator.in_use if engine is not None else {}
        mine = [g for g in groups if not in_use.get(g)]     # else a call around this one holds it
        if in_backward:
            mine = [g for g in mine if g not in self._in_forward]
            self._fresh.update(mine)
        else:
            self._in_forward.update(mine)
        for g in mine:
            self._calls[g] = self._calls.get(g, 0) + 1
        return mine

    def end_of_call(self, args, kwargs, groups):
        """The call's ``(args, kwargs)`` with every tensor that needs a gradient passed through ``_CallEnd``,
        whose backward (this call's part of their gradients complete) runs ``call_over(groups)``; None
        when none needs one (nothing to watch: ``groups`` wait for the end of the backward)."""
        flat, spec = tree_flatten((args, kwargs if kwargs is not None else {}))
        # One stand-in per tensor: a tensor passed twice stays one (attention's ``query is key`` fast path).
        picked = {id(t): t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad}
        if not picked:
            return None
        ends = _CallEnd.apply(functools.partial(self.call_over, groups), *picked.values())
        by_id = dict(zip(picked, ends))
        flat = [by_id.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in flat]
        self._watched.update(groups)
        return tree_unflatten(flat, spec)

    def call_over(self, groups) -> None:
        """The backward of the call that counted ``groups`` is over: hand over those it alone used in this
        forward, complete or not (a parameter without a gradient as zeros). A group with no gradient at
        all here waits for the end of the backward (``torch.autograd.grad`` runs this and stores none)."""
        for g in groups:
            if self._calls.get(g) != 1 or g not in self._watched:
                continue
            got = self._complete.pop(g, None)
            if got is None:
                entry = self.armed.get(g)
                if entry is None or not entry[2]:
                    continue
                del self.armed[g]
                got = (entry[0], entry[1])
                self.handed.add(g)
            self._give(g, *got)

    def _give(self, group, params, grads) -> None:
        self._taken.add(group)
        engine = self.engine()
        if engine is not None:
            _hand_over(engine, group, params, grads)

    def _trainable_order(self) -> list:
        """This backward's hand-over order ([Note: handed over in order]): made at its first use."""
        if self._order is None:
            engine = self.engine()
            groups = engine.coordinator.groups if engine is not None else ()
            self._order = [g for g in reversed(groups) if g.has_trainable]
            self._in_order_set = set(self._order)
        return self._order

    def flush(self) -> None:
        """The backward is over: hand over the groups some of whose parameters had no gradient (with
        ``every``: every trainable group not handed over yet, in order)."""
        armed, reopened, complete, taken = dict(self.armed), self.reopened, self._complete, self._taken
        order = self._trainable_order() if self.every else ()
        if self.by_call:    # what waited for the end, and every group still armed: in group order
            order = sorted({*complete, *(g for g in armed if g not in taken)}, key=lambda g: -g.index)
        if order and not (taken or complete or any(e[2] for e in armed.values())):
            order = ()      # nothing arrived on this rank (torch.autograd.grad, backward(inputs=...)): no hand-over
        self.armed.clear()
        self.handed, self.reopened, self._complete, self._taken = set(), set(), {}, set()
        self._order, self._due = None, 0
        self._calls, self._watched, self._in_forward, self._fresh = {}, set(), set(), set()
        engine = self.engine()
        if engine is None:
            return
        todo = []
        for group in order:
            if group in complete:
                params, grads = complete.pop(group)
            elif group in armed and group not in taken:
                params, grads, _ = armed.pop(group)
            elif group not in taken:    # no forward armed it on this rank (a module it skipped): zeros
                params = [s.param for s in group.slots if s.param.requires_grad]
                grads = [None] * len(params)
            else:
                continue
            todo.append((group, params, grads))
        todo += [(group, params, grads) for group, (params, grads) in complete.items()]   # trainable since the order
        # reopened: its first gradients' tokens come back at the take
        todo += [(group, params, grads) for group, (params, grads, arrived) in armed.items()
                 if arrived or group in reopened]
        for i, (group, params, grads) in enumerate(todo):
            _hand_over(engine, group, params, grads, [g for g, _, _ in todo[i + 1:]])

    def remove(self) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked = {}
        self._slot = {}
        self.armed.clear()
        self.handed, self.reopened, self._complete, self._taken = set(), set(), {}, set()
        self._order, self._due = None, 0
        self._calls, self._watched, self._in_forward, self._fresh = {}, set(), set(), set()


def watch_backward(module: nn.Module, output, pre_backward, ended: list[int], inputs=None, post_backward=None) -> None:
    """Call ``pre_backward(module)`` when the first gradient reaches ``module``'s ``output``, once per
    backward through it: ``ended[0]`` counts the backwards that ended (a graph kept with
    ``retain_graph=True`` goes through a second one).

    With ``post_backward``: call ``post_backward(module)`` when the gradient of every tensor of
    ``inputs`` (the call's arguments) that requires one is complete, in a backward that reached its
    output (see [Note: a module's backward is over] in infinity/runtime/backward_holds.py). Not
    watched when no input requires a gradient, or when one is a leaf (a hook on it would outlive
    this call)."""
    tensors = [t for t in tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
    if not tensors:
        return
    fired = [None]

    def on_output_grad(grad):
        if fired[0] != ended[0]:
            fired[0] = ended[0]
            pre_backward(module)

    for t in tensors:
        t.register_hook(on_output_grad)
    if post_backward is None:
        return
    needing = {id(t): t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad}
    if not needing or any(t.grad_fn is None for t in needing.values()):
        return
    # The hooks hold the count, never the tensors: a tensor's hooks live in its grad_fn, which the garbage
    # collector cannot see into, so a hook holding its own tensor is a cycle nothing collects (and with it
    # the engine, through post_backward, and every buffer the engine holds).
    count = len(needing)
    left = [None, 0]        # the backward counted in, inputs whose gradient is still to come

    def on_input_grad(grad):
        if left[0] != ended[0]:
            left[0], left[1] = ended[0], count
        left[1] -= 1
        if left[1] == 0 and fired[0] == ended[0]:
            post_backward(module)

    for t in needing.values():
        t.register_hook(on_input_grad)


def _hand_over(engine, group, params, grads, rest=()) -> None:
    """``engine.on_group_grads``; when it fails (an I/O error, the disk full, Ctrl-C) the step's gradients are
    lost and the caller redoes it after ``zero_grad()`` (``opt.step()`` refuses until then): autograd's
    ``.grad`` of the group, and of ``rest`` (groups a flush had still to hand over), would stay, which
    ``zero_grad()`` does not see and the redone step would add in, so it goes."""
    try:
        engine.on_group_grads(group, params, grads)
    except BaseException:
        engine.reducer.faulted = True
        for g in (group, *rest):
            for slot in g.slots:
                slot.param.grad = None
        raise


class _CallEnd(torch.autograd.Function):
    """Passes a call's tensor arguments through; its backward, which autograd runs once this call's part of
    their gradients is complete (the call's own nodes first: they were made later), calls ``over``
    ([Note: handed over at the call's end] in infinity/runtime/grads.py). The outputs are detached aliases, not
    views, so a module may still change an argument in place as without it."""

    @staticmethod
    def forward(ctx, over, *tensors):
        ctx.over = over
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.over()
        return (None, *grads)


class HookHandles:
    """The handles of every hook installed on one model; ``remove()`` undoes all of them."""

    def __init__(self, handles: list[RemovableHandle], forward: dict | None = None) -> None:
        self._handles = handles
        self._forward = forward or {}       # module -> the handles of its forward hooks

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._forward = {}

    def unhook(self, keep) -> int:
        """Remove the forward hooks of every module ``keep(module)`` is false for; returns how many
        modules lost theirs (see [Note: which modules stay hooked])."""
        gone = [m for m in self._forward if not keep(m)]
        for m in gone:
            for h in self._forward.pop(m):
                h.remove()
        return len(gone)

    def hooked(self, module) -> bool:
        """Whether ``module`` has the engine's forward hooks."""
        return module in self._forward

    def __len__(self) -> int:
        return len(self._handles)


def install_hooks(root: nn.Module, lifecycle) -> HookHandles:
    """Install the forward hooks and the state-dict pre-hooks on every module under ``root``.

    Parameters
    ----------
    root:
        The model.
    lifecycle:
        An object with ``pre_forward(module, args)``, ``post_forward(module, output, inputs)``,
        ``before_state_dict(module, prefix, keep_vars)`` and ``coordinator`` (the engine).

    [Note: which modules stay hooked]
    A forward hook costs the module its call's fast path in torch (``_call_impl`` runs
    its hook loop) and the engine a pre- and a post-forward call, each wrapped to stay
    out of ``torch.compile``: about 50 Python calls per module call on the CPU, 9,700 a
    step for GPT 350M's 221 modules, where plain torch's forward makes 2,200. Every
    module is hooked at first: the first step records the trace and watches for
    parameters used by modules that do not own them ([Note: foreign parameters] in
    infinity/runtime/foreign.py), and those are adopted by the innermost running module.
    Once a step follows the recorded trace, only a module with parameter groups (its
    own, its ``partition.units`` block's, or adopted ones) has work: gather before,
    release after, its backward held. So then the engine removes the forward hooks of
    every other module (``unhook_idle``): containers, activations, and the
    norms and projections inside a unit run as in plain torch. What follows: a
    parameter a module starts to use without owning it in a later step (a diverged
    trace, where the watch runs again) is adopted by the innermost *hooked* module
    running, an ancestor; and a module without groups called by itself, outside the
    model's forward, computes with released placeholders and so raises their error
    naming ``infinity.gathered``, as any use of a released parameter outside a forward
    does. Activation offload needs every module's entry (a checkpoint's inputs are named
    there), so with it every module stays hooked; so it does with ``prefetch.enabled =
    false``, where no step follows a trace.
    """
    handles: list[RemovableHandle] = []
    forward: dict = {}
    pre_forward = _EngineHook(lifecycle.pre_forward)    # (module, args, kwargs): may return new ones
    post_forward = _AfterForward(lifecycle.post_forward)
    for module in root.modules():
        forward[module] = [
            module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True),
            # always_call: a forward that raises still releases what its pre-hook acquired; a
            # group left in use would stay gathered and never be refreshed by an optimizer step.
            module.register_forward_hook(post_forward, always_call=True, with_kwargs=True)]
        handles.extend(forward[module])
        handles.append(module.register_state_dict_pre_hook(_EngineHook(
            lambda m, prefix, keep_vars: lifecycle.before_state_dict(m, prefix, keep_vars))))
        handles.append(module.register_load_state_dict_pre_hook(_EngineHook(
            lambda m, state_dict, prefix, metadata, *rest: refuse_assign(lifecycle.coordinator, m, state_dict, prefix,
                                                                        metadata))))
    return HookHandles(handles, forward)


class _EngineHook:
    """A module hook of the engine. Pickling a model (``torch.save(model)``, ``pickle.dumps``, sending it to
    another process) reaches its hooks before any parameter, and a function said only "Can't pickle local
    object"; this says why and what to do instead (a released parameter says the same: its ``.data``)."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    # torch.compile breaks its graph here, as at a disabled function (traced, this frame was compiled again
    # for every module until dynamo's recompile limit).
    @torch.compiler.disable
    def __call__(self, *args):
        inference = _INFERENCE[0] = torch.is_inference_mode_enabled()
        if inference:
            with engine_work():     # [Note: the engine's work under inference mode]
                return self.fn(*args)
        return self.fn(*args)

    @property
    def __name__(self) -> str:
        # torch.jit.script reads every hook's name first, to compile it: say why it cannot, before it fails
        # on something else. Anyone else finds no name, as on any callable object.
        if any(f.f_globals.get("__name__", "").startswith("torch.jit") for f in _frames()):
            raise EngineError(TORCHSCRIPT)
        raise AttributeError("__name__")

    def __reduce_ex__(self, protocol):
        raise EngineError("pickling a model infinity manages (torch.save(model), pickle, copy.deepcopy, sending it "
                          "to another process): its parameters are shards over ranks and tiers, and its hooks hold "
                          "the engine. Save model.state_dict() inside `with infinity.gathered(model):`, or use "
                          "infinity.save_checkpoint")


class _AfterForward(_EngineHook):
    """The engine's post-forward hook: ``post_forward(module, output, (args, kwargs))``, outside inference mode
    when its forward's pre-forward hook found it on."""

    __slots__ = ()

    @torch.compiler.disable
    def __call__(self, module, args, kwargs, output):
        if _INFERENCE[0]:
            with engine_work():
                return self.fn(module, output, (args, kwargs))
        return self.fn(module, output, (args, kwargs))


# Whether the forward under way runs under torch.inference_mode, as its latest pre-forward hook found: its
# post-forward hooks read it (no call of their own).
_INFERENCE = [False]


def engine_work():
    """Where the engine's own work runs when the caller is in ``torch.inference_mode``.

    [Note: the engine's work under inference mode]
    What the engine makes while a forward (or ``infinity.gathered``, a state dict) runs under
    ``torch.inference_mode`` outlives it: gathered groups and their views, placeholders, staging and arenas.
    Made there they are inference tensors, which refuse the in-place writes of every later step ("Inplace
    update to inference tensor outside InferenceMode"; an evaluation before training broke the model for
    good) and ``requires_grad_``. So the engine's hooks and gathers leave inference mode for their own work,
    with gradients kept off, as they are there (leaving it turns them on, and the engine would take the
    evaluation for a training forward). One check a forward's pre-forward hook; ``gathered`` and the state
    dict's walk check once per block and part.
    """
    return _OutsideInference() if torch.is_inference_mode_enabled() else contextlib.nullcontext()


class _OutsideInference:
    __slots__ = ("modes",)

    def __enter__(self):
        self.modes = (torch.inference_mode(False), torch.no_grad())
        for mode in self.modes:
            mode.__enter__()

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


def _frames():
    frame = inspect.currentframe()
    while frame is not None:
        yield frame
        frame = frame.f_back


def refuse_assign(coordinator, module: nn.Module, state_dict: dict, prefix: str, metadata: dict) -> None:
    """``load_state_dict(..., assign=True)`` would put plain tensors in place of parameters the engine
    manages, which it would then neither gather, step nor save: refused before any is replaced (the
    first module of the load checks all of those under it)."""
    if not metadata.get("assign_to_params_buffers"):
        return
    for name, p in module.named_parameters(remove_duplicate=False):
        if prefix + name in state_dict and p in coordinator.group_of:
            raise EngineError(f"load_state_dict(assign=True): {prefix + name!r} is a parameter infinity manages "
                              "(its values are shards over ranks and tiers), which assign would replace by a plain "
                              "tensor it never updates or saves; nothing was loaded. Load without assign inside "
                              "`with infinity.gathered(model):`, or use infinity.load_checkpoint")


def unhook_idle(roots, hooks: list[HookHandles], module_groups: dict) -> None:
    """The trace is followed: drop the forward hooks of the modules under ``roots`` (hooked by ``hooks``,
    in the same order) that have no parameter groups (see [Note: which modules stay hooked])."""
    for root, handles in zip(roots, hooks):
        handles.unhook(lambda m, root=root: m is root or bool(module_groups.get(m)))


def install_released_guard(root: nn.Module) -> HookHandles:
    """Hooks that make a forward or ``state_dict()`` of a released model raise (see [Note: releasing]
    in infinity/runtime/engine.py); they hold no engine, so its buffers can go."""
    def refuse(what):
        raise EngineError(released_message(f"{type(root).__name__}.{what}"))

    handles: list[RemovableHandle] = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(_EngineHook(lambda m, args: refuse("forward()")), prepend=True))
        handles.append(module.register_state_dict_pre_hook(_EngineHook(
            lambda m, prefix, keep_vars: refuse("state_dict()"))))
    return HookHandles(handles)
