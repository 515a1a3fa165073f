"""The package's structure, checked from its source: imports form no cycle (function-local ones
included), the top level is the subsystem packages and no import points up their layers, only the
engines touch DeepSpeed's engine object, and scripts never edit sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(sub) for sub in ast.walk(node))
    return skipped


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement loads (``from pkg import mod`` loads ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                parent = parent.rpartition(".")[0]
            base = f"{parent}.{base}" if base else parent
        subs = [f"{base}.{alias.name}" for alias in node.names]
        names = [s for s in subs if s in modules] or [base]
    else:
        return []
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_nodes(tree)
        graph[module] = {
            target
            for node in ast.walk(tree)
            if id(node) not in skipped
            for target in _imported(node, module, path.name == "__init__.py", modules)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself, with the path back (depth-first search)."""
    found, done = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            found.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_import_cycles_counting_function_local_imports():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_config_imports_nothing_above_it():
    graph = import_graph()
    above = {
        m: sorted(t for t in targets if not t.startswith("trainer.config")) for m, targets in graph.items()
    }
    assert {m: t for m, t in above.items() if m.startswith("trainer.config") and t} == {}


# The subsystems from the bottom up: a package imports only from its own layer and those below.
LAYERS = ["objectives", "config", "runtime", "args", "planner", "data", "engine", "model", "observe", "checkpoint", "loop",
          "cli", "bench"]  # fmt: skip


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    def layer(module: str) -> int | None:
        parts = module.split(".")
        return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None

    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer(module) is not None and layer(target) is not None and layer(target) > layer(module)
    ]


def test_every_subsystem_is_a_package_and_no_import_points_upward():
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    assert top - {"__pycache__"} == {"__init__", *LAYERS}
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports(
        {"trainer.engine.core": {"trainer.loop.trainer"}, "trainer.loop.x": {"trainer.engine"}}
    ) == ["trainer.engine.core -> trainer.loop.trainer"]


def test_only_engines_touch_the_deepspeed_engine_object():
    """``.ds`` is DeepSpeed's engine inside an Engine; the loop and everything else use the contract."""
    touching = []
    for module, path in _modules().items():
        if module.startswith("trainer.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "ds":
                touching.append(f"{module}:{node.lineno}")
    assert touching == []


def test_no_script_or_test_edits_sys_path():
    edits = []
    for path in [*(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                edits.append(str(path.relative_to(ROOT)))
    assert edits == []


# ---- the engine seam -----------------------------------------------------------------------------

# ZeRO-3's parameter internals: a partitioned stub's size, shard, id and state, and DeepSpeed's gather.
ZERO_NAMES = {"ds_numel", "ds_tensor", "ds_id", "ds_status", "GatheredParameters"}
# Outside trainer/engine/, DeepSpeed may be imported only to start the process group, and by the
# benchmark, which runs plain DeepSpeed as a baseline system (systems.py) and starts each system's
# process group itself, before any engine exists (worker.py, loop_overhead.py).
DEEPSPEED_IMPORTERS = {
    "trainer.runtime.distributed",
    "trainer.bench.systems",
    "trainer.bench.worker",
    "trainer.bench.loop_overhead",
}


def seam_breaches(modules: dict[str, Path]) -> list[str]:
    """Where a module outside ``trainer/engine/`` imports DeepSpeed (unless allowed to) or names a
    ZeRO internal (an attribute, a name or a string, as ``getattr(p, "ds_numel")`` reads it)."""
    found = []
    for module, path in sorted(modules.items()):
        if module == "trainer.engine" or module.startswith("trainer.engine."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported = [node.module or ""]
            else:
                imported = []
            if module not in DEEPSPEED_IMPORTERS and any(
                name == "deepspeed" or name.startswith("deepspeed.") for name in imported
            ):
                found.append(f"{module}:{node.lineno}: import {', '.join(imported)}")
            named = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if named in ZERO_NAMES:
                found.append(f"{module}:{node.lineno}: {named}")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_deepspeed_and_zero_internals_stay_behind_the_engine():
    """Everything outside ``trainer/engine/`` asks the ``Engine`` contract or ``trainer.engine.zero``."""
    assert seam_breaches(_modules()) == []


def test_the_seam_check_finds_a_breach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import deepspeed\nfrom deepspeed.utils import x\nn = getattr(p, 'ds_numel', 0)\nq.ds_tensor\n"
    )
    assert seam_breaches({"trainer.loop.bad": bad, "trainer.engine.fine": bad}) == [
        "trainer.loop.bad:1: import deepspeed",
        "trainer.loop.bad:2: import deepspeed.utils",
        "trainer.loop.bad:3: ds_numel",
        "trainer.loop.bad:4: ds_tensor",
    ]
