"""fp16 loss scaling: the gradient of the loss is scaled up in backward and divided out in the step.

[Note: loss scaling]
fp16 gradients below 2**-24 flush to zero, so with ``precision.dtype = "float16"`` the
gradient entering the model (at the outputs of its outermost module, where every
gradient of its parameters comes in) is multiplied by the loss scale ``S``: backward is
linear in that gradient, so this equals ``(S * loss).backward()`` and the user's loop
stays ``loss.backward()``. The optimizer's step folds ``1 / S`` into the factor the
update kernel multiplies the gradients by (with clipping's), so no pass over the
gradients is added; norms that clipping measures are divided by ``S`` first, and
``clip_grad_value_``'s bounds multiplied by it, so clipping sees unscaled gradients.

A step whose gradients hold an inf or NaN on any rank (an overflow) is skipped, as any
non-finite step is ([Note: skipped steps]). With ``loss_scale = "dynamic"`` the scale
then changes: each overflow counts a strike and resets the run of clean steps; from
``hysteresis`` strikes on, each overflow halves the scale (never below ``min_scale``);
after ``growth_interval`` clean steps in a row the scale doubles and the strikes are
forgotten. With ``hysteresis = 1`` this is ``torch.amp.GradScaler``'s rule (backoff 0.5,
growth 2); DeepSpeed's fp16 ``hysteresis`` counts the same way.
"""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten


class LossScaler:
    """The loss scale of one engine, and its dynamic rule (see [Note: loss scaling]).

    Parameters
    ----------
    precision:
        The ``[precision]`` section (``loss_scale``, ``initial_scale``, ``growth_interval``,
        ``hysteresis``, ``min_scale``).
    """

    def __init__(self, precision) -> None:
        self.dynamic = precision.loss_scale == "dynamic"
        self.scale = float(precision.initial_scale if self.dynamic else precision.loss_scale)
        self.growth_interval = precision.growth_interval
        self.hysteresis = precision.hysteresis
        self.min_scale = precision.min_scale
        self.clean_steps = 0         # clean steps in a row since the scale last changed or overflowed
        self.strikes = 0             # overflows since the scale last grew
        self.skipped_steps = 0

    @classmethod
    def for_precision(cls, precision) -> "LossScaler | None":
        """The scaler the config asks for: one for float16, None for the other dtypes."""
        return cls(precision) if precision.dtype == "float16" else None

    def watch_output(self, output) -> None:
        """Scale the gradient that will enter ``output`` (the outermost module's) in backward."""
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._scaled)

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scale

    def unscaled_norm(self, norm: float) -> float:
        """A norm measured on the stored (scaled) gradients, as of the true ones."""
        return norm / self.scale

    def update(self, overflow: bool) -> None:
        """A step ended: skipped for an overflow (``overflow``) or taken; apply the dynamic rule."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.strikes = min(self.strikes + 1, self.hysteresis)
                if self.strikes >= self.hysteresis:
                    self.scale = max(self.scale / 2.0, self.min_scale)
            return
        if not self.dynamic:
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * 2.0, 2.0 ** 64)
            self.clean_steps = 0
            self.strikes = 0

    def as_dict(self) -> dict:
        """``scale``, ``dynamic``, ``skipped_steps`` (overflows), ``clean_steps``, ``strikes``."""
        return {"scale": self.scale, "dynamic": self.dynamic, "skipped_steps": self.skipped_steps,
                "clean_steps": self.clean_steps, "strikes": self.strikes}

    def load(self, saved: dict, where: str) -> None:
        """Restore :meth:`as_dict` (from an optimizer state dict)."""
        scale = saved.get("scale")
        if not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"{where}: loss_scale.scale must be a positive number, got {scale!r}")
        self.scale = float(scale)
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.clean_steps = int(saved.get("clean_steps", 0))
        self.strikes = int(saved.get("strikes", 0))
