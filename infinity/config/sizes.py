"""Byte sizes and element counts written by people: "64MiB", "1.5 GB", "32Mi", 1e9.

[Note: size units]
Byte sizes take an integer, or a number and a unit. Units with an ``i`` are powers
of 1024 (KiB, MiB, GiB, TiB); units without are powers of 1000 (KB, MB, GB, TB), as
the SI and IEC define them; ``B`` (or no unit) is bytes. A bare ``k``/``M``/``G``
is refused for bytes because people mean both 1000 and 1024 by it: the error says
which two spellings to choose from. Units are case-insensitive (there are no bits
here, so ``mb`` cannot mean megabits).

Element counts (parameters, not bytes) are ``K``/``M``/``G``/``T`` for powers of
1000 and ``Ki``/``Mi``/``Gi``/``Ti`` for powers of 1024 (``32Mi`` is 33,554,432),
and accept integral floats such as DeepSpeed's ``1e9``.

The parsers raise ``ValueError`` with the reason only; the config module adds the
key and the value, so these functions stay usable from command lines too.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_COUNT_UNITS = {
    "": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB,
}
_AMBIGUOUS = {"k": "K", "m": "M", "g": "G", "t": "T"}
_NUMBER_AND_UNIT = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

BYTE_UNITS_HELP = "an integer number of bytes or a number with B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
COUNT_UNITS_HELP = "an integer, or a number with K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024)"


def _parse(value: object, what: str, units: dict[str, int], units_help: str,
           check_unit: Callable[[str, str], None] = lambda unit, written: None) -> int:
    """The count of ``what`` (bytes, elements) that ``value`` denotes: an int, an integral float, or
    a number and one of ``units``. ``check_unit`` may refuse a unit with a better message."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected {units_help}")
    if not isinstance(value, str):
        return _number(value, what, units_help)
    amount, unit, written = _split(value, units_help)
    check_unit(unit, written)
    if unit not in units:
        raise ValueError(f"unknown unit {written!r}; expected {units_help}")
    return _whole(amount * units[unit], what)


def _split(text: str, units_help: str) -> tuple[Fraction, str, str]:
    """Return (amount, unit in lower case, unit as written)."""
    match = _NUMBER_AND_UNIT.match(text)
    if match is None:
        if text.strip().startswith("-"):
            raise ValueError("must not be negative")
        raise ValueError(f"not a number and a unit; expected {units_help}")
    return Fraction(match.group(1)), match.group(2).lower(), match.group(2)


def _whole(amount: Fraction, what: str) -> int:
    if amount.denominator != 1:
        raise ValueError(f"is not a whole number of {what} ({float(amount):g})")
    return int(amount)


def _number(value: int | float, what: str, units_help: str) -> int:
    """An int, or an integral float such as JSON's 1e9, as a non-negative int."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise ValueError(f"expected {units_help}")
    if value < 0:
        raise ValueError("must not be negative")
    return value if isinstance(value, int) else _whole(Fraction(value), what)


def parse_size(value: object) -> int:
    """Return the number of bytes that ``value`` (an int, an integral float, or "64MiB") denotes.

    Examples
    --------
    >>> parse_size("64MiB"), parse_size("1.5 GB"), parse_size(4096)
    (67108864, 1500000000, 4096)
    """
    return _parse(value, "bytes", _BYTE_UNITS, BYTE_UNITS_HELP, _refuse_count_units)


def _refuse_count_units(unit: str, written: str) -> None:
    if unit in _AMBIGUOUS:
        letter = _AMBIGUOUS[unit]
        raise ValueError(f"unit {written!r} is ambiguous for bytes; write {letter}iB (powers of 1024) or {letter}B (powers of 1000)")
    if unit in ("ki", "mi", "gi", "ti"):
        raise ValueError(f"unit {written!r} counts elements; for bytes write {unit[0].upper()}iB")


def parse_count(value: object) -> int:
    """Return the element count that ``value`` (an int, an integral float, or "32Mi") denotes.

    Examples
    --------
    >>> parse_count("32Mi"), parse_count(1e9), parse_count("1.5K")
    (33554432, 1000000000, 1500)
    """
    return _parse(value, "elements", _COUNT_UNITS, COUNT_UNITS_HELP)


def format_size(nbytes: int) -> str | int:
    """Exact spelling for config files: "64MiB" when a whole number of a binary unit, else the int."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return nbytes


def format_count(numel: int) -> str | int:
    """Exact spelling for config files: "32Mi" when a whole number of a binary unit, else the int."""
    for name, unit in (("Ti", TiB), ("Gi", GiB), ("Mi", MiB), ("Ki", KiB)):
        if numel and numel % unit == 0:
            return f"{numel // unit}{name}"
    return numel


def human_size(nbytes: float) -> str:
    """Rounded spelling for people: "38.2 GiB"."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.1f} {name}"
    return f"{int(nbytes)} B"
