"""The ``[activations]`` section: its checks, DeepSpeed's translation, and the bytes the plan and the
engine's budget check count for it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.cli.plan import main as plan_main
from infinity.config import ConfigError, from_deepspeed, load_config
from infinity.plan import plan
from tiers.budget import BudgetError

MiB = 1 << 20


def test_nvme_offload_needs_a_path_and_the_buffer_is_aligned():
    with pytest.raises(ConfigError, match=r"activations\.offload: \"nvme\" needs tiers\.nvme_path"):
        load_config({"activations": {"offload": "nvme"}})
    with pytest.raises(ConfigError, match=r"activations\.buffer_bytes: 5000 bytes is not a positive multiple"):
        load_config({"activations": {"buffer_bytes": 5000}})
    with pytest.raises(ConfigError, match=r"activations\.offload: \"gpu\" is not allowed"):
        load_config({"activations": {"offload": "gpu"}})


def test_deepspeed_cpu_checkpointing_is_host_offload_and_partitioning_is_reported():
    cfg, skipped = from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": True,
                                                                "partition_activations": True},
                                   "zero_optimization": {"stage": 3}})
    assert cfg.activations.offload == "host"
    assert skipped == ["activation_checkpointing.partition_activations: partitioning activations over ranks "
                       "(P_a) needs tensor parallelism, which infinity does not have"]
    cfg, skipped = from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": False},
                                   "zero_optimization": {"stage": 3}})
    assert cfg.activations.offload == "none" and skipped == []


@pytest.mark.parametrize("offload,tier", [("none", "device"), ("host", "host"), ("nvme", "nvme")])
def test_the_plan_counts_checkpointed_activations_in_their_tier(tmp_path, offload, tier):
    cfg = load_config({"tiers": {"nvme_path": str(tmp_path)},
                       "activations": {"offload": offload, "checkpoint_nbytes": "96MiB"}})
    p = plan(1e6, cfg, check_fit=False)
    assert p.row("activations").tier == tier and p.row("activations").nbytes == 96 * MiB
    staging = p.row("activation_staging")
    assert (staging.nbytes, staging.tier) == (64 * MiB, "host") if offload == "nvme" else staging is None
    prefetch = p.row("activation_prefetch")
    assert (prefetch.nbytes, prefetch.tier) == (32 * MiB, "device") if offload != "none" else prefetch is None
    without = plan(1e6, load_config(cfg, overrides={"activations": {"checkpoint_nbytes": 0}}), check_fit=False)
    assert without.row("activations") is None and without.row("activation_prefetch") is None
    assert p.tier_bytes(tier) - without.tier_bytes(tier) >= 96 * MiB


def test_infinity_plan_takes_the_activation_bytes_on_its_command_line(capsys):
    assert plan_main(["model", "--params", "1e6", "--config", "offload-host", "--activation-bytes", "3GiB",
                      "--no-check", "--json"]) == 0
    import json

    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["per_rank"]}
    assert rows["activations"]["nbytes"] == 3 << 30 and rows["activations"]["tier"] == "device"
    assert plan_main(["model", "--params", "1e6", "--config", "offload-host", "--activation-bytes", "4k"]) == 2
    assert "--activation-bytes: activations.checkpoint_nbytes" in capsys.readouterr().err


def test_the_engine_refuses_activations_that_do_not_fit_before_training():
    cfg = {"tiers": {"device": "cpu", "host_budget": "256MiB"},
           "activations": {"offload": "host", "checkpoint_nbytes": "1GiB"}}
    with pytest.raises(BudgetError, match=r"\+ checkpointed activations \(activations\.checkpoint_nbytes, offload .host.\) need 1\.0 GiB of host memory"):
        with infinity.Init(cfg):
            nn.Linear(4, 4)
    with infinity.Init(load_config(cfg, overrides={"activations": {"checkpoint_nbytes": "16MiB"}})):
        model = nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()


def test_activation_checkpoint_wraps_a_module_beside_the_checkpoint_room():
    import infinity.checkpoint  # noqa: F401  (the sharded-checkpoint room: infinity.checkpoint is taken)
    from infinity.runtime.checkpointing import Checkpointed

    block = nn.Linear(4, 4)
    wrapped = infinity.activation_checkpoint(block)
    assert isinstance(wrapped, Checkpointed) and wrapped.module is block
    x = torch.randn(2, 4, requires_grad=True)
    torch.testing.assert_close(wrapped(x), block(x))
    torch.testing.assert_close(infinity.activation_checkpoint(block, x), block(x))
    with pytest.raises(TypeError, match="infinity.activation_checkpoint: expected an nn.Module or a function"):
        infinity.activation_checkpoint(3, x)
