"""``infinity.Trainer``: Hugging Face's ``Trainer`` whose checkpoints are infinity's.

[Note: Trainer's checkpoints through infinity]
``transformers.Trainer`` saves a checkpoint every ``save_steps`` through
``model.state_dict()`` on the main process and ``optimizer.state_dict()``: an engine model's
parameters and Adam states are shards over every rank's tiers, so a plain Trainer with a
save strategy is refused ([Note: Trainer's checkpoints] in infinity/optim/checks.py). This
subclass saves the way DeepSpeed's integration does under ZeRO-3 without gathering 16-bit
weights: each ``checkpoint-N`` directory holds, beside the scheduler, RNG and Trainer state
the Trainer writes, an ``infinity`` directory written by ``infinity.save_checkpoint`` on every
rank (bounded host memory whatever the model's size) and the model's ``config.json``, not
its weights; ``infinity-consolidate checkpoint-N/infinity model.safetensors --safetensors``
makes them one file. ``resume_from_checkpoint`` loads that directory with ``infinity.load_checkpoint`` once
the optimizer exists (parameters, masters, moments, step count; onto any world size), and
``load_best_model_at_end`` loads the best one's weights alone (``weights_only``, as the Trainer loads a plain
model's: the optimizer and the RNG states go on as they are). ``trainer.save_model(dir)``,
called by the user on every rank, writes ordinary weights with ``infinity.save_pretrained`` (each module's
tensors written to the files as it is gathered; rank 0 writes), or for a model that is no transformers
model the Trainer's own save of ``infinity.state_dict`` (gathered a module at a time, kept on rank 0). ``save_only_model=True``
writes those weights in each checkpoint instead, which cannot be resumed (as with the plain Trainer).
Over several processes (``torchrun``, ``accelerate launch``) the model is not wrapped in
``DistributedDataParallel``: the engine already splits it and reduces its gradients over the
ranks.

[Note: what infinity.Trainer trains]
Given no optimizer (neither ``optimizers`` nor ``optimizer_cls_and_kwargs``), it builds
``infinity.AdamW`` where ``transformers.Trainer`` would build ``torch.optim.AdamW``: from the same
``TrainingArguments`` (``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``) and over the
same groups (``weight_decay`` on all but biases and norms); a ``torch.optim`` optimizer over an engine
model's parameters would update nothing and is refused at its first step. An ``optim`` that is not AdamW
(Adafactor, SGD, 8-bit AdamW...) has no infinity version and is refused when the Trainer is built. A
model none of whose parameters was built in ``infinity.Init`` is refused too: it would train whole on
the device, as with ``transformers.Trainer``, the very thing ``infinity.Trainer`` was chosen to avoid.
A model holding engine parameters among others (adapters added after ``Init``: ``trl.SFTTrainer`` given a
``peft_config`` adds them so) is accepted, and ``infinity.AdamW`` is built for it even when its only trainable
parameters are those adapters: it steps them with torch's AdamW beside the base, saves their Adam states in
the checkpoints and averages their gradients over the ranks, none of which a torch AdamW built by the Trainer
would do ([Note: unmanaged parameters] in infinity/optim/unmanaged.py).
"""
from __future__ import annotations

import os

import torch

try:
    import transformers
except ImportError as exc:     # pragma: no cover - the message is the point
    raise ImportError("infinity.Trainer subclasses transformers.Trainer: pip install transformers") from exc

from infinity import registry
from infinity.checkpoint.errors import CheckpointNotFoundError
from infinity.checkpoint.reader import load_checkpoint
from infinity.checkpoint.writer import save_checkpoint
from infinity.errors import EngineError
from infinity.optim.adam import Adam, AdamW
from infinity.optim.checks import report_skipped_steps
from infinity.runtime.gathered import state_dict
from infinity.runtime.hf_save import save_pretrained
from infinity.runtime.peft_save import is_peft_model

SUBDIR = "infinity"
SCHEDULER_NAME = "scheduler.pt"     # transformers.trainer's names, so its own checks find them
TRAINING_ARGS_NAME = "training_args.bin"
# TrainingArguments.optim values that are torch's AdamW (kernels aside): infinity.AdamW does their update.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused")


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that checkpoints an engine model with ``infinity.save_checkpoint`` and
    resumes with ``infinity.load_checkpoint`` (see [Note: Trainer's checkpoints through infinity]).

    Examples
    --------
    >>> trainer = infinity.Trainer(model=model, train_dataset=data,         # infinity.AdamW, from the args
    ...                            args=transformers.TrainingArguments("out", learning_rate=3e-4))  # doctest: +SKIP
    >>> trainer.train()                                   # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)        # doctest: +SKIP
    """

    infinity_checkpoints = True     # read by infinity.optim.checks.refuse_trainer_checkpoints

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_plain(self.model)
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None and _trains_engine_params(self.model):
            _adamw_kwargs(self.args)        # an optim with no infinity version is refused now, not at train()
        if _engine_model(self.model):
            engine = registry.engine_of(self.model)
            if engine.ranks.world_size != self.args.world_size:
                raise EngineError(
                    f"infinity.Trainer: the model's engine spans {engine.ranks.world_size} rank(s) and the "
                    f"Trainer {self.args.world_size} process(es): each process would train a model of its own "
                    "without reducing gradients. Build the model under infinity.Init after "
                    "transformers.TrainingArguments(...) (it creates the process group), or pass "
                    "infinity.Init(group=...) the group the Trainer uses")
        prepare = self.accelerator.prepare_model

        def prepare_model(model, device_placement=None, evaluation_mode=False):
            # Over several processes accelerate wraps a model in DistributedDataParallel, whose replicas an
            # engine model cannot be: infinity splits it and reduces its gradients over the ranks itself
            # (ZeRO-3), as a model transformers loaded sharded does; prepared as that one is (autocast and
            # compilation only), it takes the optimizer, the scheduler and the batches as usual.
            if _engine_model(model):
                return prepare(model, device_placement=False, evaluation_mode=True)
            return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        self.accelerator.prepare_model = prepare_model
        prepare_optimizer = self.accelerator.prepare_optimizer

        def prepare_optimizer_(optimizer, device_placement=None):
            prepared = prepare_optimizer(optimizer, device_placement=device_placement)
            if isinstance(optimizer, (Adam, AdamW)):
                report_skipped_steps(prepared)  # also without device placement ([Note: skipped steps under
                # accelerate] in infinity/optim/checks.py)
            return prepared

        self.accelerator.prepare_optimizer = prepare_optimizer_

    def create_optimizer(self, model=None):
        """``transformers.Trainer.create_optimizer``, with ``infinity.AdamW`` for an engine model given no
        optimizer ([Note: what infinity.Trainer trains])."""
        opt_model = self.model if model is None else model
        _refuse_plain(opt_model)        # model_init builds a model per trial
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None and _trains_engine_params(opt_model):
            self.optimizer_cls_and_kwargs = (AdamW, _adamw_kwargs(self.args))
        return super().create_optimizer(model)

    def _managed(self) -> bool:
        return _engine_model(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._managed():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self.accelerator.unwrap_model(self.model)
        if _internal_call and not self.args.save_only_model:
            # A checkpoint: the weights are in the infinity directory written with the optimizer; beside it what
            # the Trainer's own checkpoint holds besides the weights (the tokenizer: a checkpoint loads as a model).
            config = getattr(self.model, "config", None)
            if self.args.should_save and config is not None:
                config.save_pretrained(output_dir)
                generation = getattr(model, "generation_config", None)
                if generation is not None and getattr(model, "can_generate", lambda: False)():
                    generation.save_pretrained(output_dir)
            self._save_beside_weights(output_dir)
            return
        # Every rank (the gathers are collectives), a module at a time: a model bigger than the device saves too,
        # and a transformers model's files are written as each module is gathered (bigger than host memory too).
        if not isinstance(model, transformers.PreTrainedModel) and not is_peft_model(model):   # peft: its adapter
            # Kept by the ranks that write (save_on_each_node: the first of each node), not by rank 0 alone.
            whole = state_dict(self.model, keep=self.args.should_save)
            self._save(output_dir, state_dict=whole)
            return
        save_pretrained(model, output_dir, is_main_process=self.args.should_save)    # save_on_each_node too
        self._save_beside_weights(output_dir)

    def _save_beside_weights(self, output_dir: str) -> None:
        """What ``transformers.Trainer._save`` writes beside the weights: the tokenizer and the arguments."""
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def train(self, *args, **kwargs):
        """``transformers.Trainer.train``; refuses first what could only fail after training."""
        if self._managed() and self.args.save_only_model and self.args.load_best_model_at_end:
            raise EngineError(
                "infinity.Trainer: TrainingArguments(save_only_model=True, load_best_model_at_end=True): the best "
                "checkpoint would hold a weights file, which a model built in infinity.Init takes only while it is "
                "built, so the load at the end of training would fail after it. Drop save_only_model (each "
                "checkpoint then holds an infinity directory, whose weights load_best_model_at_end loads), or "
                "load_best_model_at_end")
        return super().train(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._managed():
            return super()._save_optimizer_and_scheduler(output_dir)
        save_checkpoint(os.path.join(output_dir, SUBDIR), self.model)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._managed():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        _infinity_dir(resume_from_checkpoint, self.model)   # checked now; loaded with the optimizer, which needs it

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._managed():
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(_infinity_dir(checkpoint, self.model), self.model)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if not self._managed():
            return super()._load_best_model()
        # The weights alone, as the Trainer loads a plain model's: the optimizer and the RNG go on as they are.
        load_checkpoint(_infinity_dir(self.state.best_model_checkpoint, self.model), self.model, weights_only=True)


def _engine_model(model) -> bool:
    try:
        registry.engine_of(model)
    except registry.NotManagedError:
        return False
    return True


def _engine_params(model) -> bool:
    """Whether any parameter of ``model`` was built in ``infinity.Init``."""
    return any(registry.engine_of_param(p) is not None for p in model.parameters())


def _trains_engine_params(model) -> bool:
    """Whether a trainable parameter of ``model`` belongs to an engine: built in ``infinity.Init``, or added to
    an engine model after the block (peft's adapters, [Note: unmanaged parameters] in infinity/optim/unmanaged.py),
    which ``infinity.AdamW`` steps with torch's AdamW beside the base, saves in its checkpoints and, on several
    ranks, averages over them; a torch AdamW the Trainer built would do none of the last two."""
    added = None
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if registry.engine_of_param(p) is not None:
            return True
        added = registry.engines_by_added_param() if added is None else added
        if p in added:
            return True
    return False


def _refuse_plain(model) -> None:
    """Refuse a model with no engine parameter ([Note: what infinity.Trainer trains])."""
    if model is None or _engine_model(model) or _engine_params(model):
        return
    raise registry.NotManagedError(
        f"infinity.Trainer: {type(model).__name__} was not built inside infinity.Init, so none of its parameters "
        "is offloaded: it would train whole on the device, as with transformers.Trainer. Build it under `with "
        "infinity.Init(config): model = ...` (or infinity.from_pretrained(cls, path, config)), or train a model "
        "that fits without infinity with transformers.Trainer")


def _adamw_kwargs(args) -> dict:
    """``infinity.AdamW``'s arguments from ``TrainingArguments``, as the Trainer reads them for torch's AdamW."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_OPTIMS:
        raise EngineError(
            f"infinity.Trainer: TrainingArguments(optim={optim!r}) has no infinity version: an engine model's "
            "parameters are updated over their shards by infinity.AdamW or infinity.Adam. Leave optim at its "
            "default (AdamW, built as infinity.AdamW), or pass optimizer_cls_and_kwargs=(infinity.Adam, {...})")
    if args.optim_args:
        raise EngineError(
            f"infinity.Trainer: TrainingArguments(optim_args={args.optim_args!r}): infinity.AdamW takes lr, betas, "
            "eps and weight_decay, which TrainingArguments gives by their own names; drop optim_args")
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


def _infinity_dir(checkpoint: str, model) -> str:
    """``checkpoint``'s infinity directory; a clear error when the Trainer checkpoint has none, on every rank
    when one rank's disk lacks it (the load's collectives come next: [Note: failing together] in
    infinity/runtime/ranks.py)."""
    path = os.path.join(checkpoint, SUBDIR)
    with registry.engine_of(model).ranks.together(f"resuming from {checkpoint!r}"):
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"{checkpoint!r} has no {SUBDIR!r} directory: it was not written by infinity.Trainer (a plain "
                "Trainer's checkpoint, or one saved with save_only_model=True, holds no optimizer states an "
                "infinity model can resume from). Resume from a checkpoint infinity.Trainer saved, or load "
                "weights with from_pretrained inside infinity.Init and start a new run")
    return path
