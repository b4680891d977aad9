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
    """Every Prometheus series name a service defines through deepinfer.telemetry.metrics (deepinfer_ + name).

    Literal names, and `f"worker_{name}"` over the `for name, doc in ((...), ...)` tuple the worker uses."""
    names: set[str] = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared" / "deepinfer").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        loops = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.DictComp | ast.ListComp | ast.GeneratorExp | ast.SetComp):
                for gen in node.generators:
                    if isinstance(gen.iter, ast.Tuple):
                        loops[id(node)] = [
                            e.elts[0].value
                            for e in gen.iter.elts
                            if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)
                        ]
                for child in ast.walk(node):
                    if isinstance(child, ast.Call):
                        names |= _metric_names(child, loops.get(id(node), []))
            elif isinstance(node, ast.Call):
                names |= _metric_names(node, [])
    return {f"deepinfer_{name}" for name in names}


def _metric_names(call: ast.Call, loop_values: list[str]) -> set[str]:
    func = call.func
    if not (isinstance(func, ast.Name) and func.id in ("counter", "gauge", "histogram") and len(call.args) >= 2):
        return set()
    arg = call.args[1]
    suffix = "_total" if func.id == "counter" else ""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value + suffix}
    if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
        return {f"{arg.values[0].value}{value}{suffix}" for value in loop_values}
    return set()


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
