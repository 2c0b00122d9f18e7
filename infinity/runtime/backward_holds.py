"""What a backward holds gathered, and when a module's backward is over for the groups no gradient frees.

[Note: a module's backward is over]
A group with trainable parameters is released in backward when its gradients arrive
(infinity/runtime/grads.py): autograd stores a parameter's gradient once every node that
reads the parameter has run. A frozen group has no such moment. It was gathered at its
module's pre-backward and held to the end of the backward, so a model trained in part
(LoRA or other adapters, BitFit, a frozen trunk: every frozen weight in a group of its own,
see [Note: frozen inside a group] in infinity/runtime/construction.py) had every frozen
group gathered at once by the end of its backward: the whole model on the compute device,
where the same model trained whole holds a group or two. GPT 20M, BitFit: 8 of 15 groups
(64.5 of 64.7 MiB) held at the peak, against 2 groups (30.8 MiB) trained whole.

A call of a module is over, in a backward that reached its output, when
(a) the gradient of every tensor among its arguments (positional and keyword) that
    requires one is complete: a hook on each, which autograd runs just before the node
    that made the argument, once every node adding to its gradient has run; and
(b) no group under the module (its own, its unit's, adopted ones, its submodules') still
    waits for gradients of this backward (``GradArrivals.armed``).
Every node of the call was made after its arguments, and autograd runs a device's nodes
latest-made first, each only once the nodes it takes gradients from have run; so when an
argument's producer is next, no node of the call is left to read the weight. (b) covers
nodes whose gradient only reaches a parameter. Then the call's frozen groups are
released, unless another call still holds them in this backward: a count per group, which
matters where one call runs inside another (a module reading a weight, then calling one
that reads it too). A call with a leaf among its arguments that requires a gradient (a
hook on it would outlive the call), or none that does, is not watched, and its groups
stay held to the end of the backward, as do groups whose call's arguments never get a
whole gradient (an argument the output does not depend on).

The assumption, the one FSDP2 makes for its post-backward: the call's nodes run on the
device thread its arguments' producers run on (a model spread over several devices, whose
backward runs on several threads, may break it). Groups with trainable parameters keep
their own release (their gradients), those a frozen parameter shares after
``requires_grad_(False)`` outside ``Init`` included. Measured: docs/benchmarks/frozen.md
("Held during backward").
"""
from __future__ import annotations

from collections import defaultdict

from torch import nn

from infinity.param_group import ParamGroup


class BackwardHolds:
    """Counts the calls holding each group in this backward and releases frozen groups when the last one
    is over (see [Note: a module's backward is over]).

    Parameters
    ----------
    coordinator:
        The engine's coordinator (``module_groups``, ``group_of``, ``backward_done``).
    armed:
        The groups still waiting for gradients in this backward (``GradArrivals.armed``, read live).
    """

    def __init__(self, coordinator, armed: dict) -> None:
        self.coordinator = coordinator
        self.armed = armed
        self.count: defaultdict[ParamGroup, int] = defaultdict(int)
        self.waiting: dict[ParamGroup, list[nn.Module]] = {}    # a group under a module -> calls over once it arrives

    def watcher(self, module: nn.Module):
        """``self.over`` when ``module`` has a frozen group whose release it decides; else None (not watched)."""
        # ``not g.has_trainable`` spelled out: this runs at every hooked module's call, where the property,
        # any() and a generator per group cost 1,600 Python calls a step (benchmarks/host_overhead.py).
        for g in self.coordinator.module_groups.get(module, ()):
            for slot in g.slots:
                if slot.param.requires_grad:
                    break
            else:
                return self.over
        return None

    def held(self, module: nn.Module) -> None:
        """A call of ``module`` begins its backward (its groups were gathered for it)."""
        count = self.count
        for g in self.coordinator.module_groups.get(module, ()):
            count[g] += 1

    def over(self, module: nn.Module) -> None:
        """Every argument's gradient of a call of ``module`` is complete: (a) of the note."""
        armed = self.armed
        if armed:
            for g in _under(self.coordinator, module):
                if g in armed:
                    self.waiting.setdefault(g, []).append(module)
                    return
        count = self.count
        for g in self.coordinator.module_groups.get(module, ()):
            count[g] -= 1
            if count[g] > 0:
                continue
            del count[g]
            if not g.has_trainable:
                self.coordinator.backward_done(g)

    def arrived(self, group: ParamGroup) -> None:
        """``group``'s gradients arrived: the calls that waited for it are checked again."""
        for module in self.waiting.pop(group, ()):
            self.over(module)

    def clear(self) -> None:
        """The backward ended (everything it held is released with it)."""
        self.count.clear()
        self.waiting.clear()


def _under(coordinator, module: nn.Module):
    """The groups a call of ``module`` reads: its own, its unit's and adopted ones, and its submodules'."""
    yield from coordinator.module_groups.get(module, ())
    group_of = coordinator.group_of
    for p in module.parameters():
        g = group_of.get(p)
        if g is not None:
            yield g
