"""The module paths of 0.1 (``megatron_muon.sharded.<module>``) still import for one release: each
warns naming its new path and gives the new module itself, so classes are the same objects."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from megatron_muon.sharded import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_warns_naming_the_new_one_and_is_the_new_module(old: str) -> None:
    sys.modules.pop(f"megatron_muon.sharded.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"import {MOVED[old]}$"):
        module = importlib.import_module(f"megatron_muon.sharded.{old}")
    assert module is importlib.import_module(MOVED[old])


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
