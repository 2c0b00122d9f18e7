"""infinity.plan: know before step 0 whether a model fits, where every byte goes, how fast it can run.

Three levels:

* :func:`model_states_per_rank` and :func:`zero_table`: the ZeRO paper's arithmetic for a
  parameter count, a data-parallel degree and a stage (``infinity-plan table``).
* :func:`plan`: for a real model (an ``nn.Module``, a ``"pkg.module:build"`` callable built on
  the meta device, or a parameter count) and an infinity config, the bytes each tier holds on
  each rank, whether that fits this machine, the NVMe traffic of one step and a lower bound on
  the step time (``infinity-plan model``). ``plan(...).needs()`` feeds
  ``tiers.budget.check_budget``; the engine's own up-front check uses the same code.
* :class:`StepModel` and :func:`resolve_auto`: the step predicted per phase for any placement of the
  states on a :class:`MachineProfile` (measured by ``infinity.plan.probes``), and the placement "auto"
  tiers stand for (``infinity-plan model --config auto``; [Note: auto placement] in placement.py).

What the room may touch: the config and ``tiers.budget`` (to check the fit); it builds
models on the meta device only and never allocates a tier.

[Note: glossary]
shard: one rank's 1/N slice of a group's flat, padded buffer. group: one module's direct
parameters (or one tile of a tiled layer), flattened: the unit the engine partitions and
gathers. tier: where bytes live (device, host, nvme). working set: the largest group gathered
whole on the compute device. rank type: ranks holding the same bytes; with equal padded shards
every rank is of the one type.
"""
from infinity.plan.bandwidth import Bandwidth
from infinity.plan.census import CensusGroup, ModelCensus, census_of_module, load_model
from infinity.plan.errors import PlanError
from infinity.plan.machine import MachineProfile, Workload
from infinity.plan.placement import AutoDecision, resolve_auto
from infinity.plan.planner import FitCheck, Plan, PlanSettings, ShardSizes, plan, resolve_config
from infinity.plan.rows import PlanRow
from infinity.plan.step_model import Placement, StepModel, StepPrediction
from infinity.plan.zero import STAGE_NAMES, comm_per_rank, model_states_per_rank, render_zero_table, zero_table

__all__ = [
    "STAGE_NAMES",
    "AutoDecision",
    "MachineProfile",
    "Placement",
    "StepModel",
    "StepPrediction",
    "Workload",
    "resolve_auto",
    "Bandwidth",
    "CensusGroup",
    "FitCheck",
    "ModelCensus",
    "Plan",
    "PlanError",
    "PlanRow",
    "PlanSettings",
    "ShardSizes",
    "census_of_module",
    "load_model",
    "model_states_per_rank",
    "plan",
    "comm_per_rank",
    "render_zero_table",
    "resolve_config",
    "zero_table",
]
