"""How one setting is checked: the error type, the value kinds, coercion, and unknown keys.

The section dataclasses in ``infinity/config/sections.py`` inherit ``Section``, whose
``__post_init__`` coerces each field by its annotation (``Bytes``, ``Numel``, ``Paths``,
``Literal[...]``, ``bool``, ``int``) and then runs the section's own ``_check``. Unknown
keys are found before any section is built, all at once, each with the closest valid
key ([Note: config] in ``infinity/config/sections.py``).
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Optional, Union, get_args, get_origin, get_type_hints

from infinity.config import sizes as _sizes

ALIGNMENT = 4096
"""Direct I/O needs buffers, offsets and lengths in multiples of this many bytes."""


class ConfigError(ValueError):
    """A config that cannot be used: names the file, the key, the value and what is allowed."""

    def __init__(self, reason: str, key: str | None = None, file: str | None = None) -> None:
        self.reason, self.key, self.file = reason, key, file
        text = f"{key}: {reason}" if key else reason
        super().__init__(f"{file}: {text}" if file else text)

    def __reduce__(self):
        return (type(self), (self.reason, self.key, self.file))

    def in_file(self, file: str | os.PathLike | None) -> ConfigError:
        """The same error, said about ``file`` (unless it already names one)."""
        if file is None or self.file is not None:
            return self
        return ConfigError(self.reason, self.key, str(file))


class Kind(enum.Enum):
    """How a field's value is written in a file, beyond its Python type."""

    BYTES = "size in bytes"
    COUNT = "element count"
    PATHS = "paths"
    PATTERNS = "patterns"
    NUMA = "numa node"
    SCALE = "loss scale"


Bytes = Annotated[int, Kind.BYTES]
Numel = Annotated[int, Kind.COUNT]
Paths = Annotated[tuple[str, ...], Kind.PATHS]
Patterns = Annotated[tuple[str, ...], Kind.PATTERNS]
NumaNode = Annotated[Optional[int], Kind.NUMA]
LossScale = Annotated[Union[str, float], Kind.SCALE]


def show(value: object) -> str:
    """A value as the user wrote it (JSON spelling), short enough for one line."""
    if isinstance(value, Mapping):
        return "a table " + json.dumps(dict(value), default=str)[:60]
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def type_name(value: object) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "list", tuple: "list",
            type(None): "null"}.get(type(value), "table" if isinstance(value, Mapping) else type(value).__name__)


def coerce(key: str, hint: Any, value: object) -> object:
    """Check ``value`` against the field's annotation and return it in its stored form."""
    kind = None
    if get_origin(hint) is Annotated:
        hint, kind = get_args(hint)[0], get_args(hint)[1]
    got = f"got {show(value)} ({type_name(value)})"
    if kind in (Kind.BYTES, Kind.COUNT):
        parse = _sizes.parse_size if kind is Kind.BYTES else _sizes.parse_count
        try:
            return parse(value)
        except ValueError as exc:
            raise ConfigError(f"{show(value)} is not a valid {kind.value}: {exc}", key) from None
    if kind in (Kind.PATHS, Kind.PATTERNS):
        what = "a path or a list of paths" if kind is Kind.PATHS else "a string or a list of strings"
        if kind is Kind.PATHS:      # a pathlib.Path (pytest's tmp_path, say) is a path as much as its str
            value = os.fspath(value) if isinstance(value, os.PathLike) else value
            if isinstance(value, (list, tuple)):
                value = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in value]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) and item for item in items):
            raise ConfigError(f"expected {what} (non-empty strings), {got}", key)
        if len(set(items)) != len(items):
            raise ConfigError(f"{show(list(items))} names an entry twice", key)
        return tuple(os.path.expanduser(item) for item in items) if kind is Kind.PATHS else tuple(items)
    if kind is Kind.NUMA:
        if value is None or value == "auto":
            return None if value is None else -1
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(f"expected a NUMA node number >= 0 or \"auto\", {got}", key)
        return value
    if kind is Kind.SCALE:
        if value == "dynamic":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f'expected "dynamic" or a positive number, {got}', key)
        return float(value)
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if value not in choices or not isinstance(value, str):
            allowed = ", ".join(json.dumps(c) for c in choices)
            close = difflib.get_close_matches(str(value).lower(), choices, n=1)
            hint_text = f"; did you mean {json.dumps(close[0])}?" if close else ""
            raise ConfigError(f"{show(value)} is not allowed; expected one of {allowed}{hint_text}", key)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, {got}", key)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, {got}", key)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"expected a finite number, {got}", key)
        return float(value)
    raise TypeError(f"{key}: no coercion for annotation {hint!r}")  # a bug in infinity/config/sections.py, not in the config


class Section:
    """Shared ``__post_init__``: coerce every field by its annotation, then run ``_check``."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            value = coerce(f"{self.section}.{f.name}", hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules of the section (none by default)."""

    def _within(self, name: str, lowest: int, highest: int, why: str, unit: str = "") -> None:
        """``lowest <= value <= highest``, else an error naming the key, the bound and ``why`` it is there.

        ``unit`` ("bytes", "elements") spells the numbers as sizes ("1GiB") in the message.
        """
        value = getattr(self, name)
        if lowest <= value <= highest:
            return
        if isinstance(value, float):    # a scale, a ratio: numbers, spelled short
            raise ConfigError(f"expected a number >= {lowest:g} and <= {highest:g}, got {value:g}: {why}",
                              f"{self.section}.{name}")
        spell = {"bytes": _sizes.format_size, "elements": _sizes.format_count}.get(unit, str)
        what = {"bytes": "a size", "elements": "an element count"}.get(unit, "an integer")
        bound = f">= {spell(lowest)}" if value < lowest else f"<= {spell(highest)}"
        got = f"{value} {unit}" if unit else str(value)
        raise ConfigError(f"expected {what} {bound}, got {got}: {why}", f"{self.section}.{name}")

    def _aligned(self, name: str) -> None:
        value = getattr(self, name)
        if value <= 0 or value % ALIGNMENT:
            raise ConfigError(f"{value} bytes is not a positive multiple of {ALIGNMENT} (direct I/O alignment); "
                              f"try {max(ALIGNMENT, -(-value // ALIGNMENT) * ALIGNMENT)}", f"{self.section}.{name}")


def _suggest(sections: Sequence[type], section: str | None, key: str) -> str | None:
    """The valid full key closest to ``section.key`` (or to the section name ``key``)."""
    fields = {cls.section: [f.name for f in dataclasses.fields(cls)] for cls in sections}
    if section is None:
        close = difflib.get_close_matches(key, list(fields), n=1)
        if close:
            return close[0]
    else:
        close = difflib.get_close_matches(key, fields[section], n=1, cutoff=0.6)
        close = close or [name for name in fields[section] if len(key) >= 3 and name.startswith(key)][:1]
        if close:
            return f"{section}.{close[0]}"
    owners = [name for name, names in fields.items() if key in names and name != section]
    if owners:
        return f"{owners[0]}.{key}"
    everywhere = [f"{name}.{field}" for name, names in fields.items() for field in names]
    close = difflib.get_close_matches(key, [full.split(".")[1] for full in everywhere], n=1, cutoff=0.75)
    return next((full for full in everywhere if close and full.endswith("." + close[0])), None)


def check_keys(data: Mapping[str, Any], section_types: Sequence[type]) -> None:
    """Raise one ConfigError listing every unknown section or key, each with its closest valid key."""
    sections = {cls.section: cls for cls in section_types}
    problems: list[tuple[str, str]] = []  # (full key, what is wrong with it)
    for name, body in data.items():
        if name not in sections:
            guess = _suggest(section_types, None, name)
            where = " (settings go inside a [section])" if guess and "." in guess else ""
            problems.append((name, "unknown section" + (f"; did you mean {guess}?{where}" if guess else
                                                        f"; valid sections are {', '.join(sections)}")))
            continue
        if not isinstance(body, Mapping):
            continue  # Config.__post_init__ reports the wrong type
        valid = [f.name for f in dataclasses.fields(sections[name])]
        for key in body:
            if key not in valid:
                guess = _suggest(section_types, name, key)
                problems.append((f"{name}.{key}", "unknown key" + (f"; did you mean {guess}?" if guess else
                                                                  f"; valid keys in [{name}] are {', '.join(valid)}")))
    if problems:
        # One error for all of them: the first names its key; the others follow, one per line.
        reason = problems[0][1] + "".join(f"\n{key}: {what}" for key, what in problems[1:])
        if "zero_optimization" in data:
            reason += "\n(this looks like a DeepSpeed config: translate it with infinity.config.from_deepspeed)"
        raise ConfigError(reason, problems[0][0])
