"""The collective wrapper: group ranks mean the group's ranks, and collectives refuse what NCCL would.

See [Note: what a collective may be given] in infinity/runtime/ranks.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from infinity.runtime.ranks import CollectiveError, Ranks
from tests.support.ranks import run_ranks
from tiers.host_alloc import HostAllocator


def _subgroup(rank, world, workdir):
    group = dist.new_group([2, 3])       # every rank takes part in making the group
    if rank < 2:
        return None
    ranks = Ranks(group, "cpu")
    value = torch.tensor([float(100 + rank)])
    ranks.broadcast(value, src=0)        # group rank 0 is global rank 2
    full = torch.zeros(4)
    ranks.all_gather(full, torch.full((2,), float(rank)))
    return ranks.rank, float(value), full.tolist()


def test_group_ranks_are_translated_for_a_subgroup(tmp_path):
    results = run_ranks(_subgroup, 4, tmp_path)
    assert results[:2] == [None, None]
    assert results[2] == (0, 102.0, [2.0, 2.0, 3.0, 3.0])
    assert results[3] == (1, 102.0, [2.0, 2.0, 3.0, 3.0])


def test_collectives_refuse_host_memory_and_other_devices():
    allocator = HostAllocator(pin="never")
    ranks = Ranks(None, "cpu", allocator)
    pooled = allocator.empty(4096).view(torch.float32)
    with pytest.raises(CollectiveError, match=r"all_reduce was given host memory of the tiers' allocator"):
        ranks.all_reduce_sum(pooled)
    with pytest.raises(CollectiveError, match=r"broadcast was given a tensor on meta .*compute device cpu"):
        ranks.broadcast(torch.empty(3, device="meta"))
    with pytest.raises(CollectiveError, match=r"rank 0: all_gather"):
        ranks.all_gather(torch.zeros(4), pooled[:4])
    ranks.all_reduce_sum(torch.ones(3))      # a compute-device tensor passes


def _other_reduce_op(rank, world, workdir):
    ranks = Ranks(None, "cpu")
    value = torch.tensor([float(rank + 1)])
    ranks.all_reduce_sum(value) if rank == 0 else ranks.all_reduce_max(value)     # gloo does not mind
    return float(value)


def test_a_collective_that_differs_between_ranks_is_refused_at_the_call(tmp_path):
    """Same size, another reduce op: gloo returns, NCCL would mix; the stand-in refuses it on every rank."""
    with pytest.raises(AssertionError) as caught:
        run_ranks(_other_reduce_op, 2, tmp_path)
    said = str(caught.value)
    assert "CollectiveMismatch: rank 0: collective #0 differs between the ranks" in said, said
    assert "rank 0: all_reduce[op=SUM] (float32 x1; group default) at tests/distributed/test_ranks.py" in said, said
    assert "rank 1: all_reduce[op=MAX]" in said, said


def test_the_ledger_names_a_collective_that_differs_when_not_checked_at_the_call(tmp_path, monkeypatch):
    """The comparison at the end of the call stands on its own (the check at the call turned off)."""
    with pytest.raises(AssertionError) as caught:
        run_ranks(_disagree, 2, tmp_path, "op", False)
    said = str(caught.value)
    assert "collective #0 of group default differs" in said, said
    assert "rank 1: all_reduce[op=MAX]" in said, said


def _disagree(rank, world, workdir, how, at_call=True):
    from tests.support import ledger

    ledger.CHECK_AT_CALL = at_call
    try:
        if how == "op":
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        elif how == "count":        # NCCL reads past the shorter buffer or waits; gloo aborts the process
            dist.all_reduce(torch.ones(3 + rank))
        elif how == "dtype":        # NCCL reinterprets the bytes
            dist.broadcast(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32), src=0)
        elif how == "gather":       # an all_gather whose shards differ: the output's size does not add up
            Ranks(None, "cpu").all_gather(torch.zeros(4 + 2 * rank), torch.ones(2 + rank))
    finally:
        ledger.CHECK_AT_CALL = True
    return rank


@pytest.mark.parametrize("how, shown", [
    ("count", ("rank 0: all_reduce[op=SUM] (float32 x3", "rank 1: all_reduce[op=SUM] (float32 x4")),
    ("dtype", ("rank 0: broadcast[src=0] (float32 x4", "rank 1: broadcast[src=0] (int32 x4")),
    ("gather", ("(float32 x4, float32 x2; group default)", "(float32 x6, float32 x3; group default)")),
])
def test_mismatched_counts_and_dtypes_are_refused_on_every_rank(tmp_path, how, shown):
    """What NCCL refuses or mixes silently fails on every rank at the call, naming both ranks' calls."""
    with pytest.raises(AssertionError) as caught:
        run_ranks(_disagree, 2, tmp_path, how)
    said = str(caught.value)
    assert "rank 0 failed" in said and "CollectiveMismatch" in said, said
    for part in shown:
        assert part in said, said
    assert "_disagree" in said, said


def _one_rank_skips(rank, world, workdir):
    if rank == 0:
        dist.all_reduce(torch.ones(3))      # rank 1 never joins
    return rank


def test_a_rank_left_waiting_fails_in_seconds_naming_its_call(tmp_path):
    """Not gloo's 30 minutes: the waiting rank's error names the collective and where it was called, and
    the comparison says that the other rank issued none."""
    with pytest.raises(AssertionError) as caught:
        # The timeout is also the group's set-up's: room for a loaded machine.
        run_ranks(_one_rank_skips, 2, tmp_path, collective_timeout=8)
    said = str(caught.value)
    assert "rank 0 failed" in said and "collective #0 all_reduce" in said, said
    assert "_one_rank_skips" in said and "waited past 8 s" in said, said
    assert "rank 1: issued only 0 collectives" in said, said


def _fp16_mean(rank, world, workdir):
    ranks = Ranks(None, "cpu")
    full = torch.full((4,), 40000.0 + rank, dtype=torch.float16)     # the sum of two overflows fp16
    shard = torch.empty(2, dtype=torch.float16)
    ranks.reduce_scatter_mean(shard, full)
    return shard.tolist()


def test_an_fp16_mean_over_ranks_does_not_overflow_where_the_mean_fits(tmp_path):
    for values in run_ranks(_fp16_mean, 2, tmp_path):
        assert values == [40000.0, 40000.0] or all(abs(v - 40000.5) <= 32 for v in values), values


def _stuck_outside_collectives(rank, world, workdir):
    if rank == 1:
        import time

        time.sleep(60)      # a lock never given back, a thread never ending: no collective to time out
    return rank


def test_a_rank_stuck_outside_collectives_fails_the_call_by_its_deadline(tmp_path, monkeypatch):
    from tests.support import ranks as pool

    monkeypatch.setattr(pool, "CALL_TIMEOUT_S", 8.0)     # rank 0 is done well before, even on a loaded machine
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] did not finish within 8 s"):
        run_ranks(_stuck_outside_collectives, 2, tmp_path)


def test_a_rank_that_cannot_tell_the_others_of_its_failure_raises_its_own_error(monkeypatch):
    """ranks.together(): the block failed here, then the agreement failed too (a peer gone): the rank's own error
    is what it raises, with a note of the agreement's; with no error of its own, the agreement's."""
    ranks = Ranks()

    def gone(failed: bool):
        raise RuntimeError("peer gone")

    monkeypatch.setattr(ranks, "failed_ranks", gone)
    with pytest.raises(ValueError, match="own") as info:
        with ranks.together("the step"):
            raise ValueError("own")
    assert "then telling the other ranks failed too: RuntimeError('peer gone')" in " ".join(info.value.__notes__)
    with pytest.raises(RuntimeError, match="peer gone"):
        with ranks.together("the step"):
            pass
