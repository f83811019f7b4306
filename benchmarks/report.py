"""``python -m benchmarks.report [bench_out/results.json]``: a past run's Markdown tables.

Prints what ``python -m benchmarks`` wrote to ``results.md`` (and ``docs/benchmarks.md`` records),
from its ``results.json``: each section's lines, by the sections of ``benchmarks.__main__``.
"""

from __future__ import annotations

import json
import sys

from benchmarks.__main__ import format_markdown

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = args[0] if args else "bench_out/results.json"
    with open(path) as f:
        print(format_markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
