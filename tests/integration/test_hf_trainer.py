"""Hugging Face's Trainer on a model built in ``infinity.Init``: the same per-step losses, grad_norm and
final weights as the same Trainer with ``optim="adamw_torch"`` on the plain model (fp32), with
max_grad_norm, weight-decay groups, a warm-up schedule and gradient accumulation; one rank and two.

Trainer clears gradients with ``model.zero_grad()``, clips with ``torch.nn.utils.clip_grad_norm_`` and
builds torch-style param groups: each of those is what this checks, end to end.
"""
import os

import pytest
import torch

import infinity
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 6


def _config(**kw):
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, **kw):
    return transformers.TrainingArguments(**{
        "output_dir": out, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": STEPS,
        "learning_rate": 1e-2, "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_epsilon": 1e-6, "weight_decay": 0.1,
        "max_grad_norm": 0.5, "warmup_steps": 2, "lr_scheduler_type": "linear", "logging_steps": 1,
        "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 0, "data_seed": 0, "disable_tqdm": True,
        **kw})


def _train(model, out: str, **trainer_kw):
    trainer = transformers.Trainer(model=model, args=_args(out), train_dataset=_Tokens(4 * STEPS), **trainer_kw)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    return [r["loss"] for r in logs], [r["grad_norm"] for r in logs], trainer


def _engine_vs_plain(workdir: str, how: str, tiers: tuple[str, str]):
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config())
    torch.manual_seed(0)
    nvme = os.path.join(workdir, f"nvme-{how}-{tiers[0]}")
    os.makedirs(nvme, exist_ok=True)
    with infinity.Init({"tiers": {"params": tiers[0], "optimizer": tiers[1], "nvme_path": nvme},
                        "partition": {"sub_group_size": 4096}}):
        model = transformers.GPT2LMHeadModel(_config())
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.98), "eps": 1e-6}
    if how == "cls":
        engine_kw = {"optimizer_cls_and_kwargs": (infinity.AdamW, kwargs)}
    else:
        decay = [p for n, p in model.named_parameters() if "bias" not in n and ".ln_" not in n]
        rest = [p for n, p in model.named_parameters() if "bias" in n or ".ln_" in n]
        engine_kw = {"optimizers": (infinity.AdamW([{"params": decay, "weight_decay": 0.1},
                                                    {"params": rest, "weight_decay": 0.0}], **kwargs), None)}
    losses, norms, _ = _train(model, os.path.join(workdir, f"engine-{how}"), **engine_kw)
    ref_losses, ref_norms, _ = _train(ref, os.path.join(workdir, f"plain-{how}"))
    with infinity.gathered(model):
        param_diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "params": param_diff, "steps": (len(losses), len(ref_losses)), "zero_norm": min(norms)}


def _check(result):
    assert result["steps"] == (STEPS, STEPS), result
    assert result["zero_norm"] > 0.0, result
    assert result["loss"] <= 1e-5 and result["norm"] <= 1e-5 and result["params"] <= 1e-5, result


@pytest.mark.parametrize("how", ["cls", "optimizers"])
@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")])
def test_trainer_on_an_engine_model_matches_trainer_on_the_plain_model(tmp_path, how, tiers):
    _check(_engine_vs_plain(str(tmp_path), how, tiers))


def _on_rank(rank, world, workdir):
    # Trainer sees one process per rank (no launcher's environment): both ranks train on the same
    # batches, so the engine's mean over ranks equals the single process's gradient.
    return _engine_vs_plain(os.path.join(workdir, f"rank{rank}"), "cls", ("host", "host"))


def test_trainer_on_two_ranks(tmp_path):
    for result in run_ranks(_on_rank, 2, tmp_path):
        _check(result)


@pytest.mark.parametrize("how", ["cls", "instance"])
def test_a_trainer_that_would_save_its_own_checkpoints_is_refused_before_any_update(tmp_path, how):
    """save_strategy "steps" (the default) saves at save_steps and at the end through model.state_dict() on
    the main process: refused when the Trainer creates the optimizer, or at its first step of one given to it
    ([Note: Trainer's checkpoints] in infinity/optim/checks.py), not after the training it would have lost."""
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
        model = transformers.GPT2LMHeadModel(_config())
    with infinity.gathered(model):
        before = [p.detach().clone() for p in model.parameters()]
    args = _args(str(tmp_path / "out"))
    args.save_strategy = "steps"
    if how == "cls":
        kw = {"optimizer_cls_and_kwargs": (infinity.AdamW, {"lr": 1e-2})}
    else:
        opt = infinity.AdamW(model, lr=1e-2)
        kw = {"optimizers": (opt, None)}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(4 * STEPS), **kw)
    with pytest.raises(infinity.runtime.engine.EngineError, match=r"save_strategy='steps'.*save_strategy=\"no\""):
        trainer.train()
    if how == "instance":
        assert opt.step_count == 0
    with infinity.gathered(model):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    infinity.release(model)


def test_a_trainer_saving_only_its_best_model_without_evaluating_is_not_refused(tmp_path):
    """save_strategy "best" saves after an evaluation that improved its metric: with no evaluation it never
    saves, and trains as save_strategy "no" does."""
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
        model = transformers.GPT2LMHeadModel(_config())
    args = _args(str(tmp_path / "out"))
    args.save_strategy, args.metric_for_best_model = "best", "loss"
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(4 * STEPS),
                                   optimizer_cls_and_kwargs=(infinity.AdamW, {"lr": 1e-2}))
    trainer.train()
    assert trainer.state.global_step == STEPS
    infinity.release(model)


def test_a_step_infinity_skips_does_not_advance_the_trainers_schedule(tmp_path):
    """fp16's overflowing steps are skipped by infinity itself, and accelerate hears of a skipped step only from its
    own GradScaler: the Trainer stepped its scheduler past steps never taken (a warmup spent on them). Now it
    holds the schedule on every skipped step, as with the Trainer's fp16 GradScaler and with DeepSpeed, and the
    clipping it does by default skips them too (max_grad_norm > 0: a NaN norm)."""
    for clip in (0.0, 0.5):
        torch.manual_seed(0)
        with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}, "partition": {"sub_group_size": 4096},
                            "precision": {"dtype": "float16", "initial_scale": 2.0 ** 11, "hysteresis": 1}}):
            model = transformers.GPT2LMHeadModel(_config())
        trainer = infinity.Trainer(model=model, args=_args(str(tmp_path / f"out-{clip}"), max_grad_norm=clip),
                                   train_dataset=_Tokens(4 * STEPS))
        trainer.train()
        opt = trainer.optimizer.optimizer
        assert opt.skipped_steps >= 1 and opt.step_count >= 1, (opt.skipped_steps, opt.step_count)
        assert opt.skipped_steps + opt.step_count == STEPS
        assert trainer.lr_scheduler.last_epoch == opt.step_count     # one scheduler step a step taken
        infinity.release(model)
