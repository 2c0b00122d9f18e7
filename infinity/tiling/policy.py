"""The tiling policy: which layers of a model built in ``infinity.Init`` become tiled, and doing it.

See [Note: when layers are tiled] in infinity/tiling/layers.py for the rules and why tiling
happens at the context's exit; ``Init.__exit__`` calls ``apply_tiling`` just before
the engine finalizes.
"""
from __future__ import annotations

import fnmatch
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from infinity.config import TilingConfig
from infinity.errors import EngineError
from infinity.tiling.layers import COLUMNS, ROWS, tile_, tile_count
from infinity.tiling.weight import TilingError

logger = logging.getLogger("infinity")


@dataclass(frozen=True)
class TiledLayer:
    """One layer (or set of tied layers) the tiling policy converted."""

    names: tuple[str, ...]
    """Qualified names of the layers (several when tied or reused)."""

    kinds: tuple[str, ...]
    """"Linear" or "Embedding", per layer."""

    shape: tuple[int, ...]
    """Shape of the (shared) weight."""

    tiles: int
    """Number of tiles."""

    split: str
    """"rows" (out_features / vocabulary) or "columns" (embedding_dim)."""

    def describe(self) -> str:
        what = " + ".join(f"{n or '<root>'} ({k})" for n, k in zip(self.names, self.kinds))
        return f"{what} {list(self.shape)} -> {self.tiles} tiles by {self.split}"


@dataclass(frozen=True)
class TilingChoice:
    """Layers the policy chose to tile together (one, or all sharing one weight), and how."""

    modules: tuple[nn.Module, ...]
    """The ``nn.Linear``/``nn.Embedding`` instances, converted in place by ``tile_``."""

    layer: TiledLayer
    """Their names, shape, tile count and split."""


def plan_tiling(roots: Sequence[nn.Module], config: TilingConfig, dtype: torch.dtype,
                shape_of: Callable[[nn.Parameter], tuple] = lambda p: tuple(p.shape)) -> list[TilingChoice]:
    """Which layers to tile, grouped by shared weight (see [Note: when layers are tiled]).

    ``shape_of`` gives a parameter's true shape (a partitioned parameter holds an empty tensor).
    """
    if not config.enabled:
        return []
    names: dict[nn.Module, list[str]] = {}
    for root in roots:
        for qualname, m in root.named_modules(remove_duplicate=False):
            names.setdefault(m, []).append(qualname)
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in names:
        for attr, p in m.named_parameters(recurse=False, remove_duplicate=False):
            users.setdefault(id(p), []).append((m, attr))
    tileable = [m for m in names if type(m) in (nn.Linear, nn.Embedding) and m.weight.device.type != "meta"]
    _warn_unmatched(config.modules, names, tileable)
    esize = torch.empty((), dtype=dtype).element_size()
    chosen, done = [], set()
    for m in tileable:
        shape = tuple(shape_of(m.weight))
        if m in done or not _selected(math.prod(shape), names[m], config):
            continue
        members = _tie_set(m, users, names)
        done.update(members)
        rows_split = len(members) > 1 or isinstance(m, nn.Linear) or m.max_norm is not None
        dim = 0 if rows_split else 1
        tiles = tile_count(shape[dim], shape[1 - dim] * esize, config)
        if tiles < 2:
            logger.debug("infinity tiling: %s stays untiled (one tile would hold it)", names[m][0])
            continue
        layer = TiledLayer(tuple(n for x in members for n in names[x]),
                           tuple(type(x).__name__ for x in members for _ in names[x]),
                           shape, tiles, ROWS if rows_split else COLUMNS)
        chosen.append(TilingChoice(tuple(members), layer))
    return chosen


def _selected(numel: int, qualnames: list[str], config: TilingConfig) -> bool:
    if config.modules:
        return any(fnmatch.fnmatchcase(n, pat) for n in qualnames for pat in config.modules)
    return numel > config.threshold


def _tie_set(m: nn.Module, users: dict, names: dict) -> list[nn.Module]:
    """``m`` and every layer sharing its weight; a TilingError when one of them cannot be tiled with it."""
    label = repr(names[m][0] or "<root>")
    members = []
    for other, attr in users[id(m.weight)]:
        if type(other) not in (nn.Linear, nn.Embedding) or attr != "weight":
            raise TilingError(
                f"tiling: cannot tile {label} ({type(m).__name__}): its weight is "
                f"also {names[other][0] or '<root>'!r}.{attr} ({type(other).__name__}), which cannot be tiled "
                "with it (only nn.Linear/nn.Embedding weights tied to each other can); exclude the layer with "
                "tiling.modules patterns, raise tiling.threshold, or set tiling.enabled = false")
        if other not in members:
            members.append(other)
    for other in members:
        bias = getattr(other, "bias", None) if isinstance(other, nn.Linear) else None
        if bias is not None and any(u is not other for u, _ in users[id(bias)]):
            raise TilingError(
                f"tiling: cannot tile {names[other][0] or '<root>'!r} (Linear): its bias is shared with another "
                "module; exclude it with tiling.modules patterns or raise tiling.threshold")
    return members


def _warn_unmatched(patterns: Sequence[str], names: dict, tileable: list[nn.Module]) -> None:
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for m in tileable for n in names[m]):
            examples = [n for m in tileable for n in names[m]][:4]
            logger.warning("infinity tiling: pattern %r in tiling.modules matches no nn.Linear/nn.Embedding "
                           "(their names look like %s)", pat, examples or "<none in this model>")


def apply_tiling(partitioner, roots: Sequence[nn.Module]) -> list[TiledLayer]:
    """Tile the chosen layers of a model being built in ``infinity.Init`` (called at its exit).

    Each chosen layer's groups are gathered in fp32 from the master shards, the layer is
    converted in place with each tile partitioned as soon as it is cut, and the old groups
    are released (``Partitioner.finish`` then frees their shards as orphans). Every rank makes
    the same choices in the same order, so the collectives inside match.

    ``partitioner`` is the ``infinity.runtime.construction.Partitioner`` of the model.
    """
    done = []
    engine = partitioner.engine
    coordinator = engine.coordinator

    def shape_of(p: nn.Parameter) -> tuple:
        group = coordinator.group_of.get(p)
        return tuple(p.shape) if group is None else next(tuple(s.shape) for s in group.slots if s.param is p)

    for choice in plan_tiling(roots, engine.config.tiling, engine.dtype, shape_of):
        params = [p for m in choice.modules for p in m.parameters(recurse=False)]
        groups = sorted({coordinator.group_of[p] for p in params if p in coordinator.group_of},
                        key=lambda g: g.index)
        units = [partitioner.unit_of[g] for g in groups if g in partitioner.unit_of]
        if units:
            raise EngineError(f"[tiling] selects {choice.layer.describe()}, which sits inside a "
                              f"{type(units[0]).__name__} that partition.units partitions whole; tile only layers "
                              "outside the units (tiling.modules), or leave that class out of partition.units")
        for g in groups:
            partitioner.materialize(g)
        tile_(list(choice.modules), choice.layer.tiles, split=choice.layer.split,
              on_tile=partitioner.partition_module)
        for g in groups:
            coordinator.drop(g)
        logger.info("infinity tiling: %s", choice.layer.describe())
        done.append(choice.layer)
    return done
