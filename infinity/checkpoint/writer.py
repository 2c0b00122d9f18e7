"""``save_checkpoint``: every rank streams its shards to files; rank 0 commits (see directory.py)."""
from __future__ import annotations

import collections
import io as _io
import os
import shutil
import time
import warnings

import torch
from torch import nn

from infinity import registry
from infinity.checkpoint import directory, in_place as swap_checkpoint, rng, schema, unmanaged
from infinity.checkpoint.agreement import agree, agree_id
from infinity.checkpoint.disk import SaveSize, check_room, free_bytes, writing
from infinity.checkpoint.errors import CheckpointError
from infinity.checkpoint.manifest import (CHUNK_NBYTES, FORMAT, MANIFEST, STATE_FILES, VERSION, dtype_name,
                                          dump_json, fsync_dir, itemsize, sync_files, write_bytes, write_small_file)
from infinity.checkpoint.moments import DecodedMoments
from infinity.checkpoint.stream import StreamIO, TierSpan, ZeroSpan, write_file
from infinity.optim.split_master import MasterSource

_MOMENTS = ("exp_avg", "exp_avg_sq")


def save_checkpoint(path: str | os.PathLike, model: nn.Module, opt=None, extra=None, *, keep: int = 1,
                    in_place: bool = False) -> str:
    """Save the sharded model and optimizer states to ``path``, crash-safely; call on every rank.

    Each rank streams its compute-copy, fp32 master and Adam moment shards from their
    tiers (host or NVMe) into files through a few buffers of ``checkpoint.buffer_size``
    bytes, with CRC-32 checksums, so host memory stays bounded whatever the model size.
    The new version becomes current only once every rank has finished and rank 0 has
    committed it; until then the previous checkpoint at ``path`` stays intact and
    loadable (see [Note: commit protocol] in ``infinity/checkpoint/directory.py``).
    Accumulated gradients are not saved: save after ``opt.step()`` / ``opt.zero_grad()``.

    Parameters
    ----------
    path:
        Directory of the checkpoint (created when missing); versions are kept inside it.
    model:
        The model built inside ``infinity.Init`` (every managed parameter must be reachable from it).
    opt:
        Its ``infinity.AdamW`` / ``infinity.Adam``: step count and hyper-parameters are saved. None
        means the optimizer created for the model, if any (its states are saved in any case).
    extra:
        Anything ``torch.save`` can write (scheduler state, data position), saved per rank and
        returned by ``load_checkpoint`` (it is pickled: load only checkpoints you trust).
    keep:
        Committed versions to keep in ``path``, the new one included (older ones are removed).
    in_place:
        Write no copy of the states: the swap files become the checkpoint, sealed where they lie
        (parameters and optimizer states on NVMe; see [Note: checkpoints in place] in
        ``infinity/checkpoint/in_place.py``). The model then stops training; resume with
        ``infinity.Init(config, resume=path)`` and ``load_checkpoint``. For models whose states
        leave no room on the disk for a copy.

    Returns
    -------
    str
        The directory of the committed version.

    Examples
    --------
    >>> infinity.save_checkpoint("ckpt", model, opt, extra={"epoch": 3})   # doctest: +SKIP
    'ckpt/step00001200-5c0d2e4f9a1b3c77'
    """
    if keep < 1:
        raise ValueError(f"infinity.save_checkpoint: keep must be >= 1, got {keep}")
    engine = registry.engine_of(model, "infinity.save_checkpoint")
    ranks = engine.ranks
    with ranks.together("infinity.save_checkpoint"):    # before agree_id's broadcast: [Note: failing together]
        opt = check_ready(engine, opt, "infinity.save_checkpoint")
    root = os.fspath(path)
    save_id = agree_id(ranks)
    tmp = directory.tmp_dir(root, save_id)
    step = opt.step_count if opt is not None else 0
    chunk = min(CHUNK_NBYTES, engine.config.checkpoint.buffer_size)
    error, lock, description = None, None, None
    try:
        if in_place:
            swap_checkpoint.check_can_save(engine)
        description = describe(engine, model, opt)
        size = SaveSize(root, _rank_nbytes(engine, description, in_place), ranks.rank)
        if ranks.rank == 0:                         # [Note: one saver per directory]
            lock = directory.SaveLock(root, size)
            directory.refuse_another_model(root, description["groups"])
            # Retired versions are normally deleted in the background; only a save short of room waits.
            directory.clear_leftovers(root, with_trash=(free_bytes(root) or 0) < size.nbytes)
    except BaseException as exc:
        error = exc
    try:
        agree(ranks, error, f"preparing to save checkpoint {root}")
        try:
            check_room(size)
            with writing(size, directory.rank_dir(tmp, ranks.rank), None, "creating"):
                os.makedirs(directory.rank_dir(tmp, ranks.rank), exist_ok=True)
            _write_rank(engine, tmp, chunk, extra, description, size,
                        save_id if in_place else None)
        except BaseException as exc:
            error = exc
        try:
            agree(ranks, error, f"writing their shards of checkpoint {root}")
        except BaseException:
            swap_checkpoint.unseal_rank(engine)
            if ranks.rank == 0:                     # every rank has stopped writing: leave no debris
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        name = directory.version_name(step, save_id)
        if ranks.rank == 0:
            try:
                manifest = dump_json(_global_manifest(engine, opt, description, save_id, step, chunk, in_place))
                with writing(size, os.path.join(tmp, MANIFEST), len(manifest), "global manifest"):
                    write_bytes(os.path.join(tmp, MANIFEST), manifest)
                record = {"id": save_id, "step": step, "world_size": ranks.world_size}
                directory.commit(root, tmp, name, record, keep, size)
            except BaseException as exc:
                error = exc
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            agree(ranks, error, f"committing checkpoint {root}")
        except BaseException:
            swap_checkpoint.unseal_rank(engine)
            raise
    finally:
        if lock is not None:
            lock.release()
    return os.path.join(root, name)


def _warn_unless_data(raw: bytes) -> None:
    """Say at the save when ``extra`` will need ``trust_extra=True`` to load ([Note: a checkpoint is data] in
    infinity/checkpoint/reader.py)."""
    import pickle

    try:
        torch.load(_io.BytesIO(raw), weights_only=True, map_location="meta")     # no memory for its tensors
    except Exception as exc:
        if not isinstance(exc, pickle.UnpicklingError):
            return
        warnings.warn(f"infinity.save_checkpoint: `extra` is not plain data ({str(exc).splitlines()[0][:160]}): "
                      "infinity.load_checkpoint will refuse it unless called with trust_extra=True. Keep extra to "
                      "tensors, numbers, strings, lists and dicts (or register the type with "
                      "torch.serialization.add_safe_globals)", RuntimeWarning, stacklevel=4)


def check_ready(engine, opt, what: str, damaged_ok: bool = False):
    """The model's optimizer (``opt``, or the one created for it), once no backward runs and updates are published.

    States damaged by a load that failed half-way are refused unless ``damaged_ok`` (a load mends them).

    Why default to the engine's optimizer: the Adam moments live in the engine's store and
    are always saved and loaded, so the step count (Adam's bias correction) must travel
    with them whether or not the caller passed the optimizer.
    """
    if type(opt).__module__.startswith("accelerate.") and hasattr(opt, "optimizer"):
        opt = opt.optimizer     # accelerator.prepare's AcceleratedOptimizer: the one it wraps is ours
    if opt is None:
        opt = engine.optimizer
    elif getattr(opt, "engine", None) is not engine:
        raise CheckpointError(f"{what}: opt is not the infinity optimizer of this model "
                              f"(got {type(opt).__name__}); pass the optimizer created for this model, or None")
    # A backward cut short (Ctrl-C, or SIGTERM raising SystemExit in a preempted run's handler) is closed as the
    # next forward, step() or zero_grad() would close it ([Note: aborted backward] in infinity/runtime/engine.py).
    engine.recover_aborted_backward()
    if engine.backward_running:
        raise CheckpointError(f"{what}: called while a backward pass is still running; call it between steps")
    if not damaged_ok:
        engine.check_intact(what)
        engine.tiers.check()        # a swap file cut under the run: said so, not a short read mid-save
    if opt is not None:
        opt.synchronize()
        if not damaged_ok:      # a save: not of half a step (a load drops one)
            opt.updates.refuse_half_step(what)
    return opt


def names_by_param(model: nn.Module) -> dict:
    """Every name (tied parameters have several) under which ``model`` holds each parameter."""
    names: dict = collections.defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names[p].append(name)
    return names


def model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``model`` under every state-dict key (shared modules: several)."""
    buffers = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        # torch keeps the persistence of a buffer only in this set; it has no public accessor.
        transient = getattr(module, "_non_persistent_buffers_set", ())
        for name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
            if name not in transient:
                buffers[f"{prefix}.{name}" if prefix else name] = buf
    return buffers


def tiled_joins(model: nn.Module) -> list[dict]:
    """State-dict keys that join tile parameters (see [Note: the tiled weight] in infinity/tiling/layers.py).

    A tiled layer's ``state_dict()`` has the untiled key (``fc.weight``) while its parameters
    are the tiles (``fc.tiles.0.weight``, ...); consolidation writes the joined tensor under the
    untiled key, so the state dict loads into the plain, untiled model.
    """
    joins = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        tiled_params = getattr(module, "tiled_params", None)
        sizes = getattr(module, "tile_sizes", None)
        if tiled_params is None or sizes is None:
            continue
        p = f"{prefix}." if prefix else ""
        for name, dim, shape in tiled_params():
            joins.append({"key": p + name, "dim": int(dim), "shape": [int(d) for d in shape],
                          "sizes": [int(n) for n in sizes], "parts": [f"{p}tiles.{i}.{name}" for i in range(len(sizes))]})
    return joins


def describe(engine, model: nn.Module, opt=None) -> dict:
    """Groups with parameter names, buffers, state-dict keys, and the parameters added after ``infinity.Init``
    with ``opt``'s Adam states of them ([Note: unmanaged parameters in checkpoints]), as the manifest records
    them."""
    names = names_by_param(model)
    managed = engine.coordinator.group_of
    stray = [n for n, p in model.named_parameters() if p not in managed]
    if stray and any(s.param not in names for g in engine.coordinator.groups for s in g.slots):
        # A managed parameter replaced by a new one after Init: the new one is saved (as an added parameter,
        # [Note: unmanaged parameters in checkpoints]) but the managed one would be left out.
        more = f" ({len(stray) - 1} more)" if len(stray) > 1 else ""
        raise CheckpointError(
            f"infinity.save_checkpoint: parameter {stray[0]!r}{more} of the {type(model).__name__} is not managed "
            "by infinity (an nn.Parameter assigned after infinity.Init exited, in place of a managed one), so the "
            "checkpoint would leave out the one it replaced; nothing was written. Change a parameter's values "
            "inside `with infinity.gathered(model):` instead of assigning a new one")
    groups = []
    for g in engine.coordinator.groups:
        params = []
        for s in g.slots:
            if s.param not in names:
                raise CheckpointError(
                    f"infinity.save_checkpoint: parameter {s.name!r} of group {g.name!r} is not reachable from "
                    f"the {type(model).__name__} passed in; pass the root model (models built in one "
                    "infinity.Init share an engine and must be saved through their common root)")
            params.append({"names": names[s.param], "shape": list(s.shape), "offset": s.offset, "numel": s.numel})
        groups.append({"index": g.index, "module": g.name, "trainable": bool(g.trainable), "numel": g.numel,
                       "shard_numel": g.shard_numel, "params": params})
    state_dict = model.state_dict(keep_vars=True)
    skipped = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if skipped:
        warnings.warn(f"infinity.save_checkpoint: state-dict entries that are not tensors are not saved: {skipped}",
                      RuntimeWarning, stacklevel=3)
    return {"groups": groups, "buffer_tensors": model_buffers(model), "skipped_keys": skipped,
            "unmanaged": unmanaged.tensors(engine, model, opt),
            "state_dict_keys": list(state_dict), "joins": tiled_joins(model)}


def _rank_nbytes(engine, description: dict, in_place: bool = False) -> int:
    """About the bytes this rank's save writes (data files, buffers and unmanaged parameters; ``extra`` and
    manifests are small)."""
    whole = list(description["buffer_tensors"].values()) + [t for _, t in description["unmanaged"]]
    own_buffers = sum(t.numel() * t.element_size() for t in whole) if engine.ranks.rank == 0 else 0
    if in_place:
        return own_buffers
    params = sum(g.shard_numel for g in engine.coordinator.groups) * itemsize(engine.coordinator.dtype)
    states = 3 * 4 * sum(n for _, n in engine.layout.sub_ranges)
    return params + states + own_buffers


def _rank_spans(engine) -> dict[str, list]:
    """The spans of each data file of this rank: tier ranges (or zeros), in file order."""
    coordinator, store, layout = engine.coordinator, engine.store, engine.layout
    nbytes = itemsize(coordinator.dtype)
    files = {"params": [TierSpan(coordinator.shards.tier, g.param_key, 0, g.shard_numel * nbytes)
                        for g in coordinator.groups]}
    source = MasterSource(store.split) if store.split is not None else None
    resting = MasterSource(store.resting) if store.resting is not None else None

    def span(state: str, sub: int, n: int):
        if state in _MOMENTS and (sub in store.dormant or not (store.moments_initialized or store.in_place_of(sub))):
            return ZeroSpan(n * 4)      # never stepped (streamed keys), or dormant ([Note: dormant sub-groups] in flat_state.py)
        if state == "master" and source is not None:     # joined from compute copy and remainder
            return TierSpan(source, sub, 0, n * 4)
        if state == "master" and resting is not None and store.resting.keys[sub] is not None:
            return TierSpan(resting, sub, 0, n * 4)     # a dormant sub-group's, split meanwhile
        if state in _MOMENTS and store.moment_format.compressed:    # [Note: moments in checkpoints]
            return DecodedMoments(store, state, sub, n * 4)
        return TierSpan(store.sub_tiers[sub], store.keys[state][sub], 0, n * 4)

    for state in STATE_FILES[1:]:
        files[state] = [span(state, sub, n) for sub, (_, n) in enumerate(layout.sub_ranges)]
    return files


def _write_rank(engine, tmp: str, chunk: int, extra, description: dict, size: SaveSize,
                seal_id: str | None = None) -> None:
    """This rank's files; with ``seal_id``, no state files: its swap files are sealed as the checkpoint."""
    rank = engine.ranks.rank
    rdir = directory.rank_dir(tmp, rank)
    files = {}
    if seal_id is None:
        with StreamIO(engine.config.aio, engine.config.checkpoint.buffer_size, engine.tiers.allocator) as io:
            for name, spans in _rank_spans(engine).items():
                relpath = f"rank{rank}/{name}.bin"
                with writing(size, os.path.join(tmp, relpath), sum(s.nbytes for s in spans)):
                    files[name] = write_file(io, tmp, relpath, spans, chunk)
    small = {}
    if rank == 0:
        small["buffers"] = (f"rank{rank}/buffers.bin", _buffer_bytes(description["buffer_tensors"]))
        if description["unmanaged"]:
            small[unmanaged.FILE] = (f"rank{rank}/{unmanaged.FILE}.bin",
                                     b"".join(_raw(t) for _, t in description["unmanaged"]))
    if extra is not None:
        raw = _io.BytesIO()
        torch.save(extra, raw)
        small["extra"] = (f"rank{rank}/extra.pt", raw.getvalue())
        _warn_unless_data(raw.getvalue())
    exceptions = swap_checkpoint.exceptions_bytes(engine.store) if seal_id is not None else None
    if exceptions is not None:
        small["exceptions"] = (f"rank{rank}/exceptions.pt", exceptions)
    for name, (relpath, data) in small.items():
        with writing(size, os.path.join(tmp, relpath), len(data)):
            files[name] = write_small_file(tmp, relpath, data, chunk)
    record = {"rank": rank, "world_size": engine.ranks.world_size,
              "files": {k: v.to_json() for k, v in files.items()}, "rng": rng.capture()}
    if seal_id is not None:
        record["swap"] = swap_checkpoint.seal_rank(engine, seal_id)
    manifest = dump_json(record)
    with writing(size, os.path.join(rdir, MANIFEST), len(manifest), "manifest"):
        write_bytes(os.path.join(rdir, MANIFEST), manifest)
    with writing(size, rdir, None, "flushing (fsync) the files of"):
        sync_files([os.path.join(tmp, r.path) for r in files.values()] + [os.path.join(rdir, MANIFEST)])
        fsync_dir(rdir)
        fsync_dir(tmp)


def _buffer_bytes(buffers: dict[str, torch.Tensor]) -> bytes:
    return b"".join(_raw(t) for t in buffers.values())


def _raw(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _buffer_entries(buffers: dict[str, torch.Tensor]) -> list[dict]:
    entries, offset = [], 0
    for key, t in buffers.items():
        nbytes = t.numel() * t.element_size()
        entries.append({"name": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset,
                        "nbytes": nbytes})
        offset += nbytes
    return entries


def _jsonable_hyper(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        value = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in value] \
            if isinstance(value, list) else value
        problem = schema.hyper_problem(key, value)      # what a load would refuse fails the save instead
        if problem is not None:
            raise CheckpointError(f"infinity.save_checkpoint: optimizer hyper-parameter {str(key)[:40]!r} = "
                                  f"{str(value)[:60]} cannot be recorded: {problem}")
        out[key] = value
    return out


def _global_manifest(engine, opt, description: dict, save_id: str, step: int, chunk: int,
                     in_place: bool = False) -> dict:
    layout = engine.layout
    optimizer = None
    if opt is not None:
        optimizer = {"class": type(opt).__name__, "hyper": _jsonable_hyper(opt.param_groups[0]),
                     "groups": [_jsonable_hyper(g) for g in opt.param_groups], "step": opt.step_count,
                     "skipped_steps": int(getattr(opt, "skipped_steps", 0)),
                     "param_steps": opt.param_steps() if hasattr(opt, "param_steps") else {},
                     "loss_scale": engine.loss_scaler.as_dict() if engine.loss_scaler is not None else None}
    return {
        "format": FORMAT, "version": VERSION, "id": save_id, "step": step, "created": time.time(),
        "in_place": in_place,
        "world_size": engine.ranks.world_size, "chunk_nbytes": chunk,
        "param_dtype": dtype_name(engine.coordinator.dtype),
        "moments_initialized": bool(engine.store.moments_initialized),
        "layout": {"sub_group_size": layout.sub_group_size, "total_numel": layout.total_numel,
                   "group_starts": list(layout.group_starts)},
        "groups": description["groups"],
        "buffers": _buffer_entries(description["buffer_tensors"]),
        "unmanaged": [entry for entry, _ in description["unmanaged"]],
        "state_dict_keys": description["state_dict_keys"],
        "joins": description["joins"],
        "skipped_keys": description["skipped_keys"],
        "optimizer": optimizer,
        "config": engine.config.to_dict(),
    }
