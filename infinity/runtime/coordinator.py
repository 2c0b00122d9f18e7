"""The one owner of parameter availability: fetch, gather, release.

Module hooks (infinity/runtime/hooks.py) only ask the coordinator; every state change of
a parameter group happens here (see [Note: parameter states] in infinity/param_group.py).
What the room may touch: the groups' states, the shards (``ParamShards``, the only
reader of the parameter tier), the ranks' all-gather and the prefetcher's request hook.

[Note: bandwidth-centric fetch]
Each rank reads only its own shard of a group from its own parameter tier (host
memory or NVMe), moves it to the compute device, and the ranks assemble the whole
with one all-gather. With N ranks the tier traffic of each rank is 1/N of the
group, so the aggregate read bandwidth grows with N.

[Note: in-use counts]
A group stays AVAILABLE while a module that needs it is running (nested modules,
a module called several times, parameters shared between modules). ``acquire``
and ``release`` count those users; the group is dropped when the count returns to
zero, unless it is persistent or a prefetcher asked to keep it for an imminent
reuse. Persistent groups stay gathered from their first use after an update to the
next update: at stages 1 and 2 (whole parameters on every rank), below
``partition.persistence_threshold``, and every group gathered in place (one rank,
shards in the compute device's memory: the gathered group is its stored shard,
so keeping it costs no memory, while releasing and gathering it again around each
use would cost host time per module, which a GPU step cannot hide).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from infinity.param_group import ParamGroup, ParamSlot, ParamState
from infinity.runtime.gather_memory import GatherMemory
from infinity.runtime.shards import ParamShards
from tiers.base import CompletedFuture, wait_quietly


class _PendingFetch:
    """A shard on its way to the compute device: where it is (``source``, in host or device memory),
    the read that fills it (NVMe), and how to give its host buffer back once copied."""

    __slots__ = ("future", "source", "source_on", "release_staging", "issued_at", "after")

    def __init__(self, future, source: torch.Tensor, source_on: str, release_staging, after: tuple = ()) -> None:
        self.future = future
        self.source = source
        self.source_on = source_on
        self.release_staging = release_staging
        self.issued_at = time.perf_counter()
        self.after = after      # device copies that write ``source`` (an overlapped update's): read after them


class FetchStats:
    """Counters the engine reports per step (see infinity.stats)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stall_seconds = 0.0
        # Part of stall_seconds spent blocked on the tier read itself (the rest is the
        # host->device copy and the all-gather): the I/O stall.
        self.read_wait_seconds = 0.0
        # Part of stall_seconds spent waiting for an overlapped optimizer step to rewrite a shard.
        self.update_wait_seconds = 0.0
        self.fresh_shards = 0   # fetches served from a fresh shard, no tier read (see [Note: fresh shards])
        self.fetches = 0
        self.prefetch_hits = 0
        self.bytes_gathered = 0
        self.bytes_read_from_tier = 0
        self.peak_live_numel = 0    # most elements gathered at once ([Note: live parameters])

    def as_dict(self) -> dict:
        return {
            "stall_seconds": self.stall_seconds,
            "read_wait_seconds": self.read_wait_seconds,
            "update_wait_seconds": self.update_wait_seconds,
            "fresh_shards": self.fresh_shards,
            "fetches": self.fetches,
            "prefetch_hits": self.prefetch_hits,
            "hit_rate": self.prefetch_hits / self.fetches if self.fetches else 0.0,
            "bytes_gathered": self.bytes_gathered,
            "bytes_read_from_tier": self.bytes_read_from_tier,
            "peak_live_numel": self.peak_live_numel,
        }


def _release_gathered(coordinator: "Coordinator", group: ParamGroup, keep_views: bool = False) -> None:
    """Release the group's gathered memory; the prefetcher learns that its next use needs a fetch
    (see [Note: frontiers] in infinity/prefetch/windows.py)."""
    group.to_not_available(keep_views)
    if group in coordinator.live:
        coordinator.live.discard(group)
        coordinator.live_numel -= group.numel
    if coordinator.prefetcher is not None:
        coordinator.prefetcher.on_dropped(group)


def _finish_gather(coordinator: "Coordinator", group: ParamGroup) -> None:
    """Finish ``group``'s read and all-gather (``Coordinator.wait_available`` without the order)."""
    if group.state is ParamState.NOT_AVAILABLE:
        coordinator.start_fetch(group)
    elif getattr(group, "prefetched", False):
        coordinator.stats.prefetch_hits += 1
    pending = group.pending
    t0 = time.perf_counter()
    pending.future.wait()      # the NVMe read, if any (I/O, not a wait for the device)
    coordinator.stats.read_wait_seconds += time.perf_counter() - t0
    if coordinator.in_place:
        for event in pending.after:
            coordinator.datapath.use(event)
        full = group.flat_buffer(pending.source)
    else:
        full = group.flat_buffer()
        _fill(coordinator, group, full.data, pending)
    coordinator.stats.stall_seconds += time.perf_counter() - t0
    coordinator.stats.fetches += 1
    coordinator.stats.bytes_gathered += group.full_nbytes
    group.to_available(full)
    if not coordinator.in_place:
        coordinator.live.add(group)
        coordinator.live_numel += group.numel
        if coordinator.live_numel > coordinator.stats.peak_live_numel:
            coordinator.stats.peak_live_numel = coordinator.live_numel


def _fill(coordinator: "Coordinator", group: ParamGroup, full: torch.Tensor, pending: _PendingFetch) -> None:
    """This rank's shard into its slice of ``full`` (host->device, or device-local), then the all-gather."""
    mine = group.shard_of(full)
    if pending.source_on == "host":
        # After the last compute-stream use of ``mine``'s memory, and after the device copies that
        # wrote the source (states on the device, parameters in host RAM).
        done = coordinator.datapath.upload(mine, pending.source, after=(coordinator.memory.reuse_event, *pending.after))
        coordinator.datapath.use(done)
        if pending.release_staging is not None:
            coordinator.datapath.when_done(done, pending.release_staging)
    else:
        for event in pending.after:
            coordinator.datapath.use(event)
        mine.copy_(pending.source)
    coordinator.ranks.all_gather(full, mine)


def gather_rest(coordinator: "Coordinator") -> None:
    """Gather the groups not gathered yet, in group order ([Note: gathered in one order])."""
    for group in coordinator.groups:
        if group.state is not ParamState.AVAILABLE:
            _finish_gather(coordinator, group)


def _make_room(coordinator: "Coordinator", groups) -> None:
    """Release groups kept for reuse, then groups gathered ahead, until ``groups`` fit ``max_live`` beside
    what is gathered (see [Note: live parameters]); groups in use are never released, so the bound may be
    passed."""
    need = sum(g.numel for g in groups if g.state is not ParamState.AVAILABLE)
    if coordinator.live_numel + need <= coordinator.max_live:
        return
    # The one needed last goes first (what a cache that knows the future evicts): fewer fetches again.
    kept = sorted(coordinator.keep, key=coordinator.keep.__getitem__, reverse=True)
    ahead = [] if coordinator.prefetcher is None else coordinator.prefetcher.windows.gathered_last_first()
    for g in kept + ahead:
        if coordinator.live_numel + need <= coordinator.max_live:
            return
        if g in coordinator.live and not coordinator.busy(g) and g not in groups:
            coordinator.keep.pop(g, None)
            _release_gathered(coordinator, g)


class Coordinator:
    """Owns every parameter group and its transitions.

    Parameters
    ----------
    shards:
        Each rank's compute-dtype shards in the parameter tier.
    ranks:
        The data-parallel ranks (infinity.runtime.ranks.Ranks).
    device:
        The compute device (infinity.runtime.device.ComputeDevice).
    gather_buffer_bytes:
        ``partition.gather_buffer_bytes`` (see [Note: long-lived and short-lived gathers] in
        infinity/runtime/gather_memory.py).
    max_live:
        ``partition.max_live_parameters`` (0: no bound; see [Note: live parameters]).

    [Note: live parameters]
    ``live_numel`` counts the elements of the groups gathered on the compute device (groups gathered
    in place, one rank with the parameters on the device, cost no memory and are not counted).
    ``partition.max_live_parameters`` bounds it the way DeepSpeed's ``stage3_max_live_parameters``
    does: gathers ahead stop where they would pass it (``Windows._try_gather``), and a gather that
    would pass it first releases groups kept for reuse (``prefetch.reuse_distance``), then groups
    gathered ahead, the one needed last first (gathered ahead at a step's end while the step's first
    group was still gathered, they made its gather pass the bound by half). The groups a
    running module (or backward) uses are gathered whatever the count, so the bound holds as long as
    they fit it; ``Init`` refuses a bound below the largest group plus the persistent groups (always live).
    """

    def __init__(self, shards: ParamShards, ranks, device, gather_buffer_bytes: int = 0,
                 max_live: int = 0) -> None:
        self.shards = shards
        self.datapath = shards.datapath
        self.ranks = ranks
        self.device = device
        self.dtype = shards.dtype
        self.memory = GatherMemory(device.device, self.datapath.mark, gather_buffer_bytes)
        # World size 1 and shards in the compute device's own memory: a gathered group is its
        # stored shard itself, lent to the group's tensor (no copy; see [Note: lending memory to a group]).
        self.in_place = ranks.world_size == 1 and shards.kind == "device"
        # Several ranks at stages 1 and 2: groups are gathered in group order only ([Note: gathered in one order]).
        self.in_order = False
        self.groups: list[ParamGroup] = []
        self.group_of: dict[nn.Parameter, ParamGroup] = {}
        self.module_groups: dict[nn.Module, list[ParamGroup]] = {}
        self.in_use: dict[ParamGroup, int] = defaultdict(int)
        self.keep: dict[ParamGroup, int] = {}     # kept for reuse: where in the trace it is needed next
        self.backward_held: set[ParamGroup] = set()
        self.stats = FetchStats()
        self.prefetcher = None
        self.max_live = max_live
        self.live_numel = 0
        self.live: set[ParamGroup] = set()

    # -- partitioning --------------------------------------------------------------------------
    def new_group(self, name: str, params: list[tuple[str, nn.Parameter]]) -> ParamGroup:
        """The group ``params`` will form (its layout); nothing is stored yet (``partition`` does)."""
        slots, offset = [], 0
        for pname, p in params:
            slots.append(ParamSlot(p, pname, p.shape, p.numel(), offset))
            offset += p.numel()
        group = ParamGroup(len(self.groups), name, slots, self.dtype, self.device.device,
                           self.ranks.world_size, self.ranks.rank)
        group.memory = self.memory
        return group

    def partition(self, group: ParamGroup, flat: torch.Tensor | None) -> None:
        """Keep this rank's shard of ``flat`` (the group's padded values, the same on every rank) in the
        parameter tier; the group joins the others, NOT_AVAILABLE, its parameters empty placeholders.
        ``flat`` None: the shard's key is allocated and written later (``ParamShards.put``)."""
        self.shards.put(group, None if flat is None else group.shard_of(flat))
        self.groups.append(group)
        for slot in group.slots:
            self.group_of[slot.param] = group
        group.drop_views()

    # -- fetching ----------------------------------------------------------------------------
    def start_fetch(self, group: ParamGroup, prefetch: bool = False, staging=None) -> bool:
        """Issue the read of this rank's shard (no wait); returns whether a read was issued.

        A no-op unless NOT_AVAILABLE. While an overlapped optimizer step has not yet
        rewritten the shard (``ParamShards.update_ready``), a read ahead into ``staging`` is not issued
        (False: the prefetcher tries again at its next walk); any other fetch waits for it.

        ``staging``: an aligned host buffer with ``.tensor`` (uint8) and ``.release()`` to read
        into instead of one from the staging pool; the prefetcher passes slices of its own
        arena (see [Note: why prefetched reads have their own staging] in infinity/prefetch/prefetcher.py).
        It is released when the fetch completes (or at once when this call issues nothing).
        """
        if group.state is not ParamState.NOT_AVAILABLE:
            if staging is not None:
                staging.release()
            return False
        shards = self.shards
        fresh = shards.take_fresh(group)
        if fresh is None and not shards.update_ready(group):
            if staging is not None:
                staging.release()
                return False
            waited = shards.wait_update(group)
            self.stats.update_wait_seconds += waited
            self.stats.stall_seconds += waited
            fresh = shards.take_fresh(group)   # completed while we waited
        if fresh is not None:
            if staging is not None:
                staging.release()
            shard = fresh.tensor[:group.shard_nbytes].view(self.dtype)
            group.to_inflight(_PendingFetch(CompletedFuture(group.shard_nbytes), shard, "host", fresh.release))
            group.prefetched = prefetch
            self.stats.fresh_shards += 1
            return True
        if shards.kind != "nvme":
            # In memory already: the host->device copy (or the device-local one) happens at the gather.
            if staging is not None:
                staging.release()
            source_on = "device" if shards.kind == "device" else "host"
            group.to_inflight(_PendingFetch(CompletedFuture(group.shard_nbytes), shards.stored(group), source_on,
                                            None, shards.update_events(group)))
            group.prefetched = prefetch
            return True
        if staging is not None:
            staging, release = staging.tensor[:group.shard_nbytes].view(self.dtype), staging.release
        else:
            staging, release = shards.staging_buffer(group)
        try:
            future = shards.read(group, staging)
        except BaseException:
            if release is not None:
                release()
            raise
        group.to_inflight(_PendingFetch(future, staging, "host", release))
        group.prefetched = prefetch
        self.stats.bytes_read_from_tier += group.shard_nbytes
        return True

    def wait_available(self, group: ParamGroup) -> None:
        """Finish the group's read and all-gather; afterwards it is AVAILABLE.

        [Note: gathered in one order]
        At stages 1 and 2 every group is persistent: gathered at its first use after an update, kept to the next.
        Which groups a forward uses can differ between ranks (an expert that got no tokens on one rank, a
        layer dropped by a rank's own draw), and NCCL pairs collectives by order alone, so on several ranks
        the groups are gathered in group order only: a group's gather first gathers every group before it
        that is not gathered yet, and the end of the outermost forward (``gather_rest``) the ones after it.
        Every rank then issues the same all-gathers in the same order in the first forward after an update,
        whatever that forward uses, as long as every rank runs one before its next other collective (a
        forward on rank 0 alone, an evaluation, pairs its gathers with the other ranks' next training
        forward). In a model built in the order it runs, the order is the one the forward asks for anyway.
        """
        if group.state is ParamState.AVAILABLE:
            return
        if self.in_order:
            for earlier in self.groups[:group.index]:
                if earlier.state is not ParamState.AVAILABLE:
                    _finish_gather(self, earlier)
        _finish_gather(self, group)

    def gather(self, groups) -> None:
        """Make ``groups`` AVAILABLE: issue every read first, then wait in order."""
        if self.max_live:
            _make_room(self, groups)
        for g in groups:
            self.start_fetch(g)
        for g in groups:
            self.wait_available(g)

    def drop(self, group: ParamGroup) -> None:
        """Release a group regardless of users (end of step, after an optimizer update).

        A group still on its way (a read ahead) is not gathered to be dropped: its read is waited for and
        its staging given back, and no collective runs. Which groups are on their way depends on this
        rank's timing (arena room, events seen done), so a gather here would issue all-gathers on some
        ranks and not on others."""
        if group.state is ParamState.INFLIGHT:
            pending = group.cancel_inflight()
            group.prefetched = False
            wait_quietly([pending.future])      # the bytes are not used: a failed read shows at the next one
            if pending.release_staging is not None:
                pending.release_staging()
            if self.prefetcher is not None:
                self.prefetcher.on_dropped(group)
        if group.state is ParamState.AVAILABLE:
            _release_gathered(self, group)
        self.in_use.pop(group, None)

    # -- module lifecycle ------------------------------------------------------------------------
    def acquire(self, module: nn.Module) -> None:
        groups = self.module_groups.get(module, ())
        if self.prefetcher is not None:
            self.prefetcher.on_request(module, groups)
        self.gather(groups)
        for g in groups:
            self.in_use[g] += 1

    def release(self, module: nn.Module) -> None:
        for g in self.module_groups.get(module, ()):
            n = self.in_use.get(g, 0) - 1
            if n > 0:
                self.in_use[g] = n
                continue
            self.in_use.pop(g, None)
            if g.persistent or g in self.keep or g in self.backward_held:
                continue
            if g.state is ParamState.AVAILABLE:
                _release_gathered(self, g)

    def adopt(self, module: nn.Module, group: ParamGroup) -> None:
        """``module`` uses ``group`` without owning it: gather it now and with the module from now on."""
        groups = self.module_groups.setdefault(module, [])
        if group not in groups:
            groups.append(group)
        self.gather([group])
        self.in_use[group] += 1

    def hold_for_backward(self, module: nn.Module) -> None:
        """Gather a module's groups for its backward; they stay until their gradients are reduced."""
        groups = self.module_groups.get(module, ())
        if self.prefetcher is not None:
            self.prefetcher.on_request(module, groups)
        self.gather(groups)
        self.backward_held.update(groups)

    def backward_done(self, group: ParamGroup, keep_views: bool = False) -> None:
        """Autograd will not touch ``group``'s values again in this backward: release it.

        ``keep_views``: autograd has yet to store the group's last gradients, shaped after the
        parameters: they keep their shapes (no memory behind them) until ``ParamGroup.drop_views``.
        """
        self.backward_held.discard(group)
        if self.in_use.get(group) or group.persistent or group in self.keep:
            return
        if group.state is ParamState.AVAILABLE:
            _release_gathered(self, group, keep_views)

    def end_backward(self) -> None:
        self.backward_held.clear()
        self.release_all()
        self.shards.clear_fresh()

    def release_all(self, include_persistent: bool = False) -> None:
        """Drop every gathered group not in use (end of backward, before/after an update)."""
        for g in self.groups:
            if self.in_use.get(g):
                continue
            if g.persistent and not include_persistent:
                continue
            if g.state is not ParamState.NOT_AVAILABLE:
                self.drop(g)
        self.keep.clear()

    def keep_for_reuse(self, group: ParamGroup, keep: bool = True, next_use: int = 0) -> None:
        """Whether to keep ``group`` gathered after its current use (the prefetcher's reuse distance);
        ``next_use``: the trace position of its next request (``max_live_parameters`` releases the kept
        group needed last first)."""
        if keep:
            self.keep[group] = next_use
        else:
            self.keep.pop(group, None)

    def busy(self, group: ParamGroup) -> bool:
        """Whether something other than a read ahead holds the group: a running module, backward, persistence."""
        return bool(self.in_use.get(group)) or group in self.backward_held or group.persistent

    def use(self, groups) -> None:
        """Gather ``groups`` and count one more user of each (``infinity.gathered``)."""
        self.gather(groups)
        for g in groups:
            self.in_use[g] += 1

    def unuse(self, group: ParamGroup) -> None:
        """One user less; the last one drops the group."""
        self.in_use[group] -= 1
        if self.in_use[group] <= 0:
            self.in_use.pop(group, None)
        self.drop(group)

    def available_nbytes(self) -> int:
        return sum(g.full_nbytes for g in self.groups if g.state is ParamState.AVAILABLE)
