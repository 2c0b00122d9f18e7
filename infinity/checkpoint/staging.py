"""Optimizer states that a load must rebuild per sub-group, gathered in host memory one sub-group at a time.

[Note: staged sub-groups]
Two stored forms cannot take a checkpoint's fp32 bytes as they arrive: compressed moments
([Note: moments in checkpoints] in moments.py) are encoded per block with scales over the whole
sub-group, and split masters ([Note: split master] in infinity/optim/split_master.py) are split
into copy and remainder per sub-group. So their bytes are gathered per (state, sub-group) in a
host buffer and handed on once the sub-group is complete.

"Complete" is the bytes the load's runs will deliver to that sub-group, counted when the runs
are planned (``dest``), not the sub-group's size: the padding of the shards (no parameter covers
it) is zero and is never read from a file, so a sub-group holding padding would otherwise wait
for the zeros that ``_fill_zeros`` writes after every file is read, and every such sub-group would
sit in host memory until the end of the load. (That was the case for most sub-groups of a model
whose norms are not a multiple of 2048 elements, such as llama-2B: 8 bytes per parameter of
fp32 moments in host memory, 14 GB.) The buffer starts zeroed, so the padding is in place when
the last run arrives. On the same world size a sub-group's bytes are contiguous in each file,
so at most two sub-groups of one state are gathered at once (one ending, one starting in the
same read window), whatever the model size; a resharded load may hold more.

Split masters used to land in temporary optimizer-tier keys (4 bytes per parameter more on NVMe
until the end of the load: swap files a quarter larger than training ever makes them) and be
split at the end; gathering them here keeps the tier at its training size.
"""
from __future__ import annotations

from typing import Callable

import torch

from infinity.checkpoint.errors import CheckpointCorruptError
from infinity.checkpoint.manifest import STATE_FILES
from infinity.optim.moments import write_moments

_F32 = 4

Sink = Callable[[int, torch.Tensor], None]
"""What a complete sub-group goes to: ``sink(sub, values)`` with ``values`` its fp32 elements."""


class _Done:
    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _Dest:
    def __init__(self, staging: "StagedSubGroups", state: str, sub: int, base: int) -> None:
        self.staging, self.state, self.sub, self.base = staging, state, sub, base

    def write(self, dest_offset: int, data: torch.Tensor):
        self.staging.receive(self.state, self.sub, self.base + dest_offset, data)
        return _Done()


class StagedSubGroups:
    """Gathers fp32 bytes per (state, sub-group) and hands each sub-group to its state's sink once complete.

    Parameters
    ----------
    sub_numel:
        Elements of each sub-group, by index.
    sinks:
        Per state name (``"master"``, ``"exp_avg"``, ...), where a complete sub-group goes.
    """

    def __init__(self, sub_numel: list[int], sinks: dict[str, Sink]) -> None:
        self.sub_numel, self.sinks = sub_numel, sinks
        self._expected: dict[tuple[str, int], int] = {}
        self._staged: dict[tuple[str, int], list] = {}
        self._padded: set[tuple[str, int]] = set()
        self._complete: set[tuple[str, int]] = set()
        self.peak_staged_nbytes = 0

    def handles(self, state: str) -> bool:
        return state in self.sinks

    def dest(self, state: str, sub: int, base: int, nbytes: int) -> _Dest:
        """Where a run's ``nbytes`` bytes of ``state`` for sub-group ``sub`` from byte ``base`` go."""
        key = (state, sub)
        self._expected[key] = self._expected.get(key, 0) + nbytes
        return _Dest(self, state, sub, base)

    def pad(self, state: str, sub: int) -> None:
        """Padding (zeros, no file bytes) lies in sub-group ``sub``: it is handed on even if no run reaches it."""
        self._padded.add((state, sub))

    def receive(self, state: str, sub: int, offset: int, data: torch.Tensor) -> None:
        key = (state, sub)
        nbytes = self.sub_numel[sub] * _F32
        raw = data.reshape(-1).view(torch.uint8)
        if offset < 0 or offset + raw.numel() > nbytes:
            raise CheckpointCorruptError(f"a load writes bytes {offset}..{offset + raw.numel()} of {state} of "
                                         f"sub-group {sub}, which holds {nbytes}")
        entry = self._staged.get(key)
        if entry is None:
            entry = self._staged[key] = [torch.zeros(self.sub_numel[sub], dtype=torch.float32), 0]
            self.peak_staged_nbytes = max(self.peak_staged_nbytes, self.staged_nbytes())
        entry[0].view(torch.uint8)[offset:offset + raw.numel()].copy_(raw)
        entry[1] += raw.numel()
        expected = self._expected.get(key, 0)
        if entry[1] > expected:
            raise CheckpointCorruptError(f"a load wrote {entry[1]} bytes of {state} of sub-group {sub}, its runs "
                                         f"carry {expected}: internal error")
        if entry[1] == expected:
            del self._staged[key]
            self._complete.add(key)
            self.sinks[state](sub, entry[0])

    def staged_nbytes(self) -> int:
        return sum(entry[0].numel() * _F32 for entry in self._staged.values())

    def finish(self) -> None:
        """Hand on the sub-groups that hold only padding; every other one must have been complete."""
        missing = [key for key, nbytes in self._expected.items() if nbytes and key not in self._complete]
        if missing:
            state, sub = missing[0]
            got = self._staged[(state, sub)][1] if (state, sub) in self._staged else 0
            raise CheckpointCorruptError(
                f"the load wrote {got} of the {self._expected[(state, sub)]} bytes its runs carry for "
                f"{state} of sub-group {sub} ({len(missing)} sub-groups incomplete): internal error")
        for state, sub in sorted(self._padded - self._complete):
            self.sinks[state](sub, torch.zeros(self.sub_numel[sub], dtype=torch.float32))
        self._padded.clear()

    def abandon(self) -> None:
        self._staged.clear()
        self._padded.clear()
        self._complete.clear()


def staging_for(store, weights_only: bool = False) -> StagedSubGroups | None:
    """The states a load gathers per sub-group in host memory (None when the tier takes every byte as it comes;
    ``weights_only``: the masters alone are loaded)."""
    sinks = {}
    if store.split is not None:
        sinks["master"] = store.split.write_sub     # writes the compute copies too
    elif store.resting is not None:                 # dormant sub-groups' masters are split meanwhile
        sinks["master"] = lambda sub, values: _write_masters(store, sub, values)
    if store.moment_format.compressed and not weights_only:
        for state in STATE_FILES[2:]:
            sinks[state] = lambda sub, values, state=state: _encode(store, state, sub, values)
    return StagedSubGroups([n for _, n in store.layout.sub_ranges], sinks) if sinks else None


def _write_masters(store, sub: int, values: torch.Tensor) -> None:
    """A complete sub-group's fp32 masters: split while it is dormant and stores them so ([Note: dormant
    sub-groups] in infinity/optim/flat_state.py), else into its master key."""
    if store.resting.keys[sub] is not None:
        store.resting.write_sub(sub, values)
    else:
        store.sub_tiers[sub].write(store.keys["master"][sub], values).wait()


# Elements of a gathered sub-group encoded at a time: the encoding's temporaries are several times
# its input, so a whole 32Mi-element sub-group at once cost about 0.5 GB of host memory more.
_ENCODE_NUMEL = 1 << 22


def _encode(store, state: str, sub: int, values: torch.Tensor) -> None:
    """Compressed moments of a complete sub-group, encoded in whole blocks of ``_ENCODE_NUMEL`` elements
    (the int8 scales are per block, so the codes are those of one pass over the sub-group); zeros leave a
    dormant sub-group dormant."""
    if sub in store.dormant and not values.any():
        return
    store.wake([sub])
    block = store.moment_format.block_size
    step = max(block, _ENCODE_NUMEL // block * block)
    for a in range(0, values.numel(), step):
        write_moments(store, state, sub, a, values[a:a + step])
