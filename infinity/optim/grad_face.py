"""What torch sees as ``param.grad`` of an engine parameter: a token standing for its sharded gradient.

[Note: gradient tokens]
The gradient of an engine parameter never exists whole: it is reduce-scattered and
accumulated as fp32 shards in the optimizer's tier (see [Note: gradient flow] in
infinity/runtime/grads.py). Yet torch code reads and writes ``.grad``:
``model.zero_grad()`` sets it to None (the only zeroing Hugging Face's Trainer does),
``torch.nn.utils.clip_grad_norm_`` takes the norm of every ``.grad`` and multiplies them,
``clip_grad_value_`` clamps them. So once a backward has left a parameter's gradient in
the store, the parameter's ``.grad`` is a :class:`ShardedGrad`: a tensor with the
parameter's shape and dtype and no memory, whose operations are answered from the store:

- ``torch.linalg.vector_norm`` / ``Tensor.norm``: the parameter's exact gradient norm over
  every rank (one pass over this rank's accumulated shards, one all-reduce, for all
  parameters at once, kept until the gradients change);
- ``mul_`` by a scalar: a factor the next ``opt.step()`` applies (clipping by a common
  factor folds into the host Adam kernel, as ``infinity.clip_grad_norm_`` does);
- ``clamp_`` / ``clamp_min_`` / ``clamp_max_``: applied to the stored shards at once;
- ``zero_`` (``zero_grad(set_to_none=False)``): the gradient counts as cleared, a gradient of
  zeros (its norm 0, ``mul_`` and ``clamp_`` leave it so) until the next backward;
- ``torch._foreach_norm``, ``_foreach_mul_``, ``_foreach_clamp_min_`` / ``_max_``, ``_foreach_zero_``
  (``clip_grad_norm_`` / ``clip_grad_value_`` with ``foreach=True``): each tensor's op as above;
- anything else raises ``EngineError`` naming the parameter.

Whether the gradients were cleared is decided when the next backward starts (or at
``opt.step()``): if every token is gone (``.grad = None``) or zeroed, the store starts
from zero, as torch starts from a None ``.grad``; if none is, the backward accumulates,
as torch does. Tokens are taken off before autograd writes, so autograd always stores
into a None ``.grad``, which the reducer takes and drops as before.

What the room may touch: the optimizer state store (reads and writes of gradient
shards), the reducer's ``settle`` and book, the ranks' all-reduces, and the engine's
optimizer (its ``zero_grad``).
"""
from __future__ import annotations


import math
import weakref

import torch

from infinity.errors import EngineError
from infinity.optim.ranges import shard_span
from infinity.runtime import placeholder

_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}
_CLAMPS = {torch.Tensor.clamp_, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_, torch.Tensor.clip_}
_ALLOWED = {torch.Tensor.requires_grad_, torch.Tensor.detach_}


class ShardedGrad(torch.Tensor):
    """``param.grad`` of an engine parameter whose gradient is in the store (see [Note: gradient tokens])."""

    face: "weakref.ref[GradFace]"
    param_index: int
    cleared: bool

    @staticmethod
    def __new__(cls, param: torch.Tensor, shape: torch.Size, face: "GradFace", index: int):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=param.dtype, device=param.device)
        out.face, out.param_index, out.cleared = weakref.ref(face), index, False
        return out

    def __repr__(self) -> str:
        return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, held as shards by infinity)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":      # attributes: shape, dtype, device, ...
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _FOREACH and args and isinstance(args[0], (list, tuple)):
            return _foreach(func, args[0], args[1:], kwargs)
        token = args[0] if args and isinstance(args[0], ShardedGrad) else None
        face = token.face() if token is not None else None
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            raise EngineError(_GRAD_SCALER)
        if face is None:
            raise EngineError(f"{_name(func)} on the gradient of an infinity parameter: only norms, mul_ by a "
                              "scalar, clamp_ and zero_ are supported (torch.nn.utils.clip_grad_norm_, "
                              "clip_grad_value_, zero_grad)")
        if token.cleared and (func in _NORMS or func in _CLAMPS or func is torch.Tensor.mul_):
            # zeroed (zero_grad(set_to_none=False)): a gradient of zeros until the next backward
            return torch.zeros((), dtype=kwargs.get("dtype") or torch.float32) if func in _NORMS else token
        if func in _NORMS:
            return face.norm(token, *args[1:], **kwargs)
        if func is torch.Tensor.mul_:
            return face.scale(token, args[1])
        if func in _CLAMPS:
            return face.clamp(token, func, *args[1:], **kwargs)
        if func is torch.Tensor.zero_:
            token.cleared = True
            return token
        if func in _ALLOWED:
            return token
        raise EngineError(face.refusal(token, _name(func)))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise EngineError(f"{func} on the gradient of an infinity parameter: its values are sharded over ranks "
                          "and tiers; only torch.nn.utils.clip_grad_norm_ / clip_grad_value_, norms and zero_grad "
                          "work on it")


placeholder.GRAD_TOKENS.add(ShardedGrad)


def untaken(param) -> bool:
    """Whether ``param`` holds a gradient the engine did not take (a tensor in ``.grad``, not a token)."""
    return param.grad is not None and not isinstance(param.grad, ShardedGrad)


# torch's list ops (``clip_grad_norm_`` / ``clip_grad_value_`` with ``foreach``) and the op each is per tensor.
_GRAD_SCALER = ("torch.amp.GradScaler unscaling the gradients of infinity parameters: infinity scales the loss "
                "itself for fp16 ([precision] loss_scale, dynamic by default: a step whose gradients are not finite "
                "is skipped and the scale lowered) and bf16 and fp32 need no scaling; drop the GradScaler and call "
                "loss.backward() and opt.step() (accelerate: drop Accelerator(mixed_precision='fp16'), which makes "
                "one, and set [precision] dtype = \"float16\" in infinity's config)")
_FOREACH = {torch._foreach_norm: torch.linalg.vector_norm, torch._foreach_mul_: torch.Tensor.mul_,
            torch._foreach_clamp_min_: torch.Tensor.clamp_min_, torch._foreach_clamp_max_: torch.Tensor.clamp_max_,
            torch._foreach_zero_: torch.Tensor.zero_}


def _foreach(func, tensors, rest, kwargs):
    """A ``torch._foreach_*`` op one tensor at a time, tokens answered as their own op is; an in-place op's
    operand may be one per tensor (a list)."""
    op = _FOREACH[func]
    if func is torch._foreach_norm:
        return [op(t, *rest, **kwargs) for t in tensors]
    if rest and isinstance(rest[0], (list, tuple)):
        for t, x in zip(tensors, rest[0], strict=True):
            op(t, x, *rest[1:], **kwargs)
    else:
        for t in tensors:
            op(t, *rest, **kwargs)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


class GradFace:
    """The tokens of one engine's parameters, and the answers to what torch asks of them.

    Parameters
    ----------
    engine:
        The engine (its ``coordinator``, ``store``, ``reducer``, ``ranks``, ``optimizer``); held weakly.
    names:
        ``param -> qualified name``, for messages.
    """

    def __init__(self, engine, names: dict) -> None:
        self._engine = weakref.ref(engine)
        groups = engine.coordinator.groups
        # Every parameter, trainable now or not: one frozen when the engine was built may be trained later
        # (requires_grad can change at any time, as in torch), and only those with a gradient get a token.
        self.slots = [(g, s) for g in groups for s in g.slots]
        self.index = {id(s.param): i for i, (_, s) in enumerate(self.slots)}
        self.names = [names.get(s.param, s.name) for _, s in self.slots]
        # One token per parameter, made once: making them during backward, between the freed
        # gradient buffers, kept the C heap from giving those back (+50-100 MiB resident).
        self._made = [ShardedGrad(s.param, s.shape, self, i) for i, (_, s) in enumerate(self.slots)]
        self.tokens: dict[int, ShardedGrad] = {}           # slot index -> the token set as its .grad
        self.factors: dict[int, float] = {}                # slot index -> pending mul_ factor
        self._norms: dict[float, torch.Tensor] = {}        # norm type -> per-slot norms (unscaled), cached
        # (param, name) whose .grad an infinity.gathered block left that the engine did not take: checked
        # by the next opt.step() (see infinity/runtime/gathered.py, _stray_grads).
        self.stray: list = []

    @property
    def engine(self):
        return self._engine()

    # -- the engine's lifecycle ------------------------------------------------------------------
    def mark(self, params) -> None:
        """The gradients of ``params`` are in the store now: their ``.grad`` become tokens.

        Called while the parameters still have their shapes (autograd just stored their
        gradients, which the reducer has taken).
        """
        for p in params:
            i = self.index.get(id(p))
            if i is None:
                continue
            token = self._made[i]
            token.cleared = False
            p.grad = token
            self.tokens[i] = token
        self._norms.clear()

    def before_backward(self) -> None:
        """A backward starts: clear the store if the user cleared every ``.grad``; take the tokens off.
        Gradients the engine did not take (``stray``) are refused before autograd adds onto them."""
        self._refuse_stray("loss.backward()")
        if self._resolve_clearing("loss.backward()"):
            self.factors.clear()
        elif self.factors:
            raise EngineError("a backward is accumulating into gradients that torch.nn.utils.clip_grad_norm_ (or "
                              "another mul_ of .grad) scaled: with infinity, clip after the last backward of "
                              "the step, just before opt.step()")
        self._strip()

    def before_step(self) -> None:
        """``opt.step()`` starts: gradients the user cleared since the backward are dropped first; gradients
        the engine did not take (``stray``) are refused, not skipped."""
        self._refuse_stray("opt.step()")
        if self._resolve_clearing("opt.step()"):
            self.factors.clear()

    def _refuse_stray(self, when: str) -> None:
        if not self.stray:
            return
        self.stray = [(p, n) for p, n in self.stray if untaken(p)]
        if self.stray:
            raise EngineError(
                f"{when}: parameters hold gradients the engine did not take ({[n for _, n in self.stray][:3]}): "
                "set by hand or left by a backward inside `with infinity.gathered(...)` through a module that "
                "does not own them, which infinity sees only in a forward outside it; a step would skip them. "
                "Run training steps outside infinity.gathered (zero_grad() clears these)")

    def forget(self, keep_zeros: bool = False) -> None:
        """The store's gradients were dropped (``opt.zero_grad()``, a skipped step): no tokens, no factors.

        ``keep_zeros`` (``opt.zero_grad(set_to_none=False)``): each ``.grad`` stays, a gradient of zeros,
        as torch's zero-filled ones."""
        if keep_zeros:
            for token in self.tokens.values():
                token.cleared = True
        else:
            self._strip()
        for p, _ in self.stray:     # gradients the engine did not take: cleared with the rest
            if untaken(p):
                p.grad = None
        self.stray.clear()
        self.factors.clear()
        self._norms.clear()

    def _resolve_clearing(self, when: str) -> bool:
        """Whether the user cleared every token since the last backward (then the store is zeroed)."""
        if not self.tokens:
            return False
        cleared = [i for i, t in self.tokens.items() if t.cleared or self.slots[i][1].param.grad is not t]
        if not cleared:
            return False
        if len(cleared) != len(self.tokens):
            kept = next(i for i in self.tokens if i not in set(cleared))
            raise EngineError(
                f"before {when}: the .grad of {self.names[cleared[0]]!r} was cleared but that of "
                f"{self.names[kept]!r} was not; infinity accumulates the gradients of all parameters together: "
                "clear them all (model.zero_grad() or opt.zero_grad())")
        engine = self.engine
        if engine.optimizer is not None:
            engine.optimizer.zero_grad()
        else:       # a clear: the shards on their way are dropped, not added
            engine.reducer.settle(drop=True)
            engine.store.zero_grad()
            self.forget()
        return True

    def _strip(self) -> None:
        for i, token in self.tokens.items():
            param = self.slots[i][1].param
            if param.grad is token:
                param.grad = None
        self.tokens.clear()

    # -- what torch asks of a token -----------------------------------------------------------------
    def norm(self, token: ShardedGrad, ord=2, dim=None, keepdim=False, *, dtype=None, **kwargs) -> torch.Tensor:
        """The exact norm of the parameter's gradient (over every rank), as a 0-d fp32 tensor."""
        p = kwargs.pop("p", ord)
        if dim is not None or kwargs:
            raise EngineError(f"{self.refusal(token, 'a norm along dim')}")
        p = 2.0 if p is None or p == "fro" else float(p)
        norms = self._norms.get(p)
        if norms is None:
            norms = self._norms[p] = self._compute_norms(p)
        value = norms[token.param_index] * abs(self.factors.get(token.param_index, 1.0))
        scaler = self.engine.loss_scaler
        if scaler is not None:      # the stored gradients are scaled ([Note: loss scaling])
            value = value / scaler.scale
        return value.to(dtype or torch.float32)

    def _compute_norms(self, p: float) -> torch.Tensor:
        engine = self.engine
        # A collective (every rank's shards), which user code may call on one rank only: [Note: collectives
        # user code calls] in infinity/runtime/ranks.py.
        what = f"the {p:g}-norm of engine gradients (param.grad.norm(), clip_grad_norm_)"
        engine.ranks.arrive(what)
        # Stage 1 (world > 1): settling reduce-scatters the whole gradients, which no rank may skip because its
        # close of a backward cut short failed: that close agrees first. At stages 2-3 closing is rank-local,
        # unless the backward was cut short before its end's collectives, on every rank, which then all issue
        # them in the same order here. A failure after the collectives rides on the norm's own all-reduce, and a
        # hand-off's between them waits for it ([Note: a hand-off that fails on one rank] in
        # infinity/runtime/grads.py).
        defers = engine.reducer.defer
        if defers:
            _close_backward_together(engine, what)

        def local() -> torch.Tensor:
            if not defers:
                engine.recover_aborted_backward()
            engine.reducer.settle()
            return self._local_norms(p)

        part = engine.ranks.reduce_together(what, local, len(self.slots), "max" if math.isinf(p) else "sum")
        return part if math.isinf(p) else part.pow(1.0 / p)

    def _local_norms(self, p: float) -> torch.Tensor:
        """This rank's share of each slot's ``p``-norm (its p-th power; the maximum for the inf-norm), read from
        the stored gradient shards (tier I/O, which may fail)."""
        store = self.engine.store
        part = torch.zeros(len(self.slots), dtype=torch.float64)
        by_group: dict[int, list[int]] = {}
        for i, (g, _) in enumerate(self.slots):
            by_group.setdefault(g.index, []).append(i)
        for gi in sorted(by_group):
            if gi not in store.grad_written:
                continue
            shard = store.read_state_shard("grad", gi).double()
            for i in by_group[gi]:
                g, slot = self.slots[i]
                a, b = shard_span(g, slot)
                if a >= b:
                    continue
                x = shard[a:b].abs()
                part[i] = x.max() if math.isinf(p) else (x.pow(p).sum() if p != 2 else torch.dot(x, x))
        return part

    def scale(self, token: ShardedGrad, factor) -> ShardedGrad:
        """``grad.mul_(factor)``: remembered, applied by the next ``opt.step()``."""
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise EngineError(self.refusal(token, "mul_ by a tensor that is not a scalar"))
            factor = float(factor)
        i = token.param_index
        self.factors[i] = self.factors.get(i, 1.0) * float(factor)
        return token

    def clamp(self, token: ShardedGrad, func, *args, **kwargs) -> ShardedGrad:
        """``grad.clamp_(lo, hi)`` (or ``clamp_min_``/``clamp_max_``): applied to the stored shards now
        (after any pending ``mul_`` factors, which are applied to the shards first)."""
        lo, hi = _clamp_bounds(func, args, kwargs)
        scaler = self.engine.loss_scaler
        if scaler is not None:      # bounds on the true gradient, applied to the scaled one
            lo, hi = (None if lo is None else lo * scaler.scale), (None if hi is None else hi * scaler.scale)
        i = token.param_index
        g, slot = self.slots[i]
        factors, self.factors = self.factors, {}
        self._edit_stored({g.index} | {self.slots[k][0].index for k in factors},
                          lambda k, x: _clamped(x.mul_(factors.get(k, 1.0)), lo, hi, k == i))
        return token

    def _edit_stored(self, group_indices, edit) -> None:
        """Rewrite the stored gradient of each slot of ``group_indices`` through ``edit(slot index, values)``."""
        engine = self.engine
        # First: a failure below leaves the cached norms of the gradients before the change, on this rank alone
        # (the others clear theirs), and a norm read from them would skip the collectives the others issue.
        self._norms.clear()
        what = "a change of engine gradients (param.grad.clamp_(), clip_grad_value_)"
        # Stage 1's whole gradients waiting reduce-scatter when settled: collectives, which every rank must reach
        # together. (A backward cut short leaves no .grad to change until something closes it.)
        if engine.reducer.reduces_on_settle:
            engine.ranks.arrive(what)
            _close_backward_together(engine, what)
        else:       # all of it rank-local: a failure here reaches the others at the step's agreement
            engine.recover_aborted_backward()
        try:
            engine.reducer.settle()
        except EngineError:
            if engine.reducer.lost is None:
                raise
            # A hand-off failed on this rank of several (in the backward or just now): nothing to edit, and the
            # step refuses on every rank, which raising alone here would leave waiting in its agreement ([Note: a
            # hand-off that fails on one rank] in infinity/runtime/grads.py).
            return
        store = engine.store
        for gi in sorted(group_indices & store.grad_written):
            shard = store.read_state_shard("grad", gi)
            for k, (g, slot) in enumerate(self.slots):
                a, b = shard_span(g, slot)
                if g.index == gi and a < b:
                    edit(k, shard[a:b])
            store.write_state_shard("grad", gi, shard)
        if store.book is not None:
            store.book.exact = False     # the running norm no longer matches the stored sum
        self._norms.clear()

    def common_factor(self) -> float | None:
        """The factor every gradient of the coming step was scaled by (None: 1), for the update kernel.

        Differing factors (clipping only some parameters) are refused: the update scales all alike.
        """
        if not self.factors:
            return None
        values = {self.factors.get(i, 1.0) for i in self.tokens} or set(self.factors.values())
        if any(v != v or abs(v) == math.inf for v in values):   # a non-finite norm: its step is skipped, not refused
            self.factors.clear()
            self._norms.clear()
            return math.nan
        if len(values) != 1:
            raise EngineError("opt.step(): the gradients of some parameters were scaled (clip_grad_norm_ or "
                              "mul_) by other factors than the rest; with infinity clip all parameters together "
                              "(torch.nn.utils.clip_grad_norm_(model.parameters(), ...) or "
                              "infinity.clip_grad_norm_(model, ...))")
        factor = values.pop()
        self.factors.clear()
        self._norms.clear()
        return None if factor == 1.0 else factor

    def refusal(self, token: ShardedGrad, what: str) -> str:
        return (f"{what} on the .grad of {self.names[token.param_index]!r}: infinity keeps this gradient as fp32 "
                "shards over ranks and tiers, never whole; torch.nn.utils.clip_grad_norm_, clip_grad_value_, "
                ".norm(), zero_grad() and the infinity optimizer work on it")


def _close_backward_together(engine, what: str) -> None:
    """Close a backward cut short (``recover_aborted_backward``) in an agreement of every rank: that may fail on one
    rank alone (its end of backward failed there, and the retry's tier I/O fails again), and the others would go on
    to the collectives ``what`` issues next ([Note: failing together] in infinity/runtime/ranks.py)."""
    with engine.ranks.together(what):
        engine.recover_aborted_backward()


def _clamped(x: torch.Tensor, lo, hi, clamp: bool) -> torch.Tensor:
    return x.clamp_(lo, hi) if clamp else x


def _clamp_bounds(func, args, kwargs) -> tuple:
    if func is torch.Tensor.clamp_min_:
        return (args[0] if args else kwargs["min"]), None
    if func is torch.Tensor.clamp_max_:
        return None, (args[0] if args else kwargs["max"])
    lo = args[0] if len(args) > 0 else kwargs.get("min")
    hi = args[1] if len(args) > 1 else kwargs.get("max")
    return lo, hi
