"""emerging-optimizers' other orthogonalized optimizers on Megatron-FSDP's row shards.

Beside Muon and AdaptiveMuon, emerging-optimizers 0.3.0 registers six ``OrthogonalizedOptimizer``
subclasses (``common.options.OrthogonalizedOptimizerT``): ``polargrad`` (NS scaled by the nuclear
norm), ``scion`` (NS with unit-RMS scale; weight decay 1), ``mop`` (the polar factor by SVD),
``spel`` (NS; then NS of the updated weight), ``muon_hyperball`` (Muon; update and weight kept on
a sphere) and ``sinkhorn_muon`` (Muon; then a Sinkhorn-Knopp mapping of the updated weight). Each
steps as ``OrthogonalizedOptimizer.step``: weight decay, momentum, ``orthogonalize(p, grad)``,
``pre_weight_update_fn_inplace(p, update)``, ``p -= lr * update``,
``post_weight_update_fn_inplace(p)``.

``ShardedOrthogonalized`` runs that step on data-parallel row shards with ``ShardedMuon``'s
pipeline: weight decay and momentum on each rank's own rows; each matrix's rows to its owner,
which runs the class's OWN ``orthogonalize`` on the whole matrix (``NSMatrix.own_orthogonalize``:
never split over ranks, no QKV split, as the class); the update's rows back. The function is the
one of an instance of the class built with the user's keywords and no params (``reference``): its
constructor checks the keywords and builds its ``scaled_orthogonalize_fn``; no math is copied.

The classes differ in their weight-update hooks, and each adapter (one small subclass each:
``orthogonalized_adapters``) says how its hooks meet the row shards:

- ``polargrad``, ``scion``, ``mop``: no hooks.
- ``spel``, ``sinkhorn_muon`` (``post_update_on_owner``): the post hook is a function of the whole
  updated weight (NS of it; a Sinkhorn mapping with a global max and column sums). After the
  update the weight's rows go through the same pipeline a second time: to the owner, where the
  class's own ``post_weight_update_fn_inplace`` runs on the full matrix, and back.
- ``muon_hyperball``: its hooks scale by Frobenius norms, of the weight before the update (the
  radius), of the update (whole on its owner) and of the updated weight. A weight's norm is the
  root of its rows' fp32 sums of squares summed over ``dp_group`` (``_whole_norms``: one
  all_reduce for all matrices, before NS and after the update; replicated rows counted once).

The constructors' checks of the params need whole weights too: MuonHyperball's (no zero-norm
weight; rescale to ``hyperball_radius``) takes the norms above; SinkhornMuon's (non-negative,
row and column sums within ``doubly_stochastic_tolerance`` of the mapping's targets) sums columns
over ``dp_group``. Both are collective over ``dp_group``, as the plan built with them is.

Refused at build time (``ValueError`` naming it): a param that is not 2-D (as the classes), tensor
parallelism (the classes orthogonalize whole matrices; a TP block is not one), ``MuonFsdpConfig``
settings of Muon's Newton-Schulz (``ns_method``, ``use_syrk``, custom coefficients, Gram
restarts), which these classes do not run, and a class whose step or hooks no adapter handles.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers import registry
from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
from megatron.core.optimizer.emerging_optimizers import _kwargs_from_config
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.engine.layout import local_tensor
from megatron_muon.engine.ns_runner import NSRunner
from megatron_muon.engine.optimizer_plan import OptimizerPlan
from megatron_muon.engine.step_plan import NSMatrix
from megatron_muon.engine.tensor_parallel import tp_group
from megatron_muon.optimizers.muon import ShardedMuon

__all__ = ["ShardedOrthogonalized", "counts_rows"]

# MuonFsdpConfig fields that choose how Muon's Newton-Schulz runs: these classes run their own.
_MUON_NS_FIELDS = ("ns_method", "custom_coefficient_sets", "gram_restarts", "use_syrk")
_HOOKS = ("pre_weight_update_fn_inplace", "post_weight_update_fn_inplace")


class ShardedOrthogonalized(ShardedMuon):
    """An emerging-optimizers ``OrthogonalizedOptimizer`` on row-sharded params (module docstring).

    Args:
        params: 2-D params (or param groups): row-sharded DTensors (``Shard(0)``) or replicated
            params on ``dp_group``, as ``ShardedMuon``'s.
        fsdp: ``ShardedMuon``'s owner/gather mode, buckets and overlap (default
            ``MuonFsdpConfig()``); its Muon-NS fields must keep their defaults.
        dp_group, pg_collection: ``ShardedMuon``'s (``pg_collection``: a TP group of one rank).
        **keywords: the class's own constructor keywords (``lr``, ``momentum``, ``weight_decay``,
            ``fp32_matmul_prec``, ``num_ns_steps``, ...), checked by the class.

    State per param on every rank: ``momentum_buffer`` (like the param), as the class.
    """

    #: The emerging-optimizers registry name of the class whose step this runs.
    name: ClassVar[str]
    #: The class's hooks this adapter runs on shards (any other override is refused).
    handled_hooks: ClassVar[frozenset[str]] = frozenset()
    #: The class's post hook runs on the owner's full updated weight (a second exchange).
    post_update_on_owner: ClassVar[bool] = False
    own_orthogonalize = True

    def __init__(
        self,
        params: ParamsT,
        *,
        fsdp: MuonFsdpConfig | None = None,
        dp_group: dist.ProcessGroup | None = None,
        pg_collection: Any = None,
        **keywords: Any,
    ) -> None:
        optimizer_class = registry.get_optimizer_cls(self.name)
        _check_adapter(type(self), optimizer_class)
        fsdp = fsdp if fsdp is not None else MuonFsdpConfig()
        _check_fsdp_config(optimizer_class.__name__, fsdp)
        # The class's constructor checks the keywords and builds its orthogonalize function.
        self.reference: OrthogonalizedOptimizer = optimizer_class([{"params": []}], **keywords)
        defaults = self.reference.defaults
        muon = MuonConfig(
            momentum=defaults["momentum"],
            nesterov=self.reference.nesterov,
            split_qkv=False,
            fp32_matmul_prec=self.reference.fp32_matmul_prec,
        )
        self._group_of: dict[int, dict] = {}
        super().__init__(
            params,
            lr=defaults["lr"],
            weight_decay=defaults["weight_decay"],
            muon=muon,
            fsdp=fsdp,
            dp_group=dp_group,
            pg_collection=pg_collection,
        )
        self.weight_decay_method = self.reference.weight_decay_method
        self.defaults.update(defaults)
        for group in self.param_groups:
            for key, value in defaults.items():
                group.setdefault(key, value)
        self._check_no_tensor_parallelism()

    @classmethod
    def from_optimizer_config(
        cls, params: ParamsT, config: Any, **kwargs: Any
    ) -> ShardedOrthogonalized:
        """One built with the class's constructor keywords from megatron-core's
        ``OptimizerConfig``, read as megatron-core reads them (``_kwargs_from_config``:
        ``<name>_<arg>``, else ``<arg>``: ``lr``, ``weight_decay``), over the constructors the
        class's ``**kwargs`` reach (MuonHyperball's: Muon's). ``kwargs``: the constructor's
        others (``fsdp``, ``dp_group``, ``pg_collection``).

        megatron-core 0.19.2's default entry adds ``betas`` (for Adam-based optimizers), which
        none of these classes takes (its build raises ``TypeError``): not added here.
        """
        keywords: dict[str, Any] = {}
        for klass in reversed(_constructor_chain(registry.get_optimizer_cls(cls.name))):
            keywords.update(_kwargs_from_config(klass, cls.name, config))
        return cls(params, **kwargs, **keywords)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``ShardedMuon.add_param_group``, refusing params that are not 2-D (the class's rule)."""
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if param.ndim != 2:
                self.param_groups.pop()
                raise ValueError(
                    f"{self.label}: param of shape {tuple(param.shape)} is not a matrix; "
                    f"{type(self.reference).__name__} takes 2-D params only"
                )

    @property
    def label(self) -> str:
        """E.g. ``"Sharded PolarGrad"`` (build summaries, errors)."""
        return f"Sharded {type(self.reference).__name__}"

    def _check_no_tensor_parallelism(self) -> None:
        for param in self._all_params():
            group = tp_group(param, self.pg_collection)
            size = dist.get_world_size(group) if group is not None else 1
            if size > 1:
                raise ValueError(
                    f"{self.label} runs at tensor-parallel size 1 only, got size {size}: "
                    f"{type(self.reference).__name__} orthogonalizes whole matrices, and a TP "
                    "block is not one"
                )

    # ---------------------------------------------------------------------------------------------
    # the hooks of ShardedMuon's step
    # ---------------------------------------------------------------------------------------------

    def _tp_orthogonalize(
        self, param: torch.Tensor, matrix: NSMatrix, full: torch.Tensor
    ) -> torch.Tensor:
        """The class's own ``orthogonalize`` of the whole ``(rows, cols)`` fp32 matrix (owner),
        with the param group's keywords as the class's step passes them. FLOPs counted with
        Muon's NS cost model (the planner's)."""
        group = self._group_of[id(param)]
        self.step_stats.ns_flops += self.ns_config.flops(*full.shape)
        return self.reference.orthogonalize(
            param, full, **{k: v for k, v in group.items() if k != "params"}
        )

    @contextmanager
    def _around_orthogonalization(self, plan: OptimizerPlan, active: list[bool]) -> Iterator[None]:
        """After every update: the class's post hook on the owners' full weights, when it
        needs them (``post_update_on_owner``). Collective over ``dp_group``."""
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        yield
        if self.post_update_on_owner:
            self._post_update_on_owners(plan, active)

    def _post_update_on_owners(self, plan: OptimizerPlan, active: list[bool]) -> None:
        """``post_weight_update_fn_inplace`` of the class on each updated weight, whole, on its
        owner: the rows there and back through the step's exchange (collective over
        ``dp_group``). Rows travel in fp32 and are written back in the param's dtype."""
        params = plan.params

        def post_update(matrix: NSMatrix, full: torch.Tensor) -> torch.Tensor:
            self.reference.post_weight_update_fn_inplace(full)
            return full

        def write_back(matrix_plan: Any, rows: torch.Tensor) -> None:
            local = local_tensor(params[matrix_plan.matrix.param])
            local.copy_(rows.view_as(local))

        plan.runtime.run(
            [active[m.matrix.param] for m in plan.step_plan.matrices],
            prepare=lambda m: local_tensor(params[m.matrix.param]).float(),
            compute=NSRunner(self.ns_config, self.step_stats, post_update),
            finalize=write_back,
            stats=self.step_stats,
        )

    def _whole_norms(self, plan: OptimizerPlan, indices: list[int]) -> torch.Tensor:
        """Frobenius norms (fp32, ``(len(indices),)``) of the whole params ``plan.params[i]``:
        each distinct row interval's sum of squares (by its first holder: replicas once), summed
        over ``dp_group`` in one all_reduce. Collective over ``dp_group``."""
        sums = []
        for i in indices:
            local = local_tensor(plan.params[i]).float()
            sums.append(local.square().sum() if counts_rows(plan, i) else local.new_zeros(()))
        if not sums:
            return torch.zeros(0)
        total = torch.stack(sums)
        self._all_reduce(plan, total)
        return total.sqrt()

    def _all_reduce(
        self, plan: OptimizerPlan, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM
    ) -> None:
        """``tensor`` reduced over ``dp_group`` in place (nothing on one rank)."""
        if plan.runtime.num_ranks > 1:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
            self.step_stats.num_collectives += 1


def counts_rows(plan: OptimizerPlan, index: int) -> bool:
    """Whether this rank counts its rows of ``plan.params[index]`` in a sum over ``dp_group``:
    it holds rows and is the first holder of them (replicated rows are counted once)."""
    rank = plan.runtime.rank
    matrix = plan.step_plan.matrices[index].matrix  # every param is a matrix (add_param_group)
    assert matrix.param == index
    layout = matrix.layout
    return any(holders[0] == rank for _, holders in layout.intervals() if rank in holders)


def _constructor_chain(optimizer_class: type) -> list[type]:
    """The classes whose ``__init__`` a construction of ``optimizer_class`` runs with its
    keywords: itself, then (while an ``__init__`` passes ``**kwargs`` on) the next in its MRO."""
    chain = []
    for klass in optimizer_class.__mro__:
        if "__init__" not in vars(klass):
            continue
        chain.append(klass)
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    return chain


def _check_adapter(adapter: type[ShardedOrthogonalized], optimizer_class: type) -> None:
    """Refuses a class whose step is not ``OrthogonalizedOptimizer``'s, or whose weight-update
    hooks the adapter does not run on shards (a new class, or a new hook upstream)."""
    name = optimizer_class.__name__
    # torch.optim.Optimizer wraps a class's step in a profiling hook: compare what it wraps.
    own = [inspect.unwrap(getattr(optimizer_class, m)) for m in ("step", "_init_group")]
    base = [inspect.unwrap(getattr(OrthogonalizedOptimizer, m)) for m in ("step", "_init_group")]
    if not issubclass(optimizer_class, OrthogonalizedOptimizer) or own != base:
        raise ValueError(
            f"{name} does not step as OrthogonalizedOptimizer (its own step or state): "
            f"{adapter.__name__} cannot run it on row shards"
        )
    for hook in _HOOKS:
        overridden = getattr(optimizer_class, hook) is not getattr(OrthogonalizedOptimizer, hook)
        if overridden and hook not in adapter.handled_hooks:
            raise ValueError(
                f"{name}.{hook} needs the whole weight and {adapter.__name__} does not run it on "
                "row shards"
            )


def _check_fsdp_config(name: str, fsdp: MuonFsdpConfig) -> None:
    defaults = MuonFsdpConfig()
    for f in fields(MuonFsdpConfig):
        if f.name in _MUON_NS_FIELDS and getattr(fsdp, f.name) != getattr(defaults, f.name):
            raise ValueError(
                f"{f.name}={getattr(fsdp, f.name)!r} chooses Muon's Newton-Schulz; {name} runs its "
                "own orthogonalize: leave it at its default"
            )
