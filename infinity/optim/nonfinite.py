"""Steps that keep finding inf/NaN gradients: when to stop skipping, and which groups to name.

[Note: non-finite steps that do not stop]
A skipped step ([Note: skipped steps] in checks.py) is how float16 survives an overflow:
the next step, with smaller gradients, usually goes through. In float32 and bfloat16 the
range is that of float32, so a gradient that stays non-finite step after step means the
values themselves are broken (a parameter overwritten on disk, a NaN written into a state,
a model bug), and skipping forever only hides it: the run loops without learning and the
warning blamed fp16. So after ``precision.max_nonfinite_steps`` skipped steps in a row
(in float16: once the dynamic loss scale is at its minimum, or fixed), ``step()`` raises :class:`NonFiniteStepsError` instead, naming every group
whose gradient, compute copy, master weights or Adam moments hold inf/NaN (or values beyond
1e30, which bytes such as 0x7f7f7f7f decode to) and the tier each lives in, so the reader
knows whether to look at a disk, at host memory or at the model.
"""
from __future__ import annotations

import torch

from infinity.errors import EngineError
from infinity.optim import tier_split

_HUGE = 1e30
_STATES = ("grad", "master", "exp_avg", "exp_avg_sq")


class NonFiniteStepsError(EngineError):
    """Too many steps in a row had a non-finite gradient in float32/bfloat16; the message names the groups."""


class NonFiniteSteps:
    """Counts skipped steps in a row and raises past the config's limit (see [Note: non-finite steps that
    do not stop]).

    Parameters
    ----------
    engine:
        The engine (its config, coordinator, state store and tiers, read when the error is written).
    what:
        The optimizer's name, for the message.
    """

    def __init__(self, engine, what: str) -> None:
        self.engine = engine
        self.what = what
        self.dtype = engine.config.precision.dtype
        self.limit = engine.config.precision.max_nonfinite_steps
        self.in_a_row = 0

    @property
    def expected(self) -> bool:
        """Whether a non-finite gradient is a normal event now: a float16 overflow while the dynamic loss
        scale can still come down (at its minimum, or fixed, a smaller scale cures nothing more)."""
        scaler = self.engine.loss_scaler
        return (self.dtype == "float16" and scaler is not None and scaler.dynamic
                and scaler.scale > scaler.min_scale)

    def stepped(self) -> None:
        self.in_a_row = 0

    def skipped(self) -> None:
        """One more skipped step; raise when that makes ``limit`` in a row outside float16.

        Call before the step's gradient is dropped: the message reads it.
        """
        self.in_a_row += 1
        if self.expected or not self.limit or self.in_a_row < self.limit:
            return
        if self.dtype == "float16":
            scale = self.engine.loss_scaler.scale if self.engine.loss_scaler is not None else 1.0
            why = (f"in float16 with the loss scale at {scale:g}, which does not come down further: not an overflow "
                   "a smaller scale would cure, but broken values. ")
        else:
            why = f"in {self.dtype}, whose range is float32's: this is not an overflow but broken values. "
        raise NonFiniteStepsError(
            f"{self.what}.step(): {self.in_a_row} steps in a row had an inf/NaN gradient " + why + self.culprits()
            + f" (precision.max_nonfinite_steps = {self.limit} stops the run here; 0 only skips)")

    def culprits(self) -> str:
        """Which groups hold non-finite (or absurdly large) values, in which state and tier."""
        engine = self.engine
        if engine.optimizer is not None:
            engine.optimizer.synchronize()      # no update may still be writing the states read here
        tiers = engine.config.tiers
        coordinator, store = engine.coordinator, engine.store
        found = []
        for group in coordinator.groups:
            bad = []
            copy = torch.empty(group.shard_numel, dtype=coordinator.dtype)
            coordinator.shards.read(group, copy).wait()
            if _broken(copy):
                bad.append(f"parameters (tier {tiers.params})")
            for state in _STATES:
                if _broken(store.read_state_shard(state, group.index)):
                    tier = tier_split.group_tier(store, group.index).kind   # states split over tiers: each group's own
                    bad.append(f"{'gradient' if state == 'grad' else state} (tier {tier})")
            if bad:
                names = ", ".join(s.name for s in group.slots[:3]) + (", ..." if len(group.slots) > 3 else "")
                found.append(f"group {group.name!r} [{names}]: {', '.join(bad)}")
        if not found:
            return "No group's stored values are broken: the non-finite values arise in the forward or backward."
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more groups" if len(found) > 8 else "")
        hint = " Values on NVMe may have been overwritten on disk: set [tiers] verify = true to catch that." \
            if "nvme" in (tiers.params, tiers.optimizer) and not tiers.verify else ""
        return f"Not finite (or beyond {_HUGE:g}): {shown}.{hint}"


def _broken(values: torch.Tensor) -> bool:
    values = values.float()
    return bool(values.numel()) and not bool(values.abs().le(_HUGE).all())
