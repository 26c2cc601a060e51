"""rein's packages form layers, and an import only goes down them.

    core ← {kernels, fixtures} ← model ← engine ← openai ← store ← jobs ← batches
         ← {api, worker, offline} ← cli

Each package may import the ones below it, never one above, and api, worker and offline never
import each other; there are no exceptions. Every import of `rein` is counted, at module
level and inside functions alike, read from the source (nothing is imported).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rein"

LAYERS = [{"core"}, {"kernels", "fixtures"}, {"model"}, {"engine"}, {"openai"}, {"store"}, {"jobs"}, {"batches"},
          {"api", "worker", "offline"}, {"cli"}]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rein_imports() -> dict[str, set[str]]:
    """Module -> the rein modules it imports (anywhere in its source)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            found[name].update(t for t in targets if t == "rein" or t.startswith("rein."))
    return found


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(pkg: str) -> int:
    for index, members in enumerate(LAYERS):
        if pkg in members:
            return index
    raise AssertionError(f"rein.{pkg} is in no layer: add it to LAYERS in {__file__}")


def arrows() -> list[tuple[str, str]]:
    """(importer, imported) for every import between two packages."""
    return [(source, target) for source, targets in rein_imports().items() for target in targets
            if package(source) and package(target) and package(source) != package(target)]


def test_every_module_is_in_a_package_of_some_layer():
    loose = sorted(m for m in rein_imports() if m.count(".") == 1 and not (ROOT / m.split(".")[1]).is_dir()
                   and m not in ("rein.__main__",))
    assert loose == [], f"modules outside any package (put them in the layer they belong to): {loose}"
    for path in ROOT.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            layer(path.name)


def test_imports_only_go_down_the_layers():
    wrong = [f"{source} -> {target}" for source, target in arrows()
             if layer(package(target)) >= layer(package(source))]
    assert wrong == [], "imports that go up (or across) the layers:\n" + "\n".join(sorted(wrong))


def test_no_circles_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in arrows():
        graph[package(source)].add(package(target))

    def reaches(start: str, goal: str) -> bool:
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
        return False

    circles = sorted({tuple(sorted((a, b))) for a in list(graph) for b in graph[a] if reaches(b, a)})
    assert circles == [], f"packages that import each other (directly or through others): {circles}"
