"""``AdaptiveMuonConfig``: Megatron's ``--adaptive-muon-*`` settings, each defined and checked
once; the flags are derived from its fields (``fsdp.arguments.add_optimizer_config_flags``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import Moment2MethodT

from megatron_muon.common.options import check_choice
from megatron_muon.optimizers.settings import read_settings

__all__ = ["AdaptiveMuonConfig"]


def _help(text: str) -> dict[str, str]:
    """A field's flag help (``fsdp.arguments.add_optimizer_config_flags`` reads it)."""
    return {"help": f"--optimizer adaptive_muon: {text}."}


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaptiveMuonConfig:
    """Megatron's adaptive-Muon settings (``OptimizerConfig.adaptive_muon_*``), same names without
    the prefix, defaults megatron-core 0.19.2's (= ``AdaptiveMuon``'s).

    Attributes:
        moment2_method: ``"adamuon"`` (elementwise), ``"normuon"`` (per row or per column) or
            ``"namo"`` (a Frobenius-norm ratio); emerging-optimizers' ``Moment2MethodT``.
        beta2: decay of the second moment's running average, in [0, 1).
        eps: added to the second moment's root (adamuon, namo) or its floor (normuon), >= 0.
    """

    prefix: ClassVar[str] = "adaptive_muon"

    moment2_method: Moment2MethodT = field(
        default="adamuon",
        metadata=_help(
            "the second moment applied to the raw Newton-Schulz result: 'adamuon' elementwise, "
            "'normuon' per row or column, 'namo' a Frobenius-norm ratio"
        ),
    )
    beta2: float = field(
        default=0.95, metadata=_help("decay of the second moment's running average, in [0, 1)")
    )
    eps: float = field(default=1e-8, metadata=_help("the second moment's epsilon, >= 0"))

    def __post_init__(self) -> None:
        check_choice("moment2_method", self.moment2_method, Moment2MethodT)
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {self.beta2}")
        if not self.eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")

    @classmethod
    def from_optimizer_config(cls, config: Any) -> AdaptiveMuonConfig:
        """Reads ``config.adaptive_muon_<field>`` (``OptimizerConfig`` or Megatron's parsed args).

        Raises:
            ValueError: naming the ``adaptive_muon_`` field read.
        """
        return read_settings(cls, config)
