"""Memory-centric tiling: a huge linear or embedding layer as k tiles fetched one after another.

What the room holds: ``layers`` (``TiledLinear``, ``TiledEmbedding``, ``tile_``),
``weight`` (the joined ``TiledWeight`` of a tiled parameter, and how one is cut) and
``policy`` (which layers ``infinity.Init`` tiles, and the conversion at the context's exit). What it may touch: the user's modules, only
to convert the selected layers in place, and the engine's construction methods to
partition the tiles. See [Note: tiling] in ``infinity/tiling/layers.py``.
"""
from infinity.tiling.layers import COLUMNS, ROWS, TiledEmbedding, TiledLinear, tile_, tile_count
from infinity.tiling.weight import TiledWeight, TilingError, split_sizes

__all__ = ["COLUMNS", "ROWS", "TiledEmbedding", "TiledLinear", "TiledWeight", "TilingError", "split_sizes",
           "tile_", "tile_count"]
