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


class CheckpointWriteError(CheckpointError):
    """The operating system refused a write of a save (disk full, quota, file size limit, I/O error).

    The message names the file, the bytes the save wanted and the bytes free on its filesystem;
    ``errno`` is the OS error's. The previous checkpoint at the path stays intact and loadable.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class CheckpointLockedError(CheckpointError):
    """Another save (another job, or another thread of this one) is writing to the same checkpoint directory."""


class CheckpointUntrustedError(CheckpointError):
    """A checkpoint holds something that only unpickling with code could rebuild (its ``extra`` is not plain
    data); loading it would run code the checkpoint chose. Refused unless the caller says it trusts the file."""
