"""The two windows ahead of the cursor: what the prefetcher holds in them, and the walk that fills them.

[Note: frontiers]
The walk after each request must cost O(1) amortised, whatever the model's depth: walking
every entry ahead of the cursor at every request made a step's bookkeeping quadratic in the
number of groups (24 tiny blocks: 98,000 entry visits per step, most of the engine's time).
So the walk keeps two frontiers in the trace's slots (see [Note: slots] in trace.py): every
slot before the gather frontier has been gathered ahead or needed nothing, every slot before
the read frontier has been read ahead or needed nothing, and each walk goes on from them.
Behind a frontier a slot needs work again only when its group is dropped after it was handled
(a module used and released it, or it was dropped), which the coordinator reports
(``on_dropped``): the group's next slot ahead of the cursor is then visited again, before the
frontiers move on, so fetches still happen in trace order. Bytes held ahead are running
counts kept with the groups ahead, not a sum over them. A new step, the end of a backward,
a divergence or a trace edited in place start the frontiers again from the cursor.

[Note: revisits]
A dropped group's next slot behind a frontier goes into a heap per frontier: to gather again
and, when the tier is NVMe, to read again first. Each walk takes slots from the front of each
heap while their work succeeds and stops at the first that cannot be done yet (its read still
in flight, a window full), since gathers and reads go in trace order: so a walk looks at one
slot it cannot serve, not at every slot waiting (a set scanned whole at every walk made an
NVMe step visit up to 38 times its slots while reads were in flight).

What the room may touch: the coordinator's fetches (``start_fetch``, ``wait_available``), the
groups' states, the trace's slots and the prefetcher's staging arena; the prefetcher decides
when to walk (after each request) and owns the trace's lifecycle.
"""
from __future__ import annotations

import heapq

from infinity.param_group import ParamGroup, ParamState
from infinity.prefetch.trace import Trace, TraceMode, TraceSlots


class Windows:
    """The read and gather windows of [Note: two windows] in prefetcher.py, filled from frontiers.

    Parameters
    ----------
    coordinator:
        Owner of the groups and their fetches (``infinity.runtime.coordinator.Coordinator``).
    trace:
        The prefetcher's trace; the windows walk it only while it is FOLLOWING.
    arena:
        Staging for reads ahead (``tiers.arena.Arena``), or None when nothing is read ahead.
    nvme_bytes, device_bytes:
        The two byte budgets (``prefetch.nvme_bytes``, ``prefetch.device_bytes``).
    ordered_gathers:
        Several ranks: gathers are collectives, decided by the request sequence only
        (see [Note: ordered gathers] in prefetcher.py).
    reads_ahead:
        The parameter tier is NVMe: a fetch is a read that takes time.
    """

    def __init__(self, coordinator, trace: Trace, arena, nvme_bytes: int, device_bytes: int,
                 ordered_gathers: bool, reads_ahead: bool) -> None:
        self.coordinator = coordinator
        self.trace = trace
        self.arena = arena
        self.nvme_bytes = nvme_bytes
        self.device_bytes = device_bytes
        self.ordered_gathers = ordered_gathers
        self.reads_ahead = reads_ahead
        self.in_backward = False                # set by the prefetcher
        # Read ("nvme") or gathered ("device") ahead, not yet asked for, in order; their bytes.
        self.ahead: dict[ParamGroup, str] = {}
        self.held_bytes = {"nvme": 0, "device": 0}
        self._slots: TraceSlots | None = None
        self._gather_at = self._read_at = 0
        # Slots behind a frontier whose group was dropped (see [Note: revisits]): to gather again, in
        # trace order, and (NVMe) to read again first. Heaps of slots; stale ones are dropped when met.
        self._regather: list[int] = []
        self._reread: list[int] = []
        self._upcoming: dict[int, int] = {}     # group index -> its next slot at or after the cursor
        self._gathers_open = self._reads_open = False
        self.visits = 0                         # slots the walks of this step looked at
        self.last_visits = 0                    # ... and of the last complete step

    # -- what is held ----------------------------------------------------------------------------
    def held(self) -> dict:
        """Bytes held ahead right now, from the groups' states: ``nvme`` (reads in flight), ``device``."""
        nvme = device = 0
        for g in self.ahead:
            if g.state is ParamState.INFLIGHT:
                nvme += g.shard_nbytes
            elif g.state is ParamState.AVAILABLE and not self.coordinator.in_use.get(g):
                device += g.full_nbytes
        return {"nvme": nvme, "device": device}

    def gathered_last_first(self) -> list[ParamGroup]:
        """The groups gathered ahead, the one needed last first: what a gather on demand gives back to
        stay within ``partition.max_live_parameters`` ([Note: live parameters] in infinity/runtime/coordinator.py)."""
        never = len(self._slots) if self._slots is not None else 0
        ahead = [g for g, where in self.ahead.items() if where == "device" and g.state is ParamState.AVAILABLE]
        return sorted(ahead, key=lambda g: self._upcoming.get(g.index, never), reverse=True)

    def put(self, g: ParamGroup, where: str) -> None:
        self.take(g)
        self.ahead[g] = where
        self.held_bytes[where] += g.shard_nbytes if where == "nvme" else g.full_nbytes

    def take(self, g: ParamGroup) -> None:
        """``g`` leaves the windows (asked for, or dropped)."""
        where = self.ahead.pop(g, None)
        if where is not None:
            self.held_bytes[where] -= g.shard_nbytes if where == "nvme" else g.full_nbytes

    def forget(self) -> None:
        """Nothing is held ahead any more (every group was dropped)."""
        self.ahead.clear()
        self.held_bytes = {"nvme": 0, "device": 0}

    # -- frontiers -------------------------------------------------------------------------------
    def restart(self, enabled: bool = True) -> None:
        """Walk again from the cursor at the next request (see [Note: frontiers])."""
        self._regather.clear()
        self._reread.clear()
        if not enabled or self.trace.mode is not TraceMode.FOLLOWING:
            self._slots = None
            return
        if self._slots is None or self._slots.revision != self.trace.revision:
            self._slots = self.trace.slots()
        first = self._slots.start[self.trace.cursor]
        self._gather_at = self._read_at = first
        self._upcoming = self._slots.upcoming(first)

    def passed(self, position: int) -> None:
        """The request at ``position`` was served: its groups' next uses are their next slots."""
        slots = self._slots
        if slots is None or slots.revision != self.trace.revision:
            self.restart()      # the trace changed in place: walk it again from the cursor
            return
        for s in range(slots.start[position], slots.start[position + 1]):
            nxt = slots.following[s]
            if nxt is None:
                self._upcoming.pop(slots.group[s], None)
            else:
                self._upcoming[slots.group[s]] = nxt

    def dropped(self, g: ParamGroup) -> None:
        """``g`` is NOT_AVAILABLE again: its next use, if a frontier passed it, is visited again."""
        self.take(g)
        slots = self._slots
        if slots is None or self.trace.mode is not TraceMode.FOLLOWING or slots.revision != self.trace.revision:
            return
        nxt = self._upcoming.get(g.index)
        if nxt is None:
            return
        if nxt < self._gather_at:
            heapq.heappush(self._regather, nxt)
        if nxt < self._read_at and self.reads_ahead:
            heapq.heappush(self._reread, nxt)

    def end_step(self) -> None:
        self.last_visits, self.visits = self.visits, 0

    def stats(self) -> dict:
        return {"slots": 0 if self._slots is None else len(self._slots), "visits_last_step": self.last_visits}

    # -- the walk --------------------------------------------------------------------------------
    def walk(self) -> None:
        """Fill both windows in trace order, from the frontiers (see [Note: frontiers])."""
        slots, cursor = self._slots, self.trace.cursor
        first, end = slots.start[cursor], slots.start[slots.stop[cursor]]
        gather_at, read_at = max(self._gather_at, first), max(self._read_at, first)
        self._gathers_open = self.device_bytes > 0
        self._reads_open = self.arena is not None
        groups = self.coordinator.groups
        regather, reread = self._regather, self._reread
        while self._gathers_open and regather:
            s = regather[0]
            self.visits += 1
            g = groups[slots.group[s]]
            if s < first or s >= end or s >= gather_at or g.persistent or g.state is ParamState.AVAILABLE:
                heapq.heappop(regather)     # passed, beyond this walk, or gathered already
            elif self._try_gather(g):
                heapq.heappop(regather)
            else:
                break       # in trace order: nothing after it is gathered before it
        while self._reads_open and reread:
            s = reread[0]
            self.visits += 1
            g = groups[slots.group[s]]
            if s < first or s >= end or s >= read_at or g.persistent or g.state is not ParamState.NOT_AVAILABLE:
                heapq.heappop(reread)
            elif self._try_read(g):
                heapq.heappop(reread)
            else:
                break
        while self._gathers_open and gather_at < end:
            self.visits += 1
            g = groups[slots.group[gather_at]]
            if slots.previous[gather_at] < first and not g.persistent and g.state is not ParamState.AVAILABLE:
                if not self._try_gather(g):
                    break
            gather_at += 1
        read_at = max(read_at, gather_at)
        while self._reads_open and read_at < end:
            self.visits += 1
            g = groups[slots.group[read_at]]
            if (slots.previous[read_at] < first and not g.persistent and g.state is ParamState.NOT_AVAILABLE
                    and not self._try_read(g)):
                break
            read_at += 1
        self._gather_at, self._read_at = gather_at, read_at

    def _try_gather(self, g: ParamGroup) -> bool:
        """Gather ``g`` ahead if the gather window has room; else close the window."""
        # A bounded gather buffer (partition.gather_buffer_bytes) with no room left ends the
        # gathers ahead: the group is gathered on demand instead of into memory of its own.
        room = self.device_bytes - self.held_bytes["device"]
        c = self.coordinator       # and partition.max_live_parameters ([Note: live parameters] in coordinator.py)
        live = not c.max_live or g.state is ParamState.AVAILABLE or c.live_numel + g.numel <= c.max_live
        if g.full_nbytes <= room and live and c.memory.has_room(g.full_nbytes) and self._may_gather(g):
            if g.state is ParamState.NOT_AVAILABLE:
                self.coordinator.start_fetch(g, prefetch=True)
            self.coordinator.wait_available(g)
            self.put(g, "device")
            return True
        self._gathers_open = False
        return False

    def _try_read(self, g: ParamGroup) -> bool:
        """Read ``g``'s shard ahead if the read window and the arena have room; else close the window."""
        room = self.nvme_bytes - self.held_bytes["nvme"]
        staging = None
        if g.shard_nbytes <= room:
            # In backward, fresh shards kept for the next forward give way: this backward needs the
            # read first (see [Note: fresh shards] in infinity/prefetch/fresh_shards.py).
            fresh = self.coordinator.shards.fresh
            if self.in_backward and fresh is not None:
                staging = fresh.take_slice(g.shard_nbytes, f"prefetch {g.name}", g.index)
            else:
                staging = self.arena.take(g.shard_nbytes, f"prefetch {g.name}")
        if staging is None or not self.coordinator.start_fetch(g, prefetch=True, staging=staging):
            self._reads_open = False   # no room, or the overlapped optimizer step has not reached it
            return False
        self.put(g, "nvme")
        return True

    def _may_gather(self, g: ParamGroup) -> bool:
        if self.ordered_gathers:
            return True   # a collective: decided by the request sequence only; it waits if need be
        if not self.coordinator.shards.update_ready(g):
            return False  # the overlapped optimizer step has not rewritten it yet: never block ahead
        if g.state is ParamState.INFLIGHT:
            return g in self.ahead and g.pending.future.done()
        return not self.reads_ahead     # host/device tier: the "read" is a copy, nothing to wait for
