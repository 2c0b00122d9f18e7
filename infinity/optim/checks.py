"""What ``opt.step()`` checks of the gradients before an update: inf/NaN, which arrived, the global norm.

[Note: skipped steps]
When any rank saw a non-finite gradient (``GradReducer.take_nonfinite``, e.g. an fp16
overflow), ``step()`` skips the update as ``torch.cuda.amp.GradScaler`` does: the
step count does not advance, the gradient is dropped, ``skipped_steps`` counts it and
a ``RuntimeWarning`` names the step. With DPU the update still pending from the
previous step is published as usual.

What the room may touch: the state store's gradient bookkeeping (read only), the
reducer's non-finite flag, and the ranks' all-reduces.
"""
from __future__ import annotations

import math

import torch


class GradientChecks:
    """The per-step gradient checks and the clipping coefficient they leave for the update.

    Parameters
    ----------
    store:
        The optimizer state store (which parameters' gradients arrived, the squared norm).
    reducer:
        The gradient reducer (``infinity.runtime.grads.GradReducer``): its non-finite flag.
    ranks:
        The data-parallel ranks, for the all-reduces.
    slots:
        ``(group, slot)`` of every parameter in the optimizer, in group order.
    """

    def __init__(self, store, reducer, ranks, slots) -> None:
        self.store = store
        self.reducer = reducer
        self.ranks = ranks
        self.slots = slots
        self.clip_coef: float | None = None

    def exchange(self) -> tuple[bool, set[int]]:
        """Whether any rank's gradient of this step has an inf/NaN (the flag is consumed), and the
        ids of the parameters whose gradient arrived on any rank: one all-reduce."""
        local = self.store.param_grads
        flags = torch.tensor([1.0 if self.reducer.take_nonfinite() else 0.0]
                             + [1.0 if id(s.param) in local else 0.0 for _, s in self.slots])
        self.ranks.all_reduce_max(flags)
        had = flags[1:].tolist()
        return bool(flags[0].item()), {id(s.param) for (_, s), f in zip(self.slots, had) if f}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of this step's gradients; the update scales them to ``max_norm``."""
        norm_sq = torch.tensor([self.store.grad_norm_sq()], dtype=torch.float64)
        self.ranks.all_reduce_sum(norm_sq)
        total = math.sqrt(float(norm_sq))
        coef = max_norm / (total + 1e-6)
        self.clip_coef = coef if coef < 1.0 else None
        return torch.tensor(total)

    def take_clip_coef(self) -> float | None:
        """The coefficient for the update being handed over; the next step starts unclipped."""
        coef, self.clip_coef = self.clip_coef, None
        return coef

    def reset(self) -> None:
        """Gradients were dropped (``zero_grad`` or a skipped step): forget the flag and the coefficient."""
        self.reducer.take_nonfinite()
        self.clip_coef = None
