"""Checks that megatron_muon's subpackages import each other one way only (`make lint`).

Each subpackage may import the subpackages listed for it in ``ALLOWED`` (and itself); the
top-level entry points (``pretrain``, ``demo``, ``__init__``) may import anything. Every
``import`` and ``from ... import`` in the package is read with ``ast``, at any depth (imports
inside functions count: a lazy import is a dependency too). docs/architecture.md draws the layers.
Inside each subpackage, modules import each other one way too, and so do the modules of
``benchmarks/``: no import cycle (``import_cycles``).

Usage: ``python scripts/check_import_layers.py [package_dir]``; exit status 1 and one line per
forbidden import or cycle when a rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "megatron_muon"
# Lowest first: common <- newton_schulz <- engine <- optimizers <- checkpointing <- fsdp <-
# integrations <- cli.
_CORE = ["common", "newton_schulz", "engine", "optimizers", "checkpointing", "fsdp"]
ALLOWED: dict[str, set[str]] = {layer: set(_CORE[:index]) for index, layer in enumerate(_CORE)} | {
    "cpu_stand_ins": {"common"},
    "plan": {"common", "newton_schulz", "engine"},
    # The deprecated module paths of 0.1 (megatron_muon.sharded.*), aliased by name at import time.
    "sharded": {"common"},
    "integrations": {*_CORE, "cpu_stand_ins"},
    "cli": {*_CORE, "cpu_stand_ins", "integrations"},
    "testing": {"common", "cpu_stand_ins"},
    # python -m megatron_muon.convert: checkpoints read and written in one process.
    "convert": {"common", "checkpointing"},
}
ENTRY_POINTS = {"__init__", "pretrain", "demo"}


def subpackage(module: str) -> str:
    """``megatron_muon.engine.layout`` -> ``engine``; a top-level module -> its own name."""
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


# Directories beside the package whose modules must not import each other in a circle, read the
# same way (every import at any depth): a helper two modules share goes into a third that both
# import, never one importing the other's private names.
ACYCLIC = ("benchmarks",)


def module_graph(directory: Path) -> dict[str, set[str]]:
    """``{module: modules of the same directory it imports}`` for every ``*.py`` under
    ``directory`` (modules named from its parent, e.g. ``benchmarks.headline``). Every ``import``
    at any depth counts (inside functions and ``if TYPE_CHECKING:`` too); ``from benchmarks import
    x`` names the module ``benchmarks.x`` where that file exists, the package otherwise."""
    root = directory.name
    modules = {
        ".".join(path.relative_to(directory.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        ): path
        for path in sorted(directory.rglob("*.py"))
    }

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == root else None
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def package_graph(package_dir: Path) -> dict[str, set[str]]:
    """``module_graph`` of the package less its top-level entry points (``__init__``,
    ``pretrain``, ``demo`` may import anything; importing the package itself is no edge between
    modules)."""
    top = package_dir.name
    graph = module_graph(package_dir)
    entry = {top} | {f"{top}.{name}" for name in ENTRY_POINTS}
    return {module: targets - entry for module, targets in graph.items() if module not in entry}


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """The import cycles of a module graph, one per strongly connected component (Tarjan's
    algorithm): (its modules, one cycle through them, the first module repeated last). A cycle
    counts even where a function-level import keeps Python from failing.
    """
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
    for component, cycle in import_cycles(package_graph(package_dir)):
        short = [module.removeprefix(f"{PACKAGE}.") for module in component]
        lines.append(
            f"import cycle among {', '.join(short)}: "
            f"{' -> '.join(m.removeprefix(f'{PACKAGE}.') for m in cycle)} (a subpackage's "
            "modules import each other one way; move what both need into a module they import)"
        )
    return lines


def cycle_violations(repo: Path) -> list[str]:
    """One line per import circle among the modules of each ``ACYCLIC`` directory."""
    lines = []
    for directory in ACYCLIC:
        for group, cycle in import_cycles(module_graph(repo / directory)):
            lines.append(
                f"{repo / directory}: {', '.join(group)} import each other in a circle "
                f"({' -> '.join(cycle)}); move what both need into a module both import"
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
    circles = cycle_violations(package_dir.resolve().parent)
    for line in circles:
        print(line)
    print(f"import circles in {', '.join(ACYCLIC)}: {len(circles) or 'none'}")
    return 1 if found or circles else 0


if __name__ == "__main__":
    sys.exit(main())
