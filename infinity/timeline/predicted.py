"""What ``infinity.plan`` predicts for the traced step, as phases on the trace's "plan" track.

What the room holds: ``predicted_phases``, the one place the trace asks the planner for a step's
figures, so a fuller prediction replaces this function alone. What it may touch: the engine's config and
its groups' sizes (the census the engine's own budget check plans from); it moves nothing.

[Note: the plan beside the step]
The plan of the traced model (its groups as partitioned, the engine's config) says how many bytes one
step reads from and writes to NVMe and moves between host and device. With the disk's bandwidth (the
``nvme_bandwidth`` a trace is given: read and write GB/s, or an ``infinity-bench nvme --json`` file)
the reads and writes become phases (reads, then writes: the planner's step-time lower bound), laid from
the step's start on a track of their own; the measured NVMe tracks beside them show how far the step is
from that bound. Without a bandwidth the figures are marks with no duration, carrying the bytes.
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


def predicted_phases(engine, nvme_bandwidth=None) -> list[Phase]:
    """The plan's phases of one step of ``engine``'s model (see [Note: the plan beside the step]).

    ``nvme_bandwidth``: what ``infinity.plan.plan`` accepts (a ``Bandwidth``, a ``(read_gbps,
    write_gbps)`` pair, a bench JSON path) or None.
    """
    from infinity.plan import CensusGroup, ModelCensus, plan

    groups = engine.coordinator.groups
    census = ModelCensus("model", tuple(CensusGroup(g.name, tuple(s.numel for s in g.slots), g.has_trainable)
                                        for g in groups))
    p = plan(census, engine.config, world_size=engine.ranks.world_size, local_ranks=1, check_fit=False,
             nvme_bandwidth=nvme_bandwidth)
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
