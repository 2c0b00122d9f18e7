"""Ranks agreeing on a save id and on success, so that no rank hangs or commits alone.

[Note: agreeing on failure]
A save or load is a collective: if one rank fails (disk full, corrupt file) and the
others went on to the next collective, the job would hang. Every phase therefore
ends with :func:`agree`: each rank contributes a flag to an all-reduce, then every
rank raises together, the failing one its own exception and the others a
``CheckpointError`` naming the failed ranks. The all-reduce is also the barrier
between writing and committing.
"""
from __future__ import annotations

import secrets

import torch

from infinity.checkpoint.errors import CheckpointError


def agree(ranks, error: BaseException | None, what: str) -> None:
    """All ranks learn which ranks failed ``what``; raise on every rank if any did."""
    failed = ranks.failed_ranks(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"rank {ranks.rank}: rank(s) {failed} failed while {what} "
                              "(see the error raised there)")


def agree_id(ranks) -> str:
    """A random id, the same on every rank (chosen by rank 0)."""
    value = torch.tensor([secrets.randbits(62) if ranks.rank == 0 else 0], dtype=torch.int64, device=ranks.device)
    ranks.broadcast(value, src=0)
    return f"{int(value.item()):016x}"
