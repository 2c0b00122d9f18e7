"""What the engine did, without a profiler: ``infinity.stats`` and the per-step records.

What the room holds: the public ``stats(model)`` and ``StepTelemetry``, which turns the
counters of the coordinator and of the tiers into one record per training step. What it
may touch: it reads counters (the coordinator's ``FetchStats``, each tier's ``stats()``)
and the engine's step records; it moves nothing and changes no state.

Per-step telemetry: what a training step waited for and moved, without a profiler.

[Note: step records]
A step runs from the start of the root module's forward after an optimizer step
to the next such start (so it includes the optimizer step and whatever the user
does between steps). At each boundary the counters of the coordinator and of every
tier are read and the differences become one record in ``engine.step_stats``
(what ``infinity.stats(model)["steps"]`` returns):

- ``seconds``: wall time of the step;
- ``stall_seconds``: time the compute thread spent making parameters available
  (``read_wait_seconds`` of it blocked on tier reads, ``update_wait_seconds`` waiting
  for the overlapped optimizer step to rewrite a shard, the rest host->device copies
  and all-gathers); ``stall_fraction`` = stall / seconds;
- ``hits`` / ``misses`` / ``hit_rate``: of the parameter groups a module asked for
  that had to be fetched (not persistent, not already gathered for another user),
  how many the prefetcher had read or gathered ahead, or kept for reuse; ``late``
  counts the hits whose read was still in flight when asked for;
- ``device_transient_peak`` (a GPU only): the most device memory the step held above what
  stayed allocated after it (activations, and whatever else it freed by its end; buffers it
  made and kept, such as stage 1's whole gradients, are not counted), read from CUDA's peak
  counter without resetting it (a user's ``torch.cuda.max_memory_allocated()`` stays
  theirs); None where an earlier, higher peak hides the step's. After the first training
  step (the first record closed after an optimizer step) of tiers "auto" chosen without
  ``activations.checkpoint_nbytes``, the ``infinity`` logger says how it compares with the
  share of the device the choice kept for activations ([Note: activations before the first
  step] in infinity/plan/placement.py);
- ``tiers``: bytes read and written per tier in the step's wall time and the rates
  achieved over it (decimal GB/s), plus ``bytes_read`` / ``bytes_written`` / ``GBps``
  summed over tiers. An overlapped update runs across the boundary, so these bytes
  are one step's only on average; the transfer ledger books each step's own
  (``stats(model)["transfers"]``, see [Note: a step's bytes] in infinity/runtime/datapath.py).

Only the last ``MAX_RECORDS`` records are kept, so a long run does not grow memory.
With ``prefetch.log_every = N`` > 0 a one-line summary goes to the ``infinity``
logger (INFO) every N steps.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from infinity import registry
from infinity.param_group import ParamState

MAX_RECORDS = 1000
GB = 1e9
TIER_NAMES = ("device", "host", "nvme")


class StepTelemetry:
    """Counts one step at a time and appends its record to ``engine.step_stats``.

    Parameters
    ----------
    engine:
        The engine (reads ``coordinator.stats``, ``tiers``, appends to ``step_stats``).
    log_every:
        Log a summary line every this many steps (0: never).
    logger:
        Where the summary goes (default: the ``infinity`` logger).
    """

    def __init__(self, engine, log_every: int = 0, logger: logging.Logger | None = None) -> None:
        self.engine = engine
        self.log_every = log_every
        self.logger = logger or logging.getLogger("infinity")
        self.step: int | None = None
        self.last: dict | None = None
        self._memory0: tuple[int, int] | None = None
        self._weighed = False       # the first training step was weighed against "auto"'s guess
        self._t0 = 0.0
        self._fetch0: dict = {}
        self._tiers0: dict = {}
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.hits = 0
        self.late = 0
        self.misses = 0

    # -- counting ----------------------------------------------------------------------------
    def count_request(self, groups, ahead, kept) -> None:
        """Classify the groups a module asked for, before anything moves (see [Note: step records])."""
        coordinator = self.engine.coordinator
        in_use = coordinator.in_use
        for g in groups:
            if g.persistent:
                continue
            if g in ahead and g.state is not ParamState.NOT_AVAILABLE:
                self.hits += 1
                if g.state is ParamState.INFLIGHT and not g.pending.future.done():
                    self.late += 1
            elif g in kept and g.state is ParamState.AVAILABLE and not in_use.get(g):
                self.hits += 1
            elif g.state is ParamState.NOT_AVAILABLE and coordinator.shards.has_fresh(g):
                self.hits += 1   # in host memory already (see [Note: fresh shards] in infinity/prefetch/fresh_shards.py)
            elif g.state is not ParamState.AVAILABLE:
                self.misses += 1

    # -- boundaries --------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if step == 0:
            self.engine.datapath.ledger.discard()   # construction's traffic is no step's
            self.engine.ranks.comm.discard()
        self.step = step
        self._reset_counts()
        self._fetch0 = self._fetch_counters()
        self._tiers0 = self._tier_counters()
        self._memory0 = device_memory(self.engine.datapath)
        self._t0 = time.perf_counter()

    def end_step(self, extra: dict | None = None) -> dict | None:
        """Close the running step: build its record, keep it, log it when due; returns it."""
        if self.step is None:
            return None
        record = self._record(extra or {})
        self.engine.datapath.ledger.close_step()
        self.engine.ranks.comm.close_step()
        self.step = None
        self.last = record
        records = self.engine.step_stats
        records.append(record)
        if len(records) > MAX_RECORDS:
            del records[:-MAX_RECORDS]
        if self.log_every and (record["step"] + 1) % self.log_every == 0:
            self.logger.info(summary_line(record))
        optimizer = self.engine.optimizer
        if not self._weighed and optimizer is not None and optimizer.step_count >= 1:
            self._weighed = True    # the first training step: forwards before the optimizer (eval, generate) are not
            self._weigh_the_reserve(record)
        return record

    def _weigh_the_reserve(self, record: dict) -> None:
        """After the first training step: the device memory it held against what "auto" kept for activations."""
        decision, peak = self.engine.placement, record.get("device_transient_peak")
        if decision is None or not decision.reserve_assumed or peak is None:
            return
        kept, gib = decision.activation_reserve, 2**30
        ranks = self.engine.ranks
        who = f"rank {ranks.rank}: " if ranks.world_size > 1 else ""
        if peak > kept:
            self.logger.warning(
                f"infinity: {who}the first training step held {peak / gib:.1f} GiB of device memory above what it "
                f"kept, more than the {kept / gib:.1f} GiB that tiers \"auto\" kept for activations: a larger batch "
                f"may run out of device memory; give activations.checkpoint_nbytes = {int(peak)} so that the "
                "placement leaves room for them")
        elif peak < kept / 2 and ranks.rank == 0:
            self.logger.info(
                f"infinity: tiers \"auto\" kept {kept / gib:.1f} GiB of device memory for activations and the first "
                f"training step held {peak / gib:.1f} GiB above what it kept: with activations.checkpoint_nbytes = "
                f"{int(peak)} the placement may put more states on the device")

    def current(self) -> dict | None:
        """The running step's figures so far (None between steps)."""
        return None if self.step is None else self._record({})

    # -- helpers -----------------------------------------------------------------------------
    def _fetch_counters(self) -> dict:
        s = self.engine.coordinator.stats
        return {"stall_seconds": s.stall_seconds, "read_wait_seconds": getattr(s, "read_wait_seconds", 0.0),
                "update_wait_seconds": getattr(s, "update_wait_seconds", 0.0)}

    def _tier_counters(self) -> dict:
        out = {}
        for name in TIER_NAMES:
            tier = self.engine.tiers.by_name.get(name)
            if tier is not None:
                snap = tier.stats()
                out[name] = (snap.get("bytes_read", 0), snap.get("bytes_written", 0))
        return out

    def _record(self, extra: dict) -> dict:
        seconds = max(time.perf_counter() - self._t0, 1e-12)
        fetch = self._fetch_counters()
        stall = fetch["stall_seconds"] - self._fetch0["stall_seconds"]
        read_wait = fetch["read_wait_seconds"] - self._fetch0["read_wait_seconds"]
        update_wait = fetch["update_wait_seconds"] - self._fetch0["update_wait_seconds"]
        tiers = {}
        total_read = total_written = 0
        for name, (read, written) in self._tier_counters().items():
            read0, written0 = self._tiers0.get(name, (0, 0))
            dr, dw = read - read0, written - written0
            total_read += dr
            total_written += dw
            tiers[name] = {"bytes_read": dr, "bytes_written": dw,
                           "read_GBps": dr / seconds / GB, "write_GBps": dw / seconds / GB}
        asked = self.hits + self.misses
        record = {
            "step": self.step,
            "seconds": seconds,
            "stall_seconds": stall,
            "read_wait_seconds": read_wait,
            "update_wait_seconds": update_wait,
            "stall_fraction": stall / seconds,
            "hits": self.hits,
            "late": self.late,
            "misses": self.misses,
            "hit_rate": self.hits / asked if asked else 0.0,
            "bytes_read": total_read,
            "bytes_written": total_written,
            "GBps": (total_read + total_written) / seconds / GB,
            "tiers": tiers,
        }
        if self._memory0 is not None:
            _, peak0 = self._memory0
            allocated, peak = device_memory(self.engine.datapath)
            record["device_transient_peak"] = peak - allocated if peak > peak0 else None
        record.update(extra)
        return record


def device_memory(datapath) -> tuple[int, int] | None:
    """``(allocated, peak allocated)`` bytes on the engine's GPU; None on a CPU device."""
    if not datapath.is_cuda:
        return None
    return torch.cuda.memory_allocated(datapath.device), torch.cuda.max_memory_allocated(datapath.device)


def summary_line(record: dict) -> str:
    """One line for the log: ``step 12: 1.234 s, stall 0.051 s (4.1%), hit 97% ...``."""
    parts = [f"step {record['step']}: {record['seconds']:.3f} s",
             f"stall {record['stall_seconds']:.3f} s ({100 * record['stall_fraction']:.1f}%)",
             f"prefetch hit {100 * record['hit_rate']:.0f}% ({record['late']} late, {record['misses']} missed)"]
    for name, t in record["tiers"].items():
        if t["bytes_read"] or t["bytes_written"]:
            parts.append(f"{name} read {t['bytes_read'] / GB:.2f} GB ({t['read_GBps']:.2f} GB/s) "
                         f"written {t['bytes_written'] / GB:.2f} GB ({t['write_GBps']:.2f} GB/s)")
    if "trace" in record:
        parts.append(f"trace {record['trace']}")
    return "infinity " + ", ".join(parts)


def stats(model: nn.Module) -> dict:
    """Telemetry of the engine managing ``model``.

    Returns a dict with ``fetch`` (stall seconds, fetches, prefetch hits and hit rate,
    bytes gathered and read from the parameter tier), ``tiers`` (bytes read/written,
    wait time, current and peak bytes per tier), ``steps`` (per-step records) and
    ``prefetch`` (trace state), ``transfers`` (the last step's data-path ledger, see
    infinity/runtime/datapath.py), ``comm`` (what this rank sent through collectives in the
    last step, see [Note: communication volume] in infinity/runtime/ranks.py) and ``activations``
    (with ``activations.offload`` set: the bytes checkpoints saved in the last forward and moved,
    ``checkpoint_nbytes``; per cycle and in total, the bytes moved and fetched back and the stall
    they caused, ``stall_seconds``; see infinity/runtime/activations.py) and ``optimizer_tiers`` (per tier
    holding optimizer states: this rank's elements there, their fraction and the parameter groups; see
    [Note: optimizer states over tiers] in infinity/optim/tier_split.py), on this rank.
    """
    return registry.engine_of(model, "infinity.stats").stats()
