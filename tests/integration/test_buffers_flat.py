"""Constant-size buffers over 50 steps: the gathered groups' recycled arena, the kept groups' arena, the
gradient buckets, the host gradient staging and the activation arena reach their size in the first
steps and the allocator's and arenas' own counters (bytes allocated, peaks, slabs) stay the same after
that; kept groups never borrow from the recycled arena, and no gather overflows its buffer."""
import pytest
import torch

import infinity
from infinity.errors import EngineError
from infinity.examples.gpt import GPT, preset
from infinity.runtime import gather_memory

from tests.support.benchmarks import load_benchmark


STEPS, WARMUP = 50, 3
# The arenas lend memory to the groups' storages: a torch without the storage calls for it (2.11 on the
# lent GPU machines) resizes storages instead, checked by test_without_lending_the_resized_storages_are_counted.
lending = pytest.mark.skipif(not gather_memory._CAN_LEND, reason="this torch cannot lend memory to a storage")


def _train(model, shape, steps: int) -> None:
    opt = infinity.AdamW(model, lr=1e-3)
    for _ in range(steps):
        idx = torch.randint(0, shape.vocab_size, (2, shape.seq_len))
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()


def _tracked(stats: dict) -> dict:
    gather = stats["gather_memory"]
    host = stats["tiers"]["host_allocator"]
    arena = ("slabs", "nbytes", "peak_bytes")
    return {"gather": tuple(gather[k] for k in arena), "kept": tuple(gather["kept"][k] for k in arena),
            "overflows": gather["overflows"],
            "buckets": tuple(stats["reduce_buckets"][k] for k in arena),   # not "waits": a count of events
            "activations": tuple(stats["activations"]["arena"][k] for k in arena),
            "host_allocator": (host["allocations"], host["bytes_allocated"], host["peak_bytes"])}


@lending
@pytest.mark.parametrize("gather_buffer", ["1MiB", 0])
def test_tracked_memory_is_flat_after_warmup(gather_buffer):
    shape = preset("tiny")
    cfg = {"tiers": {"device": "cpu", "params": "host", "optimizer": "host"},
           "precision": {"dtype": "bfloat16"},
           "partition": {"persistence_threshold": 1000, "gather_buffer_bytes": gather_buffer},
           "activations": {"offload": "host", "min_nbytes": 1024}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(shape)
    model.blocks = torch.nn.ModuleList(infinity.activation_checkpoint(b) for b in model.blocks)
    opt = infinity.AdamW(model, lr=1e-3)
    engine_groups = infinity.stats(model)
    g = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(STEPS):
        idx = torch.randint(0, shape.vocab_size, (2, shape.seq_len), generator=g)
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        seen.append(_tracked(infinity.stats(model)))
    changed = [(i, s) for i, s in enumerate(seen) if i >= WARMUP and s != seen[WARMUP]]
    assert not changed, (seen[WARMUP], changed[:2])
    last = seen[-1]
    assert last["overflows"] == 0
    assert last["gather"][0] == last["kept"][0] == last["buckets"][0] == 1      # one slab each, allocated once
    if gather_buffer:
        assert last["gather"][1] == 1 << 20
    stats = infinity.stats(model)
    # Persistent groups (LayerNorms: 128 elements < 1000) borrow exactly their own arena's bytes.
    assert stats["gather_memory"]["kept"]["nbytes"] == stats["gather_memory"]["kept"]["peak_bytes"] > 0
    assert stats["activations"]["total"]["offloaded_tensors"] == STEPS * shape.n_layer
    assert engine_groups["reduce_buckets"]["capacity"] == stats["reduce_buckets"]["capacity"]


def test_buffers_too_small_for_a_group_are_refused_at_init():
    for key, value in (("gather_buffer_bytes", "4KiB"), ("reduce_bucket_bytes", "4KiB")):
        # The largest group is the token embedding: 512 x 64 fp32 elements, 131072 bytes.
        with pytest.raises(EngineError, match=f"partition.{key} = 4096 cannot hold .*'wte'.*131072 bytes.*at least 131072"):
            with infinity.Init({"tiers": {"device": "cpu", "params": "host"}, "partition": {key: value}}):
                GPT(preset("tiny"))


@lending
def test_a_full_gather_buffer_lends_memory_of_its_own_and_counts_it():
    cfg = {"tiers": {"device": "cpu", "params": "host"}, "partition": {"gather_buffer_bytes": "160KiB"},
           "prefetch": {"enabled": False}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(preset("tiny"))
    with pytest.warns(RuntimeWarning, match="partition.gather_buffer_bytes = 163840 is full"):
        with infinity.gathered(model):
            whole = {k: v.clone() for k, v in model.state_dict().items()}
    stats = infinity.stats(model)["gather_memory"]
    assert stats["overflows"] > 0 and stats["overflow_bytes"] > 0 and stats["bytes_in_use"] == 0
    assert whole["wte.weight"].shape == (512, 64)


@lending
def test_buffers_benchmark_tiny(tmp_path, capsys):
    import json

    bench = load_benchmark("buffers")
    out = tmp_path / "buffers.json"
    rc = bench.main(["--path", str(tmp_path), "--params", "nvme", "--buffered", "--layers", "2", "--d-model", "64",
                     "--batch", "2", "--seq", "64", "--vocab", "256", "--steps", "6", "--threads", "1",
                     "--gather-buffer-bytes", "1MiB", "--json", str(out)])
    assert rc == 0
    assert "after step 3: tracked bytes flat" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 6 and result["summary"]["tracked_flat"]
    assert result["steps"][-1]["gather_nbytes"] == 1 << 20 and result["steps"][-1]["gather_overflows"] == 0


@lending
def test_gathers_ahead_stop_where_the_gather_buffer_is_full():
    """prefetch.device_bytes larger than the buffer: the prefetcher gathers ahead only what fits beside
    room for the largest group, and no gather of a training step gets memory of its own. The token
    embedding (128 KiB) stays gathered through backward (the tied head and the embedding both use it),
    so 256 KiB holds it and the largest other group (72 KiB) with room for small ones ahead."""
    shape = preset("tiny")
    cfg = {"tiers": {"device": "cpu", "params": "host"}, "partition": {"gather_buffer_bytes": "256KiB"},
           "prefetch": {"device_bytes": "64MiB"}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(shape)
    _train(model, shape, steps=4)
    stats = infinity.stats(model)
    assert stats["gather_memory"]["overflows"] == 0 and stats["gather_memory"]["nbytes"] == 256 << 10
    assert stats["fetch"]["prefetch_hits"] > 0


def test_without_lending_the_resized_storages_are_counted(monkeypatch):
    """A torch that cannot lend (forced here): gathers resize the groups' storages, the stats count them
    (what is held now, its peak), and a gather buffer, which nothing can hold to, says it has no effect
    and has none (it held prefetching back when it bounded nothing)."""
    monkeypatch.setattr(gather_memory, "_CAN_LEND", False)
    shape = preset("tiny")
    torch.manual_seed(0)
    # 128 KiB: the largest group alone, which as a bound would leave no room to gather ahead.
    with pytest.warns(RuntimeWarning, match=r"partition.gather_buffer_bytes = 131072 has no effect with this torch"):
        with infinity.Init({"tiers": {"device": "cpu", "params": "host"}, "prefetch": {"device_bytes": "1MiB"},
                            "partition": {"gather_buffer_bytes": "128KiB"}}):
            model = GPT(shape)
    _train(model, shape, steps=3)
    assert infinity.stats(model)["fetch"]["prefetch_hits"] > 0     # the key holds nothing back either
    stats = infinity.stats(model)["gather_memory"]
    assert stats["lending"] is False and stats["slabs"] == 0 and stats["capacity"] is None
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    with infinity.gathered(model):      # every group's storage at its padded size
        all_gathered = infinity.stats(model)["gather_memory"]["bytes_in_use"]
    assert whole <= all_gathered < 1.25 * whole, (all_gathered, whole)
    # The token embedding (128 KiB) is the largest group; the peak holds at least it and at most the model.
    assert 128 << 10 <= stats["peak_bytes"] <= all_gathered, (stats, all_gathered)
    assert stats["nbytes"] == stats["bytes_in_use"] < stats["peak_bytes"]
    assert infinity.stats(model)["gather_memory"]["bytes_in_use"] == stats["bytes_in_use"]


def test_a_gather_buffer_too_small_is_refused_naming_the_value_the_config_gave():
    """The message showed the buffer rounded up to whole pages (1003520 for 1000001)."""
    with pytest.raises(EngineError, match=r"partition.gather_buffer_bytes = 1000001 cannot hold group '0' gathered "
                                          r"\(4005888 bytes\); set it to at least 4005888"):
        with infinity.Init({"tiers": {"params": "host", "device": "cpu"},
                            "partition": {"gather_buffer_bytes": 1000001, "persistence_threshold": 0}}):
            torch.nn.Sequential(torch.nn.Linear(1000, 1000))
