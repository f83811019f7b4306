"""A checkpoint whose optimizer state is another optimizer's is refused before it loads.

``--load`` of a Megatron ``fsdp_dtensor`` checkpoint saved with another ``--optimizer`` (a Muon
run's ``momentum_buffer`` into an Adam run, or the reverse): Megatron's partial load then waits in
collectives for state the checkpoint does not hold. ``check_optimizer_state_kinds`` first compares
the optimizer state keys in the checkpoint's DCP metadata with this run's and raises
``CheckpointMismatchError`` on every rank (each reads the same file) before any collective;
``--no-load-optim`` and ``--finetune`` skip the optimizer state and the check. The checkpoint's
optimizer is the ``args.optimizer`` Megatron saved in it (read restricted:
``checkpointing.safe_unpickle``), so that LaProp's or ObliqueAdam's state, whose keys are Adam's,
is told from Adam's; a checkpoint without ``args`` is told by its state keys
(``optimizer_of_state``). With ``--optimizer-switch-at-load`` (or ``load_checkpoint(...,
optimizer_switch_at_load=True)``) another optimizer's checkpoint loads instead, through
``integrations.optimizer_switch`` (what is carried, converted and started fresh).

adaptive_muon's normuon and namo second moments are per tensor-parallel partition
(``optimizers.moment2_partitions``: each partition's row or column statistics, stacked): a
checkpoint of them saved at another ``--tensor-model-parallel-size`` (read from the ``args``
Megatron stores in it) is refused naming both TP sizes (``tensor_parallel_refusal``), where DCP
would stop with a shape mismatch or, where the stacked shapes happen to agree, load statistics of
other partitions.

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

from megatron_muon.checkpointing import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
    leaf_optimizers,
)
from megatron_muon.checkpointing.safe_unpickle import load_item
from megatron_muon.integrations.checkpoint_guards.load_directory import checkpoint_directory
from megatron_muon.integrations.checkpoint_guards.pickles import trusts_pickles
from megatron_muon.integrations.optimizer_switch import SwitchPlan, switched_state

__all__ = [
    "BRIDGE_NAMES",
    "MEGATRON_LM_NAMES",
    "LoadSettingNames",
    "check_optimizer_state_kinds",
    "checking_optimizer_state_first",
    "optimizer_of_state",
    "refuse_another_optimizers_state",
    "state_kinds_refusal",
    "tensor_parallel_refusal",
]

_PER_PARTITION_MOMENT2 = ("normuon", "namo")

_OPTIMIZER_PREFIX = "optimizer.state."


# --------------------------------------------------------------------------------------------------


def _saved_state_kinds(directory: str) -> list[set[str]]:
    """The optimizer state keys (``exp_avg``, ``momentum_buffer``, ...) a DCP checkpoint holds,
    per param (a key ``optimizer.state.<param>.<kind>``)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as error:  # a truncated or altered file: unpickling raises many kinds
        raise IncompleteCheckpointError(
            f"the checkpoint's {os.path.join(directory, '.metadata')} does not read "
            f"({type(error).__name__}: {error}): not a whole checkpoint"
        ) from error
    by_param: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(_OPTIMIZER_PREFIX) and "." in key[len(_OPTIMIZER_PREFIX) :]:
            param, kind = key.rsplit(".", 1)
            by_param.setdefault(param, set()).add(kind)
    return list(by_param.values())


def _run_state_kinds(optimizer: Any) -> list[set[str]]:
    return [set(state) for leaf in leaf_optimizers(optimizer) for state in leaf.state.values()]


def optimizer_of_state(kinds: list[set[str]]) -> str | None:
    """The ``--optimizer`` whose state holds these per-param keys: PSGD's preconditioner factors
    (``Q_0``, ``Q_1``) are psgd_pro's, Kronecker factors (``L``, ``Q_L``, ...) soap's (or
    rekls's: the same state), a second moment next to Muon's momentum adaptive_muon's, Muon's
    momentum alone muon's, a first moment without a second one (``exp_avg`` without
    ``exp_avg_sq``: Lion's, beside AdamW's for the other params) lion's, Adam's two moments alone
    adam's. None: none of these (nothing to name)."""
    union = set().union(*kinds) if kinds else set()
    if {"Q_0", "Q_1"} & union:
        return "psgd_pro"
    if {"L", "R", "Q_L", "Q_R"} & union:
        return "soap"
    if "moment2_buffer" in union:
        return "adaptive_muon"
    if "momentum_buffer" in union:
        return "muon"
    if any("exp_avg" in k and "exp_avg_sq" not in k for k in kinds):
        return "lion"
    if "exp_avg_sq" in union:
        return "adam"
    return None


class LoadSettingNames(NamedTuple):
    """How a refusal names the load's settings: Megatron-LM's flags (``MEGATRON_LM_NAMES``) or
    Megatron-Bridge's config fields (``BRIDGE_NAMES``). ``load`` and ``optimizer`` are format
    strings of the value."""

    load: str
    optimizer: str
    option: str
    weights_alone: str
    switch: str = ""  # how to continue with this run's optimizer instead, where there is a way


MEGATRON_LM_NAMES = LoadSettingNames(
    "--load {}",
    "--optimizer {}",
    "--optimizer",
    "Pass --no-load-optim to load the weights alone",
    ", or --optimizer-switch-at-load to continue with this run's optimizer (docs/checkpoints.md)",
)
BRIDGE_NAMES = LoadSettingNames(
    "checkpoint.load={!r}",
    "optimizer={!r}",
    "optimizer",
    "Set checkpoint.load_optim=False to load the weights alone",
)


def state_kinds_refusal(
    saved: list[set[str]],
    mine: list[set[str]],
    optimizer: str,
    load: str,
    directory: str,
    names: LoadSettingNames = MEGATRON_LM_NAMES,
    *,
    saved_optimizer: str | None = None,
) -> str | None:
    """Why the optimizer state ``saved`` (per param) cannot load into this run's (``mine``,
    ``--optimizer optimizer``): the keys differ, or the state is another optimizer's (Lion's and
    Adam's keys are the same names, held by different params; LaProp's and Adam's too, told
    apart by ``saved_optimizer``, the checkpoint's ``args.optimizer`` where it has one). None: it
    can."""
    if not saved or not mine:
        return None
    saved_union, mine_union = set().union(*saved), set().union(*mine)
    saved_by: str | None
    if saved_optimizer is not None:
        saved_by, same_optimizer = saved_optimizer, saved_optimizer == optimizer
    else:
        saved_by = optimizer_of_state(saved)
        same_optimizer = saved_by == optimizer_of_state(mine)
    if saved_union == mine_union and same_optimizer:
        return None
    by = f" (saved by {names.optimizer.format(saved_by)})" if saved_by is not None else ""
    return (
        f"{names.load.format(load)}: checkpoint {directory}{by} holds optimizer state "
        f"{sorted(saved_union)}, this run's {names.optimizer.format(optimizer)} keeps "
        f"{sorted(mine_union)} (saved by a run with another {names.option}?). "
        f"{names.weights_alone}, or the {names.option} the checkpoint was saved with{names.switch}"
    )


def refuse_another_optimizers_state(
    directory: str,
    optimizer: Any,
    name: str,
    load: str,
    names: LoadSettingNames,
    *,
    saved_optimizer: str | None = None,
) -> list[set[str]]:
    """Raises when DCP checkpoint ``directory``'s optimizer state is not ``optimizer``'s (this
    run's, ``name``) (``state_kinds_refusal``; ``saved_optimizer``: the checkpoint's
    ``args.optimizer``, None where unknown); returns the saved state keys per param.

    Raises:
        IncompleteCheckpointError: the checkpoint's ``.metadata`` does not read (named).
        CheckpointMismatchError: the refusal, naming both optimizers.
    """
    saved = _saved_state_kinds(directory)
    refusal = state_kinds_refusal(
        saved,
        _run_state_kinds(optimizer),
        name,
        load,
        directory,
        names,
        saved_optimizer=saved_optimizer,
    )
    if refusal is not None:
        raise CheckpointMismatchError(refusal)
    return saved


def _saved_args(directory: str, args: Any) -> Any:
    """The ``args`` Megatron saved in the checkpoint (read restricted), or None without them."""
    try:
        return load_item(directory, "args", trust_pickles=trusts_pickles(args))
    except KeyError:
        return None


def check_optimizer_state_kinds(
    args: Any, optimizer: Any, *, switch: bool = False
) -> SwitchPlan | None:
    """Raises when the checkpoint ``--load`` reads holds optimizer state of another kind; with
    ``switch``, returns the plan of the switched load instead (``optimizer_switch``).

    Reads only the checkpoint's DCP metadata and saved ``args`` (every rank the same file: every
    rank decides alike). None: the load goes on as Megatron's.

    Raises:
        IncompleteCheckpointError: the checkpoint's ``.metadata`` does not read (named).
        CheckpointMismatchError: the state keys differ (e.g. ``momentum_buffer`` from a Muon run
            loaded into ``--optimizer adam``), or they are another optimizer's
            (``state_kinds_refusal``); the message names both optimizers. With ``switch``: the
            checkpoint's optimizer is unknown (no ``args`` in it).
    """
    if (
        optimizer is None
        or getattr(args, "no_load_optim", False)
        or getattr(args, "finetune", False)
    ):
        return None
    if getattr(args, "ckpt_format", None) != "fsdp_dtensor":
        return None
    directory = checkpoint_directory(args)
    if directory is None or not os.path.isfile(os.path.join(directory, ".metadata")):
        return None  # Megatron's own load reports a missing checkpoint
    saved = _saved_state_kinds(directory)  # first: a .metadata that does not read is named
    saved_args = _saved_args(directory, args)
    saved_by = getattr(saved_args, "optimizer", None)
    refusal = state_kinds_refusal(
        saved,
        _run_state_kinds(optimizer),
        args.optimizer,
        args.load,
        directory,
        MEGATRON_LM_NAMES,
        saved_optimizer=saved_by,
    )
    if refusal is not None and not switch:
        raise CheckpointMismatchError(refusal)
    if refusal is not None:
        if saved_by is None:
            raise CheckpointMismatchError(
                f"{refusal}. --optimizer-switch-at-load: the checkpoint holds no args saying "
                "which --optimizer saved it"
            )
        keys = _read_metadata_keys(directory, args)
        return SwitchPlan.from_metadata(keys, saved_by, args.optimizer, saved_args, args)
    refusal_text = tensor_parallel_refusal(args, directory, saved)
    if refusal_text is not None:
        raise CheckpointMismatchError(refusal_text)
    return None


def _read_metadata_keys(directory: str, args: Any) -> list[str]:
    from megatron_muon.checkpointing.safe_unpickle import read_metadata

    metadata = read_metadata(directory, trust_pickles=trusts_pickles(args))
    return list(metadata.state_dict_metadata)


def tensor_parallel_refusal(args: Any, directory: str, saved: list[set[str]]) -> str | None:
    """Why checkpoint ``directory``'s adaptive_muon normuon / namo second moments (one per TP
    partition) cannot load at this run's ``--tensor-model-parallel-size``. None: they can, or
    the checkpoint holds none (``saved``: its state keys per param)."""
    if optimizer_of_state(saved) != "adaptive_muon":
        return None
    saved_args = _saved_args(directory, args)
    method = getattr(saved_args, "adaptive_muon_moment2_method", None)
    saved_tp = getattr(saved_args, "tensor_model_parallel_size", None)
    mine = getattr(args, "tensor_model_parallel_size", 1)
    if method not in _PER_PARTITION_MOMENT2 or saved_tp is None or saved_tp == mine:
        return None
    return (
        f"--load {args.load}: checkpoint {directory} holds adaptive_muon {method} second moments "
        f"of --tensor-model-parallel-size {saved_tp} (one per TP partition: each partition's own "
        f"statistics), this run has --tensor-model-parallel-size {mine}: they do not convert. "
        f"Load it at --tensor-model-parallel-size {saved_tp}, or pass --no-load-optim to load "
        "the weights alone"
    )


def checking_optimizer_state_first(load_checkpoint: Any) -> Any:
    """``load_checkpoint`` refusing another optimizer's state (``check_optimizer_state_kinds``),
    or loading it switched where ``--optimizer-switch-at-load`` or the keyword
    ``optimizer_switch_at_load=True`` asks (the keyword wins over the flag)."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_checked(
        model: Any,
        optimizer: Any,
        *args: Any,
        optimizer_switch_at_load: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        from megatron.training import get_args

        megatron = get_args()
        switch = optimizer_switch_at_load
        if switch is None:
            switch = bool(getattr(megatron, "optimizer_switch_at_load", False))
        plan = check_optimizer_state_kinds(megatron, optimizer, switch=switch)
        if plan is None:
            return load_checkpoint(model, optimizer, *args, **kwargs)
        with switched_state(optimizer, plan):
            return load_checkpoint(model, optimizer, *args, **kwargs)

    return load_checkpoint_checked
