"""LoRA (peft) on an engine model, and a layer frozen in every block, saved as plain peft and torch save them.

Under the presets each transformer block is one unit ([Note: units] in infinity/runtime/construction.py);
frozen in part inside ``Init`` it becomes two groups, a trainable and a frozen one, together larger than the
largest single group. The state-dict walk then descends into the block's children, which gather no group of
their own (their unit does): it read them released, and every save path refused, naming
``infinity.state_dict``, the call that failed. Each save is compared here with the plain model trained the same
way (fp32, to 1e-5), with no more gathered at once than the model's largest group.
"""
import json
import os

import pytest
import torch

import infinity
from infinity import registry
from infinity.config import load_config
from infinity.checkpoint.errors import CheckpointMismatchError
from infinity.errors import EngineError

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_STEPS = 3


def _config(tmp_path, preset: str = "offload-host"):
    return load_config(preset, overrides={"tiers": {"device": "cpu", "nvme_path": str(tmp_path)},
                                          "precision": {"dtype": "float32"}})


def _lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _freeze_down_proj(model):
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.requires_grad_(False)
    return model


def _pair(tmp_path, edit, preset: str = "offload-host"):
    """(engine model, plain model): the tiny Llama with ``edit`` applied, inside ``infinity.Init`` and without,
    from the same seed, each trained ``_STEPS`` steps of AdamW on the same tokens."""
    torch.manual_seed(0)
    plain = edit(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)))
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path, preset)):
        model = edit(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)))
    pairs = [(model, infinity.AdamW(model, lr=1e-2, weight_decay=0.0)),
             (plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2,
                                       weight_decay=0.0))]
    for ours, theirs in _train(pairs, _STEPS, torch.Generator().manual_seed(1)):
        assert ours == pytest.approx(theirs, abs=1e-5)
    return model, plain


def _peak_gathered(model, run):
    """The most elements ``model``'s engine held gathered at once while ``run()`` ran, and its result."""
    engine = registry.engine_of(model)
    engine.coordinator.stats.reset()
    result = run()
    return infinity.stats(model)["fetch"]["peak_live_numel"], result


def _largest_group(model) -> int:
    return max(g.numel for g in registry.engine_of(model).coordinator.groups)


def _assert_close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].shape == tensor.shape and got[key].dtype == tensor.dtype, key
        torch.testing.assert_close(got[key], tensor, atol=1e-5, rtol=0, msg=key)


def _weights(directory) -> dict:
    """The tensors of every safetensors file in ``directory``, by key (in key order: a file's own order is
    the writer's)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(directory, name)))
    return dict(sorted(out.items()))


@pytest.mark.parametrize("edit", [_lora, _freeze_down_proj], ids=["lora", "frozen-layer"])
def test_state_dict_of_a_block_frozen_in_part_is_the_plain_models(tmp_path, edit):
    model, plain = _pair(tmp_path, edit)
    peak, got = _peak_gathered(model, lambda: infinity.state_dict(model))
    _assert_close(got, {k: v.detach() for k, v in plain.state_dict().items()})
    assert peak <= _largest_group(model), peak
    for p, q in zip(model.parameters(), plain.parameters()):    # frozen base weights untouched
        assert p.requires_grad == q.requires_grad


@pytest.mark.parametrize("edit", [_lora, _freeze_down_proj], ids=["lora", "frozen-layer"])
def test_save_pretrained_of_a_block_frozen_in_part_writes_the_plain_models_files(tmp_path, edit):
    model, plain = _pair(tmp_path, edit)
    inner = model.base_model.model if edit is _lora else model        # the transformers model under peft's
    plain_inner = plain.base_model.model if edit is _lora else plain
    peak, _ = _peak_gathered(model, lambda: infinity.save_pretrained(inner, tmp_path / "ours"))
    plain_inner.save_pretrained(tmp_path / "theirs")
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "theirs"))
    _assert_close(_weights(tmp_path / "ours"), _weights(tmp_path / "theirs"))
    assert peak <= _largest_group(model), peak


def _files(directory) -> dict:
    """Each file of ``directory``: a safetensors file as its tensors (key order), any other as its bytes."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        out[name] = _weights_of(path) if name.endswith(".safetensors") else open(path, "rb").read()
    return out


def _weights_of(path) -> dict:
    return dict(sorted(safetensors_torch.load_file(path).items()))


def _same_adapter(ours, theirs) -> None:
    """``ours`` holds what plain peft wrote in ``theirs``: the same files, config and model card byte for byte,
    the adapter's tensors to 1e-5."""
    got, want = _files(ours), _files(theirs)
    assert list(got) == list(want) and "adapter_model.safetensors" in want
    for name, value in want.items():
        if isinstance(value, dict):
            _assert_close(got[name], value)
        elif name != "training_args.bin":
            assert got[name] == value, name


def _adapter_groups(model) -> int:
    """How many groups hold LoRA parameters (one per block under the presets' units)."""
    group_of = registry.engine_of(model).coordinator.group_of
    return len({group_of[p] for name, p in model.named_parameters() if "lora_" in name})


def test_infinity_save_pretrained_of_a_peft_model_writes_the_adapter_as_peft_does(tmp_path):
    model, plain = _pair(tmp_path, _lora)
    engine = registry.engine_of(model)
    engine.coordinator.stats.reset()
    result = infinity.save_pretrained(model, tmp_path / "ours")
    fetch = infinity.stats(model)["fetch"]
    plain.save_pretrained(tmp_path / "theirs")
    _same_adapter(tmp_path / "ours", tmp_path / "theirs")
    assert result["files"] == ["adapter_model.safetensors"]
    # Only the adapter's groups are gathered, each once: the frozen base weights are not read.
    assert fetch["fetches"] == _adapter_groups(model), fetch
    # Plain peft loads it onto the plain base: the engine model's logits.
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ours")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_peft_save_pretrained_says_what_saves_the_adapter(tmp_path):
    model, plain = _pair(tmp_path, _lora)
    with pytest.raises(EngineError, match=r"PeftModel.save_pretrained\(\).*infinity.save_pretrained"
                                                   r"\(model, d\).*gathering only the adapter"):
        model.save_pretrained(tmp_path / "refused")
    assert not os.path.exists(tmp_path / "refused" / "adapter_model.safetensors")
    # What the message offers besides infinity.save_pretrained writes the same files.
    model.save_pretrained(tmp_path / "ours", state_dict=infinity.state_dict(model))
    plain.save_pretrained(tmp_path / "theirs")
    _same_adapter(tmp_path / "ours", tmp_path / "theirs")


def test_trainer_save_model_of_a_peft_model_writes_the_adapter(tmp_path):
    model, plain = _pair(tmp_path, _lora)
    args = transformers.TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True)
    infinity.Trainer(model=model, args=args).save_model(str(tmp_path / "ours"))
    transformers.Trainer(model=plain, args=args).save_model(str(tmp_path / "theirs"))
    _same_adapter(tmp_path / "ours", tmp_path / "theirs")


def _lora_after(tmp_path, seed: int = 0):
    """The tiny Llama built in ``Init``, its LoRA added after the block as most people (and TRL's SFTTrainer with
    a ``peft_config``) add it: the adapters are plain parameters the engine does not manage ([Note: unmanaged
    parameters] in infinity/optim/unmanaged.py)."""
    torch.manual_seed(seed)
    with infinity.Init(_config(tmp_path)):
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    return _lora(base)


def _train(pairs, steps: int, generator) -> list:
    """``steps`` steps of each (model, optimizer) on the same tokens; the losses of each step, per pair."""
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=generator)
        losses = []
        for net, opt in pairs:
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out


def test_get_peft_model_after_init_trains_saves_and_resumes_as_plain_peft(tmp_path):
    model = _lora_after(tmp_path)
    torch.manual_seed(0)
    plain = _lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)))
    base_before = {k: v.clone() for k, v in infinity.state_dict(model).items() if "lora_" not in k}
    added = [n for n, p in model.named_parameters() if p not in registry.engine_of(model).coordinator.group_of]
    assert len(added) == 8 and all("lora_" in n for n in added)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
    pairs = [(model, opt), (plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2,
                                                      weight_decay=0.01))]
    generator = torch.Generator().manual_seed(1)
    for ours, theirs in _train(pairs, _STEPS, generator):
        assert ours == pytest.approx(theirs, abs=1e-5)
    got = infinity.state_dict(model)
    _assert_close(got, {k: v.detach() for k, v in plain.state_dict().items()})
    for key, value in base_before.items():      # the frozen base weights untouched
        assert torch.equal(got[key], value), key
    infinity.save_pretrained(model, tmp_path / "ours")
    plain.save_pretrained(tmp_path / "theirs")
    _same_adapter(tmp_path / "ours", tmp_path / "theirs")
    # A checkpoint holds the adapters and their Adam states: a fresh model resumes where this one goes on.
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh = _lora_after(tmp_path / "fresh", seed=5)
    fresh_opt = infinity.AdamW(fresh, lr=1e-2, weight_decay=0.01)
    infinity.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    state = generator.get_state()
    (went_on, plain_on), = _train(pairs, 1, generator)
    generator.set_state(state)
    (resumed, _), = _train([(fresh, fresh_opt), (plain, pairs[1][1])], 1, generator)
    assert resumed == pytest.approx(went_on, abs=1e-5) and went_on == pytest.approx(plain_on, abs=1e-5)


def test_a_checkpoint_of_adapters_added_after_init_loads_only_into_the_same_adapters(tmp_path):
    model = _lora_after(tmp_path)
    opt = infinity.AdamW(model, lr=1e-2)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    with infinity.Init(_config(tmp_path / "inside")):     # the same names, the adapters managed
        inside = _lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)))
    with pytest.raises(CheckpointMismatchError, match=r"8 parameter\(s\) of the model are not in the checkpoint: "
                                                      r"'base_model.model.model.layers.0.self_attn.q_proj.lora_A"):
        infinity.load_checkpoint(tmp_path / "ckpt", inside)
    consolidated = infinity.checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    _assert_close({k: whole[k] for k in sorted(whole)}, dict(sorted(infinity.state_dict(model).items())))
    assert consolidated


def _lora_saving_a_module(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=["lm_head"]))


def test_an_adapter_with_modules_to_save_saves_as_peft_saves_it(tmp_path):
    """modules_to_save (SEQ_CLS adds its head so): peft asks the wrapper's state_dict() for its keys alone, which
    a released parameter refused, so no way of saving such an adapter worked, the one the refusal named included
    ([Note: save_pretrained refused before it writes] in infinity/runtime/save_guard.py). It saves as peft does."""
    model, plain = _pair(tmp_path, _lora_saving_a_module)
    infinity.save_pretrained(model, tmp_path / "ours")
    plain.save_pretrained(tmp_path / "theirs")
    _same_adapter(tmp_path / "ours", tmp_path / "theirs")
    model.save_pretrained(tmp_path / "given", state_dict=infinity.state_dict(model))   # the refusal's other way
    _same_adapter(tmp_path / "given", tmp_path / "theirs")
    infinity.release(model)


def test_a_saved_adapter_loads_onto_a_base_built_before_it_and_trains_on(tmp_path):
    """PeftModel.from_pretrained (and load_adapter) on an engine base: peft reads the model's state_dict() keys
    to map the file's keys, which a released parameter refused; loading worked only inside the Init block.
    Now it loads after it too, with the logits and the training of a plain base's."""
    torch.manual_seed(0)
    plain = _lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)))
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    _train([(plain, opt)], 2, torch.Generator().manual_seed(3))
    plain.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path)):
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    torch.manual_seed(0)
    twin = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)),
                                          tmp_path / "adapter", is_trainable=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, atol=1e-5, rtol=0)
    pairs = [(model, infinity.AdamW(model, lr=1e-2, weight_decay=0.0)),
             (twin, torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0))]
    for ours, theirs in _train(pairs, 2, torch.Generator().manual_seed(4)):
        assert ours == pytest.approx(theirs, abs=1e-5)
    model.load_adapter(tmp_path / "adapter", adapter_name="two")
    twin.load_adapter(tmp_path / "adapter", adapter_name="two")
    model.set_adapter("two")
    twin.set_adapter("two")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, atol=1e-5, rtol=0)
    infinity.release(model)


def test_an_optimizer_over_an_inactive_adapter_hooks_it_when_it_trains(tmp_path):
    """An adapter left inactive by set_adapter is frozen: infinity.AdamW(model) raised torch's "cannot register a
    hook on a tensor that doesn't require gradient", where torch.optim.AdamW(model.parameters()) takes it. It is
    hooked at the first forward that trains it, and the run equals one whose optimizer met it trainable."""
    runs = []
    for frozen_at_creation in (True, False):
        model = _lora_after(tmp_path / str(frozen_at_creation))
        torch.manual_seed(2)
        model.add_adapter("b", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        model.set_adapter("b")      # "default" frozen
        if not frozen_at_creation:
            for name, p in model.named_parameters():
                p.requires_grad_(p.requires_grad or "lora_" in name)
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.0)
        if not frozen_at_creation:
            model.set_adapter("b")
        assert bool(opt.unmanaged.frozen) == frozen_at_creation
        losses = _train([(model, opt)], 2, torch.Generator().manual_seed(5))
        model.set_adapter("default")
        losses += _train([(model, opt)], 2, torch.Generator().manual_seed(6))
        assert not opt.unmanaged.frozen     # hooked by the forward that trained it
        runs.append(losses)
        infinity.release(model)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("extra", [{"modules_to_save": ["lm_head"]}, {"use_dora": True}], ids=["modules_to_save", "dora"])
def test_an_adapter_that_reads_base_weights_added_after_init_names_the_init_block(tmp_path, extra):
    """Added after the block, an adapter that copies or reads a base weight met the general refusal, which named
    infinity.gathered; inside it the pickling or the exit refusal came instead. The way that works is adding it
    inside the Init block (where it trains as peft's own), and that is what the refusal says now."""
    torch.manual_seed(0)
    with infinity.Init(_config(tmp_path)):
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
    with pytest.raises(EngineError, match=r"peft copies or reads a base weight while adding this adapter.*"
                                          r"inside the infinity.Init block"):
        peft.get_peft_model(base, config)
    infinity.release(base)
