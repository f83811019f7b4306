"""What a checkpoint may unpickle: the one allowlist, and the readers that hold to it.

A checkpoint directory holds pickles: DCP's ``.metadata`` (read by torch 2.14's
``FileSystemReader.read_metadata`` with plain ``pickle.load``) and every non-tensor value DCP
stores whole (``BytesStorageMetadata`` items in the ``.distcp`` files: Megatron's ``args``,
``rng_state``, scheduler and param-group values; our ``common.*`` small objects, which are
``torch.save`` bytes of their own), which ``DefaultLoadPlanner.load_bytes`` reads with
``torch.load(weights_only=False)``. Unpickling runs whatever callable a pickle names, so a
checkpoint from elsewhere (shared storage, a download) could run code when loaded; the SHA-256
listings of each save detect accidents, not an attacker, who rewrites them too.

Here every such pickle is read by a restricted unpickler admitting only ``allowed_globals()``:
what our saves and Megatron-LM's ``fsdp_dtensor`` and ``torch_dist`` saves write (DCP's metadata
and save-plan classes, ``torch.Size``, dtypes, containers, numbers, strings, NumPy's RNG arrays,
``argparse.Namespace`` and megatron-core's enums of Megatron's ``args``). Any other global raises
``UnsafeCheckpointError`` naming the file and the global before that global is looked up.

- ``read_metadata(directory)``: ``.metadata`` by ``metadata_unpickler.MetadataUnpickler`` (builds
  only allowlisted types, sets state only on objects it created), a regular file of the
  directory, every storage reference confined (``confined_files``);
- ``load_item(directory, key)`` / ``load_items(directory, keys)``: values DCP stored whole;
- ``load_pickled(data, where)``: a ``torch.save`` blob, restricted (``torch.load(weights_only=
  True)`` under ``torch.serialization.safe_globals``; enums as callables returning their members,
  so no BUILD reaches a shared member); ``check_saved_file`` for a ``torch.save`` file;
- ``check_pickles(directory)``: every pickle a load of ``directory`` would read, read restricted
  now (callers run it on every rank and ``agree`` before DCP's collectives start);
- ``RestrictedFileSystemReader`` / ``RestrictedLoadPlanner``: DCP's reader and planner reading
  restricted during the load itself (a file swapped after ``check_pickles`` is refused too).

``trust_pickles=True`` (``load_checkpoint``'s keyword; Megatron-LM's ``--ckpt-trust-pickles``)
is the one way around it: for a checkpoint the caller trusts whose ``extra`` holds other types.
"""

from __future__ import annotations

import argparse
import enum
import functools
import hashlib
import io
import os
import pathlib
import pickle
import signal
import types
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from megatron_muon.checkpointing.confined_files import (
    check_storage_references,
    confined_file,
    open_regular,
)
from megatron_muon.checkpointing.errors import UnsafeCheckpointError
from megatron_muon.checkpointing.metadata_unpickler import MetadataUnpickler

__all__ = [
    "METADATA_NAME",
    "RestrictedFileSystemReader",
    "RestrictedLoadPlanner",
    "allowed_globals",
    "check_pickles",
    "check_saved_file",
    "load_item",
    "load_items",
    "load_pickled",
    "read_metadata",
]

METADATA_NAME = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format: our common.* values are such bytes


def _megatron_enums() -> list[type]:
    """megatron-core's enums (Megatron-LM's ``args`` holds some: ``AttnBackend``, ...)."""
    found: list[type] = []
    for module_name in ("megatron.core.enums", "megatron.core.transformer.enums"):
        try:
            module = __import__(module_name, fromlist=["_"])
        except ImportError:  # pragma: no cover - megatron-core is a dependency
            continue
        found.extend(
            v for v in vars(module).values() if isinstance(v, type) and issubclass(v, enum.Enum)
        )
    return found


def _numpy_globals() -> dict[str, Any]:
    """NumPy's RNG state (a uint32 array): ``numpy.random.get_state()`` in our and Megatron's
    RNG states. The reconstructor under its NumPy 2 and NumPy 1 names."""
    try:
        import numpy
    except ImportError:  # pragma: no cover
        return {}
    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(1))[0]
    return {
        "numpy._core.multiarray._reconstruct": reconstruct,
        "numpy.core.multiarray._reconstruct": reconstruct,
        "numpy.ndarray": numpy.ndarray,
        "numpy.dtype": numpy.dtype,
    }


@functools.cache
def allowed_globals() -> dict[str, Any]:
    """Pickle global name (``module.qualname``) -> the object, for every global a checkpoint of
    ``megatron_muon.checkpointing`` or of Megatron-LM's ``fsdp_dtensor`` format holds."""
    allowed: dict[str, Any] = {}
    dcp_types = [
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorProperties,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        # megatron-core's torch_dist saves keep their save plans in the metadata too
        # (``Metadata.mcore_data``): DCP's planner dataclasses and enum, no callables.
        dcp_planner.SavePlan,
        dcp_planner.WriteItem,
        dcp_planner.WriteItemType,
        dcp_planner.TensorWriteData,
        dcp_planner.BytesIOWriteData,
    ]
    plain: list[Any] = [
        *dcp_types,
        torch.Size,
        torch.device,
        torch.serialization._get_layout,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        argparse.Namespace,
        types.SimpleNamespace,
        signal.Signals,
        *_megatron_enums(),
    ]
    for obj in plain:
        allowed[f"{obj.__module__}.{obj.__qualname__}"] = obj
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[str(value)] = value  # pickled as GLOBAL torch <name>
    import collections

    allowed["collections.OrderedDict"] = collections.OrderedDict
    allowed.update(_numpy_globals())
    return allowed


def _refusal(where: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: refused to unpickle {what}: not what a checkpoint holds "
        "(megatron_muon.checkpointing.safe_unpickle.allowed_globals, metadata_unpickler); "
        "nothing outside the allowlist ran. Unpickling a checkpoint from elsewhere can run any "
        "code: if you trust this checkpoint and it holds your own types (in extra), load it "
        "with trust_pickles=True (Megatron-LM: --ckpt-trust-pickles)"
    )


class _AllowlistedUnpickler(pickle.Unpickler):
    """CPython's C unpickler with ``MetadataUnpickler``'s ``find_class``: for bytes that unpickler
    already read whole (``_load_metadata``), the same opcodes on the same objects, faster."""

    def find_class(self, module: str, name: str) -> Any:
        return allowed_globals()[f"{module}.{name}"]


# SHA-256 of the .metadata bytes MetadataUnpickler read whole in this process (a load reads the
# same .metadata several times; the pure-Python unpickler takes about 1 s per MB).
_READ_WHOLE: dict[bytes, None] = {}
_READ_WHOLE_KEPT = 64


def _load_metadata(stream: Any, where: str, trust_pickles: bool) -> Any:
    if trust_pickles:
        return pickle.load(stream)
    data = stream.read()
    digest = hashlib.sha256(data).digest()
    if digest in _READ_WHOLE:  # these exact bytes passed MetadataUnpickler's every rule
        return _AllowlistedUnpickler(io.BytesIO(data)).load()
    refuse = functools.partial(_refusal, where)
    metadata = MetadataUnpickler(io.BytesIO(data), allowed_globals(), refuse).load()
    while len(_READ_WHOLE) >= _READ_WHOLE_KEPT:
        del _READ_WHOLE[next(iter(_READ_WHOLE))]
    _READ_WHOLE[digest] = None
    return metadata


def read_metadata(directory: str, *, trust_pickles: bool = False) -> dcp_metadata.Metadata:
    """DCP's ``Metadata`` of ``directory``, read restricted (``allowed_globals``,
    ``MetadataUnpickler``), every storage reference confined to the directory
    (``confined_files``).

    Raises:
        UnsafeCheckpointError: ``.metadata`` names another global, BUILDs what it did not create,
            is not a regular file of the directory, or references a file outside it, a FIFO, a
            device, or bytes past a file's end (the file and the reason named).
        OSError, pickle.UnpicklingError, EOFError: the file is missing or damaged.
    """
    file, _ = confined_file(directory, METADATA_NAME)
    with open_regular(file) as stream:
        metadata = _load_metadata(stream, file, trust_pickles)
    storage = getattr(metadata, "storage_data", None) or {}
    check_storage_references(directory, storage.values())
    return metadata


class _EnumMember:
    """``cls(value)``, named as enum ``cls`` to torch's ``weights_only`` unpickler: a REDUCE of an
    enum returns its shared member, and that unpickler lets BUILD set state on any instance of an
    allowlisted type; with this callable in the class's place the member's type is not one."""

    def __init__(self, cls: type[enum.Enum]) -> None:
        self._cls = cls

    def __call__(self, *args: Any) -> enum.Enum:
        return self._cls(*args)


@functools.cache
def _weights_only_globals() -> list[Any]:
    """``allowed_globals()`` as ``torch.serialization.safe_globals`` takes them, enums as
    ``_EnumMember``."""
    return [
        (_EnumMember(obj) if isinstance(obj, type) and issubclass(obj, enum.Enum) else obj, name)
        for name, obj in allowed_globals().items()
    ]


def load_pickled(data: bytes, where: str, *, trust_pickles: bool = False) -> Any:
    """What ``torch.save`` wrote into ``data``, read restricted (``allowed_globals``).

    First the pickle's globals are listed without running it
    (``torch.serialization.get_unsafe_globals_in_checkpoint``), then it is read by torch's
    ``weights_only`` unpickler admitting ``allowed_globals()`` besides torch's own.

    Raises:
        UnsafeCheckpointError: the pickle names another global (``where`` and the global named).
    """
    if trust_pickles:
        return torch.load(io.BytesIO(data), weights_only=False)
    with torch.serialization.safe_globals(_weights_only_globals()):
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except ValueError:  # not torch.save's zip format: torch.load below decides
            unsafe = []
        if unsafe:
            raise _refusal(where, f"the global {unsafe[0]}")
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"{where}: refused by torch's weights_only unpickler "
                f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                "nothing of this pickle ran"
            ) from None


def _stored_bytes(directory: str, info: _StorageInfo) -> tuple[str, bytes]:
    file = os.path.join(directory, info.relative_path)
    with open_regular(file) as stream:
        stream.seek(info.offset)
        return file, stream.read(info.length)


def load_item(directory: str, key: str, *, trust_pickles: bool = False) -> Any:
    """The value DCP stored whole under ``key`` in checkpoint ``directory`` (Megatron's
    ``args``, ...), read restricted; ``KeyError`` if there is none (or it is stored
    transformed)."""
    metadata = read_metadata(directory, trust_pickles=trust_pickles)
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn == key and not info.transform_descriptors:
            file, data = _stored_bytes(directory, info)
            return load_pickled(data, f"{file} (item {key})", trust_pickles=trust_pickles)
    raise KeyError(f"{directory} stores no {key}")


def load_items(
    directory: str, keys: list[str], metadata: dcp_metadata.Metadata | None = None
) -> dict[str, Any]:
    """The values DCP stored whole under ``keys`` in checkpoint ``directory``, each read
    restricted (``load_item`` for many keys, the metadata read once: pass it where read already).

    Raises:
        KeyError: a key is not stored whole (or stored transformed).
        UnsafeCheckpointError: a pickle names a global outside ``allowed_globals()``.
    """
    metadata = metadata or read_metadata(directory)
    wanted = set(keys)
    found: dict[str, Any] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in wanted and not info.transform_descriptors and index.fqn not in found:
            file, data = _stored_bytes(directory, info)
            found[index.fqn] = load_pickled(data, f"{file} (item {index.fqn})")
    if missing := sorted(wanted - set(found)):
        raise KeyError(f"{directory} stores no {missing[:5]} ({len(missing)} missing)")
    return found


def _check_value(data: bytes, where: str) -> None:
    """``data`` and, when it unpickles to ``torch.save`` bytes (our ``common.*``), those too."""
    value = load_pickled(data, where)
    if isinstance(value, bytes) and value.startswith(_ZIP_MAGIC):
        load_pickled(value, f"{where} (the object it pickles)")


def check_pickles(directory: str) -> dcp_metadata.Metadata:
    """Reads every pickle a load of DCP checkpoint ``directory`` would read, restricted:
    ``.metadata`` and each value DCP stores whole (a ``BytesStorageMetadata`` item). Items whose
    bytes DCP stored transformed (an extension's compression) are left to the load's own
    restricted planner. Returns the metadata.

    Raises:
        UnsafeCheckpointError: a pickle names a global outside ``allowed_globals()``.
    """
    metadata = read_metadata(directory)
    whole = {
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, dcp_metadata.BytesStorageMetadata)
    }
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda i: i[0].fqn):
        if index.fqn not in whole or info.transform_descriptors:
            continue
        file, data = _stored_bytes(directory, info)
        _check_value(data, f"{file} (item {index.fqn})")
    return metadata


def check_saved_file(directory: str, name: str) -> None:
    """``torch.save`` file ``name`` of checkpoint ``directory`` (megatron-core's ``common.pt``),
    confined (``confined_files``) and read restricted (``load_pickled``).

    Raises:
        UnsafeCheckpointError: the file is not a regular file inside ``directory``, or names a
            global outside ``allowed_globals()``.
    """
    file, _ = confined_file(directory, name)
    with open_regular(file) as stream:
        data = stream.read()
    _check_value(data, file)


# --------------------------------------------------------------------------------------------------
# DCP's reader and planner, restricted during the load itself
# --------------------------------------------------------------------------------------------------

_DCP_LOAD_BYTES = DefaultLoadPlanner.load_bytes


def restricted_read_metadata(reader: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
    """``FileSystemReader.read_metadata`` (torch 2.8 to 2.14) through ``MetadataUnpickler``
    and confining the storage references (no ``super()``: ``megatron_muon.integrations`` sets it
    on the class itself)."""
    directory = str(reader.path)
    rank = kwargs.get("rank")  # torch >= 2.9: per-rank metadata files (``_get_metadata_path``)
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    file, _ = confined_file(directory, name)
    with open_regular(file) as stream:
        metadata = _load_metadata(stream, file, trust_pickles=False)
    check_storage_references(directory, (metadata.storage_data or {}).values())
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def restricted_load_bytes(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` after ``value`` read restricted: DCP's own
    ``torch.load(weights_only=False)`` then reads bytes already read whole by the restricted one
    (in memory: the same bytes)."""
    data = value.getvalue()
    _check_value(data, f"checkpoint item {read_item.dest_index.fqn}")
    _DCP_LOAD_BYTES(planner, read_item, io.BytesIO(data))


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading ``.metadata`` restricted."""

    read_metadata = restricted_read_metadata


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` reading each value stored whole restricted."""

    load_bytes = restricted_load_bytes
