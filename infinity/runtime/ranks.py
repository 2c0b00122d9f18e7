"""The ranks the model states are sharded over.

A thin face over ``torch.distributed``: when a default process group exists
(torchrun, or tests that spawn gloo ranks) every collective goes through it;
without one, the engine runs as a single rank and the collectives become copies.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Ranks:
    """This process's place among the data-parallel ranks.

    Parameters
    ----------
    group:
        A ``torch.distributed`` process group, or None for the default group
        when one is initialized, else a single rank.
    """

    def __init__(self, group=None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        if self.enabled:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` (world_size x shard numel) with every rank's ``shard``, in rank order.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place all-gather).
        """
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        dist.all_gather_into_tensor(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """``shard`` = this rank's slice of the mean of ``full`` over ranks.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place reduce-scatter).
        """
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                shard.copy_(full)
            return
        dist.reduce_scatter_tensor(shard, full, group=self.group)
        shard.div_(self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
