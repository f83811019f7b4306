"""Megatron-LM's ``fsdp_dtensor`` checkpoints under Muon: a failed save stops every rank with one
error, a damaged checkpoint is refused before it loads.

Applied by ``megatron_lm.install()`` to ``save_checkpoint`` and ``load_checkpoint`` as
``megatron.training.training`` imported them, for ``--optimizer muon --use-megatron-fsdp
--ckpt-format fsdp_dtensor`` only (``guarded``); every other run reaches the originals unchanged.
What stock megatron-core 0.19.2 does was measured with ``examples/pretrain_gpt_megatron.py`` and
``install()`` on 2 CPU ranks (Muon on Megatron-FSDP, optim_grads_params); docs/reliability.md has
the table.

1. **A save on a full disk.** A rank's write fails (``ENOSPC``, ``EDQUOT``, ``EFBIG``); DCP's
   collective write raises a ``CheckpointException`` on every rank, a traceback per failing rank
   ending in "OSError: [Errno 27] File too large", which names no path, and leaves
   ``iter_XXXXXXX`` half-written (no ``.metadata``); the tracker
   (``latest_checkpointed_iteration.txt``) still names the previous checkpoint. Now every rank
   raises one ``CheckpointError`` naming the directory, each failing rank's cause and the
   checkpoint the tracker still names, after rank 0 removed the half-written directory (it frees
   the space and no ``--ckpt-step`` can take it; kept if the tracker names it). Rank 0 creates the
   directory before Megatron's save, every rank agreeing (Megatron's ``makedirs`` runs on rank 0
   alone: had it failed there, the other ranks would wait in DCP's collectives).
2. **What was saved, recorded.** Once Megatron's save returned on every rank (the tracker is
   written by then), each rank hashes its share of the files and rank 0 writes
   ``megatron_muon_files.json`` beside them (``FILES_NAME``: each file's size and SHA-256, the
   listing of ``checkpointing.files.describe_files``).
3. **Loads verify first.** Before ``--load`` reads anything, every rank checks: the tracker holds
   an iteration (stock Megatron prints "Invalid metadata file" for an empty or damaged tracker and
   calls ``sys.exit()``: status 0, nothing trained); the checkpoint it names exists and has a
   ``.metadata`` that reads; with ``FILES_NAME``, every file has its size and SHA-256
   (``checkpointing.files.verify``); without it (saved without ``install()``, or stopped between
   Megatron's tracker and the listing), every file ``.metadata`` references holds the bytes it
   references (``.metadata`` read by ``checkpointing.safe_unpickle``'s restricted unpickler:
   ``checkpoint_guards.pickles``). Every rank raises the same ``IncompleteCheckpointError`` naming
   the file (``checkpointing.ranks.agree``). Stock: a truncated data file stopped the ranks with a
   bare ``EOFError``, a truncated ``.metadata`` with "pickle data was truncated", neither naming the
   file, and a flipped bit in a data file loaded silently.

Not covered: a failure on one rank outside DCP's collective write (Megatron's own code between
its collectives) still leaves the other ranks waiting, as in stock Megatron. ``--async-save`` is
refused at argument validation (``megatron_lm_arguments``).
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import os
import pickle
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_muon.checkpointing import CheckpointError, IncompleteCheckpointError
from megatron_muon.checkpointing import files as checkpoint_files
from megatron_muon.checkpointing.ranks import agree
from megatron_muon.checkpointing.safe_unpickle import read_metadata
from megatron_muon.integrations.checkpoint_guards.load_directory import checkpoint_directory
from megatron_muon.integrations.checkpoint_guards.pickles import trusts_pickles
from megatron_muon.integrations.megatron_lm_arguments import muon_meets_megatron_fsdp

__all__ = [
    "FILES_NAME",
    "check_checkpoint_files",
    "guarded",
    "saving_whole_or_refused",
    "verifying_files_first",
]

FILES_NAME = "megatron_muon_files.json"
FILES_FORMAT = "megatron_muon.megatron_fsdp_dtensor_files"


def guarded(args: Any) -> bool:
    """The runs whose saves and loads this module guards: Muon on Megatron-FSDP, fsdp_dtensor."""
    return muon_meets_megatron_fsdp(args) and getattr(args, "ckpt_format", None) == "fsdp_dtensor"


def _tracker(save_dir: str) -> str:
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    return str(get_checkpoint_tracker_filename(save_dir))


def _tracker_text(tracker: str) -> str | None:
    try:
        with open(tracker) as handle:
            return handle.read().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------------------------------
# 1, 2. saving
# --------------------------------------------------------------------------------------------------


def saving_whole_or_refused(save_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``save_checkpoint`` with 1 and 2 of the module docstring (guarded runs)."""
    signature = inspect.signature(save_checkpoint)

    @functools.wraps(save_checkpoint)
    def save_checkpoint_whole_or_refused(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args
        from megatron.training.checkpointing import get_checkpoint_name

        megatron = get_args()
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # another wrapper's signature in between: Megatron's keywords hold
            bound = dict(kwargs)
        if (
            not guarded(megatron)
            or bound.get("non_persistent_ckpt")
            or getattr(megatron, "async_save", False)
            or not dist.is_initialized()
        ):
            return save_checkpoint(*args, **kwargs)
        iteration = int(bound.get("iteration", args[0] if args else kwargs["iteration"]))
        directory = str(
            get_checkpoint_name(
                megatron.save, iteration, release=bound.get("release", False), return_base_dir=True
            )
        )
        _create_directory(directory)
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            result = save_checkpoint(*args, **kwargs)
        except CheckpointException as error:  # DCP raised it on every rank: no rank waits
            raise _save_failed(megatron.save, directory, iteration, error) from None
        _record_files(directory, iteration)
        return result

    return save_checkpoint_whole_or_refused


def _create_directory(directory: str) -> None:
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as caught:
            error = CheckpointError(f"cannot create the checkpoint directory {directory}: {caught}")
    agree(error)


def _cause(failure: Any) -> str:
    caught = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(caught, OSError) and caught.errno is not None and caught.errno in errno.errorcode:
        where = f" ({caught.filename})" if caught.filename else ""
        return f"{errno.errorcode[caught.errno]} {caught.strerror}{where}"
    return f"{type(caught).__name__}: {caught}"


def _save_failed(save_dir: str, directory: str, iteration: int, error: Any) -> CheckpointError:
    """Every rank: the one error; rank 0 removes the half-written ``directory``. Collective."""
    causes = "; ".join(
        f"rank {rank}: {_cause(failure)}" for rank, failure in sorted(error.failures.items())
    )
    tracker = _tracker(save_dir)
    named = _tracker_text(tracker)
    keep = named == str(iteration)
    removal = None
    if dist.get_rank() == 0 and not keep:
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass
        except OSError as caught:
            removal = f"; removing it failed ({caught}): delete it by hand"
    removals = agree(None, removal)
    if keep:
        state = f"{tracker} names this iteration: {directory} was written over in place"
    elif named is None:
        state = f"no earlier checkpoint ({tracker} does not exist); {directory} was removed"
    else:
        state = (
            f"{tracker} still names iteration {named}, which this save did not touch; the "
            f"partial {directory} was removed{removals[0] or ''}"
        )
    return CheckpointError(
        f"saving the checkpoint of iteration {iteration} to {directory} failed: {causes}. "
        f"Nothing was published: {state}. Free space on {save_dir} (or pass another --save) "
        f"and resume with --load {save_dir}"
    )


def _record_files(directory: str, iteration: int) -> None:
    """2.: ``FILES_NAME`` in ``directory``, written whole (a temporary file renamed). Collective."""
    listing = checkpoint_files.describe_files(directory)
    error = None
    if dist.get_rank() == 0:
        target = os.path.join(directory, FILES_NAME)
        try:
            with open(target + ".tmp", "w") as handle:
                content = {"format": FILES_FORMAT, "iteration": iteration, "files": listing}
                json.dump(content, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(target + ".tmp", target)
        except OSError as caught:
            error = CheckpointError(
                f"the checkpoint {directory} was saved, but its list of file hashes {target} "
                f"could not be written ({caught}); it loads with sizes checked only. Free space "
                "before the next save"
            )
    agree(error)


# --------------------------------------------------------------------------------------------------
# 3. loading
# --------------------------------------------------------------------------------------------------


def verifying_files_first(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``load_checkpoint`` after ``check_checkpoint_files`` (guarded runs)."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_verified(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        megatron = get_args()
        if guarded(megatron) and getattr(megatron, "load", None) and dist.is_initialized():
            check_checkpoint_files(megatron)
        return load_checkpoint(*args, **kwargs)

    return load_checkpoint_verified


def check_checkpoint_files(args: Any) -> None:
    """3. of the module docstring. Collective (``agree``); every rank raises the same error.

    Raises:
        CheckpointError: the tracker of ``--load`` holds no iteration.
        IncompleteCheckpointError: the checkpoint it names is missing, unfinished or damaged.
    """
    error: BaseException | None = None
    try:
        directory = _directory_to_load(args)
        if directory is not None:
            _check_directory(directory, trusts_pickles(args))
    except Exception as caught:  # noqa: BLE001 - any error on one rank must reach every rank
        error = caught
    agree(error)


def _directory_to_load(args: Any) -> str | None:
    tracker = _tracker(args.load)
    if os.path.isfile(tracker):  # Megatron reads it even with --ckpt-step
        text = _tracker_text(tracker) or ""
        if not (text.isdigit() or text == "release"):
            raise CheckpointError(
                f"--load {args.load}: its tracker {tracker} holds {text!r}, not an iteration (a "
                "save stopped while writing it?); Megatron would exit with status 0 having "
                f"trained nothing. Checkpoints there: {_iteration_directories(args.load)}. Write "
                "the iteration to resume from into the tracker (Megatron reads it even with "
                "--ckpt-step)"
            )
    return checkpoint_directory(args)


def _iteration_directories(load: str) -> list[str]:
    return sorted(name for name in os.listdir(load) if name.startswith("iter_"))


def _check_directory(directory: str, trust_pickles: bool) -> None:
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"checkpoint {directory}, named by --load, does not exist")
    metadata = os.path.join(directory, checkpoint_files.METADATA_NAME)
    if not os.path.isfile(metadata):
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is incomplete: no {checkpoint_files.METADATA_NAME} (its save "
            "did not finish)"
        )
    listing = os.path.join(directory, FILES_NAME)
    if os.path.isfile(listing):
        checkpoint_files.verify(directory, _read_listing(listing), trust_pickles=trust_pickles)
    else:
        _check_referenced_sizes(directory, trust_pickles)


def _read_listing(listing: str) -> dict[str, Any]:
    """``FILES_NAME`` as ``checkpointing.files.verify`` takes it (a hashed, version 2 manifest)."""
    try:
        with open(listing) as handle:
            content = json.load(handle)
        files = content["files"]
        if content["format"] != FILES_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {content['format']}")
    except (OSError, ValueError, KeyError, TypeError) as caught:
        raise IncompleteCheckpointError(f"{listing} is damaged ({caught})") from None
    return {"version": checkpoint_files.FORMAT_VERSION, "files": files}


def _check_referenced_sizes(directory: str, trust_pickles: bool) -> None:
    """Without hashes: ``.metadata`` reads (restricted: ``safe_unpickle``), and each file it
    references holds what it references."""
    try:
        storage = read_metadata(directory, trust_pickles=trust_pickles).storage_data or {}
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError) as caught:
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is damaged: its {checkpoint_files.METADATA_NAME} does not "
            f"read ({type(caught).__name__}: {caught})"
        ) from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise IncompleteCheckpointError(
                f"checkpoint {directory} is incomplete: {name} is missing"
            )
        if os.path.getsize(file) < size:
            raise IncompleteCheckpointError(
                f"checkpoint {directory} is damaged: {name} holds {os.path.getsize(file)} bytes, "
                f"its {checkpoint_files.METADATA_NAME} references {size} (truncated)"
            )
