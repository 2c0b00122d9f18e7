"""The ZeRO paper's model-state arithmetic, per data-parallel rank.

[Note: ZeRO stages]
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), Section 5: with Psi parameters, N_d data-parallel ranks, 2-byte parameters and
gradients and K bytes of optimizer state per parameter (K = 12 for mixed-precision Adam: fp32
master, momentum and variance), each rank holds

    stage 0 (baseline DP)      (2 + 2 + K) * Psi
    stage 1 (P_os)             2 Psi + 2 Psi + K Psi / N_d
    stage 2 (P_os+g)           2 Psi + (2 + K) Psi / N_d
    stage 3 (P_os+g+p)         (2 + 2 + K) Psi / N_d

Communication per rank and training step (Section 7, in the ring accounting of [Note:
communication volume] in infinity/runtime/ranks.py), in elements:

    stage 0                    2 Psi (N_d - 1) / N_d    (all-reduce of the gradients)
    stage 1, stage 2           2 Psi (N_d - 1) / N_d    (reduce-scatter gradients, all-gather params)
    stage 3                    3 Psi (N_d - 1) / N_d    (all-gather in forward and backward, reduce-scatter)

A partitioned state is held as a shard of ceil(Psi / N_d) elements: real shards are whole
elements, and nothing has to divide Psi (the engine pads; the paper's figures are unaffected at
the precision it prints).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from infinity.plan.errors import PlanError
from infinity.plan.units import format_gb, parse_count, parse_positive_int

STAGES: tuple[int, ...] = (0, 1, 2, 3)
STAGE_NAMES: dict[int, str] = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def model_states_per_rank(
    num_params: int | float | str,
    world_size: int,
    stage: int = 3,
    k: int = 12,
    param_bytes: int = 2,
    grad_bytes: int = 2,
) -> dict[str, int]:
    """Bytes of model states each data-parallel rank holds at a ZeRO stage.

    Parameters
    ----------
    num_params : int, float or str
        Psi, the number of parameters (``7.5e9`` and ``"7.5B"`` are accepted; must be whole).
    world_size : int
        N_d, the data-parallel degree (a positive integer; nothing has to divide by it).
    stage : int
        0 (baseline data parallelism), 1 (optimizer states partitioned), 2 (and gradients),
        3 (and parameters).
    k : int
        Optimizer-state bytes per parameter (12 for mixed-precision Adam).
    param_bytes, grad_bytes : int
        Bytes per parameter and per gradient element (2 for fp16/bf16).

    Returns
    -------
    dict
        ``params``, ``grads``, ``optimizer_states`` and ``total``, in bytes.

    Raises
    ------
    PlanError
        When a size is zero, negative or not whole, or the stage is not 0-3.

    Examples
    --------
    The paper's example, 7.5B parameters on 64 ranks at stage 3: 1.875 GB per rank.

    >>> model_states_per_rank(7.5e9, 64, stage=3)["total"]
    1875000000
    """
    psi = parse_count(num_params, "num_params")
    ranks = parse_positive_int(world_size, "world_size")
    if isinstance(stage, bool) or stage not in STAGES:
        raise PlanError(f"stage must be one of {list(STAGES)}, got {stage!r}")
    k = parse_positive_int(k, "k (optimizer bytes per parameter)")
    param_bytes = parse_positive_int(param_bytes, "param_bytes")
    grad_bytes = parse_positive_int(grad_bytes, "grad_bytes")
    shard = -(-psi // ranks)
    optimizer_states = k * (shard if stage >= 1 else psi)
    grads = grad_bytes * (shard if stage >= 2 else psi)
    params = param_bytes * (shard if stage >= 3 else psi)
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": optimizer_states,
        "total": params + grads + optimizer_states,
    }


def comm_per_rank(num_params: int | float | str, world_size: int, stage: int = 3, param_bytes: int = 2,
                  grad_bytes: int = 2) -> int:
    """Bytes each rank sends through collectives per training step at a ZeRO stage (see [Note: ZeRO stages]).

    >>> comm_per_rank(1_000_000, 4, stage=3)   # 3 Psi (N-1)/N elements of 2 bytes
    4500000
    """
    psi = parse_count(num_params, "num_params")
    ranks = parse_positive_int(world_size, "world_size")
    if isinstance(stage, bool) or stage not in STAGES:
        raise PlanError(f"stage must be one of {list(STAGES)}, got {stage!r}")
    share = lambda nbytes: nbytes * (ranks - 1) // ranks   # noqa: E731 - one ring share
    grads = share(psi * grad_bytes)
    params = share(psi * param_bytes)
    if stage == 0:
        return 2 * grads
    return grads + params * (2 if stage == 3 else 1)


def zero_table(
    params_list: Sequence[int | float | str],
    ranks_list: Sequence[int],
    *,
    k: int = 12,
    param_bytes: int = 2,
    grad_bytes: int = 2,
) -> list[dict[str, object]]:
    """The per-stage totals for every (parameter count, rank count) pair, as plain rows.

    Each row holds ``num_params``, ``world_size`` and, per stage name (``baseline``,
    ``P_os``, ``P_os+g``, ``P_os+g+p``), the total bytes per rank. ``infinity-plan table``
    prints these rows and writes them with ``--json``.

    Examples
    --------
    >>> rows = zero_table([7.5e9], [64])
    >>> rows[0]["P_os+g"]
    16640625000
    """
    if not params_list:
        raise PlanError("give at least one parameter count")
    if not ranks_list:
        raise PlanError("give at least one rank count")
    rows: list[dict[str, object]] = []
    for num_params in params_list:
        psi = parse_count(num_params, "num_params")
        for world_size in ranks_list:
            row: dict[str, object] = {"num_params": psi, "world_size": world_size}
            for stage in STAGES:
                states = model_states_per_rank(
                    psi, world_size, stage, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes
                )
                row[STAGE_NAMES[stage]] = states["total"]
                row[f"comm {STAGE_NAMES[stage]}"] = comm_per_rank(psi, world_size, stage, param_bytes, grad_bytes)
            rows.append(row)
    return rows


def _label(psi: int) -> str:
    """``7.5B``, ``128B``, ``1T``: the way the paper names its models."""
    if psi >= 10**12:
        return f"{psi / 1e12:g}T"
    if psi >= 10**9:
        return f"{psi / 1e9:g}B"
    return f"{psi / 1e6:g}M"


def render_zero_table(rows: Iterable[dict[str, object]], *, k: int = 12) -> str:
    """Text of :func:`zero_table` rows: one table per parameter count, GB = 1e9 bytes."""
    by_model: dict[int, list[dict[str, object]]] = {}
    for row in rows:
        by_model.setdefault(int(row["num_params"]), []).append(row)  # type: ignore[call-overload]
    names = [STAGE_NAMES[stage] for stage in STAGES]
    blocks = []
    for psi, model_rows in by_model.items():
        lines = [
            f"Model states per rank, {_label(psi)} parameters, K={k} "
            f"(GB = 1e9 bytes, as in the ZeRO paper)",
            f"{'ranks':>7}" + "".join(f"{name:>12}" for name in names),
        ]
        for row in model_rows:
            cells = "".join(f"{format_gb(int(row[name])):>12}" for name in names)  # type: ignore[call-overload]
            lines.append(f"{row['world_size']:>7}{cells}")
        lines.append("Sent per rank per training step through collectives (GB)")
        for row in model_rows:
            cells = "".join(f"{format_gb(int(row['comm ' + name])):>12}" for name in names)  # type: ignore[call-overload]
            lines.append(f"{row['world_size']:>7}{cells}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


__all__ = ["STAGES", "STAGE_NAMES", "comm_per_rank", "model_states_per_rank", "render_zero_table", "zero_table"]
