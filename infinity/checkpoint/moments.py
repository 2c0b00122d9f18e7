"""Compressed Adam moments in checkpoints: saved decoded to fp32, encoded again on load.

[Note: moments in checkpoints]
A checkpoint holds fp32 moments whatever ``[optimizer] state_dtype`` the run used, so its files,
resharding, ``infinity-consolidate`` and a load into a run with another ``state_dtype`` stay the
same for every format. The save decodes each compressed sub-group as its bytes stream to the file
(``DecodedMoments``: one buffer at a time, no whole shard in memory). The load gathers each
sub-group's fp32 bytes as they arrive (``MomentLoader``) and encodes the sub-group once all of
it has arrived; on the same world size a sub-group's bytes are contiguous in the file, so one
sub-group is gathered at a time, and at most those that a resharded load reads partly at once.
Re-encoding decoded values gives back the same bf16 values, and for int8 the same codes (a
code's value encodes to itself) with each block's scale within a rounding of the saved one, so
a resumed run follows the uninterrupted one to float32 rounding (tests/unit/test_moments.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.checkpoint.errors import CheckpointCorruptError
from infinity.optim.moments import read_moments, write_moments

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


class _Done:
    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _Dest:
    def __init__(self, loader: "MomentLoader", state: str, sub: int, base: int) -> None:
        self.loader, self.state, self.sub, self.base = loader, state, sub, base

    def write(self, dest_offset: int, data: torch.Tensor):
        self.loader.receive(self.state, self.sub, self.base + dest_offset, data)
        return _Done()


class MomentLoader:
    """Gathers the fp32 bytes of compressed moments per sub-group and encodes each when complete."""

    def __init__(self, store) -> None:
        self.store = store
        self._staged: dict[tuple[str, int], list] = {}

    def dest(self, state: str, sub: int, base: int) -> _Dest:
        """Where a load's bytes of ``state`` for sub-group ``sub`` from byte ``base`` go."""
        return _Dest(self, state, sub, base)

    def receive(self, state: str, sub: int, offset: int, data: torch.Tensor) -> None:
        numel = self.store.layout.sub_ranges[sub][1]
        entry = self._staged.get((state, sub))
        if entry is None:
            entry = self._staged[(state, sub)] = [torch.empty(numel, dtype=torch.float32), 0]
        raw = data.reshape(-1).view(torch.uint8)
        if offset < 0 or offset + raw.numel() > numel * _F32:
            raise CheckpointCorruptError(f"a load writes bytes {offset}..{offset + raw.numel()} of {state} of "
                                         f"sub-group {sub}, which holds {numel * _F32}")
        entry[0].view(torch.uint8)[offset:offset + raw.numel()].copy_(raw)
        entry[1] += raw.numel()
        if entry[1] >= numel * _F32:
            del self._staged[(state, sub)]
            write_moments(self.store, state, sub, 0, entry[0])

    def finish(self) -> None:
        """Every sub-group was complete (a load writes every element: parameters or padding)."""
        if self._staged:
            (state, sub), (_, got) = next(iter(self._staged.items()))
            numel = self.store.layout.sub_ranges[sub][1]
            raise CheckpointCorruptError(f"the load wrote {got} of the {numel * _F32} bytes of {state} of sub-group "
                                         f"{sub} ({len(self._staged)} sub-groups incomplete): internal error")
