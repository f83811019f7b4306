"""``MuonFsdpOptimizerConfig`` as a recipe builds it: fields carried over, bad input refused.

Single-process; needs Megatron-Bridge (``make test-bridge``), skipped elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None,
    reason="Megatron-Bridge is not installed here: `make test-bridge` runs these tests in "
    ".venv-bridge (scripts/setup_bridge_venv.sh)",
)


def test_from_config_keeps_every_field_of_a_recipe_config_and_sets_ours() -> None:
    from megatron.bridge.recipes.utils.optimizer_utils import (
        distributed_muon_with_cosine_annealing,
    )

    from megatron_muon.integrations.megatron_bridge import (
        MuonFsdpOptimizerConfig,
        muon_fsdp_with_cosine_annealing,
    )

    recipe, recipe_scheduler = distributed_muon_with_cosine_annealing(
        max_lr=3e-3, muon_momentum=0.9
    )
    ours = MuonFsdpOptimizerConfig.from_config(recipe, mode="gather", ns_method="gram")
    for field in dataclasses.fields(recipe):
        assert getattr(ours, field.name) == getattr(recipe, field.name), field.name
    assert (ours.muon_fsdp.mode, ours.muon_fsdp.ns_method) == ("gather", "gram")

    helper, scheduler = muon_fsdp_with_cosine_annealing(max_lr=3e-3, muon_momentum=0.9)
    assert isinstance(helper, MuonFsdpOptimizerConfig)
    assert (helper.optimizer, helper.lr, helper.muon_momentum) == ("dist_muon", 3e-3, 0.9)
    assert scheduler == recipe_scheduler


def test_qk_clip_comes_from_the_models_qk_clip_fields_when_its_switch_is_on() -> None:
    from megatron_muon import QKClipConfig
    from megatron_muon.integrations.megatron_bridge import _model_qk_clip

    model = SimpleNamespace(qk_clip=True, qk_clip_threshold=50.0, qk_clip_alpha=0.3)
    assert _model_qk_clip(model) == QKClipConfig(threshold=50.0, alpha=0.3)
    off = SimpleNamespace(qk_clip=False, qk_clip_threshold=50.0, qk_clip_alpha=0.3)
    assert _model_qk_clip(off) is None
    with pytest.raises(ValueError, match="QK-clip alpha must be in"):
        _model_qk_clip(SimpleNamespace(qk_clip=True, qk_clip_threshold=50.0, qk_clip_alpha=1.5))


def test_another_megatron_bridge_version_is_refused_naming_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_muon.integrations import megatron_bridge

    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.7.0")
    with pytest.raises(RuntimeError, match=r"megatron-bridge ==0\.6\.2.*0\.7\.0 is installed"):
        megatron_bridge.check_megatron_bridge_version()


def test_fsdp_optimizer_names_are_fsdp_optimizer_t_with_or_without_dist_prefix() -> None:
    """Under Megatron-FSDP ``provide`` builds megatron-muon's optimizer for every
    ``FsdpOptimizerT`` value (also "dist_<name>", megatron-core's legacy layer-wise spelling that
    Bridge's Muon recipes set) and leaves megatron-core's standard optimizers to megatron-core."""
    from typing import get_args

    from megatron_muon.common.options import FsdpOptimizerT
    from megatron_muon.integrations.megatron_bridge import fsdp_optimizer_name

    for name in get_args(FsdpOptimizerT):
        assert fsdp_optimizer_name(name) == name
        assert fsdp_optimizer_name(f"dist_{name}") == name
    assert fsdp_optimizer_name("adam") is None
    assert fsdp_optimizer_name("sgd") is None


@pytest.mark.parametrize("name", ["polargrad", "dist_polargrad", "adamw", "dist_adam"])
def test_an_optimizer_megatron_muon_does_not_build_is_refused_by_name(name: str) -> None:
    from megatron_muon.integrations.megatron_bridge import fsdp_optimizer_name

    with pytest.raises(ValueError, match=rf"optimizer='{name}' is not built for Megatron-FSDP"):
        fsdp_optimizer_name(name)
