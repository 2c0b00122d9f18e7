"""Reading and writing TOML: ``tomllib`` reads (``tomli`` on Python 3.10); a tiny writer writes.

The writer covers what a config holds: nested tables of strings, integers, floats,
booleans and arrays of those. ``None`` has no TOML spelling, so such keys are left
out (the reader then falls back to the default, which is what ``None`` means here).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

try:  # Python >= 3.11
    import tomllib as _toml_reader
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml_reader
    except ModuleNotFoundError:
        _toml_reader = None

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class TOMLUnavailable(RuntimeError):
    """Python < 3.11 without the ``tomli`` package: TOML files cannot be read."""


def loads(text: str) -> dict:
    """Parse TOML text; raises the reader's ``TOMLDecodeError`` on a syntax error."""
    if _toml_reader is None:
        raise TOMLUnavailable("reading TOML on Python 3.10 needs the 'tomli' package: pip install tomli (or use a .json config)")
    return _toml_reader.loads(text)


def decode_error_type() -> type[Exception]:
    """The syntax-error class of the TOML reader in use (a ``ValueError`` subclass)."""
    return ValueError if _toml_reader is None else _toml_reader.TOMLDecodeError


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else json.dumps(name, ensure_ascii=False)


def _value(value: object, where: str) -> str:
    # JSON's string escapes (\" \\ \n \uXXXX ...) are all valid in TOML basic strings.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item, where) for item in value) + "]"
    raise TypeError(f"{where}: cannot write {type(value).__name__} value {value!r} as TOML")


def dumps(data: Mapping[str, object]) -> str:
    """TOML text for ``data``: scalars first, then one ``[table]`` per nested mapping.

    Examples
    --------
    >>> print(dumps({"aio": {"queue_depth": 32, "engine": "auto"}}), end="")
    [aio]
    queue_depth = 32
    engine = "auto"
    """
    lines: list[str] = []
    _write_table(data, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(table: Mapping[str, object], path: tuple[str, ...], lines: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if v is not None and not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if path and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in scalars:
        lines.append(f"{_key(key)} = {_value(value, '.'.join((*path, key)))}")
    for key, value in tables:
        _write_table(value, (*path, key), lines)
