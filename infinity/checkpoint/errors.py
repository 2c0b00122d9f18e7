"""What can go wrong with a checkpoint, as typed errors whose messages name the file and what to do."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file, the rank and the cause."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the given path (nothing saved there, or no save finished yet)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated, or fails its checksum; the message names the file."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model it is loaded into (parameter names or shapes differ)."""
