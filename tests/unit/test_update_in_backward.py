"""The optimizer step during backward (``[optimizer] update_in_backward``): the ordinary step's results, or a refusal.

See [Note: update during backward] in infinity/optim/in_backward.py.
"""
import os
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


def scheduled_steps(model, opt, sched, data) -> list[float]:
    """One step per batch of ``data``, the scheduler stepped after each (no clipping: refused with the key); the
    losses."""
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def _train(preset, swap, in_backward, dtype, steps=3, state_dtype="fp32"):
    model = _engine(preset, swap, in_backward, dtype, {"optimizer": {"state_dtype": state_dtype}})
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = infinity.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    losses = scheduled_steps(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7), batches(steps, 4))
    stats = opt.stats()
    shards = deepcopy(opt.state_dict()["shards"])
    infinity.release(model)
    return losses, shards, stats


@pytest.mark.parametrize("preset,dtype,state_dtype", [("nvme", "bfloat16", "fp32"), ("offload-host", "float32", "fp32"),
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


def test_refused_where_it_cannot_be_exact(tmp_path):
    for extra, key in [({"dpu": {"enabled": True}}, "dpu"), ({"precision": {"dtype": "float16"}}, "float16")]:
        over = {"optimizer": {"update_in_backward": True}, **extra}
        with pytest.raises(ConfigError, match="optimizer.update_in_backward") as err:
            infinity.load_config("nvme", overrides={"tiers": {"nvme_path": str(tmp_path)}, **over})
        assert key in str(err.value)
    model = _engine("nvme", tmp_path, True, "bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    (x, y), (x2, y2) = batches(2, 4)
    model(x, y).backward()
    with pytest.raises(EngineError, match="update_in_backward.*clip"):
        infinity.clip_grad_norm_(model, 1.0)
    with pytest.raises(EngineError, match="zero_grad.*update_in_backward"):
        opt.zero_grad()
    model.zero_grad()   # takes effect at the next step or backward
    with pytest.raises(EngineError, match="zero_grad.*update_in_backward"):
        opt.step()
    infinity.release(model)
    model = _engine("nvme", tmp_path, True, "bfloat16")
    infinity.AdamW(model, lr=1e-2)
    model(x, y).backward()
    with pytest.raises(EngineError, match="second gradient.*update_in_backward"):
        model(x2, y2).backward()    # accumulation over micro-batches
    infinity.release(model)


def test_gradients_never_go_to_nvme(tmp_path):
    model = _engine("nvme", tmp_path, True, "bfloat16", {"optimizer": {"state_dtype": "int8"}})
    opt = infinity.AdamW(model, lr=1e-2)
    store = registry.engine_of(model, "test").store
    grad_keys = set(store.keys["grad"])
    written = []
    write = store.io.write

    def spy(tier, key, *a, **k):
        written.append(key)
        return write(tier, key, *a, **k)

    store.io.write = spy
    for x, y in batches(2, 4):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert written and not grad_keys & set(written)
    infinity.release(model)


def test_plan_and_measurement_agree_on_nvme_bytes(tmp_path):
    """With int8 moments and the update during backward: no gradient bytes on NVMe, and the new compute copies
    handed to the next forward from host memory (the model fits ``prefetch.nvme_bytes``), planned as measured:
    read 2 (backward) + 2 + 2 + 2.03 (copy, remainder, m, v), written 2 + 2.03 + 2 (remainder, m, v, copy)."""
    from tests.unit.test_plan_engine import _config, per_parameter_after_steps
    cfg = _config(tmp_path, "nvme", "nvme", "bfloat16")
    cfg["optimizer"] = {"state_dtype": "int8", "update_in_backward": True}
    measured, planned, stats = per_parameter_after_steps(cfg)
    assert stats["in_backward_subs"] > 0
    assert measured["nvme_read"] == pytest.approx(planned["nvme_read"], rel=0.05)
    assert measured["nvme_written"] == pytest.approx(planned["nvme_written"], rel=0.05)
    assert measured["nvme_read"] + measured["nvme_written"] <= 14.5
    assert planned["nvme_read"] + planned["nvme_written"] <= 14.5


def _steady_reads(swap, nvme_bytes: int):
    """Losses, the last step's NVMe bytes read, the fresh shards served and the trainable groups' shard bytes."""
    model = _engine("nvme", swap, True, "bfloat16", {"optimizer": {"state_dtype": "int8"},
                                                     "prefetch": {"nvme_bytes": nvme_bytes}})
    opt = infinity.AdamW(model, lr=1e-2)
    engine = registry.engine_of(model, "test")
    losses = []
    for x, y in batches(3, 4):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    read = infinity.stats(model)["transfers"]["nvme_to_host"]["bytes"]   # step 2, forward to forward
    fresh = engine.coordinator.shards.fresh
    copies = sum(g.shard_nbytes for g in engine.coordinator.groups if g.trainable)
    served = fresh.served if fresh is not None else 0
    infinity.release(model)
    return losses, read, served, copies


def test_the_next_forward_takes_the_new_compute_copies_from_host_memory(tmp_path):
    """The sub-groups stepped during backward hand their new compute copies to the next forward (fresh shards):
    a steady step reads every trainable group's compute copy once less from NVMe than with no arena to hold
    them (``prefetch.nvme_bytes = 0``), and the losses are the same."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    held, read_held, served, copies = _steady_reads(tmp_path / "a", 256 << 20)
    none, read_none, served_none, _ = _steady_reads(tmp_path / "b", 0)
    assert held == none
    assert served_none == 0 and served >= 2 * len(held[1:])    # every group, in each forward after an update
    assert read_none - read_held == copies


def test_fresh_shards_of_the_update_in_backward_go_by_forward_order():
    """Offers displace shards the forward needs later; a read ahead in backward displaces any later shard; what
    could not make room displaces nothing; the end of the backward the update began in keeps its shards once."""
    from types import SimpleNamespace

    from infinity.prefetch.fresh_shards import FreshShards
    from tiers.arena import Arena
    from tiers.host_alloc import HostAllocator

    arena = Arena(HostAllocator(pin="never").empty, 3 * 4096)
    fresh = FreshShards(arena)
    groups = [SimpleNamespace(index=i, name=f"g{i}", shard_numel=1024, shard_nbytes=4096) for i in range(5)]
    fresh.reset(outlive_backward=True)
    for g in reversed(groups[1:]):      # backward order: g4, g3, g2 fill the arena; g1 displaces g4
        fresh.offer(g, 0, torch.full((1024,), float(g.index)))
    assert [fresh.has(g) for g in groups] == [False, True, True, True, False] and fresh.displaced == 1
    read = fresh.take_slice(4096, "prefetch g0", 0)     # a read in backward displaces g3, the last
    assert read is not None and [fresh.has(g) for g in groups] == [False, True, True, False, False]
    assert fresh.take_slice(3 * 4096, "prefetch g0", 0) is None and fresh.has(groups[1])   # cannot fit: kept
    read.release()
    fresh.clear()                       # the end of the backward the update began in
    assert fresh.has(groups[1]) and fresh.has(groups[2])
    piece = fresh.take(groups[1])
    assert torch.equal(piece.tensor.view(torch.float32), torch.full((1024,), 1.0))
    piece.release()
    fresh.clear()                       # the end of the next backward: leftovers go
    assert not fresh.has(groups[2]) and arena.bytes_in_use == 0


def _rank_run(rank, world, workdir):
    out = []
    for in_backward in (False, True):
        swap = f"{workdir}/swap-{in_backward}-{rank}"
        os.makedirs(swap)
        model = _engine("nvme", swap, in_backward, "bfloat16")
        out.append(rank_steps(model, rank, world, batches(2 * world, 4)))
    return out


def rank_steps(model, rank: int, world: int, data) -> tuple:
    """This rank's steps over ``data`` (``world`` batches a step, one each): its losses, its master shards and the
    sub-groups stepped during backward; the model is released after."""
    opt = infinity.AdamW(model, lr=1e-2)
    losses = []
    for i in range(len(data) // world):
        x, y = data[i * world + rank]
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    masters = [t.clone() for t in opt.state_dict()["shards"]["master"]]
    stepped = opt.stats().get("in_backward_subs", 0)
    infinity.release(model)
    return losses, masters, stepped


def assert_ranks_match(results) -> None:
    """Each rank's (ordinary, during backward) runs of ``rank_steps``: the same losses and masters, and sub-groups
    stepped during backward."""
    for plain, early in results:
        assert early[0] == plain[0]
        assert all(torch.equal(a, b) for a, b in zip(plain[1], early[1]))
        assert early[2] > 0


def test_two_ranks_match_the_ordinary_step(tmp_path):
    from tests.support.ranks import run_ranks
    assert_ranks_match(run_ranks(_rank_run, 2, tmp_path))


def test_a_non_finite_gradient_after_stepped_sub_groups_is_refused(tmp_path):
    model = _engine("nvme", tmp_path, True, "bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    model.wte.weight.register_hook(lambda g: g * float("inf"))  # the tied weight's gradient comes last
    (x, y), = batches(1, 4)
    model(x, y).backward()
    with pytest.raises(EngineError, match="inf/NaN.*already stepped.*update_in_backward"):
        opt.step()
    infinity.release(model)


def _interrupted_run(tmp_path, cut):
    """Three steps; in step 1, ``cut``, then what the error asks (load the checkpoint saved before the step) and the
    step redone. ``"ctrl-c"``: a KeyboardInterrupt in the model's backward once the update has stepped sub-groups,
    then ``zero_grad()``; ``"ctrl-c-step"``: the same, then ``opt.step()``, which must refuse to finish the half
    step; ``"inf"``: an inf gradient in the tied weight, found by ``opt.step()``; ``"ctrl-c-in-step"``: a
    KeyboardInterrupt in ``opt.step()`` once the gradients are handed over (there it may wait for room for held
    gradients); ``"reload"``: no error, the checkpoint loaded after a whole backward, in place of
    ``opt.step()``."""
    model = _engine("nvme", tmp_path / "swap", True, "bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    data = batches(3, 4)
    fired = []

    def interrupt(grad):
        if not fired and opt._in_backward.stepped:      # some sub-groups are stepped already
            fired.append(True)
            raise KeyboardInterrupt
        return grad

    hook, said = None, None
    step = 0
    while step < 3:
        x, y = data[step]
        if step == 1 and not fired:
            infinity.save_checkpoint(tmp_path / "before", model, opt, keep=1)
            if cut in ("ctrl-c", "ctrl-c-step"):
                hook = model.blocks[0].mlp[0].weight.register_hook(interrupt)
            elif cut == "inf":
                hook = model.wte.weight.register_hook(lambda g: fired.append(True) or g * float("inf"))
            elif cut == "reload":
                model(x, y).backward()
                assert opt._in_backward.stepped
                fired.append(True)
                infinity.load_checkpoint(tmp_path / "before", model, opt)   # a whole load: nothing damaged after
                said = "reloaded"
        try:
            model(x, y).backward()
            if cut == "ctrl-c-in-step" and step == 1 and not fired:
                hook = _InterruptStep(registry.engine_of(model, "test"), fired)
            opt.step()
            opt.zero_grad()
            step += 1
        except (KeyboardInterrupt, EngineError) as exc:
            hook.remove()
            calls = opt.step_count
            if cut == "ctrl-c-step":
                with pytest.raises(EngineError, match="update_in_backward.*load a checkpoint"):
                    opt.step()
                assert opt.step_count == calls
            opt.zero_grad()     # drops the gradients: the states are damaged, nothing to refuse
            with pytest.raises(EngineError, match="update_in_backward.*load a checkpoint"):
                model(x, y)
            infinity.load_checkpoint(tmp_path / "before", model, opt)
            said = exc
    with infinity.gathered(model):
        weights = [p.detach().float().clone() for p in model.parameters()]
    infinity.release(model)
    return weights, said if fired else None


class _InterruptStep:
    """A KeyboardInterrupt in ``opt.step()`` after its last gradient hand-offs (where it may have waited for room for
    held gradients), once; ``remove()`` takes it out."""

    def __init__(self, engine, fired) -> None:
        self.face, self.before_step = engine.grad_face, engine.grad_face.before_step

        def before_step(*args, **kwargs):
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return self.before_step(*args, **kwargs)

        self.face.before_step = before_step

    def remove(self) -> None:
        self.face.before_step = self.before_step


@pytest.mark.parametrize("cut", ["ctrl-c", "ctrl-c-step", "inf", "ctrl-c-in-step", "reload"])
def test_a_step_cut_short_after_stepped_sub_groups_is_damaged_and_a_load_trains_on_exactly(tmp_path, cut):
    """Half of a step applied cannot be redone (stepped twice) nor finished (the rest with part of its gradients):
    the states are damaged, opt.step() refuses, zero_grad() drops the gradients, a checkpoint load and the redone
    step end as the run that was never cut. A load after a whole backward drops its stepped sub-groups too."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "swap").mkdir()
    (tmp_path / "b" / "swap").mkdir()
    model = _engine("nvme", tmp_path / "a" / "swap", True, "bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    for x, y in batches(3, 4):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    with infinity.gathered(model):
        reference = [p.detach().float().clone() for p in model.parameters()]
    infinity.release(model)
    got, said = _interrupted_run(tmp_path / "b", cut)
    assert said is not None
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


def test_a_save_of_half_a_step_is_refused_and_a_load_waits_for_the_update(tmp_path, monkeypatch):
    """Between a backward and opt.step() the update during backward has stepped some sub-groups: a save would keep
    half a step (stepped twice on resume), so it is refused naming the key; a load drops the half step, after the
    worker, slowed here, has finished writing the states it was stepping (before, its writes could land after
    the load's)."""
    import time

    from infinity.optim.in_backward import InBackwardUpdate

    (tmp_path / "swap").mkdir()
    model = _engine("nvme", tmp_path / "swap", True, "bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    (x0, y0), (x1, y1) = batches(2, 4)
    model(x0, y0).backward()
    opt.step()
    opt.zero_grad()
    infinity.save_checkpoint(tmp_path / "after-1", model, opt, keep=1)
    with infinity.gathered(model):
        saved = [p.detach().float().clone() for p in model.parameters()]
    work = InBackwardUpdate.work

    def slow(self, job, ready):
        time.sleep(0.05)
        return work(self, job, ready)

    monkeypatch.setattr(InBackwardUpdate, "work", slow)
    model(x1, y1).backward()
    with pytest.raises(EngineError, match="save_checkpoint: .* stepped during backward.*update_in_backward.*opt.step"):
        infinity.save_checkpoint(tmp_path / "half", model, opt, keep=1)
    assert not (tmp_path / "half").exists() or not any((tmp_path / "half").iterdir())
    infinity.load_checkpoint(tmp_path / "after-1", model, opt)
    assert opt._in_backward.pending._count == 0 and not opt._in_backward.stepped
    with infinity.gathered(model):
        assert all(torch.equal(a, p.detach().float()) for a, p in zip(saved, model.parameters()))
    infinity.release(model)


def test_a_backward_faster_than_the_update_holds_no_more_gradients_than_the_plan(tmp_path, monkeypatch):
    """The worker slowed (a disk-bound update beside a fast backward): the gradients held in host memory and those of
    sub-groups queued for the worker stay within infinity-plan's held_grads row (two sub-groups and the largest
    group's) because backward waits for room, where before they grew to the whole model's; the results are the
    ordinary step's still."""
    import time

    from infinity.optim.in_backward import HeldGrads, InBackwardUpdate

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _train("nvme", tmp_path / "a", False, "bfloat16")
    work, accumulate = InBackwardUpdate.work, HeldGrads.accumulate
    peak, owners = [0], []

    def slow(self, job, ready):
        time.sleep(0.01)
        return work(self, job, ready)

    def watched(self, group_index, shard):
        accumulate(self, group_index, shard)
        peak[0] = max(peak[0], self.bytes_held() + owners[0].pending.nbytes)

    monkeypatch.setattr(InBackwardUpdate, "work", slow)
    monkeypatch.setattr(HeldGrads, "accumulate", watched)
    init = InBackwardUpdate.__init__

    def remembered(self, *args):
        init(self, *args)
        owners.append(self)

    monkeypatch.setattr(InBackwardUpdate, "__init__", remembered)
    early = _train("nvme", tmp_path / "b", True, "bfloat16")
    assert early[0] == plain[0]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(x, y) for x, y in zip(plain[1][name], early[1][name])), name
    store = owners[0].store
    layout = store.layout
    sub = layout.sub_group_size
    budget = (2 * sub + -(-max(layout.shard_numels) // sub) * sub) * store.grad_dtype.itemsize
    whole = sum(layout.shard_numels) * store.grad_dtype.itemsize
    assert 0 < peak[0] <= budget < whole / 3, (peak[0], budget, whole)
    assert early[2]["in_backward_wait_seconds"] > 0


class _WithSpare(TinyGPT):
    """A parameter the forward never uses: its sub-group waits for ``opt.step()``, which steps it as the rest."""

    def __init__(self):
        super().__init__(d=48)
        self.spare = torch.nn.Linear(48, 48)


def test_the_rest_of_the_update_holds_back_only_the_groups_it_steps(tmp_path, monkeypatch):
    """With the update overlapped, ``opt.step()`` hands the sub-groups backward left to the background worker. A
    group stepped during backward is final by then (``opt.step()`` waited for it): the next forward may take it
    while the rest runs, and only groups with a piece in the sub-groups still to step wait (they waited for the
    whole job before). The job is held at its first sub-group here, so the answer cannot come from its end."""
    import threading

    from infinity.optim.background import BackgroundUpdate

    gate, announce = threading.Event(), BackgroundUpdate.sub_done

    def held(self, sub, copy_writes=None):
        gate.wait(30.0)
        announce(self, sub, copy_writes)

    monkeypatch.setattr(BackgroundUpdate, "sub_done", held)
    cfg = infinity.load_config("nvme", overrides={
        "tiers": {"nvme_path": str(tmp_path)}, "partition": {"sub_group_size": 4096},
        "precision": {"dtype": "float32"}, "optimizer": {"update_in_backward": True}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = _WithSpare()
    opt = infinity.AdamW(model, lr=1e-2)
    engine = registry.engine_of(model)
    (x, y), = batches(1, 4)
    try:
        model(x, y).backward()
        opt.step()
        overlap = opt.updates.overlap
        job = overlap._running      # the rest of the update, held at its first sub-group
        assert job is not None and job.subs, "the spare's sub-group is left for opt.step()"
        pieces = engine.store.layout.pieces_of_group
        verdicts = {g.index: (overlap.ready(g), not any(p.sub_index in job.subs for p in pieces[g.index]))
                    for g in engine.coordinator.groups if g.index in job.updated}
        assert all(ready == final for ready, final in verdicts.values()), verdicts
        assert any(final for _, final in verdicts.values()) and not all(final for _, final in verdicts.values())
    finally:
        gate.set()
    opt.zero_grad()
    opt.synchronize()
    infinity.release(model)
