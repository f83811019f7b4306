"""Our flags (``add_muon_args`` + ``MuonFsdpConfig.from_args``) on our parser and on a parser that
already has Megatron-LM's ``--qk-clip`` / ``--qk-clip-threshold``; bad values refused by name; a
bare ``%`` in a flag's help no longer stops ``--help``.
"""

from __future__ import annotations

import argparse

import pytest


def test_our_flags_reach_the_fsdp_config():
    from megatron_muon.fsdp.arguments import add_muon_args
    from megatron_muon.sharded.config import MuonFsdpConfig

    parser = add_muon_args(argparse.ArgumentParser())
    default = MuonFsdpConfig.from_args(parser.parse_args([]))
    assert default == MuonFsdpConfig()
    assert default.qk_clip_threshold is None
    args = parser.parse_args(
        [
            "--muon-ns-method=gram",
            "--muon-gram-half-dtype=bfloat16",
            "--muon-gram-restarts",
            "2",
            "--muon-offload-momentum",
            "--qk-clip-threshold=50",
        ]
    )
    config = MuonFsdpConfig.from_args(args)
    assert config == MuonFsdpConfig(
        ns_method="gram",
        gram_half_dtype="bfloat16",
        gram_restarts=(2,),
        offload_momentum=True,
        qk_clip_threshold=50.0,
    )
    assert config.sharded_muon_kwargs()["gram_half_dtype"] == "bfloat16"
    assert "qk_clip_threshold" not in config.sharded_muon_kwargs()
    with pytest.raises(ValueError, match="-3"):
        MuonFsdpConfig.from_args(parser.parse_args(["--qk-clip-threshold=-3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--muon-gram-half-dtype=float32"])


def test_on_megatrons_parser_qk_clip_follows_its_qk_clip_switch_and_threshold():
    from megatron_muon.fsdp.arguments import add_muon_args
    from megatron_muon.sharded.config import MuonFsdpConfig

    parser = argparse.ArgumentParser()  # Megatron-LM's three flags, as megatron.training has them
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--qk-clip-threshold", type=float, default=100)
    parser.add_argument("--qk-clip-alpha", type=float, default=0.5)
    add_muon_args(parser)
    assert MuonFsdpConfig.from_args(parser.parse_args([])).qk_clip_threshold is None
    on = parser.parse_args(["--qk-clip", "--qk-clip-threshold=30"])
    assert MuonFsdpConfig.from_args(on).qk_clip_threshold == 30.0
    assert MuonFsdpConfig.from_args(parser.parse_args(["--qk-clip"])).qk_clip_threshold == 100.0
    split = parser.parse_args(["--qk-clip", "--qk-clip-alpha=0.3"])
    assert MuonFsdpConfig.from_args(split).qk_clip_alpha == 0.3


def test_qk_clip_alpha_is_megatrons_flag_checked_by_megatrons_rule_when_qk_clip_is_on():
    from megatron_muon.fsdp.arguments import add_muon_args, check_muon_args
    from megatron_muon.sharded.config import MuonFsdpConfig

    ours = add_muon_args(argparse.ArgumentParser())
    assert ours.parse_args([]).qk_clip_alpha == 0.5  # Megatron-LM's default
    config = MuonFsdpConfig.from_args(
        ours.parse_args(["--qk-clip-threshold=5", "--qk-clip-alpha=0.25"])
    )
    assert (config.qk_clip_threshold, config.qk_clip_alpha) == (5.0, 0.25)
    with pytest.raises(ValueError, match=r"--qk-clip-alpha 1.0: qk_clip_alpha must be in \(0, 1\)"):
        check_muon_args(ours.parse_args(["--qk-clip-threshold=5", "--qk-clip-alpha=1.0"]))
    check_muon_args(ours.parse_args(["--qk-clip-alpha=1.0"]))  # QK-clip off: not read


def test_megatron_lm_integration_takes_over_qk_clip_for_muon_with_megatron_fsdp():
    from megatron_muon.integrations.megatron_lm_arguments import _take_over_qk_clip
    from megatron_muon.sharded.config import qk_clip_threshold

    args = argparse.Namespace(qk_clip=True, qk_clip_threshold=20.0, qk_clip_alpha=0.5)
    _take_over_qk_clip(args)
    # Megatron's train_step then never calls its clip_qk; ours clips at Megatron's threshold.
    assert args.qk_clip is False and args.muon_qk_clip is True
    assert qk_clip_threshold(args) == 20.0
    off = argparse.Namespace(qk_clip=False, qk_clip_threshold=100.0)
    _take_over_qk_clip(off)
    assert qk_clip_threshold(off) is None


def test_bad_config_values_are_refused_by_name():
    from megatron_muon.sharded.config import MuonFsdpConfig

    with pytest.raises(ValueError, match="'float32'"):
        MuonFsdpConfig(gram_half_dtype="float32")  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(ValueError, match="0.0"):
        MuonFsdpConfig(qk_clip_threshold=0.0)


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
