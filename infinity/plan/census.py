"""The model's parameter census: which partition groups exist and how many elements each holds.

[Note: partition groups]
The engine partitions a model one module at a time: each module's *direct* parameters (not its
children's) are flattened into one group, padded, and split over the ranks (shared/DESIGN.md,
"Init"; ``infinity/param_group.py``). Trainable and frozen parameters of one module go into two
separate groups, as the engine forms them. A linear layer above ``tiling.threshold`` elements is first split into tiles, each its
own group, so the working memory is one tile. The census records exactly those groups and the
element count of every parameter in them; it does not allocate anything, so it works on models
built on the meta device.

[Note: tiles in the census]
A tiled linear layer's weight (out_features x in_features) is split by output rows into k
tiles as ``torch.tensor_split`` would (the first ``out % k`` tiles get one row more); the bias,
if any, stays in the layer's own group. k is ``tiling.tiles`` when set, else the fewest tiles
whose compute-dtype bytes are at most ``tiling.max_tile_bytes`` (capped at one row per tile).
Only ``torch.nn.Linear`` modules (and subclasses) are tiled, and when ``tiling.modules`` lists
patterns, only those whose qualified name matches one (``fnmatch``).
"""
from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from infinity.plan.errors import PlanError
from infinity.plan.units import parse_count

ROOT_NAME = "<root>"


@dataclass(frozen=True)
class CensusGroup:
    """One partition unit: a module's direct parameters, or one tile of a tiled layer.

    Attributes
    ----------
    name : str
        Qualified module name (``<root>`` for the top module), with ``[tile i/k]`` for a tile.
    param_numels : tuple of int
        Element count of each parameter in the group, in module order.
    trainable : bool
        Whether the group's parameters require grad: a trainable group's Adam moments and gradient
        accumulator are held, its gradient shard leaves the device, the update streams and rewrites it.
        A module's frozen parameters are a group apart from its trainable ones, as the engine splits
        them when ``infinity.Init`` exits ([Note: frozen inside a group] in
        infinity/runtime/construction.py); a frozen group holds its master only ([Note: dormant
        sub-groups] in infinity/optim/flat_state.py).
    uses : int
        How many modules hold the group's parameters (2 for a weight tied between an
        embedding and an output head): each gathers it in forward.
    """

    name: str
    param_numels: tuple[int, ...]
    trainable: bool = True
    uses: int = 1

    def __post_init__(self) -> None:
        if not self.param_numels or any(n <= 0 for n in self.param_numels):
            raise PlanError(
                f"group {self.name!r} must hold parameters of positive size, "
                f"got element counts {list(self.param_numels)}"
            )

    @property
    def numel(self) -> int:
        """Elements in the group before padding."""
        return sum(self.param_numels)


@dataclass(frozen=True)
class ModelCensus:
    """Every partition group of a model, as the engine would form them.

    Attributes
    ----------
    source : str
        What the census was taken of (a callable spec, a class name, a parameter count).
    groups : tuple of CensusGroup
        The groups, in module order.
    structured : bool
        False when only a parameter count was given: then there is one group, and the
        largest working set is not known.
    widened_numel : int
        Elements of the largest weight a linear layer multiplies with (``nn.Linear``'s forward, or
        one tile of a tiled layer): with ``[precision] cpu_linear = "float32"`` the compute thread
        keeps two fp32 buffers of that size ([Note: widened linear layers] in
        infinity/tiling/widened.py). 0 when unknown or there is none.
    """

    source: str
    groups: tuple[CensusGroup, ...]
    structured: bool = True
    widened_numel: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise PlanError(f"model {self.source!r} has no parameters to plan for")

    @property
    def num_params(self) -> int:
        """Total parameter elements (unpadded)."""
        return sum(group.numel for group in self.groups)

    @classmethod
    def from_num_params(cls, num_params: int | float | str) -> "ModelCensus":
        """A census of a bare parameter count: one flat group, structure unknown."""
        count = parse_count(num_params, "num_params")
        return cls(
            source=f"{count:,} parameters",
            groups=(CensusGroup(name="<all parameters>", param_numels=(count,)),),
            structured=False,
        )


def load_model(spec: str) -> nn.Module:
    """Build the model named by ``"package.module:callable"`` on the meta device.

    The callable is called with no arguments inside ``torch.device("meta")``, so parameters
    get shapes but no storage: a trillion-parameter model costs nothing to inspect.

    Parameters
    ----------
    spec : str
        ``module.path:attribute`` where the attribute may be dotted (``pkg.models:GPT.small``).

    Returns
    -------
    torch.nn.Module

    Raises
    ------
    PlanError
        When the spec is malformed, the module cannot be imported (the error names the module
        and the import error), the attribute is missing, the call fails or returns something
        that is not an ``nn.Module``.

    Examples
    --------
    >>> model = load_model("torch.nn:Identity")
    >>> type(model).__name__
    'Identity'
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise PlanError(f"model must look like 'package.module:callable', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is a bad --model
        raise PlanError(
            f"cannot import module {module_name!r} for model {spec!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: object = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PlanError(
                f"module {module_name!r} has no attribute {attr_path!r} (model {spec!r})"
            ) from None
    if not callable(target):
        raise PlanError(f"{spec!r} is not callable (a {type(target).__name__})")
    try:
        with torch.device("meta"):
            model = target()
    except Exception as exc:  # the user's builder failed: say where and why
        raise PlanError(
            f"building model {spec!r} on the meta device failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise PlanError(f"{spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def census_of_module(
    model: nn.Module,
    *,
    tiling_enabled: bool = False,
    tiling_threshold: int = 2**30,
    tiles: int = 0,
    max_tile_bytes: int = 256 << 20,
    tiling_modules: Sequence[str] = (),
    param_bytes: int = 4,
    source: str | None = None,
    units: Sequence[str] = (),
) -> ModelCensus:
    """The partition groups of ``model`` (see [Note: partition groups]).

    A parameter shared by several modules (tied weights) is counted once, in the first module
    that holds it, as ``named_parameters`` does.

    Parameters
    ----------
    model : torch.nn.Module
        Any module; meta-device parameters are fine.
    tiling_enabled, tiling_threshold, tiles, max_tile_bytes, tiling_modules
        The ``[tiling]`` config section (see [Note: tiles in the census]).
    param_bytes : int
        Bytes per element of the compute copy, used to derive the tile count.
    source : str, optional
        How to name the model in reports (default: its class name).
    units : sequence of str
        ``partition.units``: modules of these classes are one group of every parameter under them
        (``"auto"``: the model's ``_no_split_modules``), as the engine forms them ([Note: units] in
        infinity/runtime/construction.py).

    Returns
    -------
    ModelCensus
    """
    seen: set[int] = set()
    groups: list[CensusGroup] = []
    holders: dict[int, int] = {}
    for module in model.modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    patterns = unit_patterns(units, model)
    covered: set[int] = set()      # modules inside a unit: the unit's group holds their parameters
    tiled: dict[int, int] = {}      # id(module) -> its largest tile's elements
    for name, module in model.named_modules():
        qualified = name or ROOT_NAME
        if id(module) in covered:
            continue
        if is_unit(module, patterns):
            covered.update(id(m) for m in module.modules())
            whole = [p for p in module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in whole)
            groups.extend(_split_by_trainable(qualified, whole, holders))
            continue
        direct = []
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            direct.append(param)
        if not direct:
            continue
        tile_count = 0
        # A tied weight already counted elsewhere is not this module's to tile.
        owns_weight = any(p is getattr(module, "weight", None) for p in direct)
        if (
            tiling_enabled
            and owns_weight
            and _is_tiled(name, module, tiling_threshold, tiling_modules)
        ):
            tile_count = _tile_count(qualified, module.weight, tiles, max_tile_bytes, param_bytes)
        if tile_count > 1:
            tiled[id(module)] = -(-module.weight.shape[0] // tile_count) * module.weight.shape[1]
            groups.extend(_tile_groups(qualified, module, direct, tile_count))
        else:
            groups.extend(_split_by_trainable(qualified, direct, holders))
    widened = max((tiled.get(id(m)) or _widened_numel(m) for m in model.modules()), default=0)
    # The engine's order: a module's group forms when its construction ends, after its children's, so the
    # optimizer states' tier cuts ([Note: optimizer states over tiers] in infinity/optim/tier_split.py) fall
    # where the engine's do. (A stable sort: a module's own groups, tiles and frozen parts, keep their order.)
    ends = _construction_order(model)
    groups.sort(key=lambda g: ends.get(g.name.split("[tile")[0], len(ends)))
    return ModelCensus(source=source or type(model).__name__, groups=tuple(groups), widened_numel=widened)


def _construction_order(model: nn.Module) -> dict[str, int]:
    """Each qualified module name's place when modules end construction children first (post-order)."""
    order: dict[str, int] = {}

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        order.setdefault(name or ROOT_NAME, len(order))
    visit(model, "")
    return order


def _widened_numel(module: nn.Module) -> int:
    """Elements of the fp32 weight buffer ``[precision] cpu_linear = "float32"`` would need for an
    untiled ``module`` (its weight, also one tied elsewhere: the layer multiplies with it), 0 for a
    module whose forward is not ``nn.Linear``'s."""
    if type(module).forward is not nn.Linear.forward or getattr(module, "weight", None) is None:
        return 0
    return module.weight.numel()


def unit_patterns(units: Sequence[str], root: nn.Module) -> tuple[str, ...]:
    """``partition.units`` as class-name patterns for a model whose outermost module is ``root``:
    ``"auto"`` stands for the class names ``root`` lists in ``_no_split_modules``."""
    patterns = tuple(u for u in units if u != "auto")
    if "auto" in units:
        patterns += tuple(getattr(type(root), "_no_split_modules", None) or ())
    return patterns


def is_unit(module: nn.Module, patterns: Sequence[str]) -> bool:
    """Whether ``module``'s class matches one of the unit ``patterns`` (fnmatch, case-sensitive)."""
    name = type(module).__name__
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _is_tiled(name: str, module: nn.Module, threshold: int, patterns: Sequence[str]) -> bool:
    """Whether the engine would tile this module (see [Note: tiles in the census])."""
    if not isinstance(module, nn.Linear) or module.weight.dim() != 2:
        return False
    if module.weight.numel() <= threshold:
        return False
    return not patterns or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _tile_count(
    name: str, weight: torch.Tensor, tiles: int, max_tile_bytes: int, param_bytes: int
) -> int:
    rows = weight.shape[0]
    if tiles > 0:
        if tiles > rows:
            raise PlanError(
                f"tiling.tiles = {tiles} but layer {name!r} has only {rows} output rows to "
                f"split; use at most {rows} tiles or set tiling.tiles = 0"
            )
        return tiles
    if max_tile_bytes <= 0:
        raise PlanError(f"tiling.max_tile_bytes must be positive, got {max_tile_bytes}")
    needed = -(-weight.numel() * param_bytes // max_tile_bytes)
    # One row per tile is the finest split; a row larger than max_tile_bytes stays whole.
    return min(needed, rows)


def _tile_groups(
    name: str, module: nn.Module, direct: list[nn.Parameter], tile_count: int
) -> list[CensusGroup]:
    weight = module.weight
    rows, cols = weight.shape
    base, extra = divmod(rows, tile_count)
    groups = [
        CensusGroup(
            name=f"{name}[tile {i + 1}/{tile_count}]",
            param_numels=((base + (1 if i < extra else 0)) * cols,),
            trainable=weight.requires_grad,
        )
        for i in range(tile_count)
    ]
    groups.extend(_split_by_trainable(name, [p for p in direct if p is not weight], {}))
    return groups


def _split_by_trainable(name: str, params: list[nn.Parameter], holders: dict[int, int]) -> list[CensusGroup]:
    """One group of the trainable parameters and one of the frozen ones (either may be absent)."""
    groups = []
    for trainable in (True, False):
        chosen = [p for p in params if p.requires_grad == trainable]
        if chosen:
            uses = max(holders.get(id(p), 1) for p in chosen)
            groups.append(CensusGroup(name=name, param_numels=tuple(p.numel() for p in chosen),
                                      trainable=trainable, uses=uses))
    return groups


def take_census(model_or_num_params: object, cfg, param_bytes: int) -> ModelCensus:
    """The census of a module, callable spec, parameter count or ready census, under ``cfg`` (a Config: its
    ``[tiling]`` and ``partition.units``) with compute copies of ``param_bytes`` bytes per element."""
    if isinstance(model_or_num_params, ModelCensus):
        return model_or_num_params
    source = None
    model = model_or_num_params
    if isinstance(model, str) and ":" in model:
        source = model
        model = load_model(model)
    if isinstance(model, nn.Module):
        tiling = cfg.tiling
        return census_of_module(
            model,
            tiling_enabled=bool(tiling.enabled),
            tiling_threshold=int(tiling.threshold),
            tiles=int(tiling.tiles),
            max_tile_bytes=int(tiling.max_tile_bytes),
            tiling_modules=tuple(tiling.modules),
            param_bytes=param_bytes,
            source=source,
            units=tuple(cfg.partition.units),
        )
    if isinstance(model, str) and re.search(r"[A-Za-z_]{2,}", model):
        # Words, not a count such as "1.3B": a callable spec missing its ":callable".
        raise PlanError(
            f"model must look like 'package.module:callable' or be a parameter count such as "
            f"1.3e9, got {model!r}"
        )
    if isinstance(model, (int, float, str)):
        return ModelCensus.from_num_params(parse_count(model, "number of parameters"))
    raise PlanError(
        f"model must be an nn.Module, a 'package.module:callable' string or a parameter "
        f"count, got {type(model).__name__}"
    )
