"""A failure on one rank only, before a collective: every rank raises, none waits for ever; after the end of a
backward's collectives: that rank alone raises, and carries on without issuing them again.

See [Note: failing together] in infinity/runtime/ranks.py and [Note: a resumable end of backward] in
infinity/runtime/backward_end.py. The collective ledger (tests/support/ledger.py)
checks that the ranks' collectives stay the same throughout, and its timeout would name a rank left waiting.
"""
from __future__ import annotations

import errno
import os

import pytest
import torch

import infinity
from infinity.runtime.ranks import RanksFailedError
from tests.support.adapted import adapted
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


def _outcome(call, own) -> str:
    """What ``call()`` did on this rank: "no error", "own: <this rank's error>" or "other: <RanksFailedError>"."""
    try:
        call()
        return "no error"
    except own as exc:
        return f"own: {exc}"
    except RanksFailedError as exc:
        return f"other: {exc}"


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
            return what, _outcome(fn, Cut)
        finally:
            undo()

    step(0)
    idx, tgt = data[1]
    forward = attempt("forward", lambda: model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]),
                      engine._updates, "before_forward")    # a failed overlapped update, said at the forward
    ckpt = os.path.join(workdir, "ckpt")
    out = [forward, attempt("save", lambda: infinity.save_checkpoint(ckpt, model, opt), opt, "synchronize"),
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


def _weights(model):
    with infinity.gathered(model):
        return [p.detach().clone() for p in model.parameters()]


def _apart(model, ref) -> float:
    """The largest difference between the engine model's weights and torch's reference's."""
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(_weights(model), ref.parameters()))


def _beside_torch(workdir, stage, params, optimizer, extra=None):
    """An engine TinyGPT (fp32, ``stage``, its tiers, NVMe under ``workdir``, ``extra`` config sections) and its
    AdamW, beside torch's same model and AdamW."""
    nvme = os.path.join(workdir, f"nvme-{stage}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": nvme},
           "partition": {"stage": stage}, "precision": {"dtype": "float32"}}
    for section, keys in (extra or {}).items():
        cfg.setdefault(section, {}).update(keys)
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT()
    return model, infinity.AdamW(model, lr=1e-2), ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _norm_on_rank_zero(rank, world, workdir, stage):
    from infinity.errors import EngineError
    from infinity.registry import engine_of

    model, opt, ref, ref_opt = _beside_torch(workdir, stage, "device" if stage == 1 else "nvme", "host")
    engine_of(model).ranks.arrival_timeout_s = 2.0
    said, worst = "no error", 0.0
    for i, (idx, tgt) in enumerate(batches(3, 4)):
        model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
        if rank == 0 and i == 1:
            try:
                model.head.weight.grad.norm()       # the DDP habit: log a norm on rank 0 only
            except EngineError as exc:
                said = str(exc)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)) if i == 2 else None
        opt.step()
        opt.zero_grad()
        ref(idx, tgt).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)) if i == 2 else None
        ref_opt.step()
        worst = max(worst, _apart(model, ref))
        ref_opt.zero_grad()
        if norm is not None:        # every rank takes it: fine
            worst = max(worst, abs(norm - ref_norm) / ref_norm)
    infinity.release(model)
    return said, worst


@pytest.mark.parametrize("stage", [1, 3])
def test_a_gradient_norm_taken_on_one_rank_says_so_and_issues_no_collective(tmp_path, stage):
    """``if rank == 0: log(w.grad.norm())`` is fine with DDP; an engine gradient's norm needs every rank's
    shard (and at stage 1 a reduce-scatter first): the lone rank raises, the ranks' collectives stay the same,
    and training goes on as plain torch's (no clipping here: the other rank takes no norm this step)."""
    (said0, worst0), (said1, worst1) = run_ranks(_norm_on_rank_zero, 2, tmp_path, stage, collective_timeout=60)
    assert "is a collective over the 2 ranks" in said0 and "call it on every rank" in said0, said0
    assert said1 == "no error"
    assert max(worst0, worst1) <= 1e-5, (worst0, worst1)


def _norm_read_fails_on_one_rank(rank, world, workdir, stage, where):
    """Rank 1's read of a stored gradient shard (``where`` "read_state_shard"), or its settling of the gradients
    after stage 1's reduce-scatters ("settle": the data path's wait for their writes), fails inside
    ``clip_grad_norm_`` (rank-local); then every rank takes the norm again and steps. Returns what each call said, the collectives the failed norm issued, and
    the largest difference from plain torch (norms and weights)."""
    from infinity.registry import engine_of

    model, opt, ref, ref_opt = _beside_torch(workdir, stage, "device", "nvme" if stage == 3 else "host")
    engine = engine_of(model)
    worst = 0.0
    for i, (idx, tgt) in enumerate(batches(3, 4)):
        model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
        ref(idx, tgt).backward()
        if i == 1:
            undo = _fail_on(rank, engine.store, where) if where == "read_state_shard" else \
                _fail_on(rank, engine.datapath, where)
            before = engine.ranks.comm.calls_so_far()
            try:
                said = _outcome(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), Cut)
            finally:
                undo()
            issued = engine.ranks.comm.calls_so_far() - before
        if i >= 1:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            worst = max(worst, abs(norm - ref_norm) / ref_norm)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, _apart(model, ref))
    infinity.release(model)
    return said, issued, worst


@pytest.mark.parametrize("stage, where", [(1, "read_state_shard"), (3, "read_state_shard"), (1, "settle")])
def test_a_gradient_norm_whose_read_fails_on_one_rank_fails_on_every_rank(tmp_path, stage, where):
    """The read of a gradient shard, or stage 1's settling after its reduce-scatters, fails on rank 1 alone: its
    failure rides on the norm's own all-reduce, so rank 0 raises too instead of waiting in that all-reduce for
    ever; called again, the norm is torch's. At stages 2-3 the norm issues that one all-reduce and nothing more."""
    (said0, issued0, worst0), (said1, issued1, worst1) = run_ranks(
        _norm_read_fails_on_one_rank, 2, tmp_path, stage, where, collective_timeout=60)
    assert said1 == f"own: rank 1: injected failure in {where}", said1
    assert said0.startswith("other: rank 0: rank(s) [1] failed in the 2-norm of engine gradients"), said0
    assert issued0 == issued1 and (stage == 1 or issued0 == 1), (issued0, issued1)
    assert max(worst0, worst1) <= 1e-5, (worst0, worst1)


def _refused_on_one_rank(rank, world, workdir):
    """After the backward, rank 1 alone clears one parameter's .grad (a partial clear, refused by the step)."""
    from infinity.errors import EngineError

    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "partition": {"stage": 2},
                        "precision": {"dtype": "float32"}}):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    idx, tgt = batches(1, 4)[0]
    model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
    if rank == 1:
        model.ln_f.weight.grad = None
    said = _outcome(opt.step, EngineError)
    infinity.release(model)
    return said


def test_a_step_refused_on_one_rank_is_refused_on_every_rank(tmp_path):
    """The refusal comes after the step's agreement and before its exchange: it rides on the exchange."""
    said0, said1 = run_ranks(_refused_on_one_rank, 2, tmp_path, collective_timeout=60)
    assert said1.startswith("own: ") and "was cleared but that of" in said1, said1
    assert said0.startswith("other: rank 0: another rank refused this opt.step()"), said0


def _relayout_fails_on_one_rank(rank, world, workdir):
    from infinity.optim import relayout

    if rank == 1:
        def build_store(*args, **kwargs):
            raise Cut("rank 1: injected failure building the new layout")

        relayout.build_store = build_store
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "device", "optimizer": "host"}, "precision": {"dtype": "float32"}}):
        model = TinyGPT()
    model.blocks.requires_grad_(False)      # frozen after Init: the optimizer moves them apart
    said = _outcome(lambda: infinity.AdamW(model, lr=1e-2), Cut)
    infinity.release(model)
    return said


def test_a_relayout_that_fails_on_one_rank_stops_every_rank(tmp_path):
    said0, said1 = run_ranks(_relayout_fails_on_one_rank, 2, tmp_path, fresh=True, collective_timeout=60)
    assert said1 == "own: rank 1: injected failure building the new layout", said1
    assert said0.startswith("other: rank 0: another rank failed while"), said0


def _hand_off_fails_on_one_rank(rank, world, workdir, stage, where):
    """Three steps beside torch's; at step 1 the disk fills on rank 1 while a gradient shard is added to its NVMe
    accumulator (the second addition of the step: groups are handed over before it and after it). The step's
    ``opt.step()`` (``where="step"``), ``opt.clip_grad_norm_`` (``"clip"``) or torch's (``"torch clip"``: the
    engine gradients' norm) tells every rank (``"clamp"``: torch's ``clip_grad_value_`` first, which changes
    nothing on rank 1, then ``opt.step()``); each zero_grad()s
    and redoes the step; ``"in backward"``: with the update during backward (small sub-groups), rank 0 has stepped
    sub-groups when the step is refused, which leaves its states damaged: the next forward refuses on every rank,
    each loads the checkpoint saved before the step and redoes it. ``"host"`` and ``"device"``: the optimizer's
    states in host memory (the shard downloaded straight into the accumulator: the second such download fails) or
    on the device (added there), ``opt.step()`` refusing. Returns what each call said, whether the failure was reached and the
    weights' largest difference from torch's."""
    from infinity.errors import EngineError
    from infinity.registry import engine_of

    extra = {"optimizer": {"update_in_backward": True}, "partition": {"sub_group_size": 4096}} \
        if where == "in backward" else None
    optimizer = where if where in ("host", "device") else "nvme"
    model, opt, ref, ref_opt = _beside_torch(workdir, stage, "device" if stage < 3 else "nvme", optimizer, extra)
    store, armed, hit, said, worst = engine_of(model).store, [0], [], [], 0.0
    name = "direct_grad" if where == "host" else "accumulate_grad"
    hand = getattr(store, name)

    def full_disk(*args, **kwargs):
        armed[0] -= 1
        if armed[0] == 0:
            hit.append(True)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return hand(*args, **kwargs)

    setattr(store, name, full_disk)
    clip = {"clip": lambda: opt.clip_grad_norm_(1.0),
            "torch clip": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
            "clamp": lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)}.get(where)
    call = opt.step if clip is None or where == "clamp" else clip
    ckpt = os.path.join(workdir, "before")
    for i, (idx, tgt) in enumerate(batches(3, 4)):
        mine = idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]
        armed[0] = 2 if i == 1 and rank == 1 else 0
        if i == 1 and where == "in backward":
            infinity.save_checkpoint(ckpt, model, opt)
        model(*mine).backward()     # rank 1's backward goes on with its collectives
        if i == 1:
            if where == "clamp":
                clip()      # on rank 1 too: no error there alone, the step refuses on both
            said.append(_outcome(call, EngineError))
            opt.zero_grad()
            if where == "in backward":
                said.append(_outcome(lambda: model(*mine), EngineError))    # damaged: refused until a load
                infinity.load_checkpoint(ckpt, model, opt)
            model(*mine).backward()
        if clip is not None:
            clip()
        opt.step()
        opt.zero_grad()
        ref(idx, tgt).backward()
        if where == "clamp":
            torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, _apart(model, ref))
    infinity.release(model)
    return said, bool(hit), worst


@pytest.mark.parametrize("stage, where", [(1, "step"), (2, "step"), (3, "step"), (1, "clip"), (3, "clip"),
                                          (3, "in backward"), (2, "host"), (3, "device"), (1, "torch clip"),
                                          (2, "torch clip"), (1, "clamp"), (3, "clamp")])
def test_a_gradient_hand_off_that_fails_on_one_rank_stops_every_rank_at_the_next_agreement(tmp_path, stage, where):
    """Without [Note: a hand-off that fails on one rank], rank 1 raised in its backward (stage 1: in its step,
    between the reduce-scatters) and rank 0 waited in the next reduce-scatter until gloo's timeout. Now rank 1
    issues every collective rank 0 does (the ledger compares them), both raise at the next agreement, and the
    redone step trains as torch does."""
    (said0, failed0, worst0), (said1, failed1, worst1) = run_ranks(
        _hand_off_fails_on_one_rank, 2, tmp_path, stage, where, collective_timeout=60)
    assert failed1 and not failed0, "the injected failure was not reached on rank 1 alone"
    mine, theirs = said1[0], said0[0]
    assert mine.startswith("own: ") and "rank 1: handing a gradient shard over to the optimizer failed" in mine \
        and "No space left on device (injected)" in mine, mine
    assert theirs.startswith("other: rank 0: "), theirs
    if where == "in backward":      # rank 0 stepped sub-groups during backward: damaged; its forward refuses on both
        assert said0[1].startswith("own: ") and "load a checkpoint" in said0[1], said0
        assert said1[1].startswith("other: rank 1: rank(s) [0] failed in the forward"), said1
    assert max(worst0, worst1) <= 1e-5, (worst0, worst1)


def _end_fails_on_rank_zero(rank, world, workdir, scenario):
    """Four steps in which the release of the groups held for backward (``coordinator.end_backward``, after the
    end's collectives) fails on rank 0 with EIO. ``"carry on"``: once at steps 1 and 2; step 1: rank 0 catches it
    and every rank steps (the gradients are whole); step 2: the ranks learn of it (an all-reduce of the user's),
    zero_grad() and redo the step. ``"again"``: four times at step 1, at the backward's end, then at the retries
    of rank 0's zero_grad() and of its next two forwards, which every rank calls; then every rank zero_grad()s
    and redoes the step. ``"owed"``: twice, then every rank goes on to the next step as if nothing had
    failed (its forward, backward, step and zero_grad()), with the same batch. ``"twice"``: once at
    step 1, whose loss every rank then backpropagates a second time (``retain_graph``) and steps on, as torch's
    reference does. ``"norm"``: twice at step 1, at the backward's end and at the retry in rank 0's
    ``torch.nn.utils.clip_grad_norm_``, which every rank calls; then every rank calls it again and steps.
    Returns the errors each rank saw, the final weights, their largest difference from plain torch, and the
    gradient norms taken with torch's reference's beside them."""
    import torch.distributed as dist
    from infinity.errors import EngineError
    from infinity.registry import engine_of

    ref, model = adapted(engine=False), adapted(engine=True)
    engine = engine_of(model)
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    release, armed, said, norms = engine.coordinator.end_backward, [0], [], []

    def failing():
        if armed[0]:
            armed[0] -= 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        release()

    def noted(call, *errors) -> float:
        try:
            call()
        except errors as exc:
            said.append(f"{type(exc).__name__}: {exc}")
            return 1.0
        return 0.0

    engine.coordinator.end_backward = failing
    data = torch.randn(4, 4 * world, 8, generator=torch.Generator().manual_seed(2))
    for i, x in enumerate(data):
        mine = x[4 * rank:4 * rank + 4]
        if scenario in ("again", "owed") and i == 1:
            armed[0] = (4 if scenario == "again" else 2) if rank == 0 else 0
            noted(lambda: model(mine).backward(), OSError)
            noted(opt.zero_grad, OSError)       # rank 0 alone: its retry fails again
            if scenario == "again":    # and again in the forward's agreement; a forward that failed agrees again
                for _ in range(2):
                    noted(lambda: model(mine), OSError, EngineError, RanksFailedError)
                opt.zero_grad()
        if scenario == "norm" and i == 1:
            armed[0] = 2 if rank == 0 else 0
            noted(lambda: model(mine).backward(), OSError)
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # noqa: E731
            noted(clip, OSError, RanksFailedError)      # rank 0's retry fails again, in the agreement
            norms.append(float(clip()))
        twice = scenario == "twice" and i == 1
        if twice:
            armed[0] = int(rank == 0)
            loss = model(mine)
            noted(lambda: loss.backward(retain_graph=True), OSError)
            loss.backward()     # before anything closed the first backward, whose end failed on rank 0
            opt.step()
            opt.zero_grad()
        for attempt in range(0 if twice or norms and i == 1 else 2):
            armed[0] = int(scenario == "carry on" and rank == 0 and i in (1, 2) and attempt == 0)
            failed = noted(lambda: model(mine).backward(), OSError)
            if scenario == "carry on" and i == 2:      # the ranks agree on a redo, as a DDP user's loop would
                flag = torch.tensor([failed])
                dist.all_reduce(flag)
                if flag.item() > 0:
                    opt.zero_grad()
                    continue
            opt.step()
            opt.zero_grad()
            break
        ref_loss = sum(ref(x[4 * r:4 * r + 4]) for r in range(world)) / world
        if twice:
            ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        if norms and i == 1:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)))
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = infinity.state_dict(model), ref.state_dict()
    infinity.release(model)
    return said, got, max(float((got[k] - want[k]).abs().max()) for k in want), norms


def test_an_end_of_backward_that_fails_on_one_rank_after_its_collectives_does_not_issue_them_again(tmp_path):
    """Rank 0's backward raises and stays open; its next opt.step() or zero_grad() closes it and used to run the
    whole end again, the reducer's hand-over and the adapter's all-reduce included, which rank 1 never issues
    (the collective ledger refuses the mismatch; NCCL would hang). Now it goes on from the stage that failed:
    the ranks' collectives stay the same, and both train on as plain torch does, with the same weights."""
    (said0, got0, error0, _), (said1, got1, error1, _) = run_ranks(_end_fails_on_rank_zero, 2, tmp_path, "carry on",
                                                              collective_timeout=60)
    assert len(said0) == 2 and all("injected" in s for s in said0), said0
    assert said1 == []
    assert all(torch.equal(got0[k], got1[k]) for k in got0)
    assert max(error0, error1) <= 1e-6, (error0, error1)


def test_closing_a_backward_that_fails_again_on_one_rank_keeps_the_ranks_together(tmp_path):
    """Rank 0's end of backward fails, then so do its retries in zero_grad() and in the next two forwards. The
    zero_grad() of every rank makes the forward agree first, rank 0's included (its zero_grad() raised before it
    said so), the forward's retry runs inside the agreement, and a forward that failed there agrees again: every
    rank raises at both (the collective ledger refused the mismatch when rank 0 alone skipped the agreement, or
    failed outside it). Then every rank's zero_grad() closes it and the step redone trains as plain torch."""
    (said0, got0, error0, _), (said1, got1, error1, _) = run_ranks(_end_fails_on_rank_zero, 2, tmp_path, "again",
                                                              collective_timeout=60)
    assert [s.split(":")[0] for s in said0] == ["OSError"] * 4 and all("injected" in s for s in said0), said0
    assert len(said1) == 2 and all(s.startswith("RanksFailedError: rank 1: rank(s) [0] failed in the forward")
                                   for s in said1), said1
    assert all(torch.equal(got0[k], got1[k]) for k in got0)
    assert max(error0, error1) <= 1e-6, (error0, error1)


def test_a_zero_grad_that_failed_on_one_rank_is_finished_by_the_next_forward(tmp_path):
    """Rank 0's zero_grad() fails to close its backward, so its gradients stay where rank 1's are dropped, and
    the loop goes on. Trained on, rank 0's old gradients would be reduced into the next step's (its weights
    drift from torch's): the next forward, agreed on by every rank, finishes the clear first."""
    (said0, got0, error0, _), (said1, got1, error1, _) = run_ranks(_end_fails_on_rank_zero, 2, tmp_path, "owed",
                                                              collective_timeout=60)
    assert [s.split(":")[0] for s in said0] == ["OSError", "OSError"] and all("injected" in s for s in said0), said0
    assert said1 == []
    assert all(torch.equal(got0[k], got1[k]) for k in got0)
    assert max(error0, error1) <= 1e-6, (error0, error1)


def _clear_fails_on_one_rank(rank, world, workdir):
    """Three steps beside torch's (stage 2, states on NVMe); after step 1 rank 1's zero_grad() fails flushing its
    gradient writes, which rank 1 catches, and the loop goes on on both ranks."""
    from infinity.registry import engine_of

    model, opt, ref, ref_opt = _beside_torch(workdir, 2, "device", "nvme")
    store, said, worst = engine_of(model).store, [], 0.0
    clear = store.zero_grad
    for i, (idx, tgt) in enumerate(batches(3, 4)):
        model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
        opt.step()
        if i == 1 and rank == 1:
            def failing():
                store.zero_grad = clear
                raise Cut("rank 1: injected failure flushing the gradient writes")

            store.zero_grad = failing
        said.append(_outcome(opt.zero_grad, Cut))
        ref(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, _apart(model, ref))
    infinity.release(model)
    return said, worst


def test_a_clear_that_fails_part_way_on_one_rank_is_finished_by_the_next_forward(tmp_path):
    """Without it owed, rank 1 kept step 1's gradients (its clear raised after closing the backward, where only
    a failure to close was owed) and added step 2's to them: its weights, and through the reduce-scatter rank
    0's, drifted from torch's."""
    (said0, worst0), (said1, worst1) = run_ranks(_clear_fails_on_one_rank, 2, tmp_path, collective_timeout=60)
    assert said0 == ["no error"] * 3 and said1[0] == said1[2] == "no error", (said0, said1)
    assert said1[1] == "own: rank 1: injected failure flushing the gradient writes", said1
    assert max(worst0, worst1) <= 1e-6, (worst0, worst1)


def _write_back_fails_on_one_rank(rank, world, workdir, modifier):
    """``infinity.gathered(model, modifier_rank=modifier)`` changes every weight; rank 1's write-back fails at the second
    group it writes. Then each rank loads the checkpoint saved before and trains a step beside torch's."""
    from infinity.errors import EngineError
    from infinity.registry import engine_of

    model, opt, ref, ref_opt = _beside_torch(workdir, 3, "nvme", "nvme")
    engine, calls = engine_of(model), []
    ckpt = os.path.join(workdir, "before")
    infinity.save_checkpoint(ckpt, model, opt)
    write = engine.write_param_shard

    def failing(*args):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise Cut("rank 1: injected failure writing a group back")
        return write(*args)

    engine.write_param_shard = failing

    def block():
        with infinity.gathered(model, modifier_rank=modifier):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)

    said = [_outcome(block, Cut)]
    engine.write_param_shard = write
    idx, tgt = batches(1, 4)[0]
    said.append(_outcome(lambda: model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]), EngineError))
    infinity.load_checkpoint(ckpt, model, opt)
    model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2]).backward()
    opt.step()
    ref(idx, tgt).backward()
    ref_opt.step()
    worst = _apart(model, ref)
    infinity.release(model)
    return said, len(calls), worst


@pytest.mark.parametrize("modifier", [0, None])
def test_a_write_back_that_fails_on_one_rank_is_raised_on_every_rank_after_the_broadcasts(tmp_path, modifier):
    """With a modifier rank it raised on rank 1 between two groups' broadcasts, and rank 0 waited in the next
    one; without, on rank 1 alone, whose damaged states then refused its next forward alone. Now rank 1 issues
    every broadcast and both raise after them; rank 1's states are damaged, and its next forward refuses on both
    ranks, until the load."""
    (said0, calls0, worst0), (said1, calls1, worst1) = run_ranks(_write_back_fails_on_one_rank, 2, tmp_path,
                                                                 modifier, collective_timeout=60)
    assert said1[0] == "own: rank 1: injected failure writing a group back", said1
    assert said0[0].startswith("other: rank 0: rank(s) [1] failed in infinity.gathered's write-back"), said0
    assert said1[1].startswith("own: ") and "could not write the block's values back" in said1[1], said1
    assert said0[1].startswith("other: rank 0: rank(s) [1] failed in "), said0
    assert calls1 == 2 and calls0 > 2, (calls0, calls1)
    assert max(worst0, worst1) <= 1e-6, (worst0, worst1)


def test_a_second_backward_after_an_end_that_failed_on_one_rank_runs_its_own_end(tmp_path):
    """retain_graph: rank 0's first end fails after its collectives, and the second backward starts before
    anything closed it. It used to skip the second end's collectives on rank 0 (the count of stages done was
    the first one's); now the first end finishes first, and both ranks step as torch does."""
    (said0, got0, error0, _), (said1, got1, error1, _) = run_ranks(_end_fails_on_rank_zero, 2, tmp_path, "twice",
                                                              collective_timeout=60)
    assert len(said0) == 1 and "injected" in said0[0], said0
    assert said1 == []
    assert all(torch.equal(got0[k], got1[k]) for k in got0)
    assert max(error0, error1) <= 1e-6, (error0, error1)


def test_a_gradient_norm_whose_close_of_backward_fails_again_on_one_rank_keeps_the_ranks_together(tmp_path):
    """Rank 0's end of backward fails, then so does its retry in torch.nn.utils.clip_grad_norm_, which every rank
    calls: the retry runs in an agreement, so every rank raises there (rank 0 alone raised, and rank 1's
    all-reduce of the norm met rank 0's next collective instead: the ledger refused it). Called again, the norm
    is torch's on both ranks, and the step trains as plain torch."""
    (said0, got0, error0, norms0), (said1, got1, error1, norms1) = run_ranks(
        _end_fails_on_rank_zero, 2, tmp_path, "norm", collective_timeout=60)
    assert [s.split(":")[0] for s in said0] == ["OSError"] * 2 and all("injected" in s for s in said0), said0
    assert len(said1) == 1 and said1[0].startswith("RanksFailedError: rank 1: rank(s) [0] failed in the 2-norm"), said1
    for ours, torchs in (norms0, norms1):
        assert abs(ours - torchs) <= 1e-5 * torchs, (ours, torchs)
    assert all(torch.equal(got0[k], got1[k]) for k in got0)
    assert max(error0, error1) <= 1e-6, (error0, error1)


def _init_exit_fails_on_one_rank(rank, world, workdir):
    """Rank 1's node is short of host memory at infinity.Init's exit (its budget check refuses); then each rank
    builds the model again, with room, and trains a step."""
    from infinity.runtime import construction

    nvme = os.path.join(workdir, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB"}}
    undo = _fail_on(rank, construction.Partitioner, "_check_budget")
    torch.manual_seed(0)
    try:
        with infinity.Init(cfg):
            TinyGPT()
        first = "no error"
    except Cut as exc:
        first = f"own: {exc}"
    except RanksFailedError as exc:
        first = f"other: {exc}"
    undo()
    with infinity.Init(cfg):        # a retry in the same processes: the ranks' collectives still pair
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=1e-2)
    idx, tgt = batches(1, 4)[0]
    model(idx, tgt).backward()
    opt.step()
    infinity.release(model)
    return first


def test_an_init_whose_exit_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """A node short of room at infinity.Init's exit (its budget, the store's allocations, its tier writes, a
    resume's adoption) raised there alone: the other ranks left Init and waited in the optimizer's first
    collective. Now every rank raises at the exit, and a retry pairs its collectives as a first build does."""
    said0, said1 = run_ranks(_init_exit_fails_on_one_rank, 2, tmp_path, fresh=True, collective_timeout=60)
    assert said1 == "own: rank 1: injected failure in _check_budget", said1
    assert said0.startswith("other: rank 0: ") and "infinity.Init's exit" in said0, said0
