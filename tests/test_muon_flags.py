"""Our flags (``add_muon_args`` + ``fsdp_config_from_args`` / ``qk_clip_config_from_args``) on our
parser and on a parser that already has Megatron-LM's ``--qk-clip`` / ``--qk-clip-threshold``; each
flag's default and choices are its config field's, our copies of Megatron-LM's Muon flags equal
Megatron's; bad values refused by name; a bare ``%`` in a flag's help no longer stops ``--help``.
"""

from __future__ import annotations

import argparse

import pytest


def test_our_flags_reach_the_fsdp_config():
    from megatron_muon import MuonFsdpConfig, QKClipConfig
    from megatron_muon.fsdp.arguments import (
        add_muon_args,
        fsdp_config_from_args,
        qk_clip_config_from_args,
    )

    parser = add_muon_args(argparse.ArgumentParser())
    assert fsdp_config_from_args(parser.parse_args([])) == MuonFsdpConfig()
    assert qk_clip_config_from_args(parser.parse_args([])) is None
    args = parser.parse_args(
        [
            "--muon-ns-method=gram",
            "--muon-gram-half-dtype=bfloat16",
            "--muon-gram-restarts",
            "2",
            "--muon-offload-momentum",
            "--muon-fsdp-bucket-size-mb=2",
            "--qk-clip-threshold=50",
        ]
    )
    config = fsdp_config_from_args(args)
    assert config == MuonFsdpConfig(
        ns_method="gram",
        gram_half_dtype="bfloat16",
        gram_restarts=(2,),
        offload_momentum=True,
        bucket_size_bytes=2 * 2**20,
    )
    assert qk_clip_config_from_args(args) == QKClipConfig(threshold=50.0)
    with pytest.raises(ValueError, match="-3"):
        qk_clip_config_from_args(parser.parse_args(["--qk-clip-threshold=-3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--muon-gram-half-dtype=float32"])


def test_each_flag_takes_its_default_and_choices_from_its_config_field():
    from typing import get_args

    from megatron_muon import MuonFsdpConfig
    from megatron_muon.common.options import FsdpModeT, GramHalfDtypeT
    from megatron_muon.fsdp.arguments import add_muon_args
    from megatron_muon.newton_schulz.methods import NSMethodT

    actions = add_muon_args(argparse.ArgumentParser())._option_string_actions
    defaults = MuonFsdpConfig()
    for option, field, alias in [
        ("--muon-fsdp-mode", "mode", FsdpModeT),
        ("--muon-ns-method", "ns_method", NSMethodT),
        ("--muon-gram-half-dtype", "gram_half_dtype", GramHalfDtypeT),
    ]:
        assert actions[option].default == getattr(defaults, field)
        assert tuple(actions[option].choices) == get_args(alias)
    for option, field in [
        ("--muon-gram-restarts", "gram_restarts"),
        ("--muon-offload-momentum", "offload_momentum"),
        ("--muon-fsdp-overlap-buckets", "overlap_buckets"),
        ("--muon-min-split-flops", "min_split_flops"),
    ]:
        assert actions[option].default == getattr(defaults, field)
    assert actions["--muon-fsdp-bucket-size-mb"].default * 2**20 == defaults.bucket_size_bytes


def test_every_fsdp_config_field_with_flag_metadata_round_trips_through_its_flag():
    # A new MuonFsdpConfig field with flag(...) metadata is a flag with no other code: parsing
    # nothing gives the field's default, and a non-default value on the command line reaches it.
    from dataclasses import fields

    from megatron_muon import MuonFsdpConfig
    from megatron_muon.fsdp.arguments import add_muon_args, fsdp_config_from_args

    parser = add_muon_args(argparse.ArgumentParser())
    flagged = [f.name for f in fields(MuonFsdpConfig) if "help" in f.metadata]
    assert "custom_coefficient_sets" not in flagged  # no flag: Megatron's flags carry no triples
    assert len(flagged) == len(fields(MuonFsdpConfig)) - 1
    argv = [
        "--muon-fsdp-mode=gather",
        "--muon-fsdp-bucket-size-mb=0.5",
        "--muon-ns-method=gram",
        "--muon-gram-half-dtype=bfloat16",
        "--muon-gram-restarts",
        "2",
        "--muon-offload-momentum",
        "--muon-fsdp-overlap-buckets",
        "--muon-min-split-flops=0",
    ]
    config = fsdp_config_from_args(parser.parse_args(argv))
    # use_syrk=True is refused where Triton's kernels cannot run, as on this CPU (its own test):
    # its flag is checked as parsed.
    assert parser.parse_args(["--muon-use-syrk"]).muon_use_syrk is True
    for name in flagged:
        if name != "use_syrk":
            assert getattr(config, name) != getattr(MuonFsdpConfig(), name), name
    assert config.bucket_size_bytes == 2**19
    assert not fsdp_config_from_args(
        parser.parse_args(["--no-muon-offload-momentum"])
    ).offload_momentum
    with pytest.raises(ValueError, match="--muon-min-split-flops -1: min_split_flops must be >= 0"):
        from megatron_muon.fsdp.arguments import check_muon_args

        check_muon_args(parser.parse_args(["--muon-min-split-flops=-1"]))


def test_our_copies_of_megatron_lms_muon_flags_equal_megatrons():
    from megatron.training.arguments import add_megatron_arguments

    from megatron_muon.fsdp.arguments import add_muon_args
    from megatron_muon.integrations.megatron_lm_arguments import extra_args_provider

    ours = add_muon_args(argparse.ArgumentParser())._option_string_actions
    parser = add_megatron_arguments(argparse.ArgumentParser())
    stock = set(parser._option_string_actions)
    megatron = extra_args_provider(parser)._option_string_actions  # Megatron's, as install() has it
    copied = [o for o in ours if o.startswith("--muon-") and o in stock]
    assert len(copied) == 10  # --muon-momentum ... --muon-scalar-optimizer
    for option in copied:
        mine, theirs = ours[option], megatron[option]
        assert (mine.dest, mine.default, mine.type) == (theirs.dest, theirs.default, theirs.type)
        assert tuple(mine.choices or ()) == tuple(theirs.choices or ())
        assert mine.nargs == theirs.nargs
        assert type(mine) is type(theirs), option
    assert set(ours["--optimizer"].choices) <= set(megatron["--optimizer"].choices)


def test_megatrons_muon_tp_mode_takes_layer_sharded_which_stock_muon_is_refused():
    from megatron.training.arguments import add_megatron_arguments

    from megatron_muon.integrations.megatron_lm_arguments import (
        _refuse_our_tp_modes_for_stock_muon,
        extra_args_provider,
    )

    parser = extra_args_provider(add_megatron_arguments(argparse.ArgumentParser()))
    args = parser.parse_args(["--optimizer", "muon", "--muon-tp-mode", "layer_sharded"])
    assert args.muon_tp_mode == "layer_sharded"
    # Muon without --use-megatron-fsdp is megatron-core's TensorParallelMuon: refused by name.
    with pytest.raises(ValueError, match="--muon-tp-mode layer_sharded runs in megatron-muon"):
        _refuse_our_tp_modes_for_stock_muon(args)
    _refuse_our_tp_modes_for_stock_muon(parser.parse_args(["--muon-tp-mode", "duplicated"]))


def test_on_megatrons_parser_qk_clip_follows_its_qk_clip_switch_and_threshold():
    from megatron_muon.fsdp.arguments import add_muon_args, qk_clip_config_from_args

    parser = argparse.ArgumentParser()  # Megatron-LM's three flags, as megatron.training has them
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--qk-clip-threshold", type=float, default=100)
    parser.add_argument("--qk-clip-alpha", type=float, default=0.5)
    add_muon_args(parser)
    assert qk_clip_config_from_args(parser.parse_args([])) is None
    on = parser.parse_args(["--qk-clip", "--qk-clip-threshold=30"])
    assert qk_clip_config_from_args(on).threshold == 30.0
    assert qk_clip_config_from_args(parser.parse_args(["--qk-clip"])).threshold == 100.0
    split = parser.parse_args(["--qk-clip", "--qk-clip-alpha=0.3"])
    assert qk_clip_config_from_args(split).alpha == 0.3


def test_qk_clip_alpha_is_megatrons_flag_checked_by_megatrons_rule_when_qk_clip_is_on():
    from megatron_muon import QKClipConfig
    from megatron_muon.fsdp.arguments import (
        add_muon_args,
        check_muon_args,
        qk_clip_config_from_args,
    )

    ours = add_muon_args(argparse.ArgumentParser())
    assert ours.parse_args([]).qk_clip_alpha == 0.5  # Megatron-LM's default
    config = qk_clip_config_from_args(
        ours.parse_args(["--qk-clip-threshold=5", "--qk-clip-alpha=0.25"])
    )
    assert config == QKClipConfig(threshold=5.0, alpha=0.25)
    with pytest.raises(ValueError, match=r"--qk-clip-alpha 1.0: QK-clip alpha must be in \(0, 1\)"):
        check_muon_args(ours.parse_args(["--qk-clip-threshold=5", "--qk-clip-alpha=1.0"]))
    check_muon_args(ours.parse_args(["--qk-clip-alpha=1.0"]))  # QK-clip off: not read


def test_megatron_lm_integration_takes_over_qk_clip_for_muon_with_megatron_fsdp():
    from megatron_muon import QKClipConfig
    from megatron_muon.fsdp.arguments import qk_clip_config_from_args
    from megatron_muon.integrations.megatron_lm_arguments import _take_over_qk_clip

    args = argparse.Namespace(qk_clip=True, qk_clip_threshold=20.0, qk_clip_alpha=0.5)
    _take_over_qk_clip(args)
    # Megatron's train_step then never calls its clip_qk; ours clips at Megatron's threshold.
    assert args.qk_clip is False and args.muon_qk_clip is True
    assert qk_clip_config_from_args(args) == QKClipConfig(threshold=20.0, alpha=0.5)
    off = argparse.Namespace(qk_clip=False, qk_clip_threshold=100.0)
    _take_over_qk_clip(off)
    assert qk_clip_config_from_args(off) is None


def test_bad_config_values_are_refused_by_name():
    from megatron_muon import MuonConfig, MuonFsdpConfig, QKClipConfig

    with pytest.raises(ValueError, match="'float32'"):
        MuonFsdpConfig(gram_half_dtype="float32")  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(ValueError, match="0.0"):
        QKClipConfig(threshold=0.0)
    with pytest.raises(ValueError, match=r"scalar_optimizer must be one of \('adam', 'lion'\)"):
        MuonConfig(scalar_optimizer="sgd")  # type: ignore[arg-type]  # a bad value on purpose


def test_a_bare_percent_in_a_flags_help_is_escaped_so_that_help_formats():
    from megatron_muon.integrations.megatron_lm_arguments import escape_bare_percent_in_help

    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--a", default=3, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--b", default=7, help="default %(default)s, 12-17%% fewer")
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    escape_bare_percent_in_help(escape_bare_percent_in_help(parser))  # idempotent
    text = " ".join(parser.format_help().split())
    assert "1.10 = 10%)." in text and "default 7, 12-17% fewer" in text


def test_use_syrk_is_refused_by_name_where_its_triton_kernels_cannot_run():
    import torch

    from megatron_muon import MuonConfig, MuonFsdpConfig
    from megatron_muon.fsdp.arguments import add_muon_args, check_muon_args, fsdp_config_from_args
    from megatron_muon.newton_schulz.methods import NSConfig
    from megatron_muon.newton_schulz.syrk import syrk_newton_schulz, syrk_problem

    parser = add_muon_args(argparse.ArgumentParser())
    assert parser.parse_args([]).muon_use_syrk is False
    assert MuonFsdpConfig().ns_config(MuonConfig()).use_syrk is False  # read into NSConfig
    with pytest.raises(ValueError, match="use_syrk .* ns_method='gram' has no syrk form"):
        NSConfig(ns_method="gram", use_syrk=True)
    assert "params are on cpu" in (syrk_problem("cpu") or "")
    with pytest.raises(ValueError, match="use_syrk runs on 2-D .* fp32 CUDA tensors.*cpu"):
        syrk_newton_schulz(torch.randn(8, 16), 5, "quintic")
    if syrk_problem() is not None:  # a CPU host (CI): refused at argument check and build
        args = parser.parse_args(["--muon-use-syrk"])
        with pytest.raises(ValueError, match=r"use_syrk \(--muon-use-syrk\) cannot run here"):
            check_muon_args(args)
        with pytest.raises(ValueError, match=r"use_syrk \(--muon-use-syrk\) cannot run here"):
            fsdp_config_from_args(args)
    else:
        assert fsdp_config_from_args(parser.parse_args(["--muon-use-syrk"])).use_syrk
