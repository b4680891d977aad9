"""Packages import only downwards: the import graph of shared/deepinfer and services, read from the source.

A unit is a module's first two dotted parts: a subpackage with everything under it (`deepinfer.engine`,
`services.gateway`; `deepinfer.kvcache.store.disk` is `deepinfer.kvcache`), a top-level module
(`deepinfer.service`) or a root package (`deepinfer`, `services`). No sub-module is placed apart from its package,
so none can hide a cycle through it. Every `import` / `from ... import` counts, wherever it sits: inside
functions (lazy imports) and under `if TYPE_CHECKING:` too. Only imports by name through `importlib` are
invisible here (`deepinfer serve` loading `services.<name>.main`, the model registry's classes).

The rule: an import goes to a unit in a lower row of `LAYERS` or sideways within its row, never up; no cycles
between units, sideways included; every unit has a row, so a new package is placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"deepinfer": ROOT / "shared" / "deepinfer", "services": ROOT / "services"}

#: Lowest first; the same order is drawn in docs/design-notes.md ("Layers").
LAYERS: tuple[tuple[str, ...], ...] = (
    ("deepinfer.hashing",),  # block identity (hashes, fingerprint, layout_id): imports nothing of ours
    ("deepinfer.subjects", "deepinfer.process", "deepinfer.protocol", "deepinfer.defaults", "deepinfer.tasks",
     "deepinfer.cpus", "deepinfer.host_memory", "deepinfer.host_identity", "deepinfer.ports",
     "deepinfer.kv_costs"),
    ("deepinfer.kv_rates",),  # a worker's measured load and prefill rates, as kv_costs' rule
    ("deepinfer.config", "deepinfer.bus", "deepinfer.telemetry", "deepinfer.dataplane", "deepinfer.tokenizer",
     "deepinfer.sampling", "deepinfer.nats_server", "deepinfer.membership", "deepinfer.structured"),
    ("deepinfer.kvcache",),  # the block store, a worker's client of it, shard placement: bus and data plane
    ("deepinfer.kernels",),
    ("deepinfer.distributed",),  # tensor-parallel primitives: process group, parallel layers, shard arithmetic
    ("deepinfer.models",),
    ("deepinfer.loader", "deepinfer.model_store"),
    ("deepinfer.executor",),  # spawns the tensor-parallel ranks, which load their shards
    ("deepinfer.engine",),
    ("deepinfer.worker", "deepinfer.up", "deepinfer.testing", "deepinfer.service", "deepinfer.bench"),
    ("services", "services.gateway", "services.scheduler", "services.prefill", "services.decode",
     "services.kvcache", "deepinfer.cli", "deepinfer.demo", "deepinfer"),
)

Graph = Mapping[str, Iterable[str]]


# -- the graph ----------------------------------------------------------------------------------------------------
def source_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every .py under SOURCES."""
    modules: dict[str, tuple[Path, bool]] = {}
    for prefix, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            parts = [prefix, *path.relative_to(base).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def unit_of(module: str) -> str:
    """The unit a module belongs to: its first two dotted parts (the root package alone stays itself)."""
    return ".".join(module.split(".")[:2])


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` reads from, with relative dots resolved against `module`."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, node.module] if node.module else package)


def imported_modules(path: Path, module: str, is_package: bool, modules: Iterable[str]) -> set[str]:
    """Our modules that `module` imports anywhere in its source: `import a.b` -> a.b; `from a import b` -> a.b
    when that is a module, else a."""
    known = set(modules)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]  # deepinfer.engine.core.EngineCore -> deepinfer.engine.core
            if name in known and name != module:
                found.add(name)
    return found


def module_edges(modules: Mapping[str, tuple[Path, bool]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs between our modules."""
    return {
        (module, target)
        for module, (path, is_package) in modules.items()
        for target in imported_modules(path, module, is_package, modules)
    }


def unit_graph(edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Unit -> the other units it imports."""
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        a, b = unit_of(importer), unit_of(imported)
        if a != b:
            graph.setdefault(a, set()).add(b)
    return graph


# -- the checks ---------------------------------------------------------------------------------------------------
def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected sets of more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    """Unit -> its row in `layers`."""
    return {unit: row for row, units in enumerate(layers) for unit in units}


def upward_edges(graph: Graph, layers: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    """Imports from a unit to one in a higher row (units without a row are `unplaced`'s business)."""
    rows = layer_of(layers)
    return sorted(
        (a, b) for a, targets in graph.items() for b in targets if a in rows and b in rows and rows[b] > rows[a]
    )


def unplaced(units: Iterable[str], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Units that have no row."""
    return sorted(set(units) - set(layer_of(layers)))


# -- the real code ------------------------------------------------------------------------------------------------
MODULES = source_modules()
EDGES = module_edges(MODULES)
GRAPH = unit_graph(EDGES)


def _witnesses(a: str, b: str) -> str:
    return ", ".join(f"{m} -> {t}" for m, t in sorted(EDGES) if unit_of(m) == a and unit_of(t) == b)


def test_every_unit_has_exactly_one_layer():
    units = {unit_of(m) for m in MODULES}
    assert unplaced(units, LAYERS) == [], "place the new package in LAYERS (and the diagram in design-notes.md)"
    listed = [u for row in LAYERS for u in row]
    assert len(listed) == len(set(listed)), "a unit is listed twice"
    assert sorted(set(listed) - units) == [], "LAYERS names a unit that no longer exists"


def test_no_cycle_between_packages():
    found = cycles(GRAPH)
    details = [f"{c}: " + "; ".join(_witnesses(a, b) for a in c for b in c if b in GRAPH.get(a, ())) for c in found]
    assert found == [], "\n".join(details)


def test_imports_only_go_down():
    found = upward_edges(GRAPH, LAYERS)
    assert found == [], "\n".join(f"{a} -> {b}: {_witnesses(a, b)}" for a, b in found)


# -- the checker itself -------------------------------------------------------------------------------------------
SYNTHETIC_LAYERS = (("low",), ("mid_a", "mid_b"), ("high",))


def test_a_clean_graph_passes():
    graph = {"high": {"mid_a", "low"}, "mid_a": {"mid_b", "low"}, "mid_b": {"low"}}
    assert cycles(graph) == [] and upward_edges(graph, SYNTHETIC_LAYERS) == []
    assert unplaced(["low", "mid_a", "mid_b", "high"], SYNTHETIC_LAYERS) == []


def test_a_cycle_is_reported_even_sideways():
    graph = {"high": {"mid_a"}, "mid_a": {"mid_b"}, "mid_b": {"mid_a", "low"}}
    assert cycles(graph) == [["mid_a", "mid_b"]]
    assert upward_edges(graph, SYNTHETIC_LAYERS) == []  # same row: only the cycle check catches it


def test_an_upward_edge_and_an_unplaced_unit_are_reported():
    graph = {"high": {"mid_a"}, "low": {"mid_b"}, "new": {"low"}}
    assert upward_edges(graph, SYNTHETIC_LAYERS) == [("low", "mid_b")]
    assert cycles(graph) == []
    assert unplaced(["low", "new"], SYNTHETIC_LAYERS) == ["new"]


def test_the_old_models_distributed_cycle_would_fail():
    # Put back the edge the split removed (a TP layer importing models.config): both checks catch it.
    graph = {unit: set(targets) for unit, targets in GRAPH.items()}
    graph.setdefault("deepinfer.distributed", set()).add("deepinfer.models")
    assert ["deepinfer.distributed", "deepinfer.models"] in cycles(graph)
    assert ("deepinfer.distributed", "deepinfer.models") in upward_edges(graph, LAYERS)


def test_the_old_protocol_kvcache_cycle_would_fail():
    # Put back the edge the move of block hashing removed (protocol/kv.py importing deepinfer.kvcache): kvcache
    # imports protocol, bus and dataplane, so both checks catch it.
    graph = {unit: set(targets) for unit, targets in GRAPH.items()}
    graph.setdefault("deepinfer.protocol", set()).add("deepinfer.kvcache")
    assert any({"deepinfer.protocol", "deepinfer.kvcache"} <= set(c) for c in cycles(graph))
    assert ("deepinfer.protocol", "deepinfer.kvcache") in upward_edges(graph, LAYERS)


def test_the_parser_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from pkg.sub import deep\n    return deep\n")
    (pkg / "sub" / "__init__.py").write_text("from . import deep\n")
    (pkg / "sub" / "deep.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n")
    (pkg / "top.py").write_text("import os\nimport pkg.sub.deep\n\ndef f():\n    from . import sub\n")
    modules = {
        "pkg": (pkg / "__init__.py", True),
        "pkg.sub": (pkg / "sub" / "__init__.py", True),
        "pkg.sub.deep": (pkg / "sub" / "deep.py", False),
        "pkg.top": (pkg / "top.py", False),
    }
    edges = module_edges(modules)
    assert edges == {
        ("pkg", "pkg.sub.deep"),  # lazy, in a function; `from pkg.sub import deep` is the submodule, not pkg.sub
        ("pkg.sub", "pkg.sub.deep"),  # relative
        ("pkg.sub.deep", "pkg.top"),  # under TYPE_CHECKING: counted like any other
        ("pkg.top", "pkg.sub.deep"),
        ("pkg.top", "pkg.sub"),  # relative, in a function
    }
    assert unit_graph(edges) == {"pkg": {"pkg.sub"}, "pkg.sub": {"pkg.top"}, "pkg.top": {"pkg.sub"}}
    assert cycles(unit_graph(edges)) == [["pkg.sub", "pkg.top"]]


def test_a_submodule_counts_as_its_package():
    assert unit_of("deepinfer.kvcache.store.disk") == unit_of("deepinfer.kvcache") == "deepinfer.kvcache"
    assert unit_of("deepinfer") == "deepinfer" and unit_of("deepinfer.service") == "deepinfer.service"
    # An import deep inside a package is an edge of the package; one within it is no edge at all.
    edges = {
        ("deepinfer.kvcache.store.server", "deepinfer.bus.nats"),
        ("deepinfer.kvcache.client.client", "deepinfer.kvcache.rendezvous"),
    }
    assert unit_graph(edges) == {"deepinfer.kvcache": {"deepinfer.bus"}}
    # The cycle that hid while kvcache.store and kvcache.client were placed apart: protocol imported block
    # hashing from the kvcache package, whose store imports the data plane, which imports protocol.
    edges = {
        ("deepinfer.protocol.kv", "deepinfer.kvcache.hashing"),
        ("deepinfer.kvcache.store.server", "deepinfer.dataplane.server"),
        ("deepinfer.dataplane.frames", "deepinfer.protocol"),
    }
    graph = unit_graph(edges)
    assert cycles(graph) == [["deepinfer.dataplane", "deepinfer.kvcache", "deepinfer.protocol"]]
    assert upward_edges(graph, LAYERS) == [("deepinfer.protocol", "deepinfer.kvcache")]


# -- the engine's front door ----------------------------------------------------------------------------------------
#: Units that reach the engine only through `deepinfer.engine`'s public names (its `__init__`), never a submodule.
ENGINE_CLIENTS = ("services", "deepinfer.worker")


def engine_submodule_imports(edges: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(importer, engine submodule) pairs where an engine client imports past the front door."""
    return sorted(
        (importer, imported) for importer, imported in edges
        if imported.startswith("deepinfer.engine.")
        and any(importer == client or importer.startswith(client + ".") for client in ENGINE_CLIENTS)
    )


def test_services_and_the_worker_use_the_engine_only_through_its_front_door():
    found = engine_submodule_imports(EDGES)
    assert found == [], "import these names from deepinfer.engine:\n" + "\n".join(f"{a} -> {b}" for a, b in found)


def test_an_engine_submodule_import_by_a_worker_or_a_service_is_reported():
    edges = {("deepinfer.worker.runtime", "deepinfer.engine.core"), ("services.decode.handler", "deepinfer.engine"),
             ("services.prefill.handler", "deepinfer.engine.handoff"), ("deepinfer.engine.llm", "deepinfer.engine.core")}
    assert engine_submodule_imports(edges) == [("deepinfer.worker.runtime", "deepinfer.engine.core"),
                                               ("services.prefill.handler", "deepinfer.engine.handoff")]
