"""Checks the package's shape (run by `make lint`): no module over 400 lines, no class over 300,
and every `type: ignore` names its error code and says why (`# type: ignore[code]  # reason`).

Usage: python scripts/check_code_shape.py [PATH ...]  (default: megatron_muon). Prints one line per
offender, naming the file (and class) with its size and the limit, and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
# A `type: ignore` with its codes and, after two spaces, a comment giving the reason.
IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<rest>.*)$")
IGNORE_WITH_REASON = re.compile(r"^\[[a-z-]+(, *[a-z-]+)*\]  # \S")


def problems_in(path: Path) -> list[str]:
    """The size and `type: ignore` problems of one Python file, one message each."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    if len(lines) > MAX_MODULE_LINES:
        found.append(f"{path}: module has {len(lines)} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > MAX_CLASS_LINES:
                found.append(
                    f"{path}:{node.lineno}: class {node.name} has {size} lines "
                    f"(limit {MAX_CLASS_LINES})"
                )
    for number, line in enumerate(lines, start=1):
        match = IGNORE.search(line)
        if match and not IGNORE_WITH_REASON.match(match["rest"]):
            found.append(
                f"{path}:{number}: `type: ignore` without `[code]  # reason`: {line.strip()}"
            )
    return found


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("megatron_muon")]
    files = sorted(f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py")))
    found = [message for path in files for message in problems_in(path)]
    for message in found:
        print(message)
    if found:
        print(f"code shape: {len(found)} problem(s) in {len(files)} files", file=sys.stderr)
        return 1
    print(f"code shape: {len(files)} files within limits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
