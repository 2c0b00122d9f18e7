"""``load_checkpoint``: each rank reads the saved bytes of its own new shards into its tiers.

The target world size, grouping and tier layout may all differ from the saved ones
(see [Note: resharding by parameter] in reshard.py): bytes go through the tier
interface (``tier.write`` for optimizer states, ``coordinator.shards.write`` for
compute copies), so params and states land on host or NVMe as the loading config
says. Every chunk read is verified against its CRC-32 before its bytes are used.

[Note: a load is all or nothing]
A load that failed half-way used to leave the model with some states from the
checkpoint and the rest from before, and training went on with the mixture. Now a
load runs in two phases, each closed by an agreement of all ranks:

1. *verify*: the commit record and manifests, the model's and the checkpoint's
   parameters, buffers and optimizer step counts agree, every byte this rank will
   read is read once and checked against its CRC-32, the buffers and ``extra`` are
   read and unpickled. Nothing reaches a tier. The optimizer's step count and
   hyper-parameters and the RNG states are changed here only in memory, after
   their old values are kept: on any failure (on any rank) they are put back,
   and the model trains on exactly as if the call had not happened.
2. *apply*: the verified bytes stream into the tiers. What can still fail here is
   the disk itself (an I/O error, a file replaced between the phases); then the
   states are a mixture that nothing can undo without a second copy of the model,
   so the engine marks them damaged and refuses to train or save until a load
   succeeds, instead of training on them.

The price is that each rank reads its share of the checkpoint twice (once to
verify, once to load); a load is much rarer than a step, and the second read
often comes from the page cache.
"""
from __future__ import annotations

import dataclasses
import io as _io
import os

import torch
from torch import nn

from infinity import registry
from infinity.checkpoint import rng, unmanaged
from infinity.checkpoint.agreement import agree
from infinity.checkpoint.directory import SavedCheckpoint
from infinity.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                       CheckpointUntrustedError)
from infinity.checkpoint.in_place import verify_sealed
from infinity.checkpoint.manifest import STATE_FILES, dtype_of, itemsize, read_small_file
from infinity.checkpoint.reshard import SavedLayout, TargetGroup, TargetSlot, plan_shards
from infinity.checkpoint.staging import StagedSubGroups, staging_for
from infinity.checkpoint.stream import Run, StreamIO, _Done, read_runs
from infinity.checkpoint.writer import check_ready, model_buffers, names_by_param
from infinity.errors import EngineError, add_note

_F32 = 4


def load_checkpoint(path: str | os.PathLike, model: nn.Module, opt=None, *, trust_extra: bool = False,
                    weights_only: bool = False):
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` and ``opt``; call on every rank.

    The checkpoint may have been saved with another world size (it is resharded) and
    with parameters or optimizer states in other tiers. Its commit record, manifests
    and every chunk it will read are verified before the first byte reaches a tier; a
    missing, truncated or corrupt file raises ``CheckpointCorruptError`` naming the file,
    and the model, optimizer and RNG states are then exactly as before the call (see
    [Note: a load is all or nothing]). Restores the step count,
    hyper-parameters and, on each rank, the RNG states saved by the same rank (by rank
    ``rank % saved_world_size`` after resharding). Accumulated gradients are cleared.

    Parameters
    ----------
    path:
        The checkpoint directory (its ``latest`` version) or one version directory.
    model:
        The model built inside ``infinity.Init``; parameter names and shapes must match.
    opt:
        Its infinity optimizer; None means the one created for the model, if any. Create the
        optimizer before loading: the moments are loaded in any case, and the step count and
        hyper-parameters go to the optimizer.
    trust_extra:
        A checkpoint is data, never code ([Note: a checkpoint is data]): its ``extra`` is read with
        ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples, dicts, and the types
        given to ``torch.serialization.add_safe_globals``). An ``extra`` that needs more (an object of
        your own class) raises ``CheckpointUntrustedError`` before anything is loaded, unless this is
        True: then it is unpickled in full, which runs whatever code the file names. Only for
        checkpoints you wrote yourself.
    weights_only:
        Load the model's values alone (parameters with their fp32 master weights, and buffers), as
        ``model.load_state_dict`` would: the optimizer's moments, step counts and hyper-parameters, the RNG
        states and ``extra`` stay as they are (the Trainer's ``load_best_model_at_end``; starting a new run
        from a checkpoint's weights). Not for a checkpoint in place, which resumes whole.

    Returns
    -------
    The ``extra`` this rank's counterpart passed to ``save_checkpoint`` (None if none, or ``weights_only``).

    Examples
    --------
    >>> extra = infinity.load_checkpoint("ckpt", model, opt)   # doctest: +SKIP
    """
    engine = registry.engine_of(model, "infinity.load_checkpoint")
    where = os.fspath(path)
    with engine.ranks.together("infinity.load_checkpoint"):     # [Note: failing together]
        opt = check_ready(engine, opt, "infinity.load_checkpoint", damaged_ok=True)
        if weights_only:
            _refuse_weights_only(engine, opt, where)
    resume = getattr(engine, "resume", None)
    if resume is not None and engine.damaged and resume.id is not None:
        if weights_only:
            raise CheckpointMismatchError(f"infinity.load_checkpoint({where!r}, weights_only=True): the model was built "
                                          "to resume this checkpoint in place, which loads whole; drop weights_only")
        return _load_in_place(engine, model, opt, resume, where, trust_extra)
    error, load = None, None
    undo = _Undo(opt)
    engine.coordinator.release_all(include_persistent=True)
    try:
        _check_swap_files(engine)
        load = _Verified(engine, model, opt, SavedCheckpoint(path), trust_extra, weights_only)
    except BaseException as exc:
        error = exc
    try:
        agree(engine.ranks, error, f"verifying checkpoint {where} (nothing was loaded)")
    except BaseException:
        undo.restore(opt)
        raise
    # From the first byte written the states are a mixture until the load is through; so also for the load's own
    # zero_grad(), which drops a half-applied update during backward with the gradients ([Note: update during
    # backward] in infinity/optim/in_backward.py).
    engine.damaged = f"loading checkpoint {where} did not finish"
    try:
        extra = load.apply()
    except BaseException as exc:
        error = exc
    finally:
        engine.coordinator.release_all(include_persistent=True)
    try:
        agree(engine.ranks, error, f"loading checkpoint {where}")
    except BaseException as exc:
        # On every rank, also those whose part went through: the model is one mixture.
        engine.damaged = (f"loading checkpoint {where} failed after its bytes began to reach the tiers "
                          f"({str(exc) or type(exc).__name__}); the states are partly loaded: load a checkpoint "
                          "(infinity.load_checkpoint) before "
                          "training or saving")
        raise
    engine.damaged = None
    if not weights_only:
        _steps_left_behind(engine, opt, load.saved.manifest, where)
    return extra


def _check_swap_files(engine) -> None:
    """A swap file cut or overwritten under the run cannot take a load: writing into it fails half-way
    (and leaves the states damaged). Refused before anything is written, saying how to go on."""
    try:
        engine.tiers.check()
    except OSError as exc:
        add_note(exc, "infinity.load_checkpoint: nothing was loaded; a damaged swap file cannot take the load. "
                      "Call infinity.release(model), build the model again inside infinity.Init (new swap files), "
                      "then load the checkpoint into it")
        raise


# [Note: a checkpoint is data]
# Checkpoints travel: downloaded, untarred from a colleague, pointed at by a conversion job. Unpickling runs
# whatever code the pickle names, so nothing in a checkpoint is unpickled with code: every state is raw bytes
# described by JSON manifests, and the one pickle a save writes, the caller's ``extra``, is read with
# ``torch.load(weights_only=True)``, torch's allow-list of plain data. An ``extra`` beyond it is refused before
# anything is loaded (``CheckpointUntrustedError``), unless the caller passes ``trust_extra=True`` for a file
# of its own; ``save_checkpoint`` warns when it writes one. The manifests' CRC-32s catch damage, not an
# adversary (anyone can recompute them): what a hostile checkpoint can do is fail.
def load_extra(raw: bytes, where: str, trust: bool = False):
    """The ``extra`` saved at ``where`` (its bytes ``raw``), as plain data unless ``trust``."""
    import pickle

    try:
        return torch.load(_io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as exc:
        if not trust:
            raise CheckpointUntrustedError(
                f"{where}: the saved `extra` is not plain data ({str(exc).splitlines()[0][:200]}); loading it "
                "would run code the file names, so nothing was loaded. If you wrote this checkpoint yourself, "
                "pass trust_extra=True to infinity.load_checkpoint (or register the type with "
                "torch.serialization.add_safe_globals); a checkpoint from elsewhere: do not") from None
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: the saved `extra` cannot be read ({type(exc).__name__})") from exc
    try:
        return torch.load(_io.BytesIO(raw), weights_only=False)
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: the saved `extra` cannot be unpickled "
                                     f"({type(exc).__name__}: {exc})") from exc


def _load_in_place(engine, model: nn.Module, opt, resume, where: str, trust_extra: bool = False):
    """The rest of a checkpoint in place, into a model built from it ([Note: checkpoints in place])."""
    error, extra = None, None
    try:
        saved = SavedCheckpoint(where)
        if saved.manifest.get("id") != resume.id:
            raise CheckpointMismatchError(
                f"infinity.load_checkpoint({where!r}): this model was built from the checkpoint in place "
                f"{resume.path} (id {resume.id}), which is the one it must load, not {saved.directory}")
        resume.verify(engine)
        buffers = model_buffers(model)
        _check_buffers(saved.manifest, buffers)
        values = _read_buffers(saved, saved.manifest)
        added = unmanaged.read(saved, saved.manifest, engine, model)
        rank = engine.ranks.rank
        state = saved.rank_manifest(rank)
        record = saved.file(rank, "extra")
        if record is not None:
            extra = load_extra(read_small_file(saved.directory, record), saved.path_of(record), trust_extra)
        record = saved.file(rank, "exceptions")
        if engine.store.split is not None:
            if record is None:
                raise CheckpointCorruptError(f"{saved.directory}: rank {rank} saved no split-master exceptions")
            engine.store.split.exceptions.load(torch.load(_io.BytesIO(read_small_file(saved.directory, record)),
                                                          weights_only=True))
        if opt is not None:
            _restore_optimizer(opt, saved.manifest)
        engine.store.moments_initialized = bool(saved.manifest.get("moments_initialized"))
        with torch.no_grad():
            for name, value in values.items():
                buffers[name].copy_(value)
        unmanaged.apply(added, engine, model, opt)
        rng.restore(state["rng"])
    except BaseException as exc:
        error = exc
    agree(engine.ranks, error, f"loading checkpoint in place {where} (the model stays untrainable until it loads)")
    resume.id = None        # loaded: the model trains from here
    engine.damaged = None
    _steps_left_behind(engine, opt, resume.saved.manifest, where)
    return extra


class _Undo:
    """What a failed load puts back: the optimizer's scalars and the RNG states (see [Note: a load is all
    or nothing])."""

    def __init__(self, opt) -> None:
        self.rng = rng.capture()
        self.optimizer = None
        if opt is not None:
            hyper = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            self.optimizer = (hyper, opt.step_count, getattr(opt, "skipped_steps", 0),
                              opt.param_steps() if hasattr(opt, "param_steps") else None)

    def restore(self, opt) -> None:
        rng.restore(self.rng)
        if self.optimizer is None:
            return
        hyper, step_count, skipped, param_steps = self.optimizer
        for group, before in zip(opt.param_groups, hyper):     # every group: a load sets each one's
            for key in [k for k in group if k != "params" and k not in before]:
                del group[key]
            group.update(before)
        opt.step_count = step_count
        if hasattr(opt, "skipped_steps"):
            opt.skipped_steps = skipped
        if param_steps is not None:
            opt.load_param_steps(param_steps, "state before the failed load")


class _StateDest:
    """Bytes of fp32 states into one sub-group key of the optimizer tier."""

    def __init__(self, tier, key: int, base: int) -> None:
        self.tier, self.key, self.base = tier, key, base

    def write(self, dest_offset: int, data: torch.Tensor):
        return self.tier.write(self.key, data, self.base + dest_offset)


class _WakingDest:
    """Bytes of fp32 moments into a dormant sub-group ([Note: dormant sub-groups] in
    infinity/optim/flat_state.py): zeros are what it holds already; the first nonzero bytes wake it."""

    def __init__(self, store, state: str, sub: int, base: int) -> None:
        self.store, self.state, self.sub, self.base = store, state, sub, base

    def write(self, dest_offset: int, data: torch.Tensor):
        if self.sub in self.store.dormant and not data.any():
            return _Done()
        self.store.wake([self.sub])
        return self.store.sub_tiers[self.sub].write(self.store.keys[self.state][self.sub], data, self.base + dest_offset)


class _ParamDest:
    """Bytes of ``src_dtype`` values into a group's compute-copy shard (converted when dtypes differ)."""

    def __init__(self, coordinator, group, elem: int, src_dtype: torch.dtype) -> None:
        self.coordinator, self.group, self.elem, self.src_dtype = coordinator, group, elem, src_dtype
        self.src_itemsize = itemsize(src_dtype)

    def write(self, dest_offset: int, data: torch.Tensor):
        values = data.view(self.src_dtype)
        return self.coordinator.shards.write(self.group, values, self.elem + dest_offset // self.src_itemsize)


def target_groups(engine, model: nn.Module) -> list[TargetGroup]:
    names = names_by_param(model)
    groups = []
    for g in engine.coordinator.groups:
        slots = tuple(TargetSlot(tuple(names.get(s.param) or [s.name]), s.offset, s.numel, tuple(s.shape))
                      for s in g.slots)
        groups.append(TargetGroup(g.index, g.shard_numel, slots))
    return groups


class _Verified:
    """A checkpoint checked against this model and verified byte by byte; ``apply`` loads it.

    Construction reads (and CRC-checks) everything this rank will load and changes nothing
    but the optimizer's scalars, which ``_Undo`` can put back (see [Note: a load is all or
    nothing]).
    """

    def __init__(self, engine, model: nn.Module, opt, saved: SavedCheckpoint, trust_extra: bool = False,
                 weights_only: bool = False) -> None:
        self.engine, self.opt, self.saved, self.weights_only = engine, opt, saved, weights_only
        manifest = saved.manifest
        saved.refuse_in_place("infinity.load_checkpoint")
        # Split masters and compressed moments are rebuilt as their sub-groups complete
        # ([Note: staged sub-groups] in staging.py).
        self.staged = staging_for(engine.store, weights_only)
        self.fills, self.files, self.runs = _plan(engine, model, saved, self.staged,
                                                  STATE_FILES[1:2] if weights_only else STATE_FILES[1:])
        self.buffers = model_buffers(model)
        _check_buffers(manifest, self.buffers)
        with StreamIO(engine.config.aio, engine.config.checkpoint.buffer_size, engine.tiers.allocator) as io:
            read_runs(io, self.files, [dataclasses.replace(run, dest=None) for run in self.runs])
        self.buffer_values = _read_buffers(saved, manifest)
        self.unmanaged = unmanaged.read(saved, manifest, engine, model)    # [Note: unmanaged parameters in ...]
        self.model = model
        twin = engine.ranks.rank % saved.world_size
        self.rng = saved.rank_manifest(twin).get("rng")
        if not isinstance(self.rng, dict):
            raise CheckpointCorruptError(f"{saved.directory}: the manifest of rank {twin} has no RNG states")
        record = None if weights_only else saved.file(twin, "extra")
        self.extra = None
        if record is not None:
            self.extra = load_extra(read_small_file(saved.directory, record), saved.path_of(record), trust_extra)
        if opt is not None and not weights_only:
            _restore_optimizer(opt, manifest)   # in memory only; _Undo puts it back on failure

    def apply(self):
        """Write the verified bytes into the tiers; then buffers, gradients and RNG states."""
        engine = self.engine
        coordinator, store, layout = engine.coordinator, engine.store, engine.layout
        with StreamIO(engine.config.aio, engine.config.checkpoint.buffer_size, engine.tiers.allocator) as io:
            try:
                read_runs(io, self.files, self.runs)
                _fill_zeros(io, coordinator, store, layout, self.fills, self.staged,
                            STATE_FILES[1:2] if self.weights_only else STATE_FILES[1:])
                if self.staged is not None:
                    self.staged.finish()
            except BaseException:
                if self.staged is not None:
                    self.staged.abandon()
                raise
        store.moments_initialized = store.moments_initialized or not self.weights_only
        if self.opt is not None:
            self.opt.zero_grad()
        else:
            store.zero_grad()
        with torch.no_grad():
            for name, value in self.buffer_values.items():
                self.buffers[name].copy_(value)
        unmanaged.apply(self.unmanaged, engine, self.model, None if self.weights_only else self.opt)
        if not self.weights_only:
            rng.restore(self.rng)
        return self.extra


def _plan(engine, model: nn.Module, saved: SavedCheckpoint, staged: StagedSubGroups | None = None,
          state_files=STATE_FILES[1:]):
    """The fills, the source files and the runs (with their destinations) that load this rank's shards.

    The parameters' runs come first in ``runs``, so ``read_runs`` reads the params file before the
    masters': a split master written from the master file then sets the compute copy last, and the
    copy is the master's rounding whatever the checkpoint's params file holds.
    """
    manifest = saved.manifest
    ranks = engine.ranks
    coordinator, store, layout = engine.coordinator, engine.store, engine.layout
    moves, fills = plan_shards(SavedLayout(manifest), target_groups(engine, model), ranks.rank, ranks.world_size)
    files: dict[str, tuple[str, object]] = {}

    def source(rank: int, name: str) -> str:
        key = f"rank{rank}/{name}"
        if key not in files:
            record = saved.file(rank, name, needed=True)
            files[key] = (saved.path_of(record), record)
        return key

    saved_dtype = dtype_of(manifest["param_dtype"])
    param_source = "params" if saved_dtype == coordinator.dtype else "master"
    param_dtype = saved_dtype if param_source == "params" else torch.float32
    param_size = itemsize(param_dtype)
    groups = coordinator.groups
    params = [Run(source(m.src_rank, param_source), m.src_elem * param_size, m.numel * param_size,
                  _ParamDest(coordinator, groups[m.group], m.dst_elem, param_dtype)) for m in moves]
    states = []
    for m in moves:
        flat = layout.group_starts[m.group] + m.dst_elem
        for state in state_files:
            src = source(m.src_rank, state)
            for sub, within, n, rel in layout.sub_pieces(flat, m.numel):
                states.append(Run(src, (m.src_elem + rel) * _F32, n * _F32,
                                  _state_dest(store, staged, state, sub, within, n * _F32)))
    return fills, files, params + states


def _state_dest(store, staged: StagedSubGroups | None, state: str, sub: int, within: int, nbytes: int):
    """Where ``nbytes`` fp32 bytes of ``state`` for elements from ``within`` of sub-group ``sub`` land."""
    if staged is not None and staged.handles(state):
        return staged.dest(state, sub, within * _F32, nbytes)
    if state != "master" and sub in store.dormant:
        return _WakingDest(store, state, sub, within * _F32)
    return _StateDest(store.sub_tiers[sub], store.keys[state][sub], within * _F32)


def _fill_zeros(io, coordinator, store, layout, fills, staged: StagedSubGroups | None = None,
                state_files=STATE_FILES[1:]) -> None:
    """Padding of the new shards (no parameter covers it) is zero, as at partitioning."""
    zeros = io.zeros
    futures = []
    for fill in fills:
        group = coordinator.groups[fill.group]
        for start in range(0, fill.numel, zeros.numel() // _F32):
            n = min(zeros.numel() // _F32, fill.numel - start)
            futures.append(coordinator.shards.write(group, zeros[:n * _F32].view(torch.float32),
                                                   fill.dst_elem + start))
            flat = layout.group_starts[fill.group] + fill.dst_elem + start
            for state in state_files:
                for sub, within, m, rel in layout.sub_pieces(flat, n):
                    if staged is not None and staged.handles(state):
                        staged.pad(state, sub)      # the staged buffer is zeros already
                    elif state == "master" or sub not in store.dormant:     # a dormant one's moments are zero
                        futures.append(_StateDest(store.sub_tiers[sub], store.keys[state][sub], within * _F32)
                                       .write(0, zeros[:m * _F32]))
        if len(futures) > 64:
            for fut in futures:
                fut.wait()
            futures = []
    for fut in futures:
        fut.wait()


def _refuse_weights_only(engine, opt, where: str) -> None:
    """A load of the weights alone leaves the optimizer's moments as they are: it cannot mend states damaged
    (a step or a load that failed part-way), nor drop half a step taken during backward."""
    what = f"infinity.load_checkpoint({where!r}, weights_only=True)"
    if engine.damaged:
        raise CheckpointError(f"{what}: the states are damaged ({engine.damaged}), and a load of the weights alone "
                              "leaves the optimizer's moments as they are; load the checkpoint whole (without "
                              "weights_only)")
    if opt is not None:
        opt.updates.refuse_half_step(what)


def _steps_left_behind(engine, opt, manifest: dict, where: str) -> None:
    """A load into a model without an optimizer yet loads the moments (they are the engine's) but has nowhere to
    put the step counts: said by the optimizer created next (``steps_not_loaded``), not left silent."""
    step = int((manifest.get("optimizer") or {}).get("step", 0))
    engine.steps_not_loaded = f"checkpoint {where} (step {step})" if opt is None and step else None


def _restore_optimizer(opt, manifest: dict) -> None:
    saved = manifest.get("optimizer")
    if saved is None:
        return
    per_group = saved.get("groups") or [saved["hyper"]] * len(opt.param_groups)
    if len(per_group) != len(opt.param_groups):
        raise CheckpointMismatchError(f"infinity.load_checkpoint: the checkpoint's optimizer has {len(per_group)} param "
                              f"groups, this one {len(opt.param_groups)}")
    for group, hyper in zip(opt.param_groups, per_group):     # checked whole before any is set
        for key, value in hyper.items():
            _check_hyper(key, group.get(key), value)
    for group, hyper in zip(opt.param_groups, per_group):
        for key, value in hyper.items():
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            group[key] = value
    opt.step_count = int(saved["step"])
    if hasattr(opt, "skipped_steps"):
        opt.skipped_steps = int(saved.get("skipped_steps", 0))
    if hasattr(opt, "load_param_steps"):
        try:
            opt.load_param_steps(saved.get("param_steps", {}), "checkpoint")
        except EngineError as exc:      # names this model does not have: the checkpoint is another model's
            raise CheckpointMismatchError(str(exc)) from None
    scaler = opt.engine.loss_scaler
    if scaler is not None and saved.get("loss_scale") is not None:    # fp16's loss scale goes on where it was
        scaler.load(saved["loss_scale"], "infinity.load_checkpoint")


def _check_hyper(key: str, now, saved) -> None:
    """A saved hyper-parameter must be what the optimizer holds there: a number for a number, a list of as many
    numbers for a tuple of numbers (``betas``); the checkpoint cannot turn ``lr`` into a string."""
    def number(value) -> bool:
        return type(value) in (int, float)

    def numeric(value) -> bool:      # what the optimizer holds: a number, or a one-element tensor (a tensor lr)
        return number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)

    wrong = (numeric(now) and not number(saved)) or (isinstance(now, tuple) and (
        type(saved) is not list or len(saved) != len(now)
        or any(numeric(a) and not number(b) for a, b in zip(now, saved))))
    if wrong:
        raise CheckpointCorruptError(f"infinity.load_checkpoint: the checkpoint's optimizer hyper-parameter {key!r} "
                                     f"is {str(saved)[:40]}, not the kind of value this optimizer holds there "
                                     f"({str(now)[:40]}); nothing was changed")


def _check_buffers(manifest: dict, buffers: dict[str, torch.Tensor]) -> None:
    saved = {e["name"]: e for e in manifest["buffers"]}
    missing = sorted(set(buffers) - set(saved))
    unexpected = sorted(set(saved) - set(buffers))
    if missing or unexpected:
        raise CheckpointMismatchError(f"module buffers differ: in the model only: {missing}; "
                                      f"in the checkpoint only: {unexpected}")
    for key, entry in saved.items():
        if tuple(entry["shape"]) != tuple(buffers[key].shape):
            raise CheckpointMismatchError(f"buffer {key!r} has shape {tuple(buffers[key].shape)} in the model "
                                          f"but {tuple(entry['shape'])} in the checkpoint")


def _read_buffers(saved: SavedCheckpoint, manifest: dict) -> dict[str, torch.Tensor]:
    """The saved module buffers, read and verified, by state-dict key (copied into the model by ``apply``)."""
    if not manifest["buffers"]:
        return {}
    record = saved.file(0, "buffers")
    if record is None:
        raise CheckpointCorruptError(f"{saved.directory}: the manifest lists buffers but rank 0 has no buffers file")
    raw = read_small_file(saved.directory, record)
    values = {}
    for entry in manifest["buffers"]:
        dtype = dtype_of(entry["dtype"])
        chunk = bytearray(raw[entry["offset"]:entry["offset"] + entry["nbytes"]])
        if len(chunk) != entry["nbytes"]:
            raise CheckpointCorruptError(f"{saved.path_of(record)}: buffer {entry['name']!r} reaches past the "
                                         f"end of the file ({len(raw)} bytes)")
        value = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        values[entry["name"]] = value.reshape(entry["shape"])
    return values


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint without loading it: commit record, manifests, sizes and every chunk's CRC-32.

    Returns a summary (``directory``, ``step``, ``world_size``, ``files``, ``nbytes``); raises
    ``CheckpointCorruptError`` naming the first bad file. A checkpoint in place has its sealed swap
    files checked too, state by state.

    Examples
    --------
    >>> infinity.checkpoint.verify_checkpoint("ckpt")["step"]   # doctest: +SKIP
    1200
    """
    from infinity.config import load_config

    saved = SavedCheckpoint(path)
    files, runs = {}, []
    for rank in range(saved.world_size):
        for name in saved.rank_manifest(rank).get("files", {}):
            record = saved.file(rank, name)
            key = f"rank{rank}/{name}"
            files[key] = (saved.path_of(record), record)
            runs.append(Run(key, 0, record.nbytes, None))
    config = load_config(None)
    with StreamIO(config.aio, config.checkpoint.buffer_size) as io:
        read_runs(io, files, runs)
    nbytes = sum(r.nbytes for _, r in files.values())
    if saved.manifest.get("in_place"):      # the states are in the sealed swap files
        nbytes += sum(verify_sealed(saved, rank) for rank in range(saved.world_size))
    return {"directory": saved.directory, "step": saved.step, "world_size": saved.world_size,
            "files": len(files), "nbytes": nbytes}
