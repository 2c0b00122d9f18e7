"""Reading, writing and documenting a config: files, presets and dicts in, ``Config`` out.

Reads TOML or JSON through ``infinity.config.text`` and builds the sections of
``infinity.config.sections``; touches nothing outside this package.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from infinity.config import text
from infinity.config.sections import SECTIONS, Config
from infinity.config.values import ConfigError


def load_config(src: str | os.PathLike | Mapping[str, Any] | Config | None = None, *,
                nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a config from a file, a preset name, a dict or a Config, and validate it.

    Parameters
    ----------
    src
        A ``.toml`` or ``.json`` path; the name of a shipped preset (``presets()``); a mapping of
        sections; a ``Config``; or ``None`` for all defaults.
    nvme_path
        The directory (or a list of directories, to stripe over several disks) for the NVMe tier's
        swap files: ``tiers.nvme_path``, given beside the preset that needs it
        (``load_config("nvme", nvme_path="/mnt/nvme")``) instead of through ``overrides``. It
        replaces the file's value, such as the ``nvme`` preset's placeholder.
    overrides
        Sections and keys merged over ``src`` before validation, e.g.
        ``{"prefetch": {"nvme_bytes": "1GiB"}}``.

    Raises
    ------
    ConfigError
        On a missing file, a syntax error (with its line), an unknown key (with the closest valid
        key) or a value that is not allowed (with the key, the value and what is allowed).

    Examples
    --------
    >>> load_config("nvme", nvme_path="/tmp/swap").tiers.nvme_path
    ('/tmp/swap',)
    >>> load_config("nvme", overrides={"tiers": {"nvme_path": "/tmp/swap"}}).tiers.params
    'nvme'
    """
    if nvme_path is not None:
        if overrides and _sets(overrides, "tiers.nvme_path"):
            raise ConfigError("given twice, as nvme_path= and in overrides; give it once", "tiers.nvme_path")
        overrides = text.merge(overrides or {}, {"tiers": {"nvme_path": nvme_path}})
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
        file, data = text.read(src)
    else:
        raise ConfigError(f"expected a path, a preset name, a dict or a Config, got {type(src).__name__}")
    try:
        if overrides:
            data = text.merge(data, overrides)
        return Config.from_dict(data)
    except ConfigError as exc:
        if nvme_path is not None and exc.key == "tiers.nvme_path":
            raise exc.in_file("the nvme_path argument") from None
        if overrides and _sets(overrides, exc.key):     # the override's value, not the file's
            raise exc.in_file("overrides") from None
        raise exc.in_file(file if file is None or not overrides else f"{file} (with overrides)") from None


def parse_overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["prefetch.enabled=false", "tiers.nvme_path=/mnt/nvme"]`` -> ``overrides`` for ``load_config``.

    What a command line's ``--set SECTION.KEY=VALUE`` means: each value is read as JSON when it
    parses (``false``, ``8``, ``["/a", "/b"]``), else as the string written (``512MiB``,
    ``/mnt/nvme``); a later setting of the same key wins. Whether the key exists and the value
    fits it is ``load_config``'s to say, naming the key.

    Raises
    ------
    ConfigError
        On an item that is not ``SECTION.KEY=VALUE``, naming the item.

    Examples
    --------
    >>> parse_overrides(["prefetch.enabled=false", "prefetch.nvme_bytes=1GiB"])
    {'prefetch': {'enabled': False, 'nvme_bytes': '1GiB'}}
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name.strip():
            raise ConfigError(f"{item!r}: expected section.key=value, e.g. prefetch.enabled=false")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(section, {})[name.strip()] = value
    return out


def _sets(overrides: Mapping[str, Any], key: str | None) -> bool:
    """Whether ``overrides`` holds ``key`` ("section.key")."""
    if not key:
        return False
    node: Any = overrides
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


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
    return text.write(text.file_dict(load_config(config), SECTIONS), Path(path))


def reference_markdown() -> str:
    """The config reference in Markdown, generated from the section dataclasses' docstrings.

    docs/reference/config.md embeds it between ``<!-- config-reference:begin -->`` and
    ``<!-- config-reference:end -->`` (written by ``python docs/generate.py``); a test keeps the two equal.
    """
    return text.reference_markdown(SECTIONS)
