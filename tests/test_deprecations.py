"""What an earlier release spelled otherwise still works for one more, with a ``DeprecationWarning``
naming the new spelling: the module paths ``megatron_muon.sharded.<module>`` (0.1) and
``megatron_muon.integrations.checkpoint_*`` (0.2; each gives the new module itself, so classes are
the same objects) and ``ShardedMuon``'s flat constructor keywords (the same configs as
``ShardedMuon.from_keywords``, so the same steps)."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

from megatron_muon.integrations import MOVED as MOVED_GUARDS
from megatron_muon.sharded import MOVED

OLD_PATHS = [("megatron_muon.sharded", old, new) for old, new in sorted(MOVED.items())] + [
    ("megatron_muon.integrations", old, new) for old, new in sorted(MOVED_GUARDS.items())
]


@pytest.mark.parametrize(("package", "old", "new"), OLD_PATHS)
def test_old_module_path_warns_naming_the_new_one_and_is_the_new_module(
    package: str, old: str, new: str
) -> None:
    sys.modules.pop(f"{package}.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"import {new}$"):
        module = importlib.import_module(f"{package}.{old}")
    assert module is importlib.import_module(new)


def test_from_import_of_an_old_class_path_gives_the_same_class_with_one_warning() -> None:
    sys.modules.pop("megatron_muon.sharded.sharded_muon", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from megatron_muon.sharded.sharded_muon import ShardedMuon as old_class
    from megatron_muon.optimizers.muon import ShardedMuon

    assert old_class is ShardedMuon
    assert [type(w.message) for w in caught] == [DeprecationWarning]


def test_an_unknown_old_name_is_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("megatron_muon.sharded.no_such_module")


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 4, generator=generator)) for _ in range(2)]


def test_the_flat_keyword_constructor_warns_and_steps_bitwise_as_from_keywords() -> None:
    from megatron_muon import ShardedMuon

    keywords = {"momentum": 0.9, "nesterov": False, "num_ns_steps": 3, "mode": "gather"}
    old_params, new_params = _params(), _params()
    with pytest.warns(DeprecationWarning, match=r"pass muon=MuonConfig\(...\) and fsdp="):
        old = ShardedMuon(old_params, lr=0.02, **keywords)
    new = ShardedMuon.from_keywords(new_params, lr=0.02, **keywords)
    assert (old.muon_config, old.fsdp_config) == (new.muon_config, new.fsdp_config)
    for _ in range(2):
        for old_param, new_param in zip(old_params, new_params, strict=True):
            old_param.grad = torch.ones_like(old_param) + old_param
            new_param.grad = torch.ones_like(new_param) + new_param
        old.step()
        new.step()
    assert all(torch.equal(a, b) for a, b in zip(old_params, new_params, strict=True))


def test_a_config_and_its_own_fields_as_flat_keywords_are_refused() -> None:
    from megatron_muon import MuonConfig, ShardedMuon

    with pytest.raises(TypeError, match=r"muon= and its fields \['momentum'\]"):
        ShardedMuon(_params(), muon=MuonConfig(), momentum=0.9)


def test_an_unknown_flat_keyword_is_refused_naming_it() -> None:
    from megatron_muon import ShardedMuon

    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['momentun'\]"):
        ShardedMuon(_params(), momentun=0.9)


def test_adam_state_install_warns_naming_megatron_lm_install_and_wraps_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.training import training

    from megatron_muon.integrations.checkpoint_guards import adam_state

    def stock(config: object, model_chunks: object) -> None:  # unwrapped, whatever ran before
        return None

    monkeypatch.setattr(training, "get_megatron_optimizer", stock)  # restored afterwards
    for _ in range(2):  # idempotent, also where megatron_lm.install() applied it
        with pytest.warns(DeprecationWarning, match=r"megatron_lm\.install\(\) applies it"):
            adam_state.install()
    wrapped = training.get_megatron_optimizer
    assert wrapped._megatron_muon_rank_symmetric_state and wrapped.__wrapped__ is stock
