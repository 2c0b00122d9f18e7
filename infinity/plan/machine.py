"""What a step is predicted on: one machine's measured rates and room (``MachineProfile``) and the work one
rank does per step (``Workload``).

[Note: machine profiles]
A profile is one machine, as data: the memory of each device, host and NVMe tier, and the rates the
step-time model divides bytes and FLOPs by. Rates are measured, not read from spec sheets: a pinned
copy each way, a host AdamW pass, a matmul, ``infinity-bench nvme --json`` for the disks
(``infinity.plan.probes`` measures and caches them per machine); tests and ``infinity-plan`` take one
given as data (a TOML or JSON table of these fields), so nothing is probed there. Host memory, host
bandwidth, the host AdamW rate and the disks belong to the machine and are shared by its ``ranks``;
device memory, FLOP/s and the copy links are per device. With the CPU as compute device
(``unified``) the "device" is host memory: device and host bytes are checked together against
``host_bytes``.

Units: bytes for memory, FLOP/s, elements per second, decimal GB/s (1e9 bytes) for bandwidths, as
``infinity-bench`` reports them.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from infinity.plan.errors import PlanError
from infinity.plan.units import parse_count


@dataclass(frozen=True)
class MachineProfile:
    """One machine's room and rates (see [Note: machine profiles]).

    Examples
    --------
    >>> p = MachineProfile(name="1x80GB", device_bytes=80e9, host_bytes=128 * 2**30, nvme_bytes=4e12)
    >>> p.ranks, p.unified
    (1, False)
    """

    name: str
    """What the profile describes (a hostname, "1x80GB", ...)."""

    device_bytes: float
    """Memory of one compute device, bytes (with ``unified``: ignored, the device is host memory)."""

    host_bytes: float
    """Host memory the tiers may use on this machine, bytes, for all its ranks together."""

    nvme_bytes: float = 0.0
    """Room on the NVMe paths, bytes, for all ranks (0: no NVMe tier)."""

    ranks: int = 1
    """Ranks (devices) on this machine; they share host memory, host bandwidth and the disks."""

    device_flops: float = 400e12
    """FLOP/s one device achieves on the model's matmuls in the compute dtype."""

    device_update_params_per_s: float = 20e9
    """Parameter elements per second AdamW steps on the device (states in device memory)."""

    host_memory_gbps: float = 100.0
    """Host memory bandwidth of the machine, GB/s (what the host update's bytes divide by)."""

    host_adam_params_per_s: float = 2e9
    """Parameter elements per second the host AdamW pass steps, measured on the machine."""

    h2d_gbps: float = 25.0
    """Pinned host-to-device copy bandwidth of one device, GB/s."""

    d2h_gbps: float = 25.0
    """Pinned device-to-host copy bandwidth of one device, GB/s."""

    disk_read_gbps: float = 0.0
    """NVMe read bandwidth of the machine, GB/s (0: no disk)."""

    disk_write_gbps: float = 0.0
    """NVMe write bandwidth of the machine, GB/s (0: no disk)."""

    interconnect_gbps: float = 0.0
    """What one rank sends per second through collectives (all-gather, reduce-scatter), GB/s; 0 leaves
    collectives out of the step."""

    unified: bool = False
    """The compute device is the CPU: device memory is host memory."""

    source: str = "given"
    """Where the figures came from (a file, a probe, a test table)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(value, str):
                    raise PlanError(f"profile {f.name} must be a string, got {value!r}")
            elif f.name == "unified":
                if not isinstance(value, bool):
                    raise PlanError(f"profile unified must be true or false, got {value!r}")
            elif f.name == "ranks":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise PlanError(f"profile ranks must be a positive integer, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise PlanError(f"profile {f.name} must be a finite number >= 0, got {value!r}")
        for name in ("device_flops", "host_memory_gbps", "host_adam_params_per_s", "h2d_gbps", "d2h_gbps",
                     "device_update_params_per_s"):
            if getattr(self, name) <= 0:
                raise PlanError(f"profile {self.name!r}: {name} must be positive, got {getattr(self, name)!r}")
        if self.nvme_bytes > 0 and (self.disk_read_gbps <= 0 or self.disk_write_gbps <= 0):
            raise PlanError(f"profile {self.name!r} has {self.nvme_bytes:.3g} bytes of NVMe room but no disk "
                            "bandwidth: give disk_read_gbps and disk_write_gbps (infinity-bench nvme --json)")

    @property
    def has_nvme(self) -> bool:
        return self.nvme_bytes > 0

    def to_dict(self) -> dict[str, object]:
        """Plain, JSON-able form; ``from_dict`` reads it back equal."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str | None = None) -> "MachineProfile":
        """A profile from plain data; sizes may be written "128GiB"-style or as numbers. Unknown keys are errors."""
        from infinity.config.sizes import parse_size

        if not isinstance(data, dict):
            raise PlanError(f"a machine profile must be a table, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(f"machine profile: unknown keys {unknown}; allowed: {sorted(names)}")
        values = dict(data)
        for key in ("device_bytes", "host_bytes", "nvme_bytes"):
            if isinstance(values.get(key), str):
                try:
                    values[key] = parse_size(values[key])
                except ValueError as exc:
                    raise PlanError(f"machine profile {key}: {exc}") from None
        if source is not None:
            values.setdefault("source", source)
        values.setdefault("name", source or "given")
        try:
            return cls(**values)
        except TypeError as exc:
            raise PlanError(f"machine profile: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "MachineProfile":
        """A profile from a JSON or TOML file (one table of the fields above)."""
        path = Path(path)
        try:
            raw = path.read_text()
        except OSError as exc:
            raise PlanError(f"cannot read machine profile {path}: {exc.strerror or exc}") from exc
        try:
            if path.suffix == ".toml":
                import tomllib

                data = tomllib.loads(raw)
            else:
                data = json.loads(raw)
        except ValueError as exc:
            raise PlanError(f"machine profile {path} does not parse: {exc}") from exc
        return cls.from_dict(data, source=str(path))


@dataclass(frozen=True)
class Workload:
    """What one rank computes per step, for the compute term of the step-time model.

    Examples
    --------
    >>> Workload(tokens=16384).recompute
    False
    """

    tokens: int = 16384
    """Tokens one rank processes per step (micro-batch x sequence; one micro-batch per step)."""

    activation_bytes: int = 0
    """Device bytes activations take at their peak (``activations.checkpoint_nbytes``, or
    ``infinity.stats(model)["activations"]["checkpoint_nbytes"]`` after a step): device memory the placement
    cannot use."""

    activation_share: float = 0.0
    """Where ``activation_bytes`` is 0: the share of a separate device's memory (a GPU's; not a CPU "device",
    which is host memory) kept for activations all the same, which are not known before a step (see [Note:
    activations before the first step] in infinity/plan/placement.py)."""

    recompute: bool = False
    """Activation checkpointing: backward runs the forward again (2 x params x tokens more FLOPs)."""

    compute_s: float = 0.0
    """Seconds of one step's forward and backward compute, measured (a plain PyTorch step of the model, or
    the engine's first step); 0 derives it from FLOPs: 6 x params x tokens / ``device_flops`` (8 with
    ``recompute``). Measured, a third of it is the forward (a quarter with ``recompute``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", parse_count(self.tokens, "tokens"))
        if isinstance(self.compute_s, bool) or not isinstance(self.compute_s, (int, float)) or not \
                self.compute_s >= 0 or self.compute_s == float("inf"):
            raise PlanError(f"compute_s must be a finite number of seconds >= 0, got {self.compute_s!r}")
        if isinstance(self.activation_bytes, bool) or not isinstance(self.activation_bytes, int) \
                or self.activation_bytes < 0:
            raise PlanError(f"activation_bytes must be a whole number of bytes >= 0, got {self.activation_bytes!r}")
        if isinstance(self.activation_share, bool) or not isinstance(self.activation_share, (int, float)) \
                or not 0 <= self.activation_share < 1:
            raise PlanError(f"activation_share must be a share of device memory in [0, 1), got "
                            f"{self.activation_share!r}")
        if not isinstance(self.recompute, bool):
            raise PlanError(f"recompute must be true or false, got {self.recompute!r}")


__all__ = ["MachineProfile", "Workload"]
