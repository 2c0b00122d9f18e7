"""The rules that join keys of different sections (each section checks its own keys in ``_check``).

What the room may touch: nothing but a config's values.
"""
from __future__ import annotations

import json

from infinity.config.values import ConfigError


def check_across_sections(cfg) -> None:
    """Raise a ``ConfigError`` naming the key when two sections' settings cannot go together."""
    stage, params = cfg.partition.stage, cfg.tiers.params
    if stage < 3 and params not in ("device", "auto"):
        raise ConfigError(
            f"stage {stage} keeps whole parameters on every rank's compute device, so tiers.params must be "
            f"\"device\" (it is {json.dumps(params)}); parameters in host memory or on NVMe are sharded over "
            "the ranks, which is stage 3", "partition.stage")
    if cfg.optimizer.state_dtype != "fp32" and (cfg.tiers.optimizer == "device" or cfg.tiers.optimizer_device_share):
        where = ("tiers.optimizer = \"device\"" if cfg.tiers.optimizer == "device" else
                 "tiers.optimizer_device_share > 0 (those states are stepped on the device)")
        raise ConfigError(f"{json.dumps(cfg.optimizer.state_dtype)} moments are stepped by the host kernel; with "
                          f"{where} they must be \"fp32\" (or keep the optimizer states in \"host\" or \"nvme\")",
                          "optimizer.state_dtype")
    if cfg.optimizer.update_in_backward:
        _check_update_in_backward(cfg)
    if cfg.tiers.optimizer_device_share or cfg.tiers.optimizer_host_share:
        _check_optimizer_shares(cfg)
    if cfg.activations.offload == "nvme" and not cfg.tiers.nvme_path:
        raise ConfigError("\"nvme\" needs tiers.nvme_path, a directory on a fast local disk, for the "
                          "activations' files", "activations.offload")


def _check_update_in_backward(cfg) -> None:
    """The settings with which a step during backward could not equal the ordinary step."""
    key = "optimizer.update_in_backward"
    if cfg.dpu.enabled:
        raise ConfigError("the update during backward steps with this step's gradients; dpu.enabled delays "
                          "the step by one iteration: turn one of them off", key)
    if cfg.precision.dtype == "float16":
        raise ConfigError("float16 loss scaling skips a step when any gradient overflows, which is known only "
                          "after the whole backward; use bfloat16 or float32, or turn the key off", key)
    if cfg.tiers.optimizer == "device":
        raise ConfigError("the update during backward runs the host optimizer; with tiers.optimizer = "
                          "\"device\" use the ordinary step (or put the states in \"host\" or \"nvme\")", key)


def _check_optimizer_shares(cfg) -> None:
    """The optimizer states split over tiers ([Note: optimizer states over tiers] in infinity/optim/tier_split.py):
    what the split can run with."""
    t = cfg.tiers
    key = "tiers.optimizer_device_share" if t.optimizer_device_share else "tiers.optimizer_host_share"
    if t.optimizer == "auto":
        raise ConfigError("tiers.optimizer = \"auto\" chooses the shares itself; set the shares with "
                          "tiers.optimizer \"host\" or \"nvme\", or leave them 0", key)
    if t.optimizer_device_share and t.optimizer not in ("host", "nvme"):
        raise ConfigError(f"the rest of the optimizer states stay in tiers.optimizer = {json.dumps(t.optimizer)}, "
                          "which is already the device; set tiers.optimizer to \"host\" or \"nvme\" to keep the "
                          "rest there", "tiers.optimizer_device_share")
    if t.optimizer_host_share and t.optimizer != "nvme":
        raise ConfigError(f"the rest of the optimizer states stay in tiers.optimizer = {json.dumps(t.optimizer)}; a "
                          "host share needs them on \"nvme\" (with \"host\" the whole of them is in host memory "
                          "already)", "tiers.optimizer_host_share")
    if cfg.dpu.enabled:
        raise ConfigError("the delayed update keeps a second gradient buffer in one tier; with the optimizer "
                          "states split over tiers set dpu.enabled = false (the host share's update still "
                          "overlaps the next forward: dpu.overlap)", key)
