"""What records a traced step: wrappers put on the engine's parts for the trace's duration, and taken off.

What the room holds: ``Probes``, which ``infinity.trace`` installs on entry and removes on exit, and
``TimedFuture``, the face an NVMe transfer shows while it is traced. What it may touch: the engine's
public parts (its data path, coordinator, shards, state store, optimizer and the model's modules); it
changes no state of theirs and decides nothing.

[Note: probes, not hooks]
A trace must cost nothing when it is off: no flag tested per copy, no timestamp taken. So the engine has
no trace hooks. ``Probes`` puts a wrapper over each method it times as an attribute of that one object
(the data path's ``upload``, ``read``, ``host_wait``, the coordinator's ``wait_available``, the state
store's ``sub_groups``, the engine's ``pre_backward`` and ``on_group_grads``) and adds forward hooks to
the modules that own parameter groups, plus a step hook pair on the optimizer; ``remove`` deletes exactly
what it added, so after the trace every call finds the class's own method again. The engine's callers
look these methods up on the object at each call, which is what lets an attribute stand in; a wrapper
the engine captured during the trace (a backward hook made by a traced forward) goes on delegating,
untimed, once the trace is over.

What each wrapper times:
- ``compute``: a module's forward, from after its engine pre-hook (its groups gathered) to before its
  engine post-hook (their release); a group's backward, from the end of its module's ``pre_backward``
  (its groups gathered for backward) to the moment autograd hands its gradients over.
- ``copies``: a group's gather (``wait_available``: the wait for its shard, the host->device copy, the
  all-gather), its release, and every host<->device copy and non-NVMe tier transfer the data path issues
  (how long issuing took; on a GPU the copy itself runs on its stream later).
- ``nvme read`` / ``nvme write``: each request from its submission to the first moment the engine sees
  it done: its ``wait()`` returns, or a ``done()`` answers True, or a poll of the requests in flight
  finds it complete (made at each traced event, and every ``POLL_S`` by a thread of the trace's own:
  ``done()`` only asks, it reaps nothing). So an end is at most a fraction of a millisecond late.
- ``update``: each sub-group's update, from the moment the state store hands it over (its reads done)
  to the moment the update asks for the next one; and ``opt.step()`` itself.
- ``host waits``: every ``wait()`` of an NVMe transfer, ``DataPath.host_wait`` / ``scalar`` / ``values``,
  and a fetch waiting for the overlapped update to rewrite a shard.
"""
from __future__ import annotations

import functools
import threading

from infinity.param_group import ParamState
from infinity.timeline.record import Timeline

# How often a thread of the trace looks for NVMe requests that completed (see [Note: probes, not hooks]).
POLL_S = 0.0002


class TimedFuture:
    """An NVMe transfer's future seen by the trace: ``wait`` and ``done`` end its span; everything else is
    the future's own."""

    __slots__ = ("future", "probes", "request")

    def __init__(self, future, probes: "Probes", request: list) -> None:
        self.future, self.probes, self.request = future, probes, request

    def wait(self):
        if not self.probes.live:
            return self.future.wait()
        t0 = self.probes.timeline.now()
        try:
            return self.future.wait()
        finally:
            t1 = self.probes.timeline.now()
            self.probes.timeline.span("host waits", f"wait {self.request[1]}", t0, t1, {"nbytes": self.request[3]})
            self.probes.complete(self.request, t1)

    def done(self) -> bool:
        finished = self.future.done()
        if finished and self.probes.live:
            self.probes.complete(self.request, self.probes.timeline.now())
        return finished

    def __getattr__(self, name: str):
        return getattr(self.future, name)


class Probes:
    """The wrappers and hooks of one trace over one engine (see [Note: probes, not hooks]).

    Parameters
    ----------
    engine:
        The engine of the traced model.
    timeline:
        Where the spans go.
    """

    def __init__(self, engine, timeline: Timeline) -> None:
        self.engine, self.timeline = engine, timeline
        self.live = False
        self.inflight: list[list] = []      # [kind, label, start_us, nbytes, future, ended]
        self.labels: dict = {}              # NVMe key -> what it holds
        self.names: dict = {}               # module -> its groups' names
        self.backward_start: dict = {}      # group -> when its module's backward first began
        self.forward_start: dict = {}       # module -> starts of its running forwards
        self.lock = threading.Lock()        # the update may run on a thread of its own
        self._undo: list = []
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_until_stopped, name="infinity-trace-poll", daemon=True)

    # -- installing ----------------------------------------------------------------------------
    def install(self) -> None:
        engine = self.engine
        for root in engine.roots:
            for qualified, module in root.named_modules():
                groups = engine.coordinator.module_groups.get(module, ())
                if groups and module not in self.names:
                    self.names[module] = ", ".join(g.name for g in groups) or qualified or type(module).__name__
                    self._undo.append(module.register_forward_pre_hook(self._forward_begins).remove)
                    self._undo.append(module.register_forward_hook(self._forward_ends, prepend=True,
                                                                   always_call=True).remove)
        datapath, coordinator = engine.datapath, engine.coordinator
        self._wrap(datapath, "upload", self._copy("host->device"))
        self._wrap(datapath, "download", self._copy("device->host"))
        self._wrap(datapath, "read", self._tier("read"))
        self._wrap(datapath, "write", self._tier("write"))
        self._wrap(datapath, "host_wait", self._waiting(lambda event: f"wait device ({datapath.phase})"))
        self._wrap(datapath, "scalar", self._waiting(lambda tensor: "read back a device scalar"))
        self._wrap(datapath, "values", self._waiting(lambda tensor: "read back device values"))
        self._wrap(coordinator, "wait_available", self._gather)
        self._wrap(coordinator, "release", self._release_of(lambda module: coordinator.module_groups.get(module, ())))
        self._wrap(coordinator, "backward_done", self._release_of(lambda group, keep_views=False: (group,)))
        self._wrap(coordinator.shards, "wait_update", self._waiting(lambda group: f"wait update of {group.name}"))
        self._wrap(engine, "pre_backward", self._backward_begins)
        self._wrap(engine, "on_group_grads", self._backward_ends)
        if engine.store is not None:
            self._wrap(engine.store, "sub_groups", self._sub_groups)
        if engine.optimizer is not None:
            step = {}
            self._undo.append(engine.optimizer.register_step_pre_hook(
                lambda *_: step.__setitem__("t0", self.timeline.now())).remove)
            self._undo.append(engine.optimizer.register_step_post_hook(
                lambda *_: self.live and "t0" in step and self.timeline.span(
                    "update", "opt.step()", step.pop("t0"), self.timeline.now())).remove)
        self.live = True
        self._poller.start()

    def remove(self) -> None:
        """Take off everything ``install`` put on, in reverse order."""
        self.live = False
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()
        self.inflight = []
        self.engine = None      # a future or a graph made in the trace may outlive it: it keeps no engine alive

    def _wrap(self, obj, name: str, make) -> None:
        original = getattr(obj, name)
        mine = vars(obj)
        had = name in mine
        previous = mine.get(name)
        setattr(obj, name, functools.update_wrapper(make(original), original))

        def undo():
            if had:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)
        self._undo.append(undo)

    # -- NVMe requests in flight ---------------------------------------------------------------
    def complete(self, request: list, at_us: float) -> None:
        with self.lock:
            if request[5]:
                return
            request[5] = True
        self.timeline.span(request[0], request[1], request[2], at_us, {"nbytes": request[3]})

    def poll(self) -> float:
        """Now, after ending the span of every NVMe request found done (see [Note: probes, not hooks])."""
        now = self.timeline.now()
        if self.inflight:
            with self.lock:
                pending = list(self.inflight)
            for request in pending:
                if not request[5] and request[4].done():
                    self.complete(request, now)
            with self.lock:
                self.inflight = [r for r in self.inflight if not r[5]]
        return now

    def _poll_until_stopped(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def label(self, key) -> str:
        if key not in self.labels:
            engine = self.engine
            for g in engine.coordinator.groups:
                self.labels[g.param_key] = f"param {g.name}"
            if engine.store is not None:
                for state, keys in engine.store.keys.items():
                    for sub, k in enumerate(keys):     # keys are unique per tier: the NVMe tier's only
                        if engine.store.sub_tiers[sub].kind == "nvme":
                            self.labels.setdefault(k, f"{state} sub {sub}")
            self.labels.setdefault(key, f"key {key}")     # looked for once: an activation's, a spare copy's
        return self.labels[key]

    # -- the wrappers --------------------------------------------------------------------------
    def _copy(self, what: str):
        def bind(original):
            def copy(dst, src, *rest, **kwargs):
                if not self.live:
                    return original(dst, src, *rest, **kwargs)
                t0 = self.poll()
                try:
                    return original(dst, src, *rest, **kwargs)
                finally:
                    nbytes = src.numel() * src.element_size()
                    self.timeline.span("copies", f"{what} {nbytes} B", t0, self.timeline.now(), {"nbytes": nbytes})
            return copy
        return bind

    def _tier(self, verb: str):
        def bind(original):
            def transfer(tier, key, tensor, *where, **named):
                if not self.live:
                    return original(tier, key, tensor, *where, **named)
                t0 = self.poll()
                nbytes = tensor.numel() * tensor.element_size()
                if tier.kind != "nvme":
                    try:
                        return original(tier, key, tensor, *where, **named)
                    finally:
                        self.timeline.span("copies", f"{tier.kind} tier {verb} {self.label(key)}", t0,
                                           self.timeline.now(), {"nbytes": nbytes})
                future = original(tier, key, tensor, *where, **named)
                request = [f"nvme {verb}", f"{verb} {self.label(key)}", t0, nbytes, future, False]
                with self.lock:
                    self.inflight.append(request)
                return TimedFuture(future, self, request)
            return transfer
        return bind

    def _waiting(self, name_of):
        def bind(original):
            def wait(*args, **kwargs):
                if not self.live:
                    return original(*args, **kwargs)
                t0 = self.poll()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.timeline.span("host waits", name_of(*args, **kwargs), t0, self.timeline.now())
            return wait
        return bind

    def _gather(self, original):
        def wait_available(group):
            if not self.live or group.state is ParamState.AVAILABLE:
                return original(group)
            t0 = self.poll()
            try:
                return original(group)
            finally:
                self.timeline.span("copies", f"gather {group.name}", t0, self.poll(), {"nbytes": group.full_nbytes})
        return wait_available

    def _release_of(self, groups_of):
        def bind(original):
            def release(*args, **kwargs):
                if not self.live:
                    return original(*args, **kwargs)
                gathered = [g for g in groups_of(*args, **kwargs) if g.state is ParamState.AVAILABLE]
                t0 = self.poll()
                try:
                    return original(*args, **kwargs)
                finally:
                    gone = [g.name for g in gathered if g.state is not ParamState.AVAILABLE]
                    if gone:
                        self.timeline.span("copies", f"release {', '.join(gone)}", t0, self.timeline.now())
            return release
        return bind

    def _forward_begins(self, module, args) -> None:
        if self.live:
            self.forward_start.setdefault(module, []).append(self.poll())

    def _forward_ends(self, module, args, output) -> None:
        starts = self.forward_start.get(module)
        if self.live and starts:
            self.timeline.span("compute", f"forward {self.names[module]}", starts.pop(), self.poll())

    def _backward_begins(self, original):
        def pre_backward(module):
            original(module)
            if self.live and module is not None:
                now = self.poll()
                for g in self.engine.coordinator.module_groups.get(module, ()):
                    self.backward_start.setdefault(g, now)
        return pre_backward

    def _backward_ends(self, original):
        def on_group_grads(group, params, grads):
            if self.live:
                start = self.backward_start.pop(group, None)
                if start is not None:
                    self.timeline.span("compute", f"backward {group.name}", start, self.poll())
            return original(group, params, grads)
        return on_group_grads

    def _sub_groups(self, original):
        def sub_groups(*args, **kwargs):
            passes = original(*args, **kwargs)
            return self._timed_passes(passes) if self.live else passes
        return sub_groups

    def _timed_passes(self, passes):
        try:
            for item in passes:
                t0 = self.poll()
                try:
                    yield item
                finally:
                    if self.live:
                        self.timeline.span("update", f"update sub {item[0]}", t0, self.poll())
        finally:
            passes.close()
