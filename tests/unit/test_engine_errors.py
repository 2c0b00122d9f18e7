"""Bad input to the engine: each a clear error that names what is wrong, raised early."""
import shutil
from collections import namedtuple

import pytest
import torch
from torch import nn

import infinity
from infinity.config import ConfigError
from infinity.engine import EngineError
from infinity.registry import NotManagedError
from tiers.base import TierFullError
from tiers.budget import BudgetError


def _nvme_cfg(path):
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(path)}}


def test_missing_nvme_path_is_named(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ConfigError, match="no-such-dir.*does not exist"):
        with infinity.Init(_nvme_cfg(missing)):
            nn.Linear(4, 4)


def test_too_little_disk_says_how_much(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(BudgetError, match=r"need .* on nvme_path .*free"):
        with infinity.Init(_nvme_cfg(tmp_path)):
            nn.Linear(64, 64)


def test_too_little_host_memory_for_optimizer_states():
    # The first module that does not fit stops construction, naming the tier and budget.
    with pytest.raises((BudgetError, TierFullError), match="host.*budget"):
        with infinity.Init({"tiers": {"params": "device", "optimizer": "host", "host_budget": 4096}}):
            nn.Linear(256, 256)


def test_step_before_backward():
    with infinity.Init({}):
        model = nn.Linear(4, 4)
    opt = infinity.AdamW(model)
    with pytest.raises(EngineError, match=r"before backward\(\)"):
        opt.step()


def test_model_built_outside_init():
    model = nn.Linear(4, 4)
    with pytest.raises(NotManagedError, match="not built inside infinity.Init"):
        infinity.AdamW(model)
    with pytest.raises(NotManagedError, match="not built inside infinity.Init"):
        with infinity.gathered(model):
            pass


def test_construction_interception_is_undone_on_error():
    before_linear = nn.Linear.__init__
    before_subclass = nn.Module.__dict__.get("__init_subclass__")

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            raise ValueError("user code failed")

    with pytest.raises(ValueError, match="user code failed"):
        with infinity.Init({}):
            Boom()
    assert nn.Linear.__init__ is before_linear
    assert nn.Module.__dict__.get("__init_subclass__") is before_subclass
    plain = nn.Linear(3, 2)
    assert plain.weight.shape == (2, 3)


def test_released_parameters_are_empty_and_gathered_ones_whole():
    with infinity.Init({"tiers": {"params": "host"}}):
        model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    assert model[0].weight.shape == (0,)
    with infinity.gathered(model):
        assert model[0].weight.shape == (3, 5)
        with torch.no_grad():
            model[2].bias.fill_(7.0)
    with infinity.gathered(model):
        assert torch.equal(model[2].bias, torch.full((2,), 7.0))


def test_swap_directory_is_released_with_the_model(tmp_path):
    """Dropping the model closes its swap files and lock: the directory can be used again."""
    import gc

    for _ in range(2):
        with infinity.Init(_nvme_cfg(tmp_path)):
            model = nn.Linear(8, 8)
        opt = infinity.AdamW(model)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        del model, opt
        gc.collect()
