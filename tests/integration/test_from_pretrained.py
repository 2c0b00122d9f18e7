"""``from_pretrained`` under ``infinity.Init`` (and ``infinity.from_pretrained``): the checkpoint's
safetensors shards are streamed into the tiers, and the loaded model equals transformers' own
``from_pretrained`` of the same checkpoint exactly, weights and loss, on one rank and two.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import infinity
from infinity import registry
from infinity.errors import EngineError
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _llama():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=False)


def _gpt2():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0)


def _save(directory: str, config, model_class) -> str:
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory, max_shard_size="16KB")   # several shards
    return directory


def _cfg(workdir: str, params: str = "nvme"):
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    return {"tiers": {"params": params, "optimizer": "nvme", "nvme_path": nvme}, "partition": {"sub_group_size": 4096}}


def _loss(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def _compare(model, ref) -> dict:
    with infinity.gathered(model):
        names = [n for n, _ in model.named_parameters()]
        equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    with torch.no_grad():
        loss, ref_loss = _loss(model), _loss(ref)
    return {"names": names == [n for n, _ in ref.named_parameters()], "equal": equal,
            "loss": loss.item(), "ref_loss": ref_loss.item(), "training": model.training}


def _load_both(checkpoint: str, workdir: str, how: str) -> dict:
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    if how == "init":
        with infinity.Init(_cfg(workdir)):
            model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    else:
        model = infinity.from_pretrained(transformers.LlamaForCausalLM, checkpoint, _cfg(workdir, "host"))
    try:
        return _compare(model, ref)
    finally:
        infinity.release(model)


def _check(result):
    assert result["names"] and result["equal"], result
    assert result["loss"] == result["ref_loss"] and not result["training"], result


def test_loaded_llama_equals_transformers_own_load(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    assert len([f for f in os.listdir(checkpoint) if f.endswith(".safetensors")]) > 3
    _check(_load_both(checkpoint, str(tmp_path), "function"))


def test_tied_gpt2_loads_tied_and_the_route_is_removed_on_exit(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _gpt2(), transformers.GPT2LMHeadModel)
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    ref = transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
    with infinity.Init(_cfg(str(tmp_path))):
        assert transformers.PreTrainedModel.__dict__["from_pretrained"] is not original
        model = transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    assert model.lm_head.weight is model.transformer.wte.weight
    _check(_compare(model, ref))
    infinity.release(model)
    with pytest.raises(RuntimeError, match="boom"):
        with infinity.Init(_cfg(str(tmp_path))):
            raise RuntimeError("boom")
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original


def test_missing_head_keeps_its_init_and_is_named(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _gpt2(), transformers.GPT2LMHeadModel)
    ref = transformers.GPT2Model.from_pretrained(checkpoint)
    with pytest.warns(UserWarning, match=r"no values for \['score.weight'\]"):
        with infinity.Init(_cfg(str(tmp_path))):
            model = transformers.GPT2ForSequenceClassification.from_pretrained(checkpoint, num_labels=3)
    with infinity.gathered(model):
        assert all(torch.equal(p, q) for p, q in zip(model.transformer.parameters(), ref.parameters()))
        assert model.score.weight.shape == (3, 32) and model.score.weight.abs().sum() > 0
    infinity.release(model)


def test_refused_checkpoints_and_options_say_why(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _gpt2(), transformers.GPT2LMHeadModel)
    cfg = _cfg(str(tmp_path))
    with pytest.raises(EngineError, match=r"dtype=torch.bfloat16.*\[precision\] dtype"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, cfg, dtype=torch.bfloat16)
    # Under bf16 compute, float32 would be a model computing in another dtype than asked: refused as well.
    bf16 = dict(cfg, precision={"dtype": "bfloat16"})
    with pytest.raises(EngineError, match=r"dtype=torch.float32.*\[precision\] dtype .*torch.bfloat16 here"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, bf16, dtype=torch.float32)
    model = infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, bf16, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    infinity.release(model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_emdb'"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, cfg, n_emdb=8)
    with pytest.raises(EngineError, match="ignore_mismatched_sizes=True"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, cfg, ignore_mismatched_sizes=True)
    # transformers' own loading options that change nothing here are taken (they were "unexpected"), and so are
    # the keywords transformers passes between its own layers (AutoModel -> the class, a pipeline -> AutoModel).
    model = infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, cfg, low_cpu_mem_usage=True,
                                     ignore_mismatched_sizes=False, disable_mmap=True, _from_auto=True,
                                     _from_pipeline="text-generation", _commit_hash="0" * 40,
                                     generation_config=transformers.GenerationConfig(max_new_tokens=3, eos_token_id=0))
    assert model.generation_config.max_new_tokens == 3
    infinity.release(model)
    # Options that would place, rename or swap what is loaded: refused by name, with the reason.
    for key, value, why in [("device_map", "auto", "places every state itself"),
                            ("use_kernels", True, "torch forward, not hub kernels"),
                            ("variant", "fp16", "reads model.safetensors"),
                            ("key_mapping", {"a": "b"}, "renames no checkpoint key")]:
        with pytest.raises(EngineError, match=rf"does not support {key}=: .*{why}"):
            infinity.from_pretrained(transformers.GPT2LMHeadModel, checkpoint, cfg, **{key: value})
    # A renamed key: the model misses one parameter and the checkpoint has one left over.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in ("config.json",):
        (renamed / name).write_bytes((tmp_path / "ckpt" / name).read_bytes())
    state = {}
    for f in sorted(os.listdir(checkpoint)):
        if f.endswith(".safetensors"):
            state.update(safetensors_torch.load_file(os.path.join(checkpoint, f)))
    state["transformer.ln_f.gamma"] = state.pop("transformer.ln_f.weight")
    safetensors_torch.save_file(state, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"transformer.ln_f.weight.*transformer.ln_f.gamma.*weight conversions"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, str(renamed), cfg)
    state["transformer.ln_f.weight"] = state.pop("transformer.ln_f.gamma")[:16]
    safetensors_torch.save_file(state, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"'transformer.ln_f.weight' in .* has shape \[16\].* has \[32\]"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, str(renamed), cfg)
    os.remove(renamed / "model.safetensors")
    torch.save(state, renamed / "pytorch_model.bin")
    with pytest.raises(EngineError, match=r"streams safetensors checkpoints.*pytorch_model.bin"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, str(renamed), cfg)


_FIRST_IMPORT_INSIDE_INIT = """
import sys
import torch, transformers, infinity
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
assert "transformers.models.llama.modeling_llama" not in sys.modules
torch.manual_seed(0)
with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
    model = transformers.LlamaForCausalLM(config)      # modeling_llama is imported (and decorated) in here
plain = transformers.LlamaForCausalLM(config)
plain.load_state_dict(infinity.state_dict(model))
ids = torch.randint(0, 64, (2, 8))
with torch.no_grad():
    assert torch.equal(plain(ids).logits, model(ids).logits)
model(ids, labels=ids).loss.backward()
print("kernels" if "_kernel_funcs" in vars(plain.model.layers[0].self_attn) else "no kernels", "ok")
"""


def test_a_model_class_first_imported_inside_init_still_builds_plain_after_it():
    """transformers imports a model's module at first use, here inside Init, where its classes are wrapped as
    they are defined; with the ``kernels`` package their ``__init__`` is decorated after that. A plain model built
    after the context must get the decorator's state (it raised AttributeError: no '_kernel_funcs'). A process
    of its own: in this one the module may have been imported already."""
    proc = subprocess.run([sys.executable, "-c", _FIRST_IMPORT_INSIDE_INIT], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stderr[-3000:]


def _on_rank(rank, world, workdir, checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_both(checkpoint, os.path.join(workdir, f"rank{rank}"), "init")


def test_two_ranks_each_load_their_shard(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    for result in run_ranks(_on_rank, 2, tmp_path / "ranks", checkpoint):
        _check(result)


def test_each_shard_is_written_once_and_nothing_is_read_back(tmp_path):
    # Every parameter is in the checkpoint: the model is built without values and each group's
    # compute copy and master are written once (fp32: 4 + 4 bytes per element), at Init's exit.
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    with infinity.Init(_cfg(str(tmp_path))):
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    nvme = infinity.stats(model)["tiers"]["nvme"]
    shard_numel = sum(g.shard_numel for g in registry.engine_of(model).coordinator.groups)
    assert nvme["bytes_written"] == 8 * shard_numel and nvme["bytes_read"] == 0, (nvme, shard_numel)
    _check(_compare(model, transformers.LlamaForCausalLM.from_pretrained(checkpoint)))
    infinity.release(model)


class _TouchConfig(transformers.PretrainedConfig):
    model_type = "infinity-test-touch"

    def __init__(self, width: int = 16, **kwargs) -> None:
        super().__init__(**kwargs)
        self.width = width


class _Touching(transformers.PreTrainedModel):
    """Its __init__ edits a child's parameter after the child was built (and sharded)."""

    config_class = _TouchConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        self.inner = torch.nn.Linear(config.width, config.width)
        self.head = torch.nn.Linear(config.width, 3)
        with torch.no_grad():
            self.inner.weight.mul_(0.5)
        self.post_init()

    def forward(self, x):
        return self.head(self.inner(x))


def test_a_group_touched_while_built_still_gets_the_checkpoint_values(tmp_path):
    torch.manual_seed(0)
    _Touching(_TouchConfig()).save_pretrained(str(tmp_path / "ckpt"))
    ref = _Touching.from_pretrained(str(tmp_path / "ckpt"))
    with infinity.Init(_cfg(str(tmp_path))):
        model = _Touching.from_pretrained(str(tmp_path / "ckpt"))
    with infinity.gathered(model):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)


def test_a_bf16_checkpoint_loads_exactly_into_fp32_masters(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama()).to(torch.bfloat16).save_pretrained(str(tmp_path / "ckpt"))
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    with infinity.Init(_cfg(str(tmp_path))):
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    with infinity.gathered(model):
        assert all(p.dtype == torch.float32 and torch.equal(p, q.float())
                   for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)


def test_bf16_compute_with_split_masters_keeps_the_fp32_checkpoint_exactly(tmp_path):
    # bf16 compute with both tiers on NVMe stores each master as its compute copy plus a remainder
    # (infinity/optim/split_master.py): the load writes the copy once, through the masters, and the
    # masters are the checkpoint's fp32 values bit for bit.
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    ref = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    cfg = dict(_cfg(str(tmp_path)), precision={"dtype": "bfloat16"})
    with infinity.Init(cfg):
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    engine = registry.engine_of(model)
    assert engine.store.split is not None
    nvme = infinity.stats(model)["tiers"]["nvme"]
    shard_numel = sum(g.shard_numel for g in engine.coordinator.groups)
    assert nvme["bytes_written"] == 4 * shard_numel and nvme["bytes_read"] == 0, (nvme, shard_numel)
    opt = infinity.AdamW(model, lr=1e-3)
    masters = torch.cat(opt.state_dict()["shards"]["master"])
    names = {id(p): n for n, p in model.named_parameters()}
    ref_values = dict(ref.named_parameters())
    for g in engine.coordinator.groups:
        start = engine.layout.group_starts[g.index]
        for slot in g.slots:
            want = ref_values[names[id(slot.param)]].detach().reshape(-1)
            got = masters[start + slot.offset:start + slot.offset + slot.numel]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), names[id(slot.param)]
    with infinity.gathered(model):
        assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(model)


def test_a_checkpoint_frozen_in_part_inside_init_loads_exactly_and_its_frozen_part_is_dormant(tmp_path):
    """Each decoder layer one group (``partition.units``), its matrices frozen in the Init block (BitFit
    after the load): the exit splits each layer's group, whose values come from the files then
    ([Note: frozen inside a group] in infinity/runtime/construction.py); the frozen halves are dormant."""
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    ref = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    cfg = dict(_cfg(str(tmp_path)), partition={"sub_group_size": 4096, "units": "auto"})
    with infinity.Init(cfg):
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
        for p in model.parameters():
            p.requires_grad_(p.dim() < 2)
    engine = registry.engine_of(model)
    layer = engine.coordinator.module_groups[model.model.layers[0]]
    assert [g.has_trainable for g in layer] == [True, False]
    frozen_subs = {p.sub_index for g in engine.coordinator.groups if not g.has_trainable
                   for p in engine.layout.pieces_of_group[g.index]}
    assert frozen_subs and frozen_subs <= set(engine.store.dormant)
    _check(_compare(model, ref))
    infinity.release(model)


def test_a_cut_safetensors_file_is_named(tmp_path):
    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    victim = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))[0]
    with open(os.path.join(checkpoint, victim), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(checkpoint, victim)) - 1)
    with pytest.raises(EngineError, match=rf"{victim}.*the file is damaged"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, checkpoint, _cfg(str(tmp_path)))


@pytest.mark.parametrize("model_class", ["LlamaForCausalLM", "AutoModelForCausalLM"])
def test_auto_tiers_are_sized_for_the_checkpoints_model(tmp_path, model_class):
    """infinity.from_pretrained(cls, path, "auto") had no model to size the placement for, and always failed
    naming Init(model=...), which it does not take. It is now sized for the model the checkpoint's config
    describes (built on the meta device), and loads as transformers' own load does."""
    from infinity.plan.machine import MachineProfile

    checkpoint = _save(str(tmp_path / "ckpt"), _llama(), transformers.LlamaForCausalLM)
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    cfg = _cfg(str(tmp_path))
    cfg["tiers"].update(params="auto", optimizer="auto")
    small = MachineProfile(name="small", device_bytes=0, host_bytes=2**30, nvme_bytes=2**34, unified=True,
                           disk_read_gbps=2.0, disk_write_gbps=2.0)
    model = infinity.from_pretrained(getattr(transformers, model_class), checkpoint, cfg, machine=small)
    decision = registry.engine_of(model).placement
    assert decision is not None and decision.chosen.placement.params_tier is not None
    _check(_compare(model, ref))
    infinity.release(model)
