"""docker-compose.yml through the real `docker-compose config` (no daemon needed), every Dockerfile through hadolint,
`deepinfer prepare` (the init step of every model-loading pod and compose service) run for real, and the tool
fetcher's idempotence. The tools come from the package registry (scripts/deploy_tools.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.deploy_harness import (
    ROOT,
    Tools,
    cli_env,
    config_settings,
    fetch_tools,
    load_script,
    serve_module,
    up_children,
)

SECRETS = {"DEEPINFER_NATS_TOKEN": "t0ken", "DEEPINFER_DATA_PLANE_SECRET": "s3cret"}
#: Compose service -> the `deepinfer up` service it stands for.
COMPOSE_SERVICES = {
    "gateway": "gateway", "scheduler": "scheduler", "kvcache": "kvcache", "prefill": "prefill", "decode": "decode",
    "prefill-gpu": "prefill", "decode-gpu": "decode",
}


@pytest.fixture(scope="module")
def tools() -> Tools:
    return fetch_tools()


def compose_config(tools: Tools, *args: str) -> dict:
    result = tools.run("docker-compose", "-f", "docker-compose.yml", *args, "config", "--format", "json", **SECRETS)
    return json.loads(result.stdout)


@pytest.mark.parametrize("profile", [(), ("--profile", "gpu")])
def test_docker_compose_config_is_valid(tools: Tools, profile):
    tools.run("docker-compose", "-f", "docker-compose.yml", *profile, "config", "-q", **SECRETS)


def test_compose_refuses_to_start_without_the_secrets(tools: Tools):
    env = {"DEEPINFER_NATS_TOKEN": "", "DEEPINFER_DATA_PLANE_SECRET": ""}
    result = tools.run("docker-compose", "-f", "docker-compose.yml", "config", "-q", check=False, **env)
    assert result.returncode != 0 and "DEEPINFER_NATS_TOKEN" in result.stderr


#: Set by `deepinfer up` only: it runs several one-process gateway entries on one port itself; compose's gateway
#: is one entry whose parent gives its processes SO_REUSEPORT (DEEPINFER_GATEWAY_PROCESSES).
UP_ONLY = {"DEEPINFER_GATEWAY_REUSE_PORT"}


def test_compose_starts_every_service_as_deepinfer_up_does(tools: Tools):
    services = compose_config(tools, "--profile", "gpu")["services"]
    up = up_children()
    assert set(COMPOSE_SERVICES.values()) == set(up)
    known = config_settings()
    for name, service in COMPOSE_SERVICES.items():
        module, up_names = up[service]
        assert serve_module(services[name]["command"]) == module, name
        env = set(services[name]["environment"])
        assert not up_names - UP_ONLY - env, (name, up_names - UP_ONLY - env)
        assert not {n for n in env if n.startswith("DEEPINFER_")} - known, name
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_compose_prepares_the_model_once_before_every_model_loading_service(tools: Tools):
    services = compose_config(tools, "--profile", "gpu")["services"]
    assert services["prepare-model"]["command"] == ["prepare"]
    for name in ("gateway", "prefill", "decode", "prefill-gpu", "decode-gpu"):
        depends_on = services[name]["depends_on"]
        assert depends_on["prepare-model"]["condition"] == "service_completed_successfully"
        assert depends_on["scheduler"]["condition"] == depends_on["kvcache"]["condition"] == "service_healthy"
        (mount,) = [v for v in services[name]["volumes"] if v["target"] == "/models"]
        assert mount["source"] == "models"
    assert services["gateway"]["build"]["args"]["ACCELERATOR"] == "slim"


def test_the_gpu_profile_reserves_a_gpu_per_worker(tools: Tools):
    default = compose_config(tools)["services"]
    assert "prefill-gpu" not in default and "decode-gpu" not in default
    services = compose_config(tools, "--profile", "gpu")["services"]
    for name in ("prefill-gpu", "decode-gpu"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert services[name]["build"]["args"]["ACCELERATOR"] == "cuda"
    zero = tools.run("docker-compose", "-f", "docker-compose.yml", "config", "--format", "json", CPU_WORKERS="0",
                     **SECRETS)
    assert json.loads(zero.stdout)["services"]["decode"]["deploy"]["replicas"] == 0


def test_hadolint_passes_on_every_dockerfile(tools: Tools):
    dockerfiles = sorted(p for p in ROOT.glob("**/Dockerfile*") if not {".venv", ".deploy-tools"} & set(p.parts))
    assert dockerfiles
    result = tools.run("hadolint", "--no-color", *map(str, dockerfiles), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deepinfer_prepare_prepares_the_default_model_once(tmp_path):
    env = cli_env() | {"DEEPINFER_MODEL_CACHE_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "deepinfer.cli", "prepare"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    model_dir = tmp_path / first.stdout.strip().rsplit("/", 1)[-1]
    assert (model_dir / "config.json").is_file() and (model_dir / ".complete").is_file()
    stamp = (model_dir / ".complete").stat().st_mtime_ns
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert again.stdout == first.stdout and (model_dir / ".complete").stat().st_mtime_ns == stamp  # reused
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env | {"DEEPINFER_MODEL": "nope"})
    assert bad.returncode == 2 and "cannot resolve model" in bad.stderr
    missing = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env | {"DEEPINFER_MODEL": "/nope"})
    # a path that is not there: where the model should be, and the volume to mount
    assert missing.returncode == 2 and "model path /nope does not exist" in missing.stderr
    assert f"mount the volume that holds it (the images' model volume is {tmp_path}" in missing.stderr


def test_the_tool_fetch_is_idempotent(tools: Tools):
    module = load_script("deploy_tools")
    root = module.cache_dir()
    stamps = {name: (root / "stamps" / name).stat().st_mtime_ns for name in module.PINS}
    assert module.ensure() == tools.commands
    assert {name: (root / "stamps" / name).stat().st_mtime_ns for name in module.PINS} == stamps
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "deploy_tools.py"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and set(json.loads(check.stdout)["tools"]) == set(module.PINS)
