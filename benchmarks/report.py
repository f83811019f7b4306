"""``python -m benchmarks.report [bench_out/results.json]``: a past run's Markdown tables.

Prints what ``python -m benchmarks`` wrote to ``results.md`` (and ``docs/benchmarks.md`` records),
from its ``results.json``: each section's lines, by the sections of ``benchmarks.__main__``.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.__main__ import format_markdown

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Print a past `python -m benchmarks` run's Markdown tables (its results.md).",
    )
    parser.add_argument(
        "results", nargs="?", default="bench_out/results.json", help="the run's results.json"
    )
    with open(parser.parse_args(argv).results) as f:
        print(format_markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
