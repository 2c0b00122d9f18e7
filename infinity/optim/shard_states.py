"""The ``"shards"`` entry of an offload optimizer's ``state_dict``: read from the tiers when looked at.

[Note: a lazy optimizer state dict]
``torch.optim``'s ``state_dict()`` hands out references to the live state tensors, so
``opt.load_state_dict(opt.state_dict())`` costs nothing there. Accelerate does exactly
that round trip in ``AcceleratedOptimizer.__init__`` (``prepare`` moves the state to the
device), as does every Trainer run. With the fp32 shards read eagerly, the whole optimizer
state (12 bytes per parameter) came into host memory at that point and was written back,
for a model whose states were put on NVMe because they do not fit there.

``ShardStates`` keeps torch's semantics without the copy: it is a read-only mapping from a
state's name (``"master"``, ``"exp_avg"``, ``"exp_avg_sq"``) to that state's shard per
group, each read from its tier only when the entry is looked at (so, like torch's
references, it shows the values current at that moment). Pickling it (``torch.save``)
and ``copy.deepcopy`` turn it into a plain dict of tensors read at that time. Given back
to the optimizer it came from, ``load_state_dict`` has nothing to write: the states it
names are the ones already stored. It is not a ``dict`` on purpose: code that rebuilds
every dict it walks (accelerate's ``move_to_device``) passes it through untouched.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


class ShardStates(Mapping):
    """A state's name -> this rank's fp32 shard per group, read from the optimizer's store on access.

    Parameters
    ----------
    store:
        The optimizer's ``OptimizerStateStore``.
    group_indices:
        The engine groups' indices, in the order the shards are listed.
    """

    def __init__(self, store, group_indices: list[int]) -> None:
        self.store = store
        self.group_indices = list(group_indices)

    def __getitem__(self, state: str) -> list[torch.Tensor]:
        if state not in STATE_NAMES:
            raise KeyError(state)
        return [self.store.read_state_shard(state, i) for i in self.group_indices]

    def __iter__(self):
        return iter(STATE_NAMES)

    def __len__(self) -> int:
        return len(STATE_NAMES)

    def is_stored_in(self, store) -> bool:
        """True when these entries name the states of ``store`` itself (loading them writes nothing)."""
        return store is self.store

    def __reduce__(self):
        return dict, ([(s, self[s]) for s in STATE_NAMES],)

    def __repr__(self) -> str:
        return f"ShardStates({len(self.group_indices)} groups, read on access: {', '.join(STATE_NAMES)})"
