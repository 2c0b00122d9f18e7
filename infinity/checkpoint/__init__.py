"""Sharded, streamed, crash-safe checkpoints, and their consolidation into one state dict.

- ``save_checkpoint(path, model, opt, extra=None, *, keep=1)``: every rank streams its shards
  from their tiers to files (writer.py, stream.py); rank 0 commits (directory.py).
- ``load_checkpoint(path, model, opt) -> extra``: onto any world size, grouping and tier
  layout (reader.py, reshard.py).
- ``verify_checkpoint(path) -> dict``: every checksum, without a model.
- ``consolidate(ckpt, out, dtype=torch.float32, safetensors=False)``: one ordinary state dict
  (consolidate.py; the ``infinity-consolidate`` command).

The on-disk layout is described in [Note: checkpoint layout] (directory.py), the
commit in [Note: commit protocol], the checksums in [Note: checksums] (manifest.py),
memory bounds in [Note: bounded streaming] (stream.py), resharding in
[Note: resharding by parameter] (reshard.py), failed loads in [Note: a load is all or
nothing] (reader.py), concurrent saves in [Note: one saver per directory] (directory.py)
and the errors of a save in [Note: save errors name the bytes] (disk.py).

What the room may touch: the engine's groups, state store and tiers through their public
methods (reads and writes of keys), the ranks' collectives to agree, and its own files; it
changes no training state except on load.
"""
from infinity.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLockedError,
                                        CheckpointMismatchError, CheckpointNotFoundError, CheckpointUntrustedError,
                                        CheckpointWriteError)
from infinity.checkpoint.reader import load_checkpoint, verify_checkpoint
from infinity.checkpoint.writer import save_checkpoint
# Bound here, after its submodule is imported: ``infinity.checkpoint.consolidate`` is then the function
# whatever imports the submodule later (a lazy attribute lost to the submodule once something imported it).
from infinity.checkpoint.consolidate import consolidate  # noqa: E402  (the name, not the module)

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "consolidate", "CheckpointError",
           "CheckpointCorruptError", "CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointWriteError",
           "CheckpointLockedError", "CheckpointUntrustedError"]

