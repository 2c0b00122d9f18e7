"""The optimizer states split over tiers on 2 ranks: parity with plain AdamW, and checkpoints across splits.

[Note: optimizer states over tiers] in infinity/optim/tier_split.py cuts each rank's states at group
boundaries from the shard lengths alone, so both ranks cut alike and issue the same collectives (the
ledger compares them at every call). Here 2 gloo ranks, each with half of the global batch, train the tiny
GPT with the states split (a device, a host and an NVMe share; a host and an NVMe share) and must follow a
plain single-process AdamW on the whole batch, as the uniform tiers do in tests/distributed/test_parity.py.

Checkpoint files do not record tiers: a checkpoint saved by 2 split ranks must load into 1 uniform rank,
and one saved by 2 uniform ranks into 2 split ranks, each continuing bit for bit as the run it was saved
from (every rank draws the same batches, as in tests/distributed/test_checkpoint_dist.py, so a 2-rank run
follows the 1-rank trajectory exactly).

A failed allocation, read or write of one rank's tiers in the update (the device, host and NVMe shares,
the overlapped part included) is heard on every rank; all load the checkpoint saved before the step (or
redo it after ``zero_grad()``) and end as the run that never failed. (A failure on one rank in the middle of
backward is not among them: the other rank is then in its next reduce-scatter, see the test's docstring.)
"""
from __future__ import annotations

import errno
import os

import torch
import torch.distributed as dist

import infinity
from infinity import registry
from infinity.optim.background import UpdateWorkerError
from infinity.runtime.ranks import RanksFailedError
from tests.distributed.test_checkpoint_dist import (assert_equal_dicts, build, gathered, one_thread,  # noqa: F401
                                                    seed_all, shards, train)
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches
from tests.unit.test_step_faults import SPLIT, _Fault, _fault_points, _tier_calls

STEPS = 12
LOCAL_BATCH = 2
# (params, optimizer, device share, host share): what each tier must get on every rank.
SPLITS = {"host params, device+host+nvme states": ("host", "nvme", 0.3, 0.4),
          "nvme params, host+nvme states": ("nvme", "nvme", 0.0, 0.5)}
K, N = 2, 2     # checkpoints: steps before the save, steps after it


def _split_config(workdir, tag, params, optimizer, device_share, host_share, sub_group_size=4096):
    nvme = os.path.join(str(workdir), f"nvme-{tag}")
    os.makedirs(nvme, exist_ok=True)
    return {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": nvme,
                      "optimizer_device_share": device_share, "optimizer_host_share": host_share,
                      "pool_buffer_size": "256KiB", "pool_buffers": 4},
            "partition": {"sub_group_size": sub_group_size}, "prefetch": {"nvme_bytes": "2MiB"},
            "aio": {"engine": "threads"}, "checkpoint": {"buffer_size": "64KiB"}}


def _kinds(model) -> set[str]:
    """The tiers this rank's optimizer states are in, once the shares are rounded to group boundaries."""
    return set(infinity.stats(model)["optimizer_tiers"])


def _expected_kinds(device_share, host_share) -> set[str]:
    return {k for k, share in (("device", device_share), ("host", host_share), ("nvme", 1.0)) if share}


def _parity(rank, world, workdir):
    out = {}
    for name, split in SPLITS.items():
        torch.manual_seed(0)
        ref = TinyGPT()
        torch.manual_seed(0)
        with infinity.Init(_split_config(workdir, f"parity{len(out)}", *split)):
            model = TinyGPT()
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
        kinds = _kinds(model)
        worst = 0.0
        for idx, tgt in batches(STEPS, LOCAL_BATCH * world):
            lo = rank * LOCAL_BATCH
            loss = model(idx[lo:lo + LOCAL_BATCH], tgt[lo:lo + LOCAL_BATCH])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            ref_loss = ref(idx, tgt)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, abs(mean_loss.item() / world - ref_loss.item()))
        param_diff = 0.0
        with infinity.gathered(model):
            for p, q in zip(model.parameters(), ref.parameters()):
                param_diff = max(param_diff, (p - q).abs().max().item())
        out[name] = {"kinds": kinds, "loss_diff": worst, "param_diff": param_diff}
    return out


def test_split_states_on_two_ranks_train_as_plain_adamw(tmp_path):
    results = run_ranks(_parity, 2, tmp_path)
    for rank, result in enumerate(results):
        for name, (_, _, device_share, host_share) in SPLITS.items():
            r = result[name]
            assert r["kinds"] == _expected_kinds(device_share, host_share), (rank, name, r["kinds"])
            # The tolerances of tests/distributed/test_parity.py.
            assert r["loss_diff"] <= 1e-5, f"{name}, rank {rank}: loss differs from plain AdamW by {r['loss_diff']:.3g}"
            assert r["param_diff"] <= 5e-5, f"{name}, rank {rank}: parameters differ by {r['param_diff']:.3g}"


# -- checkpoints between split and uniform runs ---------------------------------------------------------------

def _uniform_config(workdir, tag, params, optimizer):
    return _split_config(workdir, tag, params, optimizer, 0.0, 0.0, sub_group_size=8192)


def _run_and_save(model, opt, path, rank):
    with torch.no_grad():
        model.pos_scale.fill_(0.5)
    seed_all(1)
    train(model, opt, K)
    infinity.save_checkpoint(path, model, opt, extra={"rank": rank})
    losses = train(model, opt, N)
    return {"losses": losses, "params": gathered(model), "states": shards(opt)}


def _checkpoint_ranks(rank, world, workdir):
    split = SPLITS["host params, device+host+nvme states"]
    # 2 split ranks save; the parent resumes it on 1 uniform rank.
    model, opt = build(_split_config(workdir, "split-save", *split), 0)
    kinds = _kinds(model)
    saved_split = _run_and_save(model, opt, os.path.join(workdir, "ckpt-split"), rank)
    # 2 uniform ranks save; 2 split ranks (the other split) resume it.
    model, opt = build(_uniform_config(workdir, "uniform-save", "nvme", "nvme"), 0)
    saved_uniform = _run_and_save(model, opt, os.path.join(workdir, "ckpt-uniform"), rank)
    model, opt = build(_split_config(workdir, "split-load", *SPLITS["nvme params, host+nvme states"]), 5)
    assert _kinds(model) == {"host", "nvme"}, _kinds(model)
    assert infinity.load_checkpoint(os.path.join(workdir, "ckpt-uniform"), model, opt) == {"rank": rank}
    assert opt.step_count == K
    assert train(model, opt, N) == saved_uniform["losses"], "2 uniform -> 2 split: the losses differ"
    assert_equal_dicts(gathered(model), saved_uniform["params"], "params after 2 uniform -> 2 split")
    assert_equal_dicts(shards(opt), saved_uniform["states"], "optimizer shards after 2 uniform -> 2 split")
    return {"kinds": kinds, "losses": saved_split["losses"], "params": saved_split["params"]}


def test_checkpoints_load_between_split_and_uniform_states_across_world_sizes(tmp_path, one_thread):
    results = run_ranks(_checkpoint_ranks, 2, tmp_path)
    assert results[0]["kinds"] == {"device", "host", "nvme"}, results[0]["kinds"]
    assert results[0]["losses"] == results[1]["losses"]
    # 2 split -> 1 uniform: the checkpoint continues here exactly as it did on the 2 split ranks.
    model, opt = build(_uniform_config(tmp_path, "uniform-load", "nvme", "nvme"), 4)
    assert infinity.load_checkpoint(tmp_path / "ckpt-split", model, opt) == {"rank": 0}
    assert opt.step_count == K and torch.equal(model.pos_scale, torch.full((16, 1), 0.5))
    assert train(model, opt, N) == results[0]["losses"], "2 split -> 1 uniform: the losses differ"
    assert_equal_dicts(gathered(model), results[0]["params"], "params after 2 split -> 1 uniform")


# -- a failed tier call in one rank's update ------------------------------------------------------------------

def _run_with_fault(rank, workdir, tag, k):
    """Three steps of two micro-batches (this rank's half of each), the states split over the three tiers; on
    rank 1 the ``k``-th allocation, read or write of any tier during step 1's update (``opt.step()`` and the
    overlapped part, waited for) fails. Every rank hears of a failure (a flag all-reduced after each try):
    all load the checkpoint saved before the step when any rank's states are damaged, else all call
    ``zero_grad()``, and redo. Returns the calls counted on this rank, the weights and what happened."""
    nvme = os.path.join(workdir, f"nvme-fault-{tag}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"nvme_path": nvme, "pool_buffer_size": "256KiB", "pool_buffers": 4, "optimizer": "nvme",
                     **SPLIT},
           "partition": {"sub_group_size": 4096}, "aio": {"engine": "threads"}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    fault = _Fault(k if rank == 1 else 10 ** 9, OSError(errno.EIO, "Input/output error (injected)"))
    _tier_calls(registry.engine_of(model, "test"), fault, every_tier=True)
    data, events, tries = batches(6, 4), [], 0
    ckpt = os.path.join(workdir, f"before-{tag}")
    while opt.step_count < 3:
        step = opt.step_count
        if step == 1 and tries == 1:
            infinity.save_checkpoint(ckpt, model, opt, keep=1)
        tries += 1
        assert tries < 6, f"no progress: {events}"
        failed = 0
        try:
            for mb in range(2):
                x, y = data[2 * step + mb]
                model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
            fault.armed = step == 1 and not fault.fired
            opt.step()
            opt.synchronize()
        except (OSError, infinity.errors.EngineError, UpdateWorkerError, RanksFailedError) as exc:
            events.append(f"{type(exc).__name__}: {exc}")
            failed = 1
        finally:
            fault.armed = False
        flags = torch.tensor([failed, int(registry.engine_of(model, "test").damaged is not None)])
        dist.all_reduce(flags)
        if flags[1]:
            infinity.load_checkpoint(ckpt, model, opt)
            events.append("loaded")
        elif flags[0]:
            events.append("redone")
        opt.zero_grad()
    with infinity.gathered(model):
        weights = [p.detach().clone() for p in model.parameters()]
    infinity.release(model)
    return fault.calls, weights, events


def _fault_ranks(rank, world, workdir):
    calls, reference, _ = _run_with_fault(rank, workdir, "count", 10 ** 9)
    total = torch.tensor([calls if rank == 1 else 0])
    dist.all_reduce(total)
    out = {"total": int(total), "runs": []}
    for k in _fault_points(int(total)):
        _, weights, events = _run_with_fault(rank, workdir, f"k{k}", k)
        out["runs"].append((k, all(torch.equal(a, b) for a, b in zip(weights, reference)), events))
    return out


def test_a_failed_tier_call_in_one_ranks_update_is_recovered_on_every_rank(tmp_path):
    """EIO at the k-th allocation, read or write of rank 1's device, host or NVMe tier in step 1's update, for the
    k of ``_fault_points`` (INFINITY_TEST_ALL_FAULTS=1: each): rank 1 names the failure, every rank loads the
    checkpoint saved before the step (or redoes it after ``zero_grad()``), and both end with the weights of the
    run that never failed, every collective still the same on both ranks. The fault is armed from ``opt.step()``
    on: a gradient write failing on one rank in backward leaves the other in its next reduce-scatter (the
    collective ledger says so; NCCL would hang), for split and uniform tiers alike."""
    results = run_ranks(_fault_ranks, 2, tmp_path)
    total = results[0]["total"]
    assert total >= 20, f"only {total} tier calls in rank 1's update"
    for rank, result in enumerate(results):
        for k, same, events in result["runs"]:
            assert events, f"rank {rank}: nothing failed at call {k} of {total}"
            if rank == 1:
                assert "Input/output error (injected)" in events[0], (k, events)
            assert same, f"rank {rank}: EIO at rank 1's tier call {k} of {total} changed the weights ({events})"
