"""Muon (and megatron-muon's other optimizers) on Megatron-FSDP in Megatron-Bridge recipes.

Megatron-Bridge's ``setup_optimizer`` (``megatron/bridge/training/optim.py``) builds the optimizer
through ``optimizer_config.provide(...)`` whenever the config has that method (Bridge's extension
point); otherwise any name containing "muon" goes to megatron-core's
``get_megatron_muon_optimizer``, which with ``use_megatron_fsdp`` trains nothing at DP=1, crashes
in Newton-Schulz on uneven row shards at DP=2 and fails to build for ``dist_muon``.
A recipe sets, in one line::

    cfg.optimizer = MuonFsdpOptimizerConfig.from_config(cfg.optimizer)   # any Bridge config
    # or, in place of Bridge's distributed_muon_with_cosine_annealing(...):
    cfg.optimizer, cfg.scheduler = muon_fsdp_with_cosine_annealing(...)

``MuonFsdpOptimizerConfig`` is Bridge's ``OptimizerConfig`` plus ``muon_fsdp`` (megatron-muon's
``MuonFsdpConfig``: mode, buckets, NS method, momentum offload). Its ``provide``:

- ``optimizer`` one of ``common.options.FsdpOptimizerT`` ("muon", "adaptive_muon", "lion", ...),
  or that name with megatron-core's legacy "dist_" prefix ("dist_muon": Bridge's Muon recipes),
  with a Megatron-FSDP model: megatron-muon's optimizer (``build_muon_optimizer``: exact Muon or
  AdaptiveMuon with its ``adaptive_muon_*`` fields, or Lion; state in Bridge's ``fsdp_dtensor``
  checkpoints; Bridge's ``train_step`` reduces gradients before ``step()``, hence
  ``grads_already_synced``). fp16 is refused there.
- "adam" with Megatron-FSDP: megatron-core's optimizer, with every param's Adam state created on
  every rank at build (``checkpoint_guards.adam_state.make_adam_state_rank_symmetric``): stock, a
  rank holding no rows of a param gets no lazy state and the ``fsdp_dtensor`` save hangs. "sgd":
  Bridge's.
- any other name with Megatron-FSDP (an emerging optimizer megatron-muon does not run on
  Megatron-FSDP's row shards): refused at build, naming it and the names that are built.
- no Megatron-FSDP: what Bridge itself would build.

MuonClip: with the model's ``qk_clip`` on (Bridge's model-provider fields ``qk_clip``,
``qk_clip_threshold``, ``qk_clip_alpha``, the one place it is set), megatron-muon's ``QKClip``
(``QKClipConfig`` from those fields) clips the main weights' row shards after each step and
Bridge's own ``clip_qk`` (compute weights, Transformer Engine only) is skipped for those model
chunks (``install()``'s one patch of Bridge).

Building the config calls ``install()`` (idempotent), which applies, before Bridge initializes:

1. the version checks (``SUPPORTED_MEGATRON_BRIDGE``, ``megatron_version.SUPPORTED_MEGATRON_CORE``);
2. megatron-core's shipped dataset helpers (``megatron_lm.use_shipped_dataset_helpers``; Bridge's
   ``initialize_megatron`` calls ``compile_helpers``, which fails with the PyPI wheel);
3. ``megatron.bridge.training.train.clip_qk`` skipping chunks whose QK-clip is ours;
4. without a GPU, ``megatron_muon.cpu_stand_ins.install_for_bridge()``;
5. Bridge's checkpoint doors (``_load_checkpoint_from_path``: resume, pretrained, PEFT;
   ``has_modelopt_state`` / ``load_modelopt_state``) with ``checkpoint_guards.bridge``'s checks:
   every pickle the reader Bridge picks from the files would read, read restricted
   (``ckpt_trust_pickles`` opts out), and another optimizer's state refused naming both
   optimizers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import weakref
from collections.abc import Sequence
from typing import Any, get_args

import torch

from megatron_muon.common.megatron_fsdp_compat import uses_megatron_fsdp
from megatron_muon.common.options import FsdpOptimizerT
from megatron_muon.engine.config import MuonFsdpConfig
from megatron_muon.fsdp.qk_clip import QKClipConfig
from megatron_muon.integrations import megatron_lm
from megatron_muon.integrations.checkpoint_guards import bridge as bridge_checkpoint
from megatron_muon.integrations.checkpoint_guards.adam_state import make_adam_state_rank_symmetric
from megatron_muon.integrations.megatron_version import check_megatron_core_version

__all__ = [
    "STOCK_OPTIMIZERS",
    "SUPPORTED_MEGATRON_BRIDGE",
    "MuonFsdpOptimizerConfig",
    "check_megatron_bridge_version",
    "fsdp_optimizer_name",
    "install",
    "muon_fsdp_with_cosine_annealing",
]

# The Megatron-Bridge versions whose optim.py, train.py and initialize.py were read.
SUPPORTED_MEGATRON_BRIDGE = "==0.6.2"
# megatron-core's standard optimizers (its path for non-emerging names): built by megatron-core
# under Megatron-FSDP too. Every other name is megatron-muon's (``FsdpOptimizerT``) or refused.
STOCK_OPTIMIZERS = ("adam", "sgd")
# megatron-core's legacy prefix of a layer-wise distributed emerging optimizer ("dist_muon", which
# Bridge's Muon recipes set): on Megatron-FSDP, megatron-muon's sharded optimizer of the bare name.
_DIST_PREFIX = "dist_"

_INSTALLED = False
# Model chunks whose QK-clip megatron-muon's step runs -> that optimizer (Bridge's clip_qk skips).
_OURS_CLIPS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def check_megatron_bridge_version() -> None:
    """Raises unless the installed Megatron-Bridge is in ``SUPPORTED_MEGATRON_BRIDGE``."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    installed = version("megatron-bridge")
    if not SpecifierSet(SUPPORTED_MEGATRON_BRIDGE).contains(installed, prereleases=True):
        raise RuntimeError(
            f"{__name__} uses Megatron-Bridge's optimizer extension point and patches its "
            f"train.clip_qk as they are in megatron-bridge {SUPPORTED_MEGATRON_BRIDGE}; "
            f"megatron-bridge {installed} is installed. Install that version, or check the "
            "module docstring's items against it and widen SUPPORTED_MEGATRON_BRIDGE."
        )


def install(*, cpu_stand_ins: bool | None = None) -> None:
    """Prepares Megatron-Bridge's ``pretrain`` for ``MuonFsdpOptimizerConfig`` (module docstring).

    Idempotent; ``MuonFsdpOptimizerConfig()`` calls it.

    Args:
        cpu_stand_ins: apply ``cpu_stand_ins.install_for_bridge()``; default: without a GPU.

    Raises:
        RuntimeError: an unsupported Megatron-Bridge or megatron-core version is installed.
    """
    global _INSTALLED
    check_megatron_bridge_version()
    check_megatron_core_version(__name__)
    if cpu_stand_ins is None:
        cpu_stand_ins = not torch.cuda.is_available()
    if cpu_stand_ins:
        from megatron_muon import cpu_stand_ins as stand_ins

        stand_ins.install_for_bridge()
    if _INSTALLED:
        return
    megatron_lm.use_shipped_dataset_helpers()
    initialize: Any = importlib.import_module("megatron.bridge.training.initialize")
    datasets_utils: Any = importlib.import_module("megatron.core.datasets.utils")
    initialize.compile_helpers = datasets_utils.compile_helpers
    train: Any = importlib.import_module("megatron.bridge.training.train")
    train.clip_qk = _skipping_our_qk_clip(train.clip_qk)
    bridge_checkpoint.install_load_checks()
    _INSTALLED = True


def _skipping_our_qk_clip(clip_qk: Any) -> Any:
    @functools.wraps(clip_qk)
    def clip_qk_unless_ours(model: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = model if isinstance(model, list) else [model]
        optimizer = next((_OURS_CLIPS[c] for c in chunks if c in _OURS_CLIPS), None)
        if optimizer is None:
            return clip_qk(model, *args, **kwargs)
        stats = optimizer.last_qk_clip
        return None if stats is None else stats.max_logit

    return clip_qk_unless_ours


def _bridge_optimizer_config() -> type:
    return importlib.import_module("megatron.bridge.training.config").OptimizerConfig


@dataclasses.dataclass
class MuonFsdpOptimizerConfig(_bridge_optimizer_config()):  # type: ignore[misc]  # Bridge: untyped
    """Bridge's ``OptimizerConfig`` whose ``provide`` builds megatron-muon's optimizer
    (``fsdp_optimizer_name``: Muon, AdaptiveMuon, Lion) under Megatron-FSDP (module docstring).

    The optimizer's own settings are the inherited megatron-core fields (``muon_*``,
    ``adaptive_muon_moment2_method`` / ``_beta2`` / ``_eps``, ``lion_beta1`` / ``_beta2``).

    Attributes:
        muon_fsdp: megatron-muon's settings (``MuonFsdpConfig``); QK-clip comes from the model's
            ``qk_clip*`` fields (``_model_qk_clip``).
        ckpt_trust_pickles: the checkpoints this run reads are trusted (``checkpoint.load``,
            ``pretrained_checkpoint``, ``modelopt_state``): their pickles are read without the
            restricted unpickler (Megatron-LM's ``--ckpt-trust-pickles``;
            ``checkpoint_guards.bridge``). Only for a checkpoint
            whose pickles hold types outside the allowlist and whose origin you trust.
    """

    muon_fsdp: MuonFsdpConfig = dataclasses.field(default_factory=MuonFsdpConfig)
    ckpt_trust_pickles: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        install()
        bridge_checkpoint.trust_pickles(self.ckpt_trust_pickles)  # the modelopt_state doors

    @classmethod
    def from_config(cls, config: Any, **muon_fsdp: Any) -> MuonFsdpOptimizerConfig:
        """This class with every field of ``config`` (a Bridge or megatron-core
        ``OptimizerConfig``, e.g. a recipe's) and ``MuonFsdpConfig(**muon_fsdp)``."""
        values = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if f.init and f.name != "muon_fsdp"
        }
        return cls(**values, muon_fsdp=MuonFsdpConfig(**muon_fsdp))

    def provide(
        self,
        model_chunks: Any,
        config_overrides: Any = None,
        use_gloo_process_groups: bool = True,
        pg_collection: Any = None,
    ) -> Any:
        """The optimizer Bridge's ``setup_optimizer`` asks for (Bridge's extension point)."""
        chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
        fsdp = uses_megatron_fsdp(chunks)
        ours = fsdp_optimizer_name(self.optimizer) if fsdp else None
        if ours is not None:
            return self._ours(ours, chunks, config_overrides, pg_collection)
        optimizer = self._bridge_default(
            chunks, config_overrides, use_gloo_process_groups, pg_collection
        )
        if fsdp and self.optimizer == "adam":
            make_adam_state_rank_symmetric(optimizer)
        return optimizer

    def _ours(
        self, name: str, chunks: Sequence[Any], config_overrides: Any, pg_collection: Any
    ) -> Any:
        """megatron-muon's ``name`` (an ``FsdpOptimizerT`` value) for Megatron-FSDP ``chunks``."""
        from megatron_muon.fsdp.factory import build_muon_optimizer

        config = copy.copy(self)
        config.optimizer = name
        qk_clip = _model_qk_clip(chunks[0].config)
        optimizer = build_muon_optimizer(
            config,
            chunks,
            config_overrides=config_overrides,
            pg_collection=pg_collection,
            fsdp_config=self.muon_fsdp,
            qk_clip=qk_clip,
            grads_already_synced=True,
            ckpt_format="fsdp_dtensor",
        )
        if qk_clip is not None:
            for chunk in chunks:
                _OURS_CLIPS[chunk] = optimizer
        return optimizer

    def _bridge_default(
        self, chunks: Any, config_overrides: Any, use_gloo_process_groups: bool, pg_collection: Any
    ) -> Any:
        """What Bridge's ``setup_optimizer`` builds for a config without ``provide``."""
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer.muon import get_megatron_muon_optimizer

        kwargs = dict(
            config=self,
            model_chunks=chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
        )
        if "muon" not in self.optimizer and "soap" not in self.optimizer:
            return get_megatron_optimizer(**kwargs)
        return get_megatron_muon_optimizer(
            **kwargs, layer_wise_distributed_optimizer="dist" in self.optimizer
        )


def fsdp_optimizer_name(optimizer: str) -> str | None:
    """The ``FsdpOptimizerT`` value megatron-muon builds for Bridge's ``optimizer`` on a
    Megatron-FSDP model ("dist_<name>" is <name>), or None for megatron-core's own
    (``STOCK_OPTIMIZERS``).

    Raises:
        ValueError: any other name, naming it: megatron-muon does not run it exactly on
            Megatron-FSDP's row shards, and megatron-core's emerging-optimizer path does not
            support Megatron-FSDP.
    """
    if optimizer in STOCK_OPTIMIZERS:
        return None
    ours = get_args(FsdpOptimizerT)
    name = optimizer.removeprefix(_DIST_PREFIX)
    if name in ours:
        return name
    raise ValueError(
        f"MuonFsdpOptimizerConfig: optimizer={optimizer!r} is not built for Megatron-FSDP; "
        f"megatron-muon builds {ours} (also with the {_DIST_PREFIX!r} prefix) and megatron-core "
        f"{STOCK_OPTIMIZERS}"
    )


def _model_qk_clip(model_config: Any) -> QKClipConfig | None:
    """The model config's MuonClip settings when its ``qk_clip`` is on, else None.

    Raises:
        ValueError: a threshold or alpha that ``QKClipConfig`` refuses.
    """
    if not getattr(model_config, "qk_clip", False):
        return None
    return QKClipConfig(threshold=model_config.qk_clip_threshold, alpha=model_config.qk_clip_alpha)


def muon_fsdp_with_cosine_annealing(
    **kwargs: Any,
) -> tuple[MuonFsdpOptimizerConfig, Any]:
    """Bridge's ``distributed_muon_with_cosine_annealing(**kwargs)`` (same arguments, same
    scheduler), its optimizer config as ``MuonFsdpOptimizerConfig``; ``muon_fsdp=`` (a dict of
    ``MuonFsdpConfig`` fields) sets megatron-muon's settings."""
    optimizer_utils = importlib.import_module("megatron.bridge.recipes.utils.optimizer_utils")
    muon_fsdp = kwargs.pop("muon_fsdp", None) or {}
    optimizer, scheduler = optimizer_utils.distributed_muon_with_cosine_annealing(**kwargs)
    return MuonFsdpOptimizerConfig.from_config(optimizer, **muon_fsdp), scheduler
