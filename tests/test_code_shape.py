"""scripts/check_code_shape.py (run by `make lint`) names each module over 400 lines, each class
over 300 and each `type: ignore` without its code and reason, and passes a file within the limits.

And no module imports a test module (``tests/**/test_*.py``): what two test modules share lives in
a helper module under tests/ named by what it provides (``tests/muon_reference.py``, ...), so that
importing one test module never collects, runs the module-level code of, or couples to another.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun import REPO

SCRIPT = REPO / "scripts" / "check_code_shape.py"
# Where a test module could be imported from: the tests and what runs beside them.
IMPORTING_DIRS = ("tests", "benchmarks", "examples")


def _check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True
    )


def test_a_module_within_the_limits_passes(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("x: int = 1  # type: ignore[assignment]  # the reason\n")
    result = _check(ok)
    assert result.returncode == 0, result.stdout
    assert "1 files within limits" in result.stdout


def test_oversized_module_and_class_and_bare_ignores_are_named(tmp_path):
    big = tmp_path / "big.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(301))
    big.write_text(f"class Large:\n{body}\n" + "y = 0\n" * 100)
    ignores = tmp_path / "ignores.py"
    ignores.write_text("a = 1  # type: ignore\nb = 2  # type: ignore[assignment]\n")
    result = _check(big, ignores)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"{big}: module has 402 lines (limit 400)" in lines
    assert f"{big}:1: class Large has 302 lines (limit 300)" in lines
    assert [line for line in lines if line.startswith(f"{ignores}:")] == [
        f"{ignores}:1: `type: ignore` without `[code]  # reason`: a = 1  # type: ignore",
        f"{ignores}:2: `type: ignore` without `[code]  # reason`: "
        "b = 2  # type: ignore[assignment]",
    ]


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of a test module (``test_*``) of this repository in
    ``source``: ``tests.test_x`` however spelled (``import``, ``from tests import test_x``), a
    relative ``.test_x``, or a top-level ``test_x`` (tests/bridge puts its folder on sys.path)."""

    def is_test_module(name: str) -> bool:
        parts = name.lstrip(".").split(".")
        ours = name.startswith(".") or parts[0] == "tests" or len(parts) == 1
        return ours and any(part.startswith("test_") for part in parts[:2])

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if is_test_module(base):
                found.append((node.lineno, base))
            else:  # from tests import test_x; from . import test_x
                names = [
                    f"{base}.{a.name}" if node.module else f"{base}{a.name}" for a in node.names
                ]
                found += [(node.lineno, name) for name in names if is_test_module(name)]
    return found


SPELLINGS = {
    "from_module": "from tests.test_sharded_muon import MUON_KWARGS",
    "import_module": "import tests.test_sharded_muon",
    "from_package": "from tests import test_sharded_muon",
    "relative_module": "from .test_sharded_muon import MUON_KWARGS",
    "relative_package": "from . import test_sharded_muon",
    "inside_a_function": "def body():\n    from tests.test_checkpointing import snapshot",
    "top_level": "import test_bridge_config",
}


@pytest.mark.parametrize("source", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_every_spelling_of_a_test_module_import_is_found(source):
    assert imported_test_modules(source), source


def test_imports_of_helper_modules_and_libraries_are_not_test_module_imports():
    source = (
        "from tests.muon_reference import MUON_KWARGS\nimport torch.testing\n"
        "from megatron_muon.testing import run_on_ranks\nfrom tests import gpt_parity\n"
    )
    assert imported_test_modules(source) == []


def test_no_module_imports_a_test_module():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: imports {name}"
        for folder in IMPORTING_DIRS
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, name in imported_test_modules(path.read_text())
    ]
    assert offenders == [], "move what they share into a helper module:\n" + "\n".join(offenders)
