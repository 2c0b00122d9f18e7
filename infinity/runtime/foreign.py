"""Parameters a running module uses without owning them, caught during forward.

[Note: foreign parameters]
Some modules compute with a sub-module's parameters without calling that
sub-module (``nn.MultiheadAttention`` uses ``self.out_proj.weight`` directly), or
with a parameter of an unrelated module. While a forward runs, ``ForeignParamWatch``
looks at the arguments of every torch call; a managed parameter that is not gathered
is fetched on the spot and adopted by the running module, so from then on it is
gathered with that module's own parameters (and prefetched along the trace) and is
available during that module's backward.

The watch runs only in steps that do not follow a recorded trace (the first, the one after a
divergence, every step with ``prefetch.enabled = false``): once a step follows the trace, each
module's groups, adopted ones included, were seen and are gathered with the module, and torch
calls cost nothing extra. A module that begins to use another's parameter only in a later step,
along the same trace (a data-dependent branch inside one module), gets the released,
zero-element placeholder: its op raises a shape error rather than computing with a wrong value.

Under ``torch.compile`` the tracer inlines the watch into every graph of such a step. It looks
only at the arguments' types there (a released parameter's class is ``ReleasedParameter``, see
[Note: released placeholders]; a subclass of ``nn.Parameter`` keeps its own, so any class but
``nn.Parameter`` itself counts) and looks the parameter up in a call the tracer does not trace,
a graph break where a foreign parameter may be used. Traced, the map of every managed parameter
became an input and a guard of every graph (a 12-layer GPT's first compiled step took 6.8 s to
compile, 3.2 without).

What the room may touch: nothing but the engine's ``on_foreign_use`` and the
coordinator's parameter -> group map (read only).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from infinity.param_group import ParamState


class ForeignParamWatch(TorchFunctionMode):
    """A torch-function mode, active during forward only (see [Note: foreign parameters]).

    Parameters
    ----------
    group_of:
        The coordinator's map from each managed parameter to its group.
    on_foreign_use:
        Called with the group of a released parameter a torch call received.
    """

    def __init__(self, group_of: dict, on_foreign_use) -> None:
        super().__init__()
        self.group_of = group_of
        self.on_foreign_use = on_foreign_use
        self.active = False
        # The same lookup, as a call torch.compile's tracer does not trace (a graph break): a fetch moves
        # bytes between tiers, and the map of every managed parameter is no input of a graph. Wrapped
        # here, not at import: torch.compiler.disable imports torch._dynamo, which infinity/runtime/hooks.py
        # imports first on purpose (see [Note: torch._dynamo and the default process group]).
        self._fetch_outside_the_graph = torch.compiler.disable(self._fetch_released)

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
        if not torch.compiler.is_compiling():
            self._fetch_released(args, kwargs)
        elif any(type(a) is not nn.Parameter for a in _param_args(args, kwargs)):
            self._fetch_outside_the_graph(args, kwargs)
        return func(*args, **kwargs)

    def _fetch_released(self, args, kwargs) -> None:
        for a in _param_args(args, kwargs):
            group = self.group_of.get(a)
            if group is not None and group.state is ParamState.NOT_AVAILABLE:
                self.on_foreign_use(group)


def _param_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, nn.Parameter):
                    yield b
