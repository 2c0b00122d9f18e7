"""What an infinity optimizer steps: a model, its parameters, or torch-style param groups.

[Note: parameter groups of the optimizer]
``infinity.AdamW`` takes what ``torch.optim.AdamW`` takes (an iterable of parameters, or
of dicts ``{"params": [...], "lr": ..., "weight_decay": ...}``), or the model itself. The
groups are torch's own (``param_groups``, ``add_param_group``, read and written by LR
schedulers), and each is honoured at every step: when every group has the same
hyper-parameters the update is the usual one (whole engine groups, one fused kernel
call per sub-group); when they differ, the update carries per-parameter ranges, each
with the index of its group's hyper-parameters, and the kernel runs once per set present
in a chunk (see ``StepJob.runs`` in infinity/optim/job.py). These param groups have
nothing to do with the engine's parameter groups (one per module, the unit of transfer):
a module's weight and bias may sit in different optimizer groups. Parameters added to an engine
model after ``infinity.Init`` exited (peft's adapters) belong to its engine too, unmanaged: see
[Note: unmanaged parameters] in infinity/optim/unmanaged.py.

What the room may touch: the registry (which engine manages a parameter) and the
engine's coordinator (read only: which parameters it manages, and their names).
"""
from __future__ import annotations

from torch import nn

from infinity import registry
from infinity.errors import EngineError

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def resolve(params, what: str):
    """``(engine, groups)``: the engine managing ``params`` and torch-style group dicts for them.

    ``params`` is the model built in ``infinity.Init`` (or a wrapper of it made later, a ``PeftModel``), an
    iterable of its parameters, or an iterable of param-group dicts. Every parameter must belong to one
    engine's model: managed, or added to it after the block ([Note: unmanaged parameters]).
    """
    if isinstance(params, nn.Module):
        engine = registry.engine_of(params, what)
        return engine, [{"params": list(params.parameters())}]     # as torch.optim.AdamW(model.parameters())
    if isinstance(params, nn.Parameter):
        params = [params]
    groups = list(params)
    if not groups:
        raise ValueError(f"{what} got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    engine, added = None, None
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{what}: param group {i} must be a dict with a 'params' entry, as in torch.optim")
        for p in ([group["params"]] if isinstance(group["params"], nn.Parameter) else group["params"]):
            owner = registry.engine_of_param(p, what)
            if owner is None:
                added = registry.engines_by_added_param() if added is None else added
                owner = added.get(p)
            if owner is None:
                raise registry.NotManagedError(
                    f"{what}: a parameter of shape {tuple(p.shape)} in param group {i} is not managed by infinity; "
                    "pass the parameters (or the model) built inside infinity.Init")
            if engine is not None and owner is not engine:
                raise EngineError(f"{what}: the parameters belong to models of two different infinity.Init "
                                  "contexts; create one optimizer per model")
            engine = owner
    return engine, groups


def check_hyper(group: dict, what: str, index: int) -> None:
    """Torch's checks of one group's hyper-parameters, with the group's index in the message."""
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    where = f" (param group {index})"
    if not 0.0 <= float(lr):
        raise ValueError(f"{what}: lr must be >= 0, got {lr}{where}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{what}: betas must be in [0, 1), got {betas}{where}")
    if not float(eps) > 0.0:
        raise ValueError(f"{what}: eps must be > 0, got {eps}{where}")
    _refuse_unsupported(group, what, index)


# torch.optim.Adam(W) options the host kernels do not implement: a group asking for one is refused
# rather than stepped as if it had not (``foreach`` and ``fused`` choose torch's kernels only: ignored).
_UNSUPPORTED = ("maximize", "amsgrad", "capturable", "differentiable")


def check_options(param_groups, what: str) -> None:
    """Refuse a group that asks for an option the host Adam lacks (set since it was added)."""
    for index, g in enumerate(param_groups):
        _refuse_unsupported(g, what, index)


def _refuse_unsupported(group: dict, what: str, index: int) -> None:
    asked = [key for key in _UNSUPPORTED if group.get(key)]
    if asked:
        raise ValueError(f"{what}: param group {index} sets {asked[0]}={group[asked[0]]!r}, which infinity's "
                         f"host Adam does not implement (it would step as if {asked[0]} were False); remove it")


def hyper_sets(param_groups) -> list[tuple[float, float, float, float, float]]:
    """Per group, ``(lr, beta1, beta2, eps, weight_decay)`` as floats, read now (schedulers change them)."""
    return [(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]), float(g["weight_decay"]))
            for g in param_groups]
