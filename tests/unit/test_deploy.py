"""docker-compose.yml and the Helm chart, checked structurally against the settings classes.

Neither Docker nor helm runs here: these tests parse the files and check that every setting they name exists
(`deepinfer.config.describe_settings`), that probes point at the ports the settings give, and that every
`.Values` path a template reads is defined. They do not render the chart.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deepinfer.config import SERVICE_SETTINGS, CommonSettings, describe_settings, to_camel
from deepinfer.config.describe import is_secret, setting_fields

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
    assert set(services) == {"nats", *SERVICES}
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


def test_compose_workers_use_the_engine_image_and_advertise_their_service_name():
    services = compose()["services"]
    assert "args" not in services["scheduler"]["build"]  # torch-free
    for name in ("prefill", "decode"):
        service = services[name]
        assert service["build"]["args"]["EXTRAS"] == "engine"
        assert service["environment"][f"DEEPINFER_{name.upper()}_DATA_PLANE_HOST"] == name
        assert service["environment"][f"DEEPINFER_{name.upper()}_DEVICE"] == "cpu"
        assert "models:/models" in service["volumes"]
    assert services["gateway"]["ports"] == ["127.0.0.1:8000:8000"]


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def camel_fields(cls: type) -> dict[str, str]:
    return {to_camel(name): name for name in setting_fields(cls)}


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "deepinfer"
    assert [dep["name"] for dep in chart["dependencies"]] == ["nats"]
    assert chart["dependencies"][0]["condition"] == "nats.enabled"


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


def test_workers_get_the_pod_ip_accelerators_and_the_store_a_statefulset_with_a_volume():
    workers = (CHART / "templates" / "workers.yaml").read_text()
    assert "fieldPath: status.podIP" in workers and "DATA_PLANE_HOST" in workers
    assert '"nvidia.com/gpu"' in workers and '"huawei.com/Ascend910"' in workers
    kvcache = (CHART / "templates" / "kvcache.yaml").read_text()
    assert "kind: StatefulSet" in kvcache and "volumeClaimTemplates:" in kvcache
    assert "fieldPath: metadata.name" in kvcache  # the pod name is the shard: stable with its volume
    assert "DEEPINFER_KVCACHE_DISK_DIR" in kvcache and "mountPath: /data" in kvcache
    text = "".join(path.read_text() for path in (CHART / "templates").glob("*"))
    for probe in ("path: /health", "path: /ready"):
        assert probe in text
    assert "not been rendered" in (ROOT / "helm" / "README.md").read_text()
