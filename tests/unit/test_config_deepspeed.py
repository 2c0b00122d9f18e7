"""infinity.config.from_deepspeed: a realistic ZeRO-Infinity config, HF "auto" values, the aio section."""
from __future__ import annotations

import copy
import json

import pytest

from infinity.config import ConfigError, from_deepspeed, load_config

# Shaped like DeepSpeed's documented ZeRO-Infinity NVMe example (zero_optimization with both
# offloads on NVMe, the aio section), plus what a real training config carries around it.
ZERO_INFINITY = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 1e7,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False},
}
ZERO3 = {"zero_optimization": {"stage": 3}}    # beside a section under test: DeepSpeed's default stage is 0


def test_realistic_zero_infinity_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_INFINITY, indent=2))
    cfg, skipped = from_deepspeed(path)
    assert (cfg.tiers.params, cfg.tiers.optimizer, cfg.tiers.nvme_path) == ("nvme", "nvme", ("/local_nvme",))
    assert cfg.tiers.pin_memory == "auto"
    assert cfg.tiers.pool_buffers == 5
    assert cfg.tiers.pool_buffer_size == 200_003_584  # 1e8 bf16 elements, rounded up to 4 KiB
    assert cfg.precision.dtype == "bfloat16"
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.threads) == (1 << 20, 8, 1)
    assert cfg.partition.persistence_threshold == 100_000
    assert cfg.partition.max_live_parameters == 0     # DeepSpeed's bound is soft: reported, not enforced
    assert cfg.partition.sub_group_size == load_config().partition.sub_group_size    # 1e9: 16 GB a sub-group
    assert cfg.partition.units == ("auto",)
    assert cfg.prefetch.device_bytes == 2 * 10**7  # 1e7 bf16 elements
    assert cfg.partition.reduce_bucket_bytes == 0     # a DeepSpeed bucket splits a larger parameter: reported
    assert cfg.prefetch.reuse_distance == 2 * 10**9
    assert sorted(line.split(":")[0] for line in skipped) == sorted([
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
        "steps_per_print", "wall_clock_breakdown", "optimizer", "scheduler",
        "zero_optimization.overlap_comm",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_max_live_parameters",
    ])
    assert "optimizer: create the optimizer in the program: infinity.AdamW(model, lr=...)" in skipped
    assert load_config(cfg.to_dict()) == cfg


def test_hugging_face_auto_values_keep_defaults_and_are_reported():
    ds = {"fp16": {"enabled": "auto", "loss_scale": 0},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "stage3_prefetch_bucket_size": "auto", "sub_group_size": 1e9}}
    cfg, skipped = from_deepspeed(ds)
    assert (cfg.tiers.params, cfg.tiers.optimizer, cfg.precision.dtype) == ("host", "host", "float32")
    assert cfg.prefetch.device_bytes == load_config().prefetch.device_bytes
    assert cfg.precision.loss_scale == "dynamic"
    assert skipped == [
        "fp16.enabled: \"auto\" is filled in by the Hugging Face Trainer; kept float32 (element counts that become "
        "bytes count 4 bytes each)",
        "zero_optimization.stage3_prefetch_bucket_size: \"auto\" is filled in by the Hugging Face Trainer; "
        "kept infinity's default",
        "zero_optimization.sub_group_size: 1e+09 elements would be 14.9 GiB of host memory per optimizer "
        "sub-group in flight here (16 bytes per element: fp32 master, gradient, Adam m and v); kept infinity's "
        "default 32Mi (512.0 MiB): a sub-group is only the unit the host optimizer reads, steps and writes back, "
        "and larger ones lengthen each transfer. Set partition.sub_group_size to choose another",
    ]


def test_the_translation_chooses_what_the_presets_do_where_deepspeed_has_no_key_or_a_costly_habit():
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    preset = load_config("offload-optimizer")
    assert cfg.partition.units == preset.partition.units == ("auto",)     # one group per transformer block
    assert cfg.partition.sub_group_size == preset.partition.sub_group_size and skipped == []
    small = from_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": 1e6}})     # a choice to spend less
    assert small == (load_config({"partition": {"sub_group_size": 10**6, "units": "auto"},
                                  "tiers": {"optimizer": "device"}}), [])
    large = from_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": 2**26}})
    assert large[0].partition.sub_group_size == preset.partition.sub_group_size
    assert large[1][0].startswith("zero_optimization.sub_group_size: 6.71e+07 elements would be 1.0 GiB of host memory")


def test_both_aio_thread_names():
    assert from_deepspeed({"aio": {"thread_count": 3}})[0].aio.threads == 3
    assert from_deepspeed({"aio": {"intra_op_parallelism": 6}})[0].aio.threads == 6
    assert from_deepspeed({"aio": {"thread_count": 2, "intra_op_parallelism": 2}, **ZERO3}) == (
        load_config({"aio": {"threads": 2}, "partition": {"units": "auto"}, "tiers": {"optimizer": "device"}}), [])
    cfg, skipped = from_deepspeed({"aio": {"thread_count": 1, "intra_op_parallelism": 8}, **ZERO3})
    assert cfg.aio.threads == 8
    assert skipped == ["aio.thread_count: 1 differs from aio.intra_op_parallelism (8), its newer name; "
                       "used intra_op_parallelism"]


def test_aio_behaviour_keys_pass_when_they_match_and_are_reported_when_not():
    _, skipped = from_deepspeed({"aio": {"single_submit": True, "overlap_events": False, "use_gds": True}, **ZERO3})
    assert [line.split(":")[0] for line in skipped] == ["aio.single_submit", "aio.overlap_events", "aio.use_gds"]
    assert "GPUDirect" in skipped[2]


def test_other_offload_devices_stages_and_precisions():
    cfg, skipped = from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}})
    assert (cfg.tiers.params, cfg.tiers.optimizer, cfg.precision.dtype) == ("device", "device", "float16")
    assert cfg.partition.stage == 2 and skipped == []
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 0}})
    assert cfg.partition.stage == 3 and [line.split(":")[0] for line in skipped] == ["zero_optimization.stage"]
    with pytest.raises(ConfigError, match=r"stage 1 keeps whole parameters"):
        from_deepspeed({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    cfg, _ = from_deepspeed({"zero_optimization": {"stage3_prefetch_bucket_size": 1000}})
    assert cfg.prefetch.device_bytes == 4000  # float32: 4 bytes per element
    cfg, _ = from_deepspeed({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": False},
                                                   "offload_optimizer": {"device": "cpu", "pin_memory": False}}})
    assert cfg.tiers.pin_memory == "never"


def test_errors_name_the_deepspeed_key(tmp_path):
    ds = copy.deepcopy(ZERO_INFINITY)
    del ds["zero_optimization"]["offload_param"]["nvme_path"], ds["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_param.nvme_path \(as tiers.nvme_path\): required"):
        from_deepspeed(ds)
    ds = copy.deepcopy(ZERO_INFINITY)
    ds["zero_optimization"]["sub_group_size"] = "lots"
    with pytest.raises(ConfigError, match=r"^zero_optimization.sub_group_size: 'lots' is not an element count"):
        from_deepspeed(ds)
    with pytest.raises(ConfigError, match=r"^aio.queue_depth: expected an integer >= 1, got 0"):
        from_deepspeed({"aio": {"queue_depth": 0}})
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_param.device: 'disk' is not allowed"):
        from_deepspeed({"zero_optimization": {"offload_param": {"device": "disk"}}})
    with pytest.raises(ConfigError, match=r"^bf16.enabled: bf16.enabled and fp16.enabled are both true"):
        from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"^zero_optimization: expected an object"):
        from_deepspeed({"zero_optimization": 3})
    with pytest.raises(ConfigError, match=r"ds.json: no such file$"):
        from_deepspeed(tmp_path / "ds.json")


def test_different_param_and_optimizer_nvme_paths_are_kept_and_reported():
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme0"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme1"}}
    cfg, skipped = from_deepspeed({"zero_optimization": zero})
    assert cfg.tiers.nvme_path == ("/nvme0", "/nvme1")
    assert skipped == ["zero_optimization.offload_param.nvme_path and zero_optimization.offload_optimizer."
                       "nvme_path: differ; infinity has one tiers.nvme_path for every state: both kept, and "
                       "parameters and optimizer states are striped over all of ['/nvme0', '/nvme1']"]
    zero["offload_optimizer"]["nvme_path"] = "/nvme0"
    assert from_deepspeed({"zero_optimization": zero})[1] == []


def test_fp16_loss_scaling_keys():
    cfg, skipped = from_deepspeed({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                            "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 0.5,
                                            "consecutive_hysteresis": False}, **ZERO3})
    p = cfg.precision
    assert (p.dtype, p.loss_scale, p.initial_scale, p.growth_interval, p.hysteresis, p.min_scale) == (
        "float16", "dynamic", 4096.0, 500, 3, 0.5)
    assert skipped == []
    cfg, skipped = from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": True,
                                            "initial_scale_power": "auto"}, **ZERO3})
    assert cfg.precision.loss_scale == 128.0
    assert skipped == [
        "fp16.consecutive_hysteresis: True cannot be honoured: infinity forgets overflows only when the scale "
        "grows (DeepSpeed's consecutive_hysteresis false)",
        "fp16.initial_scale_power: \"auto\" is filled in by the Hugging Face Trainer; kept infinity's default"]
    with pytest.raises(ConfigError, match=r"fp16.loss_scale_window \(as precision.growth_interval\): expected an integer >= 1, got 0"):
        from_deepspeed({"fp16": {"enabled": True, "loss_scale_window": 0}})
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power: expected an integer"):
        from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 1.5}})


def test_zero_offload_ratio_keeps_the_rest_of_the_optimizer_states_on_the_device():
    """ZeRO-Offload++'s ratio: the fraction offloaded; the rest is the device share (the model's first groups)."""
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert (cfg.tiers.optimizer, cfg.tiers.optimizer_device_share, skipped) == ("host", 0.7, [])
    cfg, _ = from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                                         "ratio": 0.75}}})
    assert (cfg.tiers.optimizer, cfg.tiers.optimizer_device_share) == ("nvme", 0.25)
    cfg, _ = from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0}}})
    assert cfg.tiers.optimizer_device_share == 0.0
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_optimizer.ratio: expected a fraction"):
        from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}})
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_optimizer.ratio \(as tiers.optimizer_device_share\)"):
        from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "none", "ratio": 0.5}}})


def test_deepspeed_defaults_are_deepspeeds_and_soft_bounds_do_not_refuse_a_valid_config(tmp_path):
    """Where the DeepSpeed config is silent, DeepSpeed's defaults: no offload_optimizer keeps the optimizer states
    on the device, a missing stage (0 there) is reported. Its soft bounds (a bucket size a larger parameter
    exceeds, live parameters the running module exceeds) are reported, not made hard ones that infinity.Init
    would refuse for a block larger than them."""
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3}})
    assert (cfg.tiers.params, cfg.tiers.optimizer, skipped) == ("device", "device", [])
    cfg, skipped = from_deepspeed({"bf16": {"enabled": True}})
    assert cfg.tiers.optimizer == "device" and cfg.precision.dtype == "bfloat16"
    assert [line.split(":")[0] for line in skipped] == ["zero_optimization.stage"]
    assert "DeepSpeed's default is 0" in skipped[0]
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload": True}})
    assert cfg.tiers.optimizer == "host"
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e4, "stage3_max_live_parameters": 1e4,
                                "offload_optimizer": {"device": "cpu"}}}
    cfg, skipped = from_deepspeed(ds)
    assert (cfg.partition.reduce_bucket_bytes, cfg.partition.max_live_parameters) == (0, 0)
    assert [line.split(":")[0] for line in skipped] == ["zero_optimization.reduce_bucket_size",
                                                        "zero_optimization.stage3_max_live_parameters"]
    assert "partition.reduce_bucket_bytes" in skipped[0] and "partition.max_live_parameters" in skipped[1]
    import torch
    from torch import nn

    import infinity
    with infinity.Init(cfg):    # blocks of 65,792 elements, above both bounds: DeepSpeed trains this config
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = infinity.AdamW(model, lr=1e-3)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    infinity.release(model)


@pytest.mark.parametrize("ds,message", [
    ({"offload_param": {"device": "cpu", "nvme_path": 5}},
     r"^zero_optimization.offload_param.nvme_path: expected a path or a list of paths, got 5"),
    ({"offload_param": {"device": "cpu", "nvme_path": {"a": 1}}},
     r"^zero_optimization.offload_param.nvme_path: expected a path or a list of paths"),
    ({"offload_optimizer": {"device": "nvme"}},
     r"^zero_optimization.offload_optimizer.nvme_path \(as tiers.nvme_path\): required"),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": "true"}},
     r"^zero_optimization.offload_optimizer.pin_memory: expected true or false, got 'true'"),
    ({"cpu_offload": True, "offload_optimizer": {"device": "none"}},
     r"^zero_optimization.cpu_offload: given beside zero_optimization.offload_optimizer"),
    ({"cpu_offload_params": True, "offload_param": {"device": "cpu"}},
     r"^zero_optimization.cpu_offload_params: given beside zero_optimization.offload_param"),
    ({"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2},
     r"^zero_optimization.stage3_prefetch_bucket_size: given beside zero_optimization.prefetch_bucket_size"),
], ids=["path-int", "path-dict", "nvme-without-path", "pin-string", "cpu_offload-twice", "cpu_offload_params-twice",
        "alias-twice"])
def test_malformed_or_contradicting_deepspeed_keys_are_errors_naming_them(ds, message):
    with pytest.raises(ConfigError, match=message):
        from_deepspeed({"zero_optimization": {"stage": 3, **ds}})


def test_older_names_pins_of_nothing_offloaded_and_clipping():
    cfg, skipped = from_deepspeed({"bfloat16": {"enabled": True}, **ZERO3})    # DeepSpeed's older name of bf16
    assert (cfg.precision.dtype, skipped) == ("bfloat16", [])
    with pytest.raises(ConfigError, match=r"^bfloat16: bf16 and bfloat16 \(its older name\) are both given"):
        from_deepspeed({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})
    # DeepSpeed ignores pin_memory where nothing is offloaded: the real offload's false is honoured.
    cfg, skipped = from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "none", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": False}}})
    assert cfg.tiers.pin_memory == "never"
    assert skipped == ["zero_optimization.offload_param.pin_memory: ignored: this offload's device is \"none\""]
    _, skipped = from_deepspeed({"gradient_clipping": 1.0, **ZERO3})
    assert skipped == ["gradient_clipping: clip in the program: infinity.clip_grad_norm_(model, max_norm) before "
                       "opt.step() (the Hugging Face Trainer: its max_grad_norm)"]
    cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                           "nvme_path": None}}})
    assert (cfg.tiers.optimizer, cfg.tiers.nvme_path, skipped) == ("host", (), [])   # DeepSpeed's default: null
    for falsy in (False, 0, []):
        with pytest.raises(ConfigError, match=r"^zero_optimization: expected an object"):
            from_deepspeed({"zero_optimization": falsy})
