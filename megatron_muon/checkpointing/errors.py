"""What a checkpoint save or load raises; every rank raises the same one (``ranks.agree``)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; nothing was changed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist."""


class IncompleteCheckpointError(CheckpointError):
    """Not a whole checkpoint: no or a damaged marker, a file missing or altered."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """Saved from a different model or optimizer; the message names what differs."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle in the checkpoint names a global outside the allowlist of
    ``checkpointing.safe_unpickle``; nothing of it ran. The message names the file and global."""
