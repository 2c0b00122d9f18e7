"""Optimizer states split over tiers by sub-group: exact, and refused where a path takes one tier.

See [Note: optimizer states over tiers] in infinity/optim/tier_split.py. ``tiers.optimizer_device_share``
and ``tiers.optimizer_host_share`` keep the first parameter groups' states on the compute device (the CPU
here: ``tiers.device = "cpu"``) and in host memory, the rest in ``tiers.optimizer``. The device share is
stepped inside ``opt.step()``, the rest beside the next forward. Every split must train exactly as the
uniform run does (bit for bit) and as ``torch.optim.AdamW`` does (step by step, what the forward computes
with), through accumulation, frozen groups, clipping, skipped steps, state dicts and checkpoints.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import infinity
from infinity.checkpoint.errors import CheckpointError
from infinity.config.values import ConfigError
from infinity.optim import tier_split
from infinity.optim.scheduler import UpdateScheduler
from infinity.registry import engine_of
from tests.unit.test_dpu import TOL, Tiny, batches, gathered_diff, run_schedule
from tests.unit.test_overlap_step import slow_update  # noqa: F401 (a fixture)

# (params, optimizer, device share, host share)
SPLITS = [("device", "nvme", 0.5, 0.0), ("host", "nvme", 0.3, 0.4), ("nvme", "nvme", 0.0, 0.5),
          ("device", "host", 0.5, 0.0), ("nvme", "host", 0.5, 0.0)]


def ident(split) -> str:
    params, states, device_share, host_share = split
    return f"{params}-{states}-d{device_share:g}-h{host_share:g}"

_dirs = itertools.count()


def config(tmp_path, params, states, device_share=0.0, host_share=0.0, dtype="float32", **sections) -> dict:
    """The config of a run with parameters in ``params`` and the optimizer states in ``states`` but for the shares;
    ``sections``: more keys, by section."""
    path = tmp_path / f"swap{next(_dirs)}"      # each engine its own swap directory (the tier locks it)
    path.mkdir()
    cfg = {"tiers": {"params": params, "optimizer": states, "nvme_path": str(path), "device": "cpu",
                     "optimizer_device_share": device_share, "optimizer_host_share": host_share},
           "precision": {"dtype": dtype}, "partition": {"sub_group_size": 4096}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def make(tmp_path, *split, freeze_norm=False, freeze=None, **kw):
    """The engine's model and a plain one alike; ``freeze(model)`` runs inside ``infinity.Init``."""
    torch.manual_seed(0)
    with infinity.Init(config(tmp_path, *split, **kw)):
        model = Tiny(freeze_norm)
        if freeze is not None:
            freeze(model)
    torch.manual_seed(0)
    return model, Tiny(freeze_norm)


def freeze_first_block_and_norm(model) -> None:
    """Groups frozen among the first (in a device or host share) and the last (in ``tiers.optimizer``)."""
    model.blocks[0].requires_grad_(False)
    model.ln_f.requires_grad_(False)


def uniform(split):
    return split[0], split[1], 0.0, 0.0


def train(model, data, opt=None, accumulate=1, clip=0.5, skip_at=()):
    """Steps over ``data`` (``accumulate`` micro-batches each): the losses and clipping norms, and the optimizer."""
    opt = opt or infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
    out = []
    for it in range(len(data) // accumulate):
        for idx, tgt in data[it * accumulate:(it + 1) * accumulate]:
            loss = model(idx, tgt)
            (loss * float("inf") if it in skip_at else loss).backward()
            out.append(loss.item())
        if clip is not None:
            norm = infinity.clip_grad_norm_(model, clip)
            out.append(float(norm) if it not in skip_at else 0.0)
        opt.step()
        opt.zero_grad()
    return out, opt


def gathered(model) -> dict:
    with infinity.gathered(model):
        return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def kinds(model) -> list[str]:
    return [t.kind for t in engine_of(model).store.sub_tiers]


def assert_cut(model, device_share, host_share, base) -> None:
    """Each sub-group's states are in the tier its groups' cut gives, the first groups on the device."""
    engine = engine_of(model)
    store = engine.store
    numels = [g.shard_numel for g in engine.coordinator.groups]
    d, h = tier_split.cut_groups(numels, device_share, host_share)
    assert (d > 0) == (device_share > 0) and (h > d) == (host_share > 0) and h < len(numels)
    for sub, pieces in enumerate(store.layout.pieces_of_sub):
        for p in pieces:
            assert store.sub_tiers[sub].kind == tier_split.group_kind((d, h), base, p.group_index), (sub, p)
    expected = [k for k in ("device", "host") if {"device": device_share, "host": host_share}[k]] + [base]
    assert [t.kind for t in store.tiers] == expected
    assert kinds(model) == sorted(kinds(model), key=("device", "host", "nvme").index)     # fastest first


# -- 1. step by step against torch's AdamW, the update overlapping the next forward ------------------------------
@pytest.mark.parametrize("split", SPLITS, ids=ident)
def test_split_matches_torch_adamw_step_by_step(tmp_path, slow_update, monkeypatch, split):  # noqa: F811
    # What a GPU run does (the host share's update beside the next forward), forced on the CPU.
    monkeypatch.setattr(UpdateScheduler, "overlap_wanted", staticmethod(lambda engine: True))
    model, ref = make(tmp_path, *split)
    assert_cut(model, split[2], split[3], split[1])
    opt, _, out, covered = run_schedule(model, ref, 5, warmup=10 ** 6, clip=0.5, lr_at=lambda k: 1e-2 * 0.8 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert covered == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
    stats = opt.stats()
    assert stats["overlapped_steps"] == 5 and stats["sync_steps"] == 0, stats
    assert (stats["device_share_seconds"] > 0) == (split[2] > 0), stats
    # The forwards ran into the host or NVMe share's groups before the update had rewritten them.
    assert engine_of(model).coordinator.stats.update_wait_seconds > 0
    assert gathered_diff(model, ref) <= TOL


# -- 2. bit for bit the uniform run, fp32 and bf16 compute --------------------------------------------------------
BF16_SPLITS = [("nvme", "nvme", 0.0, 0.5), ("host", "nvme", 0.0, 0.5), ("device", "nvme", 0.5, 0.0),
               ("device", "host", 0.5, 0.0)]


@pytest.mark.parametrize("dtype,split", [("float32", s) for s in SPLITS] + [("bfloat16", s) for s in BF16_SPLITS],
                         ids=[f"fp32-{ident(s)}" for s in SPLITS] + [f"bf16-{ident(s)}" for s in BF16_SPLITS])
def test_split_trains_bit_identically_to_the_uniform_run(tmp_path, dtype, split):
    data = batches(4)
    runs = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s, dtype=dtype)
        grad_dtype = engine_of(model).store.grad_dtype
        runs.append((train(model, data)[0], gathered(model), grad_dtype))
        infinity.release(model)
    (losses, params, grad_dtype), (ref_losses, ref_params, _) = runs
    assert losses == ref_losses
    assert_same(params, ref_params)
    # bf16 compute: compact gradients unless a share is stepped on the device (fp32 gradients there).
    compact = dtype == "bfloat16" and split[2] == 0
    assert grad_dtype == (torch.bfloat16 if compact else torch.float32)


# -- 3. accumulation, frozen groups, skipped steps, state dicts, checkpoints -------------------------------------
@pytest.mark.parametrize("dtype,split", [("bfloat16", ("host", "nvme", 0.0, 0.5)), ("bfloat16", ("device", "host", 0.5, 0.0)),
                                         ("float32", ("device", "nvme", 0.3, 0.4))],
                         ids=["bf16-compact", "bf16-device-share", "fp32"])
def test_accumulated_micro_batches_widen_each_sub_groups_gradient_in_its_tier(tmp_path, dtype, split):
    data = batches(6)
    runs = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s, dtype=dtype)
        store = engine_of(model).store
        before = store.grad_dtype
        runs.append((train(model, data, accumulate=2)[0], gathered(model), before, store.grad_dtype))
        infinity.release(model)
    (losses, params, before, after), (ref_losses, ref_params, _, _) = runs
    assert losses == ref_losses
    assert_same(params, ref_params)
    compact = dtype == "bfloat16" and split[2] == 0     # else fp32 from the start, as the uniform run's widened
    assert (before, after) == ((torch.bfloat16, torch.float32) if compact else (torch.float32,) * 2)


@pytest.mark.parametrize("when", ["inside-init", "after-init"])
@pytest.mark.parametrize("split", [("device", "nvme", 0.3, 0.4), ("nvme", "host", 0.5, 0.0)], ids=ident)
def test_frozen_groups_keep_the_cuts(tmp_path, when, split):
    data = batches(3)
    runs = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s, freeze=freeze_first_block_and_norm if when == "inside-init" else None)
        if when == "after-init":
            freeze_first_block_and_norm(model)
        store = engine_of(model).store
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
        assert (engine_of(model).store is not store) == (when == "after-init")     # rebuilt, frozen apart
        if s is split:
            assert_cut(model, *split[2:], split[1])
            store = engine_of(model).store
            # The frozen groups' sub-groups hold masters only, in the share tier and in tiers.optimizer.
            assert {store.sub_tiers[sub].kind for sub in store.dormant} >= {kinds(model)[0], split[1]}
        runs.append((train(model, data, opt)[0], gathered(model)))
        infinity.release(model)
    assert runs[0][0] == runs[1][0]
    assert_same(runs[0][1], runs[1][1])


@pytest.mark.parametrize("split", [SPLITS[0], SPLITS[2]], ids=ident)
def test_a_non_finite_gradient_skips_the_step_in_every_tier(tmp_path, split):
    model, ref = make(tmp_path, *split)
    with pytest.warns(RuntimeWarning, match="non-finite gradient .* skipped its update"):
        opt, _, out, _ = run_schedule(model, ref, 4, warmup=10 ** 6, clip=0.5, skip_at=(1,))
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert opt.stats()["skipped_steps"] == 1
    assert gathered_diff(model, ref) <= TOL


def test_state_dict_round_trip_and_equal_to_the_uniform_runs(tmp_path):
    split = ("device", "nvme", 0.3, 0.4)
    data = batches(5)
    dicts, losses = [], []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s)
        _, opt = train(model, data[:2])
        sd = copy.deepcopy(opt.state_dict())
        dicts.append(sd)
        first = train(model, data[2:], opt)[0]
        opt.load_state_dict(sd)     # back to step 2, in every tier
        assert train(model, data[2:], opt)[0] == first
        losses.append(first)
        infinity.release(model)
    assert losses[0] == losses[1]
    (a, b) = (d["shards"] for d in dicts)
    for state in ("master", "exp_avg", "exp_avg_sq"):
        for x, y in zip(a[state], b[state]):
            assert torch.equal(x, y), state


@pytest.mark.parametrize("saved,loaded,state_dtype", [("split", "uniform", "fp32"), ("uniform", "split", "fp32"),
                                                       ("split", "uniform", "int8"), ("uniform", "split", "int8")])
def test_checkpoint_moves_between_split_and_uniform_runs(tmp_path, saved, loaded, state_dtype):
    split = ("nvme", "nvme", 0.3, 0.4) if state_dtype == "fp32" else ("nvme", "nvme", 0.0, 0.5)
    pick = {"split": split, "uniform": uniform(split)}
    data = batches(5)

    def resumed(saved, loaded):
        model, _ = make(tmp_path, *pick[saved], optimizer={"state_dtype": state_dtype})
        first, opt = train(model, data[:2])
        infinity.save_checkpoint(tmp_path / f"ckpt-{saved}-{loaded}", model, opt)
        infinity.release(model)
        model, _ = make(tmp_path, *pick[loaded], optimizer={"state_dtype": state_dtype})
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
        infinity.load_checkpoint(tmp_path / f"ckpt-{saved}-{loaded}", model, opt)
        out = first + train(model, data[2:], opt)[0], gathered(model)
        infinity.release(model)
        return out

    losses, params = resumed(saved, loaded)
    # As a uniform run resumed from a uniform run's checkpoint (int8 moments are encoded again by a load).
    ref_losses, ref_params = resumed("uniform", "uniform")
    assert losses == ref_losses
    assert_same(params, ref_params)
    if state_dtype == "fp32":   # and as the run never interrupted
        straight, _ = make(tmp_path, *uniform(split))
        assert train(straight, data)[0] == losses
        assert_same(gathered(straight), params)
        infinity.release(straight)


def test_a_checkpoint_from_before_the_first_step_restarts_a_trained_split_run(tmp_path):
    """Its moments were never stepped (the manifest says so): the load must clear those the split run's device and
    host shares hold in memory, as well as the NVMe share's."""
    split = ("device", "nvme", 0.3, 0.4)
    model, _ = make(tmp_path, *uniform(split))
    infinity.save_checkpoint(tmp_path / "ckpt", model, infinity.AdamW(model, lr=1e-2, weight_decay=0.1))
    infinity.release(model)
    fresh, _ = make(tmp_path, *split)
    expected = train(fresh, batches(2, seed=5))[0], gathered(fresh)
    infinity.release(fresh)
    model, _ = make(tmp_path, *split)
    _, opt = train(model, batches(3))
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert train(model, batches(2, seed=5), opt)[0] == expected[0]
    assert_same(gathered(model), expected[1])
    infinity.release(model)


# -- 4. compressed moments ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_compressed_moments_in_a_host_and_nvme_split(tmp_path, state_dtype):
    split = ("host", "nvme", 0.0, 0.5)
    data = batches(4)
    runs = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s, optimizer={"state_dtype": state_dtype})
        store = engine_of(model).store
        runs.append((train(model, data)[0], gathered(model), store.layout.sub_ranges))
        assert store.moment_format.compressed and kinds(model)[0] == ("host" if s is split else "nvme")
        infinity.release(model)
    (losses, params, subs), (ref_losses, ref_params, ref_subs) = runs
    # The cut falls on a sub-group boundary of the uniform layout here, so the stochastic rounding draws the
    # same numbers (seeded by step and sub-group): the compressed steps are the same, bit for bit.
    assert subs == ref_subs
    assert losses == ref_losses and losses[-2] < losses[0]
    assert_same(params, ref_params)


def test_compressed_moments_are_refused_with_a_device_share(tmp_path):
    with pytest.raises(ConfigError, match=r"^optimizer.state_dtype: \"int8\" moments .*tiers.optimizer_device_share"):
        infinity.load_config(config(tmp_path, "device", "nvme", 0.5, 0.0, optimizer={"state_dtype": "int8"}))


# -- 5. refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split,sections,key,words", [
    (("device", "nvme", 0.5, 0.0), {"dpu": {"enabled": True}}, "tiers.optimizer_device_share", "dpu.enabled"),
    (("device", "nvme", 0.0, 0.5), {"dpu": {"enabled": True}}, "tiers.optimizer_host_share", "dpu.enabled"),
    (("device", "device", 0.5, 0.0), {}, "tiers.optimizer_device_share", "already the device"),
    (("device", "auto", 0.5, 0.0), {}, "tiers.optimizer_device_share", "chooses the shares itself"),
    (("device", "auto", 0.0, 0.5), {}, "tiers.optimizer_host_share", "chooses the shares itself"),
    (("device", "host", 0.0, 0.5), {}, "tiers.optimizer_host_share", "needs them on \"nvme\""),
    (("device", "nvme", 0.6, 0.5), {}, "tiers.optimizer_host_share", "more than the whole"),
    (("device", "nvme", 1.5, 0.0), {}, "tiers.optimizer_device_share", ""),
], ids=["dpu-device", "dpu-host", "optimizer-device", "auto-device", "auto-host", "host-with-host",
        "sum", "range"])
def test_what_a_split_cannot_run_with_is_refused_naming_the_key(tmp_path, split, sections, key, words):
    with pytest.raises(ConfigError, match=rf"^{key}: .*{words}") as err:
        infinity.load_config(config(tmp_path, *split, **sections))
    assert err.value.key == key


def test_a_checkpoint_in_place_is_refused_with_a_split(tmp_path):
    model, _ = make(tmp_path, "nvme", "nvme", 0.0, 0.5)
    _, opt = train(model, batches(1))
    with pytest.raises(CheckpointError, match=r"in_place=True.*split over tiers.*tiers.optimizer_host_share = 0.5"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)     # an ordinary save still works
    infinity.release(model)


# -- 6. where the bytes are --------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [SPLITS[1], SPLITS[3]], ids=ident)
def test_each_tier_holds_its_shares_states(tmp_path, split):
    in_use = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s)
        _, opt = train(model, batches(2))
        tiers = engine_of(model).tiers.stats()
        in_use.append({k: tiers[k]["bytes_in_use"] for k in ("device", "host", "nvme") if k in tiers})
        if s is split:
            assert_cut(model, *split[2:], split[1])
            shares = infinity.stats(model)["optimizer_tiers"]
            assert set(shares) == set(kinds(model))
            assert sum(v["elements"] for v in shares.values()) == engine_of(model).store.layout.total_numel
            assert (opt.stats()["device_share_seconds"] > 0) == (split[2] > 0)
        infinity.release(model)
    got, base = in_use
    # What the shares moved out of tiers.optimizer is now in the share tiers, nonzero in each.
    for kind, share in (("device", split[2]), ("host", split[3])):
        if share:
            assert got[kind] > base[kind], (got, base)
    assert got[split[1]] < base[split[1]], (got, base)


def test_the_device_shares_update_moves_no_nvme_bytes(tmp_path, monkeypatch):
    """The device share's pass, inside ``opt.step()``, leaves the NVMe share to the overlapped pass, also the
    first one, which writes every NVMe sub-group's zero moments (before, it streamed them all a second time)."""
    from infinity.optim.update import UpdatePass

    model, _ = make(tmp_path, "device", "nvme", 0.5, 0.0)
    nvme = engine_of(model).tiers.by_name["nvme"]
    moved = []
    run = UpdatePass.run

    def counted(self, job):
        before = nvme.stats()
        run(self, job)
        after = nvme.stats()
        moved.append((self.lane, after["bytes_read"] - before["bytes_read"],
                      after["bytes_written"] - before["bytes_written"]))

    monkeypatch.setattr(UpdatePass, "run", counted)
    train(model, batches(2))[1].synchronize()
    assert [lane for lane, *_ in moved] == ["device", "host"] * 2, moved
    assert all(nbytes == [0, 0] for lane, *nbytes in moved if lane == "device"), moved
    assert all(written > 0 for lane, _, written in moved if lane == "host"), moved


# -- 7. stage 2 ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [("device", "host", 0.5, 0.0), ("device", "nvme", 0.3, 0.4)], ids=ident)
def test_stage_2_with_a_device_share_trains_as_torch(tmp_path, split):
    model, ref = make(tmp_path, *split, partition={"stage": 2})
    opt, _, out, _ = run_schedule(model, ref, 4, warmup=10 ** 6, clip=0.5, lr_at=lambda k: 1e-2 * 0.8 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert_cut(model, *split[2:], split[1])
    assert opt.stats()["device_share_seconds"] > 0
    assert gathered_diff(model, ref) <= TOL


# -- what review found ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [("device", "host", 0.5, 0.0), ("host", "nvme", 0.3, 0.4)], ids=ident)
def test_a_param_group_added_later_is_stepped_in_the_device_share_too(tmp_path, split):
    """``add_param_group`` gives every lane the new ranges: the first block (in the device share) joined later
    trains as in the uniform run (it stayed at its initial values, silently, when only the host lane knew)."""
    runs = []
    for s in (split, uniform(split)):
        model, _ = make(tmp_path, *s)
        first = list(model.blocks[0].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        opt = infinity.AdamW(rest, lr=1e-2, weight_decay=0.1)
        opt.add_param_group({"params": first})
        losses, _ = train(model, batches(3), opt)
        runs.append((losses, gathered(model)))
        infinity.release(model)
    assert runs[0][0] == runs[1][0]
    assert_same(runs[0][1], runs[1][1])


def test_the_device_share_writes_copies_on_nvme_from_host_memory(tmp_path, monkeypatch):
    """The NVMe tier writes from host memory only (on a GPU a device tensor fails there): the device share's new
    compute copies go down into the pinned staging first, then to their NVMe keys as host writes."""
    from infinity.runtime.datapath import DataPath

    model, _ = make(tmp_path, "nvme", "host", 0.5, 0.0, dtype="bfloat16")
    writes = []
    write = DataPath.write

    def seen(self, tier, key, src, offset=0, source="host"):
        writes.append((tier.kind, source))
        return write(self, tier, key, src, offset, source=source)

    monkeypatch.setattr(DataPath, "write", seen)
    train(model, [(i, t) for i, t in batches(2)])[1].synchronize()
    assert ("nvme", "host") in writes and ("nvme", "device") not in writes, sorted(set(writes))


def test_a_checkpoint_in_place_resumes_only_without_shares(tmp_path):
    from infinity.checkpoint.errors import CheckpointMismatchError

    cfg = config(tmp_path, "nvme", "nvme")
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Tiny()
    _, opt = train(model, batches(1))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, in_place=True)
    infinity.release(model)
    cfg["tiers"]["optimizer_host_share"] = 0.5
    with pytest.raises(CheckpointMismatchError, match=r"tiers.optimizer_host_share is 0.5.*resume with both shares 0"):
        with infinity.Init(cfg, resume=tmp_path / "ckpt"):
            Tiny()


def test_the_device_shares_copies_are_let_go_two_sub_groups_behind(tmp_path, monkeypatch):
    """The device lane's new compute copies (tensors of their own, in the device's memory) are waited for and
    dropped two sub-groups behind the update: held to the end of the pass, the whole share's copies would sit
    in device memory at once."""
    from infinity.optim import pipeline
    from infinity.runtime.datapath import LATE_COPIES_ENV

    monkeypatch.setenv(LATE_COPIES_ENV, "1000")    # copies a GPU has not finished when the pass moves on

    held = {}
    passes = pipeline.sub_groups

    def watched(store, grad_keys, changed, grads=None, compact=False, streamed=True):
        lens = held.setdefault(streamed, [])
        for sub, st, writes in passes(store, grad_keys, changed, grads, compact, streamed):
            lens.append(len(writes))
            yield sub, st, writes

    monkeypatch.setattr(pipeline, "sub_groups", watched)
    runs = {}
    for bounded in (True, False):
        if not bounded:
            monkeypatch.setattr(pipeline, "_retire", lambda writes, marks, depth=2: None)
        held.clear()
        model, _ = make(tmp_path, "host", "nvme", 0.9, 0.0, dtype="bfloat16")
        train(model, batches(1))[1].synchronize()
        infinity.release(model)
        runs[bounded] = list(held[False])
    unbounded = runs[False]
    assert len(unbounded) >= 4 and unbounded == sorted(unbounded) and unbounded[-1] > 0, runs
    per_sub = max(b - a for a, b in zip([0] + unbounded, unbounded))
    assert max(runs[True]) <= 2 * per_sub < unbounded[-1], runs


@pytest.mark.parametrize("shares, key, kinds", [((0.001, 0.5), "device", {"host", "nvme"}),
                                                 ((0.3, 0.001), "host", {"device", "nvme"})])
def test_a_share_too_small_for_any_group_is_said(tmp_path, shares, key, kinds):
    with pytest.warns(RuntimeWarning, match=rf"tiers.optimizer_{key}_share = 0.001 holds no parameter group: the "
                                            r"states are cut at group boundaries.*both of its cuts fell on the same "
                                            r"boundary \(the group there has [\d,]+ elements\)") as said:
        model, _ = make(tmp_path, "host", "nvme", *shares)
    assert [str(w.message).split(" =")[0] for w in said] == [f"tiers.optimizer_{key}_share"]
    assert set(tier_split.shares(engine_of(model).store)) == kinds


def test_the_host_share_is_stepped_while_the_nvme_shares_first_reads_are_in_flight(tmp_path, monkeypatch):
    """One pass issues the first streamed sub-groups' reads, then steps the sub-groups in memory (the reads land
    meanwhile), then the streamed ones: in order, the first groups first, for a next forward that fetches in
    model order."""
    from infinity.optim import pipeline

    model, _ = make(tmp_path, "host", "nvme", 0.0, 0.6)
    store = engine_of(model).store
    passes, read = pipeline.sub_groups, store.io.read
    streamed_keys = {key for keys in store.keys.values() for sub, key in enumerate(keys) if not store.in_place_of(sub)}
    runs: list[list] = []

    def reading(tier, key, *args, **kw):
        if key in streamed_keys and tier.kind == "nvme" and runs:
            runs[-1].append("read")
        return read(tier, key, *args, **kw)

    def watched(*args, **kw):
        runs.append([])
        for item in passes(*args, **kw):
            runs[-1].append(item[0])
            yield item

    monkeypatch.setattr(store.io, "read", reading)
    monkeypatch.setattr(pipeline, "sub_groups", watched)
    train(model, batches(3))[1].synchronize()
    in_memory = {s for s in range(len(store.sub_tiers)) if store.in_place_of(s)}
    assert len(runs) == 3 and in_memory
    for run in runs:
        steps = [x for x in run if x != "read"]
        assert steps == sorted(steps) and in_memory <= set(steps) and len(steps) > len(in_memory), run
        first = run.index(min(in_memory))
        assert "read" in run[:first], f"the sub-groups in memory were stepped before any streamed read: {run}"
