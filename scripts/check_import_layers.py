"""Checks that megatron_muon's subpackages import each other one way only (`make lint`).

Each subpackage may import the subpackages listed for it in ``ALLOWED`` (and itself); the
top-level entry points (``pretrain``, ``demo``, ``__init__``) may import anything. Every
``import`` and ``from ... import`` in the package is read with ``ast``, at any depth (imports
inside functions count: a lazy import is a dependency too). docs/architecture.md draws the layers.

Usage: ``python scripts/check_import_layers.py [package_dir]``; exit status 1 and one line per
forbidden import when the rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "megatron_muon"
# Lowest first: common <- newton_schulz <- sharded <- checkpointing <- fsdp <- integrations <- cli.
_CORE = ["common", "newton_schulz", "sharded", "checkpointing", "fsdp"]
ALLOWED: dict[str, set[str]] = {layer: set(_CORE[:index]) for index, layer in enumerate(_CORE)} | {
    "cpu_stand_ins": {"common"},
    "plan": {"common", "newton_schulz", "sharded"},
    "integrations": {*_CORE, "cpu_stand_ins"},
    "cli": {*_CORE, "cpu_stand_ins", "integrations"},
    "testing": {"common", "cpu_stand_ins"},
}
ENTRY_POINTS = {"__init__", "pretrain", "demo"}


def subpackage(module: str) -> str:
    """``megatron_muon.sharded.layout`` -> ``sharded``; a top-level module -> its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import of the package in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level if path.name != "__init__.py" else None]
                if path.name == "__init__.py" and node.level > 1:
                    base = module.split(".")[: 1 - node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == PACKAGE]


def violations(package_dir: Path) -> list[str]:
    """One line per import that crosses the layers the wrong way (or names an unknown layer)."""
    lines = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        source = subpackage(module)
        if source in ENTRY_POINTS and len(relative.parts) == 2:
            continue
        if source not in ALLOWED:
            lines.append(f"{path}: module {module} is at the package's top level")
            continue
        for line, name in imported_modules(path, module):
            target = subpackage(name)
            if target in (source, PACKAGE) or len(name.split(".")) < 2:
                continue
            if target not in ALLOWED[source]:
                lines.append(
                    f"{path}:{line}: {source} imports {name} ({target}); {source} may import "
                    f"only {sorted(ALLOWED[source]) or 'nothing of the package'}"
                )
    return lines


def main() -> int:
    package_dir = Path(sys.argv[1] if len(sys.argv) > 1 else PACKAGE)
    found = violations(package_dir)
    for line in found:
        print(line)
    layers = len(ALLOWED)
    print(f"import layers: {'ok' if not found else f'{len(found)} violations'} ({layers} layers)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
