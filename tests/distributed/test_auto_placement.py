"""``tiers = "auto"`` on several ranks: rank 0 decides and every rank runs its pair, whatever each rank's own
machine profile would have chosen (a branch around collectives must be decided by what every rank knows)."""
from __future__ import annotations

import torch

import infinity
from infinity.config import ConfigError, load_config
from infinity.plan.machine import MachineProfile
from infinity.plan.placement import resolve_auto
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches


_AUTO = {"tiers": {"params": "auto", "optimizer": "auto"}, "precision": {"dtype": "float32"}}


def _size() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT().parameters())


def _auto(rank, world, workdir):
    size = _size()
    box = MachineProfile(name=f"rank {rank}", device_bytes=0, host_bytes=4 * 2**30, unified=True,
                         device_update_params_per_s=1e9 if rank == 0 else 1.0)
    _, alone = resolve_auto(load_config(_AUTO), size, world_size=world, machine=box)     # what this rank would pick
    torch.manual_seed(0)
    with infinity.Init(_AUTO, model=size, machine=box) as init:
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    losses = []
    for idx, tgt in batches(2, 2, seed=rank):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    infinity.release(model)
    return (init.config.tiers.params, init.config.tiers.optimizer), alone.chosen.placement.pair, losses


def test_every_rank_runs_rank_0s_placement(tmp_path):
    results = run_ranks(_auto, 2, tmp_path)
    (ran0, own0, _), (ran1, own1, losses1) = results
    # Rank 1's device update is predicted to take 1 s per element: alone it would keep the states off the device.
    assert own0 == ("device", "device") and own1[1] != "device"
    assert ran0 == ran1 == own0
    assert all(torch.isfinite(torch.tensor(losses1)))


def _rank_0_fails(rank, world, workdir):
    """Rank 0's profile leaves no room for the model: it cannot decide. Every rank must raise, none wait."""
    box = MachineProfile(name=f"rank {rank}", device_bytes=0, host_bytes=(1024 if rank == 0 else 4 * 2**30),
                         unified=True)
    try:
        with infinity.Init(_AUTO, model=_size(), machine=box):
            TinyGPT()
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_placement_rank_0_cannot_decide_is_an_error_on_every_rank(tmp_path):
    """Each rank decided and then broadcast: rank 0 raised before the broadcast and rank 1 waited in it until
    the group's timeout (a hang under NCCL); now rank 0's error is what every rank raises."""
    said = run_ranks(_rank_0_fails, 2, tmp_path)
    assert said[0] is not None and said[0] == said[1], said
    assert "tiers.params" in said[0]


_AUTO_SPLIT = {"tiers": {"params": "auto", "optimizer": "auto"}, "precision": {"dtype": "float32"},
               "partition": {"sub_group_size": 4096}, "prefetch": {"device_bytes": "256KiB"}}


def _auto_split(rank, world, workdir):
    """Rank 0's profile has room on its device for part of the states only (and a slow host Adam): it splits
    them. Rank 1's would keep them all on its device; it runs rank 0's split, shares and all."""
    size = _size()
    if rank == 0:
        box = MachineProfile(name="rank 0", device_bytes=int(0.4 * 2**20), host_bytes=2**30,
                             host_adam_params_per_s=1e6)
    else:
        box = MachineProfile(name="rank 1", device_bytes=0, host_bytes=4 * 2**30, unified=True)
    _, alone = resolve_auto(load_config(_AUTO_SPLIT), size, world_size=world, machine=box)
    torch.manual_seed(0)
    with infinity.Init(_AUTO_SPLIT, model=size, machine=box) as init:
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    losses = []
    for idx, tgt in batches(2, 2, seed=rank):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    t = init.config.tiers
    kinds = sorted(infinity.stats(model)["optimizer_tiers"])
    infinity.release(model)
    return ((t.params, t.optimizer, t.optimizer_device_share, t.optimizer_host_share), alone.tiers(), kinds,
            init.placement.tiers(), losses)


def test_every_rank_runs_rank_0s_split_of_the_optimizer_states(tmp_path):
    (ran0, own0, kinds0, decided0, _), (ran1, own1, kinds1, decided1, losses1) = run_ranks(_auto_split, 2, tmp_path)
    assert own0["optimizer_device_share"] > 0 and own1["optimizer_device_share"] == 0
    assert ran0 == ran1 == tuple(own0.values()) and decided0 == decided1 == own0
    assert kinds0 == kinds1 == ["device", "host"]
    assert all(torch.isfinite(torch.tensor(losses1)))


def _least_free(rank, world, workdir, fails):
    from infinity.plan import placement, probes

    def free() -> float:
        if fails and rank == 1:
            raise RuntimeError("CUDA error: unknown (injected)")
        return (40e9, 25e9)[rank]      # another process holds part of rank 1's GPU

    probes.device_free_bytes = free
    return placement.least_free_device_bytes(None, None, None)


def test_auto_decides_for_the_gpu_with_the_least_free_memory(tmp_path):
    """Rank 0 decides for every rank: with its own GPU's free memory it would place states that do not fit a rank
    whose GPU another process shares. Every rank reads its own and rank 0 gets the least (None when one rank
    cannot read its own; that rank must still take part, or the others would wait in the all-reduce)."""
    assert run_ranks(_least_free, 2, tmp_path, False) == [25e9, 25e9]
    assert run_ranks(_least_free, 2, tmp_path, True) == [None, None]
