"""What an engine parameter is while its group is released: a placeholder that refuses to be read.

[Note: released placeholders]
A released parameter's values are shards over ranks and tiers; the ``nn.Parameter``
itself holds an empty ``(0,)`` tensor. Read as a tensor (``p.sum()``, ``p.tolist()``,
``p.detach()``, ``p.clone()``, ``p.data``, ``torch.save(p)``, ``copy.deepcopy``) it would
give an empty result without a word, and an in-place write to it would be lost. So
while released, a parameter's class is :class:`ReleasedParameter` (a subclass of
``nn.Parameter``: ``isinstance`` checks still hold), whose ``__torch_function__``
answers what describes the parameter, and refuses the rest with an ``EngineError``
naming the parameter and ``infinity.gathered``:

- answered as on the plain model, from the group's layout: ``shape``, ``size()``,
  ``dim()``, ``ndim``, ``numel()``, ``nelement()``, ``len()``;
- answered by the placeholder, which has them right: ``dtype``, ``device``,
  ``requires_grad`` (and ``requires_grad_``), ``grad`` (get, set, delete: the gradient
  tokens of infinity/optim/grad_face.py live there), ``is_leaf``, ``grad_fn``,
  ``layout``, ``element_size()``, ``is_floating_point()`` and friends;
- ``.to()`` / ``.cuda()`` / ``.float()`` ... pass when they change nothing (``model.to(
  device)``, as Trainer and accelerate call it), and are refused otherwise: the config's
  ``[precision]`` and ``[tiers]`` decide where and in which dtype parameters live;
- everything else is refused; a torch tool that reparametrizes (prune, weight_norm) and had already moved
  the parameter when its first read was refused finds it put back (``_put_back``): a refusal loses nothing.
  Nor does a refused conversion: ``Module._apply`` converts each module's children before its own
  tensors, so ``model.half()`` had rounded the buffers of parameter-free modules built before the first
  parameter (a positional-encoding table, say) when that parameter refused; they are put back
  (``_restore_buffers``, from the tensors ``parameter_free_buffers`` kept at construction).

Why a class swap rather than a check on every op: the group's transitions swap the
class (``ParamGroup.to_available`` back to ``nn.Parameter``, ``ParamGroup.drop_views`` to
this one), a Python attribute store per parameter per fetch, next to the ``.data``
store that is there anyway. A gathered parameter is a plain ``nn.Parameter``, whose
``__torch_function__`` is torch's disabled one, so the forward and backward ops pay
nothing; only torch calls on a released parameter come through here. (A global
torch-function mode would cost every op of every step.) The torch-function modes the
engine runs (infinity.Init's construction mode, the foreign-parameter watch) come
before a subclass in torch's dispatch, so they still gather a released parameter a
call receives before this class sees the call.

A parameter of a subclass of ``nn.Parameter`` becomes an instance of a class made
for it once, a subclass of both ``ReleasedParameter`` and its own class
(``released_class``), so ``isinstance`` checks against its own class hold too; a
subclass with a ``__torch_function__`` of its own (a tensor subclass with its own
dispatch, which a second handler would fight) keeps its class and the silent
placeholder. Not caught either: ``Tensor`` methods reached without torch's dispatch
(the C++ of custom extensions) see the ``(0,)`` tensor; while ``torch.compile`` traces
a frame every call passes (its tracer makes a fake of every tensor the frame reaches,
and must see the tensor as it is).

[Note: released joins]
A tiled layer's ``weight`` (and ``bias``) is the concatenation of its tiles' parameters,
made at each access (see [Note: the tiled weight] in infinity/tiling/weight.py). While a
tile is released there is nothing to concatenate, and the join is a ``ReleasedJoin``: a
released placeholder of the untiled shape, dtype and device, refusing reads as a
released parameter does (the message names the untiled name, ``head.weight``). What the
plain layer's parameter would do to the model does it to the tiles: setting
``requires_grad`` (or ``requires_grad_``) freezes or unfreezes every tile. ``.grad``
refuses: the gradients are the tiles' (``layer.tiles[i].weight.grad``).

What the room may touch: the registry (which engine holds a parameter, for its name);
the parameters a join is made of; nothing else of the engine.
"""
from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import nn

from infinity.errors import EngineError, foreign_optimizer_message

_T = torch.Tensor
_GRAD, _REQUIRES_GRAD = torch._C.TensorBase.grad, torch._C.TensorBase.requires_grad
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
# Attributes the placeholder itself answers right (the name of a getset descriptor).
_DESCRIBING_ATTRIBUTES = frozenset({
    "dtype", "device", "requires_grad", "grad", "is_leaf", "retains_grad", "grad_fn", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_mps", "is_xpu", "names",
    "_version", "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize", "output_nr", "_base", "_cdata"})
_DESCRIBING_METHODS = frozenset({
    _T.requires_grad_, _T.element_size, _T.is_floating_point, _T.is_complex, _T.get_device, _T.is_signed,
    _T.register_hook, _T.register_post_accumulate_grad_hook, _T.retain_grad, _T.__hash__,
    torch._has_compatible_shallow_copy_type})
# What the parameter's whole shape answers (the placeholder's is (0,)).
_SHAPE_METHODS = frozenset({_T.size, _T.dim, _T.numel, _T.nelement, _T.__len__, torch.numel})
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim"})
# Conversions that return the tensor itself when they change nothing.
_CONVERSIONS = frozenset({_T.to, _T.cuda, _T.cpu, _T.type, _T.float, _T.half, _T.bfloat16, _T.double})


GRAD_TOKENS: set[type] = set()
"""The types a released parameter's ``.grad`` may be set to besides None: the gradient tokens
(``ShardedGrad``, infinity/optim/grad_face.py, adds itself)."""


class ReleasedParameter(nn.Parameter):
    """An engine parameter whose group is released (see [Note: released placeholders])."""

    def __hash__(self) -> int:      # as Tensor's (id), without a trip through __torch_function__
        return id(self)

    # ``.grad`` is read and written on every parameter at every step (``zero_grad``, the gradient
    # tokens): these properties reach torch's own descriptor in a third of the time the trip
    # through ``__torch_function__`` takes.
    @property
    def grad(self):
        with _NO_SUBCLASS():
            return _GRAD.__get__(self)

    @grad.setter
    def grad(self, value) -> None:
        if value is not None and type(value) not in GRAD_TOKENS:
            raise EngineError(refusal(self, "assigning a .grad", "the engine keeps a released parameter's "
                                      "gradient as shards, accumulated by backward; a tensor cannot take their "
                                      "place. Scale or clip through .grad (mul_, clamp_, clip_grad_norm_) instead"))
        with _NO_SUBCLASS():
            _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        with _NO_SUBCLASS():
            _GRAD.__delete__(self)

    @property
    def requires_grad(self) -> bool:
        with _NO_SUBCLASS():
            return _REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        with _NO_SUBCLASS():
            _REQUIRES_GRAD.__set__(self, value)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={tuple(_whole_shape(self))}, dtype={self.dtype}: released by infinity; "
                "its values exist inside `with infinity.gathered(model):`)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        attribute = _attribute_of(func)
        with _NO_SUBCLASS():
            if attribute in _DESCRIBING_ATTRIBUTES and func.__name__ in ("__get__", "__set__", "__delete__"):
                if attribute == "is_leaf":      # every optimizer's add_param_group reads it
                    _refuse_a_foreign_optimizer(args[0], inspect.currentframe().f_back)
                return func(*args, **kwargs)
            if attribute == "data" and func.__name__ == "__set__":
                return func(*args, **kwargs)
            if func in _DESCRIBING_METHODS:
                return func(*args, **kwargs)
            param = _released_among(args, kwargs)
            if param is None or _compiling():
                # Not released itself, or torch.compile's tracer looking at the tensor (it makes a fake
                # of every tensor a traced frame reaches).
                return func(*args, **kwargs)
            if attribute in _SHAPE_ATTRIBUTES and func.__name__ == "__get__":
                shape = _whole_shape(param)
                return shape if attribute == "shape" else len(shape)
            if func in _SHAPE_METHODS and param is args[0]:
                return _shape_answer(func, _whole_shape(param), args[1:], kwargs)
            if func is _T.detach and param is args[0] and keys_only_caller():
                return func(*args, **kwargs)    # state_dict() for its keys alone ([Note: save_pretrained refused
                # before it writes] in infinity/runtime/save_guard.py)
            if func in _CONVERSIONS and param is args[0]:
                if func is _T.type and len(args) == 1 and not kwargs:
                    return func(*args)      # p.type(): the type's name, a description
                out = func(*args, **kwargs)
                if out is param:
                    return out
                if out.dtype == param.dtype and _same_device(out.device, param.device):
                    return param    # "cpu:0" for "cpu" (transformers.Trainer's model.to(args.device) on CPU ranks)
                _restore_buffers(param)
                raise EngineError(refusal(param, _name(func, attribute), _conversion_reason(param, out)))
        reason = _reason_on_path(func)
        if reason.endswith(_REPARAMETRIZED):
            _put_back(param)
        raise EngineError(refusal(param, _name(func, attribute), reason))


def _refuse_a_foreign_optimizer(param, frame) -> None:
    """Refuse a ``torch.optim`` optimizer that takes ``param`` into a param group, when it is not the engine's
    own: ``frame`` reads ``param.is_leaf`` ([Note: foreign optimizers] in infinity/optim/torch_guard.py)."""
    if frame is None or frame.f_code.co_name != "add_param_group" or \
            frame.f_globals.get("__name__") != "torch.optim.optimizer":
        return
    optimizer = frame.f_locals.get("self")
    held = _holder(param)
    if held is None or getattr(optimizer, "engine", None) is held[0]:
        return      # infinity.AdamW (its engine is set before torch's __init__ runs), or no live engine
    engine, group, slot = held
    name = engine.param_names.get(param) or f"{group.name}.{slot.name}"
    raise EngineError(foreign_optimizer_message(f"{type(optimizer).__module__}.{type(optimizer).__name__}(...)", name))


def _reason_on_path(func) -> str:
    """Why a read of a released parameter is refused, said for the torch tools that read every parameter and
    cannot work on shards (found on the call stack: an error's path, never a hot one); else the general reason."""
    if func is torch.autograd.grad:
        return _GRAD_REASON
    if func is _T.share_memory_:
        return _SHARE_REASON
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "resize_token_embeddings":
            return _RESIZE_REASON
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name in _PEFT_ADDING and module.startswith("peft."):
            return _PEFT_ADDING_REASON
        for prefix, reason in _TOOL_REASONS:
            if module.startswith(prefix) and (prefix != _PARAMETRIZE or frame.f_code.co_name in _REGISTERING):
                return reason   # (a parametrization registered is gathered with its module: reads are reads)
        frame = frame.f_back
    return _RELEASED_REASON


_REPARAMETRIZED = (
    "it computes from the parameter's values as it is applied, which a released parameter does not hold, and "
    "may put new parameters in its place (weight_norm's g and v, a right_inverse, prune's weight_orig and mask) "
    "that infinity would neither shard, gather nor update. Compute the weight in the module's forward from "
    "parameters the module owns, built inside infinity.Init")
_PARAMETRIZE = "torch.nn.utils.parametriz"
_REGISTERING = frozenset({"register_parametrization", "weight_norm", "spectral_norm", "orthogonal"})
_TOOL_REASONS = (
    ("torch.nn.parallel.distributed",
     "torch.nn.parallel.DistributedDataParallel wraps a model infinity manages: its parameters are shards over "
     "the ranks, which infinity gathers and whose gradients it reduces itself (ZeRO-3), so there are no replicas "
     "to wrap. Train the model unwrapped on every rank; with accelerate, prepare it as "
     "accelerator.prepare_model(model, device_placement=False, evaluation_mode=True) (no DDP), and with "
     "transformers.Trainer use infinity.Trainer, which does so"),
    (_PARAMETRIZE, "a parametrization (torch.nn.utils.parametrize, parametrizations.weight_norm, spectral_norm, "
                   "orthogonal): " + _REPARAMETRIZED),
    ("torch.nn.utils.weight_norm", "torch.nn.utils.weight_norm: " + _REPARAMETRIZED),
    ("torch.nn.utils.spectral_norm", "torch.nn.utils.spectral_norm: " + _REPARAMETRIZED),
    ("torch.nn.utils.prune", "torch.nn.utils.prune: " + _REPARAMETRIZED),
)
# An adapter that copies or wraps base weights while peft adds it (modules_to_save and a SEQ_CLS head copy their
# module, DoRA reads the weight's norm): LoRA alone adds plain parameters, which the engine takes after the block.
_PEFT_ADDING = frozenset({"get_peft_model", "inject_adapter", "add_adapter"})
_PEFT_ADDING_REASON = ("peft copies or reads a base weight while adding this adapter (modules_to_save, a sequence-"
                       "classification head, DoRA), which a released parameter cannot give. Add the adapter inside "
                       "the infinity.Init block, after the model is built or loaded there (get_peft_model there): "
                       "its parameters are then the engine's")
_RESIZE_REASON = ("resize_token_embeddings gives parameters new shapes, which a model's groups, shards and "
                  "optimizer states keep from the exit of its infinity.Init block on: call it inside that block, "
                  "after the model is built or loaded (from_pretrained there)")
_SHARE_REASON = ("share_memory puts tensors in shared memory for other processes; an infinity model's parameters "
                 "are shards in its tiers, not tensors to share: run one rank per process (torch.distributed) instead")
_GRAD_REASON = ("torch.autograd.grad with respect to parameters infinity manages: their gradients are reduced into "
                "shards in the optimizer's tier as backward produces them and never exist whole; use "
                "loss.backward(), then their .grad answer norms, scaling and clamping (clip_grad_norm_)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """The same device, an index of None meaning the only one (the CPU's)."""
    return a.type == b.type and (a.index == b.index or a.type == "cpu")


def _compiling() -> bool:
    """Whether torch.compile is at work: tracing a frame, or its tracer looking at a tensor.

    ``torch.compiler.is_compiling()`` says so for the whole compile session since torch 2.13; before,
    only inside the traced code, not in the tracer's own look at a tensor (``_is_view()`` as it makes
    a fake), which those versions do inside a tracing context.
    """
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


def requires_grad_set(func, args, kwargs) -> bool | None:
    """The value a torch call on ``args[0]`` sets its ``requires_grad`` to (``t.requires_grad = v``,
    ``t.requires_grad_(v)``); None for any other call."""
    if func is _T.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    if _attribute_of(func) == "requires_grad" and func.__name__ == "__set__":
        return bool(args[1])
    return None


def _attribute_of(func) -> str | None:
    """The attribute name of a descriptor's ``__get__``/``__set__``/``__delete__`` (None for a function)."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) if type(owner).__name__ == "getset_descriptor" else None


def _released_among(args, kwargs):
    for a in (*args, *kwargs.values()):
        if type(a) in _RELEASED_TYPES:
            return a
        if type(a) in (list, tuple):
            for b in a:
                if type(b) in _RELEASED_TYPES:
                    return b
    return None


def _name(func, attribute: str | None) -> str:
    if attribute is not None:
        return f".{attribute}" if func.__name__ == "__get__" else f"setting .{attribute}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return name.replace("TensorBase.", "Tensor.").replace("_TensorBase.", "Tensor.")


def _shape_answer(func, shape: torch.Size, args, kwargs):
    if func in (_T.numel, _T.nelement, torch.numel):
        return shape.numel()
    if func is _T.dim:
        return len(shape)
    if func is _T.__len__:
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
    dim = args[0] if args else kwargs.get("dim")
    return shape if dim is None else shape[dim]


def _holder(param):
    """(engine, group, slot) of ``param``, or None when no live engine holds it."""
    from infinity import registry

    engine = registry.engine_of_param(param)
    if engine is None:
        return None
    group = engine.coordinator.group_of[param]
    return engine, group, next(s for s in group.slots if s.param is param)


def _put_back(param) -> None:
    """Undo what a reparametrizing tool did to ``param``'s module before its read was refused, so the refusal
    loses nothing: prune registers the parameter again as ``<name>_orig`` and deletes ``<name>``, the old
    weight_norm deletes ``<name>``, each before the first read of the values. The parameter goes back under
    its name, in its place among the module's parameters (``parameters()`` and ``state_dict()`` order)."""
    held = _holder(param)
    if held is None:
        return
    engine, group, slot = held
    holder = next((m for m, groups in engine.coordinator.module_groups.items() if group in groups), None)
    if holder is None:
        return
    # A unit's group names its parameters by their path under the unit ([Note: units] in construction.py).
    path, _, name = slot.name.rpartition(".")
    module = holder.get_submodule(path)
    entries = module._parameters
    if entries.get(name + "_orig") is param:
        del entries[name + "_orig"]
    if name in entries or name in module.__dict__:
        return
    siblings = [s.name.rpartition(".")[2] for s in group.slots if s.name.rpartition(".")[0] == path]
    after = set(siblings[siblings.index(name) + 1:])
    items = list(entries.items())
    entries.clear()
    for key, value in items:
        if key in after and name not in entries:
            entries[name] = param
        entries[key] = value
    entries.setdefault(name, param)


def parameter_free_buffers(roots) -> list[tuple[weakref.ref, str, torch.Tensor]]:
    """(module, name, tensor) of every buffer of a module with no parameter in its subtree, under ``roots``:
    the only tensors ``Module._apply`` converts before it reaches a parameter, which refuses (the tensors
    themselves are kept, no copy, so in-place updates stay visible; a buffer assigned anew after construction
    is not put back, and the list keeps its first tensor alive)."""
    kept = []
    for root in roots:
        for module in root.modules():
            if next(module.parameters(), None) is None:
                kept.extend((weakref.ref(module), name, buf) for name, buf in module.named_buffers(recurse=False))
    return kept


def _restore_buffers(param) -> None:
    """Put back the buffers a refused conversion of ``param``'s model had already converted (see
    [Note: released placeholders]): a buffer now holding exactly its kept tensor converted (or moved to
    "meta", holding nothing) goes back to it."""
    held = _holder(param)
    for ref, name, kept in held[0].buffer_originals if held is not None else ():
        module = ref()
        now = None if module is None else getattr(module, name, None)
        if not isinstance(now, torch.Tensor) or now is kept or now.shape != kept.shape:
            continue
        if now.is_meta or torch.equal(now, kept.to(device=now.device, dtype=now.dtype)):   # meta: no values
            setattr(module, name, kept)     # still a buffer, persistent or not as it was


def _whole_shape(param) -> torch.Size:
    if type(param) is ReleasedJoin:
        return param.joined_shape
    held = _holder(param)
    if held is None:
        with torch._C.DisableTorchFunctionSubclass():
            return param.shape
    return held[2].shape


_RELEASED_REASON = ("it is released (its values are shards over ranks and tiers; this tensor holds none of "
                    "them); read or change it inside `with infinity.gathered(model):`, or save with "
                    "infinity.save_checkpoint and infinity-consolidate")
_IN_BACKWARD_REASON = ("it is released during backward (a group goes as soon as autograd is done with it: its "
                       "gradients taken, or its module's backward over), so a backward hook cannot read it; read "
                       "the gradient there (.grad, or a hook on the parameter), the values in a forward hook, or "
                       "both after backward inside `with infinity.gathered(model):`")
_CONFIG_DTYPES = ("float32", "bfloat16", "float16")
_CONFIG_DEVICES = ("cpu", "cuda")


def _conversion_reason(param, out: torch.Tensor) -> str:
    """Why ``model.to(...)`` / ``.half()`` / ``.cuda()`` is refused: what infinity does with the parameters,
    and the config key that gives what the conversion asked for (``out``: the placeholder converted)."""
    dtype, target = str(param.dtype).removeprefix("torch."), str(out.dtype).removeprefix("torch.")
    ways = []
    if out.dtype != param.dtype:
        ways.append(f'to compute in {target}, build the model under infinity.Init with precision.dtype = "{target}" '
                    "in its config" if target in _CONFIG_DTYPES else
                    f"infinity computes in {', '.join(_CONFIG_DTYPES)} (precision.dtype), not {target}")
    if not _same_device(out.device, param.device):
        device = out.device.type
        ways.append(f'to compute on {device}, build it with tiers.device = "{device}"' if device in _CONFIG_DEVICES
                    else f"infinity computes on {' or '.join(_CONFIG_DEVICES)} (tiers.device), not {device}")
    return (f"infinity keeps this model's parameters as shards in its tiers, computed in {dtype} on "
            f"{param.device.type} (the config's precision.dtype and tiers.device), with fp32 master weights and "
            "Adam states beside them, so converting the model cannot convert them: "
            + "; ".join(ways) + "; for converted copies of the values, convert infinity.state_dict(model) "
            "(or infinity-consolidate --dtype)")


def refusal(param, what: str, reason: str = _RELEASED_REASON) -> str:
    """The message refusing ``what`` on the released ``param``: its name, why, and what to do instead."""
    if type(param) is ReleasedJoin:
        return f"{what} on {param.describe()}: {reason}"
    held = _holder(param)
    if held is None:
        return (f"{what} on a released infinity parameter (of a model whose engine was released by "
                f"infinity.release, or is being built): {reason}")
    engine, group, slot = held
    name = engine.param_names.get(param) or f"{group.name}.{slot.name}"
    if reason is _RELEASED_REASON and engine.backward_running:
        reason = _IN_BACKWARD_REASON
    return f"{what} on parameter {name!r}: {reason}"


class ReleasedJoin(ReleasedParameter):
    """A tiled layer's joined ``weight`` or ``bias`` while a tile is released (see [Note: released joins])."""

    joined_tiles: list
    """The tiles' parameters, in order."""

    joined_shape: torch.Size
    """The untiled shape."""

    joined_attribute: str
    """The untiled name within the layer ("weight" or "bias")."""

    @classmethod
    def over(cls, tiles: list, shape, attribute: str) -> "ReleasedJoin":
        """The placeholder for the join of ``tiles`` (the ``attribute`` parameters of a tiled layer's tiles)."""
        with _NO_SUBCLASS():
            first = tiles[0]
            trainable = any(_REQUIRES_GRAD.__get__(t) for t in tiles)
            out = nn.Parameter(torch.empty(0, dtype=first.dtype, device=first.device), requires_grad=trainable)
        out.__class__ = cls
        out.joined_tiles, out.joined_shape, out.joined_attribute = list(tiles), torch.Size(shape), attribute
        return out

    @ReleasedParameter.requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        for tile in self.joined_tiles:      # what freezing the untiled parameter does: every tile
            tile.requires_grad = value
        with _NO_SUBCLASS():
            _REQUIRES_GRAD.__set__(self, value)

    def requires_grad_(self, requires_grad: bool = True) -> "ReleasedJoin":
        self.requires_grad = requires_grad
        return self

    @property
    def grad(self):
        raise EngineError(f".grad on {self.describe()}: a join has no gradient of its own; the gradients are "
                          f"the tiles' (layer.tiles[i].{self.joined_attribute}.grad, or model.named_parameters())")

    @grad.setter
    def grad(self, value) -> None:
        raise EngineError(f"setting .grad on {self.describe()}: set the tiles' "
                          f"(layer.tiles[i].{self.joined_attribute}.grad) instead")

    def describe(self) -> str:
        """The join's untiled name (from its first tile's, ``head.tiles.0.weight``) and what it is."""
        held = _holder(self.joined_tiles[0])
        name = None
        if held is not None:
            engine, group, slot = held
            first = engine.param_names.get(self.joined_tiles[0]) or f"{group.name}.{slot.name}"
            prefix, found, _ = first.rpartition(f"tiles.0.{self.joined_attribute}")
            name = prefix + self.joined_attribute if found else first
        tiles = len(self.joined_tiles)
        what = f"the joined {self.joined_attribute!r} of a tiled layer ({tiles} tiles, not all gathered)"
        return what if name is None else f"{name!r}, {what}"


def released_class(cls: type) -> type | None:
    """The class a parameter of class ``cls`` has while released (see [Note: released placeholders]).

    ``ReleasedParameter`` for ``nn.Parameter``; for a subclass, a class made once that derives from both;
    None for a subclass with its own ``__torch_function__``, or one no class can derive from together
    with ``ReleasedParameter`` (its layout), which keep their class. ``cls`` released already: itself.
    The answers are kept in ``RELEASED_OF`` (the engine looks there first: no call per parameter).
    """
    with _MAKING:
        if cls in RELEASED_OF:
            return RELEASED_OF[cls]
        made = None
        if issubclass(cls, nn.Parameter) and cls.__torch_function__ is nn.Parameter.__torch_function__:
            try:
                made = type(f"Released{cls.__name__}", (ReleasedParameter, cls),
                            {"__module__": __name__, "__qualname__": f"Released{cls.__qualname__}"})
            except Exception:       # its layout, or its own __init_subclass__: it keeps its class
                made = None
        if made is not None:
            ORIGINAL_OF[made] = cls
            RELEASED_OF[made] = made
            _RELEASED_TYPES.add(made)
        RELEASED_OF[cls] = made
        return made


# Each parameter class met -> its class while released (itself for a released class; None: it keeps its own).
RELEASED_OF: dict = {nn.Parameter: ReleasedParameter, ReleasedParameter: ReleasedParameter}
# Each released class of a parameter -> the parameter's own class.
ORIGINAL_OF: dict = {ReleasedParameter: nn.Parameter}
# Every class whose instances are released placeholders.
_RELEASED_TYPES: set = {ReleasedParameter, ReleasedJoin}
_MAKING = threading.Lock()


def keys_only_caller() -> bool:
    """Whether the ``state_dict()`` under way is one of peft's that reads the keys alone (``_KEYS_ONLY``): its
    ``detach()`` of a released parameter is let through ([Note: save_pretrained refused before it writes] in
    infinity/runtime/save_guard.py)."""
    return any(on_stack(module, function) for module, function in _KEYS_ONLY)


# peft's calls of a module's state_dict() that read its keys and nothing else.
_KEYS_ONLY = (("peft.utils.other", "adapter_state_dict"), ("peft.utils.other", "adapter_state_dict_load_map"),
              ("peft.tuners.tuners_utils", "_remap_adapter_state_dict_for_load"))


def on_stack(module: str, function: str) -> bool:
    """Whether ``function`` of ``module`` is on the stack (which library's call reaches a released parameter);
    looked at only on error paths."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False
