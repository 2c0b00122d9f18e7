"""Gradients: collected per group as autograd produces them, reduce-scattered, accumulated.

[Note: gradient flow]
Each managed parameter has a post-accumulate-grad hook. When autograd has the
whole gradient of a parameter (all its uses summed), the hook copies it into its
group's flat fp32 buffer on the compute device and drops ``param.grad``. When the
last gradient-requiring parameter of a group has arrived, the flat buffer is
reduce-scattered (averaged over ranks) into this rank's shard, which goes to the
optimizer's tier and is added to the fp32 accumulator there; the gathered
parameters of the group are released at the same moment, since autograd will not
touch them again in this backward. Groups whose parameters received no gradient in
a pass (unused branches) are flushed by a callback queued at the end of backward,
so the collectives are issued in the same order on every rank.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from infinity.param_group import ParamGroup


class GradReducer:
    """Turns per-parameter gradients into accumulated fp32 gradient shards.

    Parameters
    ----------
    coordinator:
        Owner of the groups (infinity.runtime.coordinator.Coordinator).
    ranks:
        The data-parallel ranks.

    The optimizer state store, which accumulates the shards, is attached once it exists.
    """

    def __init__(self, coordinator, ranks) -> None:
        self.coordinator = coordinator
        self.ranks = ranks
        self.store = None
        self._buffers: dict[ParamGroup, torch.Tensor] = {}
        self._arrived: dict[ParamGroup, int] = {}
        self._slot_of: dict[nn.Parameter, object] = {}
        self._expected: dict[ParamGroup, int] = {}
        self.nonfinite = False

    def attach(self, store) -> None:
        """The groups are final and ``store`` accumulates their gradients from now on."""
        self.store = store
        self._slot_of.clear()
        self._expected.clear()
        for g in self.coordinator.groups:
            for slot in g.slots:
                self._slot_of[slot.param] = slot
            self._expected[g] = sum(1 for s in g.slots if s.param.requires_grad)

    def on_grad(self, param: nn.Parameter) -> None:
        """The whole gradient of ``param`` is in ``param.grad``: move it into its group."""
        group = self.coordinator.group_of[param]
        slot = self._slot_of[param]
        buf = self._buffers.get(group)
        if buf is None:
            buf = torch.zeros(group.padded_numel, dtype=torch.float32, device=group.device)
            self._buffers[group] = buf
        buf[slot.offset:slot.offset + slot.numel].copy_(param.grad.reshape(-1))
        param.grad = None
        self.store.param_grads.add(id(param))
        self._arrived[group] = self._arrived.get(group, 0) + 1
        if self._arrived[group] >= self._expected[group]:
            self._reduce(group)

    def _reduce(self, group: ParamGroup) -> None:
        full = self._buffers.pop(group)
        self._arrived.pop(group, None)
        shard = torch.empty(group.shard_numel, dtype=torch.float32, device=full.device)
        self.ranks.reduce_scatter_mean(shard, full)
        del full
        # One fp32 dot product gives both the shard's squared norm (for clipping) and the
        # non-finite check: it is inf or nan exactly when some element is (barring an
        # overflow past 3e38, which is no gradient to apply either).
        norm_sq = float(torch.dot(shard, shard))
        if not math.isfinite(norm_sq):
            self.nonfinite = True
        self.store.accumulate_grad(group.index, shard.to(self.store.device), norm_sq=norm_sq)
        self.coordinator.backward_done(group)

    def finish_backward(self) -> None:
        """End of a backward pass: flush groups with partial gradients, in group order."""
        for group in sorted(self._buffers, key=lambda g: g.index):
            self._reduce(group)

    def pending(self) -> bool:
        return bool(self._buffers)

    def take_nonfinite(self) -> bool:
        """Whether a gradient shard reduced since the last call had an inf or NaN; clears the flag."""
        found, self.nonfinite = self.nonfinite, False
        return found
