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
   the elements of each tensor that overlap the shard (one ``pread`` per tensor, straight
   into the shard buffer; no memory map), and written to the group's compute copy and
   master weights. When the checkpoint covers every parameter, step 2 writes nothing
   (no values exist yet) and each group is read and written once, at ``Init``'s exit,
   straight into the optimizer store ([Note: groups whose values come later] in
   infinity/runtime/construction.py); the files stay open until then. Peak host memory
   is one group's shard (plus one tensor's elements where the file's dtype differs), on
   top of the engine's own budget.

Parameters the checkpoint lacks keep their initial values and are named in a warning,
as transformers does; so are checkpoint keys the model does not use.
"""
from __future__ import annotations

import json
import math
import os
import warnings
import weakref

import torch

from infinity.errors import EngineError

_HUB_KWARGS = frozenset({"cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                         "trust_remote_code", "weights_only", "use_safetensors", "code_revision", "proxies"})
# Loading options besides the hub's: checked in _split_kwargs and load_pretrained, or taken because they change
# nothing here (low_cpu_mem_usage and disable_mmap: the streaming loader reads a group at a time and never maps a
# file; tqdm_class: it draws no progress bar; adapter_name: no adapter is loaded).
_LOADING_KWARGS = frozenset({"dtype", "torch_dtype", "adapter_kwargs", "config", "attn_implementation",
                             "experts_implementation", "generation_config", "low_cpu_mem_usage",
                             "ignore_mismatched_sizes", "disable_mmap", "tqdm_class", "adapter_name"})
# What transformers passes between its own layers (AutoModel -> the model class, a pipeline -> AutoModel) or
# still accepts and drops for old callers: never a user's option, taken and ignored as transformers does.
_INTERNAL_KWARGS = frozenset({"_from_auto", "_from_pipeline", "_commit_hash", "_fast_init", "mirror", "from_tf",
                              "from_flax", "offload_state_dict"})
# Options that place, split, quantize, rename or swap what is loaded, and why each is refused when set.
_PLACES = "the engine places every state itself"
_REFUSED_KWARGS = {
    **dict.fromkeys(("device_map", "max_memory", "offload_folder", "offload_buffers", "tp_plan", "tp_size",
                     "device_mesh", "distributed_config"), _PLACES),
    "quantization_config": "the engine keeps fp32 master weights and computes in [precision] dtype",
    "gguf_file": "the streaming loader reads safetensors checkpoints",
    "state_dict": "the streaming loader reads the checkpoint's files, a group at a time",
    "output_loading_info": "missing and unused keys are named in a warning instead",
    "key_mapping": "the streaming loader renames no checkpoint key",
    "fusion_config": "the streaming loader builds the model's own modules, unfused",
    "variant": "the streaming loader reads model.safetensors or model.safetensors.index.json",
    **dict.fromkeys(("use_kernels", "kernel_config", "kernels_mode", "allow_all_kernels"),
                    "the layers the engine manages run their own torch forward, not hub kernels"),
}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# safetensors dtype names (the format's header) and the torch dtypes they hold.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_MAX_HEADER = 100 << 20     # the format's own limit on the JSON header


class _Entry:
    """Where one tensor's bytes lie in its file: dtype, shape and absolute byte offset."""

    __slots__ = ("path", "dtype", "shape", "offset")

    def __init__(self, path: str, dtype: torch.dtype, shape: tuple, offset: int) -> None:
        self.path, self.dtype, self.shape, self.offset = path, dtype, shape, offset


class CheckpointFiles:
    """The safetensors files of one checkpoint directory, read with ``pread`` into given memory.

    Each file's header (a little-endian u64 length, then JSON naming every tensor's dtype,
    shape and byte range) is read once; a range of a tensor's elements is then one
    positioned read, straight into the destination when the dtypes agree (no memory map,
    no intermediate tensor). File descriptors are opened at first use and closed by
    ``close`` (or when the object is collected); a read after ``close`` opens them again.

    Parameters
    ----------
    directory:
        Holds ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
    """

    def __init__(self, directory: str) -> None:
        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                paths = sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
        elif os.path.isfile(os.path.join(directory, _SINGLE)):
            paths = [os.path.join(directory, _SINGLE)]
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise EngineError(
                f"from_pretrained under infinity.Init streams safetensors checkpoints, and {directory!r} has "
                f"neither {_SINGLE} nor {_INDEX} (it has: {', '.join(found) or 'nothing'}); convert the "
                "checkpoint with save_pretrained(..., safe_serialization=True) first")
        self._fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, _close_all, self._fds)
        self.entries: dict[str, _Entry] = {}
        for path in paths:
            self.entries.update(_read_header(path, self.fd(path)))
        self.file_of = {k: e.path for k, e in self.entries.items()}
        self.shape_of = {k: e.shape for k, e in self.entries.items()}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self._fds[path]

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` flattened, into contiguous ``out``
        (cast when ``out``'s dtype differs from the file's)."""
        entry = self.entries[key]
        raw = out if out.dtype == entry.dtype else torch.empty(out.numel(), dtype=entry.dtype)
        nbytes = raw.numel() * raw.element_size()
        if nbytes:
            view = memoryview(raw.view(-1).view(torch.uint8).numpy())
            first = entry.offset + start * raw.element_size()
            done = 0
            while done < nbytes:
                got = os.preadv(self.fd(entry.path), [view[done:]], first + done)
                if got == 0:
                    raise EngineError(f"from_pretrained under infinity.Init: {entry.path!r} ends before the "
                                      f"bytes of {key!r} (wanted {nbytes} bytes at offset {first}); the file is cut")
                done += got
        if raw is not out:
            out.copy_(raw.view(out.shape))

    def read_flat(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` flattened, as a new tensor of the file's dtype."""
        out = torch.empty(end - start, dtype=self.entries[key].dtype)
        self.read_into(key, start, out)
        return out

    def close(self) -> None:
        _close_all(self._fds)


def _close_all(fds: dict[str, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])


def _read_header(path: str, fd: int) -> dict[str, _Entry]:
    """The tensors of one safetensors file, checked against its size."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise EngineError(f"from_pretrained under infinity.Init: {path!r} is not a safetensors file (its "
                          f"header length reads {length}, the file has {size} bytes)")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as exc:
        raise EngineError(f"from_pretrained under infinity.Init: {path!r} has an unreadable safetensors "
                          f"header ({exc})") from exc
    base = 8 + length
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise EngineError(f"from_pretrained under infinity.Init: {key!r} in {path!r} has dtype "
                              f"{info.get('dtype')!r}, which the streaming loader does not read "
                              f"(it reads {', '.join(_DTYPES)})")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
            raise EngineError(f"from_pretrained under infinity.Init: {key!r} in {path!r} claims bytes "
                              f"[{begin}, {end}) for shape {list(shape)} of {info['dtype']} in a file of "
                              f"{size} bytes; the file is damaged")
        entries[key] = _Entry(path, dtype, shape, base + begin)
    return entries


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


def _split_kwargs(kwargs: dict, compute_dtype: torch.dtype) -> tuple[dict, dict]:
    """(hub and loader options, config overrides); options that would change what is loaded are refused
    (a ``dtype`` other than the engine's compute dtype: the model would compute in another than asked)."""
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) not in (None, "auto", compute_dtype):
            raise EngineError(
                f"from_pretrained under infinity.Init got {key}={kwargs[key]!r}: the engine keeps fp32 master "
                f"weights and computes in [precision] dtype of the infinity config ({compute_dtype} here); set "
                f"it there and drop {key}=")
    for key, why in _REFUSED_KWARGS.items():
        if kwargs.get(key) not in (None, False):
            raise EngineError(f"from_pretrained under infinity.Init does not support {key}=: {why} "
                              "(drop it, or load without infinity.Init)")
    if kwargs.get("ignore_mismatched_sizes"):
        raise EngineError("from_pretrained under infinity.Init does not support ignore_mismatched_sizes=True: a "
                          "checkpoint tensor of another shape is refused, naming it (build the model with the "
                          "checkpoint's shapes, or load without infinity.Init)")
    if kwargs.get("use_safetensors") is False:
        raise EngineError("from_pretrained under infinity.Init streams safetensors only: use_safetensors=False "
                          "cannot be honoured")
    adapter = kwargs.get("adapter_kwargs") or {}
    if "_adapter_model_path" in adapter:
        raise EngineError("from_pretrained under infinity.Init does not load PEFT adapters: load the base "
                          "model, then attach the adapter")
    options, overrides = {}, {}
    for key, value in kwargs.items():
        if key in _INTERNAL_KWARGS:
            continue
        if key in _HUB_KWARGS or key in _LOADING_KWARGS or key in _REFUSED_KWARGS:
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
    options, overrides = _split_kwargs(kwargs, init.engine.dtype)
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
            twin.tie_weights()      # transformers 5.0 ties in from_pretrained, not in __init__
        match = _Match(twin, files, directory)
        del twin
        if match.missing:
            model = cls(config)
        else:
            # Every parameter comes from the checkpoint: no init, and no values written before the
            # load's (see [Note: groups whose values come later] in infinity/runtime/construction.py).
            with no_init_weights(), init.partitioner.deferring():
                model = cls(config)
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
    if model.can_generate() and options.get("generation_config") is not None:
        model.generation_config = model.generation_config.from_dict(options["generation_config"].to_dict())
    elif model.can_generate() and os.path.isfile(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    if options.get("attn_implementation") is not None:
        model.set_attn_implementation(options["attn_implementation"])
    if options.get("experts_implementation") is not None:
        model.set_experts_implementation(options["experts_implementation"])
    if init.engine.device.is_cuda and options.get("use_kernels") is None:
        _say_hub_kernels_are_off(cls)
    model.eval()        # as transformers' from_pretrained leaves it
    return model


def _say_hub_kernels_are_off(cls) -> None:
    """transformers (from 5.2x, with the ``kernels`` package installed) kernelizes a model it loads on a GPU by
    default, swapping some layers' forwards for hub kernels; the streaming loader does not, and says so."""
    try:
        from transformers.integrations.hub_kernels import _kernels_enabled
        from transformers.utils import is_kernels_available
    except ImportError:
        return      # a transformers without hub kernels: nothing was turned off
    if is_kernels_available() and _kernels_enabled():
        warnings.warn(f"{cls.__name__}.from_pretrained under infinity.Init: the model's layers run their own torch "
                      "forwards; hub kernels (use_kernels) are off for models the engine manages", stacklevel=4)


class _GroupFill:
    """Writes one group's shard (this rank's) from the checkpoint: each slot's overlap is one read."""

    def __init__(self, files: CheckpointFiles, group, key_of_param: dict) -> None:
        self.files = files
        lo = group.rank * group.shard_numel
        hi = lo + group.shard_numel
        # (checkpoint key, first element in the tensor, first element in the shard, element count)
        self.reads = []
        for slot in group.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end and slot.param in key_of_param:
                self.reads.append((key_of_param[slot.param], start - slot.offset, start - lo, end - start))
        self.complete = (sum(n for *_, n in self.reads) == sum(
            max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in group.slots))

    def __call__(self, shard: torch.Tensor) -> None:
        at = 0
        for key, first, into, n in self.reads:
            shard[at:into].zero_()      # padding and uncovered slots between the reads
            self.files.read_into(key, first, shard[into:into + n])
            at = into + n
        shard[at:].zero_()


def _stream(init, model, files: CheckpointFiles, match: _Match) -> None:
    """Give each of ``model``'s groups, this rank's shard only, its values from the checkpoint files.

    A group built in ``deferring()`` gets the files as its source and is written once, at
    ``Init``'s exit; any other group is read, filled and rewritten now.
    """
    init.settle()       # groups that construction code opened are re-sharded before being overwritten
    coordinator = init.engine.coordinator
    partitioner = init.partitioner
    key_of_param = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in match.key_of:
            key_of_param.setdefault(p, match.key_of[name])
    with init.suspended():
        for group in list(coordinator.groups):
            if not any(s.param in key_of_param for s in group.slots):
                continue
            fill = _GroupFill(files, group, key_of_param)
            if partitioner.is_deferred(group):
                partitioner.fill_from(group, fill)
                continue
            with partitioner.shard_buffer(group) as shard:
                if fill.complete:
                    fill(shard)
                else:
                    partitioner.read_master(group, shard)
                    for key, first, into, n in fill.reads:
                        files.read_into(key, first, shard[into:into + n])
                partitioner.load_shard(group, shard)
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

