"""The prefetcher: walks ahead in the recorded trace and fetches parameters before they are asked for.

[Note: two windows]
After each request the prefetcher walks the trace ahead of the cursor (see
[Note: the trace] in trace.py), group by group in trace order, and keeps two
windows full, each with its own byte budget:

- reads (``prefetch.nvme_bytes``, only when the parameter tier is NVMe): the shard
  read from NVMe into host memory is issued (``coordinator.start_fetch(group,
  prefetch=True)``) into a slice of the prefetcher's staging arena; the aio
  engine's threads do the I/O while the model computes. Held: the shard bytes of
  groups INFLIGHT that were read ahead and not yet asked for.
- gathers (``prefetch.device_bytes``): the host->device copy and the all-gather
  (``coordinator.wait_available``), after which the group is AVAILABLE. Held: the
  gathered bytes of groups made AVAILABLE ahead and not yet asked for.

Each window is filled in trace order and stops at the first group that does not
fit, so the budgets are never exceeded, and fetches happen in the order they are
needed. A group leaves the windows when a module asks for it (it then belongs to
that module, "the group currently needed").

[Note: ordered gathers]
With several ranks, the all-gather is a collective: every rank must issue the same
all-gathers in the same order, interleaved the same way with the gradient
reduce-scatters. Decisions therefore depend only on the sequence of requests and
on byte counts, never on timing: with several ranks a group entering the gather
window is gathered then, waiting for its read if need be (on CUDA the host is
ahead of the GPU, so this wait rarely shows as a GPU stall). With one rank there
is no collective; a gather ahead is done only when its read has already finished
(``future.done()``), so the compute thread never blocks on a read it does not need
yet, and the rest is left to the module's own request.

[Note: reuse]
A group asked for again within ``prefetch.reuse_distance`` bytes of fetches (per
the trace) is kept at its request (``coordinator.keep_for_reuse``), so the coordinator does
not release it after use; it is let go at its last use within that distance.
Kept bytes are reported separately (``kept_bytes``); ``reuse_distance`` bounds them.

[Note: leftovers]
Groups read or gathered ahead but never asked for (after a divergence, or a
forward with no backward) are dropped at the end of the step: at the end of a
backward the coordinator drops every group not in use; at the end of a no-grad
forward and at the start of every step the prefetcher drops what it still holds.
Dropping an INFLIGHT group waits for its read, so every staging slice comes back.

[Note: why prefetched reads have their own staging]
Demand fetches stage NVMe reads in the coordinator's fixed pool (a few buffers as
large as the largest shard, see [Note: staging buffers] in infinity/runtime/shards.py). If reads
issued ahead took buffers from that pool, a module needing a buffer could wait
for one that only a later module would give back: a hang on one thread. And
``prefetch.nvme_bytes`` is a byte budget, which a count of largest-shard buffers
expresses badly when shard sizes differ a lot (one big embedding, many small
layers). So reads ahead get their own arena: one aligned allocation of
``prefetch.nvme_bytes`` (made at the first read ahead, never on the hot path
afterwards), carved into 4096-aligned slices (``tiers.arena.Arena``, [Note: arenas]). A slice
that does not fit is simply not taken and the read is left to demand: the arena
can never hold more than its budget, and it never blocks.

[Note: the arena sized to the model]
A group is read ahead at most once at a time (both traces share the arena, and the inference
pass's reads are dropped before training takes its trace up again), so the arena never holds
more than every group's shard at once, each rounded up to 4096 bytes. The default budget
(256 MiB, 512 MiB in the nvme preset) was allocated whole for a model of a few MiB. So the
arena takes ``read_ahead_arena_nbytes``: the budget, or twice that sum when smaller (twice,
so that free slices split among shards of different sizes never leave a read without room
the whole budget would have had). ``infinity-plan`` counts the same.

[Note: inference passes]
An evaluation or ``generate`` between training steps runs forwards with gradients off, each of which
asks for the forward half of the step's trace and then starts again from the top: against the training
trace the second such forward diverged, nothing was prefetched for the rest of the evaluation, and the
next training step recorded its trace again, unprefetched. So, once the model has an optimizer, a root
forward with gradients off is an inference pass with a trace of its own: the first is recorded, each
later one is a step of that trace, followed from its first request. The training trace waits where it
was: the next training forward or backward takes it up (after dropping what the other trace held
ahead), as if the passes had not happened. Without an optimizer every root forward is a step of the
one trace, as before. Step records ([Note: step records] in infinity/telemetry.py) count an inference
pass's requests in the training step around it.
"""
from __future__ import annotations

import collections
import itertools
import logging

import torch
from torch import nn

from infinity.param_group import ParamGroup, ParamState
from infinity.prefetch.trace import BACKWARD, FORWARD, Divergence, Trace, TraceEntry, TraceMode
from infinity.prefetch.windows import Windows
from infinity.telemetry import StepTelemetry
from tiers.arena import Arena

logger = logging.getLogger("infinity")


def read_ahead_arena_nbytes(budget: int, shard_nbytes) -> int:
    """The read-ahead arena's bytes: ``prefetch.nvme_bytes``, or twice every shard's bytes (each rounded up to
    4096) when that is less ([Note: the arena sized to the model])."""
    return min(int(budget), 2 * sum(-(-int(n) // 4096) * 4096 for n in shard_nbytes))


class Prefetcher:
    """Records the request order of a step, then fetches ahead of it; also meters every step.

    The engine creates one in ``Engine.finalize`` and calls its lifecycle methods
    (``begin_forward``, ``end_forward``, ``begin_backward``, ``end_backward``,
    ``on_request``). With ``prefetch.enabled = false`` it only meters steps (see
    [Note: step records] in infinity/telemetry.py), so ``infinity.stats`` reports the same figures
    with prefetching off.

    Parameters
    ----------
    engine:
        The engine (``config``, ``coordinator``, ``ranks``, ``tiers``, ``roots``, ``optimizer``).
    """

    def __init__(self, engine) -> None:
        cfg = engine.config.prefetch
        self.engine = engine
        self.coordinator = engine.coordinator
        self.enabled = cfg.enabled
        # [Note: the arena sized to the model]
        self.nvme_bytes = read_ahead_arena_nbytes(cfg.nvme_bytes, [g.shard_nbytes for g in engine.coordinator.groups])
        self.device_bytes = cfg.device_bytes
        self.reuse_distance = cfg.reuse_distance
        self.reads_ahead = engine.config.tiers.params == "nvme"
        self.arena = (Arena(engine.tiers.allocator.empty, self.nvme_bytes, name="prefetch-staging")
                      if self.enabled and self.reads_ahead and self.nvme_bytes > 0 else None)
        self.telemetry = StepTelemetry(engine, cfg.log_every, logger)
        self.names: dict[nn.Module, str] = {}
        for root in engine.roots:
            for qualname, module in root.named_modules():
                self.names.setdefault(module, qualname)
        self.modules = {qualname: module for module, qualname in self.names.items()}
        self._roots = {id(r) for r in engine.roots}
        # The training steps' trace and the inference passes' (see [Note: inference passes]), each with its
        # windows; ``trace`` and ``windows`` are the running one's.
        self._lanes = {}
        for lane in ("training", "inference"):
            trace = Trace()
            self._lanes[lane] = (trace, Windows(self.coordinator, trace, self.arena, self.nvme_bytes,
                                                cfg.device_bytes, ordered_gathers=engine.ranks.world_size > 1,
                                                reads_ahead=self.reads_ahead))
        self.traces = tuple(trace for trace, _ in self._lanes.values())
        self.lane = "training"
        self.trace, self.windows = self._lanes["training"]
        self._ahead = self.windows.ahead     # read or gathered ahead, not yet asked for (in order)
        # Groups gathered in place (one rank, shards in the compute device's memory) are their stored
        # shards and stay gathered: nothing is ever worth fetching ahead or keeping, so a followed
        # request only checks the trace (which the foreign-parameter watch relies on).
        self._walks = not self.coordinator.in_place
        self._kept: set[ParamGroup] = set()
        self._distances: list[dict[int, int | None]] = []
        self._starts: list[int] = [0]
        self._plans = {lane: ([], [0]) for lane in self._lanes}   # the other trace's reuse plan, kept
        self._in_backward = False
        self.step = -1
        self._step_key = None
        self._forwards = 0
        self._step_diverged = False
        self.divergence_counts: collections.Counter = collections.Counter()
        self.divergence_text: dict[tuple, str] = {}
        self.peak_nvme_bytes = 0
        self.peak_device_bytes = 0
        self.peak_kept_bytes = 0

    @property
    def following(self) -> bool:
        """Whether this step follows a recorded trace (every module's groups, adopted ones
        included, are known: the engine need not watch every torch call for foreign ones)."""
        return self.enabled and self.trace.mode is TraceMode.FOLLOWING

    # -- lifecycle (called by the engine) ----------------------------------------------------
    def begin_forward(self, module: nn.Module) -> None:
        """A forward starts with an empty module stack; a root's first forward after a step opens a step."""
        if self._in_backward or id(module) not in self._roots:
            return   # a forward inside backward (recomputation) belongs to the backward phase
        self._forwards += 1
        optimizer = self.engine.optimizer
        if optimizer is not None and not torch.is_grad_enabled():
            self._switch("inference")       # each pass a step of its own trace ([Note: inference passes])
            self._begin_trace_step()        # (an evaluation before the first training step too)
            return
        self._switch("training")
        # An optimizer step (taken or skipped for a non-finite gradient) closes a step; with
        # no optimizer (inference) every root forward is a step.
        key = ((optimizer.step_count, getattr(optimizer, "skipped_steps", 0)) if optimizer is not None
               else self._forwards)
        if key != self._step_key:
            self._step_key = key
            self._new_step()

    def _switch(self, lane: str) -> None:
        """Make ``lane``'s trace the running one; what the other held ahead is dropped."""
        if lane == self.lane:
            return
        if self.enabled:
            found = self.trace.end_step() if lane == "training" else None     # the last pass ends
            if found is not None:
                self._diverged(found)
        self._drop_leftovers()
        # Each trace keeps its reuse plan ([Note: reuse]): a trace does not change while the other runs.
        self._plans[self.lane] = (self._distances, self._starts)
        self.lane = lane
        self.trace, self.windows = self._lanes[lane]
        self._distances, self._starts = self._plans[lane]
        self._ahead = self.windows.ahead
        self.windows.in_backward = self._in_backward
        self.windows.restart(self.enabled)

    def end_forward(self) -> None:
        if not self._in_backward and not torch.is_grad_enabled():
            self._drop_leftovers()   # no backward can follow a no-grad forward

    def begin_backward(self) -> None:
        self._switch("training")     # a backward follows a training forward, whatever ran in between
        self._in_backward = self.windows.in_backward = True

    def end_backward(self) -> None:
        # coordinator.end_backward() has just dropped every group not in use (ours too)
        # and cleared coordinator.keep.
        self._in_backward = self.windows.in_backward = False
        self.windows.forget()
        self._kept.clear()
        self.windows.restart(self.enabled)

    def on_request(self, module: nn.Module, groups) -> None:
        """A module asks for ``groups`` (forward or backward); called before they are gathered."""
        if self.ignores(groups):
            return
        self.telemetry.count_request(groups, self._ahead, self._kept)
        for g in groups:
            self.windows.take(g)
        if not self.enabled or (self.telemetry.step is None and self.lane == "training"):
            return
        name = self.names.get(module)
        if name is None:
            name = f"<{type(module).__name__} outside the model>"
        phase = BACKWARD if self._in_backward else FORWARD
        found = self.trace.observe(phase, name, tuple(g.index for g in groups))
        if found is not None:
            self._diverged(found)
            return
        if self.trace.mode is TraceMode.FOLLOWING and self._walks:
            self.windows.passed(self.trace.cursor - 1)
            self._reuse(groups, self.trace.cursor - 1)
            self.windows.walk()
            self._note_peaks(self.windows.held_bytes["nvme"], self.windows.held_bytes["device"])

    def ignores(self, groups) -> bool:
        """Whether a request for ``groups`` means nothing to the prefetcher (a module without groups
        in a followed step: see [Note: requests without groups] in trace.py)."""
        return self.enabled and self.trace.ignores(groups)

    def on_dropped(self, group: ParamGroup) -> None:
        """The coordinator dropped ``group`` (NOT_AVAILABLE again): its next use ahead needs a fetch."""
        self.windows.dropped(group)

    # -- steps ---------------------------------------------------------------------------------
    def _new_step(self) -> None:
        if self.telemetry.step is not None:
            found = self.trace.end_step() if self.enabled else None
            if found is not None:
                self._diverged(found)
            self._drop_leftovers()
            self.telemetry.end_step(self._step_extra())
        self.step += 1
        self._begin_trace_step()
        self._step_diverged = False
        self.windows.end_step()
        self.telemetry.begin_step(self.step)
        self.peak_nvme_bytes = self.peak_device_bytes = self.peak_kept_bytes = 0

    def _begin_trace_step(self) -> None:
        """The running trace starts a step (a training step, or an inference pass)."""
        if not self.enabled:
            return
        if self.lane == "inference":
            self._drop_leftovers()
        module_groups = self.coordinator.module_groups
        self.trace.begin_step(lambda entry: _groups_now(entry, self.modules.get(entry.name), module_groups))
        if self.trace.mode is TraceMode.FOLLOWING:
            self._distances, self._starts = _next_uses(self.trace, self.coordinator.groups)
        self.windows.restart(self.enabled)

    def _step_extra(self) -> dict:
        return {"trace": self._lanes["training"][0].mode.value if self.enabled else "off",
                "diverged": self._step_diverged,
                "peak_prefetch_nvme_bytes": self.peak_nvme_bytes,
                "peak_prefetch_device_bytes": self.peak_device_bytes,
                "peak_kept_bytes": self.peak_kept_bytes}

    def _diverged(self, found: Divergence) -> None:
        """Stop prefetching for this step; warn once per distinct divergence (see [Note: trace states])."""
        key = found.key()
        if self.lane == "inference":
            key = ("inference", *key)
        else:
            self._step_diverged = True
        self.divergence_counts[key] += 1
        if self.divergence_counts[key] == 1:
            self.divergence_text[key] = found.describe()
            if self.lane == "inference":
                logger.warning("infinity prefetch: a forward with gradients off left the trace of such forwards "
                               "(pass %s). Prefetching stops for the rest of this pass and the next one records "
                               "again (shown once per distinct divergence; data-dependent control flow or a "
                               "different input shape path cause this).", found.describe())
                return
            logger.warning("infinity prefetch: the model left its recorded trace: %s. Prefetching stops "
                           "for the rest of this step and the next step records the trace again "
                           "(shown once per distinct divergence; data-dependent control flow, a forward "
                           "with gradients off before the optimizer exists, or a different input shape path "
                           "cause this).", found.describe())

    def _drop_leftovers(self) -> None:
        """Drop what was fetched ahead and never asked for (see [Note: leftovers])."""
        c = self.coordinator
        for g in list(self._ahead):
            if g.state is not ParamState.NOT_AVAILABLE and not c.busy(g):
                c.drop(g)
        self.windows.forget()
        for g in list(self._kept):
            c.keep_for_reuse(g, False)
            if g.state is not ParamState.NOT_AVAILABLE and not c.busy(g):
                c.drop(g)
        self._kept.clear()

    # -- reuse -----------------------------------------------------------------------------------
    def _reuse(self, groups, position: int) -> None:
        if self.reuse_distance <= 0 or position >= len(self._distances):
            return
        distances = self._distances[position]
        for g in groups:
            d = distances.get(g.index)
            if d is not None and d <= self.reuse_distance and not g.persistent:
                self.coordinator.keep_for_reuse(g, next_use=self._starts[position + 1] + d)
                self._kept.add(g)
            elif g in self._kept:
                self.coordinator.keep_for_reuse(g, False)
                self._kept.discard(g)

    # -- the walk ahead --------------------------------------------------------------------------
    def held(self) -> dict:
        """Bytes held ahead right now: ``nvme`` (reads in flight), ``device`` (gathered), ``kept``."""
        kept = sum(g.full_nbytes for g in self._kept if g.state is ParamState.AVAILABLE)
        return dict(self.windows.held(), kept=kept)

    def _note_peaks(self, nvme: int, device: int) -> None:
        """Bytes held ahead after a walk (its own accounting: no second pass over what is ahead)."""
        self.peak_nvme_bytes = max(self.peak_nvme_bytes, nvme)
        self.peak_device_bytes = max(self.peak_device_bytes, device)
        if self._kept:
            kept = sum(g.full_nbytes for g in self._kept if g.state is ParamState.AVAILABLE)
            self.peak_kept_bytes = max(self.peak_kept_bytes, kept)

    # -- telemetry -------------------------------------------------------------------------------
    def current_step(self) -> dict | None:
        """The running step's record so far (as in ``infinity.stats(model)["steps"]``), or None."""
        record = self.telemetry.current()
        if record is not None:
            record.update(self._step_extra())
        return record

    def stats(self) -> dict:
        """Trace state, budgets, bytes held now and at the step's peak, divergences, the running step."""
        return {
            "enabled": self.enabled,
            "trace": self._lanes["training"][0].summary(),
            "inference_trace": self._lanes["inference"][0].summary(),
            "budgets": {"nvme_bytes": self.nvme_bytes, "device_bytes": self.device_bytes,
                        "reuse_distance": self.reuse_distance},
            "held": self.held(),
            "walk": self.windows.stats(),
            "peak": {"nvme": self.peak_nvme_bytes, "device": self.peak_device_bytes, "kept": self.peak_kept_bytes},
            "arena": None if self.arena is None else self.arena.stats(),
            "divergences": [{"what": self.divergence_text[k], "count": n} for k, n in self.divergence_counts.items()],
            "last_step": self.telemetry.last,
            "current_step": self.current_step(),
        }


def _groups_now(entry: TraceEntry, module: nn.Module | None, module_groups) -> tuple[int, ...]:
    """An entry's group indices as its module has them now (groups adopted during the recorded step)."""
    if module is None:
        return entry.groups
    return tuple(g.index for g in module_groups.get(module, ()))


def _next_uses(trace: Trace, groups) -> tuple[list[dict[int, int | None]], list[int]]:
    """For [Note: reuse]: each entry's groups' next-use distances, and the bytes fetched in the step before
    each entry (a group's next use as a point in the step)."""
    nbytes = [g.full_nbytes for g in groups]
    distances = trace.next_use_distances(lambda i: nbytes[i])
    starts = list(itertools.accumulate((sum(nbytes[g] for g in e.groups) for e in trace.entries), initial=0))
    return distances, starts
