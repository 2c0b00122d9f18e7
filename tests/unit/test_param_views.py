"""Views of engine parameters, against plain torch on the same weights: outside ``infinity.gathered`` a
released parameter refuses to be read (naming itself and ``infinity.gathered``) while describing itself as
the plain model's does; inside, writes through ``state_dict()`` tensors reach the stored shards, a tiled
layer's tiles included; bf16 masters keep the fp32 values the model was built with.

``views_case`` runs on one rank here and on two in tests/distributed/test_param_views_dist.py.
"""
import copy
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import infinity
from infinity.checkpoint.consolidate import consolidate
from infinity.errors import EngineError
from infinity.runtime.placeholder import ReleasedParameter
from tests.support.tiny_gpt import TinyGPT, batches

TILED = "blocks.0.mlp.0"        # a Linear(32, 128), tiled in 3 by the config below
REFUSED = r"'blocks\.1\.mlp\.2\.weight'.*infinity\.gathered"


def _config(workdir: str, dtype: str) -> dict:
    return {"tiers": {"params": "host", "optimizer": "host"}, "precision": {"dtype": dtype},
            "tiling": {"modules": [TILED], "tiles": 3}}


def _build(workdir: str, dtype: str):
    torch.manual_seed(0)
    plain = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(_config(workdir, dtype)):
        model = TinyGPT()
    return plain, model


def _masters(model, workdir: str) -> dict:
    """The model's fp32 master weights under the untiled keys (a checkpoint, consolidated)."""
    ckpt, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "masters.pt")
    infinity.save_checkpoint(ckpt, model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        consolidate(ckpt, out)
    if dist.is_initialized():
        dist.barrier()
    return torch.load(out)


def _check_reads_refused(plain: nn.Module, model: nn.Module) -> None:
    p = model.blocks[1].mlp[2].weight
    assert type(p) is ReleasedParameter and isinstance(p, nn.Parameter)
    reads = {"sum": lambda: p.sum(), "tolist": lambda: p.tolist(), "detach": lambda: p.detach(),
             "clone": lambda: p.clone(), "data": lambda: p.data, "add": lambda: p + 1,
             "numpy": lambda: p.detach().numpy(), "mul_": lambda: p.mul_(2),
             "torch.save": lambda: torch.save(p, io.BytesIO()),
             "index": lambda: p[0], "init": lambda: nn.init.zeros_(p)}
    for what, read in reads.items():
        with pytest.raises(EngineError, match=REFUSED):
            read()
    for what, read in {"state_dict": model.state_dict, "deepcopy": lambda: copy.deepcopy(model)}.items():
        with pytest.raises(EngineError, match=r"'[\w.]+'.*infinity\.gathered"):
            read()
    with pytest.raises(EngineError, match=r"'wte\.weight'.*precision\.dtype.*not float64.*infinity\.state_dict\(model\)"):
        model.double()
    # What describes a parameter is answered as on the plain model.
    described = {n: (tuple(p.shape), p.numel(), p.dim(), p.ndim, len(p), p.requires_grad, p.is_leaf)
                 for n, p in model.named_parameters() if ".tiles." not in n}
    expected = {n: (tuple(p.shape), p.numel(), p.dim(), p.ndim, len(p), p.requires_grad, p.is_leaf)
                for n, p in plain.named_parameters() if not n.startswith(TILED)}
    assert described == expected
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert model.to("cpu") is model and p.size(1) == 128 and p.grad is None
    # "cpu:0" is the CPU too (transformers.Trainer moves the model to args.device, cpu:0 on CPU ranks).
    assert model.to(torch.device("cpu", 0)) is model and p.size(1) == 128


def _edit(sd: dict) -> None:
    """The same edits, through state-dict tensors, of both models (values exact in bf16 too)."""
    sd[f"{TILED}.weight"].mul_(0.5)             # a tiled layer's joined weight
    sd[f"{TILED}.bias"][5:70] = 3.0
    sd["ln_f.weight"].fill_(2.0)                # an ordinary parameter; its group's bias is left alone
    nn.init.zeros_(sd["blocks.1.mlp.2.weight"])


def views_case(rank: int, world_size: int, workdir: str, dtype: str = "bfloat16") -> None:
    plain, model = _build(workdir, dtype)
    compute = getattr(torch, dtype)
    built = {k: v.clone() for k, v in plain.state_dict().items()}
    assert {k: v.equal(built[k]) for k, v in _masters(model, workdir).items()} == {k: True for k in built}

    _check_reads_refused(plain, model)

    with infinity.gathered(model):
        _edit(model.state_dict())
    with torch.no_grad():
        _edit(plain.state_dict())
    with infinity.gathered(model):
        seen = {k: v.clone() for k, v in model.state_dict().items()}
    assert list(seen) == list(built)
    for k, v in plain.state_dict().items():
        assert torch.equal(seen[k], v.to(compute)), k
    masters = _masters(model, workdir)
    edited = {f"{TILED}.weight", f"{TILED}.bias", "ln_f.weight", "blocks.1.mlp.2.weight"}
    for k, v in plain.state_dict().items():
        # Edited tensors: their changed elements hold what was written, a compute-dtype value; every other
        # element (ln_f.bias, the bias outside 5:70, every untouched tensor) keeps its fp32 master.
        want = v.to(compute).float() if k in edited else v
        if k == f"{TILED}.bias":
            want = v.clone()
            want[5:70] = 3.0
        assert torch.equal(masters[k], want), k

    # Trained from there, the model follows plain torch under autocast (the engine's step itself is
    # tested elsewhere; this checks the edited shards and masters are the ones training uses).
    opt = infinity.AdamW(model, lr=1e-3)
    loss = model(*next(iter(batches(1, 4))))
    loss.backward()
    opt.step()
    with torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32):
        ref = plain(*next(iter(batches(1, 4))))
    loss, ref = float(loss.detach()), float(ref.detach())
    assert abs(loss - ref) <= 0.01 * abs(ref), (loss, ref)
    infinity.release(model)
    with pytest.raises(EngineError, match=r"Tensor\.sum on a released infinity parameter.*infinity\.release"):
        model.blocks[1].mlp[2].weight.sum()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_param_views_on_one_rank(tmp_path, dtype):
    views_case(0, 1, str(tmp_path), dtype)


def test_construction_edits_reach_bf16_masters_unrounded(tmp_path):
    """A parent's init code edits a child's parameters after the child was partitioned (``self.apply``):
    the masters hold those fp32 values, not their bf16 rounding."""
    plain, model = _build(str(tmp_path), "bfloat16")
    masters = _masters(model, str(tmp_path))
    w = plain.blocks[1].mlp[2].weight.detach()
    assert not torch.equal(w.to(torch.bfloat16).float(), w)       # the rounding would show
    assert torch.equal(masters["blocks.1.mlp.2.weight"], w)
    infinity.release(model)
