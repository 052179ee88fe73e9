"""The package layout (README: Layout): which group of modules may import which.

tasks/ is layered. At the bottom the base (config, errors, log, credentials, offline, tested_versions, methods,
allowed and the package's own __init__), which imports nothing of the pipeline but itself. Above it the contract's
groups, each a package named for what it holds, each importing the base, itself and the groups below it only: the
GPU pool and CPU share, hashing, the on-disk contract, models and devices, the registry, the reward functions (a
reward model is a registry version), sweeps, reporting. At the top one package per stage, importing the base and the
contract, never another stage. Nothing in tasks/ imports flows/ or deployments/, flows/ never imports deployments/,
and no module imports itself back through others. Read from the source (ast), lazy imports inside functions
included, so the rules hold for every import, not only those done at load time.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tasks.config import PROJECT_ROOT

TASKS = PROJECT_ROOT / "tasks"
STAGES = ("prepare_data", "prepare_model", "train_adapter", "evaluate_adapter", "export_adapter")
BASE = ("tasks", "tasks.config", "tasks.errors", "tasks.log", "tasks.credentials", "tasks.offline",
        "tasks.tested_versions", "tasks.methods", "tasks.allowed")
# the contract's groups, lowest first: a group imports the base, itself and the groups before it
CONTRACT = ("pool", "hashing", "on_disk", "models", "registry", "rewards", "sweep", "reporting")


def _module(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(*folders: str) -> dict[str, set[str]]:
    """module -> the project's modules it imports (a package import counts as its __init__), for the modules under
    `folders` (tasks/ by default)."""
    modules = {_module(p): p for p in PROJECT_ROOT.glob("*/**/*.py")
               if p.relative_to(PROJECT_ROOT).parts[0] in ("tasks", "flows", "deployments")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name.split(".")[0] not in (folders or ("tasks",)):
            continue
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _group(module: str) -> str:
    """'base', the contract group, the stage package or the top folder (flows, deployments) a module belongs to."""
    parts = module.split(".")
    if module in BASE:
        return "base"
    if parts[0] != "tasks":
        return parts[0]
    return parts[1] if len(parts) > 2 or parts[1] in (*CONTRACT, *STAGES) else f"unplaced ({module})"


def _allowed(group: str) -> set[str]:
    if group == "base":
        return {"base"}
    if group in CONTRACT:
        return {"base", *CONTRACT[:CONTRACT.index(group) + 1]}
    if group in STAGES:
        return {"base", *CONTRACT, group}
    return set()


def test_every_stage_has_its_package_with_a_stage_module() -> None:
    for stage in STAGES:
        assert (TASKS / stage / "stage.py").is_file(), stage
    loose = sorted(p.stem for p in TASKS.glob("*.py") if p.stem in STAGES)
    assert not loose, f"stage modules outside their package: {loose}"


def test_every_module_of_tasks_is_in_a_layer() -> None:
    """A new module goes into the base (imports nothing of the pipeline), a contract group or a stage package."""
    placed = set(CONTRACT) | set(STAGES) | {"base"}
    unplaced = sorted(g for g in map(_group, _imports()) if g not in placed)
    assert not unplaced, "modules of tasks/ in no layer (name them in BASE, or move them into a group):\n" + \
        "\n".join(unplaced)


def test_imports_point_down_the_layers() -> None:
    wrong = [f"{a} ({_group(a)}) -> {b} ({_group(b)})" for a, targets in _imports().items() for b in targets
             if _group(b) not in _allowed(_group(a))]
    assert not wrong, ("imports up the layers, between stage packages, or into flows/deployments (tests/"
                       "test_structure.py says which group may import which):\n" + "\n".join(wrong))


def test_flows_import_tasks_and_flows_only() -> None:
    wrong = [f"{a} -> {b}" for a, targets in _imports("flows").items() for b in targets if _group(b) == "deployments"]
    assert not wrong, "imports point deployments -> flows -> tasks:\n" + "\n".join(wrong)


def test_cache_keys_are_made_one_way() -> None:
    """Every cache key is tasks/hashing/keys.py cache_key's (its docstring holds the rule): no module cuts a
    hash_json digest to a key of its own."""
    cut = []
    for path in sorted(TASKS.rglob("*.py")) + sorted((PROJECT_ROOT / "flows").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "hash_json"):
                cut.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}")
    assert [c.split(":")[0] for c in cut] == ["tasks/hashing/keys.py"], cut


def test_no_import_circles() -> None:
    graph = _imports("tasks", "flows")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "import circles:\n" + "\n".join(circles)
