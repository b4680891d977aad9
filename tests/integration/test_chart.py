"""The Helm chart rendered by the real `helm` (lint --strict, template) for the default, CUDA, Ascend and
external-NATS values, each manifest validated by kubernetes-validate --strict, and the rendered YAML checked against
what the code defines. The tools come from the package registry (scripts/deploy_tools.py); no cluster is needed.
"""

from __future__ import annotations

import json

import pytest

from tests.deploy_harness import (
    CHART,
    VALUES_FILES,
    Tools,
    component,
    config_settings,
    env_names,
    exported_metrics,
    fetch_tools,
    internal_routes,
    pod_spec,
    render,
    serve_module,
    up_children,
    workloads,
)

yaml = pytest.importorskip("yaml")

CASES = {"default": (), **{name: ("-f", str(path)) for name, path in VALUES_FILES.items()}}
DRAIN_GRACE_S = 20  # deepinfer.defaults.DEFAULT_DRAIN_GRACE_S


@pytest.fixture(scope="module")
def tools() -> Tools:
    return fetch_tools()


@pytest.fixture(scope="module")
def rendered(tools: Tools) -> dict[str, list[dict]]:
    return {case: render(tools, *args) for case, args in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(tools: Tools, case: str):
    result = tools.run("helm", "lint", "--strict", str(CHART), *CASES[case])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_manifest_passes_kubernetes_validate_strict(tools: Tools, rendered, case, tmp_path):
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump_all(rendered[case]))
    result = tools.run("kubernetes-validate", "--strict", str(path))
    passed = result.stdout.count(" passed for resource ")
    # ServiceMonitor is a CRD without a schema here: reported as a warning, checked in test_service_monitor.
    unchecked = sum(doc["kind"] == "ServiceMonitor" for doc in rendered[case])
    assert passed + unchecked == len(rendered[case]), result.stdout + result.stderr


def test_no_nats_without_a_url_is_refused(tools: Tools):
    result = tools.run("helm", "template", "rel", str(CHART), "--set", "nats.enabled=false", check=False)
    assert result.returncode != 0 and "common.natsUrl" in result.stderr


def test_schema_rejects_a_value_that_is_no_setting(tools: Tools):
    result = tools.run("helm", "lint", "--strict", str(CHART), "--set", "decode.settings.maxNumSeq=8", check=False)
    assert result.returncode != 0 and "maxNumSeq" in result.stdout + result.stderr


def test_the_default_install_runs_every_service_and_bundled_nats(rendered):
    docs = rendered["default"]
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in workloads(docs)}
    assert {("Deployment", f"rel-{s}") for s in ("gateway", "scheduler", "prefill", "decode")} <= names
    assert {("StatefulSet", "rel-kvcache"), ("StatefulSet", "rel-nats")} <= names
    by_name = {doc["metadata"]["name"]: doc for doc in docs}
    assert by_name["rel-scheduler"]["spec"]["replicas"] >= 2
    kvcache = by_name["rel-kvcache"]["spec"]
    assert kvcache["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    env = {e["name"]: e.get("value") for e in pod_spec(by_name["rel-kvcache"])["containers"][0]["env"]}
    assert env["DEEPINFER_KVCACHE_DISK_BYTES"] == "64GiB"
    assert "DEEPINFER_KVCACHE_TTL_S" not in env  # a null value: the setting's own default
    assert "authorization" in by_name["rel-nats-config"]["data"]["nats.conf"]  # token auth on


def test_external_nats_installs_no_nats_and_points_at_the_url(rendered):
    docs = rendered["external-nats"]
    assert not [doc for doc in docs if "nats" in doc["metadata"]["name"]]
    for doc in workloads(docs):
        env = {e["name"]: e for e in pod_spec(doc)["containers"][0]["env"]}
        assert env["DEEPINFER_NATS_URL"]["value"] == "nats://nats.messaging.svc.cluster.local:4222"
        assert env["DEEPINFER_NATS_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-deepinfer"


@pytest.mark.parametrize("case", CASES)
def test_probes_hit_real_routes_on_the_service_internal_port(rendered, case):
    routes = internal_routes()
    assert {"/health", "/ready", "/metrics"} <= routes
    for doc in workloads(rendered[case]):
        if component(doc) is None:
            continue  # the NATS chart's own
        container = pod_spec(doc)["containers"][0]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        internal = int(env[f"DEEPINFER_{component(doc).upper()}_INTERNAL_PORT"])
        assert ports["internal"] == internal
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]["httpGet"]
            assert probe["path"] in routes and probe["port"] == "internal", (doc["metadata"]["name"], kind)
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        grace = pod_spec(doc)["terminationGracePeriodSeconds"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["", "0"])
        assert grace > DRAIN_GRACE_S + int(pre_stop[-1]), doc["metadata"]["name"]


def test_the_hpa_scales_on_a_metric_a_service_exports(rendered):
    hpas = [doc for doc in rendered["cuda"] if doc["kind"] == "HorizontalPodAutoscaler"]
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas} == {"rel-gateway", "rel-decode"}
    metrics = exported_metrics()
    assert "deepinfer_worker_running_requests" in metrics
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                assert metric["pods"]["metric"]["name"] in metrics
    decode = next(d for d in rendered["cuda"] if d["metadata"]["name"] == "rel-decode" and d["kind"] == "Deployment")
    assert "replicas" not in decode["spec"]  # the HPA owns it


@pytest.mark.parametrize(
    ("case", "resource", "per_pod"),
    [("default", "nvidia.com/gpu", {"prefill": 1, "decode": 1}), ("cuda", "nvidia.com/gpu", {"prefill": 1, "decode": 2}),
     ("ascend", "huawei.com/Ascend910", {"prefill": 1, "decode": 1}), ("external-nats", None, {})],
)
def test_resources_and_tensor_parallelism_per_accelerator(rendered, case, resource, per_pod):
    for doc in workloads(rendered[case]):
        role = component(doc)
        if role is None:
            continue
        container = pod_spec(doc)["containers"][0]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        accelerators = {k for k in limits | requests if "gpu" in k or "Ascend" in k}
        if role not in ("prefill", "decode") or resource is None:
            assert not accelerators, (case, role)
            continue
        assert limits[resource] == requests[resource] == per_pod[role], (case, role)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[f"DEEPINFER_{role.upper()}_TENSOR_PARALLEL_SIZE"] == str(per_pod[role])
        assert pod_spec(doc)["tolerations"] if case != "default" else True


def test_ascend_refuses_tensor_parallelism(tools: Tools):
    args = ("-f", str(VALUES_FILES["ascend"]), "--set", "decode.acceleratorsPerPod=2")
    result = tools.run("helm", "template", "rel", str(CHART), *args, check=False)
    assert result.returncode != 0 and "cuda or cpu only" in result.stderr


@pytest.mark.parametrize(("groups", "prefill", "decode"), [(None, 1, 1), (3, 1, 2), (2, 3, 1)])
def test_the_prefill_decode_ratio_is_honoured(tools: Tools, groups, prefill, decode):
    args = [] if groups is None else ["--set", f"disaggregation.groups={groups}",
                                      "--set", f"disaggregation.ratio.prefill={prefill}",
                                      "--set", f"disaggregation.ratio.decode={decode}"]
    replicas = {component(doc): doc["spec"]["replicas"] for doc in workloads(render(tools, *args))}
    groups = groups or 1
    assert (replicas["prefill"], replicas["decode"]) == (groups * prefill, groups * decode)


@pytest.mark.parametrize("case", CASES)
def test_network_policy_exposes_only_the_gateway_api(rendered, case):
    docs = rendered[case]
    policies = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    selected = {p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for p in policies}
    assert set(filter(None, (component(doc) for doc in workloads(docs)))) <= selected
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            if "from" not in rule:  # open to every source
                assert policy["metadata"]["name"] == "rel-gateway" and rule["ports"] == [{"port": "api"}]
        if policy["metadata"]["name"] in ("rel-prefill", "rel-decode", "rel-kvcache"):
            (data_plane,) = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": "data-plane"}]]
            peers = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in data_plane["from"]}
            assert peers == {"prefill", "decode", "kvcache"}


@pytest.mark.parametrize("case", CASES)
def test_no_container_runs_as_root(rendered, case):
    for doc in workloads(rendered[case]):
        spec = pod_spec(doc)
        for container in spec.get("initContainers", []) + spec["containers"]:
            context = spec.get("securityContext", {}) | container.get("securityContext", {})
            assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) != 0, container["name"]
            assert context.get("allowPrivilegeEscalation") is False, container["name"]
        if component(doc):
            assert spec["automountServiceAccountToken"] is False
            assert spec["serviceAccountName"] == "rel-deepinfer"


@pytest.mark.parametrize("case", CASES)
def test_every_env_setting_name_is_a_real_setting(rendered, case):
    known = config_settings()
    for doc in workloads(rendered[case]):
        spec = pod_spec(doc)
        for container in spec.get("initContainers", []) + spec["containers"]:
            unknown = {n for n in env_names(container) if n.startswith("DEEPINFER_")} - known
            assert not unknown, (doc["metadata"]["name"], container["name"], unknown)
            for item in container.get("env", []):
                if item["name"] in ("DEEPINFER_NATS_TOKEN", "DEEPINFER_DATA_PLANE_SECRET", "DEEPINFER_GATEWAY_API_KEYS"):
                    assert "secretKeyRef" in item["valueFrom"], item  # never a literal in the manifest


def test_the_chart_starts_every_service_as_deepinfer_up_does(rendered):
    up = up_children()
    deployed = {component(doc): pod_spec(doc) for doc in workloads(rendered["default"]) if component(doc)}
    assert set(deployed) == set(up)
    for service, (module, up_names) in up.items():
        container = deployed[service]["containers"][0]
        assert serve_module(container["args"]) == module
        missing = up_names - env_names(container)
        assert not missing, (service, missing)


def test_every_model_loading_pod_prepares_the_model_first(rendered):
    for doc in workloads(rendered["cuda"]):
        spec = pod_spec(doc)
        mounts = {m["name"] for m in spec["containers"][0].get("volumeMounts", [])}
        if "model-cache" not in mounts:
            continue
        (init,) = spec["initContainers"]
        assert init["args"] == ["prepare"] and init["image"] == spec["containers"][0]["image"]
        init_env = {e["name"]: e.get("value") for e in init["env"]}
        main_env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        for name in ("DEEPINFER_MODEL", "DEEPINFER_MODEL_CACHE_DIR"):
            assert init_env[name] == main_env[name]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert volume["persistentVolumeClaim"]["claimName"] == "deepinfer-models"
    assert {component(d) for d in workloads(rendered["cuda"]) if "initContainers" in pod_spec(d)} == {
        "gateway", "prefill", "decode"}


def test_gateway_ingress_pdbs_and_service_monitor(rendered):
    cuda = {(doc["kind"], doc["metadata"]["name"]): doc for doc in rendered["cuda"]}
    ingress = cuda[("Ingress", "rel-gateway")]["spec"]
    assert ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] == {"name": "api"}
    pdbs = {name for kind, name in cuda if kind == "PodDisruptionBudget"}
    assert {"rel-gateway", "rel-scheduler", "rel-prefill", "rel-decode"} <= pdbs  # replicas > minAvailable
    assert "rel-kvcache" not in pdbs  # one shard: a PDB would block every node drain
    external = [doc for doc in rendered["external-nats"] if doc["kind"] == "ServiceMonitor"]
    (monitor,) = external
    assert monitor["spec"]["endpoints"] == [{"port": "internal", "path": "/metrics", "interval": "15s"}]


def test_the_grafana_dashboard_configmap_only_when_enabled(tools: Tools, rendered, tmp_path):
    for case, docs in rendered.items():
        assert not [doc for doc in docs if "grafana_dashboard" in doc["metadata"].get("labels", {})], case
    switch = ("--set", "grafana.dashboards.enabled=true", "--set", "grafana.dashboards.namespace=monitoring",
              "--set-string", "grafana.dashboards.annotations.grafana_folder=DeepInfer")
    assert "0 chart(s) failed" in tools.run("helm", "lint", "--strict", str(CHART), *switch).stdout
    docs = render(tools, *switch)
    (dashboard,) = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-dashboard")]
    metadata = dashboard["metadata"]
    assert metadata["labels"]["grafana_dashboard"] == "1" and metadata["namespace"] == "monitoring"
    assert metadata["annotations"] == {"grafana_folder": "DeepInfer"}
    assert json.loads(dashboard["data"]["deepinfer.json"]) == json.loads((CHART / "dashboards" / "deepinfer.json").read_text())
    assert len(docs) == len(rendered["default"]) + 1  # the switch adds the ConfigMap and nothing else
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump(dashboard))
    assert " passed for resource " in tools.run("kubernetes-validate", "--strict", str(path)).stdout


def gateway_env(docs: list[dict]) -> dict[str, str]:
    (gateway,) = [doc for doc in workloads(docs) if component(doc) == "gateway"]
    return {e["name"]: e.get("value") for e in pod_spec(gateway)["containers"][0]["env"]}


@pytest.mark.parametrize(
    ("args", "processes"),
    [((), "2"),  # the default: requests cpu "2", no limit
     (("--set", "gateway.processes=3"), "3"),
     (("--set", "gateway.resources.limits.cpu=1500m"), "1"),  # a limit wins over the request
     (("--set", "gateway.resources.limits.cpu=16"), "4"),
     (("--set-json", 'gateway.resources={"requests": {"cpu": 3}}'), "3")],
)
def test_gateway_processes_from_the_value_or_the_pod_cpu(tools: Tools, args: tuple[str, ...], processes: str):
    assert gateway_env(render(tools, *args))["DEEPINFER_GATEWAY_PROCESSES"] == processes


def test_extra_env_reaches_every_service_container(tools: Tools):
    env = [{"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
           {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.01"}]
    docs = render(tools, "--set-json", f"extraEnv={json.dumps(env)}")
    services = {component(doc) for doc in workloads(docs)} - {None}
    assert services >= {"gateway", "scheduler", "prefill", "decode", "kvcache"}
    for doc in workloads(docs):
        if component(doc) is not None:
            main = pod_spec(doc)["containers"][0]
            assert [e for e in main["env"] if e["name"].startswith("OTEL_")] == env, doc["metadata"]["name"]
    assert not any(e["name"].startswith("OTEL_") for doc in workloads(render(tools))
                   for e in pod_spec(doc)["containers"][0].get("env", []))  # none by default


def built_tags() -> dict[str, str]:
    """accelerator -> the tag scripts/images.sh gives its image (its `tag_of`, run by bash)."""
    import subprocess
    import tomllib

    from tests.deploy_harness import ROOT

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    script = (ROOT / "scripts" / "images.sh").read_text()
    tag_of = next(line for line in script.splitlines() if line.startswith("tag_of()"))
    return {acc: subprocess.run(["bash", "-c", f"VERSION={version}; {tag_of}; tag_of {acc}"], capture_output=True,
                                text=True, check=True).stdout.strip() for acc in ("slim", "cpu", "cuda")}


def test_chart_and_compose_run_the_images_make_images_builds_with_the_same_commands(rendered):
    tags = built_tags()
    services = yaml.safe_load((CHART.parents[1] / "docker-compose.yml").read_text())["services"]
    compose_images = {name: s["image"] for name, s in services.items() if name != "nats"}
    assert set(compose_images.values()) == set(tags.values())
    for case in ("default", "cuda"):
        for doc in workloads(rendered[case]):
            name = component(doc)
            if name is None:
                continue  # the NATS chart's
            spec = pod_spec(doc)
            for container in spec["containers"] + spec.get("initContainers", []):
                assert container["image"] in tags.values(), (case, name, container["image"])
            assert spec["containers"][0]["args"] == services[name]["command"], (case, name)
            for init in spec.get("initContainers", []):
                assert init["args"] == services["prepare-model"]["command"]
