"""``auto`` placement: where each sub-group's states cost the step least, and the placement the engine runs.

[Note: auto placement]
Two searches over the step-time model ([Note: step-time model] in infinity/plan/step_model.py):

* ``best_runnable``: what the engine runs. All compute copies in one tier (``tiers.params``) and the
  optimizer states over ``slices`` slices, fastest tier first: ``b`` slices on the device, ``d`` in host
  memory, the rest on NVMe ([Note: optimizer states over tiers] in infinity/optim/tier_split.py: the
  first groups' states on the device, stepped inside ``opt.step()``; the next ones' in host memory and
  the rest's on NVMe, stepped as the uniform host or NVMe optimizer is, beside the next forward where
  the engine overlaps it). Every params tier and every ``(b, d)`` is tried, uniform pairs among them
  (``b`` or ``d`` or the rest the whole); the device need not be filled with states, since a host
  update beside the forward can cost the step less than the same update on the device, which holds
  up compute. A split is predicted and checked for room as its config's plan, cut at group
  boundaries as the engine cuts, so the fit that construction checks is the one the search saw.
  ``tiers = "auto"`` resolves to the fastest that fits: ``tiers.params``, ``tiers.optimizer`` (the
  slowest tier holding states) and the shares ``b / slices`` and ``d / slices``.
* ``best_split``: per slice of sub-groups ([Note: placements]), the compute copies split too, which
  the engine cannot run yet. Device memory left after activations goes to compute copies of ``a``
  slices and optimizer states of ``b`` slices, host memory to copies of ``c`` and states of ``d``
  more, the rest to NVMe; the fastest tiers hold the same slices. Every ``a``, and every ``b`` up to
  what fits beside it, is tried; for each ``c`` the host takes as many state slices as fit. Tests
  enumerate every ``(a, b, c, d)`` and check that none that fits predicts a faster step. (Not every
  placement over the nine pairs: with the states split, the device share's update is its own phase
  (the engine's), and which copies its slices sit beside can matter; this search keeps the shape.) ``infinity-plan`` reports it only when it beats the runnable
  choice (by ``SPLIT_GAIN``): the gap is what splitting the compute copies in the engine would gain.

[Note: activations before the first step]
``auto`` is resolved in ``infinity.Init``, before any step: the activations' peak on the device is
not known yet (it depends on the batch, the sequence and the checkpointing the training loop chooses).
Counted as nothing, the placement fills a GPU with states and the first forward runs out of memory
(GPT 6.7B on an 80 GB H100 at 2 x 1024 tokens: states and buffers chosen at 82 GB, activations 9-12 GB
more). So where ``activations.checkpoint_nbytes`` is not given and activations stay on the device,
``ACTIVATION_SHARE`` (a quarter) of the GPU's free memory is kept for them, and the decision says so
(free memory: another process's share is not ours; on several ranks rank 0 decides for the GPU with the
least free, ``least_free_device_bytes``);
``activations.checkpoint_nbytes`` replaces it: an estimate, or measured in the first step, after which
the ``infinity`` logger compares the device memory the first training step held above what it kept
(its record's ``device_transient_peak`` in ``infinity.stats(model)["steps"]``: activations, and the
gathered parameters and gradient buckets it freed, so it errs on the large side) with what was kept,
and gives the figure for the next run. A CPU "device" is host memory,
whose budget is what the machine has available: nothing is set aside there.

Ties go to the placement with fewer bytes off the device (device before host before NVMe). A split of
the optimizer states is chosen over the fastest uniform pair that fits only when it predicts a step at
least ``SPLIT_WORTH`` (5%) shorter: the model's predictions are good to about 15% (docs/benchmarks/
plan-vs-measured.md), and a split a percent ahead (the device share of eight 80 GB GPUs at 7B and 13B:
0.86 against 0.87 s) buys a second tier's memory and a second update lane for a gain it cannot show.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infinity.plan.census import take_census
from infinity.plan.errors import PlanError
from infinity.plan.machine import MachineProfile, Workload
from infinity.plan.step_model import (PAIRS, TIERS, Placement, StepModel, StepPrediction, splits_allowed,
                                      uniform_allowed)

if TYPE_CHECKING:
    from infinity.config import Config

AUTO = "auto"
DEFAULT_SLICES = 16
# How much faster a split of the compute copies must predict the step to be reported beside the choice.
SPLIT_GAIN = 1e-3
SPLIT_WORTH = 0.05
# The share of a GPU's free memory kept for activations when their size is not given ([Note: activations
# before the first step]).
ACTIVATION_SHARE = 0.25
# The tiers keys a decision sets, which rank 0 broadcasts (``resolve_at_init``).
_DECIDED = ("params", "optimizer", "optimizer_device_share", "optimizer_host_share")


def best_split(model: StepModel, slices: int = DEFAULT_SLICES) -> StepPrediction | None:
    """The fastest fitting placement that fills faster tiers first, compute copies split too (see [Note: auto
    placement]); None when nothing fits."""
    best: StepPrediction | None = None
    budget = model.budget()
    for a in range(slices, -1, -1):
        most = next((b for b in range(slices, -1, -1) if _device_fits(model, slices, a, b, budget)), None)
        for b, c in itertools.product(range(most if most is not None else -1, -1, -1), range(slices - a, -1, -1)):
            for d in range(slices - b, -1, -1):
                placement = Placement.from_counts(slices, (a, c), (b, d))
                if not allowed_cells(model, placement) or not fits(model, placement, budget):
                    continue
                prediction = model.predict(placement)
                if best is None or prediction.step_s < best.step_s * (1 - 1e-12):
                    best = prediction
                break
    return best


def allowed_cells(model: StepModel, placement: Placement) -> bool:
    """Whether every pair of the placement is one the engine allows under the config, and the optimizer states,
    when in one tier, a tier it keeps them all in."""
    tiers = {o for (_, o), _ in placement.cells}
    if len(tiers) == 1 and not uniform_allowed(model.cfg, next(iter(tiers))):
        return False
    return all(pair in model.pairs for pair, _ in placement.cells)


def runnable(model: StepModel, placement: Placement) -> bool:
    """Whether the engine runs the placement: one params tier, pairs it allows, and the optimizer states in one
    tier or split as the config lets them be ([Note: optimizer states over tiers] in
    infinity/optim/tier_split.py: not with the delayed update)."""
    if placement.params_tier is None or not allowed_cells(model, placement):
        return False
    split = len({o for (_, o), _ in placement.cells}) > 1
    return not split or splits_allowed(model.cfg)


def fits(model: StepModel, placement: Placement, budget: dict[str, float]) -> bool:
    return all(n <= budget[t] for t, n in model.need(placement).items())


def _device_fits(model: StepModel, slices: int, a: int, b: int, budget: dict[str, float]) -> bool:
    """Whether ``a`` slices of copies and ``b`` of states fit the device, the rest in the slowest tier there
    is (with the CPU as compute device, device and host share one budget)."""
    host = not model.profile.has_nvme
    placement = Placement.from_counts(slices, (a, slices - a if host else 0), (b, slices - b if host else 0))
    if not allowed_cells(model, placement):
        return False
    return model.need(placement)["device"] <= budget["device"]


def all_placements(slices: int, pairs=PAIRS):
    """Every placement of ``slices`` slices over ``pairs`` (what the tests search exhaustively)."""
    for split in itertools.combinations(range(slices + len(pairs) - 1), len(pairs) - 1):
        bounds = (-1, *split, slices + len(pairs) - 1)
        counts = [bounds[i + 1] - bounds[i] - 1 for i in range(len(pairs))]
        yield Placement(slices, tuple(zip(pairs, counts)))


def runnable_placements(model: StepModel, slices: int = DEFAULT_SLICES, params: str = AUTO,
                        optimizer: str = AUTO):
    """Every placement the engine runs that ``params`` / ``optimizer`` allow ("auto": any), fastest tiers
    first: one params tier, the optimizer states over ``slices`` slices (device, host, NVMe); a fixed
    optimizer tier keeps the config's own shares."""
    shares = model.cfg.tiers.optimizer_device_share, model.cfg.tiers.optimizer_host_share
    for p in TIERS:
        if params not in (AUTO, p):
            continue
        if optimizer != AUTO:
            placement = Placement.of_tiers(p, optimizer, *shares)
            if runnable(model, placement):
                yield placement
            continue
        for b in range(slices, -1, -1):
            for d in range(slices - b, -1, -1):
                placement = Placement(slices, (((p, "device"), b), ((p, "host"), d), ((p, "nvme"), slices - b - d)))
                if runnable(model, placement):
                    yield placement


def best_runnable(model: StepModel, params: str = AUTO, optimizer: str = AUTO,
                  slices: int = DEFAULT_SLICES) -> StepPrediction | None:
    """The fastest fitting placement the engine runs (see [Note: auto placement]); None when none fits."""
    best: StepPrediction | None = None
    budget = model.budget()
    for placement in runnable_placements(model, slices, params, optimizer):
        if not fits(model, placement, budget):
            continue
        prediction = model.predict(placement)
        if best is None or prediction.step_s < best.step_s * (1 - 1e-12):
            best = prediction
    return best


def uniform_predictions(model: StepModel, params: str = AUTO, optimizer: str = AUTO) -> list[StepPrediction]:
    """The prediction of every pair the engine runs that ``params`` / ``optimizer`` allow ("auto": any)."""
    return [model.predict(Placement.uniform(p, o)) for p, o in PAIRS
            if (p, o) in model.pairs and uniform_allowed(model.cfg, o) and params in (AUTO, p)
            and optimizer in (AUTO, o)]


def best_uniform(model: StepModel, params: str = AUTO, optimizer: str = AUTO) -> StepPrediction | None:
    """The fastest fitting uniform pair; None when none fits."""
    fitting = [p for p in uniform_predictions(model, params, optimizer) if p.fits]
    return min(fitting, key=lambda p: p.step_s) if fitting else None


@dataclass(frozen=True)
class AutoDecision:
    """What ``auto`` chose, and why.

    Attributes
    ----------
    chosen : StepPrediction
        The placement the engine will run: one params tier, the optimizer states in one tier or split.
    split : StepPrediction or None
        The best placement with the compute copies split too (not run by the engine yet), when it predicts
        a faster step than ``chosen``.
    candidates : tuple of StepPrediction
        Every uniform pair considered, fitting or not.
    """

    chosen: StepPrediction
    split: StepPrediction | None
    candidates: tuple[StepPrediction, ...]
    activation_reserve: float = 0.0
    reserve_assumed: bool = False

    def tiers(self) -> dict[str, object]:
        """The ``tiers`` keys the chosen placement sets: params, optimizer and the optimizer's shares."""
        placement = self.chosen.placement
        optimizer, device, host = placement.optimizer_tiers()
        return {"params": placement.params_tier, "optimizer": optimizer, "optimizer_device_share": device,
                "optimizer_host_share": host}

    def summary(self) -> str:
        c = self.chosen
        line = (f"auto placement: {c.placement.describe()} (predicted step {c.step_s:.3f} s, bound by "
                f"{c.governing})")
        if self.split is not None:
            line += (f"; with the compute copies split too ({self.split.placement.describe()}) it would predict "
                     f"{self.split.step_s:.3f} s, which the engine cannot run yet")
        if self.reserve_assumed:
            line += (f"; {self.activation_reserve / 2**30:.1f} GiB of device memory kept for activations (a "
                     f"{ACTIVATION_SHARE:g} share: set activations.checkpoint_nbytes to what a step holds)")
        return line


def decide(model: StepModel, params: str = AUTO, optimizer: str = AUTO,
           slices: int = DEFAULT_SLICES) -> AutoDecision:
    """Choose the tiers ``auto`` stands for; a PlanError names every pair's shortfall when none fits."""
    candidates = uniform_predictions(model, params, optimizer)
    chosen = best_runnable(model, params, optimizer, slices)
    uniform = best_uniform(model, params, optimizer)
    if chosen is not None and chosen.placement.pair is None and uniform is not None \
            and not chosen.step_s < uniform.step_s * (1 - SPLIT_WORTH):
        chosen = uniform    # a split must be worth its second tier (see [Note: auto placement])
    if chosen is None:
        lines = [f"  {p.placement.describe()}: " + "; ".join(p.shortfalls()) for p in candidates]
        if _guessed(model):
            lines.append(f"  (each device need counts {model.activation_reserve / 2**30:.1f} GiB kept for "
                         f"activations, a {model.workload.activation_share:g} share of the device's free memory: "
                         "activations.checkpoint_nbytes says how much a step holds)")
        raise PlanError("tiers \"auto\": no placement fits this machine "
                        f"({model.profile.name}):\n" + "\n".join(lines))
    split = best_split(model, slices) if params == optimizer == AUTO else None
    if split is not None and (split.placement.params_tier is not None or not split.step_s < chosen.step_s * (
            1 - (SPLIT_WORTH if chosen.placement.pair is not None else SPLIT_GAIN))):
        split = None    # one the engine runs, or not worth more than what it runs
    return AutoDecision(chosen=chosen, split=split, candidates=tuple(candidates),
                        activation_reserve=model.activation_reserve, reserve_assumed=_guessed(model))


def _guessed(model: StepModel) -> bool:
    """Whether ``model`` keeps device memory for activations whose size it was not told."""
    return not model.workload.activation_bytes and model.activation_reserve > 0


def resolve_auto(cfg: "Config", model: object, *, world_size: int = 1, local_ranks: int | None = None,
                 machine: "MachineProfile | str | None" = None, workload: Workload | None = None,
                 slices: int = DEFAULT_SLICES) -> tuple["Config", AutoDecision | None]:
    """``cfg`` with "auto" tiers resolved for ``model`` on ``machine``, and the decision (None: nothing was auto).

    Parameters
    ----------
    cfg : Config
    model : nn.Module, "pkg.module:callable", parameter count or ModelCensus
        What the placement is sized for (``infinity.plan.plan`` takes the same).
    world_size, local_ranks : int
        Ranks in all and on this machine (default: all on this machine).
    machine : MachineProfile, profile file, or None
        None probes this machine once and caches the rates ([Note: machine probes] in
        infinity/plan/probes.py).
    workload : Workload, optional
        Tokens per rank and step (default ``Workload()``); activation bytes default to
        ``activations.checkpoint_nbytes`` when activations stay on the device.

    Raises
    ------
    PlanError
        When ``model`` is missing or no placement fits, naming each pair's shortfall.
    """
    if AUTO not in (cfg.tiers.params, cfg.tiers.optimizer):
        return cfg, None
    if model is None:
        raise PlanError('tiers "auto" places states for a model of known size: give it, as '
                        'infinity.Init("auto", model=7e9) (a parameter count), model="pkg.module:build" '
                        "(built on the meta device) or a module")
    local = world_size if local_ranks is None else local_ranks
    profile = _machine(cfg, machine, local)
    workload = workload or default_workload(cfg)
    census = take_census(model, cfg, cfg.precision.itemsize)
    decision = decide(StepModel(census, cfg, world_size, profile, workload), cfg.tiers.params,
                      cfg.tiers.optimizer, slices)
    return resolve_tiers(cfg, decision), decision


def default_workload(cfg: "Config") -> Workload:
    """``Workload()`` with ``activations.checkpoint_nbytes`` taking device memory when activations stay there,
    or, not given and tiers "auto" to decide, ``ACTIVATION_SHARE`` of a GPU's (see [Note: activations before
    the first step]; tiers given are planned as they are, their fit counting what the config says)."""
    if cfg.activations.offload != "none":
        return Workload()
    given = int(cfg.activations.checkpoint_nbytes)
    deciding = AUTO in (cfg.tiers.params, cfg.tiers.optimizer)
    return Workload(activation_bytes=given, activation_share=ACTIVATION_SHARE if deciding and not given else 0.0)


def predict_configured(cfg: "Config", census, world_size: int, local_ranks: int, machine: object,
                       workload: Workload | None = None) -> StepPrediction:
    """The predicted step of ``cfg``'s own tiers (its optimizer shares too) on ``machine`` (a profile or a
    profile file)."""
    model = StepModel(census, cfg, world_size, _machine(cfg, machine, local_ranks), workload or default_workload(cfg))
    t = cfg.tiers
    return model.predict(Placement.of_tiers(t.params, t.optimizer, t.optimizer_device_share, t.optimizer_host_share))


def _machine(cfg: "Config", machine: object, local_ranks: int) -> MachineProfile:
    if isinstance(machine, MachineProfile):
        return dataclasses.replace(machine, ranks=local_ranks) if machine.ranks != local_ranks else machine
    if machine is not None:
        return dataclasses.replace(MachineProfile.from_file(machine), ranks=local_ranks)
    from infinity.plan.probes import machine_profile

    return machine_profile(cfg.tiers.compute_device(), cfg.precision.dtype, ranks=local_ranks,
                           nvme_paths=tuple(cfg.tiers.nvme_path), host_budget=int(cfg.tiers.host_budget))


def resolve_at_init(cfg: "Config", model: object, machine: object, group=None) -> tuple["Config", AutoDecision | None]:
    """What ``infinity.Init`` runs for "auto" tiers: rank 0 decides and every rank takes its pair, so the
    ranks agree whatever each one's probes would measure. A decision that fails is a ConfigError naming the
    key, on every rank: rank 0's failure travels in the one broadcast every rank makes, so no rank waits in it
    while another has raised (and only rank 0 probes, so the cached rates are not measured under N-way
    contention)."""
    from infinity.config import ConfigError

    if AUTO not in (cfg.tiers.params, cfg.tiers.optimizer):
        return cfg, None
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    key = "tiers.params" if cfg.tiers.params == AUTO else "tiers.optimizer"
    outcome: tuple = ("error", "auto placement was not decided on rank 0")
    nccl = world > 1 and dist.get_backend(group) == "nccl"
    on_gpu = world > 1 and cfg.tiers.compute_device() == "cuda"
    gpu = _rank_gpu() if nccl or on_gpu else None
    device = gpu if nccl else None      # what the collectives below carry their tensors on
    # Each rank's GPU may have another share free (another process on it): rank 0 decides for the least.
    least_free = least_free_device_bytes(group, gpu, device) if on_gpu and machine is None else None
    if rank == 0:
        try:
            if least_free is not None:
                machine = dataclasses.replace(_machine(cfg, None, _local_ranks(world)), device_bytes=least_free)
            resolved, decision = resolve_auto(cfg, model, world_size=world, local_ranks=_local_ranks(world),
                                              machine=machine)
            outcome = ("ok", {key: getattr(resolved.tiers, key) for key in _DECIDED}, decision)
        except PlanError as exc:
            outcome = ("error", str(exc))
        except Exception as exc:        # a probe, a profile file, the cache: every rank must hear of it
            outcome = ("error", f"auto placement failed on rank 0: {exc!r}")
    if world > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group, device=device)
        outcome = box[0]
    if outcome[0] != "ok":
        raise ConfigError(outcome[1], key)
    _, tiers, decision = outcome
    resolved = dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, **tiers))
    import logging

    logging.getLogger("infinity").info("%s", decision.summary())
    return resolved, decision


def _rank_gpu():
    """This rank's GPU: ``LOCAL_RANK``'s where the process sees several, else the current one (one visible
    device per process, ``CUDA_VISIBLE_DEVICES`` set per rank), as the engine's device check takes it."""
    import torch

    local = os.environ.get("LOCAL_RANK", "")
    index = int(local) if local.isdigit() and int(local) < torch.cuda.device_count() else torch.cuda.current_device()
    return torch.device("cuda", index)


def least_free_device_bytes(group, gpu, device=None) -> float | None:
    """The least memory free on the ranks' GPUs (``gpu``: this rank's), in one all-reduce on ``device`` (None:
    the CPU) that every rank of ``group`` calls; None when some rank could not read its own."""
    import torch
    import torch.distributed as dist

    from infinity.plan.probes import device_free_bytes

    try:
        if gpu is not None:
            with torch.cuda.device(gpu):
                free = device_free_bytes()
        else:
            free = device_free_bytes()
    except Exception:       # said by the decision's own probe on rank 0; here every rank must still reduce
        free = -1.0
    least = torch.tensor([free], dtype=torch.float64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    value = float(least.item())
    return value if value >= 0 else None


def _local_ranks(world: int) -> int:
    """Ranks sharing this machine's host memory and disks: the launcher's LOCAL_WORLD_SIZE, else all."""
    try:
        return max(1, min(world, int(os.environ["LOCAL_WORLD_SIZE"])))
    except (KeyError, ValueError):
        return world


def resolve_tiers(cfg: "Config", decision: AutoDecision) -> "Config":
    """``cfg`` with its "auto" tiers replaced by the decision's: ``tiers.params``, and for an "auto" optimizer
    ``tiers.optimizer`` with ``optimizer_device_share`` and ``optimizer_host_share``."""
    chosen, tiers = decision.tiers(), cfg.tiers
    changes = {key: value for key, value in chosen.items()
               if getattr(tiers, "optimizer" if key.startswith("optimizer") else key) == AUTO}
    return dataclasses.replace(cfg, tiers=dataclasses.replace(tiers, **changes))


__all__ = ["AUTO", "AutoDecision", "all_placements", "allowed_cells", "best_runnable", "best_split", "best_uniform",
           "decide", "default_workload", "fits", "least_free_device_bytes", "predict_configured", "resolve_at_init",
           "resolve_auto", "resolve_tiers", "runnable", "runnable_placements", "uniform_predictions"]
