"""``python -m megatron_muon.convert --from torch_dist|fsdp_dtensor SRC DST``.

Converts a Megatron-LM checkpoint of megatron-core's DDP with the distributed optimizer
(``torch_dist``: Adam saved with ``--dist-ckpt-optim-fully-reshardable``, or Muon with
``--use-distributed-optimizer``, i.e. ``LayerWiseDistributedOptimizer``) into Megatron-FSDP's
``fsdp_dtensor``, or back: model, Adam's state or Muon's momentum (AdamW's state for the rest),
param groups, scheduler, iteration, ``args``.
One process, no GPU (both formats hold global tensors: any TP/DP on either side). Exit status 2
and one line naming what cannot map where a layout or state is refused.
"""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from megatron_muon.checkpointing.errors import UnsafeCheckpointError
from megatron_muon.convert.names import FormatT
from megatron_muon.convert.run import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_muon.convert", description=__doc__)
    parser.add_argument("--from", dest="source_format", required=True, choices=get_args(FormatT))
    parser.add_argument("source", help="checkpoint root (its tracker) or an iter_XXXXXXX dir")
    parser.add_argument("target", help="root to write iter_XXXXXXX and the tracker into")
    args = parser.parse_args(argv)
    try:
        summary = convert(args.source_format, args.source, args.target)
    # ConversionRefused is a ValueError; OSError: no checkpoint there, or DST holds it already.
    except (ValueError, OSError, UnsafeCheckpointError) as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    print("\n".join(summary.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
