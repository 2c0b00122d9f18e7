"""Compressed Adam moments in checkpoints: saved decoded to fp32, encoded again on load.

[Note: moments in checkpoints]
A checkpoint holds fp32 moments whatever ``[optimizer] state_dtype`` the run used, so its files,
resharding, ``infinity-consolidate`` and a load into a run with another ``state_dtype`` stay the
same for every format. The save decodes each compressed sub-group as its bytes stream to the file
(``DecodedMoments``: one buffer at a time, no whole shard in memory). The load gathers each
sub-group's fp32 bytes as they arrive and encodes the sub-group once all of it has arrived
([Note: staged sub-groups] in staging.py).
Re-encoding decoded values gives back the same bf16 values, and for int8 the same codes (a
code's value encodes to itself) with each block's scale within a rounding of the saved one, so
a resumed run follows the uninterrupted one to float32 rounding (tests/unit/test_moments.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.optim.moments import read_moments

_F32 = 4


@dataclass(frozen=True)
class DecodedMoments:
    """A save's span: one compressed moment of sub-group ``sub`` as ``nbytes`` bytes of fp32."""

    store: object
    state: str
    sub: int
    nbytes: int

    def fill(self, offset: int, dst: torch.Tensor) -> None:
        """Write bytes ``[offset, offset + len(dst))`` of the decoded fp32 values into ``dst`` (uint8)."""
        if offset % _F32 or dst.numel() % _F32:
            raise ValueError(f"decoded moments: bytes from {offset}, {dst.numel()} long, are not whole fp32 values")
        a = offset // _F32
        dst.view(torch.float32).copy_(read_moments(self.store, self.state, self.sub, a, a + dst.numel() // _F32))
