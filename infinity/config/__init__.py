"""The config: one file (TOML or JSON) read into frozen, typed sections.

What the room holds: the section dataclasses (``sections``), how one value is checked
(``values``, ``sizes``), files and presets as text (``text``, ``toml_io``, ``presets/``),
loading and writing (``load``), and the translation of a DeepSpeed config
(``deepspeed``). What it may touch: nothing else in infinity, and no tier: every
other room reads a ``Config``, this one reads only files. See [Note: config] in
``infinity/config/sections.py``.

Examples
--------
>>> from infinity.config import load_config
>>> cfg = load_config({"tiers": {"optimizer": "nvme", "nvme_path": "/mnt/nvme"}, "aio": {"block_size": "4MiB"}})
>>> cfg.aio.block_size, cfg.tiers.nvme_path
(4194304, ('/mnt/nvme',))
"""
from __future__ import annotations

from infinity.config.deepspeed import from_deepspeed
from infinity.config.load import dump, load_config, parse_overrides, reference_markdown
from infinity.config.sections import (SECTIONS, AioConfig, CheckpointConfig, Config, DpuConfig, OptimizerConfig,
                                      PartitionConfig, PrecisionConfig, PrefetchConfig, TiersConfig, TilingConfig)
from infinity.config.text import preset_path, presets
from infinity.config.values import ALIGNMENT, ConfigError

__all__ = [
    "ALIGNMENT", "SECTIONS", "AioConfig", "CheckpointConfig", "Config", "ConfigError", "DpuConfig", "OptimizerConfig",
    "PartitionConfig", "PrecisionConfig", "PrefetchConfig", "TiersConfig", "TilingConfig",
    "dump", "from_deepspeed", "load_config", "parse_overrides", "preset_path", "presets", "reference_markdown",
]
