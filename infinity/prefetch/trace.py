"""The recorded order in which modules ask for their parameters during one training step.

[Note: the trace]
A step (from the root module's forward after an optimizer step to the next such
forward) asks for parameters in an order fixed by the model's code: the forward
visits modules in program order, the backward in roughly the reverse. The first
step records that order as a list of entries ``(phase, module name, group
indices)``; later steps walk it with a cursor and the prefetcher reads ahead of
the cursor. Entries are matched by ``(phase, module name)``: the groups of a
module can grow after recording (a module that uses another module's parameters
adopts their group, see [Note: foreign parameters] in infinity/runtime/foreign.py), and such an
entry is updated in place rather than treated as a divergence.

[Note: trace states]
RECORDING: the live order is appended to the entries (the first step, and the
step after a divergence). FOLLOWING: the live order is compared with the entries,
one request at a time; the prefetcher reads ahead. DIVERGED: a request did not
match (data-dependent control flow, a skipped module, an eval or no-grad
forward, a different sequence-length path) or the step ended early; nothing is
prefetched for the rest of the step and the next step records anew. Only the
sequence of requests drives the transitions, never timing, so every rank of a
data-parallel job (same control flow, same trace) makes the same decisions and
issues its collectives in the same order.

[Note: slots]
The prefetcher walks the trace after every request, so what it looks at per walk must
not grow with the model (a walk from the cursor over every entry ahead made a step's
bookkeeping quadratic in the number of groups). ``TraceSlots`` flattens the followed
entries once per recording into slots, one per (entry, group), with each slot's
previous and next slot of the same group and where the walk ahead of each position
must stop; the prefetcher then keeps frontiers in it and walks only forward from
them (see [Note: frontiers] in windows.py).

[Note: requests without groups]
Every module asks, parameter-less containers too (a transformer block, its attention
around the projections, an activation): about a third of the requests of a GPT. Once a
recording is followed they carry nothing to fetch, so the followed entries keep only the
requests with groups (a module's groups counted after the recorded step: one that adopted
a group then keeps its entry), and a request without groups is ignored while following
(``ignores``): the engine's per-module work for such a module is then a stack push and pop.
A model with no groups at all follows its entries as recorded.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterator

FORWARD = "forward"
BACKWARD = "backward"
PHASES = (FORWARD, BACKWARD)


def starts_new_forward(entries: list["TraceEntry"], position: int) -> bool:
    """Whether the entry at ``position`` is a forward right after a backward (the next micro-batch):
    where a walk ahead ends, since the end of a backward releases every gathered group."""
    return position > 0 and entries[position - 1].phase == BACKWARD and entries[position].phase == FORWARD


class TraceMode(enum.Enum):
    RECORDING = "recording"
    FOLLOWING = "following"
    DIVERGED = "diverged"


class TraceStateError(RuntimeError):
    """The trace was asked for a transition its current mode does not allow."""


@dataclass(frozen=True)
class TraceEntry:
    """One request for parameters: a module's forward or backward asked for its groups."""

    phase: str
    """"forward" or "backward"."""

    name: str
    """Qualified name of the module (as in ``model.named_modules()``)."""

    groups: tuple[int, ...]
    """Indices of the parameter groups the module asked for (may be empty)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"TraceEntry {self.name!r}: phase must be one of {PHASES}, got {self.phase!r}")

    def label(self) -> str:
        return f"{self.phase} {self.name or '<root>'}"


@dataclass(frozen=True)
class Divergence:
    """Where a step left its trace: entry ``position`` was ``expected`` but ``got`` came.

    ``got`` is None when the step ended before the trace did; ``expected`` is None
    when the step went on after the trace ended.
    """

    step: int
    position: int
    expected: TraceEntry | None
    got: TraceEntry | None

    def key(self) -> tuple:
        """What makes two divergences 'the same' for rate-limited warnings."""
        exp = None if self.expected is None else (self.expected.phase, self.expected.name)
        got = None if self.got is None else (self.got.phase, self.got.name)
        return exp, got

    def describe(self) -> str:
        expected = "the end of the step" if self.expected is None else self.expected.label()
        got = "the end of the step" if self.got is None else self.got.label()
        return (f"step {self.step}: request {self.position} of the recorded trace was {expected}, "
                f"but the model asked for {got}")


class Trace:
    """The recorded request order of one step and a cursor following it (see [Note: trace states]).

    Examples
    --------
    >>> t = Trace()
    >>> t.begin_step(); t.observe("forward", "a", (0,)); t.observe("forward", "b", (1,))
    >>> t.end_step(); t.begin_step(); t.mode.name
    'FOLLOWING'
    >>> t.observe("forward", "a", (0,)) is None, t.observe("forward", "c", (2,)).got.name
    (True, 'c')
    >>> t.mode.name
    'DIVERGED'
    """

    def __init__(self) -> None:
        self.mode = TraceMode.RECORDING
        self.entries: list[TraceEntry] = []
        self.cursor = 0
        self.step = -1
        self.recordings = 0
        self.divergences = 0
        self._live: list[TraceEntry] = []
        self._in_step = False
        self._without_empty = False      # see [Note: requests without groups]
        self._discarded = False          # this step's recording is not to be adopted (discard_recording)
        # Changes whenever ``entries`` change (a recording adopted, an entry updated in place), so
        # that what was derived from them (``TraceSlots``) is known to be stale.
        self.revision = 0

    # -- transitions -------------------------------------------------------------------------
    def _expect(self, *modes: TraceMode, to: str) -> None:
        if self.mode not in modes:
            allowed = " or ".join(m.name for m in modes)
            raise TraceStateError(f"trace (step {self.step}): cannot become {to} from {self.mode.name}; "
                                  f"expected {allowed}")

    def to_recording(self) -> None:
        """Forget the entries and record the next step's requests."""
        self._expect(TraceMode.FOLLOWING, TraceMode.DIVERGED, to="RECORDING")
        self.mode = TraceMode.RECORDING
        self.entries = []
        self._without_empty = False
        self.cursor = 0
        self.revision += 1

    def to_following(self) -> None:
        """Start following the recorded entries from the first one."""
        self._expect(TraceMode.RECORDING, to="FOLLOWING")
        if not self.entries:
            raise TraceStateError(f"trace (step {self.step}): cannot become FOLLOWING with no recorded entries")
        self.mode = TraceMode.FOLLOWING
        self.cursor = 0
        self.revision += 1

    def to_diverged(self) -> None:
        self._expect(TraceMode.FOLLOWING, to="DIVERGED")
        self.mode = TraceMode.DIVERGED
        self.divergences += 1

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self, refresh: Callable[[TraceEntry], tuple[int, ...]] | None = None) -> None:
        """A new step starts: after a complete recording, follow it; after a divergence, record anew.

        ``refresh(entry)`` returns an entry's current group indices; it is applied to a
        fresh recording so that groups adopted during the recorded step are in the trace.
        """
        if self._in_step:
            self.end_step()
        self.step += 1
        self._in_step = True
        self._live = []
        if self._discarded:     # record the new step from its first request
            self.entries, self._discarded = [], False
        if self.mode is TraceMode.RECORDING and self.entries:
            if refresh is not None:
                self.entries = [TraceEntry(e.phase, e.name, tuple(refresh(e))) for e in self.entries]
            with_groups = [e for e in self.entries if e.groups]
            self._without_empty = bool(with_groups)
            if with_groups:
                self.entries = with_groups
            self.recordings += 1
            self.to_following()
        elif self.mode is TraceMode.DIVERGED:
            self.to_recording()
        else:
            self.cursor = 0

    def end_step(self) -> Divergence | None:
        """The step is over; a trace followed only part way is a divergence (returned)."""
        if not self._in_step:
            return None
        self._in_step = False
        if self.mode is TraceMode.FOLLOWING and self.cursor < len(self.entries):
            found = Divergence(self.step, self.cursor, self.entries[self.cursor], None)
            self.to_diverged()
            return found
        return None

    def recorded(self) -> int | None:
        """How many requests the running recording holds (None: not recording)."""
        return len(self.entries) if self.mode is TraceMode.RECORDING else None

    def discard_recording(self, since: int | None) -> None:
        """Requests recorded from entry ``since`` on came from inside ``infinity.gathered``, where a module
        using a parameter it does not own goes unseen ([Note: foreign parameters] in
        infinity/runtime/foreign.py): this recording is not adopted; the next step records anew."""
        if since is not None and self.mode is TraceMode.RECORDING and len(self.entries) > since:
            self._discarded = True      # requests after the block, in this step, are not adopted either

    def ignores(self, groups) -> bool:
        """Whether a request for ``groups`` is ignored (see [Note: requests without groups])."""
        return not groups and self._without_empty and self.mode is TraceMode.FOLLOWING

    def observe(self, phase: str, name: str, groups: tuple[int, ...]) -> Divergence | None:
        """One live request; returns the divergence when it does not match the trace."""
        if self.ignores(groups):
            return None
        entry = TraceEntry(phase, name, tuple(groups))
        if self.mode is TraceMode.RECORDING:
            self.entries.append(entry)
            return None
        if self.mode is TraceMode.DIVERGED:
            return None
        if self.cursor < len(self.entries):
            want = self.entries[self.cursor]
            if want.phase == phase and want.name == name:
                if want.groups != entry.groups:
                    self.entries[self.cursor] = entry
                    self.revision += 1
                self.cursor += 1
                return None
            found = Divergence(self.step, self.cursor, want, entry)
        else:
            found = Divergence(self.step, self.cursor, None, entry)
        self.to_diverged()
        return found

    # -- walking ahead -------------------------------------------------------------------------
    def ahead(self, stop_at_new_forward: bool = True) -> Iterator[tuple[int, TraceEntry]]:
        """The entries after the cursor, in order, with their positions (FOLLOWING only).

        With ``stop_at_new_forward`` the walk ends where a backward phase is followed by a
        forward one (gradient accumulation): the end of a backward releases every gathered
        group, so anything fetched for the next forward before then would be thrown away.
        """
        if self.mode is not TraceMode.FOLLOWING:
            return
        for position in range(self.cursor, len(self.entries)):
            if stop_at_new_forward and starts_new_forward(self.entries, position):
                return
            yield position, self.entries[position]

    def next_use_distances(self, nbytes: Callable[[int], int]) -> list[dict[int, int | None]]:
        """For each entry and each of its groups: bytes fetched before that group's next use.

        ``nbytes(group_index)`` is the size a fetch of the group moves. The distance is the
        sum over the entries strictly between this use and the next of their groups' sizes
        (None when the group is not used again in the step). A group used again within
        ``prefetch.reuse_distance`` bytes is kept gathered rather than released and refetched.
        """
        prefix = [0]
        for entry in self.entries:
            prefix.append(prefix[-1] + sum(nbytes(g) for g in entry.groups))
        out: list[dict[int, int | None]] = [{} for _ in self.entries]
        next_position: dict[int, int] = {}
        for position in range(len(self.entries) - 1, -1, -1):
            groups = self.entries[position].groups
            for g in groups:
                nxt = next_position.get(g)
                out[position][g] = None if nxt is None else prefix[nxt] - prefix[position + 1]
            for g in groups:
                next_position[g] = position
        return out

    def slots(self) -> "TraceSlots":
        """The followed entries as slots (see [Note: slots]); build once per ``revision``."""
        return TraceSlots(self.entries, self.revision)

    def summary(self) -> dict:
        return {"mode": self.mode.value, "entries": len(self.entries), "cursor": self.cursor,
                "step": self.step, "recordings": self.recordings, "divergences": self.divergences}


class TraceSlots:
    """The entries of a trace flattened into slots, one per (entry, group) (see [Note: slots]).

    Slot ``s`` is group ``group[s]`` asked for by entry ``position[s]``; the slots of entry
    ``p`` are ``start[p]`` to ``start[p + 1]``. ``previous[s]`` / ``following[s]`` are the
    slots of the same group before and after ``s`` (-1 / None when there is none), and
    ``stop[p]`` is where a walk ahead from the cursor at position ``p`` ends, as
    ``Trace.ahead`` ends it: at the first forward entry after a backward one.
    """

    def __init__(self, entries: list[TraceEntry], revision: int) -> None:
        self.revision = revision
        self.position: list[int] = []
        self.group: list[int] = []
        self.start: list[int] = []
        for p, entry in enumerate(entries):
            self.start.append(len(self.group))
            self.position.extend([p] * len(entry.groups))
            self.group.extend(entry.groups)
        self.start.append(len(self.group))
        self.previous = [-1] * len(self.group)
        self.following: list[int | None] = [None] * len(self.group)
        last: dict[int, int] = {}
        for s, g in enumerate(self.group):
            if g in last:
                self.previous[s] = last[g]
                self.following[last[g]] = s
            last[g] = s
        self.stop = [len(entries)] * (len(entries) + 1)
        for q in range(len(entries) - 1, -1, -1):
            self.stop[q] = q if starts_new_forward(entries, q) else self.stop[q + 1]

    def __len__(self) -> int:
        return len(self.group)

    def upcoming(self, first: int) -> dict[int, int]:
        """Each group's first slot at or after slot ``first``."""
        out: dict[int, int] = {}
        for s in range(first, len(self.group)):
            out.setdefault(self.group[s], s)
        return out
