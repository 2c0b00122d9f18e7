"""Each rank's shard of every parameter group, in the compute dtype, in the parameter tier.

The coordinator reads shards from here to gather groups; the optimizer's update writes
new compute copies here; checkpoints and ``infinity.gathered`` write edited values
here. Every byte that enters or leaves the parameter tier goes through ``ParamShards``,
so it alone knows the two ways a fetch is served without a tier read (a fresh shard
the overlapped update, or the update during backward, left in host memory) or must wait (the update has not rewritten
the shard yet).

[Note: staging buffers]
Direct (O_DIRECT) reads need page-aligned destinations. The demand pool is created at
the first fetch after construction, with buffers as large as the largest shard, and
reused for the rest of training: no allocation on the hot path, whatever the shard. (A
pool capped below the largest shard sent the larger shards through memory allocated per
fetch: a C-heap block per fetch that the allocator keeps, so the resident set grew with
the number of such groups.) A buffer is made when a read first finds every existing one
lent, up to DEMAND_STAGING_BUFFERS (one being read, one being gathered, one spare), so
the pool holds as many as demand reads ever overlapped: with the prefetcher reading ahead
into its arena, and one group per transformer block, that is one (GPT 1B, fp32, everything
on NVMe: 1 of 3 in use over four steps; each buffer is zeroed when made, so the two never
used held 737 MiB of the process's resident set). ``infinity-plan`` counts all three, the
most there can be. A very wide layer makes these buffers large: tile it
(``[tiling]``), which also bounds the device working set. Reads issued ahead by the
prefetcher land in their own arena of ``prefetch.nvme_bytes``
(infinity/prefetch/prefetcher.py).

What the room may touch: the parameter tier and the host allocator; the groups' keys.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from infinity.param_group import ParamGroup
from infinity.prefetch.fresh_shards import FreshShards
from tiers.aio import aligned_empty
from tiers.base import CompletedFuture

DEMAND_STAGING_BUFFERS = 3


class DemandStaging:
    """Aligned staging buffers for NVMe shard reads, made at first use (see [Note: staging buffers]).

    Parameters
    ----------
    allocator:
        ``tiers.HostAllocator`` (pinned and NUMA-bound as configured).
    largest_shard_nbytes:
        Returns the largest shard's size, read at first use, once construction is over.
    """

    def __init__(self, allocator, largest_shard_nbytes: Callable[[], int]) -> None:
        self.allocator = allocator
        self.largest_shard_nbytes = largest_shard_nbytes
        self._pools: list = []      # one buffer each, made as overlapping reads first need them
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int, owner: str):
        """A buffer of at least ``nbytes`` bytes, or None when shards this size bypass the pool or none is free.

        Never waits: the holders are reads issued ahead of the one being waited for (a
        gather issues all, then waits in order), so waiting could deadlock.
        """
        with self._lock:
            for pool in self._pools:
                if nbytes > pool.buffer_nbytes:
                    return None
                loan = pool.try_acquire(owner=owner)
                if loan is not None:
                    return loan
            if len(self._pools) == DEMAND_STAGING_BUFFERS:
                return None
            from tiers.pool import BufferPool

            size = self._pools[0].buffer_nbytes if self._pools else self.largest_shard_nbytes()
            if nbytes > size:
                return None
            try:
                pool = BufferPool(size, 1, self.allocator, name="param-staging")
            except (MemoryError, RuntimeError) as exc:     # the allocator's own errors say only the bytes
                raise type(exc)(
                    f"NVMe read staging buffer {len(self._pools) + 1} of {DEMAND_STAGING_BUFFERS} (each the size of "
                    f"the largest parameter shard, {size:,} bytes) could not be made while reading for {owner}: "
                    f"{exc}. Nothing was lost; a smaller largest group (tiling.modules for a wide layer, or "
                    "partition.units) or more host memory (tiers.host_budget) makes it fit") from exc
            self._pools.append(pool)
            return pool.try_acquire(owner=owner)

    def stats(self) -> dict | None:
        """The buffers made so far (``buffers``, at most DEMAND_STAGING_BUFFERS) and their use, as one pool's."""
        with self._lock:
            parts = [pool.stats() for pool in self._pools]
        if not parts:
            return None
        out = dict(parts[0], buffers=len(parts), nbytes=sum(p["nbytes"] for p in parts))
        for key in ("in_use", "acquires", "waits", "wait_seconds"):
            out[key] = sum(p[key] for p in parts)
        # Buffer i is made only when buffers 0..i-1 are all lent, so the most in use at once is the count made.
        out["peak_in_use"] = sum(p["peak_in_use"] for p in parts)
        return out


class ParamShards:
    """The parameter tier's view of the groups: one key per group holding this rank's shard.

    Parameters
    ----------
    tier:
        The parameter tier (``tiers.params``).
    dtype:
        The compute dtype, in which shards are stored.
    datapath:
        Moves and books every byte (``infinity.runtime.datapath.DataPath``).
    staging:
        A :class:`DemandStaging` for direct NVMe reads, or None (in-memory tiers).
    """

    def __init__(self, tier, dtype: torch.dtype, datapath, staging: DemandStaging | None = None) -> None:
        self.tier = tier
        self.kind = tier.kind       # where the shards live: "device", "host" or "nvme"
        self.dtype = dtype
        self.datapath = datapath
        self.staging = staging
        # The overlapped optimizer step still rewriting shards (infinity.optim.background.BackgroundUpdate),
        # or None, and the shards it has just rewritten, in host memory (see [Note: fresh shards]).
        self.update_gate = None
        self.fresh: FreshShards | None = None

    # -- whole shards ------------------------------------------------------------------------------
    def put(self, group: ParamGroup, shard: torch.Tensor | None) -> None:
        """Store the group's first shard (partitioning; ``shard`` is in host memory, any float dtype).

        None allocates the key without writing it: the caller writes the shard later (a group whose
        values come from a checkpoint at the end of construction).
        """
        group.param_key = self.tier.allocate(group.shard_nbytes, tag=f"param:{group.name}")
        if shard is None:
            return
        src = shard
        if shard.dtype != self.dtype:   # page-aligned, so an NVMe write goes straight from it, not through the I/O pool
            src = aligned_empty(shard.numel() * self.dtype.itemsize).view(self.dtype).copy_(shard)
        self.datapath.write(self.tier, group.param_key, src).wait()

    def free(self, group: ParamGroup) -> None:
        self.tier.free(group.param_key)

    def write(self, group: ParamGroup, values: torch.Tensor, offset_numel: int = 0):
        """Start writing ``values`` (compute dtype, or converted) into the group's shard at an element offset."""
        if self.fresh is not None:
            self.fresh.discard(group)
        src = values if values.dtype == self.dtype else values.to(self.dtype)
        return self.datapath.write(self.tier, group.param_key, src.contiguous(), offset_numel * src.element_size())

    def read(self, group: ParamGroup, into: torch.Tensor):
        """Start reading the group's shard into host memory ``into`` (compute dtype, ``shard_numel`` long)."""
        return self.datapath.read(self.tier, group.param_key, into)

    def stored(self, group: ParamGroup) -> torch.Tensor:
        """The group's stored shard itself (in-memory tiers: host or device memory; aliases it, no copy)."""
        return self.tier.view(group.param_key)[:group.shard_nbytes].view(self.dtype)

    def staging_buffer(self, group: ParamGroup) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Where a demand read of the group lands, and how to give it back (None: nothing to give)."""
        if self.staging is not None:
            buf = self.staging.try_acquire(group.shard_nbytes, owner=f"param:{group.name}")
            if buf is not None:
                return buf.tensor[:group.shard_nbytes].view(self.dtype), buf.release
        # All three lent (reads issued ahead of the one waited for): ordinary memory, this once.
        # The data path counts the copy from it as unpooled.
        return torch.empty(group.shard_numel, dtype=self.dtype), None

    # -- what the optimizer's update writes ------------------------------------------------------
    def gate_on_update(self, update_gate, arena=None, in_backward: bool = False) -> None:
        """Fetches wait for ``update_gate`` (the overlapped optimizer step) to rewrite each group first.

        With an ``arena`` (the prefetcher's), the overlapped update, or the update during backward
        (``in_backward``), also hands each rewritten shard over in host memory (see [Note: fresh
        shards] in infinity/prefetch/fresh_shards.py).
        """
        self.update_gate = update_gate
        if arena is not None and (update_gate is not None or in_backward):
            self.fresh = FreshShards(arena)

    def update_ready(self, group: ParamGroup) -> bool:
        """Whether the group's stored shard is current (no overlapped optimizer step still rewrites it)."""
        return self.update_gate is None or self.update_gate.ready(group)

    def update_events(self, group: ParamGroup) -> tuple:
        """The overlapped update's device copies of the group's shard still in flight (CUDA events):
        a read of the shard waits for them on its own stream, the host does not. Empty without an
        overlapped update or off CUDA."""
        if self.update_gate is None:
            return ()
        return self.update_gate.device_copies(group)

    def wait_update(self, group: ParamGroup) -> float:
        """Block until the overlapped update has rewritten the group's shard; returns the seconds waited."""
        return self.update_gate.wait_ready(group)

    def write_updated(self, group: ParamGroup, key: int, values: torch.Tensor, offset_numel: int,
                      source: str = "host", offer_fresh: bool = False, in_place: bool = False):
        """Start writing an update's new compute copy ``values`` into ``key`` at an element offset.

        ``key`` is a group's shard key, or DPU's second key of it; ``values`` live on ``source``
        (where the optimizer's states are: "host", or "device" for a device optimizer tier).
        Runs on the update's thread; with ``offer_fresh`` the values are also kept in host
        memory for the group's next fetch. ``in_place``: the update computed ``values`` in the
        place ``update_place`` gave, so they are stored already.
        """
        if in_place:
            fut = CompletedFuture(values.numel() * values.element_size())
        else:
            fut = self.datapath.write(self.tier, key, values, offset_numel * values.element_size(), source=source)
        if offer_fresh and self.fresh is not None:
            self.fresh.offer(group, offset_numel, values)
        return fut

    def update_place(self, key: int, offset_numel: int, numel: int) -> torch.Tensor | None:
        """Where an update may compute elements [offset, offset + numel) of a new compute copy for ``key``
        itself: the key's host memory when the shards live there (counted as written), else None (the
        copy is staged and written with ``write_updated``). Runs on the update's thread."""
        if self.kind != "host":
            return None
        size = self.dtype.itemsize
        return self.tier.place(key, offset_numel * size, numel * size).view(self.dtype)

    def take_fresh(self, group: ParamGroup):
        """The group's fresh shard (an arena slice the caller releases), or None."""
        return self.fresh.take(group) if self.fresh is not None else None

    def has_fresh(self, group: ParamGroup) -> bool:
        """Whether the group's next fetch is served from host memory (a fresh shard)."""
        return self.fresh is not None and self.fresh.has(group)

    def reset_fresh(self, outlive_backward: bool = False) -> None:
        """An update is about to start: give back every fresh shard of the last one.

        ``outlive_backward``: it starts during a backward (the update during backward), whose end keeps
        its shards for the next forward.
        """
        if self.fresh is not None:
            self.fresh.reset(outlive_backward)

    def clear_fresh(self) -> None:
        """The end of a backward: fresh shards not taken by now are not needed."""
        if self.fresh is not None:
            self.fresh.clear()

    # -- DPU's second keys ---------------------------------------------------------------------------
    def keys(self, groups, selected: frozenset[int]) -> tuple[int | None, ...]:
        """Per group of ``groups``, its shard key when its index is in ``selected``, else None."""
        return tuple(g.param_key if g.index in selected else None for g in groups)

    def copy(self, group: ParamGroup, tag: str) -> int:
        """A new key holding a copy of the group's shard (DPU's second key)."""
        shard = torch.empty(group.shard_numel, dtype=group.dtype)
        self.datapath.read(self.tier, group.param_key, shard).wait()
        key = self.tier.allocate(group.shard_nbytes, tag=tag)
        self.datapath.write(self.tier, key, shard).wait()
        return key

    def publish(self, group: ParamGroup, key: int) -> int:
        """From now on the group's shard is ``key``; returns the key it replaces (DPU's publishing)."""
        old, group.param_key = group.param_key, key
        return old
