"""Groups that mix frozen and trainable parameters (BitFit, adapters inside a block) train as plain torch.

The presets make each transformer block one parameter group (``partition.units = "auto"``). Freezing
some of its parameters (the weights, training the biases and norms: BitFit; or a block's base weights
beside trainable adapters) leaves their slots of the group's gradient without a gradient. The gradient
buckets are reused memory, so those slots must be written (zeros) in every backward: left alone they
carried another group's gradients into the global norm, ``clip_grad_norm_`` and the non-finite check
(a step skipped for a NaN no parameter had).

Freezing a parameter after the optimizer was built leaves it alone from then on in ``torch.optim``
(no gradient: no weight decay, no moment update) until it is trainable again; the engine's record of
which gradients arrived used to mark every parameter trainable when the optimizer was built, so a
parameter frozen later was still decayed and moved by its old moments.
"""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset


def _bitfit(model) -> None:
    """Train biases and norms only."""
    for p in model.parameters():
        if p.dim() > 1:
            p.requires_grad_(False)


def _run(model, shape, make_opt, steps: int):
    """(losses, gradient norms before clipping), optimizer: ``steps`` clipped AdamW steps on random tokens."""
    opt = make_opt(model)
    data = batches("random", 4, 32, shape.vocab_size, seed=0)
    losses, norms = [], []
    for _ in range(steps):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (losses, norms), opt


@pytest.mark.parametrize("name", ["device", "offload-optimizer", "offload-host", "nvme"])
def test_a_partly_frozen_block_trains_as_plain_torch(tmp_path, name):
    shape = preset("tiny", n_layer=3)
    torch.manual_seed(0)
    ref = GPT(shape)
    _bitfit(ref)
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path)}, "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
    _bitfit(model)
    frozen = {}
    with infinity.gathered(model):
        for n, p in model.named_parameters():
            if not p.requires_grad:
                frozen[n] = p.detach().clone()
    assert frozen
    trainable = [p for p in ref.parameters() if p.requires_grad]
    want, _ = _run(ref, shape, lambda m: torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1), steps=4)
    got, opt = _run(model, shape, lambda m: infinity.AdamW(m, lr=1e-2, weight_decay=0.1), steps=4)
    assert opt.skipped_steps == 0
    for what, a, b in zip(("loss", "gradient norm"), got, want):
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-4, (what, a, b)
    with infinity.gathered(model):
        for n, p in model.named_parameters():
            if n in frozen:
                assert torch.equal(p, frozen[n]), f"frozen {n} changed"
    infinity.release(model)


@pytest.mark.parametrize("name", ["device", "offload-optimizer", "offload-host", "nvme"])
def test_freezing_and_unfreezing_during_training_matches_plain_torch(tmp_path, name):
    shape = preset("tiny", n_layer=3)
    torch.manual_seed(0)
    ref = GPT(shape)
    overrides = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path)}, "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches("random", 4, 32, shape.vocab_size, seed=0)
    matrices = [n for n, p in model.blocks[1].named_parameters() if p.dim() > 1]
    for step in range(6):
        if step in (2, 4):      # block 1's matrices (its group keeps its vectors trainable), then back
            for net in (model, ref):
                for n, p in net.blocks[1].named_parameters():
                    if n in matrices:
                        p.requires_grad_(step == 4)
        if step == 2:
            with infinity.gathered(model):
                at_freeze = {n: p.detach().clone() for n, p in model.blocks[1].named_parameters() if n in matrices}
        x, y = next(data)
        losses = []
        for net, o in ((model, opt), (ref, ref_opt)):
            loss = net(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), (step, losses)
        if step == 3:           # frozen for two steps: not decayed, not moved by their moments
            with infinity.gathered(model):
                for n, p in model.blocks[1].named_parameters():
                    if n in matrices:
                        assert torch.equal(p, at_freeze[n]), n
    with infinity.gathered(model):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert float((p - q).detach().abs().max()) <= 1e-3, n
    infinity.release(model)
