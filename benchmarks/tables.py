"""How the sections show their figures: Markdown table rows and the units of bytes and FLOPs."""

from __future__ import annotations

__all__ = ["gflop", "mib", "row", "table"]


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def gflop(value: float) -> str:
    return f"{value / 1e9:.1f}"


def row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A Markdown table (header, rule, rows) and the blank line after it."""
    return [row(header), row(["---"] * len(header)), *(row(r) for r in rows), ""]
