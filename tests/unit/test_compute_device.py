"""The compute device a launched rank takes (no GPU needed: torch.cuda's answers are stood in for)."""
from __future__ import annotations

import pytest
import torch

from infinity.runtime import device


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_rank_that_forgot_set_device_is_told_which_call_it_needs(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 .* cuda:0.*torch.cuda.set_device\(2\)"):
        device._launched_device()


@pytest.mark.parametrize("local", ["0", None])
def test_local_rank_zero_or_no_launcher_takes_the_current_device(four_gpus, monkeypatch, local):
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    assert device._launched_device() == 0


def test_one_visible_device_per_process_is_fine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)      # CUDA_VISIBLE_DEVICES set per rank
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device._launched_device() == 0
