"""A checkpoint in place on 2 ranks: each rank seals its own swap files and adopts them again
([Note: checkpoints in place] in infinity/checkpoint/in_place.py)."""
from __future__ import annotations

import os

import torch

import infinity
from tests.distributed.test_checkpoint_dist import build, config, gathered, one_thread, seed_all, train  # noqa: F401
from tests.support.ranks import run_ranks

K, N = 2, 2


def _ranks(rank, world, workdir):
    seed_all(1)
    model, opt = build(config(workdir, "ref", "nvme", "nvme"), 0)
    reference = train(model, opt, K + N)
    expected = gathered(model)
    infinity.release(model)

    cfg = config(workdir, "run", "nvme", "nvme")
    seed_all(1)
    model, opt = build(cfg, 0)
    assert train(model, opt, K) == reference[:K]
    ckpt = os.path.join(workdir, "ckpt")
    infinity.save_checkpoint(ckpt, model, opt, extra={"rank": rank}, in_place=True)
    infinity.release(model)
    sealed = [f for f in os.listdir(os.path.join(cfg["tiers"]["nvme_path"], f"rank{rank}")) if f.endswith(".sealed")]
    assert len(sealed) == 1, sealed

    torch.manual_seed(7)          # other initial values: none of them reach the model
    with infinity.Init(cfg, resume=ckpt):
        from tests.distributed.test_checkpoint_dist import GPT
        resumed = GPT()
    ropt = infinity.AdamW(resumed, lr=1e-2, weight_decay=0.01)
    assert infinity.load_checkpoint(ckpt, resumed, ropt) == {"rank": rank}
    losses = train(resumed, ropt, N)
    assert losses == reference[K:], (losses, reference)
    got = gathered(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    return losses


def test_two_ranks_resume_from_their_sealed_swap_files(tmp_path, one_thread):
    results = run_ranks(_ranks, 2, tmp_path)
    assert results[0] == results[1]
