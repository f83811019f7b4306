"""Checks that megatron_muon's subpackages import each other one way only (`make lint`).

Each subpackage may import the subpackages listed for it in ``ALLOWED`` (and itself); the
top-level entry points (``pretrain``, ``demo``, ``__init__``) may import anything. Every
``import`` and ``from ... import`` in the package is read with ``ast``, at any depth (imports
inside functions count: a lazy import is a dependency too). docs/architecture.md draws the layers.
Inside each subpackage, modules import each other one way too: no import cycle (``import_cycles``).

Usage: ``python scripts/check_import_layers.py [package_dir]``; exit status 1 and one line per
forbidden import or cycle when a rule is broken.
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


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of its own subpackage that it imports (at any depth).

    An imported name resolves to the longest module name that is a prefix of it
    (``megatron_muon.integrations.megatron_lm.install`` -> ``...megatron_lm``); importing a
    subpackage itself (``from megatron_muon.checkpointing import X``) is an edge to its
    ``__init__``. The top-level entry points are in no subpackage and left out.
    """
    paths = {}
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent).with_suffix("")
        paths[".".join(relative.parts).removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        if subpackage(module) in ENTRY_POINTS:
            continue
        graph[module] = set()
        for _, name in imported_modules(path, module):
            parts = name.split(".")
            prefixes = (".".join(parts[:n]) for n in range(len(parts), 1, -1))
            target = next((prefix for prefix in prefixes if prefix in paths), None)
            if target and target != module and subpackage(target) == subpackage(module):
                graph[module].add(target)
    return graph


def import_cycles(package_dir: Path) -> list[tuple[list[str], list[str]]]:
    """The import cycles inside each subpackage, one per strongly connected component of
    ``module_graph`` (Tarjan's algorithm): (its modules, one cycle through them, the first module
    repeated last). A cycle counts even where a function-level import keeps Python from failing.
    """
    graph = module_graph(package_dir)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [(component, _one_cycle(graph, component)) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module] & members):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target not in previous:
                    previous[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its strongly connected component")


def cycle_lines(package_dir: Path) -> list[str]:
    """One line per import cycle inside a subpackage."""
    lines = []
    for component, cycle in import_cycles(package_dir):
        short = [module.removeprefix(f"{PACKAGE}.") for module in component]
        lines.append(
            f"import cycle among {', '.join(short)}: "
            f"{' -> '.join(m.removeprefix(f'{PACKAGE}.') for m in cycle)} (a subpackage's "
            "modules import each other one way; move what both need into a module they import)"
        )
    return lines


def main() -> int:
    package_dir = Path(sys.argv[1] if len(sys.argv) > 1 else PACKAGE)
    found = violations(package_dir)
    found += cycle_lines(package_dir)
    for line in found:
        print(line)
    layers = len(ALLOWED)
    print(f"import layers: {'ok' if not found else f'{len(found)} violations'} ({layers} layers)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
