"""Translation of a DeepSpeed config into ours: ``from_deepspeed``.

[Note: DeepSpeed translation]
DeepSpeed counts most ZeRO-3 sizes in elements of the parameter dtype; ours are in
elements where the engine thinks in elements (persistence threshold, live parameters,
sub-groups) and in bytes where it thinks in bytes (prefetch budgets, pool buffers).
Element counts that become bytes are multiplied by the itemsize of the translated
``precision.dtype`` (and pool buffers rounded up to the 4 KiB I/O alignment).

What infinity would choose for the same intent, where DeepSpeed's habit would cost more here:
``partition.units = "auto"``, as every preset sets (one group per transformer block; DeepSpeed has
no such key, so nothing in its config could ask for it). And ``sub_group_size``: DeepSpeed's usual
1e9 is a sub-group of a billion elements, which infinity streams through host buffers of 16 bytes
per element (fp32 master, gradient, Adam m and v): 16 GB per sub-group in flight. A value above
infinity's default is kept at the default and reported; a smaller one, a choice to spend less, is
translated as it is.

Keys are sorted three ways: translated into a field; accepted because they ask for
what infinity always does (``contiguous_gradients: true``, ``aio.overlap_events:
true``); or reported, with their full path and the reason, in the list returned
beside the config. A value that cannot be read at all (``stage3_max_live_parameters:
"lots"``) is a ConfigError naming the DeepSpeed key.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from infinity.config import sizes as _sizes
from infinity.config.load import load_config
from infinity.config.sections import Config, PartitionConfig
from infinity.config.text import read
from infinity.config.values import ALIGNMENT, ConfigError

_OFFLOAD_DEVICE = {"param": {"cpu": "host", "nvme": "nvme", "none": "device"},
                   "optimizer": {"cpu": "host", "nvme": "nvme", "none": "device"}}

# Keys that ask for what infinity always does, with the value that means it.
_BUILT_IN = {
    "zero_optimization.contiguous_gradients": (True, "infinity always moves gradients in flat, contiguous buffers"),
    "zero_optimization.reduce_scatter": (True, "infinity always reduce-scatters gradients"),
    "zero_optimization.offload_optimizer.pipeline_read": (True, "infinity always reads the next sub-group while stepping one"),
    "zero_optimization.offload_optimizer.pipeline_write": (True, "infinity always writes a sub-group back while stepping the next"),
    "aio.single_submit": (False, "infinity's engines always submit requests in batches"),
    "aio.overlap_events": (True, "infinity always overlaps submission and completion"),
    "aio.use_gds": (False, "infinity reads NVMe into host buffers; GPUDirect Storage is not one of its engines"),
}

# (DeepSpeed key in zero_optimization, its pydantic alias, our key, element count -> bytes?)
_ZERO_SCALARS = (
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", "prefetch.device_bytes", True),
    ("stage3_param_persistence_threshold", "param_persistence_threshold", "partition.persistence_threshold", False),
    ("stage3_max_reuse_distance", "max_reuse_distance", "prefetch.reuse_distance", True),
    ("sub_group_size", None, "partition.sub_group_size", False),
)

# Bounds DeepSpeed lets the running module exceed, which infinity enforces: translated, a valid DeepSpeed config
# would be refused by infinity.Init (a block larger than the bound). Reported, infinity's default kept.
_SOFT_BOUNDS = {
    "reduce_bucket_size": "DeepSpeed fills buckets of this many elements and reduces a larger parameter on its own; "
                          "infinity reduce-scatters each group (a transformer block) whole, from one buffer that "
                          "must hold the largest and by default holds two (partition.reduce_bucket_bytes = 0): "
                          "kept that; set partition.reduce_bucket_bytes to bound it",
    "stage3_max_live_parameters": "DeepSpeed still gathers the module that runs when this bound is reached; "
                                  "infinity.Init refuses a partition.max_live_parameters below what the largest "
                                  "module needs: kept 0 (no bound: gathers ahead are bounded by prefetch.device_bytes, "
                                  "from stage3_prefetch_bucket_size); set partition.max_live_parameters to bound them",
}
_SOFT_BOUNDS["max_live_parameters"] = _SOFT_BOUNDS["stage3_max_live_parameters"]

_PROGRAM_KEYS = {
    "optimizer": "create the optimizer in the program: infinity.AdamW(model, lr=...)",
    "scheduler": "create the learning-rate scheduler in the program",
    "train_batch_size": "batch sizes belong to the program's data loader",
    "train_micro_batch_size_per_gpu": "batch sizes belong to the program's data loader",
    "gradient_accumulation_steps": "accumulate in the program: call opt.step() every N backward passes",
    "gradient_clipping": "clip in the program: infinity.clip_grad_norm_(model, max_norm) before opt.step() (the "
                         "Hugging Face Trainer: its max_grad_norm)",
}
_NO_EQUIVALENT = "no equivalent in infinity's config"


class _Translation:
    """One translation: our sections as plain data, where each came from, and what was skipped."""

    def __init__(self) -> None:
        self.ours: dict[str, dict[str, Any]] = {}
        self.origin: dict[str, str] = {}
        self.skipped: list[str] = []
        self.itemsize = 4

    def put(self, our_key: str, ds_key: str, value: object) -> None:
        section, name = our_key.split(".")
        self.ours.setdefault(section, {})[name] = value
        self.origin[our_key] = ds_key

    def skip(self, ds_key: str, reason: str) -> None:
        self.skipped.append(f"{ds_key}: {reason}")

    def count(self, ds_key: str, value: object) -> int | None:
        """An element count as DeepSpeed writes it (1e9); None for "auto" (reported, default kept)."""
        if value == "auto":
            self.skip(ds_key, "\"auto\" is filled in by the Hugging Face Trainer; kept infinity's default")
            return None
        try:
            return _sizes.parse_count(value)
        except ValueError as exc:
            raise ConfigError(f"{value!r} is not an element count: {exc}", ds_key) from None

    def built_in_or_skip(self, ds_key: str, value: object) -> None:
        expected, reason = _BUILT_IN.get(ds_key, (None, None))
        if reason is None:
            self.skip(ds_key, _NO_EQUIVALENT)
        elif value != expected:
            self.skip(ds_key, f"{value!r} cannot be honoured: {reason}")


def _section(data: Mapping[str, Any], name: str, where: str = "") -> Mapping[str, Any]:
    body = data.get(name)
    body = {} if body is None else body
    if not isinstance(body, Mapping):
        raise ConfigError(f"expected an object, got {body!r}", f"{where}{name}")
    return body


# DeepSpeed's fp16 loss-scaling keys and ours ([Note: loss scaling] in infinity/optim/loss_scale.py:
# the same rule as DeepSpeed's with consecutive_hysteresis false, its default).
_LOSS_SCALE_KEYS = {"loss_scale": "precision.loss_scale", "initial_scale_power": "precision.initial_scale",
                    "loss_scale_window": "precision.growth_interval", "hysteresis": "precision.hysteresis",
                    "min_loss_scale": "precision.min_scale", "consecutive_hysteresis": None}


def _loss_scale(t: _Translation, key: str, value: object) -> None:
    ds_key = f"fp16.{key}"
    if value == "auto":
        t.skip(ds_key, "\"auto\" is filled in by the Hugging Face Trainer; kept infinity's default")
    elif key == "consecutive_hysteresis":
        if value is not False:
            t.skip(ds_key, f"{value!r} cannot be honoured: infinity forgets overflows only when the scale grows "
                           "(DeepSpeed's consecutive_hysteresis false)")
    elif key == "loss_scale":
        # DeepSpeed: 0 is dynamic, a positive number a fixed scale.
        t.put(_LOSS_SCALE_KEYS[key], ds_key, "dynamic" if value == 0 and not isinstance(value, bool) else value)
    elif key == "initial_scale_power":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer (the scale is 2**power), got {value!r}", ds_key)
        t.put(_LOSS_SCALE_KEYS[key], ds_key, 2.0 ** value)
    else:
        t.put(_LOSS_SCALE_KEYS[key], ds_key, value)


def _precision(t: _Translation, data: Mapping[str, Any]) -> None:
    enabled = {}
    if "bf16" in data and "bfloat16" in data:
        raise ConfigError("bf16 and bfloat16 (its older name) are both given; keep bf16", "bfloat16")
    bf16 = "bfloat16" if "bfloat16" in data else "bf16"
    for name, dtype in ((bf16, "bfloat16"), ("fp16", "float16")):
        body = _section(data, name)
        for key, value in body.items():
            if name == "fp16" and key in _LOSS_SCALE_KEYS:
                _loss_scale(t, key, value)
            elif key != "enabled":
                t.skip(f"{name}.{key}", _NO_EQUIVALENT)
        value = body.get("enabled", False)
        if value == "auto":
            t.skip(f"{name}.enabled", "\"auto\" is filled in by the Hugging Face Trainer; kept float32 (element "
                   "counts that become bytes count 4 bytes each)")
        elif not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {value!r}", f"{name}.enabled")
        elif value:
            enabled[name] = dtype
    if len(enabled) == 2:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; choose one", "bf16.enabled")
    for name, dtype in enabled.items():
        t.put("precision.dtype", f"{name}.enabled", dtype)
        t.itemsize = 2


def _offload(t: _Translation, zero: Mapping[str, Any], what: str, nvme_paths: list[str], pins: dict) -> None:
    key = f"offload_{what}"
    body = _section(zero, key, "zero_optimization.")
    where = f"zero_optimization.{key}"
    our_tier = "tiers.params" if what == "param" else "tiers.optimizer"
    for name, value in body.items():
        ds_key = f"{where}.{name}"
        if name == "device":
            device = "none" if value is None else str(value).lower()
            if device not in _OFFLOAD_DEVICE[what]:
                raise ConfigError(f"{value!r} is not allowed; expected one of {', '.join(map(repr, _OFFLOAD_DEVICE[what]))}", ds_key)
            t.put(our_tier, ds_key, _OFFLOAD_DEVICE[what][device])
            if device == "nvme":    # a missing path is named where the NVMe offload was asked for
                t.origin.setdefault("tiers.nvme_path", f"{where}.nvme_path")
        elif name == "nvme_path":
            paths = [] if value is None else [value] if isinstance(value, str) else value if isinstance(
                value, (list, tuple)) else None     # DeepSpeed's default is null
            if paths is None or not all(isinstance(path, str) for path in paths):
                raise ConfigError(f"expected a path or a list of paths, got {value!r}", ds_key)
            for path in paths:
                if path not in nvme_paths:
                    nvme_paths.append(path)
            t.origin["tiers.nvme_path"] = ds_key
        elif name == "pin_memory":
            if not isinstance(value, bool):
                raise ConfigError(f"expected true or false, got {value!r}", ds_key)
            pins[ds_key] = value
        elif name == "ratio" and what == "optimizer":
            _ratio(t, ds_key, value)
        elif name == "buffer_count":
            count = t.count(ds_key, value)
            previous = t.ours.get("tiers", {}).get("pool_buffers", 0)
            if count is not None and count > previous:
                t.put("tiers.pool_buffers", ds_key, count)
        elif name == "buffer_size" and what == "param":
            numel = t.count(ds_key, value)
            if numel is not None:
                nbytes = -(-numel * t.itemsize // ALIGNMENT) * ALIGNMENT
                t.put("tiers.pool_buffer_size", ds_key, nbytes)
        else:
            t.built_in_or_skip(ds_key, value)
    if f"{where}.pin_memory" in pins and t.ours.get("tiers", {}).get(our_tier.split(".")[1]) in (None, "device"):
        del pins[f"{where}.pin_memory"]     # nothing of it is offloaded, as DeepSpeed ignores it there
        t.skip(f"{where}.pin_memory", "ignored: this offload's device is \"none\"")


def _ratio(t: _Translation, ds_key: str, value: Any) -> None:
    """ZeRO-Offload++'s ``ratio``, the fraction of the optimizer states offloaded: the rest stays on the device
    ([Note: optimizer states over tiers] in infinity/optim/tier_split.py), the model's first groups there."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"expected a fraction from 0 to 1, got {value!r}", ds_key)
    if value < 1:
        t.put("tiers.optimizer_device_share", ds_key, round(1.0 - float(value), 12))


def _zero(t: _Translation, data: Mapping[str, Any]) -> None:
    zero = _section(data, "zero_optimization")
    nvme_paths: list[str] = []
    pins: dict[str, object] = {}
    handled = {"offload_param", "offload_optimizer"}
    for legacy, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        if legacy in zero and section in zero:
            raise ConfigError(f"given beside zero_optimization.{section}, its newer form (DeepSpeed refuses both); "
                              f"keep {section}", f"zero_optimization.{legacy}")
    if "stage" not in zero:
        t.skip("zero_optimization.stage", "not given: DeepSpeed's default is 0 (plain data parallelism); "
               "infinity partitions the optimizer states at least (stages 1, 2 and 3): kept stage 3")
    _offload(t, zero, "param", nvme_paths, pins)
    param_paths = list(nvme_paths)
    _offload(t, zero, "optimizer", nvme_paths, pins)
    t.origin.setdefault("tiers.nvme_path", "zero_optimization.offload_param.nvme_path")
    if nvme_paths:
        t.put("tiers.nvme_path", t.origin["tiers.nvme_path"], nvme_paths)
    if "tiers.optimizer" not in t.origin:      # no offload asked for: DeepSpeed keeps the states on the device
        t.put("tiers.optimizer", "zero_optimization.offload_optimizer (not given)", "device")
    if param_paths and param_paths != nvme_paths:
        t.skip("zero_optimization.offload_param.nvme_path and zero_optimization.offload_optimizer.nvme_path",
               "differ; infinity has one tiers.nvme_path for every state: both kept, and parameters and "
               f"optimizer states are striped over all of {nvme_paths}")
    if pins:
        values = set(pins.values())
        if len(values) > 1:
            t.skip(" and ".join(pins), "disagree; infinity pins all host buffers or none: kept \"auto\"")
        elif values == {True}:
            t.put("tiers.pin_memory", next(iter(pins)), "auto")
        elif values == {False}:
            t.put("tiers.pin_memory", next(iter(pins)), "never")
    for ds_name, alias, our_key, to_bytes in _ZERO_SCALARS:
        if ds_name in zero and alias in zero:
            raise ConfigError(f"given beside zero_optimization.{alias}, its other name; keep one",
                              f"zero_optimization.{ds_name}")
        for name in (ds_name, alias):
            if name in zero:
                handled.add(name)
                numel = t.count(f"zero_optimization.{name}", zero[name])
                if numel is not None and our_key == "partition.sub_group_size":
                    _sub_group_size(t, f"zero_optimization.{name}", numel)
                elif numel is not None:
                    t.put(our_key, f"zero_optimization.{name}", numel * t.itemsize if to_bytes else numel)
    for name, value in zero.items():
        if name in handled:
            continue
        if name in _SOFT_BOUNDS:
            if t.count(f"zero_optimization.{name}", value) is not None:     # "auto" is reported there
                t.skip(f"zero_optimization.{name}", _SOFT_BOUNDS[name])
        elif name == "stage":
            if value in (1, 2, 3) and not isinstance(value, bool):
                t.put("partition.stage", "zero_optimization.stage", value)
            else:
                t.skip("zero_optimization.stage", f"{value!r}: infinity partitions the optimizer states at least "
                       "(stages 1, 2 and 3); stage 0 is plain data parallelism (torch DDP)")
        elif name == "cpu_offload" and value is True:
            t.put("tiers.optimizer", "zero_optimization.cpu_offload", "host")
        elif name == "cpu_offload_params" and value is True:
            t.put("tiers.params", "zero_optimization.cpu_offload_params", "host")
        else:
            t.built_in_or_skip(f"zero_optimization.{name}", value)


def _sub_group_size(t: _Translation, ds_key: str, numel: int) -> None:
    """DeepSpeed's sub_group_size, kept at infinity's default when larger ([Note: DeepSpeed translation])."""
    default = PartitionConfig.sub_group_size
    if numel <= default:
        t.put("partition.sub_group_size", ds_key, numel)
        return
    t.skip(ds_key, f"{numel:.3g} elements would be {_sizes.human_size(16 * numel)} of host memory per "
           "optimizer sub-group in flight here (16 bytes per element: fp32 master, gradient, Adam m and v); "
           f"kept infinity's default {_sizes.format_count(default)} ({_sizes.human_size(16 * default)}): a sub-group is only the "
           "unit the host optimizer reads, steps and writes back, and larger ones lengthen each transfer. "
           "Set partition.sub_group_size to choose another")


def _aio(t: _Translation, data: Mapping[str, Any]) -> None:
    aio = _section(data, "aio")
    threads = {name: aio[name] for name in ("thread_count", "intra_op_parallelism") if name in aio}
    if len(set(map(repr, threads.values()))) > 1:
        t.skip("aio.thread_count", f"{threads['thread_count']!r} differs from aio.intra_op_parallelism "
               f"({threads['intra_op_parallelism']!r}), its newer name; used intra_op_parallelism")
    for name, value in aio.items():
        ds_key = f"aio.{name}"
        if name == "block_size":
            t.put("aio.block_size", ds_key, value)
        elif name == "queue_depth":
            t.put("aio.queue_depth", ds_key, value)
        elif name in threads:
            if name == "intra_op_parallelism" or "intra_op_parallelism" not in threads:
                t.put("aio.threads", ds_key, value)
        else:
            t.built_in_or_skip(ds_key, value)


def _activations(t: _Translation, data: Mapping[str, Any]) -> None:
    """``activation_checkpointing``: ``cpu_checkpointing`` moves checkpointed activations to host memory."""
    section = _section(data, "activation_checkpointing")
    for name, value in section.items():
        ds_key = f"activation_checkpointing.{name}"
        if name == "cpu_checkpointing":
            if not isinstance(value, bool):
                raise ConfigError(f"expected true or false, got {value!r}", ds_key)
            if value:
                t.put("activations.offload", ds_key, "host")
        elif name == "partition_activations" and value:
            t.skip(ds_key, "partitioning activations over ranks (P_a) needs tensor parallelism, which infinity "
                   "does not have")
        elif name != "partition_activations":
            t.skip(ds_key, _NO_EQUIVALENT)


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike) -> tuple[Config, list[str]]:
    """Translate a DeepSpeed config (dict or JSON file) into a Config.

    Reads ``zero_optimization`` (offload_param, offload_optimizer, stage3_* prefetch and
    persistence keys, sub_group_size), the top-level ``aio`` section, ``bf16``/``fp16`` and
    ``activation_checkpointing.cpu_checkpointing`` (as ``activations.offload = "host"``). Sets
    ``partition.units = "auto"`` as the presets do, and keeps a ``sub_group_size`` above infinity's
    default (DeepSpeed's usual 1e9: 16 GB of host memory per sub-group here) at the default, reporting it.

    Returns
    -------
    (Config, list[str])
        The config, and one line per DeepSpeed key that could not be translated, each starting
        with the key's full path (``"zero_optimization.reduce_bucket_size: ..."``).

    Examples
    --------
    >>> cfg, skipped = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    ...                                "aio": {"queue_depth": 16}, "bf16": {"enabled": True}})
    >>> cfg.tiers.optimizer, cfg.aio.queue_depth, cfg.precision.dtype, skipped
    ('host', 16, 'bfloat16', [])
    """
    file = None
    if isinstance(ds_config, (str, os.PathLike)):
        file, ds_config = read(ds_config)
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"expected a DeepSpeed config (a dict or a JSON file), got {type(ds_config).__name__}")
    t = _Translation()
    try:
        _precision(t, ds_config)
        _zero(t, ds_config)
        _aio(t, ds_config)
        _activations(t, ds_config)
        t.ours.setdefault("partition", {}).setdefault("units", "auto")    # [Note: DeepSpeed translation]
        for name in ds_config:
            if name not in ("bf16", "bfloat16", "fp16", "zero_optimization", "aio", "activation_checkpointing"):
                t.skip(name, _PROGRAM_KEYS.get(name, _NO_EQUIVALENT))
        config = load_config(t.ours)
    except ConfigError as exc:
        ds_key = t.origin.get(exc.key or "")
        key = f"{ds_key} (as {exc.key})" if ds_key and ds_key != exc.key else exc.key
        raise ConfigError(exc.reason, key, file).in_file(exc.file) from None
    return config, t.skipped
