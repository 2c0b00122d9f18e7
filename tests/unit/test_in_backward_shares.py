"""The update during backward with the optimizer states split over tiers: exact, each share where it belongs.

See [Note: update during backward] in infinity/optim/in_backward.py and [Note: optimizer states over tiers] in
infinity/optim/tier_split.py. The host and NVMe shares' sub-groups are stepped during backward as their
gradients complete (the NVMe share's gradients held in host memory, never written to the disk; the host
share's in their accumulators); the device share's wait for ``opt.step()``. Every such run must train bit for
bit as the same split with the ordinary step, and as ``torch.optim.AdamW`` step by step (what each forward
computes with), the rest of the update overlapping the next forward as on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity.optim import in_backward
from infinity.optim.scheduler import UpdateScheduler
from infinity.config import load_config
from infinity.plan import plan
from infinity.plan.shapes import known_census
from infinity.plan.layout import Layout
from infinity.registry import engine_of
from tests.unit.test_dpu import TOL, batches, gathered_diff, run_schedule
from tests.unit.test_optimizer_shares import assert_cut, assert_same, gathered, ident, kinds, make
from tests.unit.test_overlap_step import slow_update  # noqa: F401 (a fixture)
from tests.unit.test_update_in_backward import assert_ranks_match, rank_steps, scheduled_steps

IN_BACKWARD = {"update_in_backward": True}
# (params, optimizer, device share, host share)
SPLITS = [("device", "nvme", 0.5, 0.0), ("host", "nvme", 0.3, 0.4), ("nvme", "nvme", 0.0, 0.5),
          ("device", "host", 0.5, 0.0)]


class _SubsStepped:
    """Which sub-groups each pass stepped, and where: during backward (the worker) or in ``opt.step()``."""

    def __init__(self, monkeypatch) -> None:
        self.in_backward: set[int] = set()
        work = in_backward.InBackwardUpdate.work
        seen = self

        def work_seen(self, job, ready):
            seen.in_backward |= set(job.subs)
            return work(self, job, ready)

        monkeypatch.setattr(in_backward.InBackwardUpdate, "work", work_seen)


def _train(model, data, opt=None):
    """Plain steps, a learning-rate schedule, no clipping (refused with the update during backward)."""
    opt = opt or infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    return scheduled_steps(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8), data), opt


# -- 1. bit for bit the ordinary step of the same split, fp32 and bf16 compute ------------------------------------
@pytest.mark.parametrize("dtype,split", [("float32", s) for s in SPLITS] + [("bfloat16", SPLITS[1]), ("bfloat16", SPLITS[2])],
                         ids=[f"fp32-{ident(s)}" for s in SPLITS] + [f"bf16-{ident(SPLITS[1])}", f"bf16-{ident(SPLITS[2])}"])
def test_same_losses_and_weights_as_the_ordinary_step(tmp_path, monkeypatch, dtype, split):
    seen = _SubsStepped(monkeypatch)
    data = batches(4)
    runs = []
    for early in (True, False):
        model, _ = make(tmp_path, *split, dtype=dtype, optimizer={"update_in_backward": early})
        if early:
            assert_cut(model, split[2], split[3], split[1])
            tiers = kinds(model)
        losses, opt = _train(model, data)
        runs.append((losses, gathered(model), opt.stats()))
        infinity.release(model)
    (losses, params, stats), (ref_losses, ref_params, ref_stats) = runs
    assert losses == ref_losses
    assert_same(params, ref_params)
    assert stats["in_backward_subs"] > 0 and "in_backward_subs" not in ref_stats
    # Only host-memory and NVMe sub-groups were stepped during backward; the device share in opt.step().
    assert seen.in_backward and {tiers[sub] for sub in seen.in_backward} <= {"host", "nvme"}, seen.in_backward
    assert (stats["device_share_seconds"] > 0) == (split[2] > 0), stats


# -- 2. step by step against torch's AdamW, the rest of the update beside the next forward ------------------------
@pytest.mark.parametrize("split", SPLITS, ids=ident)
def test_matches_torch_adamw_step_by_step(tmp_path, slow_update, monkeypatch, split):  # noqa: F811
    monkeypatch.setattr(UpdateScheduler, "overlap_wanted", staticmethod(lambda engine: True))
    model, ref = make(tmp_path, *split, optimizer=IN_BACKWARD)
    opt, _, out, covered = run_schedule(model, ref, 5, warmup=10 ** 6, lr_at=lambda k: 1e-2 * 0.8 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert covered == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
    assert opt.stats()["in_backward_subs"] > 0
    assert gathered_diff(model, ref) <= TOL


# -- 3. where each share's gradients go --------------------------------------------------------------------------
def test_only_the_nvme_shares_gradients_are_held_and_none_reach_the_disk(tmp_path):
    model, _ = make(tmp_path, "host", "nvme", 0.3, 0.4, optimizer=IN_BACKWARD)
    opt = infinity.AdamW(model, lr=1e-2)     # the update during backward takes hold of the store here
    store = engine_of(model).store
    nvme = engine_of(model).tiers.by_name["nvme"]
    streamed = set(store.streamed_subs)
    assert streamed and len(streamed) < store.layout.num_subs
    grad_keys = {store.keys["grad"][sub] for sub in streamed}
    written, held_subs = [], set()
    write = store.io.write

    def spy(tier, key, *a, **k):
        if tier is nvme:
            written.append(key)
        return write(tier, key, *a, **k)

    store.io.write = spy
    accumulate = store.held.accumulate

    def held(group_index, shard):
        held_subs.update(p.sub_index for p in store.layout.pieces_of_group[group_index])
        accumulate(group_index, shard)

    store.held.accumulate = held
    ref, _ = make(tmp_path, "host", "nvme", 0.3, 0.4)
    ref_opt = infinity.AdamW(ref, lr=1e-2)
    for idx, tgt in batches(2):
        model(idx, tgt).backward()
        ref(idx, tgt).backward()
        # .grad before opt.step(): the host share's from its accumulators, as the ordinary step's
        for gi, group in enumerate(engine_of(model).coordinator.groups):
            if all(store.in_place_of(p.sub_index) for p in store.layout.pieces_of_group[gi]):
                assert torch.equal(store.read_state_shard("grad", gi),
                                   engine_of(ref).store.read_state_shard("grad", gi)), group.name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert written and not grad_keys & set(written)
    assert held_subs and held_subs <= streamed, (held_subs, streamed)
    assert not store.held.subs      # every held gradient was stepped and let go
    assert_same(gathered(model), gathered(ref))
    infinity.release(model)
    infinity.release(ref)


def test_the_plan_holds_only_the_nvme_shares_gradients():
    """infinity-plan's held-gradient row covers the NVMe share's sub-groups only (a split's host share takes its
    gradients into its accumulator), and none of their bytes go to the disk."""
    census = known_census("llama-7b")

    def planned(host_share):
        cfg = load_config({"precision": {"dtype": "bfloat16"}, "optimizer": IN_BACKWARD, "tiers": {
            "params": "nvme", "optimizer": "nvme", "nvme_path": "/nonexistent/x", "optimizer_host_share": host_share}})
        p = plan(census, cfg, check_fit=False)
        return {r.key: r.nbytes for r in p.rows if r.tier == "host"}, p, Layout(census, cfg, 1, 2)

    uniform, u, whole = planned(0.0)
    split, s, layout = planned(0.97)     # the NVMe share: the last groups, 131M elements
    streamed = layout.trainable_on("nvme")
    assert 0 < streamed < layout.trainable_numel
    assert 0 < split["held_grads"] <= layout.grad_bytes * streamed < uniform["held_grads"]
    # Written per step: the NVMe share's masters (split into bf16 halves in the uniform run) and moments, the
    # compute copies; no gradient.
    assert s.nvme_write_bytes == (4 + 8) * streamed + layout.rewrite_nvme
    assert u.nvme_write_bytes == (whole.master_bytes + 8) * whole.trainable_numel + whole.rewrite_nvme


# -- 4. two ranks ------------------------------------------------------------------------------------------------
def _rank_run(rank, world, workdir):
    """Each rank half of the batch; the split (a device, a host and an NVMe share) with either step."""
    import pathlib

    out = []
    for early in (False, True):
        root = pathlib.Path(workdir) / f"rank{rank}-{early}"
        root.mkdir()
        model, _ = make(root, "host", "nvme", 0.3, 0.4, optimizer={"update_in_backward": early})
        out.append(rank_steps(model, rank, world, batches(3 * world)))
    return out


def test_two_ranks_match_the_ordinary_step(tmp_path):
    from tests.support.ranks import run_ranks
    assert_ranks_match(run_ranks(_rank_run, 2, tmp_path))
