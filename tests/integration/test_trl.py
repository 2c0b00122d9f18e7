"""TRL's ``SFTTrainer`` on a model built in ``infinity.Init``, as most people call it: with a ``peft_config``, so
that TRL adds the LoRA adapters after the block ([Note: unmanaged parameters] in infinity/optim/unmanaged.py).

``class SFTTrainer(infinity.Trainer, trl.SFTTrainer)`` trains as plain torch, peft and ``trl.SFTTrainer`` do
(the same losses and adapters, fp32, to 1e-5; the base weights untouched), with host and NVMe tiers; its
checkpoints hold the adapters' Adam states, so a resumed run logs what the run that went on logged; its
``save_model`` writes the files plain peft writes. ``trl.SFTTrainer`` alone, whose checkpoints take
``model.state_dict()`` on one process, is refused at its first step, naming ``infinity.Trainer``.
"""
import os

import pytest
import torch

import infinity
from infinity.errors import EngineError
from tests.integration.test_peft import _LLAMA, _assert_close, _config, _same_adapter
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

STEPS, SAVE = 4, 2


class SFTTrainer(infinity.Trainer, trl.SFTTrainer):
    """TRL's SFTTrainer with infinity's checkpoints, as docs/how-to/huggingface.md writes it."""


def _tokenizer():
    """A word-level tokenizer over the tiny Llama's 64 ids (no download)."""
    words = tokenizers.models.WordLevel({f"t{i}": i for i in range(_LLAMA["vocab_size"])}, unk_token="t1")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(words), pad_token="t0",
                                                eos_token="t0")


def _dataset():
    ids = torch.randint(1, _LLAMA["vocab_size"], (4 * STEPS, 12), generator=torch.Generator().manual_seed(5))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _args(out, **kw):
    kw = {"per_device_train_batch_size": 2, **kw}
    return trl.SFTConfig(str(out), max_steps=STEPS, learning_rate=1e-2, weight_decay=0.01, max_grad_norm=0.5,
                         warmup_steps=1, logging_steps=1, save_steps=SAVE, report_to=[], use_cpu=True, seed=0,
                         data_seed=0, disable_tqdm=True, **kw)


def _engine_model(nvme, preset: str = "offload-host"):
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    with infinity.Init(_config(nvme, preset)):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))


def _trainer(cls, model, out, **kw):
    return cls(model=model, args=_args(out, **kw), train_dataset=_dataset(), processing_class=_tokenizer(),
               peft_config=_lora_config())


def _logged(trainer) -> dict:
    return {r["step"]: (r["loss"], r["grad_norm"], r["learning_rate"])
            for r in trainer.state.log_history if "loss" in r and "grad_norm" in r}


def _plain(tmp_path):
    """trl.SFTTrainer on the plain tiny Llama, trained ``STEPS`` steps."""
    torch.manual_seed(0)
    trainer = _trainer(trl.SFTTrainer, transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)),
                       tmp_path / "plain", save_strategy="no")
    trainer.train()
    return trainer


def _max_difference(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(abs(a - b) for step in want for a, b in zip(got[step], want[step]))


@pytest.mark.parametrize("preset", ["offload-host", "nvme"])
def test_sft_trainer_with_a_peft_config_trains_and_saves_as_plain_trl(tmp_path, preset):
    """Before, infinity.Trainer gave the adapters the Trainer's torch AdamW: its checkpoints held no Adam state
    of theirs, and on several ranks no one averaged their gradients."""
    plain = _plain(tmp_path)
    model = _engine_model(tmp_path / "nvme", preset)
    base = infinity.state_dict(model)
    ours = _trainer(SFTTrainer, model, tmp_path / "out")
    ours.train()
    assert isinstance(ours.optimizer.optimizer, infinity.AdamW)
    assert _max_difference(_logged(ours), _logged(plain)) <= 1e-5
    got = infinity.state_dict(ours.model)
    _assert_close(got, {k: v.detach() for k, v in plain.model.state_dict().items()})
    untouched = [(k, v) for k, v in got.items() if "lora_" not in k]     # the base, under peft's names
    assert len(untouched) == len(base)
    for (key, value), before in zip(untouched, base.values()):
        assert torch.equal(value, before), key
    checkpoint = sorted(os.listdir(tmp_path / "out" / f"checkpoint-{SAVE}"))
    assert {"config.json", "infinity", "scheduler.pt", "trainer_state.json"} <= set(checkpoint), checkpoint
    assert not any(name.endswith(".safetensors") for name in checkpoint), checkpoint
    ours.save_model(str(tmp_path / "final" / "ours"))
    plain.save_model(str(tmp_path / "final" / "theirs"))
    _same_adapter(tmp_path / "final" / "ours", tmp_path / "final" / "theirs")


def test_a_resumed_sft_run_logs_and_ends_as_the_run_that_went_on(tmp_path):
    """The checkpoint holds the adapters' values and Adam states: resumed, the last steps log the same losses,
    grad norms and learning rates, and the adapters end the same. Before, the resumed adapters restarted Adam."""
    whole = _trainer(SFTTrainer, _engine_model(tmp_path / "nvme-a"), tmp_path / "a")
    whole.train()
    resumed = _trainer(SFTTrainer, _engine_model(tmp_path / "nvme-b"), tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{SAVE}"))
    want = {step: logged for step, logged in _logged(whole).items() if step > SAVE}
    got = {step: logged for step, logged in _logged(resumed).items() if step > SAVE}
    assert _max_difference(got, want) <= 1e-6
    _assert_close(infinity.state_dict(resumed.model), infinity.state_dict(whole.model))


def test_sft_trainer_alone_is_refused_at_its_first_step_naming_infinity_trainer(tmp_path):
    """Its checkpoints save the adapter with PeftModel.save_pretrained, which takes model.state_dict() on one
    process: before, the run stopped at its first save (500 steps in, by default), naming only
    infinity.save_pretrained."""
    trainer = _trainer(trl.SFTTrainer, _engine_model(tmp_path / "nvme"), tmp_path / "out")
    with pytest.raises(EngineError, match=r"AdamW.step\(\): SFTTrainer \(a transformers\.Trainer\) with "
                                          r"save_strategy='steps'.*class T\(infinity\.Trainer, SFTTrainer\)"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not os.path.exists(tmp_path / "out" / f"checkpoint-{SAVE}")




def _two_ranks(rank, world, workdir):
    """On each of two ranks launched as torchrun launches them: the SFT run, plain trl.SFTTrainer on the plain
    model (which the Trainer wraps in DistributedDataParallel), then on the engine model trl.SFTTrainer alone
    with save_strategy="no" and a plain loop's torch AdamW over the adapters."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29544")
    ours = _trainer(SFTTrainer, _engine_model(os.path.join(workdir, f"nvme{rank}")), os.path.join(workdir, "out"))
    ours.train()
    torch.manual_seed(0)
    plain = _trainer(trl.SFTTrainer, transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)),
                     os.path.join(workdir, "plain"), save_strategy="no")
    plain.train()
    refused = []
    try:        # wraps the model in DistributedDataParallel, as on a plain model
        _trainer(trl.SFTTrainer, _engine_model(os.path.join(workdir, f"alone{rank}")), os.path.join(workdir, "alone"),
                 save_strategy="no").train()
    except EngineError as exc:
        refused.append(str(exc))
    model = peft.get_peft_model(_engine_model(os.path.join(workdir, f"loop{rank}")), _lora_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(1, _LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        opt.step()
    except EngineError as exc:
        refused.append(str(exc))
    adapters = {k: v for k, v in infinity.state_dict(ours.model).items() if "lora_" in k}
    want = {k: v.detach().clone() for k, v in plain.model.state_dict().items() if "lora_" in k}
    return _max_difference(_logged(ours), _logged(plain)), adapters, want, type(plain.model_wrapped).__name__, refused


def test_two_ranks_train_as_plain_trl_under_ddp_and_a_torch_optimizer_is_refused(tmp_path):
    """On two ranks the SFT run logs the losses, grad norms and learning rates of plain torch + peft +
    trl.SFTTrainer there (DistributedDataParallel), and ends with its adapters. trl.SFTTrainer alone is refused
    as it wraps the engine model in DDP; a torch AdamW over the adapters in a loop of one's own, whose
    gradients nothing averages over the ranks, at its first step: before, each rank trained its own copy,
    silently."""
    for difference, adapters, want, wrapper, refused in run_ranks(_two_ranks, 2, tmp_path):
        assert wrapper == "DistributedDataParallel" and difference <= 1e-5, (wrapper, difference)
        _assert_close(adapters, want)
        assert len(refused) == 2, refused
        assert "DistributedDataParallel wraps a model infinity manages" in refused[0], refused[0]
        assert refused[1].startswith("torch.optim.adamw.AdamW.step(): it holds parameters added to a model built "
                                     "in infinity.Init after the block") and "copies would drift apart" in refused[1] \
            and "infinity.AdamW(model" in refused[1], refused[1]
