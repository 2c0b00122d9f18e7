"""The config file: TOML or JSON, read into frozen typed dataclasses, one per section.

[Note: config]
A config has eight sections (``tiers``, ``aio``, ``precision``, ``partition``,
``prefetch``, ``tiling``, ``dpu``, ``checkpoint``). Each is a frozen dataclass whose
fields carry their defaults, the only place a default is written, and a docstring
that ``reference_markdown()`` turns into the README's reference. Validation lives in
each section's ``__post_init__``, so a section built from Python (``AioConfig(
block_size="4MiB")``) is checked and coerced exactly like one read from a file.

Every problem is a ``ConfigError`` naming the file, the full key, the value found
and what is allowed. Unknown keys are errors at every depth, with the closest valid
key suggested. Sizes in bytes accept "64MiB"-style strings, element counts accept
"32Mi" or 1e9 ([Note: size units] in ``infinity/_sizes.py``).

Examples
--------
>>> from infinity.config import load_config
>>> cfg = load_config({"tiers": {"optimizer": "nvme", "nvme_path": "/mnt/nvme"}, "aio": {"block_size": "4MiB"}})
>>> cfg.aio.block_size, cfg.tiers.nvme_path
(4194304, ('/mnt/nvme',))
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, get_args, get_origin, get_type_hints

from infinity import _sizes, _toml

__all__ = [
    "AioConfig", "CheckpointConfig", "Config", "ConfigError", "DpuConfig", "PartitionConfig",
    "PrecisionConfig", "PrefetchConfig", "TiersConfig", "TilingConfig",
    "dump", "from_deepspeed", "load_config", "preset_path", "presets", "reference_markdown",
]

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


class _Kind(enum.Enum):
    """How a field's value is written in a file, beyond its Python type."""

    BYTES = "size in bytes"
    COUNT = "element count"
    PATHS = "paths"
    PATTERNS = "patterns"
    NUMA = "numa node"


Bytes = Annotated[int, _Kind.BYTES]
Numel = Annotated[int, _Kind.COUNT]
Paths = Annotated[tuple[str, ...], _Kind.PATHS]
Patterns = Annotated[tuple[str, ...], _Kind.PATTERNS]
NumaNode = Annotated[Optional[int], _Kind.NUMA]


def _show(value: object) -> str:
    """A value as the user wrote it (JSON spelling), short enough for one line."""
    if isinstance(value, Mapping):
        return "a table " + json.dumps(dict(value), default=str)[:60]
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def _type_name(value: object) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "list", tuple: "list",
            type(None): "null"}.get(type(value), "table" if isinstance(value, Mapping) else type(value).__name__)


def _coerce(key: str, hint: Any, value: object) -> object:
    """Check ``value`` against the field's annotation and return it in its stored form."""
    kind = None
    if get_origin(hint) is Annotated:
        hint, kind = get_args(hint)[0], get_args(hint)[1]
    got = f"got {_show(value)} ({_type_name(value)})"
    if kind in (_Kind.BYTES, _Kind.COUNT):
        parse = _sizes.parse_size if kind is _Kind.BYTES else _sizes.parse_count
        try:
            return parse(value)
        except ValueError as exc:
            raise ConfigError(f"{_show(value)} is not a valid {kind.value}: {exc}", key) from None
    if kind in (_Kind.PATHS, _Kind.PATTERNS):
        what = "a path or a list of paths" if kind is _Kind.PATHS else "a string or a list of strings"
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) and item for item in items):
            raise ConfigError(f"expected {what} (non-empty strings), {got}", key)
        if len(set(items)) != len(items):
            raise ConfigError(f"{_show(list(items))} names an entry twice", key)
        return tuple(os.path.expanduser(item) for item in items) if kind is _Kind.PATHS else tuple(items)
    if kind is _Kind.NUMA:
        if value is None or value == "auto":
            return None if value is None else -1
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(f"expected a NUMA node number >= 0 or \"auto\", {got}", key)
        return value
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if value not in choices or not isinstance(value, str):
            allowed = ", ".join(json.dumps(c) for c in choices)
            close = difflib.get_close_matches(str(value).lower(), choices, n=1)
            hint_text = f"; did you mean {json.dumps(close[0])}?" if close else ""
            raise ConfigError(f"{_show(value)} is not allowed; expected one of {allowed}{hint_text}", key)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, {got}", key)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, {got}", key)
        return value
    raise TypeError(f"{key}: no coercion for annotation {hint!r}")  # a bug in this module, not in the config


class _Section:
    """Shared ``__post_init__``: coerce every field by its annotation, then run ``_check``."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            value = _coerce(f"{self.section}.{f.name}", hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules of the section (none by default)."""

    def _at_least(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if value < minimum:
            raise ConfigError(f"expected an integer >= {minimum}, got {value}", f"{self.section}.{name}")

    def _aligned(self, name: str) -> None:
        value = getattr(self, name)
        if value <= 0 or value % ALIGNMENT:
            raise ConfigError(f"{value} bytes is not a positive multiple of {ALIGNMENT} (direct I/O alignment); "
                              f"try {max(ALIGNMENT, -(-value // ALIGNMENT) * ALIGNMENT)}", f"{self.section}.{name}")


@dataclasses.dataclass(frozen=True)
class TiersConfig(_Section):
    """Where each model state lives, and the host memory that backs the tiers."""

    section: ClassVar[str] = "tiers"

    params: Literal["device", "host", "nvme"] = "device"
    """Tier holding each rank's shard of the parameters (the compute copy, in `precision.dtype`)
    between uses: "device" on the compute device, "host" in pinned host RAM, "nvme" in files under
    `nvme_path`. A whole parameter exists only while a module uses it."""

    optimizer: Literal["host", "nvme"] = "host"
    """Tier holding the fp32 master weights, Adam's m and v, and the accumulated fp32 gradients.
    The optimizer always steps on the host; with "nvme" these states stream through host buffers
    one sub-group at a time."""

    nvme_path: Paths = ()
    """Directory for swap files, or a list of directories to stripe them over; required when
    `params` or `optimizer` is "nvme". Each rank keeps its own files below it."""

    host_budget: Bytes = 0
    """Most host RAM the tiers and buffers may use, checked before training starts; 0 means no
    limit beyond the memory available."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: "cuda" (the rank's local GPU), "cpu", or "auto" (cuda when available)."""

    numa_node: NumaNode = None
    """NUMA node that host buffers are bound to: a node number, "auto" (stored as -1: the node
    nearest the GPU), or unset for no binding. Binding needs libnuma."""

    pin_memory: Literal["auto", "always", "never"] = "auto"
    """Page-lock host buffers so copies to the GPU run asynchronously: "always" (an error when
    impossible), "never", or "auto" (pin when a GPU is present)."""

    pool_buffer_size: Bytes = 64 * _sizes.MiB
    """Size of each buffer of the constant-size NVMe I/O pool, a multiple of 4 KiB; transfers that
    are not aligned for direct I/O are staged through these buffers."""

    pool_buffers: int = 8
    """Number of buffers in the NVMe I/O pool; staged NVMe I/O in flight is at most
    `pool_buffers` x `pool_buffer_size` bytes."""

    def _check(self) -> None:
        on_nvme = [name for name in ("params", "optimizer") if getattr(self, name) == "nvme"]
        if on_nvme and not self.nvme_path:
            raise ConfigError(f"required when tiers.{on_nvme[0]} is \"nvme\"; give a directory on a fast local disk",
                              "tiers.nvme_path")
        self._aligned("pool_buffer_size")
        self._at_least("pool_buffers", 1)


@dataclasses.dataclass(frozen=True)
class AioConfig(_Section):
    """How NVMe files are read and written (the `tiers._aio` extension)."""

    section: ClassVar[str] = "aio"

    block_size: Bytes = 8 * _sizes.MiB
    """Largest single read or write submitted, a multiple of 4 KiB; larger transfers are split into
    pieces of this size. `infinity-bench nvme` measures a good value."""

    queue_depth: int = 32
    """Requests kept in flight per I/O handle, at least 1."""

    threads: int = 4
    """Worker threads of the thread-pool engine, at least 1."""

    engine: Literal["auto", "io_uring", "threads"] = "auto"
    """I/O engine: "io_uring", "threads" (a pthread pool doing pread/pwrite), or "auto" (io_uring when
    the kernel allows it, else threads). `infinity-report` shows which work here."""

    direct: bool = True
    """Open swap files with O_DIRECT, bypassing the page cache. Set false on file systems that refuse
    O_DIRECT (tmpfs)."""

    def _check(self) -> None:
        self._aligned("block_size")
        self._at_least("queue_depth", 1)
        self._at_least("threads", 1)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class PrecisionConfig(_Section):
    """Number formats."""

    section: ClassVar[str] = "precision"

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the parameters' compute copy in forward and backward. Master weights, gradients and
    optimizer states are always float32."""

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype`` (imports torch on first use)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return _ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class PartitionConfig(_Section):
    """How parameters and optimizer states are cut up."""

    section: ClassVar[str] = "partition"

    persistence_threshold: Numel = 0
    """Parameters with fewer elements than this stay gathered on the compute device after first use
    instead of being released (biases, norms: saves many tiny fetches); 0 releases all."""

    sub_group_size: Numel = 32 * _sizes.MiB
    """Elements per optimizer sub-group: the flat fp32 unit the optimizer reads, steps and writes back
    in one piece. Larger means longer I/O; each sub-group in flight costs 16 bytes per element of
    host memory."""

    max_live_parameters: Numel = 0
    """Most parameter elements gathered on the compute device at once, prefetched ones included;
    0 means no limit."""

    def _check(self) -> None:
        self._at_least("sub_group_size", 1)


@dataclasses.dataclass(frozen=True)
class PrefetchConfig(_Section):
    """Trace-driven prefetching of parameters ahead of their use."""

    section: ClassVar[str] = "prefetch"

    enabled: bool = True
    """Record the order in which modules fetch parameters during the first step, and fetch ahead of
    it in later steps."""

    nvme_bytes: Bytes = 256 * _sizes.MiB
    """How far ahead, in bytes, reads of parameter shards from NVMe into host buffers run."""

    device_bytes: Bytes = 128 * _sizes.MiB
    """How far ahead, in bytes, host-to-device copies and all-gathers run."""

    reuse_distance: Bytes = 0
    """Keep a parameter gathered after use when the trace says it is needed again within this many
    bytes of fetches; 0 releases it always."""

    log_every: int = 0
    """Print a prefetch summary (stall time, hit rate) every this many steps; 0 never."""

    def _check(self) -> None:
        self._at_least("log_every", 0)


@dataclasses.dataclass(frozen=True)
class TilingConfig(_Section):
    """Memory-centric tiling: large linear layers become several smaller parameters."""

    section: ClassVar[str] = "tiling"

    enabled: bool = True
    """Replace large linear layers by tiled equivalents inside `infinity.Init`."""

    threshold: Numel = 2**30
    """Linear layers whose weight has more elements than this are tiled."""

    tiles: int = 0
    """Tiles per tiled layer; 0 picks the fewest tiles that keep each at most `max_tile_bytes`."""

    max_tile_bytes: Bytes = 256 * _sizes.MiB
    """Largest tile, in bytes, when `tiles` is 0."""

    modules: Patterns = ()
    """Tile only modules whose qualified name matches one of these fnmatch patterns (for example
    "blocks.*.mlp.*"); empty means every linear layer above `threshold`."""

    def _check(self) -> None:
        self._at_least("threshold", 1)
        self._at_least("tiles", 0)
        self._at_least("max_tile_bytes", 1)


@dataclasses.dataclass(frozen=True)
class DpuConfig(_Section):
    """Delayed parameter update: the host optimizer step overlaps the next iteration."""

    section: ClassVar[str] = "dpu"

    enabled: bool = False
    """After warm-up, run the optimizer step of iteration t on a background thread while iteration
    t+1 computes with parameters one step older. This changes the training dynamics."""

    warmup_steps: int = 5
    """Steps run with ordinary, synchronous updates before the delay starts."""

    threads: int = 0
    """CPU threads for the host optimizer step; 0 keeps torch's default."""

    def _check(self) -> None:
        self._at_least("warmup_steps", 0)
        self._at_least("threads", 0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """Saving and loading sharded checkpoints."""

    section: ClassVar[str] = "checkpoint"

    buffer_size: Bytes = 64 * _sizes.MiB
    """Buffer through which shards stream between their tiers and checkpoint files, a multiple of
    4 KiB."""

    def _check(self) -> None:
        self._aligned("buffer_size")


_SECTIONS: tuple[type[_Section], ...] = (TiersConfig, AioConfig, PrecisionConfig, PartitionConfig,
                                        PrefetchConfig, TilingConfig, DpuConfig, CheckpointConfig)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole config: one frozen dataclass per section.

    Build one with ``load_config``; change one with ``dataclasses.replace`` or
    ``load_config(cfg, overrides={...})``. A section may also be given as a mapping.

    Examples
    --------
    >>> cfg = Config(aio={"queue_depth": 8})
    >>> cfg.aio.queue_depth, cfg.tiers.params
    (8, 'device')
    """

    tiers: TiersConfig = dataclasses.field(default_factory=TiersConfig)
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    prefetch: PrefetchConfig = dataclasses.field(default_factory=PrefetchConfig)
    tiling: TilingConfig = dataclasses.field(default_factory=TilingConfig)
    dpu: DpuConfig = dataclasses.field(default_factory=DpuConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for cls in _SECTIONS:
            value = getattr(self, cls.section)
            if isinstance(value, Mapping):
                _check_keys({cls.section: value})
                object.__setattr__(self, cls.section, cls(**value))
            elif not isinstance(value, cls):
                raise ConfigError(f"expected a table of settings, got {_show(value)} ({_type_name(value)})", cls.section)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from plain data (as read from a file); every unknown key is an error."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table of sections, got {_show(data)} ({_type_name(data)})")
        _check_keys(data)
        return cls(**{name: section for name, section in data.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain, JSON-able data: sizes as integers, tuples as lists, unset values as ``None``."""
        return {
            cls.section: {f.name: (list(v) if isinstance(v := getattr(section, f.name), tuple) else v)
                          for f in dataclasses.fields(section)}
            for cls in _SECTIONS for section in (getattr(self, cls.section),)
        }


# ----------------------------------------------------------------------------------------------
# Unknown keys


def _suggest(section: str | None, key: str) -> str | None:
    """The valid full key closest to ``section.key`` (or to the section name ``key``)."""
    fields = {cls.section: [f.name for f in dataclasses.fields(cls)] for cls in _SECTIONS}
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


def _check_keys(data: Mapping[str, Any]) -> None:
    """Raise one ConfigError listing every unknown section or key, each with its closest valid key."""
    sections = {cls.section: cls for cls in _SECTIONS}
    problems: list[str] = []
    for name, body in data.items():
        if name not in sections:
            guess = _suggest(None, name)
            where = " (settings go inside a [section])" if guess and "." in guess else ""
            problems.append(f"{name}: unknown section" + (f"; did you mean {guess}?{where}" if guess else
                            f"; valid sections are {', '.join(sections)}"))
            continue
        if not isinstance(body, Mapping):
            continue  # Config.__post_init__ reports the wrong type
        valid = [f.name for f in dataclasses.fields(sections[name])]
        for key in body:
            if key not in valid:
                guess = _suggest(name, key)
                problems.append(f"{name}.{key}: unknown key" + (f"; did you mean {guess}?" if guess else
                                f"; valid keys in [{name}] are {', '.join(valid)}"))
    if problems:
        if "zero_optimization" in data:
            problems.append("(this looks like a DeepSpeed config: translate it with infinity.config.from_deepspeed)")
        first_key = problems[0].split(":", 1)[0]
        raise ConfigError("\n".join(problems)[len(first_key) + 2:], first_key)


# ----------------------------------------------------------------------------------------------
# Files


def presets() -> list[str]:
    """Names of the config files shipped in ``infinity/presets`` (usable as ``load_config(name)``)."""
    return sorted(p.stem for p in (Path(__file__).parent / "presets").glob("*.toml"))


def preset_path(name: str) -> Path:
    """Path of the shipped preset ``name`` (see ``presets()``)."""
    path = Path(__file__).parent / "presets" / f"{name}.toml"
    if not path.is_file():
        close = difflib.get_close_matches(name, presets(), n=1)
        raise ConfigError(f"no preset named {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                          + f"; presets are {', '.join(presets())}")
    return path


def _read(src: str | os.PathLike) -> tuple[str, dict]:
    """Read a .toml or .json file (or a preset name) into plain data."""
    path = Path(src)
    if not path.suffix and not path.exists() and str(src) in presets():
        path = preset_path(str(src))
    file = str(path)
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"expected a .toml or .json file (or a preset: {', '.join(presets())})", file=file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such file", file=file) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {getattr(exc, 'strerror', None) or exc}", file=file) from None
    if path.suffix == ".json":
        return file, _parse_json(text, file)
    try:
        return file, _toml.loads(text)
    except _toml.TOMLUnavailable as exc:
        raise ConfigError(str(exc), file=file) from None
    except _toml.decode_error_type() as exc:
        message = str(exc)
        # tomllib ends its messages with "(at line L, column C)"; put the place first, like JSON's.
        head, _, place = message.rpartition(" (at ")
        if head and place.startswith("line "):
            raise ConfigError(f"TOML syntax error at {place.rstrip(')')}: {head}", file=file) from None
        raise ConfigError(f"TOML syntax error: {message}", file=file) from None


def _parse_json(text: str, file: str) -> dict:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ConfigError(f"key {key!r} appears twice in one JSON object", file=file)
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}", file=file) from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object of sections at the top, got {_type_name(data)}", file=file)
    return data


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(src: str | os.PathLike | Mapping[str, Any] | Config | None = None, *,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a config from a file, a preset name, a dict or a Config, and validate it.

    Parameters
    ----------
    src
        A ``.toml`` or ``.json`` path; the name of a shipped preset (``presets()``); a mapping of
        sections; a ``Config``; or ``None`` for all defaults.
    overrides
        Sections and keys merged over ``src`` before validation, e.g.
        ``{"tiers": {"nvme_path": "/mnt/nvme"}}``.

    Raises
    ------
    ConfigError
        On a missing file, a syntax error (with its line), an unknown key (with the closest valid
        key) or a value that is not allowed (with the key, the value and what is allowed).

    Examples
    --------
    >>> load_config("nvme", overrides={"tiers": {"nvme_path": "/tmp/swap"}}).tiers.params
    'nvme'
    """
    file = None
    if isinstance(src, Config):
        if not overrides:
            return src
        data: Mapping[str, Any] = src.to_dict()
    elif src is None:
        data = {}
    elif isinstance(src, Mapping):
        data = src
    elif isinstance(src, (str, os.PathLike)):
        file, data = _read(src)
    else:
        raise ConfigError(f"expected a path, a preset name, a dict or a Config, got {type(src).__name__}")
    try:
        if overrides:
            data = _merge(data, overrides)
        return Config.from_dict(data)
    except ConfigError as exc:
        raise exc.in_file(file) from None


def _file_value(hint: Any, value: object) -> object:
    """A stored value as a person would write it in a file: "64MiB", "auto", lists."""
    kind = get_args(hint)[1] if get_origin(hint) is Annotated else None
    if kind is _Kind.BYTES:
        return _sizes.format_size(value)
    if kind is _Kind.COUNT:
        return _sizes.format_count(value)
    if kind is _Kind.NUMA and value == -1:
        return "auto"
    return list(value) if isinstance(value, tuple) else value


def _file_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    out = {}
    for cls in _SECTIONS:
        hints = get_type_hints(cls, include_extras=True)
        section = getattr(cfg, cls.section)
        out[cls.section] = {f.name: _file_value(hints[f.name], getattr(section, f.name)) for f in dataclasses.fields(cls)}
    return out


def dump(config: Config | Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write a config to ``path`` as TOML or JSON (by suffix); ``load_config(path)`` reads it back equal.

    A mapping is validated first, so only loadable files are written. The file is written under a
    temporary name and renamed, so a reader never sees half of it.

    Examples
    --------
    >>> import tempfile, os
    >>> out = dump(Config(aio={"queue_depth": 8}), os.path.join(tempfile.mkdtemp(), "io.toml"))
    >>> load_config(out).aio.queue_depth
    8
    """
    path = Path(path)
    cfg = load_config(config)
    data = _file_dict(cfg)
    if path.suffix == ".toml":
        text = "# infinity config (see README.md, \"Config reference\")\n" + _toml.dumps(data)
    elif path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        raise ConfigError("expected a .toml or .json file name to write", file=str(path))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write: {exc.strerror or exc}", file=str(path)) from None
    return path


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike) -> tuple[Config, list[str]]:
    """Translate a DeepSpeed config (dict or JSON file) into a Config.

    Reads ``zero_optimization`` (offload_param, offload_optimizer, stage3_* prefetch and
    persistence keys, sub_group_size), the top-level ``aio`` section and ``bf16``/``fp16``.

    Returns
    -------
    (Config, list[str])
        The config, and one line per DeepSpeed key that could not be translated, each starting
        with the key's full path (``"zero_optimization.reduce_bucket_size: ..."``).

    Examples
    --------
    >>> cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    ...                                "aio": {"queue_depth": 16}, "bf16": {"enabled": True}})
    >>> cfg.tiers.optimizer, cfg.aio.queue_depth, cfg.precision.dtype, skipped
    ('host', 16, 'bfloat16', [])
    """
    from infinity import _deepspeed

    return _deepspeed.translate(ds_config)


# ----------------------------------------------------------------------------------------------
# Reference


def _field_docs(cls: type) -> dict[str, str]:
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
    if kind is _Kind.BYTES:
        return 'bytes: integer or "64MiB", "1.5GB"'
    if kind is _Kind.COUNT:
        return 'elements: integer or "32Mi", "1G"'
    if kind is _Kind.PATHS:
        return "path or list of paths"
    if kind is _Kind.PATTERNS:
        return "string or list of strings"
    if kind is _Kind.NUMA:
        return 'integer >= 0 or "auto"'
    if get_origin(hint) is Literal:
        return " \\| ".join(f'"{choice}"' for choice in get_args(hint))
    return {bool: "true \\| false", int: "integer"}[hint]


def reference_markdown() -> str:
    """The config reference in Markdown, generated from the section dataclasses' docstrings.

    README.md embeds it between ``<!-- config-reference:begin -->`` and ``<!-- config-reference:end -->``;
    a test keeps the two equal.
    """
    out = []
    for cls in _SECTIONS:
        hints, docs = get_type_hints(cls, include_extras=True), _field_docs(cls)
        out += [f"### `[{cls.section}]`", "", inspect.getdoc(cls), "",
                "| key | allowed | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = _file_value(hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory())
            shown = "unset" if default is None else f"`{json.dumps(default)}`"
            meaning = docs.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{f.name}` | {_allowed(hints[f.name])} | {shown} | {meaning} |")
        out.append("")
    return "\n".join(out)
