"""Hugging Face ``from_pretrained`` under ``infinity.Init``: safetensors shards streamed into the tiers.

[Note: loading a pretrained model]
transformers (v5) builds the model on the meta device, then reads every checkpoint tensor
on a thread pool that runs ahead of the loop assigning them, and memory-maps each shard
file until the end: the whole checkpoint passes through host memory before a parameter
could be sharded. That path cannot be bounded from outside, so under ``Init`` a model
class's ``from_pretrained`` is routed here instead (for the context's duration only;
``infinity.from_pretrained`` is the same thing with the context built for you):

1. the checkpoint's keys and shapes are read from the safetensors headers, and the model
   is built once on the meta device, outside the engine, to match names, shapes and tied
   parameters against them: a shape that differs is an error, and so is a checkpoint
   whose keys would need transformers' weight conversions (model parameters missing
   *and* checkpoint keys left over);
2. the model is built inside ``Init`` (each module sharded as it is built), without
   weight initialisation when the checkpoint covers every parameter;
3. for each parameter group, this rank's shard is filled from the files, reading only
   the rows of each tensor that overlap the shard (``pread``, no memory map), and written
   over the group's compute copy and master weights. Peak host memory is one group's
   shard plus one tensor's overlapping rows, on top of the engine's own budget.

Parameters the checkpoint lacks keep their initial values and are named in a warning,
as transformers does; so are checkpoint keys the model does not use.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from contextlib import nullcontext

import torch

from infinity.errors import EngineError

_HUB_KWARGS = frozenset({"cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                         "trust_remote_code", "weights_only", "use_safetensors", "code_revision", "proxies"})
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointFiles:
    """The safetensors files of one checkpoint directory: which file holds each key, read lazily.

    Parameters
    ----------
    directory:
        Holds ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
    """

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        elif os.path.isfile(os.path.join(directory, _SINGLE)):
            single = os.path.join(directory, _SINGLE)
            with self._open(single) as f:
                self.file_of = dict.fromkeys(f.keys(), single)
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise EngineError(
                f"from_pretrained under infinity.Init streams safetensors checkpoints, and {directory!r} has "
                f"neither {_SINGLE} nor {_INDEX} (it has: {', '.join(found) or 'nothing'}); convert the "
                "checkpoint with save_pretrained(..., safe_serialization=True) first")
        self._handles: dict[str, object] = {}
        self.shape_of = {}
        for path in sorted(set(self.file_of.values())):
            handle = self.handle(path)
            for key in handle.keys():
                self.shape_of[key] = tuple(handle.get_slice(key).get_shape())

    def _open(self, path: str):
        try:
            return self._safe_open(path, framework="pt", device="cpu", backend="pread")
        except TypeError:       # safetensors without the pread backend
            return self._safe_open(path, framework="pt", device="cpu")

    def handle(self, path: str):
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path]

    def read_flat(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` flattened, reading only the rows they lie in."""
        handle = self.handle(self.file_of[key])
        shape = self.shape_of[key]
        if len(shape) == 0:
            return handle.get_tensor(key).reshape(-1)[start:end]
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)
        rows = handle.get_slice(key)[first:last]
        return rows.reshape(-1)[start - first * row:end - first * row]

    def close(self) -> None:
        self._handles.clear()


class _Match:
    """Which checkpoint key feeds each parameter and buffer of a model, checked on a meta-device twin."""

    def __init__(self, model, files: CheckpointFiles, where: str) -> None:
        prefix = getattr(model, "base_model_prefix", "") or ""
        used: set[str] = set()
        self.key_of: dict[str, str] = {}       # model name -> checkpoint key
        self.missing: list[str] = []
        by_param: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(p), []).append(name)
        shapes = dict(model.named_parameters(remove_duplicate=False))
        for names in by_param.values():
            keys = [(n, k) for n in names for k in [self._key(n, prefix, files)] if k is not None]
            if not keys:
                self.missing.append(names[0])
            for name, key in keys:
                self._check_shape(name, key, tuple(shapes[name].shape), files, where)
                self.key_of[name] = key
                used.add(key)
        for name, buf in model.named_buffers(remove_duplicate=False):
            key = self._key(name, prefix, files)
            if key is not None:
                self._check_shape(name, key, tuple(buf.shape), files, where)
                self.key_of[name] = key
                used.add(key)
        self.unexpected = sorted(set(files.file_of) - used)
        if self.missing and self.unexpected:
            raise EngineError(
                f"from_pretrained under infinity.Init: the checkpoint {where!r} does not name the model's "
                f"parameters {self.missing[:5]} and has keys the model lacks {self.unexpected[:5]}: it needs "
                "transformers' weight conversions (renamed or fused weights), which the streaming loader does "
                "not apply; load it once without infinity and save_pretrained it, then load that copy")

    @staticmethod
    def _key(name: str, prefix: str, files: CheckpointFiles) -> str | None:
        candidates = [name]
        if prefix:
            lead = prefix + "."
            candidates.append(name[len(lead):] if name.startswith(lead) else lead + name)
        return next((k for k in candidates if k in files.file_of), None)

    @staticmethod
    def _check_shape(name: str, key: str, want: tuple, files: CheckpointFiles, where: str) -> None:
        got = files.shape_of[key]
        if got != want:
            raise EngineError(
                f"from_pretrained under infinity.Init: {key!r} in {files.file_of[key]!r} has shape {list(got)}, "
                f"the model's {name!r} has {list(want)} (checkpoint {where!r})")


def _directory(path, kwargs: dict) -> str:
    path = os.fspath(path)
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        return os.path.join(path, subfolder)
    from huggingface_hub import snapshot_download

    hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision")
           if kwargs.get(k) is not None}
    pattern = f"{subfolder}/*" if subfolder else "*"
    root = snapshot_download(path, allow_patterns=[f"{pattern}.json", f"{pattern}.safetensors"], **hub)
    return os.path.join(root, subfolder)


def _split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """(hub and loader options, config overrides); options that would change what is loaded are refused."""
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) not in (None, "auto", torch.float32):
            raise EngineError(
                f"from_pretrained under infinity.Init got {key}={kwargs[key]!r}: the engine keeps fp32 master "
                "weights and computes in [precision] dtype of the infinity config; set it there and drop "
                f"{key}=")
    for key in ("device_map", "quantization_config", "tp_plan", "gguf_file", "state_dict", "output_loading_info"):
        if kwargs.get(key) not in (None, False):
            raise EngineError(f"from_pretrained under infinity.Init does not support {key}=; the engine places "
                              "every state itself (drop it, or load without infinity.Init)")
    if kwargs.get("use_safetensors") is False:
        raise EngineError("from_pretrained under infinity.Init streams safetensors only: use_safetensors=False "
                          "cannot be honoured")
    adapter = kwargs.get("adapter_kwargs") or {}
    if "_adapter_model_path" in adapter:
        raise EngineError("from_pretrained under infinity.Init does not load PEFT adapters: load the base "
                          "model, then attach the adapter")
    options, overrides = {}, {}
    for key, value in kwargs.items():
        if key in _HUB_KWARGS or key in ("dtype", "torch_dtype", "adapter_kwargs", "config", "attn_implementation",
                                         "device_map", "quantization_config", "tp_plan", "gguf_file",
                                         "state_dict", "output_loading_info"):
            options[key] = value
        else:
            overrides[key] = value
    return options, overrides


def load_pretrained(init, cls, path, *model_args, **kwargs):
    """``cls.from_pretrained(path, **kwargs)`` while ``init`` is open: see [Note: loading a pretrained model]."""
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    if model_args:
        raise EngineError(f"from_pretrained under infinity.Init takes no positional model arguments after the "
                          f"path (got {len(model_args)}); pass them as keyword arguments")
    options, overrides = _split_kwargs(kwargs)
    directory = _directory(path, options)
    config = options.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        source = directory if config is None else config
        config_class = getattr(cls, "config_class", None) or AutoConfig
        config = config_class.from_pretrained(source)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise TypeError(f"{cls.__name__}.from_pretrained under infinity.Init got an unexpected keyword "
                            f"argument {key!r} (neither a loading option nor an attribute of {type(config).__name__})")
        setattr(config, key, value)
    config.name_or_path = os.fspath(path)

    files = CheckpointFiles(directory)
    try:
        with init.building_outside(), torch.device("meta"):
            twin = cls(config)
        match = _Match(twin, files, directory)
        del twin
        with nullcontext() if match.missing else no_init_weights():
            model = cls(config)
        if not match.missing:
            model.tie_weights()     # no_init_weights skips init_weights, which ties too
        _stream(init, model, files, match)
    finally:
        files.close()
    if match.missing:
        warnings.warn(f"{cls.__name__}.from_pretrained: the checkpoint {directory!r} has no values for "
                      f"{match.missing}; they keep their initial values", stacklevel=3)
    if match.unexpected:
        warnings.warn(f"{cls.__name__}.from_pretrained: the checkpoint {directory!r} has keys the model does not "
                      f"use: {match.unexpected}", stacklevel=3)
    if model.can_generate() and os.path.isfile(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    if options.get("attn_implementation") is not None:
        model.set_attn_implementation(options["attn_implementation"])
    model.eval()        # as transformers' from_pretrained leaves it
    return model


def _stream(init, model, files: CheckpointFiles, match: _Match) -> None:
    """Fill each of ``model``'s groups, this rank's shard only, from the checkpoint files."""
    init.settle()       # groups that construction code opened are re-sharded before being overwritten
    coordinator = init.engine.coordinator
    name_of = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in match.key_of:
            name_of.setdefault(p, name)
    with init.suspended():
        for group in list(coordinator.groups):
            if not any(s.param in name_of for s in group.slots):
                continue
            lo = group.rank * group.shard_numel
            hi = lo + group.shard_numel
            with init.partitioner.shard_buffer(group) as shard:
                if all(s.param in name_of for s in group.slots):
                    shard.zero_()
                else:
                    init.partitioner.read_master(group, shard)
                for slot in group.slots:
                    start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if start >= end or slot.param not in name_of:
                        continue
                    key = match.key_of[name_of[slot.param]]
                    shard[start - lo:end - lo].copy_(files.read_flat(key, start - slot.offset, end - slot.offset))
                init.partitioner.load_shard(group, shard)
        for name, buf in model.named_buffers(remove_duplicate=False):
            if name in match.key_of:
                key = match.key_of[name]
                buf.copy_(files.read_flat(key, 0, buf.numel()).reshape(buf.shape))


class FromPretrainedRoute:
    """Routes ``PreTrainedModel.from_pretrained`` to :func:`load_pretrained` while one ``Init`` is open.

    ``install`` replaces the classmethod on transformers' base class (every model class and
    the auto classes reach it); ``remove`` puts the original back exactly.
    """

    def __init__(self, init, base: type) -> None:
        self.base = base
        self.original = base.__dict__["from_pretrained"]

        def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
            return load_pretrained(init, cls, pretrained_model_name_or_path, *model_args, **kwargs)

        from_pretrained.__doc__ = self.original.__func__.__doc__
        from_pretrained.infinity_route = True
        self.base.from_pretrained = classmethod(from_pretrained)

    def remove(self) -> None:
        self.base.from_pretrained = self.original


def is_pretrained_base(cls: type) -> bool:
    """Whether ``cls`` is transformers' ``PreTrainedModel`` itself (the class that defines ``from_pretrained``)."""
    return (cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils"
            and "from_pretrained" in cls.__dict__)

