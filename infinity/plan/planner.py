"""The per-rank plan of a model under a config: bytes per tier, NVMe traffic, a step-time bound.

Sizes come from ``infinity.plan.layout`` ([Note: where each byte lives], [Note: padding],
[Note: NVMe traffic per step]); this module turns them into a :class:`Plan`, checks it against
the machine (``tiers.budget``) and bounds the step time.

[Note: step-time lower bound]
All ranks on one machine are assumed to share the NVMe paths the bench measured, and a disk's
bandwidth is shared between reads and writes (mixed traffic runs no faster than either pure
rate), so the bound is local_ranks x (read_bytes / read rate + write_bytes / write rate).
Compute, PCIe copies and collectives can only add to it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infinity.plan.activations import activation_rows
from infinity.plan.bandwidth import Bandwidth
from infinity.plan.census import ModelCensus, take_census
from infinity.plan.errors import PlanError
from infinity.plan.layout import Layout
from infinity.plan.rows import PlanRow
from infinity.plan.units import parse_positive_int

if TYPE_CHECKING:
    from infinity.config import Config
    from infinity.plan.machine import MachineProfile, Workload
    from infinity.plan.placement import AutoDecision
    from infinity.plan.step_model import StepPrediction
    from tiers.budget import Need

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Short names for budget messages, which join every need of one resource in a sentence.
# The rows that hold model states (the rest are buffers and transient memory).
STATE_ROWS = ("compute_copy", "master", "adam_moments", "grad_accumulator", "dpu_grad_accumulator",
              "dpu_compute_copy")
NEED_LABELS = {
    "compute_copy": "params (compute copy)",
    "master": "fp32 master",
    "adam_moments": "Adam m, v",
    "grad_accumulator": "fp32 gradients",
    "pool_buffers": "NVMe I/O pool",
    "optimizer_subgroup_buffers": "optimizer sub-group buffers",
    "nvme_staging": "NVMe staging",
    "prefetch_arena": "NVMe read-ahead arena",
    "working_set": "largest gathered group",
    "working_set_grad": "gradient buckets",
    "gather_buffer": "gather buffer",
    "grad_staging": "gradient downloads",
    "widened_linear": "fp32 linear-layer buffers",
    "compute_copy_staging": "compute-copy staging",
    "device_prefetch": "device prefetch",
    "persistent_params": "persistent params",
    "activations": "checkpointed activations",
    "activation_staging": "activation staging",
    "activation_prefetch": "activation prefetch",
}
TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class FitCheck:
    """The outcome of checking a plan's needs against this machine (``tiers.budget``)."""

    fits: bool
    """Whether every tier has room for what the ranks of one machine need."""

    shortfalls: tuple[str, ...]
    """One line per tier short of room, with the bytes needed and free."""

    rows: tuple[dict, ...]
    """Needed and free bytes per tier and path (``tiers.budget.BudgetReport.rows``)."""

    local_ranks: int
    """Ranks sharing this machine, whose needs were added up."""


@dataclass(frozen=True)
class PlanSettings:
    """The setting a plan was made for: ranks, precision, tiers, compute device.

    Attributes
    ----------
    world_size : int
        Data-parallel ranks.
    local_ranks : int
        Ranks sharing one machine (its RAM and NVMe paths); divides ``world_size``.
    dtype : str
        ``precision.dtype`` (the compute copy's dtype).
    param_bytes : int
        Bytes per element of ``dtype``.
    params_tier, optimizer_tier : str
        ``tiers.params`` and ``tiers.optimizer``.
    optimizer_device_share, optimizer_host_share : float
        ``tiers.optimizer_device_share`` and ``tiers.optimizer_host_share`` (the optimizer states split
        over tiers: [Note: optimizer states over tiers] in infinity/optim/tier_split.py).
    compute_device : str
        ``cpu`` or ``cuda`` (``tiers.device`` with ``auto`` resolved on this machine).
    nvme_paths : tuple of str
        ``tiers.nvme_path``.
    host_budget : int
        ``tiers.host_budget`` (0: RAM available).
    stage : int
        ``partition.stage`` (the ZeRO stage).
    nvme_direct : bool
        ``aio.direct``: the NVMe paths must accept O_DIRECT.
    """

    world_size: int
    local_ranks: int
    dtype: str
    param_bytes: int
    params_tier: str
    optimizer_tier: str
    compute_device: str
    nvme_paths: tuple[str, ...]
    host_budget: int
    stage: int = 3
    nvme_direct: bool = True
    optimizer_device_share: float = 0.0
    optimizer_host_share: float = 0.0


@dataclass(frozen=True)
class ShardSizes:
    """Element counts of one rank's shards (see [Note: padding] in ``infinity.plan.layout``).

    Attributes
    ----------
    shard_numel : int
        Elements per rank over all groups, padding included.
    trainable_shard_numel : int
        Of which in trainable groups (what fp32 master, Adam m, v and gradients cover).
    padding_numel : int
        Padding elements over all ranks and groups.
    largest_group : str or None
        Name of the largest group (None when only a parameter count was given).
    largest_group_numel : int or None
        Its padded, gathered element count.
    """

    shard_numel: int
    trainable_shard_numel: int
    padding_numel: int
    largest_group: str | None
    largest_group_numel: int | None


@dataclass(frozen=True)
class Plan:
    """What every rank must hold, where, and what one step moves to and from NVMe.

    Build one with :func:`plan`. Byte counts are per rank (every rank holds the same bytes);
    ``needs`` multiplies host and NVMe bytes by the ranks sharing this machine.

    Attributes
    ----------
    source : str
        The model (callable spec, class name or parameter count).
    num_params : int
        Parameter elements, unpadded.
    settings : PlanSettings
    shards : ShardSizes
    rows : tuple of PlanRow
        Every purpose bytes are held for, per rank.
    nvme_read_bytes, nvme_write_bytes : int
        NVMe traffic of one step, per rank; reads with the next forward keeping pace with the
        overlapped update (see [Note: NVMe traffic per step] in infinity/plan/layout.py).
    nvme_read_bytes_max : int
        Reads when the update ends before the next forward starts (fewer fresh shards).
    host_to_device_bytes, device_to_host_bytes : int
        Traffic between host memory and the compute device in one step, per rank
        (see [Note: PCIe traffic per step] in infinity/plan/layout.py).
    all_gather_bytes, reduce_scatter_bytes : int
        What one rank sends through the step's all-gathers and reduce-scatters (see [Note:
        communication volume] in infinity/runtime/ranks.py; ``infinity.stats(model)["comm"]``).
    bandwidth : Bandwidth or None
        For the step-time bound.
    fit : FitCheck or None
        The check against this machine, when made.
    prediction : StepPrediction or None
        The predicted step per phase and its governing term, when a machine profile was given or
        probed ([Note: step-time model] in infinity/plan/step_model.py).
    auto : AutoDecision or None
        What "auto" tiers resolved to, and the pairs it weighed ([Note: auto placement]).
    """

    source: str
    num_params: int
    settings: PlanSettings
    shards: ShardSizes
    rows: tuple[PlanRow, ...]
    nvme_read_bytes: int
    nvme_write_bytes: int
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    nvme_read_bytes_max: int = 0
    bandwidth: Bandwidth | None = None
    fit: FitCheck | None = field(default=None, compare=False)
    prediction: "StepPrediction | None" = field(default=None, compare=False)
    auto: "AutoDecision | None" = field(default=None, compare=False)

    def tier_bytes(self, tier: str) -> int:
        """Bytes one rank needs in ``tier`` (``device``, ``host`` or ``nvme``)."""
        if tier not in TIERS:
            raise PlanError(f"tier must be one of {list(TIERS)}, got {tier!r}")
        return sum(row.nbytes for row in self.rows if row.tier == tier)

    def per_parameter(self) -> dict[str, float]:
        """Bytes per parameter element of one rank's shards (padding included, as the engine's
        ``infinity.stats(model)["transfers"]["per_parameter"]`` counts them): ``stored`` (the model
        states in every tier: compute copy, master, moments, gradients), ``stored_nvme`` (of which on
        NVMe), and ``nvme_read`` / ``nvme_written`` in one step."""
        numel = max(1, self.shards.shard_numel)
        states = [row for row in self.rows if row.key in STATE_ROWS]
        return {"stored": sum(r.nbytes for r in states) / numel,
                "stored_nvme": sum(r.nbytes for r in states if r.tier == "nvme") / numel,
                "nvme_read": self.nvme_read_bytes / numel,
                "nvme_written": self.nvme_write_bytes / numel}

    def row(self, key: str) -> PlanRow | None:
        """The row with this key, or None when the config makes it unnecessary."""
        return next((row for row in self.rows if row.key == key), None)

    @property
    def step_time_lower_bound_s(self) -> float | None:
        """Seconds per step the NVMe traffic alone takes (see [Note: step-time lower bound]).

        None when no bandwidth was given; 0.0 when nothing is on NVMe.
        """
        if self.nvme_read_bytes == 0 and self.nvme_write_bytes == 0:
            return 0.0
        if self.bandwidth is None:
            return None
        return self.settings.local_ranks * self.bandwidth.seconds(
            self.nvme_read_bytes, self.nvme_write_bytes
        )

    def needs(self, local_ranks: int | None = None) -> list["Need"]:
        """The plan as ``tiers.budget.Need`` rows for ``check_budget``, for one machine.

        Host and NVMe bytes are multiplied by ``local_ranks`` (default: the plan's), since
        those ranks share this machine's memory and disks; device bytes are per GPU, except
        with the CPU as compute device, where every rank's "device" bytes are this machine's
        RAM too (``check_budget`` then checks host + device together). NVMe bytes are spread
        evenly over ``tiers.nvme_path``.

        Examples
        --------
        >>> from tiers.budget import check_budget  # doctest: +SKIP
        >>> check_budget(plan(model, cfg).needs(), host_budget=cfg.tiers.host_budget)  # doctest: +SKIP
        """
        from tiers.budget import Need

        st = self.settings
        ranks = st.local_ranks if local_ranks is None else parse_positive_int(
            local_ranks, "local_ranks"
        )
        out: list[Need] = []
        for row in self.rows:
            if row.nbytes == 0:
                continue
            tier, what = row.tier, NEED_LABELS.get(row.key, row.what)
            per_gpu = tier == "device" and st.compute_device != "cpu"
            copies = 1 if per_gpu else ranks
            if copies > 1:
                what = f"{what} (x{copies} ranks)"
            total = row.nbytes * copies
            if tier != "nvme":
                out.append(Need(what=what, tier=tier, nbytes=total))
                continue
            share, extra = divmod(total, len(st.nvme_paths))
            for i, path in enumerate(st.nvme_paths):
                out.append(
                    Need(what=what, tier="nvme", nbytes=share + (i < extra), path=path)
                )
        return out

    def check_fit(self, local_ranks: int | None = None) -> FitCheck:
        """Check :meth:`needs` against this machine with ``tiers.budget.check_budget``.

        An NVMe path that cannot be inspected (missing directory) counts as a shortfall
        naming the path and the error, not as an exception.
        """
        from tiers.budget import check_budget

        from infinity.config.paths import problem

        st = self.settings
        ranks = st.local_ranks if local_ranks is None else local_ranks
        if "nvme" in (st.params_tier, st.optimizer_tier):
            # The budget measures free space from the nearest existing parent, which would call a
            # missing or unusable nvme_path a fit ([Note: checking nvme_path] in infinity/config/paths.py).
            wrong = [f"tiers.nvme_path: {why}" for path in st.nvme_paths if (why := problem(path, st.nvme_direct))]
            if wrong:
                return FitCheck(fits=False, shortfalls=tuple(wrong), rows=(), local_ranks=ranks)
        try:
            report = check_budget(
                self.needs(ranks),
                host_budget=st.host_budget,
                device=torch.device(st.compute_device),
            )
        except OSError as exc:
            return FitCheck(
                fits=False,
                shortfalls=(f"cannot inspect {exc.filename or 'an NVMe path'}: "
                            f"{exc.strerror or exc}",),
                rows=(),
                local_ranks=ranks,
            )
        return FitCheck(
            fits=bool(report.fits),
            shortfalls=tuple(report.shortfalls()),
            rows=tuple(dict(row) for row in report.rows),
            local_ranks=ranks,
        )

    def to_dict(self) -> dict[str, object]:
        """Plain, JSON-able form (bytes as ints; what ``infinity-plan model --json`` writes)."""
        return {
            "source": self.source,
            "num_params": self.num_params,
            **dataclasses.asdict(self.settings),
            "nvme_paths": list(self.settings.nvme_paths),
            **dataclasses.asdict(self.shards),
            "per_rank": [
                {"key": r.key, "what": r.what, "tier": r.tier, "nbytes": r.nbytes}
                for r in self.rows
            ],
            "tier_bytes": {tier: self.tier_bytes(tier) for tier in TIERS},
            "per_parameter": self.per_parameter(),
            "nvme_read_bytes_per_step": self.nvme_read_bytes,
            "nvme_read_bytes_per_step_max": self.nvme_read_bytes_max,
            "nvme_write_bytes_per_step": self.nvme_write_bytes,
            "host_to_device_bytes_per_step": self.host_to_device_bytes,
            "device_to_host_bytes_per_step": self.device_to_host_bytes,
            "all_gather_bytes_per_step": self.all_gather_bytes,
            "reduce_scatter_bytes_per_step": self.reduce_scatter_bytes,
            "bandwidth": None if self.bandwidth is None else self.bandwidth.to_dict(),
            "step_time_lower_bound_s": self.step_time_lower_bound_s,
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "auto": None if self.auto is None else {
                "chosen": self.auto.tiers(), "summary": self.auto.summary(),
                "split": None if self.auto.split is None else self.auto.split.to_dict(),
                "candidates": [c.to_dict() for c in self.auto.candidates]},
            "fit": None
            if self.fit is None
            else {
                "fits": self.fit.fits,
                "shortfalls": list(self.fit.shortfalls),
                "local_ranks": self.fit.local_ranks,
                "rows": [dict(row) for row in self.fit.rows],
            },
        }

    def table(self) -> str:
        """The plan as text: one table for the rank type (every rank holds the same bytes)."""
        from infinity.plan.render import render_plan

        return render_plan(self)


def plan(
    model_or_num_params: "torch.nn.Module | str | int | float | ModelCensus",
    config: "Config | str | Path | dict",
    *,
    world_size: int = 1,
    nvme_bandwidth: Bandwidth | tuple[float, float] | str | Path | None = None,
    local_ranks: int | None = None,
    check_fit: bool = True,
    machine: "MachineProfile | str | Path | None" = None,
    workload: "Workload | None" = None,
) -> Plan:
    """Plan where each rank's bytes live for a model under a config.

    Parameters
    ----------
    model_or_num_params : nn.Module, str, int or ModelCensus
        A module (meta-device models work), a ``"package.module:callable"`` built on the meta
        device, a parameter count (``1.3e9``, ``"1.3B"``) or a census the engine has taken.
    config : Config, path, preset name or dict
        Anything ``infinity.load_config`` accepts (a preset is named without ``.toml``).
    world_size : int
        Data-parallel ranks (a positive integer; groups are padded, so nothing must divide it).
    nvme_bandwidth : Bandwidth, (read_gbps, write_gbps), bench JSON path, or None
        For the step-time lower bound.
    local_ranks : int, optional
        Ranks sharing this machine (default: ``world_size``, all on this machine). Must divide
        ``world_size``: every machine runs the same number of ranks.
    check_fit : bool
        Check the needs against this machine now (``Plan.fit``).
    machine : MachineProfile, profile file, or None
        The machine the step is predicted on (``Plan.prediction``). With "auto" tiers and None, this
        machine is probed once and its rates cached ([Note: machine probes] in infinity/plan/probes.py).
    workload : Workload, optional
        Tokens per rank and step, activation bytes, recompute (``infinity.plan.machine.Workload``).

    Returns
    -------
    Plan

    Raises
    ------
    PlanError
        On bad sizes, world sizes, model specs or configs, naming the culprit.

    Examples
    --------
    >>> p = plan(1_300_000_000, {"precision": {"dtype": "bfloat16"}})  # doctest: +SKIP
    >>> p.row("master").nbytes  # doctest: +SKIP
    5200001024
    """
    cfg = resolve_config(config)
    ranks = parse_positive_int(world_size, "world_size")
    local = ranks if local_ranks is None else parse_positive_int(local_ranks, "local_ranks")
    if local > ranks or ranks % local:
        raise PlanError(
            f"local_ranks ({local}) must divide world_size ({ranks}): every machine runs the "
            f"same number of ranks"
        )
    dtype = str(cfg.precision.dtype)
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"precision.dtype must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    param_bytes = DTYPE_BYTES[dtype]
    census = take_census(model_or_num_params, cfg, param_bytes)
    from infinity.plan.placement import predict_configured, resolve_auto

    cfg, decision = resolve_auto(cfg, census, world_size=ranks, local_ranks=local, machine=machine,
                                 workload=workload)
    bandwidth = resolve_bandwidth(nvme_bandwidth)
    layout = Layout(census, cfg, ranks, param_bytes)
    settings = PlanSettings(
        world_size=ranks,
        local_ranks=local,
        dtype=dtype,
        param_bytes=param_bytes,
        params_tier=cfg.tiers.params,
        optimizer_tier=cfg.tiers.optimizer,
        compute_device=cfg.tiers.compute_device(),
        nvme_paths=tuple(str(p) for p in cfg.tiers.nvme_path),
        host_budget=int(cfg.tiers.host_budget),
        stage=int(cfg.partition.stage),
        nvme_direct=bool(cfg.aio.direct),
        optimizer_device_share=float(cfg.tiers.optimizer_device_share),
        optimizer_host_share=float(cfg.tiers.optimizer_host_share),
    )
    shards = ShardSizes(
        shard_numel=layout.shard_numel,
        trainable_shard_numel=layout.trainable_numel,
        padding_numel=layout.shard_numel * ranks - census.num_params,
        largest_group=layout.largest_name,
        largest_group_numel=layout.largest_numel,
    )
    result = Plan(
        source=census.source,
        num_params=census.num_params,
        settings=settings,
        shards=shards,
        rows=(*layout.rows(), *activation_rows(cfg)),
        nvme_read_bytes=layout.nvme_read_bytes(),
        nvme_write_bytes=layout.nvme_write_bytes(),
        host_to_device_bytes=layout.host_to_device_bytes(),
        device_to_host_bytes=layout.device_to_host_bytes(),
        all_gather_bytes=layout.all_gather_bytes(),
        reduce_scatter_bytes=layout.reduce_scatter_bytes(),
        nvme_read_bytes_max=layout.nvme_read_bytes(paced=False),
        bandwidth=bandwidth,
        auto=decision,
        prediction=decision.chosen if decision is not None else
        None if machine is None else predict_configured(cfg, census, ranks, local, machine, workload),
    )
    disk = result.prediction.machine if result.prediction is not None else None
    if bandwidth is None and disk is not None and disk.disk_read_gbps > 0 and disk.disk_write_gbps > 0:
        # One source of disk rates for the NVMe bound and the prediction.
        result = dataclasses.replace(result, bandwidth=Bandwidth(disk.disk_read_gbps, disk.disk_write_gbps,
                                                                 source=f"machine profile {disk.name}"))
    if not check_fit:
        return result
    return dataclasses.replace(result, fit=result.check_fit())


def resolve_config(config: object) -> "Config":
    """Load ``config`` (a Config, file, preset name or dict), turning failures into PlanError."""
    from infinity.config import Config, ConfigError, load_config

    if isinstance(config, Config):
        return config
    try:
        return load_config(config)
    except (ConfigError, OSError, ValueError, TypeError) as exc:
        raise PlanError(f"config {config!s} does not load: {exc}") from exc


def resolve_bandwidth(value: object) -> Bandwidth | None:
    """A Bandwidth from a Bandwidth, a (read, write) GB/s pair or a bench JSON path."""
    if value is None or isinstance(value, Bandwidth):
        return value
    if isinstance(value, (str, Path)):
        return Bandwidth.from_bench_json(value)
    if isinstance(value, tuple) and len(value) == 2:
        return Bandwidth(read_gbps=value[0], write_gbps=value[1], source="given")
    raise PlanError(
        f"nvme_bandwidth must be a Bandwidth, a (read_gbps, write_gbps) pair or a bench JSON "
        f"path, got {value!r}"
    )


