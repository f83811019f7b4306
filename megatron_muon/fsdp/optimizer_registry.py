"""The optimizers megatron-muon runs, one entry per ``--optimizer`` name (``OPTIMIZERS``).

Each entry (``OptimizerEntry``, megatron-core's ``EmergingOptimizerEntry`` is the model) says
what everything else must know of the optimizer, so that no second table grows beside it:

- ``kind``: how it is built (``OptimizerKindT``): ``orthogonalized`` (``ShardedMuon`` and its
  subclasses: whole matrices, Newton-Schulz on owners), ``owner_computed`` (each matrix's state
  and work on one owner rank: SOAP, REKLS, PSGDPro), ``rowwise`` (each rank's rows: LaProp, the
  oblique classes), ``elementwise`` (megatron-core's own class on the row shards as they are:
  Lion; SGD, for every param), ``megatron_core`` (Adam: megatron-core builds it; the factory
  does not);
- ``builder``: its matrices' optimizer over one kind of params (dense or expert;
  ``fsdp.factory`` wraps and chains what it returns), None where megatron-core's class is built;
- ``settings``: the dataclass of its settings beyond Muon's and ``OptimizerConfig``'s;
- ``state_keys``: the per-param state of the params it steps (its matrices; the rest of a run
  holds AdamW's, ``OPTIMIZERS["adam"].state_keys``);
- ``counterparts``: each state key that holds a quantity another optimizer's state also holds
  (``StateCounterpart``: the quantity, and the ``OptimizerConfig`` field of its coefficient):
  what ``integrations.optimizer_switch`` carries at a load that switches optimizer, into all of
  a ``whole_state`` optimizer's tensors or none (Adam: its ``step`` bias-corrects both moments;
  Muon's momentum as ``exp_avg`` beside a fresh ``exp_avg_sq`` would need ``step`` 0 for the
  second moment and the real count for the first, and measured here, the tiny GPT's loss rose
  from 3.62 to 5.0 in three AdamW steps after such a load, with ``step`` 0);
- ``megatron_lm``: ``install()`` offers it as ``--optimizer`` (the others: a custom trainer's
  ``build_muon_optimizer``). A checkpoint tells its optimizer by the ``args.optimizer`` Megatron
  saves in it, else by its state keys (``integrations.checkpoint_guards.optimizer_kind``).

The quantities (read in the code of each class, emerging-optimizers 0.3.0 and torch 2.14):

- ``grad_ema``: an exponential average of the gradients, ``m <- m.lerp_(grad, 1 - beta)``, the
  same arithmetic in torch's Adam/AdamW ``exp_avg`` (``beta = adam_beta1``), emerging-optimizers'
  ``OrthogonalizedOptimizer`` and ``AdaptiveMuon`` ``momentum_buffer`` and ``ShardedMuon``'s
  (``beta = muon_momentum``; Nesterov changes the update, ``grad.lerp(m, beta)``, not the buffer)
  and Lion's ``exp_avg`` (``beta = lion_beta2``; ``lion_beta1`` only mixes the update's sign).
  Given the same gradients, two such buffers are equal bit for bit when their betas are equal;
  with other betas they weigh the same gradients differently.
- ``grad_sq_ema``: Adam's ``exp_avg_sq``, ``v <- v * beta2 + (1 - beta2) * grad**2``.

Not counterparts, though some share a name: adaptive_muon's ``moment2_buffer`` averages the
squared *orthogonalized* update, not the gradient; SGD's ``momentum_buffer`` is a heavy-ball sum
(``momentum * buf + grad``), not an average; SOAP's and REKLS's moments live in their
preconditioner's eigenbasis; LaProp's ``exp_avg`` averages normalized gradients; PSGDPro's
``exp_avg`` and the oblique optimizers' states were not established as the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch

from megatron_muon.common.options import (
    FsdpOptimizerT,
    MegatronOptimizerT,
    OrthogonalizedOptimizerT,
)
from megatron_muon.engine.config import MuonConfig
from megatron_muon.fsdp.muon_optimizers import MatrixBuild, build_orthogonalized
from megatron_muon.fsdp.owner_computed_optimizers import OWNER_COMPUTED, build_owned
from megatron_muon.fsdp.rowwise_optimizers import (
    ROWWISE_OPTIMIZERS,
    ROWWISE_SETTINGS,
    build_rowwise,
)
from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig
from megatron_muon.optimizers.muon import ShardedMuon
from megatron_muon.optimizers.orthogonalized_adapters import SHARDED_ORTHOGONALIZED
from megatron_muon.optimizers.psgd_matrix import PsgdProConfig
from megatron_muon.optimizers.rekls import RekLsConfig
from megatron_muon.optimizers.soap_matrix import SoapConfig

__all__ = [
    "OPTIMIZERS",
    "MatrixBuilder",
    "OptimizerEntry",
    "OptimizerKindT",
    "QuantityT",
    "StateCounterpart",
    "fsdp_optimizer_names",
    "lookup",
    "megatron_lm_optimizer_names",
    "routed_by_install",
]

#: How an optimizer is built (module docstring).
OptimizerKindT = Literal[
    "orthogonalized", "owner_computed", "rowwise", "elementwise", "megatron_core"
]
#: What a state tensor holds where two optimizers hold the same (module docstring).
QuantityT = Literal["grad_ema", "grad_sq_ema"]
#: ``(build, groups, is_expert) -> (the optimizer of those matrices, its summary line)``.
MatrixBuilder = Callable[[MatrixBuild, list[dict], bool], tuple[torch.optim.Optimizer, str]]


@dataclass(frozen=True)
class StateCounterpart:
    """A state key's quantity and the ``OptimizerConfig`` field of its average's coefficient."""

    quantity: QuantityT
    beta: str


@dataclass(frozen=True, kw_only=True)
class OptimizerEntry:
    """One optimizer megatron-muon runs (module docstring)."""

    name: str
    kind: OptimizerKindT
    builder: MatrixBuilder | None
    settings: type | None
    state_keys: tuple[str, ...]
    counterparts: Mapping[str, StateCounterpart] = field(default_factory=dict)
    megatron_lm: bool = True
    #: the optimizer of the params its routing does not give the matrix optimizer, where Muon's
    #: ``muon_scalar_optimizer`` does not say (megatron-core's default emerging-optimizer entry).
    scalar_optimizer: str = "adam"
    #: its state is one whole (Adam: the shared ``step`` bias-corrects both moments): a switch
    #: carries counterparts into it only where every one of its tensors has one.
    whole_state: bool = False
    #: reads Muon's ``muon_*`` fields (``MuonConfig.from_optimizer_config``); other
    #: orthogonalized ones take ``MuonConfig()`` and their own settings.
    reads_muon_flags: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.counterparts) - set(self.state_keys)
        if unknown:
            raise ValueError(f"{self.name}: counterparts of keys it does not hold: {unknown}")
        if (self.builder is None) != (self.kind in ("elementwise", "megatron_core")):
            raise ValueError(f"{self.name}: a builder exactly where megatron-muon builds it")

    def muon_config(self, config: Any) -> MuonConfig | None:
        """Muon's settings for an ``orthogonalized`` optimizer (``OptimizerConfig`` ``config``),
        None for the other kinds."""
        if self.kind != "orthogonalized":
            return None
        return MuonConfig.from_optimizer_config(config) if self.reads_muon_flags else MuonConfig()


def _owned(build: MatrixBuild, groups: list[dict], is_expert: bool) -> Any:
    return build_owned(build.config, groups, is_expert, build.pg_collection, build.fsdp_modules)


def _rowwise(build: MatrixBuild, groups: list[dict], is_expert: bool) -> Any:
    return build_rowwise(build.config, groups, is_expert, build.pg_collection, build.fsdp_modules)


_MUON_MOMENTUM = StateCounterpart("grad_ema", "muon_momentum")
_ADAM = ("step", "exp_avg", "exp_avg_sq")
_OWNER_SETTINGS: dict[str, type] = {
    "soap": SoapConfig,
    "rekls": RekLsConfig,
    "psgd_pro": PsgdProConfig,
}

_ENTRIES = (
    OptimizerEntry(
        name="muon",
        kind="orthogonalized",
        builder=partial(build_orthogonalized, ShardedMuon),
        settings=MuonConfig,
        state_keys=("momentum_buffer",),
        counterparts={"momentum_buffer": _MUON_MOMENTUM},
        reads_muon_flags=True,
    ),
    OptimizerEntry(
        name="adaptive_muon",
        kind="orthogonalized",
        builder=partial(build_orthogonalized, ShardedAdaptiveMuon),
        settings=AdaptiveMuonConfig,
        state_keys=("momentum_buffer", "moment2_buffer"),
        counterparts={"momentum_buffer": _MUON_MOMENTUM},
        reads_muon_flags=True,
    ),
    OptimizerEntry(
        name="lion",
        kind="elementwise",
        builder=None,
        settings=None,
        state_keys=("exp_avg",),
        counterparts={"exp_avg": StateCounterpart("grad_ema", "lion_beta2")},
    ),
    *(
        OptimizerEntry(
            name=name,
            kind="owner_computed",
            builder=_owned,
            settings=_OWNER_SETTINGS[name],
            state_keys=adapter.STATE_KEYS,
        )
        for name, adapter in OWNER_COMPUTED.items()
    ),
    *(
        OptimizerEntry(
            name=name,
            kind="rowwise",
            builder=_rowwise,
            settings=ROWWISE_SETTINGS[name],
            state_keys=cls.state_keys,
        )
        for name, cls in ROWWISE_OPTIMIZERS.items()
    ),
    *(
        OptimizerEntry(
            name=name,
            kind="orthogonalized",
            builder=partial(build_orthogonalized, cls),
            settings=None,  # the class's own, read by its from_optimizer_config
            state_keys=("momentum_buffer",),
            megatron_lm=False,
        )
        for name, cls in SHARDED_ORTHOGONALIZED.items()
    ),
    OptimizerEntry(
        name="adam",
        kind="megatron_core",
        builder=None,
        settings=None,
        state_keys=_ADAM,
        counterparts={
            "exp_avg": StateCounterpart("grad_ema", "adam_beta1"),
            "exp_avg_sq": StateCounterpart("grad_sq_ema", "adam_beta2"),
        },
        whole_state=True,
    ),
    # megatron-core 0.19.2's DistributedOptimizer refuses SGD, and Megatron-FSDP takes no other:
    # megatron-core's own SGD on every param's row shards as they are (elementwise), ours.
    OptimizerEntry(
        name="sgd",
        kind="elementwise",
        builder=None,
        settings=None,
        state_keys=("momentum_buffer",),
        scalar_optimizer="sgd",
    ),
)

#: ``--optimizer`` name -> its entry.
OPTIMIZERS: Mapping[str, OptimizerEntry] = MappingProxyType({e.name: e for e in _ENTRIES})


def fsdp_optimizer_names() -> tuple[str, ...]:
    """The names ``build_muon_optimizer`` builds (every kind but ``megatron_core``), sorted."""
    return tuple(sorted(n for n, e in OPTIMIZERS.items() if e.kind != "megatron_core"))


def routed_by_install(name: str) -> bool:
    """Whether ``install()`` routes ``--optimizer name`` with Megatron-FSDP to
    ``build_muon_optimizer``: an ``install()`` choice megatron-muon builds; False for
    megatron-core's own (Adam), the orthogonalized ones Megatron-LM's flag does not offer (a
    custom trainer builds them) and unknown names."""
    entry = OPTIMIZERS.get(name)
    return entry is not None and entry.megatron_lm and entry.kind != "megatron_core"


def megatron_lm_optimizer_names() -> tuple[str, ...]:
    """The ``--optimizer`` values ``install()`` runs with ``--use-megatron-fsdp``, in order."""
    return tuple(n for n, e in OPTIMIZERS.items() if e.megatron_lm)


def lookup(name: str) -> OptimizerEntry:
    """The entry of ``name``.

    Raises:
        ValueError: no optimizer of that name (the known names listed).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; megatron-muon knows {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


# The Literal aliases (typing, config checks) name the same optimizers as the registry.
_FSDP_NAMES = {*get_args(FsdpOptimizerT), *get_args(OrthogonalizedOptimizerT), "sgd"}
assert set(fsdp_optimizer_names()) == _FSDP_NAMES
assert set(megatron_lm_optimizer_names()) == set(get_args(MegatronOptimizerT))
