"""``infinity.Trainer``: Hugging Face's Trainer saving and resuming an engine model's checkpoints through
infinity ([Note: Trainer's checkpoints through infinity] in infinity/checkpoint/trainer.py).

A run stopped after its checkpoint and resumed from it with ``resume_from_checkpoint`` logs the same
losses, grad norms and learning rates as the run that went on, and ends with the same weights; on one
rank and two, with the states in host memory or on NVMe. ``save_model`` writes ordinary weights.
"""
import os

import pytest
import torch

import infinity
from infinity.checkpoint import CheckpointNotFoundError
from infinity.errors import EngineError
from tests.integration.test_hf_trainer import _config, _Tokens
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, SAVE = 6, 3


def _model(nvme: str, tier: str, **config):
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": tier, "optimizer": tier, "nvme_path": nvme},
                        "partition": {"sub_group_size": 4096}}):
        return transformers.GPT2LMHeadModel(_config(**config))


def _trainer(model, out: str, steps: int = STEPS):
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=SAVE, report_to=[], use_cpu=True, seed=0, data_seed=0,
        disable_tqdm=True)
    return infinity.Trainer(model=model, args=args, train_dataset=_Tokens(4 * STEPS),
                            optimizer_cls_and_kwargs=(infinity.AdamW, {"lr": 1e-2, "betas": (0.9, 0.98)}))


def _logged(trainer) -> dict:
    return {r["step"]: (r["loss"], r["grad_norm"], r["learning_rate"])
            for r in trainer.state.log_history if "loss" in r and "grad_norm" in r}


def _weights(model) -> list:
    with infinity.gathered(model):
        return [p.detach().clone() for p in model.parameters()]


def _resume_matches_the_run_that_went_on(workdir: str, tier: str, rank: int = 0) -> dict:
    whole = _trainer(_model(os.path.join(workdir, f"nvme-a{rank}"), tier), os.path.join(workdir, "a"))
    whole.train()
    checkpoint = os.path.join(workdir, "a", f"checkpoint-{SAVE}")
    written = sorted(os.listdir(checkpoint))
    resumed = _trainer(_model(os.path.join(workdir, f"nvme-b{rank}"), tier), os.path.join(workdir, "b"))
    resumed.train(resume_from_checkpoint=checkpoint)
    want = _logged(whole)
    got = {step: logged for step, logged in _logged(resumed).items() if step > SAVE}   # with the saved history
    return {"steps": sorted(got), "written": written,
            "logs": max(abs(a - b) for s in got for a, b in zip(got[s], want[s])),
            "weights": max(float((p - q).abs().max()) for p, q in zip(_weights(whole.model), _weights(resumed.model)))}


def _check(result) -> None:
    assert result["steps"] == list(range(SAVE + 1, STEPS + 1)), result
    # What the Trainer's own checkpoint holds besides the weights, so that it loads as a model would.
    assert {"config.json", "generation_config.json", "infinity", "scheduler.pt", "trainer_state.json",
            "training_args.bin"} <= set(result["written"]), result
    assert not any(name.endswith(".safetensors") for name in result["written"]), result
    assert result["logs"] <= 1e-6 and result["weights"] <= 1e-6, result


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_resumed_run_logs_and_ends_as_the_run_that_went_on(tmp_path, tier):
    _check(_resume_matches_the_run_that_went_on(str(tmp_path), tier))


def _on_rank(rank, world, workdir):
    # As torchrun sets it: Trainer and accelerate see a distributed run (each rank its own batches, the
    # model not wrapped in DistributedDataParallel by infinity.Trainer) and use the group already made.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    result = _resume_matches_the_run_that_went_on(workdir, "host", rank)
    result["world"] = transformers.TrainingArguments("unused", use_cpu=True).world_size
    return result


def test_two_ranks_resume(tmp_path):
    results = run_ranks(_on_rank, 2, tmp_path)
    for result in results:
        assert result["world"] == 2
        _check(result)


def test_save_model_writes_weights_plain_transformers_loads(tmp_path):
    trainer = _trainer(_model(str(tmp_path / "nvme"), "host"), str(tmp_path / "out"), steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    # What Trainer._save writes for the plain model (the weights through infinity.save_pretrained).
    assert sorted(os.listdir(tmp_path / "final")) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "training_args.bin"]
    plain = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for p, q in zip(plain.parameters(), _weights(trainer.model)):
        assert torch.equal(p, q)
    infinity.release(trainer.model)


def test_save_only_model_checkpoints_hold_ordinary_weights(tmp_path):
    """``save_only_model=True``: each checkpoint holds the weights as save_model writes them (through
    ``infinity.save_pretrained``), no infinity directory; the last one is the trained model."""
    trainer = _trainer(_model(str(tmp_path / "nvme"), "host"), str(tmp_path / "out"))
    trainer.args.save_only_model = True
    trainer.train()
    last = tmp_path / "out" / f"checkpoint-{STEPS}"
    assert "model.safetensors" in os.listdir(last) and "infinity" not in os.listdir(last)
    plain = transformers.GPT2LMHeadModel.from_pretrained(str(last))
    for p, q in zip(plain.parameters(), _weights(trainer.model)):
        assert torch.equal(p, q)
    infinity.release(trainer.model)


def test_save_only_model_with_load_best_model_at_end_is_refused_before_training(tmp_path):
    """Its checkpoints hold weights files, which an engine model takes only while it is built: the load at the
    end failed after the whole run (no TrainOutput, the last weights in place of the best). Refused first."""
    trainer = _trainer(_model(str(tmp_path / "nvme"), "host"), str(tmp_path / "out"))
    trainer.args.save_only_model, trainer.args.load_best_model_at_end = True, True
    trainer.args.eval_strategy, trainer.args.eval_steps, trainer.args.metric_for_best_model = "steps", SAVE, "loss"
    trainer.eval_dataset = _Tokens(4)
    with pytest.raises(infinity.errors.EngineError, match=r"save_only_model=True, load_best_model_at_end=True"):
        trainer.train()
    assert trainer.state.global_step == 0 and not list((tmp_path / "out").glob("checkpoint-*"))
    infinity.release(trainer.model)


def test_resuming_from_a_checkpoint_infinity_did_not_write_names_it(tmp_path):
    plain_dir = tmp_path / "out" / "checkpoint-3"
    plain_dir.mkdir(parents=True)
    trainer = _trainer(_model(str(tmp_path / "nvme"), "host"), str(tmp_path / "out"))
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint-3.* has no 'infinity' directory"):
        trainer.train(resume_from_checkpoint=str(plain_dir))
    infinity.release(trainer.model)


def _wrap_in_ddp(rank, world, workdir):
    model = _model(os.path.join(workdir, "nvme"), "host")
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except infinity.errors.EngineError as exc:
        return str(exc)
    finally:
        infinity.release(model)
    return None


def test_wrapping_an_engine_model_in_ddp_says_infinity_reduces_over_ranks_itself(tmp_path):
    """accelerate's prepare and transformers.Trainer over several processes wrap the model in DDP, which
    read a released parameter ("Tensor.detach on parameter ... is released"): not what to do about it."""
    (message,) = run_ranks(_wrap_in_ddp, 1, tmp_path)
    assert message is not None and "DistributedDataParallel wraps a model infinity manages" in message
    assert "evaluation_mode=True" in message and "infinity.Trainer" in message


def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path):
    trainer = _trainer(_model(str(tmp_path / "nvme"), "host"), str(tmp_path / "out"))
    trainer.args.eval_strategy, trainer.args.eval_steps = "steps", SAVE
    trainer.args.load_best_model_at_end, trainer.args.metric_for_best_model = True, "loss"
    trainer.args.greater_is_better = False  # the first evaluation's here: not the weights training ends with
    trainer.eval_dataset = _Tokens(4)
    trainer.train()
    drawn = torch.rand(4)
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "out" / f"checkpoint-{SAVE}"), best
    # The weights alone, as the Trainer loads a plain model's: the optimizer's step count and learning rate are
    # where training left them, and so are the RNG states (the whole load rolled them back to the best step).
    opt = trainer.optimizer.optimizer
    assert opt.step_count == trainer.state.global_step > SAVE
    assert [g["lr"] for g in opt.param_groups] == trainer.lr_scheduler.get_last_lr()
    saved_rng = torch.load(os.path.join(best, "rng_state.pth"), weights_only=False)["cpu"]
    torch.set_rng_state(saved_rng)
    assert not torch.equal(torch.rand(4), drawn)
    fresh = _model(str(tmp_path / "nvme-fresh"), "host")
    infinity.load_checkpoint(os.path.join(best, "infinity"), fresh)
    for p, q in zip(_weights(trainer.model), _weights(fresh)):
        assert torch.equal(p, q)
    infinity.release(fresh)
    infinity.release(trainer.model)


class _Wrapped(torch.nn.Module):
    """A model that is no transformers model (the Trainer saves its state dict itself)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels=None):
        return self.inner(input_ids=input_ids, labels=labels)


def _two_nodes(rank, world, workdir, wrapped=False):
    # Each rank the first of its "node" (LOCAL_RANK 0), each node with a disk of its own (a directory per rank).
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29542")
    model = _model(os.path.join(workdir, f"nvme{rank}"), "host", tie_word_embeddings=not wrapped)
    if wrapped:     # untied: a tensor twice in a state dict is refused by safetensors (the plain Trainer's too)
        model = _Wrapped(model)
    trainer = _trainer(model, os.path.join(workdir, "out"), steps=1)
    trainer.args.save_on_each_node = True
    trainer.train()
    final = os.path.join(workdir, f"final{rank}")
    trainer.save_model(final)
    keys = None
    if wrapped:
        from safetensors.torch import load_file
        keys = len(load_file(os.path.join(final, "model.safetensors")))
    infinity.release(trainer.model)
    return trainer.args.should_save, sorted(os.listdir(final)), keys


def test_save_model_with_save_on_each_node_writes_the_weights_on_each_node(tmp_path):
    for should_save, names, _ in run_ranks(_two_nodes, 2, tmp_path):
        assert should_save and names == ["config.json", "generation_config.json", "model.safetensors",
                                         "training_args.bin"]


def _two_nodes_wrapped(rank, world, workdir):
    return _two_nodes(rank, world, workdir, wrapped=True)


def test_a_model_that_is_no_transformers_model_saves_whole_on_each_node(tmp_path):
    """Its state dict was kept on rank 0 alone, and the first rank of every other node wrote an empty weights
    file without a word."""
    results = run_ranks(_two_nodes_wrapped, 2, tmp_path)
    assert [r[2] for r in results] == [results[0][2]] * 2 and results[0][2] > 0, results
    assert all(r[0] and "model.safetensors" in r[1] for r in results), results


def _engine_of_one_rank(rank, world, workdir):
    """Two launched ranks, and a model each built on a one-rank group: the Trainer refuses it on each rank."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29543")
    alone = [dist.new_group([r]) for r in range(world)][rank]
    nvme = os.path.join(workdir, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "nvme_path": nvme}}, group=alone):
        model = transformers.GPT2LMHeadModel(_config())
    try:
        _trainer(model, os.path.join(workdir, "out"))
        return "no error"
    except EngineError as exc:
        return str(exc)
    finally:
        infinity.release(model)


def test_a_trainer_over_more_processes_than_the_engine_is_refused_on_every_rank(tmp_path):
    """Two processes would train two models without reducing a gradient; each rank says why instead."""
    for said in run_ranks(_engine_of_one_rank, 2, tmp_path):
        assert "engine spans 1 rank(s) and the Trainer 2 process(es)" in said, said


def test_init_under_a_launcher_before_the_process_group_is_refused(tmp_path, monkeypatch):
    """torchrun set WORLD_SIZE=2 and the script builds the model before TrainingArguments (which makes the
    group): the engine would be this process's alone, and two processes would train two models silently."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(EngineError, match=r"rank 1 of WORLD_SIZE=2.*no torch.distributed process group"):
        _model(str(tmp_path / "nvme"), "host")


def test_given_no_optimizer_it_trains_with_infinity_adamw_as_the_trainer_would_with_torchs(tmp_path):
    """Without optimizer_cls_and_kwargs, the first opt.step() refused torch.optim.AdamW over the engine's
    parameters ([Note: what infinity.Trainer trains] in infinity/checkpoint/trainer.py)."""
    from tests.integration.test_hf_trainer import _args, _train

    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config())
    ref_losses, ref_norms, _ = _train(ref, str(tmp_path / "plain"))      # optim: the default, torch's AdamW
    model = _model(str(tmp_path / "nvme"), "host")
    trainer = infinity.Trainer(model=model, args=_args(str(tmp_path / "engine")), train_dataset=_Tokens(4 * STEPS))
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, infinity.AdamW)
    assert trainer.optimizer.param_groups[0]["betas"] == (0.9, 0.98) and trainer.optimizer.param_groups[0]["eps"] == 1e-6
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    assert len(logs) == STEPS
    assert max(abs(r["loss"] - want) for r, want in zip(logs, ref_losses)) <= 1e-5
    assert max(abs(r["grad_norm"] - want) / want for r, want in zip(logs, ref_norms)) <= 1e-5
    with infinity.gathered(model):
        assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters())) <= 1e-5
    infinity.release(model)


def test_an_optim_with_no_infinity_version_is_refused_when_the_trainer_is_built(tmp_path):
    from tests.integration.test_hf_trainer import _args

    model = _model(str(tmp_path / "nvme"), "host")
    with pytest.raises(EngineError, match=r"optim='sgd'\) has no infinity version.*optimizer_cls_and_kwargs"):
        infinity.Trainer(model=model, args=_args(str(tmp_path / "out"), optim="sgd"), train_dataset=_Tokens(4))
    infinity.Trainer(model=model, args=_args(str(tmp_path / "out"), optim="sgd"), train_dataset=_Tokens(4),
                     optimizer_cls_and_kwargs=(infinity.Adam, {"lr": 1e-3}))     # its own choice: let through
    infinity.release(model)


def test_a_model_not_built_in_init_is_refused_instead_of_training_without_offload(tmp_path):
    from tests.integration.test_hf_trainer import _args

    with pytest.raises(infinity.registry.NotManagedError,
                       match=r"infinity.Trainer: GPT2LMHeadModel was not built inside infinity.Init, so none of "
                             r"its parameters is offloaded: it would train whole on the device"):
        infinity.Trainer(model=transformers.GPT2LMHeadModel(_config()), args=_args(str(tmp_path / "out")),
                         train_dataset=_Tokens(4))
