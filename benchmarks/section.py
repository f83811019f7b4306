"""What a section of ``python -m benchmarks`` is, and what every section is given.

A section is one module (``benchmarks.headline``, ``benchmarks.buckets``, ...) holding its
measurement, the figures it must produce and how they are shown, exported as a ``Section``:

- ``key``: where its figures go in ``results.json``;
- ``run(context, results)``: measures and returns the figures (``results``: those of the sections
  run before it, which a section may read, e.g. the stock comparison reads the headline's);
- ``figures``: dotted paths into ``results.json`` the run must hold (``*``: every key at that
  level), checked by ``missing_figures`` before anything is written;
- ``report(results)`` / ``markdown(results)``: its lines in the terminal table and in
  ``results.md`` (none for the sections whose tables docs/benchmarks.md writes by hand).

``benchmarks/__main__.py`` lists the sections in the order they run and are shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig

__all__ = ["RunContext", "Section", "missing_figures"]


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every section of one run is given.

    Attributes:
        config: the run's sizes and repeat counts (``benchmarks.config``: ``FULL`` or ``QUICK``).
        device: ``"cpu"`` (gloo ranks, one thread each) or ``"cuda"``.
        dp_sizes: the data-parallel sizes the run measures (``config.dp_sizes``).
        out_dir: where ``results.json``, ``results.md`` and a section's own files are written.
        quick: ``--quick`` (tiny sizes).
    """

    config: BenchConfig
    device: str
    dp_sizes: list[int]
    out_dir: Path
    quick: bool


def _no_lines(results: dict) -> list[str]:
    return []


@dataclass(frozen=True, slots=True)
class Section:
    """One section of the run (module docstring).

    Attributes:
        peers: run only with ``--peers`` (``make bench``).
        derived: computed from earlier sections' figures, nothing measured: no progress line and
            no entry in ``meta.section_seconds``.
    """

    key: str
    run: Callable[[RunContext, dict], Any]
    figures: tuple[str, ...] = ()
    report: Callable[[dict], list[str]] = _no_lines
    markdown: Callable[[dict], list[str]] = _no_lines
    peers: bool = False
    derived: bool = False


def missing_figures(results: dict, figures: tuple[str, ...]) -> list[str]:
    """Each of ``figures`` (dotted paths) absent from ``results``, with ``*`` replaced by the keys
    present (a ``*`` level with no keys at all is reported with the ``*`` in place)."""
    missing: list[str] = []

    def walk(node: object, parts: list[str], done: list[str]) -> None:
        if not parts:
            return
        head, rest = parts[0], parts[1:]
        if head == "*" and isinstance(node, dict) and node:
            for key, child in node.items():
                walk(child, rest, [*done, key])
        elif head != "*" and isinstance(node, dict) and node.get(head) is not None:
            walk(node[head], rest, [*done, head])
        else:
            missing.append(".".join(done + parts))

    for figure in figures:
        walk(results, figure.split("."), [])
    return missing
