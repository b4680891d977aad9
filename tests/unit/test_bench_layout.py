"""bench/ as a workshop beside the house (STYLE.md, issue #37): nothing of ours imports it, it imports nothing
from tests/, its probes edit no `sys.path`, and its modules import each other without a cycle. Read from the
source, as test_layers.py does."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_layers import cycles

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def module_name(path: Path) -> str:
    """bench/gpu/gpu.py -> bench.gpu.gpu (a package's __init__ is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in its source (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_outside_bench_imports_it():
    importers = [
        f"{path.relative_to(ROOT)}: {name}"
        for top in ("shared", "services", "tests", "scripts")
        for path in sorted((ROOT / top).rglob("*.py"))
        for name in sorted(imported_names(path))
        if name == "bench" or name.startswith("bench.")
    ]
    assert importers == [], "move what a test needs into the package (deepinfer.testing, deepinfer.bench)"


def test_bench_imports_nothing_from_tests():
    importers = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(BENCH.rglob("*.py"))
        for name in sorted(imported_names(path))
        if name == "tests" or name.startswith("tests.")
    ]
    assert importers == [], "move what a probe needs into the package (deepinfer.testing) and import it from there"


def test_no_probe_edits_sys_path():
    edits = [str(path.relative_to(ROOT)) for path in sorted(BENCH.rglob("*.py")) if "sys.path" in path.read_text()]
    assert edits == [], "run from the repository root with PYTHONPATH=shared:. and import as bench.<topic>.<module>"


def test_bench_modules_import_each_other_without_a_cycle():
    modules = {module_name(path): path for path in sorted(BENCH.rglob("*.py"))}
    graph = {
        name: {target for target in imported_names(path) if target in modules and target != name}
        for name, path in modules.items()
    }
    assert cycles(graph) == [], "move what both sides need into a module both import (as bench/gpu/harness.py)"


def private_attributes(path: Path) -> list[str]:
    """`obj._name` read or written in `path` where obj is not self / cls (dunders aside): what a probe would patch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_probes_use_public_hooks_not_private_attributes():
    """Issue #37: a probe times or reads the engine, the workers and the gateway through their public methods and
    hooks (EngineLoop.on_commands / on_settled / on_step_time, EngineCore.install_drafter, a bus it injects), never
    by patching or reading another object's private attributes, which change without notice."""
    assert [hit for path in sorted(BENCH.rglob("*.py")) for hit in private_attributes(path)] == []
