"""Counts and sizes as people type them, and as tables print them.

[Note: GB and GiB]
The ZeRO paper counts memory in decimal gigabytes (1 GB = 1e9 bytes: 7.5B parameters x 16 bytes
= 120 GB), so the ``table`` command prints GB. Budgets on a real machine are binary
(``free``, ``nvidia-smi``, ``psutil`` all count in powers of two), so a model plan prints GiB.
Every printed header says which one it is.
"""
from __future__ import annotations

import math
import re

from infinity.plan.errors import PlanError

GB = 10**9
GIB = 1 << 30

# Suffixes people use for parameter counts ("1.3B", "175B", "1T").
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", re.IGNORECASE)


def parse_count(value: object, what: str) -> int:
    """Read a positive whole count such as ``7.5e9``, ``"128e9"``, ``"1.3B"`` or ``4096``.

    Parameters
    ----------
    value : int, float or str
        The count. Floats and strings must denote a whole number.
    what : str
        What the count is (``"--params"``, ``"num_params"``), for the error message.

    Returns
    -------
    int
        The count, at least 1.

    Raises
    ------
    PlanError
        When the value is not a number, not whole, zero or negative.

    Examples
    --------
    >>> parse_count("7.5e9", "num_params")
    7500000000
    """
    if isinstance(value, bool):
        raise PlanError(f"{what} must be a positive whole number, got {value!r}")
    if isinstance(value, int):
        number: float | int = value
    elif isinstance(value, float):
        number = value
    elif isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("-"):
            raise PlanError(f"{what} must be positive, got {value!r}")
        match = _COUNT_RE.fullmatch(stripped)
        if match is None:
            raise PlanError(
                f"{what} must be a positive whole number such as 7.5e9 or 1.3B, got {value!r}"
            )
        number = float(match.group(1)) * _COUNT_SUFFIX[match.group(2).lower()]
    else:
        raise PlanError(f"{what} must be a positive whole number, got {type(value).__name__}")
    if isinstance(number, float):
        if not math.isfinite(number) or number != math.floor(number):
            raise PlanError(f"{what} must be a whole number, got {value!r}")
        number = int(number)
    if number <= 0:
        raise PlanError(f"{what} must be positive, got {value!r}")
    return number


def parse_positive_int(value: object, what: str) -> int:
    """Read a positive ``int`` (a rank count, bytes per element); anything else is a PlanError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    if value <= 0:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    return value


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def format_gib(nbytes: int) -> str:
    """Bytes as GiB with three decimals (the unit is said by the table's header)."""
    return f"{nbytes / GIB:.3f}"


def format_gb(nbytes: float) -> str:
    """Bytes as decimal GB, with enough digits to compare with the ZeRO paper's Table 1."""
    value = nbytes / GB
    if value >= 100:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_count(count: int) -> str:
    """A parameter count exactly and rounded: ``1,300,000,000 (1.30 B)``, ``68,000 (0.07 M)``."""
    if count >= 10**9:
        return f"{count:,} ({count / 1e9:.2f} B)"
    return f"{count:,} ({count / 1e6:.2f} M)"
