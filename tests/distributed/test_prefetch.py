"""Prefetching changes timing only: results, budgets and leaks, over tiers, paths and world sizes.

Each run trains a tiny GPT for a few steps under infinity (params and optimizer states on
NVMe or in host memory, prefetch on or off) next to a plain PyTorch reference, and
checks at every step: the loss equals the reference's; with prefetch on it is bitwise the
loss with prefetch off; the bytes held ahead, sampled at every request from the
coordinator's group states (not from the prefetcher's own counters), stay within
``prefetch.nvme_bytes`` / ``prefetch.device_bytes``; after every step no group is in
flight and every staging buffer is back. Models whose forward path depends on the data
(blocks reversed or skipped) exercise divergence; no-grad forwards between steps follow a trace of
their own and leave the training trace alone ([Note: inference passes] in infinity/prefetch/prefetcher.py).
"""
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import infinity
from infinity.param_group import ParamState
from infinity.registry import engine_of
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT, batches

STEPS = 7
NVME_BYTES = 64 << 10      # ~3 shards of the tiny model's larger groups: the budget binds
DEVICE_BYTES = 48 << 10


class PathGPT(TinyGPT):
    """TinyGPT with three blocks whose path depends on the batch (``idx[0, 0]`` odd).

    mode "reverse": the blocks run in reverse order (every parameter still gets a gradient);
    mode "skip": block 1 is skipped; mode "none": always the same path.
    """

    def __init__(self, mode: str = "none") -> None:
        super().__init__(layers=3)
        self.mode = mode

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        blocks = list(self.blocks)
        if int(idx[0, 0]) % 2 == 1:
            if self.mode == "reverse":
                blocks = blocks[::-1]
            elif self.mode == "skip":
                blocks = [b for i, b in enumerate(blocks) if i != 1]
        for block in blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)) * self.scale
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


OTHER_PATH_STEPS = (3, 5)


def _data(steps):
    """Batches whose first token is odd (the other path) on OTHER_PATH_STEPS only.

    With a trace recorded at step 0: steps 1-2 follow it, step 3 diverges, step 4 records
    anew, step 5 follows and diverges the same way again (warned once), step 6 records.
    """
    out = []
    for step, (idx, tgt) in enumerate(batches(steps, 2)):
        idx = idx.clone()
        idx[0, 0] = 2 * (idx[0, 0] // 2) + (step in OTHER_PATH_STEPS)
        out.append((idx, tgt))
    return out


class _Probe:
    """Samples the bytes held ahead at every request, from the groups' states alone."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.nvme = []
        self.device = []
        inner = engine.prefetcher.on_request

        def on_request(module, groups):
            inner(module, groups)
            self.sample(set(groups))

        engine.prefetcher.on_request = on_request

    def sample(self, needed) -> None:
        c = self.engine.coordinator
        self.nvme.append(sum(g.shard_nbytes for g in c.groups
                             if g.state is ParamState.INFLIGHT and g not in needed))
        self.device.append(sum(g.full_nbytes for g in c.groups
                               if g.state is ParamState.AVAILABLE and g not in needed and not g.persistent
                               and not c.in_use.get(g) and g not in c.backward_held and g not in c.keep))


def _leaks(engine) -> list[str]:
    """What is still held after a step (should be nothing)."""
    if engine.optimizer is not None:
        engine.optimizer.synchronize()   # the overlapped update, still filling fresh shards
    found = [f"{g.name} INFLIGHT" for g in engine.coordinator.groups if g.state is ParamState.INFLIGHT]
    pf = engine.prefetcher
    # Fresh shards of the overlapped step wait in the arena for the next forward, by design.
    shards = engine.coordinator.shards
    fresh = shards.fresh.held_bytes if shards.fresh is not None else 0
    if pf.arena is not None and pf.arena.bytes_in_use != fresh:
        found.append(f"arena holds {pf.arena.bytes_in_use} bytes, {fresh} of them fresh shards")
    pool = shards.staging.stats() if shards.staging is not None else None
    if pool and pool["in_use"]:
        found.append(f"staging pool lends {pool['in_use']} buffers")
    if engine.coordinator.keep:
        found.append(f"keep holds {len(engine.coordinator.keep)} groups")
    return found


def train(workdir, tiers, prefetch, mode="none", steps=STEPS, eval_at=(), world=1):
    """Train under infinity and plain torch side by side; returns losses and what was observed.

    ``workdir`` must be new for every run: it holds the run's NVMe swap files.
    """
    params, optim = tiers
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": params, "optimizer": optim, "nvme_path": nvme,
                     "pool_buffer_size": 1 << 20, "pool_buffers": 4},
           "partition": {"sub_group_size": 4096},
           "prefetch": {"nvme_bytes": NVME_BYTES, "device_bytes": DEVICE_BYTES, **prefetch}}
    torch.manual_seed(0)
    ref = PathGPT(mode)
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = PathGPT(mode)
    engine = engine_of(model)
    probe = _Probe(engine)
    opt = infinity.AdamW(model, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    losses, ref_losses, evals, leaks = [], [], [], []
    for step, (idx, tgt) in enumerate(_data(steps)):
        if step in eval_at:
            with torch.no_grad():
                evals.append((float(model(idx, tgt)), float(ref(idx, tgt))))
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()   # parameters that got no gradient are left alone, by both
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
        ref_losses.append(float(ref_loss.detach()))
        leaks += [f"step {step}: {what}" for what in _leaks(engine)]
    model(*_data(1)[0])              # one more forward closes the last step's record
    stats = infinity.stats(model)
    return {"losses": losses, "ref_losses": ref_losses, "evals": evals, "leaks": leaks,
            "max_nvme": max(probe.nvme, default=0), "max_device": max(probe.device, default=0),
            "steps": stats["steps"], "prefetch": stats["prefetch"]}


# Run name -> (tiers, mode, eval_at, prefetch settings, also run with prefetch off).
RUNS = {
    "nvme": (("nvme", "nvme"), "none", (), {"log_every": 2}, True),
    "host": (("host", "host"), "none", (), {}, True),
    "nvme-reverse": (("nvme", "nvme"), "reverse", (), {}, True),
    "nvme-skip-eval": (("nvme", "nvme"), "skip", (1,), {}, True),
    "nvme-reuse": (("nvme", "nvme"), "none", (), {"reuse_distance": 1 << 20}, False),
    "nvme-eval": (("nvme", "nvme"), "none", (0, 2, 3, 5), {}, True),   # step 0: before any training step
    "nvme-no-room": (("nvme", "nvme"), "none", (), {"nvme_bytes": 4096, "device_bytes": 4096}, False),
}
PAIRS = [n for n, run in RUNS.items() if run[4]]
WORLD2_RUNS = ("host", "nvme-reverse")
WORLD2_STEPS = 5        # record, follow, follow, diverge (step 3 takes the other path), record


def _run_all(rank, world, workdir, names, steps=STEPS):
    out = {}
    for name in names:
        tiers, mode, eval_at, settings, pair = RUNS[name]
        for enabled in (True, False) if pair else (True,):
            run_dir = os.path.join(workdir, f"rank{rank}-{name}-{'on' if enabled else 'off'}")
            out[name, enabled] = train(run_dir, tiers, {"enabled": enabled, **settings},
                                       mode, steps=steps, eval_at=eval_at, world=world)
    return out


def _check(results, names):
    """Every run: same as prefetch off, as plain torch, within budgets, nothing left held."""
    for rank, res in enumerate(results):
        for name in names:
            tiers, mode, _, settings, pair = RUNS[name]
            nvme_budget = settings.get("nvme_bytes", NVME_BYTES)
            device_budget = settings.get("device_bytes", DEVICE_BYTES)
            on = res[name, True]
            where = f"rank {rank}, run {name}"
            runs = [on]
            if pair:
                off = res[name, False]
                runs.append(off)
                assert on["losses"] == off["losses"], f"{where}: prefetch on/off losses differ"
                assert off["max_nvme"] == off["max_device"] == 0 and off["prefetch"]["trace"]["entries"] == 0
                assert all(s["hit_rate"] == 0 and s["trace"] == "off" for s in off["steps"])
            for step, (a, b) in enumerate(zip(on["losses"], on["ref_losses"])):
                assert abs(a - b) <= 1e-5, f"{where}: step {step} loss {a} vs plain torch {b}"
            for a, b in on["evals"]:
                assert abs(a - b) <= 1e-5, f"{where}: no-grad forward {a} vs plain torch {b}"
            for r in runs:
                assert r["leaks"] == [], f"{where}: {r['leaks']}"
                assert r["max_nvme"] <= nvme_budget, f"{where}: {r['max_nvme']} bytes read ahead"
                assert r["max_device"] <= device_budget, f"{where}: {r['max_device']} bytes gathered ahead"
            diverged = [s for s in on["steps"] if s["diverged"]]
            if mode == "none":      # evaluations between steps too: they have a trace of their own
                assert not diverged and on["prefetch"]["divergences"] == [], f"{where}: {diverged}"
            else:
                assert diverged and on["prefetch"]["divergences"], f"{where}: no divergence seen"


def _following(run):
    return [s for s in run["steps"] if s["trace"] == "following" and not s["diverged"]]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record) -> None:
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Every run once, world size 1 without torch.distributed, with the infinity log captured."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    log = logging.getLogger("infinity")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        results = _run_all(0, 1, str(tmp_path_factory.mktemp("one_rank")), list(RUNS))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        torch.set_num_threads(before)
    return results, handler.lines


def test_one_rank_matches_prefetch_off_and_torch_within_budgets(one_rank):
    results, _ = one_rank
    _check([results], list(RUNS))
    for name in ("nvme", "host", "nvme-reverse", "nvme-reuse"):
        following = _following(results[name, True])
        assert following, f"{name}: no step followed its trace"
        assert all(s["hit_rate"] > 0.5 for s in following), [s["hit_rate"] for s in following]
    assert results["nvme", True]["max_nvme"] > NVME_BYTES // 2, "reads ahead never came near the budget"
    assert results["host", True]["max_device"] > 0, "nothing was gathered ahead"


def test_evaluations_between_steps_follow_a_trace_of_their_own(one_rank):
    """Against the training trace the second no-grad forward diverged and the next training step recorded
    again; now the first evaluation records the inference passes' trace, the others follow it, and every
    training step after the first follows its own, prefetched."""
    results, _ = one_rank
    run = results["nvme-eval", True]
    assert [s["trace"] for s in run["steps"]] == ["recording"] + ["following"] * (STEPS - 1)
    assert all(s["hit_rate"] > 0.5 for s in run["steps"][1:]), [s["hit_rate"] for s in run["steps"]]
    passes = run["prefetch"]["inference_trace"]
    assert passes["mode"] == "following" and passes["recordings"] == 1 and passes["divergences"] == 0, passes
    assert passes["step"] == 3 and passes["entries"] > 0      # four passes: recorded, then followed three times
    assert len(run["evals"]) == 4 and run["prefetch"]["divergences"] == []
    off = results["nvme-eval", False]["prefetch"]
    assert off["inference_trace"]["entries"] == 0 and off["inference_trace"]["recordings"] == 0


def test_divergence_warned_once_per_distinct_divergence(one_rank):
    results, lines = one_rank
    warned = [m for level, m in lines if level == logging.WARNING and "left its recorded trace" in m]
    expected = sum(len(results[n, True]["prefetch"]["divergences"]) for n in RUNS)
    assert len(warned) == expected > 0
    assert any("forward blocks.0" in w and "forward blocks.2" in w for w in warned)    # reversed path
    assert any("forward blocks.1" in w and "forward blocks.2" in w for w in warned)    # skipped block
    assert not any("forward <root>" in w for w in warned)       # no-grad forwards: a trace of their own
    counts = [d["count"] for d in results["nvme-reverse", True]["prefetch"]["divergences"]]
    assert counts == [2]          # steps 3 and 5 diverge alike: counted twice, warned once
    steps = results["nvme-reverse", True]["steps"]
    assert [s["trace"] for s in steps] == ["recording", "following", "following", "diverged", "recording",
                                           "diverged", "recording"]


def test_skipped_block_matches_prefetch_off(one_rank):
    """Prefetching never changes a value, whatever the path; and a skipped block's parameters,
    which get no gradient on those steps, are left alone as torch.optim leaves them."""
    results, _ = one_rank
    on, off = results["nvme-skip-eval", True], results["nvme-skip-eval", False]
    assert on["losses"] == off["losses"] and len(on["losses"]) == STEPS
    assert on["losses"] == pytest.approx(on["ref_losses"], abs=1e-5)


def test_reuse_distance_keeps_groups_gathered(one_rank):
    results, _ = one_rank
    plain, reuse = _following(results["nvme", True])[-1], _following(results["nvme-reuse", True])[-1]
    assert results["nvme-reuse", True]["losses"] == results["nvme", True]["losses"]
    assert reuse["misses"] < plain["misses"]
    assert reuse["peak_kept_bytes"] > 0 and plain["peak_kept_bytes"] == 0
    assert reuse["tiers"]["nvme"]["bytes_read"] < plain["tiers"]["nvme"]["bytes_read"]


def test_budget_smaller_than_every_group(one_rank):
    results, _ = one_rank
    r = results["nvme-no-room", True]
    assert r["max_nvme"] == r["max_device"] == 0 and r["prefetch"]["arena"]["peak_bytes"] == 0
    assert all(s["hits"] == 0 for s in r["steps"]) and r["leaks"] == []


def test_stats_per_step_and_log_line(one_rank):
    results, lines = one_rank
    r = results["nvme", True]
    steps = r["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        for key in ("seconds", "stall_seconds", "read_wait_seconds", "stall_fraction", "hit_rate", "hits",
                    "misses", "late", "bytes_read", "bytes_written", "GBps", "tiers"):
            assert key in s, key
        assert 0 <= s["stall_fraction"] <= 1 and s["read_wait_seconds"] <= s["stall_seconds"] + 1e-9
        nvme = s["tiers"]["nvme"]
        assert nvme["bytes_read"] > 0 and nvme["bytes_written"] > 0 and nvme["read_GBps"] > 0
    assert steps[0]["trace"] == "recording" and steps[0]["hits"] == 0
    logged = [m for level, m in lines if level == logging.INFO and m.startswith("infinity step")]
    on = [m.split(":")[0] for m in logged if m.endswith("trace following")]
    off = [m.split(":")[0] for m in logged if m.endswith("trace off")]    # prefetch off meters too
    assert on == off == ["infinity step 1", "infinity step 3", "infinity step 5"]
    assert len(logged) == 6 and "nvme read" in logged[0] and "prefetch hit" in logged[0]
    current = r["prefetch"]["current_step"]
    assert current is not None and current["step"] == STEPS


def test_two_ranks(tmp_path):
    """Two gloo ranks, params and optimizer on NVMe (with a data-dependent path) and in host memory:
    gathers ahead are issued in the same order on both ranks (no hang, same losses)."""
    results = run_ranks(_run_all, 2, tmp_path, WORLD2_RUNS, WORLD2_STEPS)
    _check(results, WORLD2_RUNS)
    assert results[0]["host", True]["max_device"] > 0, "no group was gathered ahead with two ranks"
    for name in WORLD2_RUNS:
        assert results[0][name, True]["losses"] == results[1][name, True]["losses"]
        assert _following(results[0][name, True])


def test_evaluations_before_the_first_training_step_are_prefetched(tmp_path):
    """An evaluation at step 0 (the optimizer made, nothing trained yet) records the inference passes' trace
    at its first forward and follows it from the second."""
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)},
           "prefetch": {"nvme_bytes": NVME_BYTES, "device_bytes": DEVICE_BYTES}}
    with infinity.Init(cfg):
        model = PathGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    idx, tgt = _data(1)[0]
    with torch.no_grad():
        for _ in range(3):
            model(idx, tgt)
    passes = infinity.stats(model)["prefetch"]["inference_trace"]
    assert passes["mode"] == "following" and passes["recordings"] == 1 and passes["entries"] > 0, passes
    model(idx, tgt).backward()
    opt.step()
    infinity.release(model)


def _read_ahead_on_one_rank(rank, world, workdir):
    """After a step, rank 1 alone has the last group's read ahead still in flight (its prefetcher ran ahead
    of rank 0's: arena room and events seen done are each rank's own timing), and then every rank drops
    what it holds (a load, the end of a step). The drop used to finish that read's gather, all-gather
    included, on rank 1 alone."""
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB"},
           "precision": {"dtype": "float32"}, "prefetch": {"nvme_bytes": NVME_BYTES}}
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    coordinator = engine_of(model).coordinator
    worst, ahead = 0.0, None
    for i, (idx, tgt) in enumerate(batches(3, 4)):
        model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
        ref(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if i == 0:
            ckpt = os.path.join(workdir, "ckpt")
            infinity.save_checkpoint(ckpt, model, opt)
            if rank == 1:
                ahead = next(g for g in reversed(coordinator.groups) if g.state is ParamState.NOT_AVAILABLE)
                coordinator.start_fetch(ahead, prefetch=True)
                assert ahead.state is ParamState.INFLIGHT
            infinity.load_checkpoint(ckpt, model, opt)      # drops every group, the one in flight too
            assert ahead is None or ahead.state is ParamState.NOT_AVAILABLE
        with infinity.gathered(model):
            worst = max([worst] + [float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())])
    infinity.release(model)
    return worst


def test_a_read_ahead_dropped_on_one_rank_issues_no_collective(tmp_path):
    assert max(run_ranks(_read_ahead_on_one_rank, 2, tmp_path, collective_timeout=60)) <= 1e-5
