"""The joined view of a tiled parameter, and how a parameter is cut into tiles.

[Note: the tiled weight]
``weight`` and ``bias`` of a tiled layer are properties returning a new tensor,
the concatenation of the tiles (a ``TiledWeight``): readable wherever the tiles
are gathered (under ``infinity.gathered``, in plain PyTorch always; elsewhere a
``ReleasedJoin``, which describes the join and refuses reads), differentiable (gradients flow
to the tiles, so a head computed as ``x @ wte.weight.T`` works, though it gathers
every tile at once), and written through: an in-place edit of it (``nn.init``,
``copy_``, ``zero_``, indexing) is copied back into the tiles, where they are
gathered (a tiled layer written in model code and built inside ``infinity.Init``
has partitioned tiles during construction: such an edit raises ``TilingError``
there), also through what shares its memory (``.data``, ``detach()``, indexing and
other views: ``emb.weight.data[pad].zero_()``). They cannot be assigned.
Each access copies the whole layer. ``state_dict()`` has the untiled keys
(``weight``, ``bias``), as ``TiledWeight``s too, so an in-place edit of a state
dict's tensor reaches the tiles as it reaches an untiled layer's parameter (under
``infinity.gathered``, on to the stored shards); ``load_state_dict`` splits them, so state dicts move
between tiled and untiled models both ways; ``parameters()`` lists the tiles.
``tile_sizes`` and ``tiled_params()`` are what infinity/checkpoint reads to write
consolidated checkpoints under the untiled keys.

Setting ``requires_grad`` on the join (``layer.weight.requires_grad_(False)``) sets it on every
tile, as it would on the untiled parameter.

What the room may touch: the tiles' parameters of one tiled layer (``tiles``,
``tile_sizes``) and the released placeholder of a join; nothing of the engine.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from infinity.runtime.placeholder import ReleasedJoin, requires_grad_set


class TilingError(RuntimeError):
    """A layer cannot be tiled as asked; the message names the layer and what to change."""


def split_sizes(n: int, tiles: int) -> list[int]:
    """Sizes of ``tiles`` contiguous pieces of ``n`` that differ by at most one (the larger first).

    Examples
    --------
    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    """
    if not 1 <= tiles <= n:
        raise TilingError(f"cannot split {n} rows into {tiles} tiles: need 1 <= tiles <= {n}")
    return [n // tiles + (1 if i < n % tiles else 0) for i in range(tiles)]


class TiledWeight(torch.Tensor):
    """The concatenation of a tiled layer's tile parameters; in-place edits are written back to the tiles.

    Returned by ``TiledLinear.weight``/``.bias`` and ``TiledEmbedding.weight``
    (see [Note: the tiled weight]). Results of operations on it that share its memory (``.data``,
    ``detach()``, indexing, views) are TiledWeights of the same join, so their in-place edits are
    written back too; other results are plain tensors.
    """

    tiled_owner: nn.Module
    """The tiled layer whose tiles this joins."""

    tiled_name: str
    """The tiled parameter's name ("weight" or "bias")."""

    tiled_dim: int
    """The dimension the tiles are joined along."""

    tiled_base: "TiledWeight"
    """The whole join this one shares memory with (itself, or the join a view of it came from)."""

    @classmethod
    def over(cls, joined: torch.Tensor, owner: nn.Module, name: str, dim: int, base=None) -> "TiledWeight":
        """``joined`` (the tiles of ``owner``'s ``name`` concatenated along ``dim``, or memory of ``base``,
        such a join) as a TiledWeight."""
        out = joined.as_subclass(cls)
        out.tiled_owner, out.tiled_name, out.tiled_dim = owner, name, dim
        out.tiled_base = out if base is None else base
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trainable = requires_grad_set(func, args, kwargs)
        if trainable is not None and isinstance(args[0], TiledWeight) and args[0] is args[0].tiled_base:
            # Freezing (or unfreezing) the untiled parameter: every tile. The join itself, a result of the
            # tiles (not a leaf where they require grad), keeps what it was made with. (A tensor made from
            # it, ``detach()`` or a view, is not the parameter: its own flag, as torch sets it.)
            for tile, _, _ in tile_ranges(args[0].tiled_owner):
                getattr(tile, args[0].tiled_name).requires_grad_(trainable)
            return args[0] if func is torch.Tensor.requires_grad_ else None
        with torch._C.DisableTorchFunctionSubclass():
            views = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, TiledWeight)]
            versions = [v._version for v in views]
            out = func(*args, **kwargs)
            for view, before in zip(views, versions):
                if view._version != before:
                    view.write_back()
            if views and not torch.compiler.is_compiling():     # traced, the result is what the graph makes
                out = tree_map(lambda t: _sharing(t, views), out)
        return out

    def write_back(self) -> None:
        """Copy the joined values into the tiles (after an in-place edit of the joined tensor or a view of it)."""
        base = self.tiled_base
        pieces = [(getattr(tile, self.tiled_name), base.narrow(self.tiled_dim, start, size))
                  for tile, start, size in tile_ranges(self.tiled_owner)]
        if any(p.shape != piece.shape for p, piece in pieces):
            # Only possible inside infinity.Init for a TiledLinear/TiledEmbedding written in model
            # code: its tiles were partitioned as they were built, and the construction-time mode
            # that gathers touched parameters cannot act from inside this handler.
            raise TilingError(
                f"{type(self.tiled_owner).__name__} ({self.tiled_owner.num_tiles} tiles): an in-place edit of the "
                f"joined {self.tiled_name!r} cannot be written back while its tiles are partitioned; inside infinity.Init "
                f"edit each tile (`for t in layer.tiles: nn.init.normal_(t.{self.tiled_name})`) or call "
                "reset_parameters(), or edit it later under infinity.gathered")
        with torch.no_grad():
            for p, piece in pieces:
                p.copy_(piece)

    def __reduce_ex__(self, protocol):
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach().clone().as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach().clone().as_subclass(torch.Tensor)


def _sharing(result, joins: list):
    """``result`` as a TiledWeight of the join among ``joins`` whose memory it shares (a view, ``.data``,
    ``detach()``); else as it is. Called with torch functions of subclasses disabled."""
    if type(result) is not torch.Tensor or result.numel() == 0 or result.is_meta:
        return result
    ptr = result.untyped_storage().data_ptr()
    if ptr == 0:
        return result
    for join in joins:
        if join.untyped_storage().data_ptr() == ptr:
            return TiledWeight.over(result, join.tiled_owner, join.tiled_name, join.tiled_dim, join.tiled_base)
    return result


def tile_ranges(module: nn.Module):
    start = 0
    for tile, size in zip(module.tiles, module.tile_sizes):
        yield tile, start, size
        start += size


def joined(module: nn.Module, name: str, dim: int, full_shape: tuple, wrap: bool):
    """The tiles' ``name`` parameters joined along ``dim``; while a tile is released, a placeholder
    that describes the join and refuses reads (see [Note: released joins] in infinity/runtime/placeholder.py)."""
    out = None
    for tile, start, size in tile_ranges(module):
        part = getattr(tile, name)
        if part is None:
            return None
        expected = list(full_shape)
        expected[dim] = size
        # Reading the shape first lets infinity.Init's construction-time mode gather this tile
        # before it is copied (tile by tile, so never more than a few tiles at once). The shape of
        # the tensor itself: a released parameter answers its whole shape to ``.shape``.
        with torch._C.DisableTorchFunctionSubclass():
            gathered = list(part.shape) == expected
        if not gathered:
            return ReleasedJoin.over([getattr(t, name) for t in module.tiles], full_shape, name)
        if out is None:
            out = torch.empty(full_shape, dtype=part.dtype, device=part.device)
        out.narrow(dim, start, size).copy_(part)
    if not wrap:
        return out
    return TiledWeight.over(out, module, name, dim)
