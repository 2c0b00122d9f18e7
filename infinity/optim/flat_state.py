"""Each rank's fp32 master weights, Adam moments and gradient accumulator, flat per sub-group.

The flat space and its sub-groups are ``FlatLayout``'s ([Note: flat layout] in infinity/optim/flat_layout.py).
Two states may be stored narrower and widened for the kernel: the master as the compute copy plus a 16-bit
remainder ([Note: split master] in infinity/optim/split_master.py) and the gradient in the compute dtype
([Note: compact gradients] in infinity/optim/compact_grads.py).

[Note: dormant sub-groups]
A sub-group holding only groups that were frozen at ``infinity.Init``'s exit, or when the optimizer
was created ([Note: sub-groups apart for frozen groups] in infinity/optim/flat_layout.py, [Note: frozen
after Init] in infinity/optim/relayout.py) is dormant: it has master weights but
no moment or gradient keys, so a frozen base under trained adapters holds 4 (or, split, 2) bytes
per parameter in the optimizer tier instead of 16. Its first gradient (a group unfrozen later) or
a load bringing it nonzero moments wakes it: its keys are allocated then, zero, as at the start.
Until then its moments read as zeros.
With bf16 compute and a separate fp32 master (states in host memory or on NVMe, the compute
copies in any tier), a dormant sub-group's masters are stored split meanwhile, as its compute copy
plus a 16-bit remainder ([Note: split master] in infinity/optim/split_master.py): 2 bytes per
parameter instead of 4, exact. The join and split that make split masters slow to step cost nothing
here, since a dormant sub-group is never stepped; it is joined into an fp32 master once, when it
wakes (with the copies on the device, a read of them to host memory then, and at checkpoint saves).

What the room may touch: the optimizer tier (keys, reads, writes) and the host
allocator for the streaming buffers; it knows nothing of modules or the coordinator.
"""
from __future__ import annotations

import functools
from typing import Iterator, Sequence

import torch

from infinity.errors import EngineError, add_note
from infinity.optim import compact_grads, pipeline, split_master
from infinity.optim.flat_layout import FlatLayout
from infinity.optim.moments import MomentFormat, read_moments, write_moments
from infinity.optim.pipeline import MOMENTS, STATES, stored_len
from tiers.aio import aligned_empty
from tiers.base import wait_quietly

# The arrays the update streams side by side start apart in host memory ([Note: staggered starts] in
# tiers/host_alloc.py): 2x on torch's fused AdamW over 128 MiB sub-groups here.
_STAGGER = {"master": 0, "exp_avg": 1, "exp_avg_sq": 2, "grad": 3, "grad_compact": 4, "copy": 5, "remainder": 6}
_F32 = 4
_MAX_PENDING_BYTES = 64 * 2**20


def allocate_key(store, state: str, nbytes: int, tag: str, sub: int) -> int:
    """A key of ``nbytes`` in sub-group ``sub``'s tier for its ``state`` (also a second or widened
    gradient key), in host memory started apart from the other states' ([Note: staggered starts] in
    tiers/host_alloc.py)."""
    stagger = {"stagger": _STAGGER[state]} if store.in_place_of(sub) else {}
    return store.sub_tiers[sub].allocate(nbytes, tag=tag, **stagger)


class _Unbooked:
    """The tier's own reads and writes, for a store used without an engine's data path."""

    @staticmethod
    def read(tier, key: int, dst: torch.Tensor, offset: int = 0, into: str = "host"):
        return tier.read(key, dst, offset)

    @staticmethod
    def write(tier, key: int, src: torch.Tensor, offset: int = 0, source: str = "host"):
        return tier.write(key, src, offset)


def _fill_fresh(store, sub: int, fresh: dict, zero: bool) -> None:
    """What sub-group ``sub``'s new keys ``fresh`` start with as it wakes: its resting masters, joined; zeros
    (on NVMe only with ``zero``: else a first pass or an adopted checkpoint in place fills them)."""
    tier = store.sub_tiers[sub]
    if ("master", sub) in fresh:
        store.io.write(tier, fresh["master", sub], store.resting.read_sub(sub)).wait()
    if store.in_place_of(sub):
        for s in (*MOMENTS, "grad"):
            tier.view(fresh[s, sub]).zero_()
        return
    if not zero:
        return
    if ("remainder", sub) in fresh:
        store.split.write_zeros(sub, fresh["remainder", sub])
    numel = store.layout.sub_ranges[sub][1]
    zeros = torch.zeros(min(_MAX_PENDING_BYTES, store.moment_format.stored_nbytes("exp_avg_sq", numel)),
                        dtype=torch.uint8)
    for s in MOMENTS:
        size = store.moment_format.stored_nbytes(s, numel)
        for at in range(0, size, zeros.numel()):
            store.io.write(tier, fresh[s, sub], zeros[:size - at], offset=at).wait()


def _master_split(store, sub: int):
    """The ``SplitMasters`` holding sub-group ``sub``'s masters, or None (an fp32 master key)."""
    if store.split is not None:
        return store.split
    if store.resting is not None and store.resting.keys[sub] is not None:
        return store.resting
    return None


class OptimizerStateStore:
    """The optimizer states of one rank, in the device, host or NVMe tier, or split over them.

    Parameters
    ----------
    tier:
        ``tiers.DeviceTier`` or ``tiers.HostTier`` (states viewed in place) or ``tiers.NVMeTier``
        (states streamed through two sets of sub-group buffers).
    layout:
        The flat layout.
    allocator:
        ``tiers.HostAllocator`` for the NVMe streaming buffers.
    datapath:
        Moves and books the tier transfers (``infinity.runtime.datapath.DataPath``); None:
        the tier's own reads and writes, unbooked (tests of the store alone).
    copies:
        ``infinity.optim.split_master.CopyAccess`` to store each master as its bf16 compute copy
        plus a 16-bit remainder (see [Note: split master] in infinity/optim/split_master.py), or
        None: a separate fp32 master.
    grad_dtype:
        The dtype the gradient keys start in: fp32, or the compute dtype until micro-batches
        accumulate (see [Note: compact gradients] in infinity/optim/compact_grads.py).
    moment_format:
        How Adam's m and v are stored (``infinity.optim.moments.MomentFormat``); None: fp32.
        Compressed moments are raw bytes in their keys and buffers (see [Note: compressed
        moments] in infinity/optim/moments.py); ``read_state_shard`` and ``write_state_shard``
        decode and encode them.
    dormant:
        Sub-groups without moments and gradient until they wake ([Note: dormant sub-groups]).
    dormant_copies:
        ``CopyAccess`` to store the dormant sub-groups' masters split while they sleep, or None.
    sub_tiers:
        The tier of each sub-group when the states are split over tiers ([Note: optimizer states over
        tiers] in infinity/optim/tier_split.py): runs of sub-groups, fastest tier first; None: all in ``tier``.
        A split store keeps fp32 masters (neither ``copies`` nor ``dormant_copies``).
    """

    def __init__(self, tier, layout: FlatLayout, allocator=None, *, defer_states: bool = False,
                 datapath=None, copies=None, grad_dtype: torch.dtype = torch.float32,
                 moment_format: MomentFormat | None = None, dormant=(), dormant_copies=None,
                 sub_tiers=None) -> None:
        # Each sub-group's tier ([Note: optimizer states over tiers] in infinity/optim/tier_split.py).
        self.sub_tiers = list(sub_tiers) if sub_tiers is not None else [tier] * layout.num_subs
        if len(self.sub_tiers) != layout.num_subs:
            raise EngineError(f"{len(self.sub_tiers)} sub-group tiers for {layout.num_subs} sub-groups (internal error)")
        self.tiers = list({id(t): t for t in self.sub_tiers}.values()) or [tier]    # each tier once, fastest first
        if len(self.tiers) > 1 and (copies is not None or dormant_copies is not None):
            raise EngineError("optimizer states split over tiers keep fp32 masters (internal error)")
        self.moment_format = moment_format or MomentFormat()
        self.io = datapath if datapath is not None else _Unbooked()
        self.layout = layout
        self.streamed_subs = [sub for sub, t in enumerate(self.sub_tiers) if not hasattr(t, "view")]
        self.in_place = all(hasattr(t, "view") for t in self.tiers)     # every sub-group's states viewed in memory
        self.grad_dtype = grad_dtype
        # The masters split into compute copy and remainder (see [Note: split master]), or None.
        self.split = None
        # Sub-groups without moment and gradient keys yet ([Note: dormant sub-groups]); ``on_wake``:
        # called with each sub-group that gets them (DPU gives it a second gradient key).
        self.dormant: set[int] = set(dormant)
        self.woken: set[int] = set()    # dormant when the store was built, not any more
        self.on_wake: list = []     # each returns what undoes it
        # The dormant sub-groups' masters stored split meanwhile (their remainder keys), or None.
        self.resting = None
        self._pending_writes: list = []
        n = layout.sub_group_size
        def empty(nbytes: int, state: str) -> torch.Tensor:
            if allocator is None:
                return torch.empty(nbytes, dtype=torch.uint8)
            return allocator.empty(nbytes, stagger=_STAGGER[state])

        # Allocated before any key (short of host memory, no key is left behind): two sets of sub-group buffers the streamed sub-groups pass through ([Note: pipelined sub-groups] in
        # infinity/optim/pipeline.py), and the scratch of the sub-group stepped in place.
        self.slots: list[dict] = []
        self.scratch: dict = {}
        streams, in_place = bool(self.streamed_subs), len(self.streamed_subs) < layout.num_subs
        if streams:
            fmt = self.moment_format
            self.slots = [{s: empty(fmt.stored_nbytes(s, n), s).view(fmt.stored_dtype(s)) for s in STATES}
                          for _ in range(2)]
        if copies is not None and in_place:    # the joined masters of the sub-group being stepped
            self.scratch["master"] = empty(n * _F32, "master").view(torch.float32)
        if copies is not None:
            for bufs in [*self.slots, *([self.scratch] if in_place else [])]:
                bufs["copy"] = empty(n * 2, "copy").view(torch.bfloat16)
                bufs["remainder"] = empty(n * 2, "remainder").view(torch.int16)
        if grad_dtype != torch.float32:     # a compact gradient sub-group, widened into "grad"
            if in_place:
                self.scratch["grad"] = empty(n * _F32, "grad_compact").view(torch.float32)
            for bufs in self.slots:
                bufs["grad_compact"] = empty(n * compact_grads.itemsize(grad_dtype), "grad_compact").view(grad_dtype)
        # Dormant sub-groups' remainder keys come with the first nonzero remainder ([Note: zero remainders]).
        def allocate_remainder(sub: int, nbytes: int) -> int:
            return allocate_key(self, "remainder", nbytes, f"remainder:sub{sub}", sub)

        if copies is not None:
            keys = self._allocate("remainder", split_master.REMAINDER_ITEMSIZE, skip=self.dormant)
            self.keys = {"remainder": [split_master.ZERO if sub in self.dormant else k for sub, k in enumerate(keys)]}
            self.split = split_master.SplitMasters(copies, layout, self.tier, self.io, self.keys["remainder"],
                                                   allocate=allocate_remainder)
        else:
            resting = self.dormant if dormant_copies is not None else set()
            self.keys = {"master": self._allocate("master", skip=resting)}
            if resting:
                self.resting = split_master.SplitMasters(
                    dormant_copies, layout, self.tier, self.io,
                    [split_master.ZERO if sub in resting else None for sub in range(layout.num_subs)],
                    allocate=allocate_remainder)
        # Groups whose compute copy this store writes with their masters (split masters).
        self.copy_writers = {p.group_index for sub in range(layout.num_subs) for p in layout.pieces_of_sub[sub]
                             if _master_split(self, sub) is not None}
        self.moments_initialized = False
        self.grad_written: set[int] = set()
        # What arrived since zero_grad, and the running norm (``GradientBook``, kept on the compute
        # device by the gradient reducer); zero_grad resets it with the accumulator.
        self.book = None
        # With the update during backward ([Note: update during backward] in infinity/optim/in_backward.py):
        # the gradients of streamed sub-groups held in host memory instead of their NVMe keys (``HeldGrads``;
        # those in memory arrive in their accumulators as always), and what refuses a second gradient of a
        # group before the step.
        self.held = None
        self.refuse_second_grad = None
        self.before_zero_grad = None
        # Called before the gradient keys widen to fp32 ([Note: compact gradients] in optim/compact_grads.py).
        self.before_widen = None
        self.land_grads = None      # lands gradient copies still in flight to the keys (GradReducer.land_direct)
        if not defer_states:
            self.allocate_states()

    def _allocate(self, state: str, itemsize: int | None = None, skip=()) -> list[int | None]:
        """One key per sub-group but those in ``skip`` (None): ``itemsize`` bytes per element, or the
        state's stored size. All of them or none (a full tier keeps nothing)."""
        keys: list[int | None] = []
        try:
            for i, (_, n) in enumerate(self.layout.sub_ranges):
                nbytes = n * itemsize if itemsize is not None else self.moment_format.stored_nbytes(state, n)
                keys.append(None if i in skip else allocate_key(self, state, nbytes, f"{state}:sub{i}", i))
        except BaseException:
            for i, key in enumerate(keys):
                if key is not None:
                    self.sub_tiers[i].free(key)
            raise
        return keys

    def allocate_states(self) -> None:
        """Allocate Adam's moments and the gradient accumulator (zero on in-place tiers), except for
        the dormant sub-groups' ([Note: dormant sub-groups]).

        [Note: allocation order] The engine allocates the master weights first, moves the
        initial masters in and frees their temporary keys, and only then calls this: the
        freed space is reused for the moments instead of leaving holes the size of the
        masters in the swap files.
        """
        num_subs, asleep = self.layout.num_subs, set(self.dormant)
        for s in (*MOMENTS, "grad"):
            self.keys[s] = [None] * num_subs
        self.dormant = set(range(num_subs))
        # On NVMe the first pass over the sub-groups writes their zero moments.
        self.wake([sub for sub in range(num_subs) if sub not in asleep], zero=False)
        self.woken.clear()
        self.moments_initialized = not self.streamed_subs

    def wake(self, subs, zero: bool = True) -> None:
        """Give the dormant sub-groups among ``subs`` their moment, gradient (and split masters' remainder)
        keys, zero (see ``_fill_fresh``); all or none: a failure allocating or writing them keeps nothing."""
        subs = sorted(self.dormant.intersection(subs))
        if not subs:
            return
        fresh: dict[tuple[str, int], int] = {}
        undo: list = []
        try:    # all of them or none: a tier too full to take them loses nothing
            for s in (*MOMENTS, "grad", "master", "remainder"):
                for sub in subs:
                    n = self.layout.sub_ranges[sub][1]
                    if s == "master" and (self.resting is None or self.resting.keys[sub] is None):
                        continue
                    if s == "remainder" and (self.split is None or self.split.keys[sub] != split_master.ZERO):
                        continue    # split masters step their remainder keys: a woken one gets its own
                    nbytes = (n * compact_grads.itemsize(self.grad_dtype) if s == "grad" else n * _F32
                              if s == "master" else n * split_master.REMAINDER_ITEMSIZE if s == "remainder"
                              else self.moment_format.stored_nbytes(s, n))
                    fresh[s, sub] = allocate_key(self, s, nbytes, f"{s}:sub{sub}", sub)
            for sub in subs:
                undo.extend(hook(sub) for hook in self.on_wake)
            for sub in subs:    # every byte into the new keys first: a failure here keeps nothing either
                _fill_fresh(self, sub, fresh, zero)
        except BaseException as exc:
            for step_back in reversed(undo):
                step_back()
            for (_, sub), key in fresh.items():
                self.sub_tiers[sub].free(key)
            add_note(exc, f"infinity: while giving sub-group(s) {subs} their optimizer states (nothing kept): groups "
                          "frozen when infinity.Init exited (or when the optimizer was created) get Adam moments and "
                          "gradients when they first train or load moments, beyond what infinity-plan counted")
            raise
        for (s, sub), key in fresh.items():
            if s == "remainder":
                self.split.keys[sub] = key
            elif s != "master":
                self.keys[s][sub] = key
        for sub in subs:
            if ("master", sub) in fresh:    # the resting masters, joined into it
                self.keys["master"][sub] = fresh["master", sub]
                self.resting.free(sub)
                self.copy_writers.difference_update(p.group_index for p in self.layout.pieces_of_sub[sub])
        # Last: an update on another thread (during backward) streams the sub-groups not dormant.
        self.dormant.difference_update(subs)
        self.woken.update(subs)

    # -- where the states are -------------------------------------------------------------------
    @property
    def tier(self):
        """The tier holding every sub-group's states (a store split over tiers has none: ``sub_tiers``)."""
        if len(self.tiers) > 1:
            raise EngineError("the optimizer states are split over the " + ", ".join(t.kind for t in self.tiers) +
                              " tiers; this path takes one tier (internal error: ask sub_tiers[sub])")
        return self.tiers[0]

    def in_place_of(self, sub: int) -> bool:
        """Whether sub-group ``sub``'s states are viewed in memory (device or host tier), not streamed."""
        return hasattr(self.sub_tiers[sub], "view")

    # -- access ---------------------------------------------------------------------------------
    def view(self, state: str, sub: int) -> torch.Tensor:
        """The in-place view of one state of one sub-group (device or host tier): fp32, gradients in
        ``grad_dtype``, the raw bytes of compressed moments."""
        dtype = self.grad_dtype if state == "grad" else self.moment_format.stored_dtype(state)
        return self.sub_tiers[sub].view(self.keys[state][sub]).view(dtype)

    def write_master_shard(self, group_index: int, fp32_shard: torch.Tensor) -> None:
        """Set the master weights of one group (initial values, resharded loads); split masters
        also write the group's compute copy, their rounding."""
        for piece in self.layout.pieces_of_group[group_index]:
            src = fp32_shard[piece.group_offset:piece.group_offset + piece.numel]
            split = _master_split(self, piece.sub_index)
            if split is None:
                self._write(("master", piece), src)
            else:
                self._pending_writes.extend(split.write_piece(piece, src))
        self.flush()

    def read_state_shard(self, state: str, group_index: int) -> torch.Tensor:
        """One group's shard of ``state`` as a new fp32 tensor (checkpoints, gathered views)."""
        self.flush()
        out = torch.empty(self.layout.shard_numels[group_index], dtype=torch.float32)
        for piece in self.layout.pieces_of_group[group_index]:
            dst = out[piece.group_offset:piece.group_offset + piece.numel]
            if state == "master" and _master_split(self, piece.sub_index) is not None:
                _master_split(self, piece.sub_index).read_piece(piece, dst)
            elif state in MOMENTS and (piece.sub_index in self.dormant or not (
                    self.moments_initialized or self.in_place_of(piece.sub_index))):
                dst.zero_()
            elif state == "grad" and group_index not in self.grad_written:
                dst.zero_()
            elif state == "grad" and self.held is not None and not self.in_place_of(piece.sub_index):
                self.held.read(piece, dst)
            elif state == "grad" and self.grad_dtype != torch.float32:
                compact = aligned_empty(piece.numel * self.grad_dtype.itemsize).view(self.grad_dtype)  # no I/O pool
                self.io.read(self.sub_tiers[piece.sub_index], self.keys[state][piece.sub_index], compact,
                             offset=piece.sub_offset * compact.element_size()).wait()
                dst.copy_(compact)
            elif state in MOMENTS and self.moment_format.compressed:
                dst.copy_(read_moments(self, state, piece.sub_index, piece.sub_offset, piece.sub_offset + piece.numel))
            else:
                self.io.read(self.sub_tiers[piece.sub_index], self.keys[state][piece.sub_index], dst,
                               offset=piece.sub_offset * _F32).wait()
        return out

    def write_state_shard(self, state: str, group_index: int, values: torch.Tensor) -> None:
        if state == "master":
            self.write_master_shard(group_index, values)
            return
        if state == "grad" and self.refuse_second_grad is not None:
            raise EngineError("gradient shards cannot be edited with optimizer.update_in_backward = true (each "
                              "sub-group is stepped as soon as its gradients are in); set the key to false")
        # Zeros leave a dormant sub-group dormant (they are what it holds).
        pieces = [p for p in self.layout.pieces_of_group[group_index]
                  if p.sub_index not in self.dormant or values[p.group_offset:p.group_offset + p.numel].any()]
        self.wake(p.sub_index for p in pieces)
        if state == "grad":
            # edited gradients (clip_grad_value_) need not fit the compute dtype
            compact_grads.widen(self, functools.partial(allocate_key, self, "grad"))
        for piece in pieces:
            src = values[piece.group_offset:piece.group_offset + piece.numel]
            if state in MOMENTS and self.moment_format.compressed:
                write_moments(self, state, piece.sub_index, piece.sub_offset, src)
            else:
                self._write((state, piece), src)
        if state in MOMENTS:
            self.moments_initialized = True
        self.flush()

    def _write(self, where, src: torch.Tensor):
        state, piece = where
        src = src.contiguous()
        fut = self.io.write(self.sub_tiers[piece.sub_index], self.keys[state][piece.sub_index], src,
                            offset=piece.sub_offset * src.element_size())
        self._pending_writes.append((fut, src))
        # Gradient shards arrive throughout backward: keep only unfinished writes (and
        # their source tensors) referenced, and at most _MAX_PENDING_BYTES of them.
        pending = [(f, t) for f, t in self._pending_writes if not f.done()]
        while sum(t.numel() for _, t in pending) * _F32 > _MAX_PENDING_BYTES and len(pending) > 1:
            f, _ = pending.pop(0)
            f.wait()
        self._pending_writes = pending
        return fut

    def flush(self) -> None:
        """Wait for every write this store issued."""
        pending, self._pending_writes = self._pending_writes, []
        for fut, _src in pending:
            fut.wait()

    # -- gradients ------------------------------------------------------------------------------
    def accumulate_grad(self, group_index: int, shard_grad: torch.Tensor) -> list:
        """Add one group's reduce-scattered gradient shard (any float dtype) to the fp32 accumulator.

        Returns the futures of the writes still reading ``shard_grad`` (NVMe): the caller keeps
        it unchanged until they are done.
        """
        first = group_index not in self.grad_written
        if self.dormant:    # a group frozen at Init's exit, unfrozen since
            self.wake(p.sub_index for p in self.layout.pieces_of_group[group_index])
        if not first and self.refuse_second_grad is not None:
            self.refuse_second_grad(group_index)
        if self.held is not None and not self.in_place_of(self.layout.pieces_of_group[group_index][0].sub_index):
            self.held.accumulate(group_index, shard_grad)
            self.grad_written.add(group_index)
            return []
        if not first:
            compact_grads.widen(self, functools.partial(allocate_key, self, "grad"))   # micro-batches accumulate: in fp32 from now on
        futures = []
        for piece in self.layout.pieces_of_group[group_index]:
            src = shard_grad[piece.group_offset:piece.group_offset + piece.numel]
            if self.in_place_of(piece.sub_index):
                dst = self.view("grad", piece.sub_index)[piece.sub_offset:piece.sub_offset + piece.numel]
                dst.copy_(src) if first else dst.add_(src)
            elif first:
                futures.append(self._write(("grad", piece), src.to(self.grad_dtype)))
            else:
                self.flush()  # this group's earlier writes must land before read-add-write
                old = torch.empty(piece.numel, dtype=torch.float32)
                self.io.read(self.sub_tiers[piece.sub_index], self.keys["grad"][piece.sub_index], old,
                             offset=piece.sub_offset * _F32).wait()
                self._write(("grad", piece), old.add_(src))
        self.grad_written.add(group_index)
        return futures

    def direct_grad(self, group_index: int, dtype: torch.dtype) -> list | None:
        """Where a group's first fp32 gradient shard can be written straight into the accumulator:
        ``[(shard offset, numel, accumulator view)]`` per piece, or None (it must go through
        ``accumulate_grad``: not in host or device memory, another dtype, or a second micro-batch).
        The caller fills the views; the group counts as written from here on."""
        if dtype != self.grad_dtype:
            return None
        return self.first_grad_views(group_index)

    def first_grad_views(self, group_index: int) -> list | None:
        """The fp32 accumulator views a group's first gradient shard is written into, by the caller
        (any dtype, converted by ``copy_``): ``[(shard offset, numel, view)]``, or None when the
        states are not in memory or the group was written since ``zero_grad``. The group counts
        as written from here on."""
        pieces = self.layout.pieces_of_group[group_index]
        if not all(self.in_place_of(p.sub_index) for p in pieces) or group_index in self.grad_written:
            return None
        if self.dormant:
            self.wake(p.sub_index for p in self.layout.pieces_of_group[group_index])
        self.grad_written.add(group_index)
        return [(piece.group_offset, piece.numel,
                 self.view("grad", piece.sub_index)[piece.sub_offset:piece.sub_offset + piece.numel])
                for piece in self.layout.pieces_of_group[group_index]]

    def zero_grad(self) -> None:
        if self.before_zero_grad is not None:
            self.before_zero_grad()
        self.flush()
        self.grad_written.clear()
        if self.book is not None:
            self.book.reset()

    @property
    def has_grad(self) -> bool:
        return bool(self.grad_written)

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's accumulated gradient shard, in float64 (a pass over the
        stored sum: for when accumulating micro-batches hid it from the running norm)."""
        total = torch.zeros((), dtype=torch.float64)
        for gi in sorted(self.grad_written):
            total += self.read_state_shard("grad", gi).double().pow(2).sum()
        return total

    def swap_grad_keys(self, keys: list[int]) -> tuple[int, ...]:
        """Accumulate into ``keys`` from now on; returns the keys used so far, flushed (DPU's hand-off)."""
        self.flush()
        filled = tuple(self.keys["grad"])
        self.keys["grad"] = list(keys)
        return filled

    # -- the sub-group pipeline ([Note: pipelined sub-groups] in infinity/optim/pipeline.py) ------------
    def sub_groups(self, grad_keys: Sequence[int], changed: Sequence[bool], grads: dict | None = None,
                   compact: bool = False, streamed: bool = True) -> Iterator[tuple]:
        """Yield ``(sub, {state: tensor}, writes)`` for each sub-group an update must visit, in order
        (``infinity.optim.pipeline.sub_groups``)."""
        return pipeline.sub_groups(self, grad_keys, changed, grads, compact, streamed)
