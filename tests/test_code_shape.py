"""scripts/check_code_shape.py (run by `make lint`) names each module over 400 lines, each class
over 300 and each `type: ignore` without its code and reason, and passes a file within the limits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.torchrun import REPO

SCRIPT = REPO / "scripts" / "check_code_shape.py"


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
