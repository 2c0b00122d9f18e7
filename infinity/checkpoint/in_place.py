"""Checkpoints that are the swap files themselves: saved by sealing them, resumed by adopting them.

[Note: checkpoints in place]
A model whose states fill the disk has no room for a copy of them: at 6.7B parameters with
int8 moments the swap files take 50 GiB (8 B/param) and a checkpoint of fp32 states would
take 94 GB, on a disk with 75 GB free. ``save_checkpoint(path, model, opt, in_place=True)``
then writes no copy. Every rank (its optimizer synchronized, no transfer in flight):

1. reads each state key of its NVMe tier once, for its CRC-32 (the compute copy of each
   group, ``param:<group>``; the master or its remainder, and Adam's moments once they
   exist, ``<state>:<sub-group>``; never the gradients, which a save does not keep);
2. writes the small rest as an ordinary checkpoint does: module buffers, ``extra``, RNG
   states, and the split masters' exceptions (host memory, [Note: split master]);
3. seals its swap files (tiers/swapfile.py, [Note: sealed swap files]): flushed and renamed
   ``<tier>.ckpt-<id>.sealed`` where they are, and records where each key lies in them.

Rank 0 commits as for any checkpoint ([Note: commit protocol]); the global manifest says
``"in_place": true``. A failure anywhere before the commit unseals every rank's files and
the run goes on. After the commit the model refuses to train or save (its tier refuses
writes): its swap files are the checkpoint.

Resuming: ``infinity.Init(config, resume=path)`` builds the model with no values at all
(nothing is written; [Note: groups whose values come later]) on an NVMe tier that adopts
the sealed files. At the context's exit every state key takes its recorded place
(``NVMeTier.settle``), checked by name and size against the manifest, and the gradients get
new slots in the space left. ``infinity.load_checkpoint(path, model, opt)`` then checks
every state key's CRC-32 and restores the step counts, hyper-parameters, buffers, RNG
states and ``extra``; until it has, the model refuses to train. The first write into the
files (the first backward) consumes the checkpoint: the files become the new run's swap
files. A run that fails or is killed before that leaves the checkpoint as it found it, so
resuming can be retried.

What it asks: parameters and optimizer states both on NVMe, and the same model, world size,
nvme_path, precision, sub-group size and moment format when resuming (a different layout
cannot reuse the bytes where they lie; an ordinary checkpoint reshards). Deleting a
checkpoint in place means deleting its sealed files too (the rank manifests list them).
"""
from __future__ import annotations

import dataclasses
import io as _io
import os
import re
import stat
import zlib

import torch

from infinity.checkpoint.directory import SavedCheckpoint
from infinity.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from infinity.optim.split_master import ZERO
from tiers.swapfile import has_swap_header
from tiers.swapspace import Placement

# Config keys on which where the bytes lie depends: a resume must match them.
_LAYOUT_KEYS = (("tiers", "params"), ("tiers", "optimizer"), ("precision", "dtype"), ("optimizer", "state_dtype"),
                ("optimizer", "state_block_size"), ("partition", "sub_group_size"), ("partition", "stage"),
                ("tiers", "pool_buffer_size"))


def saved_in_place(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at ``path`` was saved in place (resume it with ``infinity.Init(resume=path)``)."""
    return bool(SavedCheckpoint(path).manifest.get("in_place"))


def label(save_id: str) -> str:
    """The label a save seals its swap files with."""
    return f"ckpt-{save_id}"


_CHOSEN = ', as tiers "auto" chose them: give tiers.params = tiers.optimizer = "nvme" to save in place'


def check_can_save(engine) -> None:
    """Raise unless the engine's states can be saved in place (all on NVMe, not sealed already)."""
    t = engine.config.tiers
    if t.optimizer_device_share or t.optimizer_host_share:
        raise CheckpointError(
            "infinity.save_checkpoint(in_place=True): the optimizer states are split over tiers "
            f"(tiers.optimizer_device_share = {t.optimizer_device_share:g}, tiers.optimizer_host_share = "
            f"{t.optimizer_host_share:g}{_CHOSEN if engine.placement is not None else ''}): those in device or host "
            "memory are not in the swap files. Save an ordinary checkpoint (in_place=False), or set both shares to 0")
    if t.params != "nvme" or t.optimizer != "nvme":
        raise CheckpointError(
            "infinity.save_checkpoint(in_place=True): needs tiers.params and tiers.optimizer both 'nvme' (they are "
            f"{t.params!r} and {t.optimizer!r}{_CHOSEN if engine.placement is not None else ''}): states in host or "
            "device memory are not in the swap files. Save an ordinary checkpoint (in_place=False)")
    tier = engine.tiers.nvme_tier
    if tier.sealed is not None:
        raise CheckpointError(f"infinity.save_checkpoint: this model's swap files are already checkpoint "
                              f"{tier.sealed!r} (saved in place); resume from it in a new model to go on")


def state_keys(coordinator, store, with_moments: bool) -> dict[str, int]:
    """The keys holding the training state, by role: the same roles in the saving and the resuming run."""
    keys = {f"param:{g.index}": g.param_key for g in coordinator.groups}
    for state, per_sub in store.keys.items():
        if state == "grad" or (state in ("exp_avg", "exp_avg_sq") and not with_moments):
            continue
        for sub, key in enumerate(per_sub):
            # a dormant sub-group's moments are zero ([Note: dormant sub-groups]), its remainders may be
            # ([Note: zero remainders] in infinity/optim/split_master.py): no key, no role
            if key is not None and key != ZERO:
                keys[f"{state}:{sub}"] = key
    return keys


def key_crc(tier, key: int, buffers: list[torch.Tensor]) -> int:
    """CRC-32 of a key's bytes, read through two host buffers (one read ahead of the sum)."""
    nbytes, chunk = tier.nbytes(key), buffers[0].numel()
    crc, pending = 0, None
    for i, start in enumerate(range(0, nbytes, chunk)):
        buf = buffers[i % 2][:min(chunk, nbytes - start)]
        future = tier.read(key, buf, start)
        if pending is not None:
            pending[1].wait()
            crc = zlib.crc32(memoryview(pending[0].numpy()), crc)
        pending = (buf, future)
    if pending is not None:
        pending[1].wait()
        crc = zlib.crc32(memoryview(pending[0].numpy()), crc)
    return crc


def _buffers(engine) -> list[torch.Tensor]:
    chunk = engine.config.checkpoint.buffer_size
    return [engine.tiers.allocator.empty(chunk) for _ in range(2)]


def seal_rank(engine, save_id: str) -> dict:
    """Sum this rank's state keys, seal its swap files; the rank manifest's ``swap`` record."""
    tier = engine.tiers.nvme_tier
    keys = state_keys(engine.coordinator, engine.store, engine.store.moments_initialized)
    buffers = _buffers(engine)
    roles = {role: {"placement": dataclasses.asdict(tier.placement(key)), "nbytes": tier.nbytes(key),
                    "crc32": key_crc(tier, key, buffers)} for role, key in keys.items()}
    directories = [swap.directory for swap in tier.swap.files]
    files = tier.seal(label(save_id))
    engine.damaged = (f"its swap files were sealed as a checkpoint in place (id {save_id}); build a new model "
                      "with infinity.Init(config, resume=<the checkpoint directory>) to go on training")
    return {"label": label(save_id), "directories": directories, "files": files, "roles": roles}


def unseal_rank(engine) -> None:
    """Undo ``seal_rank`` after a failed save: the files are this run's swap files again."""
    tier = engine.tiers.nvme_tier
    if tier is not None and tier.sealed is not None:
        tier.seal(None)
        engine.damaged = None


def exceptions_bytes(store) -> bytes | None:
    """The split masters' exceptions (host memory), for the rank's checkpoint files; None without split masters."""
    if store.split is None:
        return None
    raw = _io.BytesIO()
    torch.save(store.split.exceptions.state(), raw)
    return raw.getvalue()


def _sealed_runs(record: dict, files: list[str]):
    """``(file, offset, nbytes)`` of a state's bytes in the sealed files, in key order ([Note: placement and
    striping] in tiers/swapspace.py)."""
    p = record["placement"]
    names = [files[i] for i in p["files"]]
    if len(names) == 1:
        yield names[0], p["offsets"][0], record["nbytes"]
        return
    stripe, ways, position = p["stripe_nbytes"], len(names), 0
    while position < record["nbytes"]:
        chunk = position // stripe
        length = min(stripe, record["nbytes"] - position)
        yield names[chunk % ways], p["offsets"][chunk % ways] + (chunk // ways) * stripe, length
        position += length


def _open_sealed(saved: SavedCheckpoint, rank: int, swap: dict, name: str) -> int:
    """Open a sealed swap file the manifest names, for reading: only a file this checkpoint sealed (named
    ``<tier>.<label>.sealed``, in one of the rank's swap directories ``rank<N>``, not through a symlink, a
    regular file starting with a swap header). A manifest is anyone's to edit: without this, verifying a
    checkpoint in place read any file the process could and said its CRC-32."""
    where = f"checkpoint in place {saved.directory}: rank {rank}'s sealed swap file {name[:200]!r}"
    if not (os.path.isabs(name) and os.path.dirname(name) in swap["directories"]
            and re.fullmatch(r"rank[0-9]{1,7}", os.path.basename(os.path.dirname(name)))
            and re.fullmatch(r"[A-Za-z0-9_-]{1,64}\." + re.escape(label(saved.manifest["id"])) + r"\.sealed",
                             os.path.basename(name))):
        raise CheckpointCorruptError(f"{where} is not a file this checkpoint sealed (<tier>.{label('<id>')}.sealed "
                                     "in one of its swap directories); nothing is read there")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where} is missing (deleted, or consumed by a run that resumed from it and "
                                     "trained)") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{where} cannot be opened ({exc.strerror}; a symbolic link is not "
                                     "followed)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or not has_swap_header(fd):
        os.close(fd)
        raise CheckpointCorruptError(f"{where} is not a swap file (no swap header); nothing is read from it")
    return fd


def verify_sealed(saved: SavedCheckpoint, rank: int, chunk: int = 8 << 20) -> int:
    """Check every state in rank ``rank``'s sealed files against its CRC-32, without a model; returns the
    bytes checked (raises ``CheckpointCorruptError`` naming the state and the file)."""
    swap = saved.rank_manifest(rank)["swap"]
    total = 0
    for role, record in swap["roles"].items():
        crc = 0
        for name, offset, nbytes in _sealed_runs(record, swap["files"]):
            fd = _open_sealed(saved, rank, swap, name)
            try:
                for start in range(0, nbytes, chunk):
                    data = os.pread(fd, min(chunk, nbytes - start), offset + start)
                    if len(data) != min(chunk, nbytes - start):
                        raise CheckpointCorruptError(f"checkpoint in place {saved.directory}: {name} ends before "
                                                     f"the bytes of {role} (truncated)")
                    crc = zlib.crc32(data, crc)
            finally:
                os.close(fd)
        if crc != record["crc32"]:      # (the CRC found is not said: it would describe bytes of any file)
            raise CheckpointCorruptError(f"checkpoint in place {saved.directory}: the bytes of {role} in rank "
                                         f"{rank}'s sealed swap files changed since the save (they fail the CRC-32 "
                                         "the manifest records)")
        total += record["nbytes"]
    return total


class Resume:
    """A checkpoint in place opened for ``infinity.Init(config, resume=path)``: which sealed files each rank
    adopts, and where each state key lies in them."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.saved = SavedCheckpoint(path)
        if not self.saved.manifest.get("in_place"):
            raise CheckpointError(f"infinity.Init(resume={self.path!r}): {self.saved.directory} is an ordinary "
                                  "checkpoint (its states are in its own files); build the model without resume= "
                                  "and call infinity.load_checkpoint")
        self.id = self.saved.manifest["id"]
        self.rank = None

    def resolve_auto(self, config):
        """``config`` with its "auto" tiers as the save ran them ([Note: auto placement] in
        infinity/plan/placement.py): a checkpoint in place holds every state on NVMe, where it lies, so that is
        the one placement that resumes it. Decided from the manifest, alike on every rank (no collective): a
        placement searched again (the machine's room and rates measured anew, the sealed files counted as used
        disk) would choose others, which the resume must refuse."""
        tiers = config.tiers
        if "auto" not in (tiers.params, tiers.optimizer):
            return config
        saved = self.saved.manifest["config"]["tiers"]
        chosen = {key: saved[key] for key in ("params", "optimizer") if getattr(tiers, key) == "auto"}
        if "optimizer" in chosen:
            chosen.update(optimizer_device_share=0.0, optimizer_host_share=0.0)
        import logging

        logging.getLogger("infinity").info(
            "infinity.Init(resume=%r): tiers \"auto\" resumes the checkpoint in place as it was saved: %s", self.path,
            ", ".join(f"tiers.{key} = {value!r}" for key, value in chosen.items()))
        return dataclasses.replace(config, tiers=dataclasses.replace(tiers, **chosen))

    def files(self, config, rank: int, world_size: int, process_rank: int | None = None) -> list[str]:
        """The sealed files rank ``rank`` adopts, after checking that this run can take them over.

        ``process_rank``: the rank in the whole job, which names the swap directories (default ``rank``)."""
        where = f"infinity.Init(resume={self.path!r})"
        if world_size != self.saved.world_size:
            raise CheckpointMismatchError(f"{where}: the checkpoint was saved in place by {self.saved.world_size} "
                                          f"ranks and this run has {world_size}; a checkpoint in place resumes with "
                                          "the same world size")
        saved_config, now = self.saved.manifest["config"], config.to_dict()
        for section, key in _LAYOUT_KEYS:
            if saved_config.get(section, {}).get(key) != now.get(section, {}).get(key):
                raise CheckpointMismatchError(
                    f"{where}: config {section}.{key} is {now.get(section, {}).get(key)!r} and the checkpoint was "
                    f"saved with {saved_config.get(section, {}).get(key)!r}; the swap files are reused where they "
                    "lie, so it must be the same")
        for key in ("optimizer_device_share", "optimizer_host_share"):
            if now.get("tiers", {}).get(key):   # saved in place only with every state on NVMe: no shares
                raise CheckpointMismatchError(
                    f"{where}: config tiers.{key} is {now['tiers'][key]!r}, and a checkpoint in place holds every "
                    "optimizer state on NVMe, where the save left it; resume with both shares 0 (a later ordinary "
                    "checkpoint can move to a split run)")
        self.rank = rank
        swap = self.saved.rank_manifest(rank)["swap"]
        named = rank if process_rank is None else process_rank
        dirs = [os.path.abspath(os.path.join(p, f"rank{named}")) for p in config.tiers.nvme_path]
        if dirs != swap["directories"]:
            raise CheckpointMismatchError(f"{where}: rank {rank}'s swap directories are {dirs} and the checkpoint's "
                                          f"sealed files are in {swap['directories']}; give the same tiers.nvme_path")
        return list(swap["files"])

    def adopted_nbytes(self) -> int:
        """Disk the sealed files of this rank hold now (their blocks are reused, not added)."""
        files = self.saved.rank_manifest(self.rank)["swap"]["files"]
        return sum(os.stat(f).st_blocks * 512 for f in files if os.path.exists(f))

    def settle(self, engine, store) -> None:
        """Give the state keys of the model just built their places in the adopted files (``NVMeTier.settle``);
        the model refuses to train until ``load_checkpoint`` has run."""
        roles = self.saved.rank_manifest(self.rank)["swap"]["roles"]
        # Sub-groups the saving run had woken (a group unfrozen after Init): their moments are adopted too.
        store.wake((int(r.split(":")[1]) for r in roles if r.startswith("exp_avg:")), zero=False)
        # Dormant sub-groups whose remainders the saving run held nonzero (its masters not bf16 values).
        for sub in (int(r.split(":")[1]) for r in roles if r.startswith("remainder:")):
            if store.split is not None and sub < len(store.split.keys) and store.split.keys[sub] == ZERO:
                store.split.adopt(sub)
        keys = state_keys(engine.coordinator, store, bool(self.saved.manifest.get("moments_initialized")))
        missing, unknown = sorted(set(roles) - set(keys)), sorted(set(keys) - set(roles))
        if missing or unknown:
            why = "another model, or another grouping of it"
            if unknown and all(r.startswith(("exp_avg", "remainder")) for r in unknown):
                why = ("groups trainable at this model's Init exit were frozen, and never unfrozen, in the saving "
                       "run: freeze the same parameters inside infinity.Init, or resume from an ordinary checkpoint")
            raise CheckpointMismatchError(
                f"infinity.Init(resume={self.path!r}): rank {self.rank}: the model built does not have the "
                f"checkpoint's states: in the checkpoint only: {missing[:6]}{' ...' if len(missing) > 6 else ''}; in the model only: "
                f"{unknown[:6]}{' ...' if len(unknown) > 6 else ''} ({why})")
        try:
            store.tier.settle({keys[r]: Placement(**{k: tuple(v) if isinstance(v, list) else v
                                                     for k, v in roles[r]["placement"].items()}) for r in roles})
        except ValueError as exc:
            raise CheckpointMismatchError(f"infinity.Init(resume={self.path!r}): {exc}") from exc
        engine.damaged = (f"it was built from the checkpoint in place {self.path} and its step counts, buffers "
                          f"and RNG states are not restored yet; call infinity.load_checkpoint({self.path!r}, model, "
                          "opt) first")

    def verify(self, engine) -> None:
        """Check every adopted state key against its CRC-32 (raises ``CheckpointCorruptError`` naming the file)."""
        roles = self.saved.rank_manifest(self.rank)["swap"]["roles"]
        keys = state_keys(engine.coordinator, engine.store, bool(self.saved.manifest.get("moments_initialized")))
        tier, buffers = engine.store.tier, _buffers(engine)
        for role, record in roles.items():
            crc = key_crc(tier, keys[role], buffers)
            if crc != record["crc32"]:
                files = sorted({self.saved.rank_manifest(self.rank)["swap"]["files"][i]
                                for i in record["placement"]["files"]})
                raise CheckpointCorruptError(
                    f"checkpoint in place {self.saved.directory}: the bytes of {role} in {', '.join(files)} changed "
                    f"since the save (CRC-32 {crc:#010x}, saved {record['crc32']:#010x}); the swap file was written "
                    "to or damaged. Nothing was loaded")
