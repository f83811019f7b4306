"""Slow bf16 on a CPU is detected from measured rates and named with the flag that avoids it."""

from __future__ import annotations

import argparse

from megatron_muon import pretrain
from megatron_muon.fsdp.arguments import add_muon_args
from megatron_muon.newton_schulz import matmul_rates
from megatron_muon.newton_schulz.matmul_rates import (
    FP32_NS_FLAGS,
    bf16_is_slow,
    measure_matmul_rates,
    slow_bf16_message,
)

# A Zen 3 core (AVX2, no bf16 instructions) as measured: 84 GFLOP/s fp32, 1.0 GFLOP/s bf16.
ZEN3 = {"fp32": 84e9, "bf16": 1.0e9}
# An Intel Xeon with AVX512-BF16 at 256^3, as measured: 122 fp32, 70 bf16.
XEON_BF16 = {"fp32": 122e9, "bf16": 70e9}


def test_measured_rates_are_positive_for_both_dtypes():
    rates = measure_matmul_rates(size=64, repeats=1)
    assert set(rates) == {"fp32", "bf16"} and min(rates.values()) > 0


def test_bf16_is_slow_only_without_bf16_instructions():
    assert bf16_is_slow(ZEN3)
    assert not bf16_is_slow(XEON_BF16)


def test_the_notice_gives_the_rates_the_slowdown_and_the_flag():
    message = slow_bf16_message(ZEN3)
    assert "1.0 GFLOP/s" in message and "84.0 in fp32" in message and "~84x" in message
    assert " ".join(FP32_NS_FLAGS) + " (fp32 matmuls" in message


def test_the_flag_named_is_one_megatrons_parser_accepts():
    args = add_muon_args(argparse.ArgumentParser()).parse_args(list(FP32_NS_FLAGS))
    assert args.muon_fp32_matmul_prec == FP32_NS_FLAGS[1]


def test_the_entry_point_says_it_once_for_muon_at_megatrons_default_precision(monkeypatch, capsys):
    monkeypatch.setattr(matmul_rates, "measure_matmul_rates", lambda: ZEN3)
    monkeypatch.setenv("RANK", "0")
    pretrain._notice_slow_bf16(argparse.Namespace(optimizer="muon", muon_fp32_matmul_prec="medium"))
    assert capsys.readouterr().out.count(" ".join(FP32_NS_FLAGS) + " (fp32") == 1
    for args in (
        argparse.Namespace(optimizer="muon", muon_fp32_matmul_prec="high"),
        argparse.Namespace(optimizer="adam", muon_fp32_matmul_prec="medium"),
    ):
        pretrain._notice_slow_bf16(args)
    monkeypatch.setenv("RANK", "1")
    pretrain._notice_slow_bf16(argparse.Namespace(optimizer="muon", muon_fp32_matmul_prec="medium"))
    assert capsys.readouterr().out == ""
