"""The files a checkpoint may make a load read: regular files inside its directory, read whole.

DCP's ``.metadata`` names, for every stored item, a file (``_StorageInfo.relative_path``), an
offset and a length; DCP's ``FileSystemReader`` joins the path to the checkpoint directory and
reads there. Nothing stops a crafted ``.metadata`` from naming ``../x``, an absolute path
(``/etc/passwd``; ``/dev/zero`` with a length of gigabytes: memory scales with it) or a FIFO (an
``open()`` that blocks: every rank waits before any collective, the job hangs).

``check_storage_references`` refuses each such reference with an ``UnsafeCheckpointError`` naming
the file and the reason, from ``os.stat`` alone (a FIFO or device is never opened): the path
relative, without ``..``, inside the checkpoint directory once symbolic links are resolved, a
regular file; and ``offset + length`` within its size, else ``IncompleteCheckpointError`` naming
the file and both sizes (a truncated file, or a crafted length). ``open_regular`` opens a
checkpoint file that must be a regular file without blocking (``O_NONBLOCK``: a FIFO swapped in
after the check is refused, not waited on).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any, BinaryIO

from megatron_muon.checkpointing.errors import IncompleteCheckpointError, UnsafeCheckpointError

__all__ = ["check_storage_references", "confined_file", "open_regular"]


def _refused(directory: str, name: str, reason: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{os.path.join(directory, str(name))}: refused ({reason}); a checkpoint's metadata may "
        f"reference only regular files inside its directory {directory}, nothing of it was read"
    )


def confined_file(directory: str, name: Any) -> tuple[str, int]:
    """(path, size) of checkpoint file ``name``: relative, inside ``directory`` (symbolic links
    resolved), a regular file. Only ``os.stat``: nothing is opened.

    Raises:
        UnsafeCheckpointError: naming the file and which of these it breaks.
        FileNotFoundError: it does not exist.
    """
    if not isinstance(name, str) or not name:
        raise _refused(directory, repr(name), "not a file name")
    if os.path.isabs(name):
        raise _refused(directory, name, "an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise _refused(directory, name, "a path leaving the checkpoint directory (..)")
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(directory, name))
    if os.path.commonpath([root, path]) != root:
        raise _refused(directory, name, f"a symbolic link to {path}, outside the directory")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise  # as an open() of it would: the caller names a missing file its own way
    except OSError as error:
        raise _refused(directory, name, f"cannot stat it: {error.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise _refused(directory, name, f"not a regular file ({_kind(status.st_mode)})")
    return os.path.join(directory, name), status.st_size


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def check_storage_references(directory: str, storage: Iterable[Any]) -> None:
    """Every ``_StorageInfo`` of ``storage`` (DCP's ``Metadata.storage_data.values()``) references
    bytes inside a confined regular file of ``directory`` (``confined_file``); nothing opened.

    A file that does not exist is left to the reader that opens it (it names it missing).

    Raises:
        UnsafeCheckpointError: naming the first file that is not, and why.
        IncompleteCheckpointError: bytes past a file's end referenced (the file and sizes named).
    """
    sizes: dict[str, int | None] = {}
    ends: dict[str, int] = {}
    for info in storage:
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = confined_file(directory, name)[1]
            except FileNotFoundError:  # nothing to read: each reader reports it missing
                sizes[name] = None
        offset, length = info.offset, info.length
        if not all(isinstance(value, int) and value >= 0 for value in (offset, length)):
            raise _refused(directory, name, f"offset {offset!r} and length {length!r}")
        ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        size = sizes[name]
        if size is not None and end > size:  # a truncated file, or a crafted length
            raise IncompleteCheckpointError(
                f"checkpoint {directory} is damaged: {name} holds {size} bytes, its "
                f".metadata references {end} (truncated)"
            )


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading without blocking on a FIFO (``O_NONBLOCK``), refused unless
    it is a regular file once open (``fstat``).

    Raises:
        UnsafeCheckpointError: ``path`` is a FIFO, a device, a directory, ...
    """
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise _refused(os.path.dirname(path), os.path.basename(path), _kind(mode))
    return os.fdopen(descriptor, "rb")
