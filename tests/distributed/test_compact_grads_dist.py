"""Two ranks: gradient shards stored in bf16 give the results fp32 keys give (the reduction is bf16 either way).

See [Note: compact gradients] in infinity/optim/compact_grads.py.
"""
import os

import torch

from tests.support.ranks import run_ranks
from tests.unit.test_compact_grads import _same, _train


def _ranks(rank, world, workdir):
    out = {}
    for compact in (True, False):
        swap = os.path.join(workdir, f"swap{rank}-{compact}")
        os.makedirs(swap, exist_ok=True)
        losses, shards, dtypes = _train("nvme", swap, compact, accum=1, rank=rank, world=world)
        out[compact] = (losses, shards, [str(d) for d in dtypes])
    return out


def test_two_ranks_reduce_in_the_compute_dtype_either_way(tmp_path):
    """The shard is reduce-scattered in bf16 before it is stored, so storing it in bf16 changes nothing."""
    for result in run_ranks(_ranks, 2, tmp_path):
        compact, wide = result[True], result[False]
        assert set(compact[2]) == {str(torch.bfloat16)} and set(wide[2]) == {str(torch.float32)}
        _same(compact, wide)
