"""The package layout of tasks/ (README: Layout): one package per stage, the shared contract at the top.

Imports go from a stage package to the shared contract only, never between stage packages nor from the
contract to a stage, and no module imports itself back through others. Read from the source (ast), lazy
imports inside functions included, so the rule holds for every import, not only those done at load time.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tasks.config import PROJECT_ROOT

TASKS = PROJECT_ROOT / "tasks"
STAGES = ("prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter")


def _module(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """tasks module -> the tasks modules it imports (a package import counts as its __init__)."""
    modules = {_module(p): p for p in TASKS.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _owner(module: str) -> str:
    """The stage package a module belongs to, or 'contract' for the shared modules and packages."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else "contract"


def test_every_stage_has_its_package_with_a_stage_module() -> None:
    for stage in STAGES:
        assert (TASKS / stage / "stage.py").is_file(), stage
    loose = sorted(p.stem for p in TASKS.glob("*.py") if p.stem in STAGES)
    assert not loose, f"stage modules outside their package: {loose}"


def test_imports_point_only_toward_the_shared_contract() -> None:
    wrong = [f"{a} -> {b}" for a, targets in _imports().items() for b in targets
             if _owner(b) != "contract" and _owner(b) != _owner(a)]
    assert not wrong, "imports between stage packages, or from the contract into a stage:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "import circles:\n" + "\n".join(circles)
