"""Tiling inside infinity.Init: tiled layers equal untiled ones on the host and NVMe tiers, a small GPT
trains identically with and without tiling, state dicts cross between tiled and untiled models, and
the weight bytes gathered at once drop to a tile or two.

Values are kept at the scale of a trained layer (see tests/unit/test_tiling.py) so the absolute
fp32 bound (1e-6) measures the engine and the tiling, not the magnitude of the numbers.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity import registry
from infinity.tiling import TiledEmbedding, TiledLinear, TilingError
from tests.support.parity import stored_grad

TOL = 1e-6


def _cfg(tmp_path, tier, tiling, **extra):
    nvme = tmp_path / f"nvme-{tier}-{len(list(tmp_path.iterdir()))}"
    nvme.mkdir()
    # Small I/O pool and staging: the engine pre-faults them, and these models are tiny.
    cfg = {"tiers": {"params": tier, "optimizer": "host", "nvme_path": str(nvme),
                     "pool_buffer_size": "1MiB", "pool_buffers": 2},
           "partition": {"sub_group_size": 4096}, "prefetch": {"nvme_bytes": "4MiB"}, "tiling": tiling}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _diff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_tiled_linear_equals_untiled_inside_init(tmp_path, tier):
    for in_f, out_f, tiles in ((33, 65, 4), (40, 96, 3), (16, 7, 7)):
        g = torch.Generator().manual_seed(out_f)
        x = torch.randn(6, in_f, generator=g)
        r = torch.randn(6, out_f, generator=g) / out_f ** 0.5
        results = {}
        for tiled in (False, True):
            torch.manual_seed(0)
            with infinity.Init(_cfg(tmp_path, tier, {"enabled": tiled, "threshold": 1, "tiles": tiles})):
                model = nn.Sequential(nn.Linear(in_f, out_f))
            layer = model[0]
            assert isinstance(layer, TiledLinear) == tiled
            xi = x.clone().requires_grad_()
            y = model(xi)
            (y * r).sum().backward()
            params = list(layer.tiles) if tiled else [layer]
            dw = torch.cat([stored_grad(model, m.weight) for m in params])
            db = torch.cat([stored_grad(model, m.bias) for m in params])
            with infinity.gathered(model):
                w = layer.weight.detach().clone()
            results[tiled] = (y.detach(), xi.grad, dw, db, w)
        untiled, tiled_ = results[False], results[True]
        assert torch.equal(untiled[4], tiled_[4]), "tiling must keep the initial weights exactly"
        for what, a, b in zip(("output", "dx", "dw", "db"), untiled[:4], tiled_[:4]):
            assert _diff(a, b) <= TOL, f"{what} differs for Linear({in_f}, {out_f}) in {tiles} tiles"


# -- a small GPT with a big MLP and a tied head ------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero true gradient, so Adam would amplify
        # rounding noise there and the parameter comparison would test noise.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 8 * d)
        self.out = nn.Linear(8 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 97, d: int = 16, heads: int = 2, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _batches(steps, batch=2, seq=8, vocab=97):
    """Random tokens; the target is the next token id (learnable, so the loss falls)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((idx, (idx + 1) % vocab))
    return out


TILING = {"threshold": 1000, "tiles": 3}     # fc (16 -> 128), out (128 -> 16), wte + head (97 x 16)


def _train(tmp_path, tier, tiling, steps):
    torch.manual_seed(0)
    with infinity.Init(_cfg(tmp_path, tier, tiling)):
        model = GPT()
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
    losses = []
    for idx, tgt in _batches(steps):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with infinity.gathered(model):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, losses, state


@pytest.mark.parametrize("tier,steps", [("host", 6), ("nvme", 3)])
def test_gpt_trains_the_same_with_and_without_tiling(tmp_path, tier, steps):
    _, ref_losses, ref_state = _train(tmp_path, tier, {"enabled": False}, steps)
    model, losses, state = _train(tmp_path, tier, TILING, steps)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if type(m).__name__.startswith("Tiled")}
    assert kinds == {"wte": "TiledEmbedding", "head": "TiledLinear", "blocks.0.fc": "TiledLinear",
                     "blocks.0.out": "TiledLinear", "blocks.1.fc": "TiledLinear", "blocks.1.out": "TiledLinear"}
    assert model.head.tiles[1].weight is model.wte.tiles[1].weight
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        assert abs(a - b) <= 1e-6 * abs(a), f"step {step}: loss {b} with tiling, {a} without"
    assert ref_losses[-1] < ref_losses[0]
    assert list(state) == list(ref_state)
    assert max(_diff(state[k], ref_state[k]) for k in state) <= 1e-5


def _train_ranks(rank, world, workdir):
    import pathlib

    runs = {}
    for name, tiling in (("untiled", {"enabled": False}), ("tiled", TILING)):
        root = pathlib.Path(workdir) / f"{name}-{rank}"
        root.mkdir()
        runs[name] = _train(root, "host", tiling, 3)[1]
    return runs


def test_two_ranks_train_the_same_with_and_without_tiling(tmp_path):
    from tests.support.ranks import run_ranks

    for runs in run_ranks(_train_ranks, 2, tmp_path):
        for a, b in zip(runs["untiled"], runs["tiled"]):
            assert abs(a - b) <= 1e-6 * abs(a)


def test_state_dicts_cross_between_tiled_engine_models_and_plain_untiled_ones(tmp_path):
    idx, tgt = _batches(1)[0]
    torch.manual_seed(0)
    with infinity.Init(_cfg(tmp_path, "host", TILING)):
        tiled = GPT()
    with infinity.gathered(tiled):
        sd = {k: v.clone() for k, v in tiled.state_dict().items()}
    plain = GPT()
    assert list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd)
    with torch.no_grad():
        assert abs(float(plain(idx, tgt)) - float(tiled(idx, tgt))) <= 1e-6
    torch.manual_seed(5)
    other = GPT()                                         # untiled values into the tiled engine model
    with infinity.gathered(tiled):
        tiled.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert abs(float(other(idx, tgt)) - float(tiled(idx, tgt))) <= 1e-6
    with infinity.gathered(tiled):
        assert torch.equal(tiled.head.weight, other.head.weight)


def test_explicit_tiled_layers_in_model_code_are_built_tile_by_tile(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = TiledEmbedding(50, 12, tiles=3)
            self.fc = TiledLinear(12, 30, tiles=4)

        def forward(self, idx):
            return self.fc(self.emb(idx)).pow(2).mean()

    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    with infinity.Init(_cfg(tmp_path, "host", {"enabled": False})):
        model = Net()
    groups = registry.engine_of(model).coordinator.groups
    assert [g.numel for g in groups] == [50 * 4] * 3 + [8 * 13] * 2 + [7 * 13] * 2   # no group holds a layer
    idx = torch.randint(0, 50, (3, 5))
    ref(idx).backward()
    model(idx).backward()
    with torch.no_grad():
        assert _diff(ref(idx), model(idx)) <= TOL
    for tile in model.fc.tiles:
        assert _diff(stored_grad(model, tile.weight), dict(ref.named_parameters())[
            next(n for n, p in model.named_parameters() if p is tile.weight)].grad) <= TOL


def test_editing_an_explicit_tiled_weight_during_construction_is_refused_clearly(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = TiledLinear(12, 30, tiles=8)
            nn.init.zeros_(self.fc.weight)     # the 8 tiles are partitioned: cannot write back

    with pytest.raises(TilingError, match=r"TiledLinear \(8 tiles\): an in-place edit of the joined 'weight'"):
        with infinity.Init(_cfg(tmp_path, "host", {"enabled": False})):
            Net()


def test_patterns_tile_exactly_the_named_layers(tmp_path):
    with infinity.Init(_cfg(tmp_path, "host", {"modules": ["blocks.*.fc", "blocks.1.proj"], "tiles": 2})):
        model = GPT()
    tiled = sorted(n for n, m in model.named_modules() if isinstance(m, (TiledLinear, TiledEmbedding)))
    assert tiled == ["blocks.0.fc", "blocks.1.fc", "blocks.1.proj"]


def test_a_weight_tied_to_something_untileable_is_refused_naming_the_layer(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 64)
            self.scale = nn.Module()
            self.scale.w = self.proj.weight

    with pytest.raises(TilingError, match=r"cannot tile 'proj' \(Linear\): its weight is also 'scale'.w"):
        with infinity.Init(_cfg(tmp_path, "host", {"threshold": 100, "tiles": 2})):
            Odd()


def _peak_gathered(model, x) -> tuple[int, int]:
    """Largest gathered bytes right after each gather (forward and backward), and fetches that were prefetched."""
    coordinator = registry.engine_of(model).coordinator
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], coordinator.available_nbytes())

    def watch(m, args, out):
        out.register_hook(sample)

    handles = [h for m in model.modules()
               for h in (m.register_forward_pre_hook(sample), m.register_forward_hook(watch))]
    hits = coordinator.stats.prefetch_hits
    model(x).pow(2).mean().backward()
    for h in handles:
        h.remove()
    return peak[0], coordinator.stats.prefetch_hits - hits


def test_working_memory_is_a_tile_plus_the_one_prefetched(tmp_path):
    x = torch.randn(4, 255)
    tile_nbytes = 128 * 256 * 4        # 128 rows of 255 weights and a bias: no padding
    peaks = {}
    for tiles in (0, 8):
        cfg = _cfg(tmp_path, "host", {"enabled": tiles > 0, "threshold": 1, "tiles": max(tiles, 1)},
                   prefetch={"device_bytes": tile_nbytes})
        with infinity.Init(cfg):
            model = nn.Sequential(nn.Linear(255, 1024))
        _peak_gathered(model, x)                                       # records the trace
        peaks[tiles] = _peak_gathered(model, x)
    assert [g.full_nbytes for g in registry.engine_of(model).coordinator.groups] == [tile_nbytes] * 8
    assert peaks[0][0] == 8 * tile_nbytes
    assert peaks[8][0] == 2 * tile_nbytes, "the tile in use and the next one, prefetched"
    assert peaks[8][1] >= 14, "every tile but the first of each pass comes from the prefetcher"
    assert peaks[0][0] / peaks[8][0] >= 8 / 2


@pytest.mark.gpu
def test_tiled_linear_equals_untiled_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref = nn.Linear(64, 100).cuda()
    tiled = TiledLinear.from_linear(ref, 7)
    x = torch.randn(8, 64, device="cuda") / 8
    assert _diff(ref(x), tiled(x)) <= TOL
    with infinity.Init({"tiers": {"params": "host", "device": "cuda"}, "tiling": {"threshold": 1, "tiles": 7}}):
        model = nn.Sequential(nn.Linear(64, 100))
    with infinity.gathered(model):
        model[0].load_state_dict(ref.state_dict())
    assert isinstance(model[0], TiledLinear) and _diff(model(x), ref(x)) <= TOL
