"""What ``infinity.plan`` predicts for the traced step, as phases on the trace's "plan" track.

What the room holds: ``predicted_phases``, the one place the trace asks the planner for a step's
figures. What it may touch: the engine's config and its groups' sizes (the census the engine's own budget
check plans from) and the cached machine profile; it moves nothing and probes nothing.

[Note: the plan beside the step]
The plan of the traced model (its groups as partitioned, the engine's config) says how many bytes one
step reads from and writes to NVMe and moves between host and device. With the disk's bandwidth (the
``nvme_bandwidth`` a trace is given: read and write GB/s, or an ``infinity-bench nvme --json`` file; else
the machine profile's disk rates) the reads and writes become phases (reads, then writes: the planner's
step-time lower bound), laid from the step's start; without one they are marks with no duration,
carrying the bytes.

With a machine profile (the ``machine`` a trace is given, else this machine's cached profile,
[Note: machine probes] in infinity/plan/probes.py; a trace never probes: a probe takes seconds and
loads the machine the step runs on) the step-time model ([Note: step-time model] in
infinity/plan/step_model.py) adds the predicted forward, backward and update, each as long as its
busiest resource, and a mark at the predicted step with its schedule and governing resource. Forward
and backward are laid end to end from the step's start; the update follows the backward, except with
the update during backward (it starts with the backward, on a lane of its own). An update overlapped
with the next forward is still laid after the backward, since that is where this step's update runs;
the step mark, earlier than its end, says how much of it the next forward hides. The measured tracks
beside them show which phase is further from its prediction.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Phase:
    """One predicted phase: ``seconds`` from ``start_s`` after the step began (0 seconds: a figure only)."""

    name: str
    start_s: float
    seconds: float
    args: dict


def predicted_phases(engine, nvme_bandwidth=None, machine=None, workload=None) -> list[Phase]:
    """The plan's phases of one step of ``engine``'s model (see [Note: the plan beside the step]).

    ``nvme_bandwidth``: what ``infinity.plan.plan`` accepts (a ``Bandwidth``, a ``(read_gbps,
    write_gbps)`` pair, a bench JSON path) or None. ``machine``: a ``MachineProfile``, a profile file, or
    None for this machine's cached profile (none cached: the NVMe figures only). ``workload``: a
    ``Workload`` or the tokens of the step (None: ``Workload()``'s).
    """
    from infinity.plan import CensusGroup, ModelCensus, Workload, plan

    groups = engine.coordinator.groups
    census = ModelCensus("model", tuple(CensusGroup(g.name, tuple(s.numel for s in g.slots), g.has_trainable)
                                        for g in groups))
    cfg = engine.config
    profile = machine if machine is not None else _cached_profile(cfg)
    if isinstance(workload, int):
        workload = Workload(tokens=workload)
    p = plan(census, cfg, world_size=engine.ranks.world_size, local_ranks=1, check_fit=False,
             nvme_bandwidth=nvme_bandwidth, machine=profile, workload=workload if profile is not None else None)
    return _nvme_phases(p) + (_step_phases(p.prediction, workload or Workload()) if p.prediction else [])


def _cached_profile(cfg):
    """This machine's cached profile, or None; one rank's view, as the NVMe figures are (``local_ranks=1``)."""
    from infinity.plan.probes import cached_profile

    return cached_profile(cfg.tiers.compute_device(), cfg.precision.dtype,
                          nvme_paths=tuple(str(p) for p in cfg.tiers.nvme_path),
                          host_budget=int(cfg.tiers.host_budget))


def _nvme_phases(p) -> list[Phase]:
    read, written = p.nvme_read_bytes, p.nvme_write_bytes
    moved = {"host_to_device_bytes": p.host_to_device_bytes, "device_to_host_bytes": p.device_to_host_bytes}
    bw = p.bandwidth
    if bw is None:
        return [Phase(f"plan: NVMe read {read} B, write {written} B (no bandwidth given)", 0.0, 0.0,
                      {"nvme_read_bytes": read, "nvme_write_bytes": written, **moved})]
    read_s, write_s = bw.seconds(read, 0), bw.seconds(0, written)
    source = {"bandwidth": bw.to_dict()}
    return [
        Phase(f"plan: NVMe read {read} B at {bw.read_gbps:.3g} GB/s", 0.0, read_s,
              {"nvme_read_bytes": read, **source}),
        Phase(f"plan: NVMe write {written} B at {bw.write_gbps:.3g} GB/s", read_s, write_s,
              {"nvme_write_bytes": written, **source}),
        Phase(f"plan: step >= {p.step_time_lower_bound_s:.6f} s (NVMe bound)", read_s + write_s, 0.0,
              {"step_time_lower_bound_s": p.step_time_lower_bound_s, **moved}),
    ]


def _step_phases(prediction, workload) -> list[Phase]:
    """Forward, backward and update of the step-time model, and the predicted step as a mark."""
    fwd, bwd, upd = (prediction.phases[k] for k in ("forward", "backward", "update"))
    source = {"machine": prediction.machine.name, "machine_source": prediction.machine.source,
              "tokens": workload.tokens, "schedule": prediction.schedule}
    update_start = fwd if prediction.schedule == "update beside backward" else fwd + bwd
    return [
        Phase(f"plan: forward {fwd:.6f} s", 0.0, fwd, source),
        Phase(f"plan: backward {bwd:.6f} s", fwd, bwd, source),
        Phase(f"plan: update {upd:.6f} s", update_start, upd, source),
        Phase(f"plan: step {prediction.step_s:.6f} s ({prediction.schedule}; {prediction.governing} governs)",
              prediction.step_s, 0.0, {**source, **prediction.to_dict()}),
    ]
