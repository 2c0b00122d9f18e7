"""The NVMe bandwidth a step-time bound is computed from: given, or read from a bench result.

[Note: reading infinity-bench JSON]
``infinity-bench nvme --json F`` (infinity/cli/bench.py) records the settings, the machine, every
raw sample (``samples``: tool, op, setting, repeat, nbytes, seconds, gb_per_s) and the median per
(tool, setting, op) (``summary``: ..., gb_per_s). The planner takes the best median read and
the best median write of our own engine (tool ``ours``; fio and the Python baselines are not
what the engine achieves) over all settings, in decimal GB/s: the fastest the engine has been
seen to move bytes on that disk, which keeps the step-time bound a lower bound. Without a
summary it takes medians of the ``ours`` samples; files of other shapes work when they hold
``read_gbps`` / ``write_gbps`` (top level or under ``best``), or records naming an op
(read/write) with a GB/s figure. A file with none of these is an error naming the file.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from infinity.plan.errors import PlanError

_RATE_KEYS = ("gb_per_s", "gbps", "gb_s", "bandwidth_gbps", "gbytes_per_s")
_OP_KEYS = ("op", "mode", "kind", "direction", "rw")


@dataclass(frozen=True)
class Bandwidth:
    """Sequential NVMe bandwidth available to the ranks on one machine.

    Attributes
    ----------
    read_gbps, write_gbps : float
        Decimal GB/s (1 GB = 1e9 bytes), as ``infinity-bench`` reports them.
    source : str
        Where the figures came from (a file, or ``command line``).

    Examples
    --------
    >>> Bandwidth(2.5, 3.0).seconds(read_bytes=5 * 10**9, write_bytes=3 * 10**9)
    3.0
    """

    read_gbps: float
    write_gbps: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("read_gbps", "write_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanError(f"{name} must be a number of GB/s, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise PlanError(f"{name} must be a positive number of GB/s, got {value!r}")

    def seconds(self, read_bytes: int, write_bytes: int) -> float:
        """Time to read and then write the given bytes at these rates (see planner's bound)."""
        return read_bytes / (self.read_gbps * 1e9) + write_bytes / (self.write_gbps * 1e9)

    def to_dict(self) -> dict[str, object]:
        """Plain, JSON-able form."""
        return {"read_gbps": self.read_gbps, "write_gbps": self.write_gbps, "source": self.source}

    @classmethod
    def from_bench_json(cls, path: str | Path) -> "Bandwidth":
        """Read the best read and write rates from an ``infinity-bench nvme --json`` file.

        Raises
        ------
        PlanError
            When the file cannot be read, is not JSON, or holds no read or no write rate.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise PlanError(f"cannot read bench result {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise PlanError(f"bench result {path} is not JSON: {exc}") from exc
        best = _best_rates(data)
        missing = [op for op in ("read", "write") if op not in best]
        if missing:
            raise PlanError(
                f"bench result {path} holds no {' or '.join(missing)} rate in GB/s; "
                f"expected an 'infinity-bench nvme --json' file"
            )
        return cls(read_gbps=best["read"], write_gbps=best["write"], source=str(path))


def _best_rates(data: object) -> dict[str, float]:
    """Best read/write GB/s in a bench result (see [Note: reading infinity-bench JSON])."""
    if isinstance(data, dict):
        for source in (data.get("summary"), _sample_medians(data.get("samples"))):
            best = _best_of(source if isinstance(source, list) else [])
            if len(best) == 2:
                return best
        for holder in (data.get("best"), data):
            if isinstance(holder, dict):
                direct = {
                    op: float(holder[f"{op}_gbps"])
                    for op in ("read", "write")
                    if _is_rate(holder.get(f"{op}_gbps"))
                }
                if len(direct) == 2:
                    return direct
    return _best_of(list(_records(data)))


def _sample_medians(samples: object) -> list[dict]:
    """Median gb_per_s per (tool, setting, op) of raw samples, as summary-like rows."""
    if not isinstance(samples, list):
        return []
    groups: dict[tuple[str, str, str], list[float]] = {}
    for sample in samples:
        if isinstance(sample, dict) and _is_rate(sample.get("gb_per_s")):
            key = (str(sample.get("tool")), json.dumps(sample.get("setting"), sort_keys=True),
                   str(sample.get("op")))
            groups.setdefault(key, []).append(float(sample["gb_per_s"]))
    return [
        {"tool": tool, "op": op, "gb_per_s": statistics.median(rates)}
        for (tool, _setting, op), rates in groups.items()
    ]


def _best_of(records: list[dict]) -> dict[str, float]:
    """Largest rate per op over records naming an op; only tool "ours" when tools are named."""
    records = [r for r in records if isinstance(r, dict)]
    if any("tool" in r for r in records):
        records = [r for r in records if r.get("tool") == "ours"]
    best: dict[str, float] = {}
    for record in records:
        op = next(
            (str(record[key]).lower() for key in _OP_KEYS if isinstance(record.get(key), str)),
            None,
        )
        if op not in ("read", "write"):
            continue
        for key, value in record.items():
            if key.lower() in _RATE_KEYS and _is_rate(value):
                best[op] = max(best.get(op, 0.0), float(value))
    return best


def _records(data: object) -> Iterator[dict]:
    """Every dict nested anywhere in ``data``."""
    if isinstance(data, dict):
        yield data
        for value in data.values():
            yield from _records(value)
    elif isinstance(data, list):
        for value in data:
            yield from _records(value)


def _is_rate(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
