"""A Plan as text: what ``infinity-plan model`` prints and ``Plan.table()`` returns.

It reads a ``infinity.plan.planner.Plan`` (its rows, sizes, traffic, bound and fit) and
imports nothing of the planner, which imports this module to render.
"""
from __future__ import annotations

from infinity.plan.layout import SHARD_ALIGN_NUMEL
from infinity.plan.units import format_count, format_gib

_TIER_ORDER = {"device": 0, "host": 1, "nvme": 2}


def render_plan(plan) -> str:
    """The plan's header, its per-rank table (GiB), NVMe traffic, step-time bound and fit."""
    st, sh = plan.settings, plan.shards
    ranks = st.world_size
    rank_span = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"
    where = f"{st.local_ranks} on this machine"
    paths = f" ({', '.join(st.nvme_paths)})" if st.nvme_paths else ""
    lines = [
        f"Plan for {plan.source}: {format_count(plan.num_params)} parameters, "
        f"world size {ranks} ({where})",
        f"precision {st.dtype} ({st.param_bytes} bytes/element); params in "
        f"{st.params_tier}, optimizer {_optimizer_tiers(st)}{paths}; compute device "
        f"{st.compute_device}",
        f"Every rank holds the same bytes: each group's shard is padded to a multiple of "
        f"{SHARD_ALIGN_NUMEL} elements ({sh.shard_numel:,} elements per rank, "
        f"{sh.padding_numel:,} padding in all).",
        "",
        f"Per rank ({rank_span}), GiB = 2^30 bytes",
        f"{'tier':<7}{'GiB/rank':>10}  what",
    ]
    rows = sorted(plan.rows, key=lambda row: _TIER_ORDER[row.tier])
    for row in rows:
        lines.append(f"{row.tier:<7}{format_gib(row.nbytes):>10}  {row.what}")
    totals = ", ".join(
        f"{tier} {format_gib(plan.tier_bytes(tier))}" for tier in ("device", "host", "nvme")
    )
    lines.append(f"total per rank, GiB: {totals}")
    if sh.largest_group is None:
        lines.append(
            "largest working set: unknown (only a parameter count was given; pass a model "
            "to size it)"
        )
    lines.append("")
    lines.append(
        f"NVMe traffic per step, per rank: read {format_gib(plan.nvme_read_bytes)} GiB, "
        f"write {format_gib(plan.nvme_write_bytes)} GiB"
    )
    if plan.nvme_read_bytes_max > plan.nvme_read_bytes:
        lines.append(
            f"  (reads with the forward keeping pace with the overlapped update; up to "
            f"{format_gib(plan.nvme_read_bytes_max)} GiB when the update ends first: fewer fresh shards)"
        )
    per = plan.per_parameter()
    lines.append(
        f"Bytes per parameter: stored {per['stored']:.2f} ({per['stored_nvme']:.2f} on NVMe); NVMe per step "
        f"read {per['nvme_read']:.2f} + written {per['nvme_written']:.2f} = "
        f"{per['nvme_read'] + per['nvme_written']:.2f}"
    )
    lines.append(
        f"Host<->device traffic per step, per rank: to the device {format_gib(plan.host_to_device_bytes)} GiB, "
        f"to the host {format_gib(plan.device_to_host_bytes)} GiB"
    )
    if ranks > 1:
        lines.append(
            f"Collectives per step, per rank (ZeRO stage {st.stage}; bytes sent): all-gather "
            f"{format_gib(plan.all_gather_bytes)} GiB, reduce-scatter {format_gib(plan.reduce_scatter_bytes)} GiB"
        )
    lines.append(_step_time_line(plan))
    lines.extend(prediction_lines(plan.prediction, plan.auto))
    if plan.fit is not None:
        lines.append(_fit_line(plan))
    return "\n".join(lines)


def _optimizer_tiers(st) -> str:
    """``tiers.optimizer``, with the shares kept in faster tiers when the states are split over tiers."""
    shares = [f"{share:.1%} on the device" for share in (st.optimizer_device_share,) if share]
    shares += [f"{share:.1%} in host memory" for share in (st.optimizer_host_share,) if share]
    return f"{', '.join(shares)}, the rest in {st.optimizer_tier}" if shares else f"in {st.optimizer_tier}"


def _step_time_line(plan) -> str:
    bound = plan.step_time_lower_bound_s
    if bound == 0.0:
        return "Step time lower bound from NVMe: none (nothing lives on NVMe)"
    if bound is None or plan.bandwidth is None:
        return (
            "Step time lower bound from NVMe: needs a bandwidth (--bench-json, or "
            "--read-gbps and --write-gbps)"
        )
    bw = plan.bandwidth
    local = plan.settings.local_ranks
    sharing = f"{local} ranks sharing " if local > 1 else ""
    return (
        f"Step time lower bound from NVMe: {bound:.3f} s ({sharing}read {bw.read_gbps:.2f} "
        f"GB/s, write {bw.write_gbps:.2f} GB/s, GB = 1e9 bytes; from {bw.source})"
    )


_TERM_NAMES = {"compute": "compute", "host_to_device": "host->device copies", "device_to_host": "device->host copies",
               "host_update": "host update", "nvme": "NVMe", "interconnect": "collectives"}


def prediction_lines(prediction, auto=None) -> list[str]:
    """The predicted step per phase and the bound's governing term ([Note: step-time model] in
    infinity/plan/step_model.py), and what "auto" weighed ([Note: auto placement] in infinity/plan/placement.py)."""
    if prediction is None:
        return []
    p = prediction
    lines = ["", f"Placement: {p.placement.describe()}" + (" (tiers \"auto\")" if auto is not None else "")]
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.3f} s" for name, seconds in p.phases.items())
    lines.append(f"Predicted step: {p.step_s:.3f} s ({p.schedule}; phases alone: {phases})")
    terms = ", ".join(f"{_TERM_NAMES[k]} {v:.3f} s" for k, v in p.bound_terms.items())
    lines.append(f"Bound: {p.bound_s:.3f} s, governed by {_TERM_NAMES[p.governing]} ({terms})")
    if auto is None:
        return lines
    lines.append(f"{'params':<8}{'optimizer':<11}{'fits':<6}{'step s':>10}  governed by")
    for c in auto.candidates:
        params, optimizer = c.placement.pair
        # a tier with no measured rate (a disk without infinity-bench figures) takes "forever"
        step = f"{c.step_s:>10.3f}" if c.step_s < 1e9 else f"{'no rate':>10}"
        lines.append(f"{params:<8}{optimizer:<11}{'yes' if c.fits else 'no':<6}{step}  {_TERM_NAMES[c.governing]}")
    if p.placement.pair is None:
        lines.append("The optimizer states are split over tiers ([Note: optimizer states over tiers]): the "
                     "device share is stepped inside opt.step(), the rest as the uniform optimizer of its tier.")
    split = auto.split
    if split is not None:
        lines.append(f"With the compute copies split too, {split.placement.describe()} would predict "
                     f"{split.step_s:.3f} s (the engine holds every compute copy in one tier, so it runs the "
                     "placement above)")
    if auto.reserve_assumed:
        lines.append(f"{auto.activation_reserve / 2**30:.1f} GiB of device memory kept for activations, which are "
                     "not known before a step: --activation-bytes (activations.checkpoint_nbytes) says how much a "
                     "step holds")
    return lines


def _fit_line(plan) -> str:
    fit = plan.fit
    if fit is None:
        return ""
    machine = f"this machine ({fit.local_ranks} rank{'s' if fit.local_ranks > 1 else ''})"
    if fit.fits:
        return f"Fits {machine}: yes"
    return f"Fits {machine}: NO:\n" + "\n".join(f"  - {line}" for line in fit.shortfalls)


__all__ = ["prediction_lines", "render_plan"]
