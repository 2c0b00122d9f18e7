"""Tiled layers in plain PyTorch: equal to the untiled layer, same public face, the policy's choices.

The bound (max abs diff <= 1e-6, fp32) is absolute while fp32 rounding is relative, so the
cases keep values at the scale of a trained layer: weights ~ 1/sqrt(fan_in), upstream
gradients ~ 1/sqrt(out_features), outputs and input gradients of order one or less. The
tiled input gradient sums k partial products instead of one, a few ulps apart.
"""
import logging
import pickle

import pytest
import torch
from torch import nn

from infinity.config import load_config
from infinity.tiling import TiledEmbedding, TiledLinear, TiledWeight, TilingError, split_sizes, tile_, tile_count
from infinity.tiling.policy import plan_tiling

TOL = 1e-6


def _max_diff(a, b) -> float:
    return float((a - b).detach().abs().max())


def _linear_case(in_f, out_f, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f ** 0.5)
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=g))
    x = torch.randn(3, 5, in_f, generator=g)
    r = torch.randn(3, 5, out_f, generator=g) / out_f ** 0.5
    return ref, x, r


def _run(layer, x, r):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * r).sum().backward()
    return y, x.grad


def _tile_grads(layer, name, dim):
    return torch.cat([getattr(t, name).grad for t in layer.tiles], dim=dim)


def test_split_sizes_differ_by_at_most_one_and_cover_all():
    for n in (1, 7, 10, 4095, 4097):
        for k in {1, 2, 3, 7, min(n, 16)}:
            if k > n:
                continue
            sizes = split_sizes(n, k)
            assert sum(sizes) == n and len(sizes) == k and max(sizes) - min(sizes) <= 1
    with pytest.raises(TilingError, match="cannot split 3 rows into 4 tiles"):
        split_sizes(3, 4)


def test_tile_count_from_max_tile_bytes_keeps_every_tile_under_it():
    cfg = load_config({"tiling": {"max_tile_bytes": 3}}).tiling
    assert tile_count(3, 2, cfg) == 3            # one 2-byte row per 3-byte tile
    cfg = load_config({"tiling": {"max_tile_bytes": "1MiB"}}).tiling
    k = tile_count(1000, 4096, cfg)
    assert max(split_sizes(1000, k)) * 4096 <= 1 << 20 and max(split_sizes(1000, k - 1)) * 4096 > 1 << 20
    assert tile_count(1000, 4096, load_config({"tiling": {"tiles": 7}}).tiling) == 7
    assert tile_count(5, 4096, load_config({"tiling": {"tiles": 7}}).tiling) == 5


@pytest.mark.parametrize("in_f,out_f,tiles,bias", [
    (7, 10, 4, True), (33, 65, 4, True), (64, 100, 7, False), (16, 16, 16, True), (5, 3, 2, True), (128, 257, 8, True)])
def test_tiled_linear_equals_linear_outputs_and_gradients(in_f, out_f, tiles, bias):
    ref, x, r = _linear_case(in_f, out_f, bias)
    tiled = TiledLinear.from_linear(ref, tiles)
    assert tiled.tile_sizes == tuple(split_sizes(out_f, tiles))
    y0, dx0 = _run(ref, x, r)
    y1, dx1 = _run(tiled, x, r)
    assert _max_diff(y0, y1) <= TOL and _max_diff(dx0, dx1) <= TOL
    assert _max_diff(ref.weight.grad, _tile_grads(tiled, "weight", 0)) <= TOL
    if bias:
        assert _max_diff(ref.bias.grad, _tile_grads(tiled, "bias", 0)) <= TOL
    assert (tiled.in_features, tiled.out_features, isinstance(tiled, nn.Linear)) == (in_f, out_f, True)


@pytest.mark.parametrize("split", ["columns", "rows"])
@pytest.mark.parametrize("num,dim,tiles,padding,freq", [
    (10, 6, 4, None, False), (37, 9, 5, 3, False), (37, 9, 5, -1, True), (20, 3, 3, 0, True)])
def test_tiled_embedding_equals_embedding(split, num, dim, tiles, padding, freq):
    g = torch.Generator().manual_seed(1)
    ref = nn.Embedding(num, dim, padding_idx=padding, scale_grad_by_freq=freq)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(num, dim, generator=g))
    tiled = TiledEmbedding.from_embedding(ref, tiles, split=split)
    idx = torch.randint(0, num, (4, 11), generator=g)
    idx[0, :3] = ref.padding_idx if padding is not None else 0
    r = torch.randn(4, 11, dim, generator=g)
    (ref(idx) * r).sum().backward()
    y = tiled(idx)
    (y * r).sum().backward()
    assert torch.equal(ref(idx), y)
    assert _max_diff(ref.weight.grad, _tile_grads(tiled, "weight", 1 if split == "columns" else 0)) <= TOL
    assert tiled.padding_idx == ref.padding_idx and torch.equal(tiled.weight, ref.weight)


def test_tied_head_and_embedding_tile_together_and_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50)
            self.head.weight = self.wte.weight

        def forward(self, idx):
            return self.head(torch.tanh(self.wte(idx)))

    torch.manual_seed(0)
    ref = Tied()
    torch.manual_seed(0)
    model = Tied()
    tile_([model.wte, model.head], tiles=4)
    assert all(h.weight is e.weight for h, e in zip(model.head.tiles, model.wte.tiles))
    assert len(list(model.parameters())) == 8          # 4 shared weight tiles + 4 bias tiles
    idx = torch.randint(0, 50, (3, 7))
    r = torch.randn(3, 7, 50) * 0.05
    (ref(idx) * r).sum().backward()
    y = model(idx)
    (y * r).sum().backward()
    assert _max_diff(ref(idx), y) <= TOL
    assert _max_diff(ref.wte.weight.grad, _tile_grads(model.head, "weight", 0)) <= TOL
    assert _max_diff(ref.head.bias.grad, _tile_grads(model.head, "bias", 0)) <= TOL
    assert model.wte.split == "rows"


def test_state_dict_round_trip_between_tiled_and_untiled():
    ref, x, _ = _linear_case(12, 30, True)
    tiled = TiledLinear.from_linear(ref, 7)
    sd = tiled.state_dict()
    assert list(sd) == list(ref.state_dict()) == ["weight", "bias"]
    assert isinstance(sd["weight"], TiledWeight) and not sd["weight"].requires_grad
    plain = nn.Linear(12, 30)
    plain.load_state_dict(sd)
    assert torch.equal(plain(x), ref(x))
    sd["bias"].zero_()                                  # written through to the tiles, as a parameter's view is
    sd["weight"][29, 11] = 7.0
    assert all(not t.bias.any() for t in tiled.tiles) and float(tiled.tiles[-1].weight[-1, -1].detach()) == 7.0
    other = TiledLinear(12, 30, tiles=4)               # a different tiling loads the same dict
    other.load_state_dict(ref.state_dict())
    assert _max_diff(other(x), ref(x)) <= TOL
    outer = nn.Sequential(nn.ReLU(), other)
    assert list(outer.state_dict()) == ["1.weight", "1.bias"]
    assert not [k for k in outer.state_dict()._metadata if "tiles" in k]
    nn.Sequential(nn.ReLU(), nn.Linear(12, 30)).load_state_dict(outer.state_dict())
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*\(31, 12\).*\(30, 12\).*4 tiles"):
        other.load_state_dict({"weight": torch.zeros(31, 12), "bias": torch.zeros(30)})


def test_weight_edits_write_through_and_assignment_is_refused():
    ref, x, _ = _linear_case(9, 10, True)
    tiled = TiledLinear.from_linear(ref, 3)
    w = tiled.weight
    assert isinstance(w, TiledWeight) and w.shape == (10, 9)
    assert type(w * 2) is torch.Tensor
    nn.init.zeros_(tiled.bias)
    assert all(not t.bias.any() for t in tiled.tiles)
    w = tiled.weight
    with torch.no_grad():
        w[9, 8] = 5.0
    assert float(tiled.tiles[2].weight[-1, -1].detach()) == 5.0
    torch.manual_seed(3)
    nn.init.normal_(tiled.weight, std=0.5)
    torch.manual_seed(3)
    nn.init.normal_(ref.weight, std=0.5)
    assert torch.equal(tiled.weight, ref.weight)      # same RNG draw as the untiled layer
    with pytest.raises(TilingError, match=r"TiledLinear \(3 tiles\): 'weight' is the concatenation"):
        tiled.weight = nn.Parameter(torch.zeros(10, 9))
    copy = pickle.loads(pickle.dumps(tiled.weight))
    assert type(copy) is torch.Tensor and torch.equal(copy, ref.weight)


def test_head_computed_from_tiled_embedding_weight_gets_gradients():
    emb = nn.Embedding(20, 4)
    tiled = TiledEmbedding.from_embedding(emb, 3)
    h = torch.randn(5, 4)
    (h @ emb.weight.T).pow(2).sum().backward()
    (h @ tiled.weight.T).pow(2).sum().backward()
    assert _max_diff(emb.weight.grad, _tile_grads(tiled, "weight", 1)) <= TOL


def test_edits_through_what_shares_the_joined_weight_reach_the_tiles_and_only_the_join_freezes_them():
    ref, _, _ = _linear_case(6, 8, True)
    tiled = TiledLinear.from_linear(ref, 3)
    with torch.no_grad():
        tiled.weight.data[2].zero_()                # .data, then a view of it
        tiled.weight.detach()[5].fill_(3.0)
        tiled.weight.view(-1)[:6].fill_(-1.0)
        ref.weight.data[2].zero_()
        ref.weight.detach()[5].fill_(3.0)
        ref.weight.view(-1)[:6].fill_(-1.0)
    assert torch.equal(torch.cat([t.weight for t in tiled.tiles]), ref.weight)
    copy = tiled.weight.detach().requires_grad_()   # a tensor of its own, as detach() of a parameter is
    assert copy.requires_grad and all(t.weight.requires_grad for t in tiled.tiles)
    tiled.weight.detach().requires_grad_(False)
    assert all(t.weight.requires_grad for t in tiled.tiles)
    tiled.weight.requires_grad_(False)              # the untiled parameter's flag: every tile's
    assert not any(t.weight.requires_grad for t in tiled.tiles) and all(t.bias.requires_grad for t in tiled.tiles)
    meta = TiledLinear(6, 8, tiles=2, device="meta")
    assert type(meta.weight * 2) is torch.Tensor    # no memory to share on the meta device


def test_a_compiled_function_of_a_tiled_weight_computes_and_differentiates_as_eager():
    emb = TiledEmbedding(20, 4, tiles=3)
    h = torch.randn(5, 4)

    def head(h):
        return (h @ emb.weight.T).pow(2).sum() + emb.weight[3].sum()

    head(h).backward()
    want = torch.cat([t.weight.grad for t in emb.tiles], dim=1)
    for t in emb.tiles:
        t.weight.grad = None
    torch._dynamo.reset()
    torch.compile(head, backend="aot_eager")(h).backward()
    assert _max_diff(torch.cat([t.weight.grad for t in emb.tiles], dim=1), want) <= TOL
    torch._dynamo.reset()


def test_constructors_match_the_untiled_initialisation():
    torch.manual_seed(0)
    layer = TiledLinear(256, 300, tiles=5)
    bound = 1 / 256 ** 0.5
    w, b = layer.weight.detach(), layer.bias.detach()
    assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound
    assert float(b.abs().max()) <= bound
    emb = TiledEmbedding(100, 64, padding_idx=7, tiles=3, split="rows")
    table = emb.weight.detach()
    assert not table[7].any() and 0.9 < float(table.std()) < 1.1
    assert emb(torch.tensor([7, 99])).shape == (2, 64)
    with pytest.raises(TilingError, match="max_norm renormalizes whole rows"):
        TiledEmbedding(10, 4, max_norm=1.0, split="columns")
    with pytest.raises(TilingError, match="expected nn.Linear or nn.Embedding layers, got Conv1d"):
        tile_(nn.Conv1d(2, 2, 1), 2)
    with pytest.raises(TilingError, match="share one weight parameter"):
        tile_([nn.Linear(2, 4), nn.Linear(2, 4)], 2)


# -- the policy ------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, d=8, vocab=40):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 8 * d), nn.GELU(), nn.Linear(8 * d, d))
                                    for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.small = nn.Linear(d, d)


def _plan(model, **tiling):
    cfg = load_config({"tiling": tiling}).tiling
    return [c.layer for c in plan_tiling([model], cfg, torch.float32)]


def test_policy_threshold_picks_big_layers_and_their_tied_partners():
    layers = _plan(Net(), threshold=300, tiles=4)
    names = [layer.names for layer in layers]
    assert names == [("wte", "head"), ("blocks.0.0",), ("blocks.0.2",), ("blocks.1.0",), ("blocks.1.2",)]
    assert layers[0].split == "rows" and layers[0].kinds == ("Embedding", "Linear") and layers[0].shape == (40, 8)
    assert _plan(Net(), threshold=300, enabled=False) == []


def test_policy_patterns_match_qualified_names_regardless_of_threshold(caplog):
    layers = _plan(Net(), modules=["blocks.*.2", "small"], tiles=2)
    assert [layer.names for layer in layers] == [("blocks.0.2",), ("blocks.1.2",), ("small",)]
    layers = _plan(Net(), modules=["head"], tiles=2)     # tied: the embedding comes along
    assert [layer.names for layer in layers] == [("wte", "head")]
    with caplog.at_level(logging.WARNING, logger="infinity"):
        _plan(Net(), modules=["blocks.*.mlp"], tiles=2)
    assert "pattern 'blocks.*.mlp' in tiling.modules matches no nn.Linear/nn.Embedding" in caplog.text


def test_policy_derives_tiles_from_max_tile_bytes_and_skips_one_tile_layers():
    layers = _plan(Net(), threshold=300, max_tile_bytes=512)
    # 40 and 64 rows of 32 bytes: 16 rows a tile; 8 rows of 256 bytes: 2 rows a tile.
    assert {layer.names[0]: layer.tiles for layer in layers} == {
        "wte": 3, "blocks.0.0": 4, "blocks.0.2": 4, "blocks.1.0": 4, "blocks.1.2": 4}
    assert _plan(Net(), modules=["blocks.0.2"], max_tile_bytes=2048) == []   # one tile would hold it


def test_policy_refuses_a_weight_shared_with_something_it_cannot_tile():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 40)
            self.extra = nn.Module()
            self.extra.table = self.proj.weight

    with pytest.raises(TilingError,
                       match=r"cannot tile 'proj' \(Linear\): its weight is also 'extra'.table \(Module\)"):
        _plan(Odd(), threshold=10, tiles=2)
    assert _plan(Odd(), modules=["nothing"], tiles=2) == []
