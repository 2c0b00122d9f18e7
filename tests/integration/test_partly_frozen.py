"""Freezing and unfreezing (``requires_grad``) at any time trains as plain torch does.

The presets make each transformer block one parameter group (``partition.units = "auto"``). Freezing
some of its parameters (the weights, training the biases and norms: BitFit; or a block's base weights
beside trainable adapters) leaves their slots of the group's gradient without a gradient. The gradient
buckets are reused memory, so those slots must be written (zeros) in every backward: left alone they
carried another group's gradients into the global norm, ``clip_grad_norm_`` and the non-finite check
(a step skipped for a NaN no parameter had).

Freezing a parameter after the optimizer was built leaves it alone from then on in ``torch.optim``
(no gradient: no weight decay, no moment update) until it is trainable again; the engine's record of
which gradients arrived used to mark every parameter trainable when the optimizer was built, so a
parameter frozen later was still decayed and moved by its old moments. And a parameter frozen when
the engine and the optimizer were built (gradual unfreezing) was never stepped once unfrozen, had no
``.grad`` (so ``clip_grad_norm_`` left it out of the norm), and a group larger than every group
trainable then found no gradient bucket to fit in.
"""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity import registry
from infinity.config import load_config
from infinity.errors import EngineError
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset

PRESETS = ["device", "offload-optimizer", "offload-host", "nvme"]


def _build(tmp_path, name: str, frozen=None, **sections):
    """(model, plain model, shape): the tiny GPT under preset ``name`` (fp32, CPU) and the same plain GPT,
    both with ``frozen(model)`` applied as they are built (inside ``infinity.Init``: the engine is built
    with those parameters frozen)."""
    shape = preset("tiny", n_layer=3)
    torch.manual_seed(0)
    ref = GPT(shape)
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path)}, "precision": {"dtype": "float32"},
                 **sections}
    torch.manual_seed(0)
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
        if frozen is not None:
            frozen(model)
    if frozen is not None:
        frozen(ref)
    return model, ref, shape


def _steps(pairs, shape, steps: int, before=lambda step: None, clip: float | None = None):
    """Train each (model, optimizer) of ``pairs`` ``steps`` steps on the same random tokens, calling
    ``before(step)`` first; yields, per step, each pair's (loss, gradient norm before clipping or None)."""
    data = batches("random", 4, 32, shape.vocab_size, seed=0)
    for step in range(steps):
        before(step)
        x, y = next(data)
        out = []
        for net, opt in pairs:
            loss = net(x, y)
            loss.backward()
            norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))
            opt.step()
            opt.zero_grad()
            out.append((loss.item(), norm))
        yield step, out


def _close(got, want, rel: float) -> bool:
    return all(a is None or abs(a - b) <= rel * abs(b) for a, b in zip(got, want))


def _bitfit(model) -> None:
    """Train biases and norms only."""
    for p in model.parameters():
        if p.dim() > 1:
            p.requires_grad_(False)


def _gathered_copies(model, names) -> dict:
    with infinity.gathered(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if n in names}


@pytest.mark.parametrize("name", PRESETS)
def test_a_partly_frozen_block_trains_as_plain_torch(tmp_path, name):
    model, ref, shape = _build(tmp_path, name)
    _bitfit(model)
    _bitfit(ref)
    frozen = _gathered_copies(model, {n for n, p in model.named_parameters() if not p.requires_grad})
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    pairs = [(model, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    for step, (got, want) in _steps(pairs, shape, 4, clip=0.05):
        assert _close(got, want, 1e-4), (step, got, want)
    assert opt.skipped_steps == 0
    for n, p in _gathered_copies(model, frozen).items():
        assert torch.equal(p, frozen[n]), f"frozen {n} changed"
    infinity.release(model)


def _norms_frozen(model) -> None:
    """Each block's norms frozen, the rest trained: in backward a norm comes after the trained layers it
    feeds, so its group (the block) has all its gradients while autograd still needs the norm's weight."""
    for n, p in model.named_parameters():
        if ".ln1." in n or ".ln2." in n:
            p.requires_grad_(False)


@pytest.mark.parametrize("name", PRESETS)
def test_a_block_whose_norms_are_frozen_after_init_trains_as_plain_torch(tmp_path, name):
    """The block's group was released once its trained parameters had their gradients, and the norm's
    backward read a released weight ("data is not allocated yet"; a segfault with Llama's RMSNorm)."""
    model, ref, shape = _build(tmp_path, name)
    _norms_frozen(model)
    _norms_frozen(ref)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    pairs = [(model, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    for step, (got, want) in _steps(pairs, shape, 3, clip=1e9):
        assert _close(got, want, 1e-5), (step, got, want)
    infinity.release(model)


@pytest.mark.parametrize("name", PRESETS)
def test_freezing_and_unfreezing_during_training_matches_plain_torch(tmp_path, name):
    model, ref, shape = _build(tmp_path, name)
    matrices = {f"blocks.1.{n}" for n, p in model.blocks[1].named_parameters() if p.dim() > 1}
    at_freeze = {}

    def before(step: int) -> None:
        if step in (2, 4):      # block 1's matrices (its group keeps its vectors trainable), then back
            for net in (model, ref):
                for n, p in net.named_parameters():
                    if n in matrices:
                        p.requires_grad_(step == 4)
        if step == 2:
            at_freeze.update(_gathered_copies(model, matrices))
        if step == 4:           # frozen for two steps: not decayed, not moved by their moments
            for n, p in _gathered_copies(model, matrices).items():
                assert torch.equal(p, at_freeze[n]), n

    pairs = [(model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)),
             (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    for step, (got, want) in _steps(pairs, shape, 6, before):
        assert _close(got, want, 1e-5), (step, got, want)
    infinity.release(model)


def _freeze_blocks(model) -> None:
    model.blocks.requires_grad_(False)


@pytest.mark.parametrize("name", PRESETS)
def test_blocks_frozen_when_the_engine_was_built_train_once_unfrozen(tmp_path, name):
    """Train the embeddings first, then everything (gradual unfreezing): the blocks' groups, frozen when the
    engine and the optimizer were built and larger than any group trainable then, get gradients, ``.grad``
    and updates as in torch from the step they are unfrozen."""
    model, ref, shape = _build(tmp_path, name, _freeze_blocks)

    def before(step: int) -> None:
        if step == 2:
            for net in (model, ref):
                net.blocks.requires_grad_(True)

    pairs = [(model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1)),
             (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    for step, (got, want) in _steps(pairs, shape, 5, before, clip=1e9):
        assert _close(got, want, 1e-4), (step, got, want)
    infinity.release(model)


def test_unfreezing_with_the_update_during_backward_matches_plain_torch(tmp_path):
    """With the update during backward, a sub-group waits for the groups training at this backward: those
    unfrozen since the last one too (else it would be stepped without their gradients)."""
    model, ref, shape = _build(tmp_path, "offload-optimizer", _freeze_blocks,
                               optimizer={"update_in_backward": True}, partition={"sub_group_size": 4096})

    def before(step: int) -> None:
        if step in (2, 4):
            for net in (model, ref):
                net.blocks[1].requires_grad_(step == 2)
                net.blocks[2].requires_grad_(True)

    pairs = [(model, infinity.AdamW(model, lr=1e-2)), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))]
    for step, (got, want) in _steps(pairs, shape, 5, before):
        assert _close(got, want, 1e-5), (step, got, want)
    infinity.release(model)


def test_unfreezing_a_group_frozen_at_construction_with_dpu_is_refused_naming_it(tmp_path):
    model, _, shape = _build(tmp_path, "offload-optimizer", _freeze_blocks, dpu={"enabled": True, "warmup_steps": 1})
    opt = infinity.AdamW(model, lr=1e-2)
    x, y = next(batches("random", 4, 32, shape.vocab_size, seed=0))
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    model.blocks.requires_grad_(True)
    model(x, y).backward()
    with pytest.raises(EngineError, match=r"dpu\.enabled.*'blocks\.0'"):
        opt.step()
    assert opt.step_count == 1          # refused before anything changed
    opt.zero_grad()
    model.blocks.requires_grad_(False)
    model(x, y).backward()
    opt.step()
    assert opt.step_count == 2
    infinity.release(model)


def test_a_partly_frozen_block_is_stepped_during_backward_as_plain_torch(tmp_path):
    """BitFit under the update during backward: a group whose trainable parameters all have their gradients
    is complete (its frozen ones are not stepped), so its sub-groups are stepped while backward runs."""
    model, ref, shape = _build(tmp_path, "offload-optimizer", _bitfit,
                               optimizer={"update_in_backward": True}, partition={"sub_group_size": 4096})
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    pairs = [(model, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    for step, (got, want) in _steps(pairs, shape, 4):
        assert _close(got, want, 1e-5), (step, got, want)
    assert opt.stats()["in_backward_subs"] >= 4 * 3, opt.stats()["in_backward_subs"]    # the blocks, each step
    infinity.release(model)


def _bucket_buffer(model):
    return registry.engine_of(model).reducer.device_buckets.arena


def test_a_configured_bucket_buffer_is_kept_or_refused_for_a_group_unfrozen_later(tmp_path):
    """``partition.reduce_bucket_bytes`` set: a group unfrozen later that fits uses the same buffer; one that
    does not makes its backward raise, naming the key and the group."""
    model, ref, shape = _build(tmp_path, "offload-optimizer", _freeze_blocks,
                               partition={"reduce_bucket_bytes": "1MiB"})
    opt = infinity.AdamW(model, lr=1e-2)
    x, y = next(batches("random", 4, 32, shape.vocab_size, seed=0))
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    arena = _bucket_buffer(model)
    model.blocks.requires_grad_(True)
    model(x, y).backward()
    opt.step()
    assert _bucket_buffer(model) is arena
    infinity.release(model)
    model, _, _ = _build(tmp_path / "small", "offload-optimizer", _freeze_blocks,
                         partition={"reduce_bucket_bytes": 150_000})
    model.blocks.requires_grad_(True)
    with pytest.raises(EngineError, match=r"partition\.reduce_bucket_bytes = 150000 cannot hold .*'blocks\.2'"):
        model(x, y).backward()
    infinity.release(model)
