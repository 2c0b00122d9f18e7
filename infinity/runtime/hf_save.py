"""``infinity.save_pretrained``: a transformers model's directory, written a module at a time.

[Note: save_pretrained streamed]
``model.save_pretrained(d, state_dict=infinity.state_dict(model))`` holds the whole state dict in host
memory: 26 GB for a 13B model in bf16, more than a machine whose NVMe holds the model may have. Here the
files are planned before anything is gathered, from the state dict's shapes and dtypes alone
(``model.state_dict(keep_vars=True)``: the released parameters answer those), as transformers'
``save_pretrained`` would write them: the keys it would drop as tied duplicates (found by its own
``remove_tied_weights_from_state_dict``, given stand-ins that share storage where the parameters are one),
the keys it leaves out (``_keys_to_ignore_on_save``), its split into shards of at most ``max_shard_size``
in key order (huggingface_hub's split) and their names. Each shard's safetensors header is written first;
then the model is walked as ``infinity.state_dict`` walks it (infinity/runtime/gathered.py), and each
tensor's bytes go to their place in their shard as its subtree is gathered, before the next; a subtree
whose keys are all dropped (a tied head) is not gathered. Host memory holds one subtree, on the device no
more than the model's largest group is gathered.

Every rank walks (the gathers are collectives); the main process writes (rank 0, or each rank told
``is_main_process=True``: one per node for a node's own disk, as transformers' ``save_on_each_node``), and
goes on walking after an error of its own.
The shards and the index are written under temporary names and synced, config.json and
generation_config.json into a staging directory beside them; only then are they renamed into place and
the weight files of an earlier save that the new one does not replace removed (transformers removes old
shards but keeps an old model.safetensors beside new shards, which a load then reads). A failure before
the renames (a full disk, at a write or at fsync; a tensor the plan did not foresee; a config that does
not save) leaves the directory as it was; one during them says the directory may hold part of this save.
Either way every rank raises (``_agree``), none returns as if it had saved. A model whose save transformers would convert back to a checkpoint layout (renamed or
fused keys) is refused before anything is gathered: that conversion needs the whole state dict, which
``save_pretrained(d, state_dict=infinity.state_dict(model))`` gives it.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time

import torch
from torch import nn

from infinity import registry
from infinity.checkpoint import safetensors_file
from infinity.checkpoint.stream import _pwrite_all
from infinity.errors import EngineError
from infinity.runtime.gathered import state_dict_parts
from infinity.runtime.peft_save import adapter_state_dict, is_peft_model
from tiers import newfile

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, max_shard_size: int | str = "50GB",
                    dtype: torch.dtype | None = None, is_main_process: bool | None = None) -> dict:
    """``model.save_pretrained(save_directory)`` for a transformers model built inside ``infinity.Init``, the
    state dict streamed to the files a module at a time (see [Note: save_pretrained streamed]).

    Every rank calls it; the main process writes. The directory holds what transformers' own ``save_pretrained`` of the
    plain model writes (safetensors): loadable by ``from_pretrained`` with or without infinity.

    Parameters
    ----------
    model:
        A ``transformers.PreTrainedModel`` built inside ``infinity.Init``, or a ``peft.PeftModel`` whose base and
        adapters were: then what ``PeftModel.save_pretrained`` writes, the adapter only, with only the adapter
        gathered (``max_shard_size`` does not apply).
    save_directory:
        Created if missing. Shards of an earlier save that this one does not replace are removed.
    max_shard_size:
        As transformers' (``"5GB"``, or bytes); its default.
    dtype:
        Floating-point tensors written in it (and ``config.dtype`` saying so); the compute dtype otherwise.
    is_main_process:
        As transformers': whether this rank writes the files. Default: rank 0 does. ``infinity.Trainer`` passes
        ``args.should_save`` (with ``save_on_each_node``, the first rank of each node).

    Returns
    -------
    dict
        ``files`` (the weight files written), ``bytes`` (their tensors' bytes), ``seconds``.
    """
    t0 = time.perf_counter()
    engine = registry.engine_of(model, "infinity.save_pretrained")
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):     # torch.compile's wrapper
        model = model._orig_mod
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = None     # then no model is one
    writes = engine.ranks.rank == 0 if is_main_process is None else bool(is_main_process)
    if is_peft_model(model):
        return _save_adapter(engine, model, os.fspath(save_directory), dtype, writes, t0)
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        raise TypeError(f"infinity.save_pretrained: {type(model).__name__} is not a transformers model; save "
                        "torch.save(infinity.state_dict(model), path) instead")
    _refuse_conversions(model)
    plan = _Plan(model, dtype, max_shard_size)
    directory = os.fspath(save_directory)
    writer = _Writer(directory, plan) if writes else None
    # Rank 0 keeps walking after a failure of its own: the walk's gathers are collectives every rank joins.
    failure = _attempt(writer, writer.open) if writer is not None else None
    for part in state_dict_parts(engine, model, skip=plan.unwanted):
        for key, value in part.items():
            if writer is not None and failure is None:
                failure = _attempt(writer, writer.put, key, value)
    if writer is not None and failure is None:
        failure = _attempt(writer, writer.finish, model)
    try:
        _agree(engine, failure, f"writing {directory!r} failed; it is left as it was")
    except EngineError:
        if writer is not None:
            writer.abandon()        # another writing rank failed: nothing of this save goes in either
        raise
    failure = _attempt(writer, writer.commit) if writer is not None else None
    _agree(engine, failure, f"moving the written files into {directory!r} failed; it may hold part of this save "
                            "beside the earlier one: save again")
    return {"files": list(plan.shards), "bytes": plan.total_bytes, "seconds": time.perf_counter() - t0}


def _save_adapter(engine, model: nn.Module, directory: str, dtype: torch.dtype | None, writes: bool,
                  t0: float) -> dict:
    """A ``PeftModel``: what its own ``save_pretrained`` writes, the adapter alone gathered ([Note: an adapter
    gathered alone] in infinity/runtime/peft_save.py); peft writes the files, on the main process."""
    state = adapter_state_dict(engine, model, dtype=dtype, keep=writes)
    failure = None
    if writes:
        try:
            model.save_pretrained(directory, state_dict=state)
        except Exception as e:      # every rank raises it, below
            failure = e
    _agree(engine, failure, f"writing the adapter to {directory!r} failed")
    files = [os.path.join("" if name == "default" else name, "adapter_model.safetensors") for name in model.peft_config]
    return {"files": files, "bytes": sum(t.nbytes for t in state.values()), "seconds": time.perf_counter() - t0}


def _attempt(writer: "_Writer", step, *args) -> Exception | None:
    """Run one of this rank's writing steps; on an error, remove what it wrote and give the error back."""
    try:
        step(*args)
    except Exception as exc:    # any: the other ranks must hear of it (_agree), not wait in a collective
        writer.abandon()
        return exc
    return None


def _refuse_conversions(model) -> None:
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if conversions:
        raise EngineError(f"infinity.save_pretrained: transformers saves {type(model).__name__} converted back to "
                          "its checkpoint layout (renamed or fused keys), which needs the whole state dict at "
                          "once; save it with model.save_pretrained(d, state_dict=infinity.state_dict(model)) "
                          "(the state dict in host memory)")


class _Plan:
    """The files transformers would write for ``model``'s state dict: which keys, in which shard, where."""

    def __init__(self, model, dtype: torch.dtype | None, max_shard_size: int | str) -> None:
        from huggingface_hub import split_state_dict_into_shards_factory
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        skeleton = model.state_dict(keep_vars=True)
        for key in model._keys_to_ignore_on_save or ():
            skeleton.pop(key, None)
        self.entries: dict[str, tuple[torch.dtype, tuple, int]] = {}
        for key, value in skeleton.items():
            out = dtype if dtype is not None and value.dtype.is_floating_point else value.dtype
            if out not in safetensors_file.DTYPES:
                raise EngineError(f"infinity.save_pretrained: {key!r} is {out}, which safetensors cannot hold")
            self.entries[key] = (out, tuple(value.shape), math.prod(value.shape) * out.itemsize)
        # One stand-in per parameter, its keys views of it: transformers' own rule picks the key it keeps.
        stand_ins: dict[int, torch.Tensor] = {}
        shared = {key: stand_ins.setdefault(id(value), torch.zeros(1)) for key, value in skeleton.items()}
        kept = remove_tied_weights_from_state_dict(dict(shared), model)
        # Each module's keys, by the prefix they share: a subtree whose keys are all dropped (a tied head) is
        # not gathered again only to be skipped.
        self._under: dict[str, list[str]] = {}
        for key in skeleton:
            parts = key.split(".")
            for depth in range(len(parts)):
                self._under.setdefault(".".join(parts[:depth]) + "." if depth else "", []).append(key)
        self._dropped = set(skeleton) - set(kept)
        kept_entries = {key: entry for key, entry in self.entries.items() if key in kept}
        split = split_state_dict_into_shards_factory(
            kept_entries, get_storage_size=lambda entry: entry[2],
            filename_pattern=_WEIGHTS.replace(".safetensors", "{suffix}.safetensors"), max_shard_size=max_shard_size)
        self.shards: dict[str, list[str]] = dict(split.filename_to_tensors)
        self.weight_map: dict[str, str] | None = dict(split.tensor_to_filename) if split.is_sharded else None
        self.total_bytes = sum(entry[2] for entry in kept_entries.values())
        self.dtype = dtype if dtype is not None else model.dtype
        self.n_params = model.num_parameters()


    def unwanted(self, prefix: str) -> bool:
        keys = self._under.get(prefix)
        return bool(keys) and all(key in self._dropped for key in keys)


class _Writer:
    """Rank 0's files: each shard's header, then each tensor's bytes at its offset as it comes."""

    def __init__(self, directory: str, plan: _Plan) -> None:
        self.directory, self.plan = directory, plan
        self.fds: dict[str, int] = {}
        self.where: dict[str, tuple[int, int]] = {}     # key -> (fd, offset)
        self.pending = {key for names in plan.shards.values() for key in names}
        self.staging: str | None = None     # config.json and the like, until commit moves them in
        self.temps: dict[str, str] = {}     # file name -> its temporary name until commit

    def _create(self, name: str) -> int:
        """A new file under a random name (see [Note: temporary names on a shared disk]), for ``name``."""
        fd, self.temps[name] = newfile.create(self.directory, prefix=f".{name}.tmp-")
        return fd

    def open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for name, keys in self.plan.shards.items():
            head, offsets = safetensors_file.header(
                [(key, *self.plan.entries[key]) for key in keys], {"format": "pt"})
            fd = self.fds[name] = self._create(name)
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, len(head) + sum(self.plan.entries[key][2] for key in keys))
            self.where.update({key: (fd, offsets[key]) for key in keys})

    def put(self, key: str, value: torch.Tensor) -> None:
        if key not in self.plan.entries:
            raise EngineError(f"infinity.save_pretrained: the model's state dict gave {key!r}, which its "
                              "state_dict(keep_vars=True) did not name")
        if key not in self.where:
            return      # a second part naming a key again (a module under two names) or a tie dropped
        dtype, shape, _ = self.plan.entries[key]
        if tuple(value.shape) != shape:
            raise EngineError(f"infinity.save_pretrained: {key!r} has shape {tuple(value.shape)}; the plan from "
                              f"state_dict(keep_vars=True) said {shape}")
        data = value.detach().to("cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
        fd, offset = self.where[key]
        _pwrite_all(fd, data, offset)
        self.pending.discard(key)

    def finish(self, model) -> None:
        """Everything written and on disk under temporary names (shards, index, the configs in a staging
        directory): what can fail, a full disk at fsync included, fails before an earlier save is touched."""
        if self.pending:
            raise EngineError(f"infinity.save_pretrained: the walk gave no value for {sorted(self.pending)[:5]}")
        for name, fd in list(self.fds.items()):
            os.fsync(fd)
            os.close(fd)
            del self.fds[name]
        if self.plan.weight_map is not None:
            content = {"metadata": {"total_parameters": self.plan.n_params, "total_size": self.plan.total_bytes},
                       "weight_map": self.plan.weight_map}
            with open(self._create(_INDEX), "w", encoding="utf-8") as f:
                f.write(json.dumps(content, indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.staging = tempfile.mkdtemp(prefix=".infinity-save-", dir=self.directory)
        model.config.dtype = str(self.plan.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(self.staging)
        if model.can_generate():
            model.generation_config.save_pretrained(self.staging)

    def commit(self) -> None:
        """Renames into place; then the files of an earlier save this one does not replace go."""
        for name in self.plan.shards:
            os.replace(self.temps[name], os.path.join(self.directory, name))
            del self.temps[name]
        index = os.path.join(self.directory, _INDEX)
        if self.plan.weight_map is not None:
            os.replace(self.temps[_INDEX], index)
            del self.temps[_INDEX]
        elif os.path.exists(index):
            os.remove(index)        # it names the shards of an earlier save, removed below
        for name in os.listdir(self.directory):     # an earlier save's weights (transformers keeps model.safetensors)
            if (_SHARD_NAME.fullmatch(name) or name == _WEIGHTS) and name not in self.plan.shards:
                os.remove(os.path.join(self.directory, name))
        for name in os.listdir(self.staging):
            os.replace(os.path.join(self.staging, name), os.path.join(self.directory, name))
        os.rmdir(self.staging)
        self.staging = None

    def abandon(self) -> None:
        """Remove what this save wrote under temporary names (after a failure)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        for name in list(self.temps):
            try:
                os.remove(self.temps.pop(name))
            except FileNotFoundError:
                pass
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def _agree(engine, failure: BaseException | None, what: str) -> None:
    """Every rank raises, saying ``what``, when a step of a writing rank failed (the others only walked);
    the others name the highest rank that failed."""
    flag = torch.tensor([0.0 if failure is None else engine.ranks.rank + 1.0], device=engine.ranks.device)
    engine.ranks.all_reduce_max(flag)
    failed = int(flag.item()) - 1
    if failed < 0:
        return
    if failure is None:
        raise EngineError(f"infinity.save_pretrained: on rank {failed}, {what}; its error there says why")
    raise EngineError(f"infinity.save_pretrained: {what}: {failure}") from failure
