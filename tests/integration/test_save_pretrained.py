"""``infinity.save_pretrained``: the directory transformers' ``save_pretrained`` writes for the plain model
(config, generation config, shards, index; tied duplicates dropped as transformers drops them), loadable by
plain ``from_pretrained``, with no more gathered at once than the model's largest group; every rank calls
it, rank 0 writes; a failed write leaves the directory as it was."""
import os

import pytest
import torch

import infinity
from infinity import registry
from infinity.errors import EngineError
from infinity.runtime import hf_save
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_CFG = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}, "precision": {"dtype": "bfloat16"}}


def _gpt2(tied: bool = True, cfg: dict = _CFG):
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = transformers.GPT2LMHeadModel(config)
    opt = infinity.AdamW(model, lr=1e-2)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _llama_tiled():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with infinity.Init({**_CFG, "tiling": {"modules": ["model.layers.*.mlp.*"], "tiles": 2}}):
        return transformers.LlamaForCausalLM(config)


def _files(directory) -> dict:
    """Each file's content: a safetensors file as its tensors, any other file as its bytes."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        out[name] = safetensors_torch.load_file(path) if name.endswith(".safetensors") else open(path, "rb").read()
    return out


def _same_files(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        if isinstance(value, dict):
            assert sorted(got[name]) == sorted(value), name
            for key, tensor in value.items():
                assert got[name][key].dtype == tensor.dtype and torch.equal(got[name][key], tensor), (name, key)
        else:
            assert got[name] == value, name


@pytest.mark.parametrize("make", ["tied", "untied", "tiled-llama"])
@pytest.mark.parametrize("max_shard_size", ["50GB", "20KB"])
def test_the_directory_is_the_one_transformers_writes_for_the_plain_model(tmp_path, make, max_shard_size):
    model = _llama_tiled() if make == "tiled-llama" else _gpt2(tied=make == "tied")[0]
    engine = registry.engine_of(model)
    engine.coordinator.stats.reset()
    result = infinity.save_pretrained(model, tmp_path / "ours", max_shard_size=max_shard_size)
    fetch = infinity.stats(model)["fetch"]
    peak = fetch["peak_live_numel"]
    # Each group gathered once: a tied head's, whose key transformers drops, is not gathered again to be skipped.
    assert fetch["fetches"] == len(engine.coordinator.groups), fetch
    model.save_pretrained(tmp_path / "theirs", state_dict=infinity.state_dict(model), max_shard_size=max_shard_size)
    got, want = _files(tmp_path / "ours"), _files(tmp_path / "theirs")
    _same_files(got, want)
    assert result["files"] == [n for n in want if n.endswith(".safetensors")]
    assert (len(result["files"]) > 1) == (max_shard_size == "20KB")
    if make == "tied":
        assert all("lm_head.weight" not in tensors for tensors in got.values() if isinstance(tensors, dict))
    groups = engine.coordinator.groups
    assert peak <= max(g.numel for g in groups) < sum(g.numel for g in groups), peak
    # Plain transformers loads it: the same logits as the engine model's.
    plain = type(model).from_pretrained(tmp_path / "ours")
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    with torch.no_grad():
        want_logits = model(ids).logits
        assert plain.dtype == torch.bfloat16 and not plain.training
        assert torch.equal(plain(ids).logits, want_logits)
    infinity.release(model)


def test_dtype_converts_and_the_config_says_so(tmp_path):
    model, _ = _gpt2()
    infinity.save_pretrained(model, tmp_path, dtype=torch.float32)
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    want = infinity.state_dict(model)
    assert all(v.dtype == torch.float32 and torch.equal(v, want[k].float()) for k, v in saved.items())
    assert transformers.AutoConfig.from_pretrained(tmp_path).dtype == torch.float32
    infinity.release(model)


def test_the_compiled_model_saves_as_the_model(tmp_path):
    model, _ = _gpt2()
    infinity.save_pretrained(torch.compile(model), tmp_path / "compiled")
    infinity.save_pretrained(model, tmp_path / "model")
    _same_files(_files(tmp_path / "compiled"), _files(tmp_path / "model"))
    infinity.release(model)


def test_a_later_save_leaves_no_file_of_an_earlier_one_behind(tmp_path):
    """transformers leaves model.safetensors beside a later save's shards (a load would read the old
    weights); here each save's files replace the other's."""
    model, opt = _gpt2()
    infinity.save_pretrained(model, tmp_path)
    infinity.save_pretrained(model, tmp_path, max_shard_size="20KB")
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    infinity.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    infinity.release(model)


def test_a_failed_write_leaves_the_directory_as_it_was_and_a_retry_works(tmp_path, monkeypatch):
    model, opt = _gpt2()
    infinity.save_pretrained(model, tmp_path, max_shard_size="20KB")
    before = _files(tmp_path)
    calls = []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        os.pwrite(fd, data.numpy().tobytes(), offset)

    monkeypatch.setattr(hf_save, "_pwrite_all", full_disk)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()      # the weights change: a complete save would differ
    opt.step()
    opt.zero_grad()
    with pytest.raises(EngineError, match=r"writing .* failed; it is left as it was.*No space left"):
        infinity.save_pretrained(model, tmp_path)
    _same_files(_files(tmp_path), before)
    monkeypatch.undo()
    infinity.save_pretrained(model, tmp_path)
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    state = infinity.state_dict(model)
    assert all(torch.equal(v, state[k]) for k, v in saved.items())
    infinity.release(model)


def test_what_is_not_a_transformers_model_engine_is_refused_by_name(tmp_path):
    with infinity.Init(_CFG):
        net = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"torch.save\(infinity.state_dict\(model\)"):
        infinity.save_pretrained(net, tmp_path)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1,
                                                                 n_head=2))
    with pytest.raises(registry.NotManagedError, match="infinity.save_pretrained"):
        infinity.save_pretrained(plain, tmp_path)
    assert os.listdir(tmp_path) == []
    infinity.release(net)


def _two_ranks(rank: int, world: int, workdir: str) -> dict:
    model, _ = _gpt2(cfg={**_CFG, "tiers": {"params": "host", "optimizer": "host"}})
    state = infinity.state_dict(model, rank0_only=True)
    out = os.path.join(workdir, "saved")
    infinity.save_pretrained(model, out, max_shard_size="20KB")
    infinity.release(model)
    return state


def test_every_rank_calls_it_and_rank_0_writes(tmp_path):
    state, other = run_ranks(_two_ranks, 2, tmp_path)
    assert other == {}
    saved = {}
    for name in os.listdir(tmp_path / "saved"):
        if name.endswith(".safetensors"):
            saved.update(safetensors_torch.load_file(tmp_path / "saved" / name))
    assert sorted(saved) == sorted(k for k in state if k != "lm_head.weight")
    assert all(torch.equal(v, state[k]) for k, v in saved.items())


def _fail_on_rank_0(rank: int, world: int, workdir: str, step: str) -> tuple[str, bool]:
    """Save once, then again with rank 0's ``step`` failing; returns (this rank's error, whether the
    directory still holds the first save)."""
    model, opt = _gpt2(cfg={**_CFG, "tiers": {"params": "host", "optimizer": "host"}})
    out = os.path.join(workdir, "saved")
    infinity.save_pretrained(model, out, max_shard_size="20KB")
    before = _files(out) if rank == 0 else None
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()      # the weights change: a complete save would differ
    opt.step()
    opt.zero_grad()
    calls = []

    def failing(real, exc, nth):
        def call(*args, **kwargs):
            calls.append(1)
            if len(calls) == nth:
                raise exc
            return real(*args, **kwargs)
        return call

    where, name, exc, nth = {     # rank 0's nth call of where.name raises exc
        "put": (hf_save, "_pwrite_all", RuntimeError("a tensor the plan did not foresee"), 2),
        "fsync": (os, "fsync", OSError(28, "No space left on device"), 2),
        "config": (transformers.GenerationConfig, "save_pretrained", ValueError("an invalid generation config"), 1),
        "rename": (os, "replace", PermissionError(13, "Permission denied"), 2),
    }[step]
    real = getattr(where, name)
    if rank == 0:
        setattr(where, name, failing(real, exc, nth))
    try:
        with pytest.raises(EngineError) as raised:
            infinity.save_pretrained(model, out, max_shard_size="20KB")
    finally:
        setattr(where, name, real)
    kept = None
    if rank == 0:
        kept = True
        try:
            _same_files(_files(out), before)
        except AssertionError:
            kept = False
        assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)   # nothing left behind
    infinity.release(model)
    return str(raised.value), kept


@pytest.mark.parametrize("step", ["put", "fsync", "config", "rename"])
def test_a_failure_on_rank_0_at_any_step_raises_on_every_rank(tmp_path, step):
    """Rank 0 writes: an error of any kind there, while writing, syncing, writing the configs or moving the
    files into place, is heard by every rank (none waits in a collective or returns as if saved), and before
    the files are moved in the directory is left as it was."""
    (mine, kept), (other, _) = run_ranks(_fail_on_rank_0, 2, tmp_path, step)
    if step == "rename":
        assert "moving the written files into" in mine and "Permission denied" in mine
        assert "on rank 0, moving the written files" in other
    else:
        assert kept and "it is left as it was" in mine and "on rank 0, writing" in other
        assert {"put": "did not foresee", "fsync": "No space left", "config": "invalid generation"}[step] in mine


def _each_node(rank: int, world: int, workdir: str, fail: bool) -> str | None:
    """Each rank the main process of its "node", writing to a directory of its own; rank 1's fsync fails
    when ``fail``."""
    model, _ = _gpt2(cfg={**_CFG, "tiers": {"params": "host", "optimizer": "host"}})
    out = os.path.join(workdir, f"node{rank}")
    real = os.fsync
    if fail and rank == 1:
        os.fsync = lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        infinity.save_pretrained(model, out, max_shard_size="20KB", is_main_process=True)
    except EngineError as exc:
        return str(exc)
    finally:
        os.fsync = real
        infinity.release(model)
    return None


def test_with_is_main_process_each_node_writes_its_own_copy(tmp_path):
    """transformers' save_on_each_node (Trainer passes args.should_save): every main process writes the whole
    directory; one that fails stops them all, and no directory keeps a part of the save."""
    assert run_ranks(_each_node, 2, tmp_path, False) == [None, None]
    _same_files(_files(tmp_path / "node1"), _files(tmp_path / "node0"))
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "node0")
    mine, other = run_ranks(_each_node, 2, tmp_path / "failed", True)[::-1]
    assert "No space left" in mine and "on rank 1, writing" in other
    assert [os.listdir(tmp_path / "failed" / d) for d in ("node0", "node1")] == [[], []]
