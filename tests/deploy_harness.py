"""Shared by the deployment tests: the repository's files, the fetched tools, rendering the chart, and what the
code defines (internal HTTP routes, Prometheus metric names, the settings `deepinfer config --json` lists, the
children `deepinfer up` starts)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "deepinfer"
VALUES_FILES = {name: CHART / "ci" / f"{name}-values.yaml" for name in ("cuda", "ascend", "external-nats")}
SERVICES = ("gateway", "scheduler", "prefill", "decode", "kvcache")
#: Kinds that carry a pod template.
WORKLOADS = ("Deployment", "StatefulSet")


def load_script(name: str) -> ModuleType:
    """A module from scripts/ (not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Tools:
    """The deployment checkers fetched by scripts/deploy_tools.py, run in their environment."""

    commands: dict[str, list[str]]
    env: dict[str, str]

    def run(self, name: str, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.commands[name], *args], capture_output=True, text=True, timeout=120,
            cwd=ROOT, env={**self.env, **env},
        )
        if check and result.returncode != 0:
            pytest.fail(f"{name} {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result


def fetch_tools() -> Tools:
    """Fetch the tools (once: a cache dir); skip the calling tests only if the registry cannot provide them."""
    module = load_script("deploy_tools")
    try:
        commands = module.ensure()
    except (OSError, subprocess.CalledProcessError, ValueError) as exc:
        pytest.skip(f"deployment tools unavailable (scripts/deploy_tools.py): {exc}")
    return Tools(commands, module.tool_env(module.cache_dir()))


def render(tools: Tools, *args: str) -> list[dict]:
    """`helm template` of the chart with extra arguments (-f FILE, --set K=V): every non-empty document."""
    import yaml

    out = tools.run("helm", "template", "rel", str(CHART), "--namespace", "ns", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def workloads(docs: list[dict]) -> Iterator[dict]:
    return (doc for doc in docs if doc["kind"] in WORKLOADS)


def component(doc: dict) -> str | None:
    """The DeepInfer component of a resource (gateway, ..., kvcache); None for the NATS chart's."""
    labels = doc["metadata"].get("labels", {})
    return labels.get("app.kubernetes.io/component") if labels.get("app.kubernetes.io/name") == "deepinfer" else None


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def env_names(container: dict) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


def internal_routes() -> set[str]:
    """The paths the internal HTTP server of every service answers (deepinfer/telemetry/health.py)."""
    text = (ROOT / "shared" / "deepinfer" / "telemetry" / "health.py").read_text()
    return set(re.findall(r'Route\("(/[\w/]*)"', text))


def exported_metrics() -> set[str]:
    """Every Prometheus series name the code defines (a counter's with its `_total`; a histogram's base name)."""
    return {name + ("_total" if m.kind == "counter" else "") for name, m in defined_metrics().items()}


@dataclass(frozen=True)
class Metric:
    """A metric as the code defines it: counter, gauge or histogram, and its label names (None: not literal)."""

    kind: str
    labels: frozenset[str] | None


#: The constructors a metric is defined with: deepinfer.telemetry's (the name gets `deepinfer_`) and
#: prometheus_client's (the name as written: vLLM's `vllm:*` gauges and counters).
_OUR_CONSTRUCTORS = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}
_CLIENT_CONSTRUCTORS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}


def defined_metrics() -> dict[str, Metric]:
    """Every metric the code in services/ and shared/deepinfer defines: its name as /metrics exposes it (a
    counter's without `_total`) -> its kind and labels. Read from the source:

    - `counter(registry, "gateway_requests", ...)`: a literal name;
    - `gauge(registry, f"worker_{name}", ...)` or `Gauge(name, ...)` in a comprehension `for name, ... in T`,
      T a literal tuple of tuples or a module-level one (`_COUNTERS = (("vllm:...", ...), ...)`): every first
      element, through the f-string;
    - `histogram(registry, f"{service}_hop_seconds", ...)` in the class `Hops(tracer, registry, service)`: once
      per service name a `Hops(...)` call passes as a literal.
    """
    names: dict[str, Metric] = {}
    hop_services: set[str] = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared" / "deepinfer").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        constants = _module_tuples(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.DictComp | ast.ListComp | ast.GeneratorExp | ast.SetComp):
                values = _loop_values(node, constants)
                for child in ast.walk(node):
                    if isinstance(child, ast.Call):
                        names |= _metric_names(child, values)
            elif isinstance(node, ast.Call):
                names |= _metric_names(node, {})
                if _is_call(node, "Hops", 3) and isinstance(node.args[2], ast.Constant):
                    hop_services.add(node.args[2].value)
    hops = names.pop("deepinfer_{service}_hop_seconds", None)
    assert hops is not None, "telemetry/hops.py no longer defines deepinfer_<service>_hop_seconds as read here"
    names |= {f"deepinfer_{service}_hop_seconds": hops for service in hop_services}
    return names


def _is_call(node: ast.Call, name: str, num_args: int) -> bool:
    return isinstance(node.func, ast.Name) and node.func.id == name and len(node.args) == num_args


def _module_tuples(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level `NAME = ((literal, ...), ...)`: NAME -> the first elements."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            firsts = _first_elements(node.value)
            if firsts:
                found[node.targets[0].id] = firsts
    return found


def _first_elements(node: ast.expr) -> list[str]:
    if not isinstance(node, ast.Tuple):
        return []
    return [e.elts[0].value for e in node.elts
            if isinstance(e, ast.Tuple) and e.elts and isinstance(e.elts[0], ast.Constant)]


def _loop_values(node: ast.expr, constants: dict[str, list[str]]) -> dict[str, list[str]]:
    """The comprehension's `for name, ... in T`: name -> T's first elements."""
    values = {}
    for gen in node.generators:  # type: ignore[attr-defined]
        target = gen.target.elts[0] if isinstance(gen.target, ast.Tuple) else gen.target
        if not isinstance(target, ast.Name):
            continue
        firsts = constants.get(gen.iter.id, []) if isinstance(gen.iter, ast.Name) else _first_elements(gen.iter)
        if firsts:
            values[target.id] = firsts
    return values


def _metric_names(call: ast.Call, loop_values: dict[str, list[str]]) -> dict[str, Metric]:
    func = call.func
    if not isinstance(func, ast.Name):
        return {}
    if func.id in _OUR_CONSTRUCTORS and len(call.args) >= 2:
        kind, prefix, arg, labels_at = _OUR_CONSTRUCTORS[func.id], "deepinfer_", call.args[1], 3
    elif func.id in _CLIENT_CONSTRUCTORS and call.args:
        kind, prefix, arg, labels_at = _CLIENT_CONSTRUCTORS[func.id], "", call.args[0], 2
    else:
        return {}
    metric = Metric(kind, _label_names(call, labels_at))
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {prefix + arg.value: metric}
    if isinstance(arg, ast.Name):
        return {prefix + value: metric for value in loop_values.get(arg.id, [])}
    if isinstance(arg, ast.JoinedStr):
        parts = arg.values
        if len(parts) == 2 and isinstance(parts[0], ast.Constant) and isinstance(parts[1], ast.FormattedValue):
            variable = parts[1].value
            if isinstance(variable, ast.Name) and variable.id in loop_values:
                return {f"{prefix}{parts[0].value}{value}": metric for value in loop_values[variable.id]}
        if ast.unparse(arg) == "f'{service}_hop_seconds'":
            return {prefix + "{service}_hop_seconds": metric}
    return {}


def _label_names(call: ast.Call, position: int) -> frozenset[str] | None:
    """The literal `labelnames` of a metric's constructor call (positional or keyword); None when not literal."""
    node = next((k.value for k in call.keywords if k.arg == "labelnames"), None)
    if node is None:
        node = call.args[position] if len(call.args) > position else ast.Tuple(elts=[])
    if not isinstance(node, ast.List | ast.Tuple):
        return None
    if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return None
    return frozenset(e.value for e in node.elts)


def cli_env() -> dict[str, str]:
    """An environment whose `python -m deepinfer.cli` imports this checkout, with no DEEPINFER_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "shared"), str(ROOT)])
    return env


def config_settings() -> set[str]:
    """The env names `deepinfer config --json` lists (the real command, as an operator runs it)."""
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "config", "--json"],
        capture_output=True, text=True, timeout=60, env=cli_env(), check=True,
    )
    return {row["env"] for row in json.loads(result.stdout)}


def up_children() -> dict[str, tuple[str, set[str]]]:
    """What `deepinfer up` starts, by service: the module it runs and the DEEPINFER_ names it sets."""
    from deepinfer.up.stack import Stack

    stack = Stack(base_env={}, device="cpu", num_gpus=0, num_gateways=2)
    try:
        children = {}
        for spec in stack.plan()[1:]:  # nats first
            assert spec.argv[1] == "-m", spec.argv
            # `python -m services.<x>` runs services/<x>/__main__.py, which calls services.<x>.main:main.
            main_py = (ROOT / spec.argv[2].replace(".", "/") / "__main__.py").read_text()
            assert f"from {spec.argv[2]}.main import main" in main_py and "main()" in main_py
            children[stack.kinds[spec.name]] = (
                f"{spec.argv[2]}.main",
                {key for key in spec.env if key.startswith("DEEPINFER_")},
            )
        return children
    finally:
        stack.stop()


def serve_module(args: list[str]) -> str:
    """The module `deepinfer serve <service>` runs (deepinfer.cli)."""
    from deepinfer.cli import SERVICE_NAMES

    assert args[0] == "serve" and args[1] in SERVICE_NAMES, args
    return f"services.{args[1]}.main"
