"""One module's parameters as one sharded unit, and its availability state machine.

[Note: parameter groups]
The direct parameters of a module (``module.parameters(recurse=False)``) are
flattened into one flat tensor in the compute dtype, padded so that it splits
into ``world_size`` equal shards whose length is a multiple of ``ALIGN_NUMEL``,
and each rank keeps only its shard, in the parameter tier. A group is the unit
of every transfer: one tier read, one all-gather, one reduce-scatter. Keeping
shard lengths a multiple of 2048 elements keeps every shard's byte offset in the
optimizer's flat fp32 space, and in a 2-byte parameter tier, a multiple of the
4096-byte ``O_DIRECT`` block.

[Note: parameter states]
NOT_AVAILABLE: only shards exist, in a tier; each ``nn.Parameter`` holds an
empty tensor and refuses to be read ([Note: released placeholders] in
infinity/runtime/placeholder.py). INFLIGHT: the shard read (and on several ranks the all-gather) has
been issued. AVAILABLE: the whole flat tensor is on the compute device and every
parameter is a view into it. Releasing goes back to NOT_AVAILABLE. Transitions
check the state they start from and raise ``ParamStateError`` naming the group.

[Note: freeing storage, not tensors]
Autograd keeps what forward saved for backward, and that is often a view of a
parameter (``F.linear`` saves ``weight.t()``), which would keep the whole gathered
tensor alive from forward to backward: the whole model, in memory. So each group
owns one flat tensor for its lifetime, and releasing takes the memory away from
that tensor's *storage* (zero bytes left); gathering gives it memory again and
fills it in place. Saved views then read the refilled bytes in backward, after the
module's pre-backward hook gathered it again. Where the memory comes from is
[Note: lending memory to a group] in infinity/runtime/gather_memory.py.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from infinity.runtime.placeholder import ORIGINAL_OF, RELEASED_OF, released_class

ALIGN_NUMEL = 2048


class ParamState(enum.Enum):
    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"
    AVAILABLE = "available"


class ParamStateError(RuntimeError):
    """A parameter group was asked for a transition its current state does not allow."""


@dataclass
class ParamSlot:
    """Where one parameter sits inside its group's flat tensor."""

    param: nn.Parameter
    name: str
    shape: torch.Size
    numel: int
    offset: int


def padded_shard_numel(numel: int, world_size: int) -> int:
    """Shard length for ``numel`` elements over ``world_size`` ranks (a multiple of ALIGN_NUMEL)."""
    per_rank = -(-numel // world_size)
    return max(ALIGN_NUMEL, -(-per_rank // ALIGN_NUMEL) * ALIGN_NUMEL)


class ParamGroup:
    """The sharded parameters of one module.

    Parameters
    ----------
    index:
        Position of the group in the engine (also its order in the flat fp32 space).
    name:
        Qualified name of the owning module, for messages.
    slots:
        The parameters, in flat order.
    dtype, device:
        Compute dtype and device of the gathered tensor.
    world_size, rank:
        The sharding.
    """

    def __init__(self, index: int, name: str, slots: list[ParamSlot], dtype: torch.dtype,
                 device: torch.device, world_size: int, rank: int) -> None:
        self.index = index
        self.name = name
        self.slots = slots
        self.dtype = dtype
        self.device = device
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = padded_shard_numel(self.numel, world_size)
        # Sizes, fixed for the group's life (read on every fetch: plain attributes, not properties).
        self.padded_numel = self.shard_numel * world_size
        self.shard_nbytes = self.shard_numel * torch.empty((), dtype=dtype).element_size()
        self.full_nbytes = self.shard_nbytes * world_size
        self.rank = rank
        self.world_size = world_size
        self.state = ParamState.NOT_AVAILABLE
        self.persistent = False
        # Filled by the coordinator: the tier key of this rank's shard, and the
        # group's start in this rank's flat fp32 optimizer space.
        self.param_key: int | None = None
        self.flat_offset = 0
        self.full: torch.Tensor | None = None
        self.pending = None
        # Lends the gathered tensor its memory (infinity.runtime.gather_memory.GatherMemory);
        # set by the coordinator that owns the group.
        self.memory = None
        self._flat: torch.Tensor | None = None
        # (flat, views): the parameters' views of the gathered flat tensor, made once while its memory is
        # lent (the storage object stays; only its data pointer moves, see infinity/runtime/gather_memory.py).
        self._views: tuple | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots]

    @property
    def has_trainable(self) -> bool:
        """Whether a parameter of the group requires grad now (``trainable``: all of them, as built)."""
        return any(s.param.requires_grad for s in self.slots)

    def __repr__(self) -> str:
        return f"ParamGroup({self.index}, {self.name!r}, numel={self.numel}, {self.state.name})"

    # -- flat layout -------------------------------------------------------------------------
    def flatten(self, tensors: list[torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The padded flat tensor of the parameters' current values (or of ``tensors``), in the compute
        dtype unless ``dtype`` says otherwise."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=self.device)
        for slot, t in zip(self.slots, tensors or [s.param.data for s in self.slots]):
            flat[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        start = self.rank * self.shard_numel
        return flat[start:start + self.shard_numel]

    def flat_buffer(self, source: torch.Tensor | None = None) -> torch.Tensor:
        """The group's gathered flat tensor, with memory behind it; fill it through ``.data``.

        ``source``: the group's whole shard in the compute device's memory, to be used as the
        gathered tensor's memory itself (one rank, the device tier: no copy).
        """
        if self.memory is None:   # a group no coordinator owns (tests): plain memory of its own
            if self._flat is None:
                self._flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
            return self._flat
        self._flat = self.memory.attach(self._flat, self.padded_numel, self.dtype, f"gathered {self.name}", source,
                                        kept=self.persistent)
        return self._flat

    # -- transitions -------------------------------------------------------------------------
    def _expect(self, *states: ParamState, to: str) -> None:
        if self.state not in states:
            allowed = " or ".join(s.name for s in states)
            raise ParamStateError(
                f"parameter group {self.name!r} (#{self.index}): cannot become {to} from "
                f"{self.state.name}; expected {allowed}")

    def to_inflight(self, pending) -> None:
        self._expect(ParamState.NOT_AVAILABLE, to="INFLIGHT")
        self.pending = pending
        self.state = ParamState.INFLIGHT

    def cancel_inflight(self):
        """A read ahead nobody will use: back to NOT_AVAILABLE without a gather; returns its pending fetch."""
        self._expect(ParamState.INFLIGHT, to="NOT_AVAILABLE")
        pending, self.pending = self.pending, None
        self.state = ParamState.NOT_AVAILABLE
        return pending

    def to_available(self, full: torch.Tensor) -> None:
        """Point every parameter at its view of the gathered flat tensor."""
        self._expect(ParamState.INFLIGHT, to="AVAILABLE")
        self.full = full
        self.pending = None
        if self._views is not None and self._views[0] is full:
            views = self._views[1]
        else:
            views = [full[slot.offset:slot.offset + slot.numel].view(slot.shape) for slot in self.slots]
            lent = full is self._flat and self.memory is not None and self.memory.lending
            self._views = (full, views) if lent else None
        for slot, view in zip(self.slots, views):
            param = slot.param
            cls = type(param)
            if cls in ORIGINAL_OF:              # its own class again before .data is set
                param.__class__ = ORIGINAL_OF[cls]
            param.data = view
        self.state = ParamState.AVAILABLE

    def to_not_available(self, keep_views: bool = False) -> None:
        """Drop the gathered tensor; parameters go back to empty placeholders.

        With ``keep_views`` the parameters keep their shapes over the now memoryless tensor until
        ``drop_views``: autograd may still store a gradient for them, and it shapes the gradient
        after the parameter (see [Note: one gradient hook per group] in infinity/runtime/hooks.py).
        """
        self._expect(ParamState.AVAILABLE, to="NOT_AVAILABLE")
        if not keep_views:
            self.drop_views()
        if self.full is self._flat and self._flat is not None and self.memory is not None:
            self.memory.detach(self._flat)
        self.full = None
        self.state = ParamState.NOT_AVAILABLE

    def part_with_escaped(self) -> None:
        """Before a release from ``infinity.gathered``: tensors made in the block that share the gathered memory
        (a state dict taken there, ``p.data`` kept, a graph's saved weights) keep their values in memory of their
        own, and this group takes new memory at its next gather ([Note: tensors that outlive a block] in
        infinity/runtime/gathered.py)."""
        flat = self._flat
        if flat is None or self.memory is None or self.full is not flat or self.state is not ParamState.AVAILABLE:
            return
        storage = flat.untyped_storage()
        mine = storage._cdata
        views = self._views[1] if self._views is not None and self._views[0] is flat else ()
        on_it = sum(1 for slot in self.slots if slot.param.untyped_storage()._cdata == mine)
        held = 2 + len(views) + on_it      # the flat tensor, ``storage`` here, the cached views, the parameters
        if torch._C._storage_Use_Count(mine) > held:
            self.memory.give_away(flat)
            self._flat, self._views = None, None

    def drop_views(self) -> None:
        """Parameters become empty placeholders that refuse reads (a released group, or one released with
        ``keep_views``; see [Note: released placeholders] in infinity/runtime/placeholder.py)."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for slot in self.slots:
            param = slot.param
            param.data = empty
            cls = type(param)
            released = RELEASED_OF[cls] if cls in RELEASED_OF else released_class(cls)
            if released is not None:
                param.__class__ = released
