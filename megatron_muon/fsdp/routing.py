"""Which optimizer takes which Megatron-FSDP optimizer param: tags, routing, param groups.

Routing is megatron-core 0.19.2's for Muon (its ``_get_megatron_emerging_optimizer``): Muon takes
every 2-D param except embeddings and the output layer (hidden linears, experts and the MoE router
included); the scalar optimizer (``muon_scalar_optimizer``: AdamW or Lion) takes embeddings (the
word *and* the learned absolute position embedding, which stock megatron-core sends to Muon
because it carries no ``is_embedding_or_output_parameter`` tag), the output layer, biases, norms,
every non-2-D param and params with ``use_muon=False``. A ``config_overrides`` entry with an
``"optimizer"`` key routes the params it matches explicitly. Another matrix optimizer (Lion:
megatron-core routes ``--optimizer lion`` as Muon, the rest to Adam) takes Muon's place
(``route_params(matrix_name=...)``).

Experts are params of an expert layer (name contains ``experts``, not ``shared``; the rule by
which megatron-core tags ``expert_tp``) or expert-parallel params (``allreduce=False``); their Muon
rows are sharded over another group (``expt_dp``), so their param groups are kept apart.

Megatron-FSDP's optimizer params are DTensors whose raw module param is ``p.orig_param``: the tags
megatron-core sets on model params (``allreduce``, ``expert_tp``, ``is_qkv``,
``qkv_split_shapes``) live there, not on the optimizer param; ``partition_dim``,
``tensor_model_parallel`` and ``is_embedding_or_output_parameter`` are copied onto it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey
from megatron.core.optimizer_param_scheduler import combine_param_group_overrides
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig
from torch.distributed.tensor import DTensor

__all__ = [
    "RoutedParam",
    "RoutingDifference",
    "Routing",
    "route_params",
    "param_groups_by_optimizer",
    "split_groups",
    "is_expert",
    "is_qkv",
]

_EMBEDDING_MODULES = (torch.nn.Embedding, VocabParallelEmbedding)


@dataclass(frozen=True, slots=True)
class RoutedParam:
    """Where one param went: ``optimizer`` is the matrix optimizer's name ("muon", "lion") or
    the scalar optimizer's."""

    name: str
    optimizer: str
    is_expert: bool
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RoutingDifference:
    """A param routed otherwise than megatron-core's own emerging optimizer routes it (its
    default overrides: the scalar optimizer takes params tagged ``is_embedding_or_output_parameter``
    and params that are not 2-D, the matrix optimizer the rest): ``ours`` and ``stock`` are the
    optimizers' names, ``reason`` why ours differs."""

    name: str
    ours: str
    stock: str
    reason: str

    def log_line(self) -> str:
        """The line the factory prints once at build time (rank 0)."""
        return (
            f"megatron-muon routing: {self.name} -> {self.ours} (megatron-core's own optimizer: "
            f"{self.stock}): {self.reason}; see docs/exactness.md"
        )


@dataclass(frozen=True, slots=True)
class Routing:
    """The routing of every optimizer param of the model chunks.

    Attributes:
        params: where each trainable param went, in ``named_parameters()`` order.
        overrides: the ``config_overrides`` for megatron-core's ``_get_param_groups``: the user's
            (or megatron-core's standard ones) plus one that sends the scalar params to the
            scalar optimizer (``{"optimizer": scalar_name}``).
        qkv_split_shapes: ``[q, kv, kv]`` rows per query group of the tagged ``linear_qkv``
            weights, or None when none is tagged.
        matrix_optimizer, scalar_optimizer: the names of the two targets (``"muon"`` and
            ``muon_scalar_optimizer``; ``"lion"`` and ``"adam"``).
        differences: the params routed otherwise than megatron-core routes them, in ``params``
            order.
    """

    params: list[RoutedParam]
    overrides: dict[ParamKey, Any]
    qkv_split_shapes: list[int] | None
    matrix_optimizer: str = "muon"
    scalar_optimizer: str = "adam"
    differences: list[RoutingDifference] = field(default_factory=list)


def route_params(
    chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    config_overrides: dict[ParamKey, Any] | None,
    scalar_name: str,
    matrix_name: str = "muon",
) -> Routing:
    """Tags the chunks' optimizer params and routes each to Muon (or ``matrix_name``'s optimizer,
    by the same rule) or the scalar optimizer.

    Raises:
        ValueError: a trainable param that is not a DTensor (the optimizer was built after a
            forward swapped the compute weights in), or a Muon param that is not a matrix.
    """
    named = _named_optimizer_params(chunks)
    qkv_split_shapes = _tag_params(chunks, named)
    user_overrides = (
        get_standard_config_overrides(config) if config_overrides is None else config_overrides
    )
    route = _router(user_overrides, chunks, scalar_name, matrix_name)
    overrides = dict(user_overrides)
    overrides[ParamKey(with_name_predicate=_routing_predicate(route, scalar_name))] = {
        "optimizer": scalar_name
    }
    routing = [RoutedParam(name, route(p, name), is_expert(p), tuple(p.shape)) for name, p in named]
    if matrix_name == "muon":
        _check_muon_params(routing)
    differences = []  # one optimizer for all (SGD): no routing to differ
    if matrix_name != scalar_name:
        differences = _routing_differences(chunks, named, user_overrides, scalar_name, matrix_name)
    return Routing(routing, overrides, qkv_split_shapes, matrix_name, scalar_name, differences)


def _named_optimizer_params(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"param {name} is a plain tensor, not a Megatron-FSDP optimizer param "
                    "(DTensor): build the optimizer right after wrapping the model, before a "
                    "forward pass swaps the compute weights in"
                )
            named.append((name, param))
    return named


def _check_muon_params(routing: list[RoutedParam]) -> None:
    for entry in routing:
        if entry.optimizer != "muon":
            continue
        if len(entry.shape) == 2 or (len(entry.shape) == 3 and entry.is_expert):
            continue
        raise ValueError(
            f"param {entry.name} of shape {entry.shape} is routed to Muon, which orthogonalizes "
            "matrices (2-D, or 3-D stacks of expert matrices): route it to the scalar optimizer"
        )


# --------------------------------------------------------------------------------------------------
# tags
# --------------------------------------------------------------------------------------------------


def _orig(param: torch.Tensor) -> torch.Tensor:
    """The raw module param behind a Megatron-FSDP optimizer param (attributes live there)."""
    orig = getattr(param, "orig_param", None)
    return param if orig is None else orig


def _attr(param: torch.Tensor, name: str, default: Any = None) -> Any:
    """``name`` from the optimizer param, else from its raw param (module docstring)."""
    value = getattr(param, name, None)
    return value if value is not None else getattr(_orig(param), name, default)


def is_expert(param: torch.Tensor) -> bool:
    """An expert-layer param (``expert_tp`` tag) or an expert-parallel one (``allreduce=False``)."""
    return bool(getattr(param, "expert_tp", False)) or not _attr(param, "allreduce", True)


def is_qkv(param: torch.Tensor) -> bool:
    """Megatron-core's QKV tag, on the optimizer param or its raw param."""
    return bool(_attr(param, "is_qkv", False))


def _tag(param: torch.Tensor, **tags: Any) -> None:
    """Sets megatron-core's param tags: plain attributes on the tensor, as megatron-core sets them
    (torch's type stubs declare no such attributes, hence ``setattr``)."""
    for name, value in tags.items():
        setattr(param, name, value)


def _transformer_config(chunk: torch.nn.Module) -> TransformerConfig | None:
    module: Any = chunk
    while module is not None:
        config = getattr(module, "config", None)
        if isinstance(config, TransformerConfig):
            return config
        module = getattr(module, "module", None)
    return None


def _tag_params(
    chunks: list[torch.nn.Module], named: list[tuple[str, torch.Tensor]]
) -> list[int] | None:
    """Tags the optimizer params as megatron-core tags model params for Muon. Returns QKV split.

    - ``allreduce`` copied from the raw param (as megatron-core's ``copy_optimizer_param_metadata``
      does for its main params): expert-parallel grouping and TP-duplicate filtering read it;
    - ``expert_tp`` on params of expert layers (name contains ``experts``, not ``shared``);
    - ``is_qkv`` and ``qkv_split_shapes`` on 2-D ``linear_qkv.weight`` whose rows divide evenly.
    """
    shapes: list[int] | None = None
    owner = {id(p): chunk for chunk in chunks for p in chunk.parameters()}
    for name, param in named:
        orig = _orig(param)
        if orig is not param and hasattr(orig, "allreduce") and not hasattr(param, "allreduce"):
            _tag(param, allreduce=orig.allreduce)
        if "experts" in name and "shared" not in name:
            _tag(param, expert_tp=True)
        if "linear_qkv.weight" in name and param.ndim == 2:
            config = _transformer_config(owner[id(param)])
            if config is None:
                continue
            split = _get_qkv_split_shapes(config)
            if param.shape[0] % sum(split) == 0:
                _tag(param, is_qkv=True, qkv_split_shapes=split)
                shapes = shapes or split
    return shapes


# --------------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------------


def _router(
    user_overrides: dict[ParamKey, Any],
    chunks: list[torch.nn.Module],
    scalar_name: str,
    matrix_name: str,
) -> Callable[[torch.Tensor, str], str]:
    """``route(param, name) -> matrix_name | scalar_name`` (or a ``config_overrides`` choice)."""
    embeddings = _embedding_param_ids(chunks)

    def route(param: torch.Tensor, name: str) -> str:
        explicit = _explicit_optimizer(user_overrides, param, name)
        if explicit is not None:
            return explicit
        return scalar_name if _scalar_reason(param, embeddings) else matrix_name

    return route


def _embedding_param_ids(chunks: list[torch.nn.Module]) -> set[int]:
    return {
        id(p)
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(module, _EMBEDDING_MODULES)
        for p in module.parameters()
    }


def _explicit_optimizer(
    user_overrides: dict[ParamKey, Any], param: torch.Tensor, name: str
) -> str | None:
    """The optimizer a ``config_overrides`` entry names for the param, if any."""
    matching = [o for key, o in user_overrides.items() if key.matches(param, name)]
    return combine_param_group_overrides(matching).get("optimizer") if matching else None


# Why the scalar optimizer takes a param, first match: megatron-core's own emerging-optimizer
# routing has the first two rules only (its default overrides), ours all of them.
_STOCK_REASONS = ("tagged is_embedding_or_output_parameter", "not 2-D")


def _scalar_reason(param: torch.Tensor, embeddings: set[int]) -> str | None:
    """Why the scalar optimizer takes ``param`` by our rules (None: the matrix optimizer does)."""
    if _attr(param, "is_embedding_or_output_parameter", False):
        return _STOCK_REASONS[0]
    if param.ndim != 2:
        return _STOCK_REASONS[1]
    if id(param) in embeddings:
        return (
            "an embedding without megatron-core's is_embedding_or_output_parameter tag, "
            "as the learned absolute position embedding is"
        )
    if _attr(param, "is_embedding_parameter", False):
        return "tagged is_embedding_parameter"
    if _attr(param, "use_muon", True) is False:
        return "tagged use_muon=False"
    return None


def _routing_differences(
    chunks: list[torch.nn.Module],
    named: list[tuple[str, torch.Tensor]],
    user_overrides: dict[ParamKey, Any],
    scalar_name: str,
    matrix_name: str,
) -> list[RoutingDifference]:
    """The params our rules give the scalar optimizer where megatron-core's give them the matrix
    optimizer (a ``config_overrides`` choice routes both alike)."""
    embeddings = _embedding_param_ids(chunks)
    differences = []
    for name, param in named:
        reason = _scalar_reason(param, embeddings)
        explicit = _explicit_optimizer(user_overrides, param, name)
        if explicit is None and reason is not None and reason not in _STOCK_REASONS:
            differences.append(RoutingDifference(name, scalar_name, matrix_name, reason))
    return differences


def _routing_predicate(route: Callable[[torch.Tensor, str], str], scalar_name: str) -> Any:
    from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

    def to_scalar(param: torch.Tensor, name: str) -> bool:
        # Only where no user override picks the optimizer (else the two would conflict).
        return route(param, name) == scalar_name

    return ParamWithNamePredicate(name="megatron_muon_scalar_params", fn=to_scalar)


def param_groups_by_optimizer(
    chunks: list[torch.nn.Module], config: OptimizerConfig, routing: Routing
) -> dict[tuple[str, bool], list[dict]]:
    """megatron-core's param groups for ``routing``, by (optimizer, is_expert), lr and decay set.

    Raises:
        ValueError: ``config_overrides`` route params to an optimizer megatron-muon does not build.
    """
    param_groups = _get_param_groups(chunks, config, routing.overrides)
    _set_initial_lr_and_weight_decay(param_groups, config)
    return split_groups(param_groups, routing.scalar_optimizer, routing.matrix_optimizer)


def _set_initial_lr_and_weight_decay(param_groups: list[dict], config: OptimizerConfig) -> None:
    """What ``OptimizerParamScheduler`` sets at a constant schedule: ``lr = max_lr``,
    ``weight_decay = config.weight_decay * wd_mult``, so a loop without a scheduler also
    leaves biases and norms undecayed. A scheduler overwrites both every step."""
    for group in param_groups:
        group["lr"] = group.get("max_lr") if group.get("max_lr") is not None else config.lr
        group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)


def split_groups(
    param_groups: list[dict], scalar_name: str, matrix_name: str = "muon"
) -> dict[tuple[str, bool], list[dict]]:
    """Param groups by (optimizer, is_expert); a group mixing experts and dense params is split."""
    by_target: dict[tuple[str, bool], list[dict]] = {}
    for group in param_groups:
        target = group.get("optimizer", matrix_name)
        if target not in (matrix_name, scalar_name):
            raise ValueError(
                f"config_overrides route params to optimizer {target!r}; megatron-muon builds "
                f"{matrix_name!r} and the scalar optimizer {scalar_name!r}"
            )
        parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for param in group["params"]:
            parts[is_expert(param)].append(param)
        for expert, params in parts.items():
            # Empty groups are kept where _get_param_groups made them (rank-symmetric groups).
            if params or not any(parts.values()):
                by_target.setdefault((target, expert), []).append(group | {"params": params})
    return by_target
