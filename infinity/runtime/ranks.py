"""The ranks the model states are sharded over.

A thin face over ``torch.distributed``: when a default process group exists
(torchrun, or tests that spawn gloo ranks) every collective goes through it;
without one, the engine runs as a single rank and the collectives become copies.

[Note: what a collective may be given]
NCCL, the backend of every multi-GPU run, takes tensors on the GPU and refuses host
tensors. Tests and these machines run gloo on the CPU, where any tensor would pass, so a
collective handed host memory would only fail on a GPU. Every collective here therefore
checks what the backend of a real run would take: tensors on the compute device, and
never memory of the tiers' host allocator (pools, host tier, staging: host memory on a
GPU, whatever device torch reports on the CPU). A violation raises ``CollectiveError``
naming the collective, the rank and the tensor, on the CPU as on a GPU, at world size 1
too. And ``src`` ranks are group ranks, translated to the global ranks
``torch.distributed`` expects when the group is not the default one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective was given a tensor its backend would refuse (an engine bug: the message says which)."""


class Ranks:
    """This process's place among the data-parallel ranks.

    Parameters
    ----------
    group:
        A ``torch.distributed`` process group, or None for the default group
        when one is initialized, else a single rank.
    device:
        The compute device: where every tensor given to a collective must be.
    allocator:
        The tiers' host allocator, whose memory no collective may be given (None: not checked).
    """

    def __init__(self, group=None, device: torch.device | str = "cpu", allocator=None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.device = torch.device(device)
        self.allocator = allocator
        if self.enabled:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        """See [Note: what a collective may be given]."""
        for t in tensors:
            if t.device.type != self.device.type or (t.device.index or 0) != (self.device.index or 0):
                raise CollectiveError(
                    f"rank {self.rank}: {what} was given a tensor on {t.device} (shape {tuple(t.shape)}); "
                    f"collectives take tensors on the compute device {self.device} (NCCL refuses host "
                    "tensors): an engine bug")
            if self.allocator is not None and self.allocator.owns(t):
                raise CollectiveError(
                    f"rank {self.rank}: {what} was given host memory of the tiers' allocator (shape "
                    f"{tuple(t.shape)}); on a GPU that is a host tensor NCCL refuses: an engine bug")

    def _global(self, rank: int) -> int:
        """``rank`` of this group as the global rank ``torch.distributed`` expects for ``src``."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` (world_size x shard numel) with every rank's ``shard``, in rank order.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place all-gather).
        """
        self._check("all_gather", full, shard)
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        dist.all_gather_into_tensor(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """``shard`` = this rank's slice of the mean of ``full`` over ranks.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place reduce-scatter).
        """
        self._check("reduce_scatter", shard, full)
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                shard.copy_(full)
            return
        dist.reduce_scatter_tensor(shard, full, group=self.group)
        shard.div_(self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._check("all_reduce", tensor)
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self._check("all_reduce", tensor)
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` = rank ``src``'s (a rank of this group)."""
        self._check("broadcast", tensor)
        if self.world_size > 1:
            dist.broadcast(tensor, src=self._global(src), group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
