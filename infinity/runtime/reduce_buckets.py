"""Device memory that gradients are collected in before their reduce-scatter: one constant-size buffer.

[Note: gradient buckets]
Each group's gradients are copied into a flat bucket (its padded size, compute dtype) that is
reduce-scattered in place; this rank's shard then leaves the device, and the bucket is given
back once its download is done (at once on the CPU). The buckets are lent from one buffer of
``partition.reduce_bucket_bytes`` (0: twice the largest trainable group's bucket, so one fills
while the last one's shard leaves the device), allocated at the first backward and never grown,
apart from the gathered parameters' memory: a bucket lives from one group's last gradient to its
download, a gathered group for a module's use, and the two would fragment one arena between
them. A bucket that finds the buffer full waits for the downloads still reading it (on a GPU;
counted in ``waits``). The buffer must hold the largest bucket: the end of ``infinity.Init``
refuses a smaller ``reduce_bucket_bytes`` with the group's name and size.

What the room may touch: its arena and the data path's ``settle``.
"""
from __future__ import annotations

import torch

from infinity.errors import EngineError
from tiers.arena import Arena

_ALIGN = 4096


def _round(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ReduceBuckets:
    """The gradient buckets' buffer (see [Note: gradient buckets]).

    Parameters
    ----------
    device:
        The compute device.
    datapath:
        Its ``settle(wait=True)`` gives back buckets whose downloads are done.
    capacity:
        ``partition.reduce_bucket_bytes`` (0: twice the largest bucket, known at ``size_for``).
    """

    def __init__(self, device: torch.device, datapath, capacity: int = 0) -> None:
        self.device = torch.device(device)
        self.datapath = datapath
        self.configured = int(capacity)
        self.arena: Arena | None = None
        self.waits = 0

    def size_for(self, largest_nbytes: int, largest_name: str | None) -> None:
        """The buckets will be at most ``largest_nbytes`` (group ``largest_name``): size the buffer."""
        largest = _round(max(1, largest_nbytes))
        if self.configured and _round(self.configured) < largest:
            raise EngineError(f"partition.reduce_bucket_bytes = {self.configured} cannot hold the gradient bucket of "
                              f"group {largest_name!r} ({largest_nbytes} bytes, reduce-scattered whole); set it to at "
                              f"least {largest}, or 0 for twice the largest bucket")
        capacity = self.configured or 2 * largest
        self.arena = Arena(lambda n: torch.empty(n, dtype=torch.uint8, device=self.device), capacity,
                           name=f"reduce-buckets-{self.device.type}")

    def take(self, nbytes: int, owner: str):
        """A bucket of ``nbytes``, waiting for earlier buckets' downloads when the buffer is full."""
        loan = self.arena.take(nbytes, owner)
        if loan is None:
            self.waits += 1
            self.datapath.settle(wait=True)
            loan = self.arena.take(nbytes, owner)
        if loan is None:
            raise EngineError(f"partition.reduce_bucket_bytes: {owner} needs {nbytes} bytes and the "
                              f"{self.arena.capacity}-byte buffer still lends {self.arena.bytes_in_use} with no "
                              "download left to wait for; a bucket was not given back")
        return loan

    def stats(self) -> dict:
        out = self.arena.stats() if self.arena is not None else {"capacity": self.configured, "allocated": False}
        out["waits"] = self.waits
        return out
