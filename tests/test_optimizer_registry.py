"""One registry of the optimizers megatron-muon runs (``fsdp.optimizer_registry``), read by the
factory, ``install()``'s ``--optimizer`` choices, the checkpoint-kind check and the switch at
load (``integrations.optimizer_switch``): what each switch carries, and a checkpoint told apart
by the ``args.optimizer`` saved in it where its state keys are another optimizer's (LaProp's and
ObliqueAdam's are Adam's names). In-process, one rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

_ADAM = {"exp_avg", "exp_avg_sq", "step"}


def test_every_optimizer_name_has_one_entry_and_the_flags_take_them() -> None:
    from megatron_muon.common.options import (
        FsdpOptimizerT,
        MegatronOptimizerT,
        OrthogonalizedOptimizerT,
    )
    from megatron_muon.fsdp.optimizer_registry import (
        OPTIMIZERS,
        fsdp_optimizer_names,
        megatron_lm_optimizer_names,
        routed_by_install,
    )

    built = {*get_args(FsdpOptimizerT), *get_args(OrthogonalizedOptimizerT), "sgd"}
    assert set(fsdp_optimizer_names()) == built
    assert set(megatron_lm_optimizer_names()) == set(get_args(MegatronOptimizerT))
    # megatron-core builds Adam on Megatron-FSDP; its DistributedOptimizer refuses SGD: ours.
    assert OPTIMIZERS["adam"].kind == "megatron_core"
    assert (OPTIMIZERS["sgd"].kind, OPTIMIZERS["sgd"].scalar_optimizer) == ("elementwise", "sgd")
    routed = {name for name in OPTIMIZERS if routed_by_install(name)}  # install()'s, on FSDP
    assert routed == {*get_args(FsdpOptimizerT), "sgd"}
    for entry in OPTIMIZERS.values():  # a builder exactly where megatron-muon builds the matrices
        assert (entry.builder is None) == (entry.kind in ("elementwise", "megatron_core"))
        assert set(entry.counterparts) <= set(entry.state_keys), entry.name


def test_unknown_name_is_refused_naming_the_known_ones() -> None:
    from megatron_muon.fsdp.optimizer_registry import lookup

    with pytest.raises(ValueError, match=r"unknown optimizer 'adamw'.*'muon'"):
        lookup("adamw")


@pytest.mark.parametrize(
    ("old", "new", "carried", "fresh"),
    [
        ("adam", "adam", {"step": "step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}, []),
        ("adam", "muon", {"momentum_buffer": "exp_avg"}, []),
        ("adam", "adaptive_muon", {"momentum_buffer": "exp_avg"}, ["moment2_buffer"]),
        ("adam", "lion", {"exp_avg": "exp_avg"}, []),
        ("muon", "lion", {"exp_avg": "momentum_buffer"}, []),
        ("lion", "muon", {"momentum_buffer": "exp_avg"}, []),
        # Adam's state is whole: no second moment in Muon or Lion, so none of it is carried.
        ("muon", "adam", {}, ["step", "exp_avg", "exp_avg_sq"]),
        ("lion", "adam", {}, ["step", "exp_avg", "exp_avg_sq"]),
        # Same names, other quantities: LaProp's exp_avg averages normalized gradients.
        ("laprop", "adam", {}, ["step", "exp_avg", "exp_avg_sq"]),
        ("adam", "soap", {}, ["step", "exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"]),
        ("sgd", "muon", {}, ["momentum_buffer"]),
    ],
)
def test_a_switch_carries_exactly_the_counterparts(
    old: str, new: str, carried: dict[str, str], fresh: list[str]
) -> None:
    from megatron_muon.fsdp.optimizer_registry import lookup
    from megatron_muon.integrations.optimizer_switch import SwitchPlan

    plan = SwitchPlan(old, new, {}, set())
    pair = plan.pair(lookup(old), lookup(new), list(lookup(new).state_keys))
    assert pair.carried == carried
    assert pair.fresh == fresh


def test_laprop_state_into_adam_is_refused_by_the_saved_optimizer_name() -> None:
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import state_kinds_refusal

    laprop = [_ADAM, _ADAM]  # LaProp's matrices hold Adam's key names
    assert state_kinds_refusal(laprop, laprop, "adam", "/c", "/c/i") is None  # keys alone
    refusal = state_kinds_refusal(laprop, laprop, "adam", "/c", "/c/i", saved_optimizer="laprop")
    assert refusal is not None and "saved by --optimizer laprop" in refusal, refusal
    assert state_kinds_refusal(laprop, laprop, "adam", "/c", "/c/i", saved_optimizer="adam") is None


class _Optimizer(torch.optim.SGD):
    """A torch optimizer with momentum state and the two calls Megatron's load makes."""

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        state = self.state[self.param_groups[0]["params"][0]]
        return {"state": {"w": state}, "param_to_group_meta": {"w": {"momentum": 0.9}}}

    def load_state_dict(self, state_dict: Any) -> None:
        raise AssertionError("the fake load below does not load")


def _checkpoint(directory: Path, optimizer: str) -> None:
    """A DCP checkpoint (one process) with Megatron's ``args`` and one param's Adam state."""
    import torch.distributed.checkpoint as dcp

    state = {"exp_avg": torch.ones(2, 2), "exp_avg_sq": torch.ones(2, 2), "step": torch.tensor(4.0)}
    args = argparse.Namespace(optimizer=optimizer, adam_beta1=0.9)
    dcp.save({"args": args, "optimizer": {"state": {"w": state}}}, checkpoint_id=directory)


@pytest.mark.parametrize("by", ["flag", "keyword"])
def test_another_optimizers_checkpoint_is_refused_unless_the_switch_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    import megatron.training

    from megatron_muon.checkpointing import CheckpointMismatchError
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import (
        checking_optimizer_state_first,
    )

    _checkpoint(tmp_path / "iter_0000004", "adam")
    optimizer = _Optimizer([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=0.9)
    optimizer.state[optimizer.param_groups[0]["params"][0]]["momentum_buffer"] = torch.zeros(2, 2)
    args = argparse.Namespace(
        load=str(tmp_path), ckpt_step=4, ckpt_format="fsdp_dtensor", optimizer="sgd"
    )
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    seen: list[Any] = []

    def load_checkpoint(model: Any, optimizer: Any, *rest: Any, **kwargs: Any) -> str:
        seen.append(optimizer.sharded_state_dict())  # the switched template, inside the load
        return "loaded"

    checked = checking_optimizer_state_first(load_checkpoint)
    with pytest.raises(CheckpointMismatchError, match="saved by --optimizer adam"):
        checked(None, optimizer)
    assert not seen
    if by == "flag":
        args.optimizer_switch_at_load = True
        assert checked(None, optimizer) == "loaded"
    else:
        assert checked(None, optimizer, optimizer_switch_at_load=True) == "loaded"
    # SGD's heavy-ball sum is no average: nothing of Adam's carried, the template empty.
    assert seen == [{"state": {"w": {}}}]
    assert "sharded_state_dict" not in vars(optimizer)  # restored after the load
