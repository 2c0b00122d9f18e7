"""A failure on one rank only, before a collective: every rank raises, none waits for ever.

See [Note: failing together] in infinity/runtime/ranks.py. The collective ledger (tests/support/ledger.py)
checks that the ranks' collectives stay the same throughout, and its timeout would name a rank left waiting.
"""
from __future__ import annotations

import os

import torch

import infinity
from infinity.runtime.ranks import RanksFailedError
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches


class Cut(OSError):
    """Stands for a rank-local fault: a swap file cut under the run, a background update that failed."""


def _fail_on(rank, target, name):
    original = getattr(target, name)

    def failing(*args, **kwargs):
        if rank == 1:
            raise Cut(f"rank 1: injected failure in {name}")
        return original(*args, **kwargs)

    setattr(target, name, failing)
    return lambda: setattr(target, name, original)


def _one_rank_fails(rank, world, workdir):
    from infinity.registry import engine_of

    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB"},
           "precision": {"dtype": "float32"}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    engine = engine_of(model)
    data = batches(4, 4)

    def step(i):
        idx, tgt = data[i]
        model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()

    def attempt(what, fn, target, name):
        undo = _fail_on(rank, target, name)
        try:
            fn()
            said = "no error"
        except Cut as exc:
            said = f"own: {exc}"
        except RanksFailedError as exc:
            said = f"other: {exc}"
        finally:
            undo()
        return what, said

    step(0)
    ckpt = os.path.join(workdir, "ckpt")
    out = [attempt("save", lambda: infinity.save_checkpoint(ckpt, model, opt), opt, "synchronize"),
           attempt("gathered", lambda: infinity.gathered(model).__enter__(), opt, "synchronize"),
           attempt("state_dict", lambda: infinity.state_dict(model), opt, "synchronize")]
    idx, tgt = data[1]
    model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
    out.append(attempt("step", opt.step, engine.tiers, "check"))
    opt.zero_grad()
    infinity.save_checkpoint(ckpt, model, opt)      # nothing failed: it saves
    out.append(attempt("load", lambda: infinity.load_checkpoint(ckpt, model, opt), opt, "synchronize"))
    step(2)                                          # and training goes on, on both ranks
    infinity.load_checkpoint(ckpt, model, opt)
    step(3)
    infinity.release(model)
    return out


def test_a_failure_on_one_rank_before_a_collective_stops_every_rank(tmp_path):
    results = run_ranks(_one_rank_fails, 2, tmp_path, collective_timeout=60)
    for (what, said0), (_, said1) in zip(*results):
        assert said1.startswith("own: rank 1: injected failure"), (what, said1)
        assert said0.startswith("other: rank 0: rank(s) [1] failed in "), (what, said0)
