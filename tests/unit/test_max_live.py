"""``partition.max_live_parameters`` bounds the elements gathered on the compute device at once
([Note: live parameters] in infinity/runtime/coordinator.py): it was accepted and ignored before."""
import pytest
import torch

import infinity
from infinity.config import load_config
from infinity.errors import EngineError
from infinity.examples.gpt import GPT, GPTConfig
from infinity.registry import engine_of

SHAPE = GPTConfig(n_layer=6, d_model=32, n_head=4, vocab_size=128, seq_len=8)


def train_losses(model, opt, steps: int, shape: GPTConfig, batch: int) -> list[float]:
    """The losses of ``steps`` steps of ``model`` on one batch of ``batch`` random sequences, again and again."""
    idx = torch.randint(0, shape.vocab_size, (batch, shape.seq_len), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(max_live: int, steps: int = 4, persistence_threshold: int = 0):
    cfg = load_config("offload-host", overrides={
        "tiers": {"device": "cpu"}, "precision": {"dtype": "float32"},
        "partition": {"max_live_parameters": max_live, "persistence_threshold": persistence_threshold},
        "prefetch": {"device_bytes": "64MiB", "reuse_distance": "64MiB"}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(SHAPE)
    losses = train_losses(model, infinity.AdamW(model, lr=1e-3), steps, SHAPE, batch=1)
    groups = sorted(g.numel for g in engine_of(model).coordinator.groups)
    peak = infinity.stats(model)["fetch"]["peak_live_numel"]
    infinity.release(model)
    return losses, peak, groups


def test_the_bound_holds_gathers_ahead_and_kept_groups_and_changes_no_result():
    free_losses, free_peak, groups = _train(0)
    # Four of the six blocks and the small groups (embeddings, norms): above what modules use at once
    # (up to three blocks in backward, where a block is held until its gradient is reduced), below all.
    bound = 4 * groups[-1] + sum(g for g in groups if g < groups[-1])
    assert free_peak == sum(groups) > bound     # unbounded, the prefetcher and the reuse keep hold everything
    losses, peak, _ = _train(bound)
    assert peak <= bound
    assert losses == free_losses


def test_a_bound_below_the_largest_group_is_refused_naming_it():
    _, _, groups = _train(0, steps=0)
    with pytest.raises(EngineError, match=rf"partition.max_live_parameters = {groups[-1] - 1} is below "
                                          rf"{groups[-1]}: the 0 elements .* plus group '.*'s {groups[-1]} elements"):
        _train(groups[-1] - 1, steps=0)


def test_a_bound_below_the_groups_that_stay_gathered_is_refused():
    """Persistent groups (below partition.persistence_threshold) are always live: a bound that holds the
    largest group but not them beside it would stop every gather ahead for good."""
    _, _, groups = _train(0, steps=0)
    small = sum(g for g in groups if g < groups[-1])
    with pytest.raises(EngineError, match=rf"is below {small + groups[-1]}: the {small} elements of the groups "
                                          r"that stay gathered .*persistence_threshold = 10000"):
        _train(groups[-1], steps=0, persistence_threshold=10000)


def test_the_kept_group_needed_last_is_released_first(monkeypatch):
    """Groups kept for reuse carry where in the step they are needed next; the bound releases the one
    needed last first (it released them in set order, refetching some about to be used)."""
    from infinity.param_group import ParamState
    from infinity.runtime import coordinator as coordinator_module

    class Group:
        numel, state = 10, ParamState.NOT_AVAILABLE

    soon, later, last, new = Group(), Group(), Group(), [Group(), Group()]
    released = []

    class Coordinator:
        keep = {later: 200, last: 300, soon: 100}
        live, live_numel, max_live = {soon, later, last}, 30, 40
        prefetcher = None

        def busy(self, group):
            return False

    def release(coordinator, group):
        released.append(group)
        coordinator.live_numel -= group.numel

    monkeypatch.setattr(coordinator_module, "_release_gathered", release)
    fake = Coordinator()
    coordinator_module._make_room(fake, new)       # 20 more elements: one kept group must go
    assert released == [last] and set(fake.keep) == {soon, later}


def test_a_gather_on_demand_gives_back_groups_gathered_ahead_to_stay_within_the_bound():
    """The embedding is asked for first in a step, after the prefetcher gathered the first blocks ahead
    while it was still gathered (the end of the last backward): the gather on demand passed the bound,
    which gave back only groups kept for reuse. Now the groups gathered ahead needed last go first."""
    shape = GPTConfig(n_layer=6, d_model=32, n_head=4, vocab_size=4096, seq_len=8)
    cfg = load_config("offload-host", overrides={
        "tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}, "partition": {"persistence_threshold": 0}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        free = GPT(shape)
    free_losses = train_losses(free, infinity.AdamW(free, lr=1e-3), 4, shape, batch=1)
    groups = sorted(g.numel for g in engine_of(free).coordinator.groups)
    infinity.release(free)
    bound = groups[-1] + 3 * groups[-2] + sum(groups[:-2 - shape.n_layer + 1])
    assert bound < sum(groups)
    torch.manual_seed(0)
    with infinity.Init(load_config("offload-host", overrides={
            "tiers": {"device": "cpu"}, "precision": {"dtype": "float32"},
            "partition": {"persistence_threshold": 0, "max_live_parameters": bound}})):
        model = GPT(shape)
    losses = train_losses(model, infinity.AdamW(model, lr=1e-3), 4, shape, batch=1)
    assert infinity.stats(model)["fetch"]["peak_live_numel"] <= bound
    assert losses == free_losses
    infinity.release(model)
