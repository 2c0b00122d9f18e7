"""A group gathered into lent memory keeps its parameters' views (made at its first gather): they follow
the memory lent at each gather, and a group gathered without lending makes them anew."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.param_group import ParamGroup, ParamSlot
from infinity.runtime import gather_memory
from infinity.runtime.gather_memory import GatherMemory


def _group() -> ParamGroup:
    shapes = [(3, 4), (5,), (2, 2, 2)]
    slots, offset = [], 0
    for i, shape in enumerate(shapes):
        numel = torch.Size(shape).numel()
        slots.append(ParamSlot(nn.Parameter(torch.zeros(shape)), f"p{i}", torch.Size(shape), numel, offset))
        offset += numel
    return ParamGroup(0, "g", slots, torch.float32, torch.device("cpu"), world_size=1, rank=0)


def _gather(group: ParamGroup, values: torch.Tensor) -> None:
    flat = group.flat_buffer()
    flat[:values.numel()].copy_(values)
    group.to_inflight(None)
    group.to_available(flat)


@pytest.mark.parametrize("lending", [True, False], ids=["lent", "resized"])
def test_parameters_follow_the_memory_of_each_gather(lending, monkeypatch):
    if lending and not gather_memory._CAN_LEND:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(gather_memory, "_CAN_LEND", lending)
    group = _group()
    group.memory = GatherMemory(torch.device("cpu"), mark=lambda: None)
    other = group.memory.arena.take(4096, "someone else")   # the next gather gets another slice
    pointers = []
    for k in range(3):
        values = torch.arange(group.numel, dtype=torch.float32) + 100 * k
        _gather(group, values)
        params = [s.param for s in group.slots]
        assert [tuple(p.shape) for p in params] == [(3, 4), (5,), (2, 2, 2)]
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), values)
        pointers.append(params[0].data_ptr())
        group.to_not_available()
        assert all(p.numel() == 0 for p in params)
        if k == 0 and other is not None:
            other.release()
    assert (group._views is not None) == lending, "views kept only while the memory is lent"
    if lending:
        assert len(set(pointers)) > 1, "the gathers got different memory (what the kept views must follow)"
