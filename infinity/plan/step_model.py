"""The step-time model: from a placement of one rank's states and a machine profile to a predicted step.

[Note: placements]
Sub-groups of one rank's flat shard are alike, so a placement is a count, not a list: the shard is cut
into ``slices`` equal slices (each some whole sub-groups; a slice stands for its share of every group),
and each slice puts its compute copies in one tier and its optimizer states (fp32 master, Adam m and v,
gradient) in one tier: ``cells[(params tier, optimizer tier)]`` counts the slices of each pair. The
engine runs the placements with one params tier (``tiers.params``): the states in one tier, or split over
tiers by ``tiers.optimizer_device_share`` / ``optimizer_host_share`` ([Note: optimizer states over tiers]
in infinity/optim/tier_split.py), device slices first, then host, then ``tiers.optimizer``.

[Note: step-time model]
Bytes and traffic of a placement the engine runs are the plan of its config (``infinity.plan.layout``:
[Note: where each byte lives], [Note: PCIe traffic per step], [Note: NVMe traffic per step]; a split cut
at group boundaries as the engine cuts), so the model of such a placement is exactly what
``infinity-plan`` counts. Those of any other placement's cell are its share of the uniform plan of that
pair. Buffers that exist once per rank
(I/O pool, sub-group buffers, staging, the gathered working set) are taken once, at the largest size any
present pair needs. The step has three phases; each is a window in which every resource works at once,
so a window takes as long as its busiest resource:

* forward: compute 2 x params x tokens / FLOP/s (or a third of a measured compute time,
  ``Workload.compute_s``); host->device copies of the parameters not on the
  device (every fetch but the last of each group) and their NVMe reads;
* backward: compute 4 x params x tokens (6 with activation checkpointing, which runs the forward
  again); the last fetch of each group; gradients device->host for the states off the device, and
  their NVMe writes;
* update: AdamW on the device for the states there (on the compute resource), on the host for the
  rest (host time: the elements over the measured AdamW rate, or the pass's bytes over the memory
  bandwidth, whichever is longer; the machine's ranks share it); optimizer states and rewritten
  compute copies to and from NVMe; new compute copies across the link where copy and states are on
  different sides.
* device update, with the states split over tiers: the device share's AdamW (at
  ``device_update_params_per_s``), its new compute copies to host memory or NVMe when the copies are
  not on the device. The engine steps it inside ``opt.step()`` before handing the rest on
  (``UpdateScheduler``'s device lane, infinity/optim/scheduler.py; the lane's pass waits for its
  copies' CUDA events, so the host share's update starts after the device's ends), so it is a window
  of its own in every schedule, added to the step; the "update" phase is then the host and NVMe
  shares' alone. Within it the host share is counted beside the NVMe share's traffic, as one window;
  the engine steps the host share while only the first two streamed sub-groups' reads land
  ([Note: pipelined sub-groups] in infinity/optim/pipeline.py), so where the host share's AdamW is
  longer than those reads the window is short by the difference (at 13B on one 80 GB GPU, auto's split
  steps ~8 G host elements, about a second beside a disk-bound update of tens of seconds).

Resources: compute, host->device link, device->host link, host update, disk (reads / read rate +
writes / write rate, shared by the machine's ranks), and with ``interconnect_gbps`` in the profile the
collectives (what one rank sends in the step's all-gathers, every fetch but the last of a group in the
forward, and reduce-scatters, in the backward: [Note: communication volume] in infinity/runtime/ranks.py). The engine's schedule decides which windows merge
([Note: update modes] in infinity/optim/scheduler.py): the overlapped update (``dpu.overlap``; when
the pass touches NVMe or, on a GPU, host states) runs beside the next forward, so update and forward
are one window; the update during backward joins the backward's window; DPU runs it beside the whole
next iteration (one window); otherwise the three follow each other. The update beside the forward
goes up the sub-groups as the forward goes up the groups, and a group's forward waits for its
sub-group: the window is at least the update alone plus the forward of the groups in its last
sub-group (their share of the forward counted as their share of the rank's elements), which
matters where the update is the longer and sub-groups are few (a small model on the CPU: 4M-element
sub-groups of a 16M model leave a quarter of the forward after the update). The update during backward
steps each sub-group once backward has produced its gradients, the model's last sub-group first: it
starts no sooner than the backward of that sub-group's groups, and the sub-group backward reaches last
(the model's first groups, which the next forward needs first) is stepped after the backward ends, so
the window is at least either of those plus the rest of the update (a model of one sub-group steps it
all after backward). With the CPU as compute device the host update and the copies between "device" and
host memory (memcpys) run on the cores that compute: all count on the compute resource. (Counted on links
of their own, as on a GPU, they were taken as overlapped with the compute they slow: over 93 steps measured
on two cores, 67 within 15% of the prediction with them apart, 78 with them on the compute.)

The bound (shared/DESIGN.md, "Placement and the bound") is one window of everything: no schedule
beats the busiest resource's total. The governing term is that resource.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infinity.plan.census import ModelCensus
from infinity.plan.errors import PlanError
from infinity.plan.layout import Layout
from infinity.plan.machine import MachineProfile, Workload

if TYPE_CHECKING:
    from infinity.config import Config

TIERS = ("device", "host", "nvme")
PAIRS = tuple(itertools.product(TIERS, TIERS))     # (params tier, optimizer tier)
RESOURCES = ("compute", "host_to_device", "device_to_host", "host_update", "nvme", "interconnect")
PHASES = ("forward", "backward", "update")
STATE_ROWS = ("compute_copy", "master", "adam_moments", "grad_accumulator", "dpu_grad_accumulator",
              "dpu_compute_copy")
FP32_BYTES = 4
PLACEHOLDER_NVME = "/nonexistent/infinity-plan"


@dataclass(frozen=True)
class Placement:
    """Slices of one rank's shard per (params tier, optimizer tier) pair (see [Note: placements]).

    Examples
    --------
    >>> Placement.uniform("device", "host").describe()
    'params device, optimizer host'
    """

    slices: int
    cells: tuple[tuple[tuple[str, str], int], ...]

    def __post_init__(self) -> None:
        if sum(n for _, n in self.cells) != self.slices or any(n < 0 for _, n in self.cells):
            raise PlanError(f"a placement's cells must count its {self.slices} slices, got {self.cells}")
        object.__setattr__(self, "cells", tuple(sorted(((p, n) for p, n in self.cells if n),
                                                       key=lambda c: PAIRS.index(c[0]))))

    @classmethod
    def uniform(cls, params: str, optimizer: str) -> "Placement":
        return cls(1, (((params, optimizer), 1),))

    @classmethod
    def from_counts(cls, slices: int, params: tuple[int, int], optimizer: tuple[int, int]) -> "Placement":
        """Slice i holds its copies on the device while i < params[0], in host memory while i < params[0] +
        params[1], else on NVMe; its states likewise by ``optimizer``: fastest tiers on the same slices."""
        counts: dict[tuple[str, str], int] = {}
        for i in range(slices):
            pair = (_tier_of(i, params), _tier_of(i, optimizer))
            counts[pair] = counts.get(pair, 0) + 1
        return cls(slices, tuple(counts.items()))

    @classmethod
    def of_tiers(cls, params: str, optimizer: str, device_share: float = 0.0, host_share: float = 0.0,
                 slices: int = 10**6) -> "Placement":
        """A config's tiers as a placement: the compute copies in ``params``, the optimizer states split by the
        shares ([Note: optimizer states over tiers] in infinity/optim/tier_split.py), to ``1 / slices``."""
        if not (device_share or host_share):
            return cls.uniform(params, optimizer)
        device = round(device_share * slices)
        host = round((device_share + host_share) * slices) - device
        return cls(slices, (((params, "device"), device), ((params, "host"), host),
                            ((params, optimizer), slices - device - host)))

    @property
    def pair(self) -> tuple[str, str] | None:
        """(params, optimizer) tiers when uniform, else None."""
        return self.cells[0][0] if len(self.cells) == 1 else None

    @property
    def params_tier(self) -> str | None:
        """The one tier of every compute copy (the engine runs only such placements), else None."""
        tiers = {p for (p, _), _ in self.cells}
        return tiers.pop() if len(tiers) == 1 else None

    def optimizer_tiers(self) -> tuple[str, float, float]:
        """``(tiers.optimizer, tiers.optimizer_device_share, tiers.optimizer_host_share)`` of this placement's
        optimizer states: the slowest tier holding any, and the shares of the faster ones before it."""
        base = next(t for t in reversed(TIERS) if self.share(optimizer=t))
        device = self.share(optimizer="device") if base != "device" else 0.0
        host = self.share(optimizer="host") if base == "nvme" else 0.0
        return base, device, host

    def share(self, params: str | None = None, optimizer: str | None = None) -> float:
        """Fraction of the shard whose copies (or states) are in the given tiers."""
        return sum(n for (p, o), n in self.cells if params in (None, p) and optimizer in (None, o)) / self.slices

    def describe(self) -> str:
        if self.pair is not None:
            return f"params {self.pair[0]}, optimizer {self.pair[1]}"
        params = self.params_tier or " / ".join(f"{t} {self.share(params=t):.0%}" for t in TIERS
                                                if self.share(params=t))
        states = " / ".join(f"{t} {self.share(optimizer=t):.1%}".replace(".0%", "%") for t in TIERS
                            if self.share(optimizer=t))
        return f"params {params}, optimizer {states}"


def _tier_of(i: int, counts: tuple[int, int]) -> str:
    return "device" if i < counts[0] else "host" if i < counts[0] + counts[1] else "nvme"


@dataclass(frozen=True)
class PairCosts:
    """One rank's bytes and traffic per step under a uniform (params, optimizer) pair: the uniform plan's."""

    state: dict[str, float]           # tier -> bytes of model states
    buffers: dict[str, dict[str, int]]   # tier -> row key -> bytes of buffers held once per rank
    h2d: tuple[float, ...]            # forward, backward, update, device update (a split store's device share)
    d2h: tuple[float, ...]
    nvme_read: tuple[float, ...]
    nvme_write: tuple[float, ...]
    collectives: tuple[float, ...]    # bytes one rank sends in all-gathers and reduce-scatters
    host_elements: float              # elements the host AdamW steps
    host_bytes: float                 # bytes the host update pass moves through memory
    device_elements: float            # elements AdamW steps on the device
    lane: bool = False                # the device elements are stepped apart, inside opt.step() (a split store)


@dataclass(frozen=True)
class StepPrediction:
    """A placement's predicted step (see [Note: step-time model]).

    Attributes
    ----------
    placement : Placement
    phases : dict
        Seconds of each phase on its own: ``forward``, ``backward``, ``update``.
    schedule : str
        How the phases overlap: ``sequential``, ``update beside forward``, ``update beside backward``,
        ``update beside the whole step`` (DPU).
    step_s : float
        The predicted step.
    bound_terms : dict
        Seconds each resource needs per step in total; the bound is their largest.
    governing : str
        The resource with the largest total.
    need : dict
        Bytes needed per tier on the machine (``device``: per device).
    budget : dict
        Bytes available per tier.
    fits : bool
    machine : MachineProfile
        The profile it was predicted on.
    """

    placement: Placement
    phases: dict[str, float]
    schedule: str
    step_s: float
    bound_terms: dict[str, float]
    governing: str
    need: dict[str, float]
    budget: dict[str, float]
    fits: bool
    machine: MachineProfile | None = dataclasses.field(default=None, compare=False)

    @property
    def bound_s(self) -> float:
        return max(self.bound_terms.values())

    def shortfalls(self) -> list[str]:
        return [f"{tier}: needs {self.need[tier] / 2**30:.1f} GiB, has {self.budget[tier] / 2**30:.1f} GiB"
                for tier in TIERS if self.need[tier] > self.budget[tier]]

    def to_dict(self) -> dict[str, object]:
        return {"placement": {"slices": self.placement.slices,
                              "cells": [{"params": p, "optimizer": o, "slices": n}
                                        for (p, o), n in self.placement.cells],
                              "describe": self.placement.describe()},
                "phases_s": dict(self.phases), "schedule": self.schedule, "step_s": self.step_s,
                "bound_terms_s": dict(self.bound_terms), "bound_s": self.bound_s, "governing": self.governing,
                "need_bytes": dict(self.need), "budget_bytes": dict(self.budget), "fits": self.fits}


class StepModel:
    """Predicts the step of any placement of one model under one config, world size and machine.

    Parameters
    ----------
    census : ModelCensus
    cfg : Config
        Its ``tiers.params`` / ``tiers.optimizer`` are not used: the placement says where states go.
    world_size : int
        Data-parallel ranks (``profile.ranks`` of them per machine).
    profile : MachineProfile
    workload : Workload
    """

    def __init__(self, census: ModelCensus, cfg: "Config", world_size: int, profile: MachineProfile,
                 workload: Workload) -> None:
        self.census, self.cfg, self.world_size = census, cfg, world_size
        self.profile, self.workload = profile, workload
        self.pb = cfg.precision.itemsize
        self.pairs = {pair: self.pair_costs(*pair) for pair in PAIRS if allowed(cfg, *pair)}
        self.num_params = census.num_params
        self._runnable: dict[tuple, PairCosts] = {}

    def pair_costs(self, params: str, optimizer: str, device_share: float = 0.0,
                   host_share: float = 0.0) -> PairCosts:
        """The plan of these tiers (uniform, or the optimizer states split by the shares), split by phase (see
        [Note: step-time model])."""
        cfg = with_tiers(self.cfg, params, optimizer, device_share, host_share)
        layout = Layout(self.census, cfg, self.world_size, self.pb)
        state = {tier: 0.0 for tier in TIERS}
        buffers: dict[str, dict[str, int]] = {tier: {} for tier in TIERS}
        for row in layout.rows():
            if row.key in STATE_ROWS:
                state[row.tier] += row.nbytes
            else:
                buffers[row.tier][row.key] = row.nbytes
        t, pb = layout.trainable_numel, self.pb
        off, on = layout.trainable_off_device(), layout.trainable_on("device")
        # A split store steps its device share apart, inside opt.step() ([Note: optimizer states over tiers]
        # in infinity/optim/tier_split.py): that share's update traffic goes to the fourth phase.
        lane = layout.split_states
        fetched = pb * layout.gathered_numel if params != "device" else 0.0
        fetch_fwd = fetched * max(0.0, 1 - layout.shard_numel / max(1, layout.gathered_numel))
        h2d_update = layout.host_to_device_bytes() - fetched
        d2h_grads = pb * off
        d2h_update = layout.device_to_host_bytes() - d2h_grads     # the device update's new compute copies
        read_params = (layout.read_nvme - layout.fresh_bytes()) if params == "nvme" else 0.0
        read_fwd = read_params * max(0.0, 1 - layout.compute_nvme / max(1, layout.read_nvme))
        grads_written = layout.grad_bytes * layout.trainable_on("nvme") if not layout.grads_held else 0.0
        # Compute copies the device share's update rewrites on NVMe.
        lane_write = layout.rewrite_nvme * on / max(1, t) if lane and params == "nvme" else 0.0
        mom = layout.moments.bytes_per_element()
        gathered_fwd = layout.all_gather_bytes() * max(0.0, 1 - layout.shard_numel / max(1, layout.gathered_numel))
        # The pass reads master, m, v and gradient and writes master, m, v and the new compute copy.
        host_bytes = off * (2 * (FP32_BYTES + 2 * mom) + layout.grad_bytes + pb)
        lane_d2h = d2h_update if lane else 0.0
        return PairCosts(
            state=state, buffers=buffers,
            h2d=(fetch_fwd, fetched - fetch_fwd, h2d_update, 0.0),
            d2h=(0.0, d2h_grads, d2h_update - lane_d2h, lane_d2h),
            nvme_read=(read_fwd, read_params - read_fwd, layout.nvme_read_bytes() - read_params, 0.0),
            nvme_write=(0.0, grads_written, layout.nvme_write_bytes() - grads_written - lane_write, lane_write),
            collectives=(gathered_fwd, layout.all_gather_bytes() - gathered_fwd + layout.reduce_scatter_bytes(),
                         0.0, 0.0),
            host_elements=off, host_bytes=host_bytes, device_elements=on, lane=lane)

    def costs(self, placement: Placement) -> list[tuple[PairCosts, float, bool]]:
        """``(costs, weight, to the device lane)`` of the placement's parts. A placement the engine runs (one
        params tier) is one part, the plan of its config (the states cut at group boundaries as the engine
        cuts them); any other is its cells, each its share of a uniform pair's plan, the device states' update
        apart when the states are in several tiers (as a split store steps them)."""
        params = placement.params_tier
        mixed = len({o for (_, o), _ in placement.cells}) > 1
        if params is not None and (splits_allowed(self.cfg) or not mixed):
            tiers = (params, *placement.optimizer_tiers())
            if tiers not in self._runnable:
                self._runnable[tiers] = self.pair_costs(*tiers)
            return [(self._runnable[tiers], 1.0, False)]
        return [(self.pairs[pair], n / placement.slices, mixed and pair[1] == "device")
                for pair, n in placement.cells]

    def budget(self) -> dict[str, float]:
        prof = self.profile
        host = float(prof.host_bytes)
        if int(self.cfg.tiers.host_budget):
            host = min(host, float(self.cfg.tiers.host_budget))
        device = host if prof.unified else float(prof.device_bytes)
        # NVMe only where the config names a directory for it: the engine has nowhere else to put files.
        nvme = float(prof.nvme_bytes) if self.cfg.tiers.nvme_path else 0.0
        return {"device": device, "host": host, "nvme": nvme}

    @property
    def activation_reserve(self) -> float:
        """Device bytes per device kept for activations: the workload's, or its share of a GPU's memory."""
        wl, prof = self.workload, self.profile
        if wl.activation_bytes or prof.unified:
            return float(wl.activation_bytes)
        return wl.activation_share * float(prof.device_bytes)

    def need(self, placement: Placement) -> dict[str, float]:
        """Bytes per tier on the machine: host and NVMe for all its ranks, device per device."""
        per_rank = {tier: 0.0 for tier in TIERS}
        buffers: dict[str, dict[str, int]] = {tier: {} for tier in TIERS}
        for costs, share, _ in self.costs(placement):
            for tier in TIERS:
                per_rank[tier] += costs.state[tier] * share
                for key, nbytes in costs.buffers[tier].items():
                    buffers[tier][key] = max(buffers[tier].get(key, 0), nbytes)
        for tier in TIERS:
            per_rank[tier] += sum(buffers[tier].values())
        per_rank["device"] += self.activation_reserve
        ranks = self.profile.ranks
        need = {"device": per_rank["device"], "host": per_rank["host"] * ranks, "nvme": per_rank["nvme"] * ranks}
        if self.profile.unified:     # the device is host memory: one budget for both
            need["host"] += per_rank["device"] * ranks
            need["device"] = need["host"]
        return need

    def usage(self, placement: Placement) -> list[dict[str, float]]:
        """Seconds each resource is busy in each phase (forward, backward, update, device update)."""
        prof, wl = self.profile, self.workload
        flops = self.num_params * wl.tokens
        compute = (2 * flops / prof.device_flops, (4 + 2 * wl.recompute) * flops / prof.device_flops, 0.0, 0.0)
        if wl.compute_s:
            share = 4 if wl.recompute else 3
            compute = (wl.compute_s / share, wl.compute_s * (share - 1) / share, 0.0, 0.0)
        out = [dict.fromkeys(RESOURCES, 0.0) for _ in range(4)]
        disk = [[0.0, 0.0] for _ in range(4)]
        for phase, use in enumerate(out):
            use["compute"] = compute[phase]
        # With the CPU as compute device a "copy to the device" is a memcpy by the cores that compute.
        h2d, d2h = ("compute", "compute") if prof.unified else ("host_to_device", "device_to_host")
        for c, share, to_lane in self.costs(placement):
            for phase in range(4):
                into = 3 if to_lane and phase == 2 else phase
                use = out[into]
                use[h2d] += share * c.h2d[phase] / (prof.h2d_gbps * 1e9)
                use[d2h] += share * c.d2h[phase] / (prof.d2h_gbps * 1e9)
                if prof.interconnect_gbps:
                    use["interconnect"] += share * c.collectives[phase] / (prof.interconnect_gbps * 1e9)
                disk[into][0] += share * c.nvme_read[phase]
                disk[into][1] += share * c.nvme_write[phase]
            out[3 if c.lane or to_lane else 2]["compute"] += share * c.device_elements / prof.device_update_params_per_s
            host = prof.ranks * share * max(c.host_elements / prof.host_adam_params_per_s,
                                            c.host_bytes / (prof.host_memory_gbps * 1e9))
            out[2]["compute" if prof.unified else "host_update"] += host
        for use, (read, write) in zip(out, disk):
            if read or write:
                use["nvme"] = prof.ranks * (read / _rate(prof.disk_read_gbps) + write / _rate(prof.disk_write_gbps))
        return out

    @property
    def last_sub_share(self) -> float:
        """The share of a rank's elements in the update's last sub-group: the forward of those groups
        cannot start before the update ends."""
        per_rank = max(1.0, self.num_params / self.world_size)
        return min(1.0, int(self.cfg.partition.sub_group_size) / per_rank)

    def schedule(self, placement: Placement) -> str:
        """Which phases share a window ([Note: update modes] in infinity/optim/scheduler.py)."""
        cfg = self.cfg
        if cfg.dpu.enabled:
            return "update beside the whole step"
        if cfg.optimizer.update_in_backward:
            return "update beside backward"
        streamed = placement.share(optimizer="nvme") > 0 or placement.share(params="nvme") > 0
        host_on_gpu = placement.share(optimizer="host") > 0 and not self.profile.unified
        if cfg.dpu.overlap and (streamed or host_on_gpu):
            return "update beside forward"
        return "sequential"

    def predict(self, placement: Placement) -> StepPrediction:
        """The predicted step of ``placement`` (see [Note: step-time model])."""
        fwd, bwd, upd, lane = self.usage(placement)
        window = lambda *uses: max(sum(u[r] for u in uses) for r in RESOURCES)   # noqa: E731
        schedule = self.schedule(placement)
        share = self.last_sub_share
        chased = window(upd) + window(fwd) * share    # the last sub-group's groups wait for it
        # Stepped as backward completes sub-groups: from the first one's gradients to after the last one's.
        chasing = max(window(bwd) * share + window(upd), window(bwd) + window(upd) * share)
        step = {"sequential": lambda: window(fwd) + window(bwd) + window(upd),
                "update beside forward": lambda: max(window(fwd, upd), chased) + window(bwd),
                "update beside backward": lambda: window(fwd) + max(window(bwd, upd), chasing),
                "update beside the whole step": lambda: window(fwd, bwd, upd)}[schedule]()
        # A split store's device share is stepped inside opt.step(), before the rest is handed on.
        step += window(lane)
        terms = {r: fwd[r] + bwd[r] + upd[r] + lane[r] for r in RESOURCES}
        need, budget = self.need(placement), self.budget()
        phases = {"forward": window(fwd), "backward": window(bwd), "update": window(upd)}
        if any(lane.values()):
            phases["device_update"] = window(lane)
        return StepPrediction(
            placement=placement, phases=phases,
            schedule=schedule, step_s=step, bound_terms=terms, governing=max(terms, key=terms.get),
            need=need, budget=budget, fits=all(need[t] <= budget[t] for t in TIERS), machine=self.profile)


def _rate(gbps: float) -> float:
    """Bytes per second of a disk rate; no disk at all makes any byte on it take forever."""
    return gbps * 1e9 if gbps > 0 else 1e-30


def allowed(cfg: "Config", params: str, optimizer: str) -> bool:
    """Whether the engine runs this (params, optimizer) pair under ``cfg``'s other settings."""
    if int(cfg.partition.stage) < 3 and params != "device":
        return False
    if optimizer == "device" and cfg.optimizer.state_dtype != "fp32":
        return False
    return True


def uniform_allowed(cfg: "Config", optimizer: str) -> bool:
    """Whether the engine keeps all the optimizer states in ``optimizer`` under ``cfg``: not on the device with the
    update during backward, which runs the host optimizer (a device share it leaves to ``opt.step()``)."""
    return not (optimizer == "device" and cfg.optimizer.update_in_backward)


def splits_allowed(cfg: "Config") -> bool:
    """Whether the engine splits the optimizer states over tiers under ``cfg``'s other settings ([Note: optimizer
    states over tiers] in infinity/optim/tier_split.py): not with the delayed update, which takes one tier."""
    return not cfg.dpu.enabled


def with_tiers(cfg: "Config", params: str, optimizer: str, device_share: float = 0.0,
               host_share: float = 0.0) -> "Config":
    """``cfg`` with these tiers and optimizer shares (a placeholder NVMe path when it names none: the plan only
    counts bytes)."""
    tiers = cfg.tiers
    paths = tiers.nvme_path
    if "nvme" in (params, optimizer) and not paths:
        paths = (PLACEHOLDER_NVME,)
    wanted = (params, optimizer, device_share, host_share, paths)
    if (tiers.params, tiers.optimizer, tiers.optimizer_device_share, tiers.optimizer_host_share,
            tiers.nvme_path) == wanted:
        return cfg
    changes = {"tiers": dataclasses.replace(tiers, params=params, optimizer=optimizer,
                                            optimizer_device_share=device_share, optimizer_host_share=host_share,
                                            nvme_path=paths)}
    if optimizer == "device" and cfg.optimizer.update_in_backward:
        # The device cells of a split, counted alone: the update during backward leaves a device share to
        # opt.step(), so their plan is the ordinary step's (all of the states there is refused: uniform_allowed).
        changes["optimizer"] = dataclasses.replace(cfg.optimizer, update_in_backward=False)
    return dataclasses.replace(cfg, **changes)


__all__ = ["PAIRS", "Placement", "StepModel", "StepPrediction", "allowed", "splits_allowed", "uniform_allowed",
           "with_tiers"]
