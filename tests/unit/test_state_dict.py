"""``infinity.state_dict``: the state dict ``gathered`` + ``state_dict()`` gives, in host memory, with no more of
the model gathered at once than its largest group (a module walked whole when it fits, else its own state and
its children; a tiled layer whole, through its own ``state_dict``); tied weights one host tensor."""
import pytest
import torch
from torch import nn

import infinity
from infinity import registry
from infinity.tiling import TiledLinear
from tests.support.ranks import run_ranks


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    """Own parameter and buffers beside children bigger than any one group; tied head, also under a second
    name; a tiled layer."""

    def __init__(self, vocab: int = 24, d: int = 8) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("positions", torch.arange(d, dtype=torch.float32))
        self.register_buffer("scratch", torch.zeros(d), persistent=False)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(3))
        self.wide = TiledLinear(d, d, tiles=2)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.again = self.head          # one module under two names: state_dict() gives both

    def forward(self, idx):
        x = (self.embed(idx) * self.scale + self.positions).to(self.scale.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.wide(x))


_CFG = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}, "precision": {"dtype": "bfloat16"}}


def _built():
    torch.manual_seed(0)
    with infinity.Init(_CFG):
        return _Net()


def _gathered_state(model) -> dict:
    with infinity.gathered(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _peak_gathered(model, run) -> tuple[int, object]:
    """The most elements ``model``'s engine held gathered at once while ``run()`` ran, and its result."""
    registry.engine_of(model).coordinator.stats.reset()
    result = run()
    return infinity.stats(model)["fetch"]["peak_live_numel"], result


def test_state_dict_is_gathereds_in_host_memory_a_module_at_a_time():
    model = _built()
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randint(0, 24, (2, 5))).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    want = _gathered_state(model)
    engine = registry.engine_of(model)
    peak, got = _peak_gathered(model, lambda: infinity.state_dict(model))
    assert list(got) == list(want) and "scratch" not in got
    for key, value in want.items():
        assert torch.equal(got[key], value) and got[key].dtype == value.dtype, key
    assert got["head.weight"] is got["embed.weight"] and got["again.weight"] is got["embed.weight"]
    largest = max(g.numel for g in engine.coordinator.groups)
    whole = sum(g.numel for g in engine.coordinator.groups)
    assert peak <= largest < whole == _peak_gathered(model, lambda: _gathered_state(model))[0], (peak, largest, whole)
    assert all(v.dtype == torch.float32 for v in infinity.state_dict(model, dtype=torch.float32).values())
    block = infinity.state_dict(model.blocks[1])
    assert list(block) == [k.removeprefix("blocks.1.") for k in want if k.startswith("blocks.1.")]
    infinity.release(model)


@pytest.mark.hf
def test_state_dict_saves_a_model_with_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    with infinity.Init(_CFG):
        model = transformers.GPT2LMHeadModel(config)
    want = _gathered_state(model)
    model.save_pretrained(tmp_path, state_dict=infinity.state_dict(model))
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert {k: torch.equal(saved[k], v) for k, v in want.items()} == {k: True for k in want}
    infinity.release(model)


def _rank0_case(rank: int, world: int, workdir) -> tuple[int, bool]:
    model = _built()
    want = _gathered_state(model)
    got = infinity.state_dict(model, rank0_only=True)
    same = list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    infinity.release(model)
    return len(got), same


def test_rank0_only_on_two_ranks(tmp_path):
    (n0, same0), (n1, _) = run_ranks(_rank0_case, 2, tmp_path)
    assert same0 and n0 > 0 and n1 == 0


@pytest.mark.parametrize("params", ["host", "device", "nvme"])
def test_tensors_taken_inside_gathered_keep_their_values_after_it(tmp_path, params):
    """``sd = model.state_dict()`` or ``w = p.data`` inside gathered shared the gathered memory, released at the
    exit: reading them crashed the process, and torch.save(sd) wrote empty storages without an error ([Note:
    tensors that outlive a block] in infinity/runtime/gathered.py). They keep the block's values now, and the
    model trains on exactly as one where nothing was kept."""
    import io

    def build(tag):
        (tmp_path / tag).mkdir()
        torch.manual_seed(0)
        with infinity.Init({"tiers": {"params": params, "optimizer": "host", "nvme_path": str(tmp_path / tag)}}):
            return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model, twin = build("model"), build("twin")
    with infinity.gathered(model):
        sd = model.state_dict()
        w = model[0].weight.data
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert all(torch.equal(saved[k], v) and torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    assert torch.equal(w, ref[0].weight.data)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for m in (model, twin):
        opt = infinity.AdamW(m, lr=1e-2)
        for _ in range(2):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    with infinity.gathered(model), infinity.gathered(twin):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert torch.equal(w, ref[0].weight.data)     # the block's values, not the later updates'
    infinity.release(model)
    infinity.release(twin)
