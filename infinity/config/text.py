"""A config as text: reading files and presets, writing them, and the Markdown reference.

Nothing here knows the sections by name; ``infinity/config/sections.py`` passes them in.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from infinity.config import sizes as _sizes, toml_io as _toml
from infinity.config.values import ConfigError, Kind, type_name
from tiers import newfile


def presets() -> list[str]:
    """Names of the config files shipped in ``infinity/config/presets`` (usable as ``load_config(name)``)."""
    return sorted(p.stem for p in (Path(__file__).parent / "presets").glob("*.toml"))


def preset_path(name: str) -> Path:
    """Path of the shipped preset ``name`` (see ``presets()``)."""
    path = Path(__file__).parent / "presets" / f"{name}.toml"
    if not path.is_file():
        close = difflib.get_close_matches(name, presets(), n=1)
        raise ConfigError(f"no preset named {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                          + f"; presets are {', '.join(presets())}")
    return path


def read(src: str | os.PathLike) -> tuple[str, dict]:
    """Read a .toml or .json file (or a preset name) into plain data."""
    path = Path(src)
    if not path.suffix and not path.is_file() and os.sep not in str(src):
        # A name without a suffix: a preset, or a misspelt one (said so); a directory of that name in the
        # working directory (the swap files' "nvme", say) is no config file and does not hide the preset.
        path = preset_path(str(src))
    file = str(path)
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"expected a .toml or .json file (or a preset: {', '.join(presets())})", file=file)
    text = _read_text(path, file)
    if path.suffix == ".json":
        return file, parse_json(text, file)
    try:
        return file, _toml.loads(text)
    except RecursionError:
        raise ConfigError("nested too deeply to be a config (sections hold values, not tables of tables)",
                          file=file) from None
    except _toml.TOMLUnavailable as exc:
        raise ConfigError(str(exc), file=file) from None
    except _toml.decode_error_type() as exc:
        message = str(exc)
        # tomllib ends its messages with "(at line L, column C)"; put the place first, like JSON's.
        head, _, place = message.rpartition(" (at ")
        if head and place.startswith("line "):
            raise ConfigError(f"TOML syntax error at {place.rstrip(')')}: {head}", file=file) from None
        raise ConfigError(f"TOML syntax error: {message}", file=file) from None


MAX_CONFIG_NBYTES = 1 << 20     # a config is a few KiB; more is not one (``/dev/zero``, a log given by mistake)


def _read_text(path: Path, file: str) -> str:
    """The file's text: a regular file (a FIFO would block, a device never end) of at most MAX_CONFIG_NBYTES."""
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError("cannot read: not a regular file (a FIFO, a device or a directory): a config is read from a "
                                  "file", file=file)
            data = f.read(MAX_CONFIG_NBYTES + 1)
    except FileNotFoundError:
        raise ConfigError("no such file", file=file) from None
    except IsADirectoryError:
        raise ConfigError("cannot read: not a regular file (a directory): a config is read from a file", file=file) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=file) from None
    if len(data) > MAX_CONFIG_NBYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_NBYTES // 1024} KiB: not a config file", file=file)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})", file=file) from None


def parse_json(text: str, file: str) -> dict:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ConfigError(f"key {key!r} appears twice in one JSON object", file=file)
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except RecursionError:
        raise ConfigError("nested too deeply to be a config (sections hold values, not objects of objects)",
                          file=file) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}", file=file) from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object of sections at the top, got {type_name(data)}", file=file)
    return data


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def file_value(hint: Any, value: object) -> object:
    """A stored value as a person would write it in a file: "64MiB", "auto", lists."""
    kind = get_args(hint)[1] if get_origin(hint) is Annotated else None
    if kind is Kind.BYTES:
        return _sizes.format_size(value)
    if kind is Kind.COUNT:
        return _sizes.format_count(value)
    if kind is Kind.NUMA and value == -1:
        return "auto"
    return list(value) if isinstance(value, tuple) else value


def file_dict(cfg: object, sections: Sequence[type]) -> dict[str, dict[str, Any]]:
    out = {}
    for cls in sections:
        hints = get_type_hints(cls, include_extras=True)
        section = getattr(cfg, cls.section)
        out[cls.section] = {f.name: file_value(hints[f.name], getattr(section, f.name)) for f in dataclasses.fields(cls)}
    return out


def write(data: Mapping[str, Any], path: Path) -> Path:
    """Write plain config data as TOML or JSON by ``path``'s suffix, under a temporary name then renamed."""
    if path.suffix == ".toml":
        text = "# infinity config (every key: docs/reference/config.md)\n" + _toml.dumps(data)
    elif path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        raise ConfigError("expected a .toml or .json file name to write", file=str(path))
    tmp = None      # a random name written through its descriptor: [Note: temporary names on a shared disk]
    try:
        fd, tmp = newfile.create(str(path.parent), prefix=f".{path.name}.tmp-")
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"cannot write: {exc.strerror or exc}", file=str(path)) from None
    return path


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (Python keeps none at run time, so read the source)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _allowed(hint: Any) -> str:
    kind = get_args(hint)[1] if get_origin(hint) is Annotated else None
    if kind is Kind.BYTES:
        return 'bytes: integer or "64MiB", "1.5GB"'
    if kind is Kind.COUNT:
        return 'elements: integer or "32Mi", "1G"'
    if kind is Kind.PATHS:
        return "path or list of paths"
    if kind is Kind.PATTERNS:
        return "string or list of strings"
    if kind is Kind.NUMA:
        return 'integer >= 0 or "auto"'
    if kind is Kind.SCALE:
        return '"dynamic" or a number > 0'
    if get_origin(hint) is Literal:
        return " \\| ".join(f'"{choice}"' for choice in get_args(hint))
    return {bool: "true \\| false", int: "integer", float: "number"}[hint]


def reference_markdown(sections: Sequence[type]) -> str:
    """The config reference in Markdown, generated from the docstrings of ``sections``.

    See ``infinity.config.reference_markdown``.
    """
    out = []
    for cls in sections:
        hints, docs = get_type_hints(cls, include_extras=True), field_docs(cls)
        out += [f"### `[{cls.section}]`", "", inspect.getdoc(cls), "",
                "| key | allowed | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = file_value(hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory())
            shown = "unset" if default is None else f"`{json.dumps(default)}`"
            meaning = docs.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{f.name}` | {_allowed(hints[f.name])} | {shown} | {meaning} |")
        out.append("")
    return "\n".join(out)
