"""Device memory that gradients are collected in before their reduce-scatter: one constant-size buffer.

[Note: gradient buckets]
Each group's gradients are copied into a flat bucket (its padded size, compute dtype) that is
reduce-scattered in place; this rank's shard then leaves the device. The buckets are lent from
one buffer of ``partition.reduce_bucket_bytes`` (0: twice the largest trainable group's bucket,
so one fills while the last one's shard leaves the device), allocated at the first backward and
never grown, apart from the gathered parameters' memory: a bucket lives from one group's last
gradient to its download, a gathered group for a module's use, and the two would fragment one
arena between them. The buffer must hold the largest bucket: the end of ``infinity.Init``
refuses a smaller ``reduce_bucket_bytes`` with the group's name and size.

A bucket whose download is queued is handed back with that download's event (``release_after``)
and cools: it goes back to the buffer as soon as the event is seen done, without waiting for it.
When the next bucket finds the buffer full, the oldest cooling bucket is reused with the compute
stream ordered after its download (``DataPath.use``): the device waits, if it must, and the host
never does (on an H100 the host used to wait for the download, 16-18 times in each backward of GPT
1.3B, whose downloads fell behind). ``waits`` counts those ordered reuses. On the CPU a download
is done when it returns, and nothing cools.

What the room may touch: its arena and the data path's ``use``.
"""
from __future__ import annotations

import collections

import torch

from infinity.errors import EngineError
from infinity.runtime.datapath import DONE
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
        Its ``use`` orders the compute stream after a cooling bucket's download.
    capacity:
        ``partition.reduce_bucket_bytes`` (0: twice the largest bucket, known at ``size_for``).
    """

    def __init__(self, device: torch.device, datapath, capacity: int = 0) -> None:
        self.device = torch.device(device)
        self.datapath = datapath
        self.configured = int(capacity)
        self.arena: Arena | None = None
        self.waits = 0
        self._cooling: collections.deque = collections.deque()    # (loan, its download's event), oldest first

    def size_for(self, largest_nbytes: int, largest_name: str | None) -> None:
        """The buckets will be at most ``largest_nbytes`` (group ``largest_name``): size the buffer."""
        largest = _round(max(1, largest_nbytes))
        if self.configured and _round(self.configured) < largest:
            raise EngineError(f"partition.reduce_bucket_bytes = {self.configured} cannot hold the gradient bucket of "
                              f"group {largest_name!r} ({largest_nbytes} bytes, reduce-scattered whole); set it to at "
                              f"least {largest}, or 0 for twice the largest bucket")
        capacity = self.configured or 2 * largest
        if self.arena is not None and self.arena.capacity >= capacity:
            return      # sized again for a group trainable since (see GradientReducer._grow_buckets): it fits
        self.arena = Arena(lambda n: torch.empty(n, dtype=torch.uint8, device=self.device), capacity,
                           name=f"reduce-buckets-{self.device.type}")

    def take(self, nbytes: int, owner: str):
        """A bucket of ``nbytes``; when the buffer is full, cooling buckets are reused, oldest first,
        with the compute stream ordered after their downloads (the host does not wait)."""
        self._cool_down()
        loan = self.arena.take(nbytes, owner)
        while loan is None and self._cooling:
            old, event = self._cooling.popleft()
            self.waits += 1
            self.datapath.use(event)
            old.release()
            loan = self.arena.take(nbytes, owner)
        if loan is None:
            raise EngineError(f"partition.reduce_bucket_bytes: {owner} needs {nbytes} bytes and the "
                              f"{self.arena.capacity}-byte buffer still lends {self.arena.bytes_in_use} with no "
                              "download left to wait for; a bucket was not given back")
        return loan

    def release_after(self, loan, event) -> None:
        """Give ``loan`` back once ``event`` (its download's end) is done: at once when it is, else it
        cools until it is seen done or a later ``take`` needs its memory."""
        if event is None or event is DONE or event.query():
            loan.release()
            return
        self._cooling.append((loan, event))

    def _cool_down(self) -> None:
        """Give back the cooling buckets whose downloads are done, oldest first, without waiting."""
        while self._cooling and self._cooling[0][1].query():
            self._cooling.popleft()[0].release()

    def stats(self) -> dict:
        out = self.arena.stats() if self.arena is not None else {"capacity": self.configured, "allocated": False}
        out["waits"] = self.waits
        return out
