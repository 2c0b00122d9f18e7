"""Memory-centric tiling: a huge linear or embedding layer as k tiles fetched one after another.

[Note: tiling]
The engine gathers and releases parameters per module: each module's direct
parameters form one group, hooks gather a module's group before its forward (and
its backward) and release it after, and the prefetcher walks the recorded trace
of module requests. So a tiled layer is built from that machinery alone: its
weight is split into k tile parameters, each owned by its own child module
(``tiles.0`` ... ``tiles.{k-1}``), and the tiled layer's forward calls the tiles
one after another. Each tile is then gathered just before use and released
after, forward and backward, and the next tile is prefetched along the trace;
working memory is one tile plus what ``prefetch.device_bytes`` lets the
prefetcher gather ahead, instead of the whole layer. No engine change.

How the weight is split, so that every tile stays one dense kernel:
- ``nn.Linear``: along ``out_features`` (rows of the weight, and the bias with
  them). Tile i computes the output columns ``[a_i, b_i)`` with one matmul over
  the whole input; the outputs are concatenated. Backward: each tile's weight
  gradient is its own matmul; the input gradient sums the tiles' contributions
  (the same sum as untiled, in k partial sums: equal up to fp32 rounding).
- ``nn.Embedding``: along ``embedding_dim`` ("columns": tile i is an
  ``Embedding(num, d_i)``; outputs concatenated on the last dimension), or along
  the vocabulary ("rows": tile i holds rows ``[a_i, b_i)`` and fills the output
  positions whose index falls in its range) when the weight is tied to an output
  projection or ``max_norm`` is set (a row's norm needs the whole row).
Sizes that do not divide evenly differ by at most one row (``split_sizes``).

Tied weights (an output projection sharing the embedding's weight): every layer
sharing the weight is tiled along the vocabulary with the same boundaries, and
tile i of each is the same ``nn.Parameter``, so they stay tied. A layer whose
weight is shared with something tiling cannot follow (another attribute name, a
custom module, a different shape) is refused with a ``TilingError`` naming both.

[Note: when layers are tiled]
Inside ``infinity.Init`` tiling happens once, at the context's exit, before the
engine finalizes (``apply_tiling`` in infinity/tiling/policy.py, called from
``Init.__exit__``). By then the
qualified names are known, so ``tiling.modules`` patterns match the names of
``model.named_modules()`` (e.g. ``"blocks.*.mlp.0"``, ``"head"``), ties are known
(parameters shared between modules), and all construction code (``self.apply(
_init_weights)``, ``named_parameters()`` loops, ``head.weight = wte.weight``) ran
on ordinary layers, so a tiled model starts from exactly the weights of the
untiled one. Each selected layer is converted in place (its class becomes
``TiledLinear``/``TiledEmbedding``, so the parent's references, the user's hooks
and ``isinstance(m, nn.Linear)`` still hold): its group is gathered in fp32 from
the master shards, each tile is cut, partitioned at once and freed, and the old
group is dropped (the engine's orphan pass frees its shards).
The alternative, tiling in ``Init._on_built`` right after ``nn.Linear.__init__``
returns, saves that one extra gather and re-shard per tiled layer at construction
(about a second per GiB on the host tier), but sees only class names (no
patterns), not ties made later by the parent, and changes what the parent's init
code sees. Construction peak memory is the same either way: one layer, which
``nn.Linear.__init__`` allocates anyway. (A ``TiledLinear`` written in model code
is built tile by tile, so it never holds more than one tile, even then.)

Which layers: exact ``nn.Linear`` and ``nn.Embedding`` instances (subclasses may
override ``forward`` and are left alone). With ``tiling.modules`` empty, those
whose weight has more than ``tiling.threshold`` elements; with patterns, exactly
those matching a pattern (the threshold then does not apply), plus any layer tied
to one. ``tiling.tiles`` tiles, or with 0 the fewest that keep every tile at most
``tiling.max_tile_bytes`` in the compute dtype. A layer that would get one tile is
left as it is.

"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from infinity.config import TilingConfig
from infinity.tiling.weight import TilingError, joined, split_sizes, tile_ranges

ROWS, COLUMNS = "rows", "columns"


def tile_count(rows: int, row_nbytes: int, config: TilingConfig) -> int:
    """Tiles for a weight of ``rows`` slices of ``row_nbytes`` each (see [Note: when layers are tiled])."""
    if config.tiles > 0:
        return min(config.tiles, rows)
    per_tile = max(1, config.max_tile_bytes // max(row_nbytes, 1))
    return min(rows, -(-rows // per_tile))


# -- tiles ------------------------------------------------------------------------------------------
class _LinearTile(nn.Module):
    """Rows ``[a, b)`` of a tiled linear layer: one dense matmul producing those output features."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _EmbeddingTile(nn.Module):
    """Columns (or rows) of a tiled embedding's table, looked up like ``nn.Embedding``."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, options: tuple) -> None:
        super().__init__()
        self.weight = weight
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = options

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


class _Tiled:
    """What ``TiledLinear`` and ``TiledEmbedding`` share: tiles, joined weights, untiled state-dict keys."""

    tiles: nn.ModuleList
    tile_sizes: tuple[int, ...]

    def tiled_params(self) -> list[tuple[str, int, tuple]]:
        """(name, split dimension, full shape) of each tiled parameter."""
        raise NotImplementedError

    @property
    def num_tiles(self) -> int:
        return len(self.tile_sizes)

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight", "bias") and "tiles" in self.__dict__.get("_modules", {}):
            raise TilingError(
                f"{type(self).__name__} ({self.num_tiles} tiles): {name!r} is the concatenation of the tile "
                f"parameters and cannot be assigned; assign tiles[i].{name}, edit it in place, or tie layers "
                "before infinity.Init exits (tied layers are tiled together)")
        super().__setattr__(name, value)

    def state_dict(self, *args, **kwargs):
        """The untiled keys (``prefix.weight``, ``prefix.bias``), as ``nn.Linear``/``nn.Embedding`` have."""
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
        for name, dim, shape in self.tiled_params():
            keys = [f"{prefix}tiles.{i}.{name}" for i in range(self.num_tiles)]
            if keys[0] not in out:
                continue
            for k in keys:
                del out[k]
            if keep_vars:
                out[prefix + name] = joined(self, name, dim, shape, wrap=False)
                continue
            # Written through, like a state dict's views of an untiled layer's parameters: an in-place
            # edit of this tensor reaches the tiles (see [Note: the tiled weight]).
            with torch.no_grad():
                out[prefix + name] = joined(self, name, dim, shape, wrap=True)
        metadata = getattr(out, "_metadata", None)
        if metadata is not None:
            for key in [f"{prefix}tiles", *(f"{prefix}tiles.{i}" for i in range(self.num_tiles))]:
                metadata.pop(key, None)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # Split untiled keys into the tiles' keys; the children then load them as usual.
        for name, dim, shape in self.tiled_params():
            value = state_dict.pop(prefix + name, None)
            if value is None:
                continue
            if tuple(value.shape) != tuple(shape):
                error_msgs.append(
                    f"size mismatch for {prefix}{name}: copying a param with shape {tuple(value.shape)} from "
                    f"checkpoint, the shape in current model is {tuple(shape)} ({type(self).__name__}, "
                    f"{self.num_tiles} tiles).")
                continue
            for i, (_, start, size) in enumerate(tile_ranges(self)):
                state_dict[f"{prefix}tiles.{i}.{name}"] = value.narrow(dim, start, size)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class TiledLinear(_Tiled, nn.Linear):
    """``nn.Linear`` whose weight (and bias) is split along ``out_features`` into ``tiles`` parameters.

    Equivalent to ``nn.Linear(in_features, out_features, bias)``: same attributes, same
    ``state_dict`` keys, same initial distribution; see [Note: tiling] for the split and
    [Note: the tiled weight] for ``weight``/``bias``. Inside ``infinity.Init`` it is built
    tile by tile, so the whole weight never exists at once; construction code there edits
    its tiles (or calls ``reset_parameters``), not the joined weight. (Layers the tiling
    policy converts need none of this: construction code sees plain ``nn.Linear``.)

    Parameters
    ----------
    in_features, out_features, bias, device, dtype:
        As for ``nn.Linear``.
    tiles:
        Number of tiles (at most ``out_features``); sizes differ by at most one row.

    Examples
    --------
    >>> layer = TiledLinear(16, 10, tiles=4)
    >>> layer.tile_sizes, layer.weight.shape, list(layer.state_dict())
    ((3, 3, 2, 2), torch.Size([10, 16]), ['weight', 'bias'])
    >>> layer(torch.ones(2, 16)).shape
    torch.Size([2, 10])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tiles: int = 2,
                 device=None, dtype=None) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        sizes = split_sizes(out_features, tiles)
        made = []
        for rows in sizes:
            w = nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype))
            b = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None
            _init_linear_tile(w, b, in_features)
            made.append(_LinearTile(w, b))
        _attach(self, made, sizes)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tiles: int) -> "TiledLinear":
        """A tiled copy of ``linear`` (same values; ``linear`` is left unchanged)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        sizes = split_sizes(linear.out_features, tiles)
        weights = _cut(linear.weight, sizes, 0)
        biases = _cut(linear.bias, sizes, 0) if linear.bias is not None else [None] * len(sizes)
        _attach(out, [_LinearTile(w, b) for w, b in zip(weights, biases)], sizes)
        return out

    def tiled_params(self):
        out = [("weight", 0, (self.out_features, self.in_features))]
        if self.tiles[0].bias is not None:
            out.append(("bias", 0, (self.out_features,)))
        return out

    @property
    def weight(self) -> torch.Tensor:
        return joined(self, "weight", 0, (self.out_features, self.in_features), wrap=True)

    @property
    def bias(self) -> torch.Tensor | None:
        return joined(self, "bias", 0, (self.out_features,), wrap=True)

    def reset_parameters(self) -> None:
        for tile in self.tiles:
            _init_linear_tile(tile.weight, tile.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tiles={self.num_tiles}"


class TiledEmbedding(_Tiled, nn.Embedding):
    """``nn.Embedding`` whose table is split into ``tiles`` parameters, by columns or by rows.

    ``split="columns"`` (default): tile i is ``Embedding(num_embeddings, d_i)``, outputs
    concatenated. ``split="rows"``: tile i holds rows ``[a_i, b_i)`` of the vocabulary (the
    split a tied output projection needs, and the one ``max_norm`` needs). Attributes,
    ``state_dict`` keys and the initial distribution are those of ``nn.Embedding``.

    Parameters
    ----------
    num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, device, dtype:
        As for ``nn.Embedding``.
    tiles:
        Number of tiles.
    split:
        "columns" or "rows".

    Examples
    --------
    >>> emb = TiledEmbedding(10, 6, tiles=4)
    >>> emb.tile_sizes, emb(torch.tensor([[1, 2]])).shape, list(emb.state_dict())
    ((2, 2, 1, 1), torch.Size([1, 2, 6]), ['weight'])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, tiles: int = 2, split: str = COLUMNS, device=None, dtype=None) -> None:
        nn.Module.__init__(self)
        _set_embedding_options(self, num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                               scale_grad_by_freq, sparse)
        self.split = _check_split(split, max_norm, "TiledEmbedding")
        dim = 0 if self.split == ROWS else 1
        sizes = split_sizes((num_embeddings, embedding_dim)[dim], tiles)
        made, start = [], 0
        for size in sizes:
            shape = [num_embeddings, embedding_dim]
            shape[dim] = size
            w = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
            pad = _local_padding(self.padding_idx, dim, start, size)
            _init_embedding_tile(w, pad)
            made.append(_EmbeddingTile(w, pad, _options(self)))
            start += size
        _attach(self, made, sizes)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, tiles: int, split: str = COLUMNS) -> "TiledEmbedding":
        """A tiled copy of ``embedding`` (same values; ``embedding`` is left unchanged)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        e = embedding
        _set_embedding_options(out, e.num_embeddings, e.embedding_dim, e.padding_idx, e.max_norm, e.norm_type,
                               e.scale_grad_by_freq, e.sparse)
        out.split = _check_split(split, e.max_norm, "TiledEmbedding.from_embedding")
        dim = 0 if out.split == ROWS else 1
        sizes = split_sizes(e.weight.shape[dim], tiles)
        _attach(out, _embedding_tiles(out, _cut(e.weight, sizes, dim), sizes), sizes)
        return out

    def tiled_params(self):
        return [("weight", 0 if self.split == ROWS else 1, (self.num_embeddings, self.embedding_dim))]

    @property
    def weight(self) -> torch.Tensor:
        name, dim, shape = self.tiled_params()[0]
        return joined(self, name, dim, shape, wrap=True)

    def reset_parameters(self) -> None:
        for tile in self.tiles:
            _init_embedding_tile(tile.weight, tile.padding_idx)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.split == COLUMNS:
            return torch.cat([tile(idx) for tile in self.tiles], dim=-1)
        # Rows: each tile looks up only the positions whose index falls in its range, so
        # padding and scale_grad_by_freq see exactly the indices they would untiled.
        flat = idx.reshape(-1)
        out = None
        for tile, start, size in tile_ranges(self):
            local = flat - start
            inside = (local >= 0) & (local < size)
            rows = tile(local[inside])
            if out is None:
                out = rows.new_zeros(flat.numel(), self.embedding_dim)
            out.index_put_((inside,), rows)
        return out.view(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tiles={self.num_tiles}, split={self.split}"


# -- building tiles -------------------------------------------------------------------------------------
def _init_linear_tile(w: nn.Parameter, b: nn.Parameter | None, in_features: int) -> None:
    # nn.Linear.reset_parameters per tile: the bounds depend only on fan-in, which every tile shares.
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(b, -bound, bound)


def _init_embedding_tile(w: nn.Parameter, padding_idx: int | None) -> None:
    nn.init.normal_(w)
    if padding_idx is not None:
        with torch.no_grad():
            w[padding_idx].fill_(0)


def _set_embedding_options(m, num, dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse) -> None:
    if padding_idx is not None:
        if not -num <= padding_idx < num:
            raise TilingError(f"padding_idx {padding_idx} must be within num_embeddings {num}")
        padding_idx = padding_idx % num
    m.num_embeddings, m.embedding_dim, m.padding_idx = num, dim, padding_idx
    m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse = max_norm, norm_type, scale_grad_by_freq, sparse


def _options(m) -> tuple:
    return m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse


def _check_split(split: str, max_norm, what: str) -> str:
    if split not in (ROWS, COLUMNS):
        raise TilingError(f"{what}: split must be 'rows' or 'columns', got {split!r}")
    if split == COLUMNS and max_norm is not None:
        raise TilingError(f"{what}: max_norm renormalizes whole rows; use split='rows'")
    return split


def _local_padding(padding_idx: int | None, dim: int, start: int, size: int) -> int | None:
    if padding_idx is None or dim == 1:
        return padding_idx
    return padding_idx - start if start <= padding_idx < start + size else None


def _embedding_tiles(m, weights: list[nn.Parameter], sizes: list[int]) -> list[_EmbeddingTile]:
    dim = 0 if m.split == ROWS else 1
    out, start = [], 0
    for w, size in zip(weights, sizes):
        out.append(_EmbeddingTile(w, _local_padding(m.padding_idx, dim, start, size), _options(m)))
        start += size
    return out


def _cut(p: torch.Tensor, sizes: list[int], dim: int) -> list[nn.Parameter]:
    return [nn.Parameter(piece.clone(), requires_grad=p.requires_grad)
            for piece in torch.split(p.detach(), sizes, dim)]


def _attach(m: nn.Module, tiles: list[nn.Module], sizes: list[int]) -> None:
    for name in ("weight", "bias"):
        try:
            nn.Module.__delattr__(m, name)   # the parameter, or the None slot of a missing bias
        except AttributeError:
            pass
    nn.Module.__setattr__(m, "tile_sizes", tuple(sizes))
    nn.Module.__setattr__(m, "tiles", nn.ModuleList(tiles))


# -- in-place conversion ------------------------------------------------------------------------------
def tile_(modules: nn.Module | Sequence[nn.Module], tiles: int, *, split: str | None = None,
          on_tile: Callable[[nn.Module], None] | None = None) -> list[nn.Module]:
    """Turn ``nn.Linear``/``nn.Embedding`` layers into ``TiledLinear``/``TiledEmbedding`` in place.

    The instances keep their identity (parents' references, hooks, attributes); their
    ``weight``/``bias`` parameters are replaced by tile parameters holding the same values.
    Several layers sharing one weight (tied) are tiled together along the vocabulary and
    share tile i's parameter, so they stay tied (see [Note: tiling]).

    Parameters
    ----------
    modules:
        One layer, or every layer sharing one weight parameter.
    tiles:
        Number of tiles.
    split:
        For a single embedding: "columns" (default, or "rows" when ``max_norm`` is set)
        or "rows". Tied layers and linear layers always split rows.
    on_tile:
        Called with each tile module as soon as it is built (``infinity.Init`` partitions
        it there, so only one tile's copy of the values exists at a time).

    Returns
    -------
    The converted modules.

    Examples
    --------
    >>> wte, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = wte.weight
    >>> _ = tile_([wte, head], tiles=3)
    >>> type(head).__name__, head.tiles[0].weight is wte.tiles[0].weight
    ('TiledLinear', True)
    """
    mods = [modules] if isinstance(modules, nn.Module) else list(dict.fromkeys(modules))
    for m in mods:
        if type(m) not in (nn.Linear, nn.Embedding):
            raise TilingError(f"tile_: expected nn.Linear or nn.Embedding layers, got {type(m).__name__}")
        if m.weight is not mods[0].weight:
            raise TilingError("tile_: several layers are tiled together only when they share one weight "
                              f"parameter (tied); {type(m).__name__} {tuple(m.weight.shape)} does not")
    only = mods[0]
    if len(mods) > 1 or isinstance(only, nn.Linear):
        if split not in (None, ROWS):
            raise TilingError(f"tile_: linear and tied layers split rows, not {split!r}")
        split = ROWS
    else:
        split = _check_split(split or (ROWS if only.max_norm is not None else COLUMNS), only.max_norm, "tile_")
    dim = 0 if split == ROWS else 1
    weight = only.weight.detach()
    sizes = split_sizes(weight.shape[dim], tiles)
    built: dict[nn.Module, list[nn.Module]] = {m: [] for m in mods}
    start = 0
    for size in sizes:
        shared = nn.Parameter(weight.narrow(dim, start, size).clone(), requires_grad=only.weight.requires_grad)
        for m in mods:
            if isinstance(m, nn.Linear):
                bias = None if m.bias is None else nn.Parameter(
                    m.bias.detach().narrow(0, start, size).clone(), requires_grad=m.bias.requires_grad)
                tile = _LinearTile(shared, bias)
            else:
                tile = _EmbeddingTile(shared, _local_padding(m.padding_idx, dim, start, size), _options(m))
            built[m].append(tile)
            if on_tile is not None:
                on_tile(tile)
        start += size
    for m in mods:
        if isinstance(m, nn.Embedding):
            nn.Module.__setattr__(m, "split", split)
        _attach(m, built[m], sizes)
        m.__class__ = TiledLinear if isinstance(m, nn.Linear) else TiledEmbedding
    return mods
