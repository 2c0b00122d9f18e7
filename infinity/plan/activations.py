"""The plan's rows for checkpointed activations (``[activations]``), per rank.

[Note: activation bytes in the plan]
What checkpoints save depends on the batch, the sequence and the model's widths at the
checkpoint boundaries, none of which a config or a parameter census knows; batch sizes are
the program's. So the bytes are given, as ``activations.checkpoint_nbytes`` (for a
transformer with every block checkpointed: blocks x batch x sequence x hidden x dtype
bytes; ``infinity.stats(model)["activations"]["checkpoint_nbytes"]`` measures it after one
step), and ``infinity-plan model --activation-bytes`` sets it for one plan. One number
serves the engine's budget check at ``Init`` (before any batch exists) and the plan.

Rows: the activations themselves in the tier ``offload`` names ("none": the compute device);
with "nvme" the constant-size staging buffer (``activations.buffer_bytes``, host); with any
offload, what backward brings back ahead of use (``activations.prefetch_bytes``, at most all
of them) on the compute device.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from infinity.plan.rows import PlanRow

if TYPE_CHECKING:
    from infinity.config import Config

_TIER = {"none": "device", "host": "host", "nvme": "nvme"}


def activation_rows(cfg: "Config") -> Iterator[PlanRow]:
    """The ``activations``, ``activation_staging`` and ``activation_prefetch`` rows of one rank."""
    act = cfg.activations
    nbytes = int(act.checkpoint_nbytes)
    if nbytes:
        yield PlanRow("activations", f"checkpointed activations (activations.checkpoint_nbytes, offload "
                      f"{act.offload!r})", _TIER[act.offload], nbytes)
    if act.offload == "nvme":
        yield PlanRow("activation_staging", "activation staging buffer (activations.buffer_bytes)", "host",
                      int(act.buffer_bytes))
    if act.offload != "none" and nbytes:
        yield PlanRow("activation_prefetch", "activations brought back ahead of backward "
                      "(activations.prefetch_bytes)", "device", min(int(act.prefetch_bytes), nbytes))
