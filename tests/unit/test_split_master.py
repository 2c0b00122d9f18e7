"""The fp32 master stored as bf16 compute copy + 16-bit remainder: exact, and the engine's results unchanged.

See [Note: split master] in infinity/optim/split_master.py.
"""
from copy import deepcopy
import pytest
import torch

import infinity
from infinity import registry
from infinity.optim import split_master
from infinity.optim import relayout
from tests.support.tiny_gpt import TinyGPT, batches


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _roundtrip(master: torch.Tensor):
    copy = torch.empty(master.numel(), dtype=torch.bfloat16)
    remainder = torch.empty(master.numel(), dtype=torch.int16)
    found = split_master.split(master, copy, remainder)
    assert torch.equal(copy, master.to(torch.bfloat16)) or torch.isnan(master).any()
    back = split_master.join(copy, remainder, found, torch.empty_like(master))
    return back, found


def test_random_masters_come_back_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    master = bits.view(torch.float32)
    back, found = _roundtrip(master)
    assert torch.equal(_bits(back), bits)
    # ties rounded down (about 1 in 2^17) and NaNs whose rounding changed their upper half
    # (about 1 in 256 of random bit patterns is a NaN) are the exceptions
    assert found is not None and 0 < found[0].numel() < master.numel() // 100


def test_ties_both_ways_nan_inf_and_signed_zero():
    # 1 + 2^-8 is a tie whose rounding goes down (r = +0x8000, does not fit int16);
    # 1 + 3 * 2^-8 a tie rounded up (r = -0x8000, fits)
    down = torch.tensor([1 + 2**-8, -(1 + 2**-8)], dtype=torch.float32)
    up = torch.tensor([1 + 3 * 2**-8, -(1 + 3 * 2**-8)], dtype=torch.float32)
    odd_nan = torch.tensor([0x7F800001, 0x7FC01234, -1], dtype=torch.int32).view(torch.float32)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45],
                           dtype=torch.float32)
    master = torch.cat([down, up, odd_nan, special])
    back, found = _roundtrip(master)
    assert torch.equal(_bits(back), _bits(master))
    index = set(found[0].tolist())
    assert {0, 1} <= index and not {2, 3} & index          # the ties rounded down, not those rounded up
    assert 4 in index                                       # a signalling NaN's rounding is a quiet NaN
    assert not set(range(7, 14)) & index                    # infinities, zeros, extremes: no exception


def test_all_masters_on_ties():
    master = torch.full((10_000,), 1 + 2**-8, dtype=torch.float32)
    back, found = _roundtrip(master)
    assert torch.equal(back, master) and found[0].numel() == master.numel()


@pytest.mark.skipif(split_master._qadam is None, reason="the C extension is not built")
def test_the_c_pass_equals_torch_passes(monkeypatch):
    g = torch.Generator().manual_seed(1)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = torch.full((80_000,), 1 + 2**-8, dtype=torch.float32)     # more exceptions than one call has room for
    ties[::7] = 1 + 3 * 2**-8
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, 1.0])
    for master in (random_bits.view(torch.float32), ties, special, torch.randn(1000)):
        results = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(split_master, "_qadam", None)
            back, found = _roundtrip(master)
            assert torch.equal(_bits(back), _bits(master)), native
            results.append(found)
        monkeypatch.undo()
        nan = torch.isnan(master)
        kept = [set() if f is None else {i for i in f[0].tolist() if not nan[i]} for f in results]
        assert kept[0] == kept[1]
        if results[0] is not None:
            assert torch.equal(results[0][0], torch.sort(results[0][0]).values)     # ascending
    # a non-contiguous master takes torch's passes
    master = torch.randn(2000)[::2]
    back, _ = _roundtrip(master)
    assert torch.equal(_bits(back), _bits(master))


def test_split_by_default_in_bf16_with_both_tiers_on_nvme_only():
    assert split_master.use_split_master(torch.bfloat16, "nvme", "nvme")
    assert not split_master.use_split_master(torch.bfloat16, "host", "host")
    assert not split_master.use_split_master(torch.bfloat16, "host", "nvme")
    assert not split_master.use_split_master(torch.float16, "nvme", "nvme")
    assert not split_master.use_split_master(torch.float32, "nvme", "nvme")


def test_exceptions_replace_a_range_only():
    ex = split_master.Exceptions()
    ex.set(0, (torch.tensor([1, 5, 9]), torch.tensor([10, 50, 90], dtype=torch.int32)))
    ex.set(0, (torch.tensor([0]), torch.tensor([7], dtype=torch.int32)), start=4, numel=4)
    index, values = ex.get(0)
    assert index.tolist() == [1, 4, 9] and values.tolist() == [10, 7, 90]
    index, values = ex.get(0, 8, 4)
    assert index.tolist() == [1] and values.tolist() == [90]
    assert ex.count() == 3


class _TieNorm(torch.nn.LayerNorm):
    def __init__(self, d: int, value: float, frozen: bool = False) -> None:
        super().__init__(d)
        torch.nn.init.constant_(self.weight, value)
        self.weight.requires_grad_(not frozen)


def _train(preset: str, tmp_path, split: bool, monkeypatch, steps: int = 4):
    # host tiers keep a separate master by default; the split path is the same code there
    monkeypatch.setattr(relayout, "use_split_master", lambda *a: split)
    (tmp_path / f"swap-{split}").mkdir()
    cfg = infinity.load_config(preset, overrides={"tiers": {"nvme_path": str(tmp_path / f"swap-{split}")},
                                                  "partition": {"sub_group_size": 4096}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT(d=48)
        model.ln_f = _TieNorm(48, 1 + 2**-8)        # masters on ties rounded down: exceptions
        model.blocks[0].ln1 = _TieNorm(48, 1 + 3 * 2**-8)     # and rounded up
    store = registry.engine_of(model, "test").store
    assert (store.split is not None) is split and (store.split.exceptions.count() >= 48 if split else True)
    opt = infinity.AdamW(model, lr=1e-2)
    losses = []
    for x, y in batches(steps, 4):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = deepcopy(opt.state_dict()["shards"])
    infinity.release(model)
    monkeypatch.undo()
    return losses, state


@pytest.mark.parametrize("preset", ["nvme", "offload-host"])
def test_split_masters_train_bit_identical(preset, tmp_path, monkeypatch):
    split_losses, split_state = _train(preset, tmp_path, True, monkeypatch)
    losses, state = _train(preset, tmp_path, False, monkeypatch)
    assert split_losses == losses
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(split_state[name], state[name]):
            assert torch.equal(_bits(a), _bits(b)), name


def test_checkpoints_save_load_and_consolidate_split_masters_exactly(tmp_path, monkeypatch):
    """Ties and all: the saved, consolidated and reloaded masters are the trained ones bit for bit."""
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = infinity.load_config("nvme", overrides={"tiers": {"nvme_path": str(swap)},
                                                  "partition": {"sub_group_size": 4096}})

    def build():
        torch.manual_seed(0)
        with infinity.Init(cfg):
            model = TinyGPT(d=48)
            model.ln_f = _TieNorm(48, 1 + 2**-8, frozen=True)    # stays on its ties
        return model, infinity.AdamW(model, lr=1e-3)

    model, opt = build()
    x, y = batches(1, 4)[0]
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    trained = deepcopy(opt.state_dict()["shards"])
    engine = registry.engine_of(model, "test")
    assert engine.store.split.exceptions.count() > 0
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {names[id(s.param)]: trained["master"][g.index][s.offset:s.offset + s.numel]
                for g in engine.coordinator.groups for s in g.slots if id(s.param) in names}
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.release(model)

    fresh, fresh_opt = build()
    infinity.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    loaded = fresh_opt.state_dict()["shards"]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(trained[name], loaded[name]):
            assert torch.equal(_bits(a), _bits(b)), name
    engine = registry.engine_of(fresh, "test")
    for group in engine.coordinator.groups:      # the compute copy is the loaded master's rounding
        copy = torch.empty(group.shard_numel, dtype=torch.bfloat16)
        engine.coordinator.shards.read(group, copy).wait()
        assert torch.equal(copy, loaded["master"][group.index].to(torch.bfloat16))
    infinity.release(fresh)

    from infinity.checkpoint.consolidate import consolidate
    consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    for name, values in expected.items():
        assert torch.equal(_bits(state[name].flatten().contiguous()), _bits(values)), name
