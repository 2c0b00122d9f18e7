"""``infinity.Init``: build a model that never exists whole.

[Note: intercepting construction]
While the context is open, every ``nn.Module`` subclass's ``__init__`` is wrapped
(classes defined inside the context too, through ``__init_subclass__``). When the
outermost ``__init__`` of an instance returns, that module's parameters are
partitioned at once: flattened per module, broadcast from rank 0 so every rank
agrees, sharded, stored in the tiers, and the full tensors freed. Peak memory
during construction is about one module. Every wrapper is removed on exit,
exactly, also when construction raises.

[Note: a wrapper someone wrapped again]
A class may have its ``__init__`` replaced by someone else while the context is open:
transformers imports a model's module lazily, at first use, so ``class
LlamaAttention`` can be defined inside the context, wrapped here by
``__init_subclass__``, and then decorated by the ``kernels`` package
(``use_kernelized_func``), whose new ``__init__`` calls ours. Putting the original
back on exit would throw that decorator's ``__init__`` away with ours, and every
instance built later would lack what it sets (``_kernel_funcs``). So a wrapper is
removed only while the class still holds it; one that another ``__init__`` calls
stays in that chain but goes inert: each wrapper asks a gate for its ``Init``'s builder, and the
gate forgets it on exit, so the wrapper only calls the original and keeps neither the
context nor its engine alive.

[Note: edits after partitioning]
Model code often touches parameters after their module was built: a parent's
``self.apply(self._init_weights)``, ``nn.init.normal_(p)`` over
``named_parameters()``, ``p.data.zero_()``. A ``TorchFunctionMode`` active inside
the context sees any torch call whose arguments include a partitioned parameter,
gathers that parameter's group in fp32 (exactly, from the master shards) before the
call, and keeps it materialized; the least recently touched groups are re-sharded
(rank 0's values win) when more than a few are open, and all of them at exit. So
such code works unchanged and yields the same weights as without ``Init``.

While the context is open, transformers' ``PreTrainedModel.from_pretrained`` is routed to
the streaming loader of infinity/runtime/pretrained.py ([Note: loading a pretrained model]),
and put back on exit with the ``__init__`` wrappers.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from infinity import registry
from infinity.config import Config, load_config
from infinity.plan.placement import resolve_at_init
from infinity.runtime.construction import Partitioner
from infinity.runtime.engine import Engine
from infinity.runtime.pretrained import FromPretrainedRoute, is_pretrained_base
from infinity.tiling.policy import apply_tiling
from infinity.tiling.widened import apply_cpu_linear

_MAX_OPEN_GROUPS = 4


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


class _TouchMode(TorchFunctionMode):
    """Hands the parameters each torch call receives to ``touched`` (see [Note: edits after partitioning])."""

    def __init__(self, touched: Callable[[list[nn.Parameter]], None]) -> None:
        super().__init__()
        self.touched = touched

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        params = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, nn.Parameter)]
        if params:
            self.touched(params)
        return func(*args, **kwargs)


class _Gate:
    """What the ``__init__`` wrappers call: the open ``Init``'s builder, or None once it has exited
    (see [Note: a wrapper someone wrapped again])."""

    __slots__ = ("build",)

    def __init__(self, build: Callable) -> None:
        self.build = build


class Init:
    """Context manager under which models are built sharded over ranks and tiers.

    Parameters
    ----------
    config:
        A path to a TOML/JSON config, a preset name (``"nvme"``, ``"offload-host"``, ...), a dict, a
        loaded ``Config``, or None for defaults.
    nvme_path:
        The directory (or directories) for the NVMe tier's swap files, ``tiers.nvme_path``, given
        where the config is chosen: ``Init("nvme", nvme_path="/mnt/nvme")``. It replaces the
        config's own value (the ``nvme`` preset's is a placeholder). See ``infinity.load_config``.
    group:
        A ``torch.distributed`` process group; None uses the default group when one is
        initialized (torchrun), else runs as a single rank.
    resume:
        A checkpoint saved with ``save_checkpoint(..., in_place=True)``: the model built takes over its
        sealed swap files instead of writing initial values (see [Note: checkpoints in place] in
        infinity/checkpoint/in_place.py); call ``infinity.load_checkpoint(resume, model, opt)`` next. "auto"
        tiers take the tiers the save ran (every state on NVMe), without searching.
    model:
        With ``tiers.params`` or ``tiers.optimizer`` "auto" (the ``auto`` preset): the model the placement
        is sized for, before it exists: a parameter count (``7e9``), a ``"package.module:callable"`` or a
        module built on the meta device. ``Init.placement`` then holds the decision ([Note: auto
        placement] in infinity/plan/placement.py); on several ranks, rank 0's pair is the one every rank runs.
    machine:
        With "auto": the machine profile to place for (``infinity.plan.machine.MachineProfile`` or a file);
        None probes this machine once and caches its rates.

    Examples
    --------
    >>> import torch, infinity
    >>> with infinity.Init({"tiers": {"params": "host"}}):
    ...     model = torch.nn.Linear(4, 3)
    >>> model.weight.shape          # released: only shards exist until a forward gathers them
    torch.Size([3, 4])
    >>> model.weight.sum()          # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    infinity.errors.EngineError: Tensor.sum on parameter 'weight': it is released ...
    >>> with infinity.gathered(model):
    ...     float(model.weight.sum()) == float(model.weight.detach().sum())
    True
    """

    def __init__(self, config: str | dict | Config | None = None, *, nvme_path=None, group=None,
                 resume=None, model=None, machine=None) -> None:
        config = load_config(config, nvme_path=nvme_path)
        self.resume = None
        if resume is not None:
            from infinity.checkpoint.in_place import Resume

            self.resume = Resume(resume)
            config = self.resume.resolve_auto(config)   # "auto" resumes a checkpoint in place as it was saved
        self.config, self.placement = resolve_at_init(config, model, machine, group)
        self.group = group
        self.engine: Engine | None = None
        self.partitioner: Partitioner | None = None
        self._patched: list[tuple[type, object, object]] = []     # (class, its __init__, our wrapper)
        self._gate = _Gate(self._build)
        self._routes: list[FromPretrainedRoute] = []
        self._outside = False
        self._had_init_subclass = False
        self._old_init_subclass = None
        self._depth: dict[int, int] = {}
        self._building: list[nn.Module] = []     # modules whose outermost __init__ is running, outermost first
        self._built: list[nn.Module] = []
        self._children: set[int] = set()
        self._open_groups: OrderedDict = OrderedDict()
        self._suspended = False
        self._mode: _TouchMode | None = None

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if getattr(nn.Module.__init__, "infinity_init", False) or any(
                getattr(c.__dict__.get("__init__"), "infinity_init", False) for c in (nn.Linear,)):
            raise RuntimeError("infinity.Init is already active; nested Init contexts are not supported")
        self.engine = Engine(self.config, self.group, resume=self.resume)
        self.engine.placement = self.placement
        try:
            self.partitioner = Partitioner(self.engine)
            self._gate = _Gate(self._build)     # one per entry: an exited context's wrappers keep theirs, emptied
            for cls in _all_subclasses(nn.Module):
                self._wrap(cls)
            self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
            self._old_init_subclass = nn.Module.__dict__.get("__init_subclass__")
            wrap = self._wrap
            old = self._old_init_subclass

            def __init_subclass__(cls, **kwargs):
                if old is not None:
                    old.__get__(None, cls)(**kwargs)
                else:
                    super(nn.Module, cls).__init_subclass__(**kwargs)
                wrap(cls)

            nn.Module.__init_subclass__ = classmethod(__init_subclass__)
            self._mode = _TouchMode(self._touched)
            self._mode.__enter__()
        except BaseException:
            self._restore()
            self._abandon()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc, tb)
                self._mode = None
        finally:
            self._restore()
        if exc_type is not None:
            self._abandon()
            return False
        try:
            with self.suspended():
                self._close_all()
                roots = self._roots()
                if not roots:
                    raise RuntimeError("infinity.Init: no module with parameters was built inside the context")
                apply_tiling(self.partitioner, roots)   # [Note: when layers are tiled] in infinity/tiling/layers.py
                # [Note: widened linear layers] in infinity/tiling/widened.py
                apply_cpu_linear(self.engine.config.precision.cpu_linear, self.engine.device.device,
                                 self.engine.dtype, roots)
                self.partitioner.close_groups(roots)
                # Each rank's own work from here (the budget, the store, its tier writes; a resume's adoption): a
                # node short of room fails alone, and the others would go on to the optimizer's first collective.
                with self.engine.ranks.together("infinity.Init's exit"):    # [Note: failing together]
                    self.engine.finalize(roots, self.partitioner.finish(roots))
        except BaseException:
            self._abandon()
            raise
        for root in roots:
            for m in root.modules():
                registry.register(m, self.engine)
        return False

    def _abandon(self) -> None:
        """The body (or building the engine) raised: give back all the context took.

        [Note: an Init that fails]
        Without this, swap files, the swap directory's lock, the I/O threads and the pinned
        buffers stayed with an engine nobody could reach, and a retry in the same process was
        refused ("locked by this process"). The engine's tiers are closed now (files deleted,
        lock released, threads stopped) and every reference this context holds to the engine
        and to the modules built is dropped, so the host memory goes back once the caller lets
        go of the exception. Modules built in the failed body are not usable: build them again.
        """
        engine, self.engine, self.partitioner = self.engine, None, None
        self._built.clear()
        self._children.clear()
        self._open_groups.clear()
        self._depth.clear()
        self._building.clear()
        if engine is not None:
            engine.release()

    def _restore(self) -> None:
        for route in reversed(self._routes):
            route.remove()
        self._routes.clear()
        self._gate.build = None
        for cls, orig, wrapper in reversed(self._patched):
            if cls.__dict__.get("__init__") is wrapper:
                cls.__init__ = orig
            # else: another __init__ calls ours now; it stays, inert ([Note: a wrapper someone wrapped again])
        self._patched.clear()
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._old_init_subclass
        elif "__init_subclass__" in nn.Module.__dict__:
            del nn.Module.__init_subclass__

    # -- interception ----------------------------------------------------------------------------
    def _wrap(self, cls: type) -> None:
        if is_pretrained_base(cls) and not any(r.base is cls for r in self._routes):
            self._routes.append(FromPretrainedRoute(self, cls))
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "infinity_init", False):
            return

        gate = self._gate

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            build = gate.build
            if build is None:
                return orig(module, *args, **kwargs)
            build(orig, module, args, kwargs)

        __init__.infinity_init = True   # marks the wrapper, so it is never wrapped twice
        cls.__init__ = __init__
        self._patched.append((cls, orig, __init__))

    def _build(self, orig, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Runs ``orig`` (a class's own ``__init__``) on ``module``; the outermost call partitions it."""
        if self._outside:
            orig(module, *args, **kwargs)
            return
        key = id(module)
        depth = self._depth.get(key, 0)
        self._depth[key] = depth + 1
        if depth == 0:
            self._building.append(module)
        try:
            orig(module, *args, **kwargs)
        finally:
            if depth:
                self._depth[key] = depth
            else:
                self._depth.pop(key, None)
                self._building.pop()
        if depth == 0:
            self._on_built(module)

    def _on_built(self, module: nn.Module) -> None:
        with self.suspended():
            for child in module.children():
                self._children.add(id(child))
            self._built.append(module)
            units = self.partitioner.units
            if units.within(self._building):
                return      # partitioned with the unit being built around it (partition.units)
            self.partitioner.partition_module(module, unit=units.is_unit(module, self._building))

    def _roots(self) -> list[nn.Module]:
        roots, seen = [], set()
        for m in self._built:
            if id(m) in self._children or id(m) in seen:
                continue
            if any(True for _ in m.parameters()):
                roots.append(m)
                seen.add(id(m))
        # A module built here may have become a child after its parent was built
        # (assigned later): keep only modules that are nobody's descendant.
        inner = {id(d) for r in roots for d in r.modules() if d is not r}
        return [r for r in roots if id(r) not in inner]

    @contextmanager
    def building_outside(self):
        """Modules built in this block are ordinary ones, not the engine's (a loader's meta-device twin)."""
        prev, self._outside = self._outside, True
        try:
            yield
        finally:
            self._outside = prev

    def settle(self) -> None:
        """Re-shard the groups construction code has open, so their shards are final (before a load)."""
        with self.suspended():
            self._close_all()

    @contextmanager
    def suspended(self):
        """Engine-internal torch calls run without the touch mode's interception."""
        prev, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = prev

    def _touched(self, params: list[nn.Parameter]) -> None:
        """Construction code is about to use ``params``: gather the partitioned ones."""
        if self._suspended:
            return
        group_of = self.engine.coordinator.group_of
        for p in params:
            group = group_of.get(p)
            if group is not None:
                self._open(group)

    def _open(self, group) -> None:
        if group in self._open_groups:
            self._open_groups.move_to_end(group)
            return
        with self.suspended():
            self.partitioner.materialize(group)
            self._open_groups[group] = True
            while len(self._open_groups) > _MAX_OPEN_GROUPS:
                old, _ = self._open_groups.popitem(last=False)
                self.partitioner.dematerialize(old)

    def _close_all(self) -> None:
        while self._open_groups:
            group, _ = self._open_groups.popitem(last=False)
            self.partitioner.dematerialize(group)


def from_pretrained(model_class, path, infinity_config=None, *, nvme_path=None, group=None, machine=None,
                    **kwargs):
    """Load a Hugging Face model from a safetensors checkpoint straight into the engine's tiers.

    The same as ``with infinity.Init(infinity_config): model = model_class.from_pretrained(path, **kwargs)``:
    the checkpoint is streamed group by group into the tiers (see [Note: loading a pretrained
    model] in infinity/runtime/pretrained.py); the whole model never exists in host memory.

    Parameters
    ----------
    model_class:
        A transformers model class (``LlamaForCausalLM``) or auto class (``AutoModelForCausalLM``).
    path:
        A local checkpoint directory, or a Hub model id.
    infinity_config:
        What ``infinity.Init`` takes: a path to a TOML/JSON config, a preset name, a dict, a ``Config``
        or None.
    nvme_path:
        The NVMe tier's directory, as for ``infinity.Init``.
    group:
        The ``torch.distributed`` process group, as for ``infinity.Init``.
    machine:
        With "auto" tiers, the machine profile to place for, as for ``infinity.Init``; the placement is sized
        for the model the checkpoint's config describes (built on the meta device first).
    **kwargs:
        Passed to ``from_pretrained`` (``config=``, ``revision=``, config attribute overrides, ...).

    Examples
    --------
    >>> import infinity, transformers
    >>> model = infinity.from_pretrained(transformers.AutoModelForCausalLM, "ckpt/",   # doctest: +SKIP
    ...                                  "nvme", nvme_path="/mnt/nvme")
    """
    import transformers  # noqa: F401  (imported before Init opens, so Init routes its from_pretrained)

    config = load_config(infinity_config, nvme_path=nvme_path)
    sized = None
    if "auto" in (config.tiers.params, config.tiers.optimizer):     # [Note: auto placement]: sized for this model
        sized = _on_meta(model_class, path, kwargs)
    with Init(config, group=group, model=sized, machine=machine):
        model = model_class.from_pretrained(path, **kwargs)
    return model


def _on_meta(model_class, path, kwargs):
    """The model ``model_class.from_pretrained(path, **kwargs)`` builds, on the meta device (no memory)."""
    import torch
    import transformers

    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        hub = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token", "cache_dir", "subfolder") if k in kwargs}
        config = transformers.AutoConfig.from_pretrained(config or path, **hub)
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):     # an auto class
            return model_class.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False))
        return model_class(config)
