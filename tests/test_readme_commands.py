"""The commands and links of README.md and docs/*.md still work as written.

Every fenced ``bash`` block of README.md and docs/*.md is split into commands (``\\`` continuations
joined, ``#`` comments dropped), and each command is checked by what it is:

- ``make TARGET ...``: ``make -n TARGET`` succeeds (the target exists; nothing runs);
- ``pip install .[EXTRA]``: the repository is a package and declares each extra;
- ``bash scripts/X.sh ...``: the script exists and parses (``bash -n``);
- ``python -m MODULE ...``, ``python FILE ...`` (also ``.venv/bin/python``) and ``torchrun ... -m
  MODULE|FILE ...`` (also ``.venv/bin/torchrun``): ``python -m MODULE --help`` / ``python FILE
  --help`` exits 0, in one process on CPU;
- a block preceded by ``<!-- runs-on-cpu -->`` is run as written instead (``python`` is this
  interpreter), so it must stay cheap on CPU;
- a block preceded by ``<!-- not-run: REASON -->`` is skipped with its reason (a command that needs
  a file outside this repository, such as Megatron-LM's ``pretrain_gpt.py``).

A command of any other kind fails the test, so that a new one is checked too. Every relative link
(and image) of those files must point at a file of the repository and, for ``FILE.md#anchor``, at
a heading of that file (GitHub's anchors).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

HELP_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_MARKER = re.compile(r"^<!--\s*(runs-on-cpu|not-run:\s*(?P<reason>.+?))\s*-->$")


@dataclass(frozen=True)
class Command:
    """One shell command of a ``bash`` block: its file and line, its words, the block's marker."""

    where: str
    argv: tuple[str, ...]
    mode: str  # "check", "run" or "skip"
    reason: str = ""


def _bash_blocks(path: Path) -> list[tuple[int, list[str], str, str]]:
    """(first line number, lines, mode, reason) of each ``bash`` block of ``path``."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(3).strip()
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence.group(2)):
            body.append(lines[i])
            i += 1
        i += 1
        if lang != "bash":
            continue
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = _MARKER.match(before)
        mode, reason = "check", ""
        if marker and marker.group(1) == "runs-on-cpu":
            mode = "run"
        elif marker:
            mode, reason = "skip", marker.group("reason")
        blocks.append((start + 2, body, mode, reason))
    return blocks


def _commands() -> list[Command]:
    commands = []
    for path in DOCS:
        for first_line, body, mode, reason in _bash_blocks(path):
            joined: list[tuple[int, str]] = []
            pending, pending_line = "", first_line
            for offset, line in enumerate(body):
                if not pending:
                    pending_line = first_line + offset
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                joined.append((pending_line, pending + line))
                pending = ""
            for line_no, text in joined:
                argv = shlex.split(text, comments=True)
                if argv:
                    where = f"{path.relative_to(REPO)}:{line_no}"
                    commands.append(Command(where, tuple(argv), mode, reason))
    return commands


COMMANDS = _commands()


def _python_target(argv: tuple[str, ...]) -> tuple[str, ...] | None:
    """``("-m", MODULE)`` or ``(FILE,)`` of a python or torchrun command; None for others."""
    program = Path(argv[0]).name
    if program not in ("python", "python3", "torchrun"):
        return None
    words = list(argv[1:])
    if program == "torchrun":  # torchrun's own options come first, each `--opt value` or `--opt=v`
        while words and words[0].startswith("--") and words[0] != "-m":
            words = words[1:] if "=" in words[0] else words[2:]
    if words[:1] == ["-m"]:
        return ("-m", words[1])
    return (words[0],)


@cache
def _help(target: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *target, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        env=_env(),
    )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _check(command: Command) -> None:
    argv = command.argv
    target = _python_target(argv)
    if argv[0] == "make":
        for goal in (a for a in argv[1:] if "=" not in a and not a.startswith("-")):
            done = subprocess.run(["make", "-n", goal], cwd=REPO, capture_output=True, text=True)
            assert done.returncode == 0, f"make -n {goal}: {done.stderr}"
    elif argv[:2] == ("pip", "install"):
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        for spec in argv[2:]:
            path, _, extras = spec.partition("[")
            assert (REPO / path / "pyproject.toml").is_file(), f"{spec}: not a package directory"
            for extra in filter(None, extras.rstrip("]").split(",")):
                assert extra in project["optional-dependencies"], f"{spec}: no extra {extra!r}"
    elif argv[0] == "bash":
        script = REPO / argv[1]
        assert script.is_file(), f"{argv[1]} does not exist"
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    elif target is not None:
        if target[0] != "-m":
            assert (REPO / target[0]).is_file(), f"{target[0]} does not exist"
        done = _help(target)
        assert done.returncode == 0, f"{' '.join(target)} --help:\n{done.stderr[-3000:]}"
    else:
        pytest.fail(f"{command.where}: no check for a command {argv[0]!r}; add one to this test")


def _params() -> list[object]:
    params = []
    for command in COMMANDS:
        params.append(pytest.param(command, id=command.where))
    return params


@pytest.mark.parametrize("command", _params())
def test_documented_command_works_as_written(command: Command) -> None:
    if command.mode == "skip":
        pytest.skip(command.reason)
    if command.mode == "check":
        _check(command)
        return
    argv = list(command.argv)
    assert _python_target(command.argv) is not None, "runs-on-cpu blocks hold python commands"
    argv[0] = sys.executable
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env()
    )
    assert done.returncode == 0, f"{shlex.join(command.argv)}:\n{done.stderr[-3000:]}"


def test_readme_has_a_block_that_runs_and_every_skip_says_why() -> None:
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert any(c.mode == "run" for c in readme)
    assert all(c.reason for c in COMMANDS if c.mode == "skip")


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path`` outside fenced code blocks, with their numbers."""
    out, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _FENCE.match(line)
        if match and (fence is None or match.group(2).startswith(fence)):
            fence = None if fence else match.group(2)[:3]
            continue
        if fence is None:
            out.append((number, line))
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: link text kept, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path):
        anchors.update(_HTML_ANCHOR.findall(line))
        heading = _HEADING.match(line)
        if heading:
            base = github_anchor(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return frozenset(anchors)


def _links() -> list[object]:
    params = []
    for path in DOCS:
        for number, line in _prose_lines(path):
            for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                where = f"{path.relative_to(REPO)}:{number}"
                params.append(pytest.param(path, target, id=f"{where}->{target}"))
    return params


@pytest.mark.parametrize(("page", "target"), _links())
def test_relative_link_points_at_an_existing_file_and_heading(page: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    resolved = (page.parent / file_part).resolve() if file_part else page
    assert resolved.is_relative_to(REPO), f"{target}: outside the repository"
    assert resolved.exists(), f"{target}: no such file ({resolved.relative_to(REPO)})"
    if anchor and resolved.suffix == ".md":
        assert anchor in _anchors(resolved), (
            f"{target}: no heading with that anchor in {resolved.relative_to(REPO)}"
        )


def test_github_anchor_matches_githubs_rule() -> None:
    assert github_anchor("Results: GPU") == "results-gpu"
    assert (
        github_anchor("Planning NS work: `python -m x.plan`") == "planning-ns-work-python--m-xplan"
    )
    assert (
        github_anchor("Each owner's queue (2026-11-26, run)") == "each-owners-queue-2026-11-26-run"
    )
