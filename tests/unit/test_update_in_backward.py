"""The optimizer step during backward (``[optimizer] update_in_backward``): the ordinary step's results, or a refusal.

See [Note: update during backward] in infinity/optim/in_backward.py.
"""
from copy import deepcopy

import pytest
import torch

import infinity
from infinity import registry
from infinity.config import ConfigError
from infinity.errors import EngineError
from tests.support.tiny_gpt import TinyGPT, batches


def _engine(preset: str, swap, in_backward: bool, dtype: str, extra=None):
    over = {"tiers": {"nvme_path": str(swap)}, "partition": {"sub_group_size": 4096},
            "precision": {"dtype": dtype}, "optimizer": {"update_in_backward": in_backward}}
    for k, v in (extra or {}).items():
        over.setdefault(k, {}).update(v)
    cfg = infinity.load_config(preset, overrides=over)
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT(d=48)
    return model


def _train(preset, swap, in_backward, dtype, steps=4, state_dtype="fp32"):
    model = _engine(preset, swap, in_backward, dtype, {"optimizer": {"state_dtype": state_dtype}})
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = infinity.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses = []
    for x, y in batches(steps, 4):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    stats = opt.stats()
    shards = deepcopy(opt.state_dict()["shards"])
    infinity.release(model)
    return losses, shards, stats


@pytest.mark.parametrize("preset,dtype,state_dtype", [("nvme", "bfloat16", "fp32"), ("nvme", "float32", "fp32"),
                                                      ("offload-host", "bfloat16", "fp32"),
                                                      ("offload-host", "float32", "fp32"),
                                                      ("nvme", "bfloat16", "int8")])
def test_same_losses_and_states_as_the_ordinary_step(preset, dtype, state_dtype, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _train(preset, tmp_path / "a", False, dtype, state_dtype=state_dtype)
    early = _train(preset, tmp_path / "b", True, dtype, state_dtype=state_dtype)
    assert early[0] == plain[0]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for x, y in zip(plain[1][name], early[1][name]):
            assert torch.equal(x, y), name
    assert early[2]["in_backward_subs"] > 0     # some sub-groups really were stepped during backward
    assert "in_backward_subs" not in plain[2]
