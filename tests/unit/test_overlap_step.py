"""The overlapped optimizer step (``dpu.overlap``): exact results while the update runs beside the forward.

Without DPU, when states or parameters are on NVMe, ``opt.step()`` hands the update to a
background thread and returns; each fetch of the next forward waits until the update has
rewritten that group's shard. These tests slow the update down so that the forward really
runs into groups not yet rewritten, and compare what the forward computes with (captured
by forward pre-hooks) against plain ``torch.optim.AdamW``, step by step.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import infinity
import infinity.errors
import infinity.optim.moments
from infinity.optim.background import BackgroundUpdate, UpdateWorkerError
from infinity.registry import engine_of
from tests.unit.test_dpu import TOL, Tiny, batches, gathered_diff, run_schedule

LAYOUTS = [("nvme", "nvme"), ("host", "nvme"), ("nvme", "host"), ("device", "nvme")]


def make(tmp_path, params, optimizer, overlap=True, prefetch=True, sub_group_size=4096):
    path = tmp_path / f"overlap-{overlap}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(path)},
           "partition": {"sub_group_size": sub_group_size},
           "prefetch": {"enabled": prefetch, "nvme_bytes": "64KiB", "device_bytes": "64KiB"},
           "dpu": {"overlap": overlap}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Tiny()
    torch.manual_seed(0)
    return model, Tiny()


@pytest.fixture
def slow_update(monkeypatch):
    """The next forward catches the update midway, whatever the machine's load: each job holds back
    the first sub-group it steps until a fetch waits for a group the job has not rewritten yet, or the main
    thread waits for the whole job (``synchronize``, the next step), and announces the others 3 ms late.

    The word to go on is given only to the job still holding its first sub-group, and only once the
    fetch sleeps on the job's progress: given earlier, the job could finish the group before
    ``wait_ready`` looked (a wait of 0 seconds), and given by a wait for a later sub-group it would let
    the next job through unheld."""
    announce, wait_ready, wait_job, submit = (BackgroundUpdate.sub_done, BackgroundUpdate.wait_ready,
                                              BackgroundUpdate.wait, BackgroundUpdate.submit)
    asked = threading.Event()
    past_first = [False]    # the running job has announced its first sub-group

    def let_go():
        if not past_first[0]:
            asked.set()

    def starting(self, job):
        past_first[0] = False
        return submit(self, job)

    def late(self, sub, copy_writes=()):
        if not past_first[0]:     # the job's first sub-group (not sub-group 0 when a device share was stepped)
            asked.wait(30.0)    # only a guard: one of the two waits below always comes
            asked.clear()
            past_first[0] = True
        else:
            time.sleep(0.003)
        announce(self, sub, copy_writes)

    def waiting(self, group):
        if self.ready(group):
            return wait_ready(self, group)
        progress = self._progress
        sleep = progress.wait
        slept = []

        def sleep_then_let_go(*args, **kwargs):
            if not slept:
                slept.append(True)
                let_go()
            return sleep(*args, **kwargs)

        progress.wait = sleep_then_let_go
        try:
            return wait_ready(self, group)
        finally:
            del progress.wait
            if not slept:
                let_go()     # it waited for writes, not for a sub-group

    def waiting_for_all(self):
        let_go()
        return wait_job(self)

    monkeypatch.setattr(BackgroundUpdate, "submit", starting)
    monkeypatch.setattr(BackgroundUpdate, "sub_done", late)
    monkeypatch.setattr(BackgroundUpdate, "wait_ready", waiting)
    monkeypatch.setattr(BackgroundUpdate, "wait", waiting_for_all)
    yield
    asked.set()     # a job still held back at the test's end goes on


@pytest.mark.parametrize("params,optimizer", LAYOUTS)
def test_overlapped_step_matches_torch_adamw_step_by_step(tmp_path, slow_update, params, optimizer):
    model, ref = make(tmp_path, params, optimizer)
    opt, reference, out, covered = run_schedule(model, ref, 6, warmup=10 ** 6, clip=0.5,
                                                lr_at=lambda k: 1e-2 * 0.8 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert covered == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
    stats = opt.stats()
    assert stats["overlap"] and stats["overlapped_steps"] == 6 and stats["sync_steps"] == 0, stats
    assert stats["worker_threads"] == 1   # dpu.threads = 0 with the CPU as compute device
    # The forwards did run into groups the update had not rewritten yet, and waited for them.
    fetch = engine_of(model).coordinator.stats
    assert fetch.update_wait_seconds > 0
    assert fetch.stall_seconds >= fetch.update_wait_seconds
    # With NVMe params, forwards took the shards the update had just written from host memory.
    assert (fetch.fresh_shards > 0) == (params == "nvme")
    assert gathered_diff(model, ref) <= TOL


def test_overlap_on_and_off_train_bit_identically(tmp_path, slow_update):
    results = []
    for overlap in (True, False):
        model, _ = make(tmp_path, "nvme", "nvme", overlap=overlap)
        opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.1)
        losses = []
        for idx, tgt in batches(5):
            loss = model(idx, tgt)
            loss.backward()
            infinity.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert opt.stats()["overlapped_steps"] == (5 if overlap else 0)
        with infinity.gathered(model):
            results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_on, params_on), (losses_off, params_off) = results
    assert losses_on == losses_off
    assert all(torch.equal(a, b) for a, b in zip(params_on, params_off))


def test_overlap_applies_only_where_the_update_moves_bytes_to_nvme(tmp_path):
    for params, optimizer, expected in [("host", "host", False), ("device", "host", False),
                                        ("nvme", "host", True), ("host", "nvme", True)]:
        model, _ = make(tmp_path / f"{params}-{optimizer}", params, optimizer)
        assert infinity.AdamW(model).stats()["overlap"] is expected, (params, optimizer)
    model, _ = make(tmp_path / "off", "nvme", "nvme", overlap=False)
    assert infinity.AdamW(model).stats()["overlap"] is False


def test_states_in_host_memory_overlap_only_beside_a_gpu():
    """On a GPU the host Adam runs beside the device's forward; on the CPU it would compete for cores."""
    from types import SimpleNamespace

    from infinity.optim.scheduler import UpdateScheduler

    def engine(device, kind="host", in_place=True, params="host", overlap=True, dpu=False):
        return SimpleNamespace(device=SimpleNamespace(is_cuda=device == "cuda"),
                               store=SimpleNamespace(in_place=in_place, tiers=[SimpleNamespace(kind=k) for k in
                                                                                kind.split("+")]),
                               config=SimpleNamespace(dpu=SimpleNamespace(overlap=overlap, enabled=dpu),
                                                      tiers=SimpleNamespace(params=params)))

    assert UpdateScheduler.overlap_wanted(engine("cuda")) is True
    assert UpdateScheduler.overlap_wanted(engine("cpu")) is False
    assert UpdateScheduler.overlap_wanted(engine("cuda", kind="device")) is False
    assert UpdateScheduler.overlap_wanted(engine("cpu", params="nvme")) is True
    assert UpdateScheduler.overlap_wanted(engine("cuda", overlap=False)) is False
    assert UpdateScheduler.overlap_wanted(engine("cuda", dpu=True)) is False
    # The states split over tiers: a host share overlaps beside a GPU (the device share is stepped in opt.step()).
    assert UpdateScheduler.overlap_wanted(engine("cuda", kind="device+host")) is True
    assert UpdateScheduler.overlap_wanted(engine("cpu", kind="device+host")) is False


@pytest.mark.parametrize("params", ["host", "device"])
def test_overlapped_step_with_states_in_host_memory_matches_torch(tmp_path, slow_update, monkeypatch, params):
    """What a GPU run does with host optimizer states, forced on the CPU: the update overlaps the
    next forward and every step still equals torch's AdamW."""
    from infinity.optim.scheduler import UpdateScheduler

    monkeypatch.setattr(UpdateScheduler, "overlap_wanted", staticmethod(lambda engine: True))
    model, ref = make(tmp_path, params, "host")
    opt, reference, out, covered = run_schedule(model, ref, 5, warmup=10 ** 6, clip=0.5,
                                                lr_at=lambda k: 1e-2 * 0.9 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    stats = opt.stats()
    assert stats["overlap"] and stats["overlapped_steps"] == 5 and stats["sync_steps"] == 0, stats
    assert engine_of(model).coordinator.stats.update_wait_seconds > 0
    assert gathered_diff(model, ref) <= TOL


def test_eval_forward_and_accumulation_without_zero_grad_see_the_update(tmp_path, slow_update):
    """A no-grad forward right after step() waits too; a backward without zero_grad accumulates
    onto gradients the update is no longer reading."""
    model, ref = make(tmp_path, "nvme", "nvme")
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    (idx, tgt), (idx2, tgt2) = batches(2)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(idx, tgt).backward()
        o.step()   # no zero_grad: the next backward accumulates, as torch does
    with torch.no_grad():
        assert abs(model(idx2, tgt2).item() - ref(idx2, tgt2).item()) <= 1e-5
    for m, o in ((model, opt), (ref, ref_opt)):
        m(idx2, tgt2).backward()
        o.step()
    assert gathered_diff(model, ref) <= TOL


def test_state_dict_and_checkpoint_paths_wait_for_the_update(tmp_path, slow_update):
    model, ref = make(tmp_path, "nvme", "nvme")
    opt, _, _, _ = run_schedule(model, ref, 3, warmup=10 ** 6)
    sd = opt.state_dict()    # waits: the master shards are those after step 3
    assert not opt.updates.overlap.running
    with infinity.gathered(model):
        for g, shard in zip(engine_of(model).coordinator.groups, sd["shards"]["master"]):
            assert torch.equal(g.shard_of(g.flatten().float()), shard[: g.shard_numel])


def test_failed_update_is_raised_by_the_next_forward(tmp_path, monkeypatch):
    model, _ = make(tmp_path, "nvme", "nvme")
    opt = infinity.AdamW(model)
    idx, tgt = batches(1)[0]
    model(idx, tgt).backward()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    monkeypatch.setattr(infinity.optim.moments, "fused_fp32_step", broken)     # the C pass, where it steps
    opt.step()   # handed over: returns at once
    opt.zero_grad()
    with pytest.raises(UpdateWorkerError, match=r"background optimizer step 1 .*kernel exploded.*partly updated"):
        model(idx, tgt)


@pytest.mark.parametrize("params, optimizer, overlap", [("nvme", "nvme", True), ("host", "host", False)])
def test_a_failed_update_damages_the_states_until_a_checkpoint_loads(tmp_path, monkeypatch, params, optimizer,
                                                                     overlap):
    """Partly updated states refuse to train or be saved (before: the loop went on with them, and saved
    them as a valid checkpoint); a load mends them, and training goes on as an untouched run's."""
    model, _ = make(tmp_path, params, optimizer, overlap=overlap)
    opt = infinity.AdamW(model, lr=1e-2)
    data = batches(3)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    idx, tgt = data[0]
    model(idx, tgt).backward()
    kernel = torch._fused_adamw_

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    monkeypatch.setattr(infinity.optim.moments, "fused_fp32_step", broken)
    with pytest.raises((UpdateWorkerError, RuntimeError), match="kernel exploded"):
        opt.step()
        opt.zero_grad()
        model(idx, tgt)         # overlapped: the failure is reported here
    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    monkeypatch.undo()
    opt.zero_grad()
    for call in (lambda: model(idx, tgt), opt.step, lambda: infinity.save_checkpoint(tmp_path / "bad", model, opt)):
        with pytest.raises(infinity.errors.EngineError, match="refused because .*kernel exploded.*partly updated.*"
                                                              "load a checkpoint"):
            call()
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    clean, _ = make(tmp_path / "clean", params, optimizer, overlap=overlap)
    runs = [(model, opt), (clean, infinity.AdamW(clean, lr=1e-2))]
    losses = [[], []]
    for idx, tgt in data:
        for (net, o), out in zip(runs, losses):
            loss = net(idx, tgt)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    assert losses[0] == losses[1]
    for net, _ in runs:
        infinity.release(net)


def test_fresh_shards_are_served_once_and_discarded_by_a_state_load(tmp_path):
    model, ref = make(tmp_path, "nvme", "nvme")
    opt = infinity.AdamW(model, lr=1e-2)
    coordinator = engine_of(model).coordinator
    initial = copy.deepcopy(opt.state_dict())   # a snapshot: state_dict, like torch's, shows the live states
    (idx, tgt), = batches(1)
    model(idx, tgt).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    fresh = coordinator.shards.fresh
    assert fresh.has(coordinator.groups[0]) and fresh.arena.bytes_in_use > 0
    opt.load_state_dict(initial)   # rewrites every shard: the fresh copies of step 1 are stale
    assert not any(fresh.has(g) for g in coordinator.groups)
    with torch.no_grad():
        assert model(idx, tgt).item() == pytest.approx(ref(idx, tgt).item(), abs=1e-6)
    model(idx, tgt).backward()
    opt.step()
    opt.zero_grad()
    served = fresh.served
    with torch.no_grad():
        model(idx, tgt)          # takes the fresh shards of step 2
    after_first = fresh.served
    assert after_first > served
    with torch.no_grad():
        model(idx, tgt)          # and cannot take them twice
    assert fresh.served == after_first


def test_a_fetch_after_a_failed_update_raises_instead_of_using_mixed_parameters(tmp_path, monkeypatch):
    """The update fails in its third sub-group: groups of the first two are rewritten, the rest
    are not. The first fetch afterwards must raise, not gather a mix."""
    model, _ = make(tmp_path, "nvme", "nvme")
    opt = infinity.AdamW(model)
    coordinator = engine_of(model).coordinator
    idx, tgt = batches(1)[0]
    model(idx, tgt).backward()
    announce = BackgroundUpdate.sub_done

    def fail_third(self, sub, copy_writes=()):
        if sub >= 2:
            raise OSError(28, "No space left on device (injected)")
        announce(self, sub, copy_writes)

    monkeypatch.setattr(BackgroundUpdate, "sub_done", fail_third)
    opt.step()
    opt.zero_grad()
    opt.updates.overlap.wait_idle()     # the job has failed; nothing has reported it yet
    last = coordinator.groups[-1]
    with pytest.raises(UpdateWorkerError, match=r"background optimizer step 1 .*injected.*partly updated"):
        coordinator.gather([last])
    assert opt.updates.overlap.ready(last)   # reported once, as DPU reports a failed step


def test_reset_gives_back_shards_left_half_filled():
    from types import SimpleNamespace

    from infinity.prefetch.fresh_shards import FreshShards
    from tiers.arena import Arena
    from tiers.host_alloc import HostAllocator

    arena = Arena(HostAllocator(pin="never").empty, 4 * 4096)
    fresh = FreshShards(arena)
    group = SimpleNamespace(index=0, name="g", shard_numel=2048, shard_nbytes=8192)
    fresh.offer(group, 0, torch.ones(1024))            # half of the shard: still filling
    assert arena.bytes_in_use == 8192 and not fresh.has(group) and fresh.held_bytes == 8192
    fresh.clear()                                        # end of a backward: complete ones only
    assert arena.bytes_in_use == 8192
    fresh.reset()                                        # before the next update: everything
    assert arena.bytes_in_use == 0 and fresh.held_bytes == 0
    fresh.offer(group, 0, torch.ones(1024))
    fresh.offer(group, 1024, torch.full((1024,), 2.0))
    piece = fresh.take(group)
    assert torch.equal(piece.tensor[:8192].view(torch.float32), torch.cat([torch.ones(1024), torch.full((1024,), 2.0)]))
    assert fresh.take(group) is None
    piece.release()
    assert arena.bytes_in_use == 0


class _DeviceCopy:
    """A compute-copy write as the device tier returns it on a GPU: pending on an event."""

    def __init__(self, inner) -> None:
        self.inner, self.event = inner, object()

    def done(self) -> bool:
        return False

    def wait(self) -> int:
        return self.inner.wait()


def test_device_copies_of_an_overlapped_update_order_the_stream_not_the_host(tmp_path, slow_update, monkeypatch):
    """With parameters on the device and states on the host (offload-optimizer on a GPU), the new
    compute copies are device copies: a fetch makes the compute stream wait for their events
    (``DataPath.use``) and neither the worker nor the forward waits for them on the host."""
    from infinity.optim.scheduler import UpdateScheduler
    from infinity.runtime.datapath import DataPath
    from infinity.runtime.shards import ParamShards

    monkeypatch.setattr(UpdateScheduler, "overlap_wanted", staticmethod(lambda engine: True))
    issued, used = set(), []
    alive = []      # every event seen stays alive: an id is an object's only while it lives
    write_updated = ParamShards.write_updated
    real_use = DataPath.use

    def as_device_copy(self, *args, **kwargs):
        fut = write_updated(self, *args, **kwargs)
        if getattr(fut, "event", None) is None:     # copies at once: stand in for the GPU's pending copy
            fut = _DeviceCopy(fut)
        issued.add(id(fut.event))
        alive.append(fut.event)
        return fut

    def use(self, event):
        if id(event) in issued:
            used.append(id(event))
        alive.append(event)
        real_use(self, event)       # the other copies' events (held late in tests) still order the "stream"

    monkeypatch.setattr(ParamShards, "write_updated", as_device_copy)
    monkeypatch.setattr(DataPath, "use", use)
    model, ref = make(tmp_path, "device", "host")
    opt, _, out, _ = run_schedule(model, ref, 4, warmup=10 ** 6, lr_at=lambda k: 1e-2)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert opt.stats()["overlapped_steps"] == 4
    model(*batches(1)[0])       # the last update's copies are ordered at the next forward's fetches
    # Every copy ordered on the stream at its group's fetch, unless found complete when the fetch asked (a
    # held copy that ran at a poll: a GPU's copy that had finished needs no wait either).
    events = {id(e): e for e in alive}
    assert issued and all(i in set(used) or getattr(events[i], "done", False) for i in issued)
    waits = infinity.stats(model)["transfers"]["host_waits"]
    assert waits["forward"] == 0 and waits["backward"] == 0, waits
