"""``python -m megatron_muon.plan``: NS work, bytes and memory per GPU for a model at a DP size.

Examples::

    python -m megatron_muon.plan --model llama3-8b --dp 64
    python -m megatron_muon.plan --model deepseek-v3 --dp 1024 --ep 64 --json out.json
    python -m megatron_muon.plan --config configs/llama3-8b.yaml --dp 256 --tp 2
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from megatron_muon.engine.config import DEFAULT_BUCKET_SIZE_BYTES
from megatron_muon.newton_schulz.methods import DEFAULT_NS_METHOD, NSMethodT
from megatron_muon.plan.model_specs import PRESETS, load_model_config
from megatron_muon.plan.models import default_parallelism
from megatron_muon.plan.report import analyze, format_report
from megatron_muon.plan.strategies import GroupInput
from megatron_muon.plan.tp_modes import TP_MODES, format_tp_modes, tp_mode_figures

_NS_BYTES = {"medium": 2, "high": 4, "highest": 4}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_muon.plan",
        description="Per-GPU Newton-Schulz work, bytes moved, peak extra memory and collectives "
        "of one Muon step under Megatron-FSDP, for our owner plan and three baselines.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(PRESETS), help="a model preset")
    source.add_argument("--config", help="a YAML file with ModelSpec keys (see configs/)")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ep", type=int, help="expert-parallel size (default: the preset's)")
    parser.add_argument("--expt-dp", type=int, help="expert-data-parallel size")
    parser.add_argument("--ns-steps", type=int, default=5, help="NS iterations")
    parser.add_argument(
        "--ns-method",
        choices=get_args(NSMethodT),
        default=DEFAULT_NS_METHOD,
        help="--muon-ns-method: the NS method, priced through its FLOP count",
    )
    parser.add_argument(
        "--matmul-prec",
        choices=sorted(_NS_BYTES),
        default="medium",
        help="--muon-fp32-matmul-prec: 'medium' runs NS (and split-NS collectives) in bf16",
    )
    parser.add_argument(
        "--max-split", type=int, default=16, help="largest rank block one matrix's NS may use"
    )
    parser.add_argument(
        "--flops-per-byte",
        type=float,
        default=0.0,
        help="price of one byte of split-NS traffic in NS FLOPs when planning (0, ShardedMuon's "
        "default: FLOPs only; ~1e3 NVLink-class)",
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_SIZE_BYTES / 2**20,
        help="owner exchange bucket bound (ShardedMuon bucket_size_bytes) in MiB; default: "
        "ShardedMuon's; 0: unbounded (one bucket)",
    )
    parser.add_argument("--json", help="also write the figures as JSON to this path ('-': stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    spec = PRESETS[args.model] if args.model else load_model_config(args.config)
    bucket_bytes = int(args.bucket_mb * 2**20) if args.bucket_mb else None
    try:
        parallel = default_parallelism(spec, args.dp, args.tp, args.ep, args.expt_dp)
        report = analyze(
            spec,
            parallel,
            num_ns_steps=args.ns_steps,
            ns_method=args.ns_method,
            ns_bytes=_NS_BYTES[args.matmul_prec],
            max_split=args.max_split,
            bucket_bytes=bucket_bytes,
            flops_per_byte=args.flops_per_byte,
        )
        settings = GroupInput(
            (), (), 1, args.ns_steps, _NS_BYTES[args.matmul_prec], args.max_split, bucket_bytes,
            args.flops_per_byte, ns_method=args.ns_method,
        )  # fmt: skip
        tp_modes = (
            [tp_mode_figures(spec, parallel, mode, settings) for mode in TP_MODES]
            if parallel.tp > 1 or parallel.expert_tp > 1
            else []
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(format_report(report))
        if tp_modes:
            print("\n" + format_tp_modes(tp_modes))
    if args.json:
        text = json.dumps(
            {**report.to_dict(), "tp_modes": [f.to_dict() for f in tp_modes]}, indent=2
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
