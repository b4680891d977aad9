#!/usr/bin/env python3
"""Write helm/deepinfer/values.schema.json: the chart's values, each `settings` map one to one with settings fields.

    python scripts/chart_schema.py          # rewrite the schema
    python scripts/chart_schema.py --check  # exit 1 if the committed schema differs (tests/unit/test_deploy.py)

A settings map allows exactly the fields of its settings class (camelCase, `deepinfer.config.to_camel`), minus
secrets (they come from the Secret) and the fields the templates set themselves (CHART_SET), plus the old key of a
renamed or removed setting for the release that deprecates it (deepinfer.config.renamed): a typo or a setting removed
earlier fails `helm lint`.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from deepinfer.config import SERVICE_SETTINGS, CommonSettings, to_camel
from deepinfer.config.describe import is_secret, setting_fields
from deepinfer.config.renamed import removed_fields, renamed_fields

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "helm" / "deepinfer" / "values.schema.json"

#: Fields the templates set from Kubernetes (pod name, pod IP, volumes, acceleratorsPerPod) or do not wire (NATS
#: user and TLS files), by settings group; secrets are left out as well.
CHART_SET = {
    "common": {"natsUser", "natsTlsCa", "natsTlsCert", "natsTlsKey"},
    "gateway": {"gatewayId", "reusePort", "processes"},  # processes: gateway.processes, or from resources
    "scheduler": {"schedulerId"},
    "prefill": {"workerId", "dataPlaneHost", "tensorParallelSize"},
    "decode": {"workerId", "dataPlaneHost", "tensorParallelSize"},
    "kvcache": {"shard", "dataPlaneHost", "diskDir"},
}
SERVICES = ("gateway", "scheduler", "prefill", "decode", "kvcache")

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def field_schema(annotation: object) -> dict:
    """JSON schema of one settings field's values; null always allowed (= the setting's default)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        return {"enum": [*typing.get_args(annotation), None]}
    if isinstance(annotation, type) and annotation.__name__ == "ByteSize":
        return {"type": ["string", "integer", "null"]}  # 4GiB or bytes
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return {"type": ["string", "null"]}
    if annotation is float:
        return {"type": ["number", "string", "null"]}
    kind = _JSON_TYPES.get(annotation)  # type: ignore[arg-type]
    return {"type": [kind, "null"]} if kind else {}


def settings_schema(group: str, cls: type) -> dict:
    fields = setting_fields(cls)
    properties = {
        to_camel(name): field_schema(info.annotation)
        for name, info in fields.items()
        if not is_secret(info) and to_camel(name) not in CHART_SET[group]
    }
    for old, new in renamed_fields(cls).items():  # the old key, for the release that deprecates it
        if to_camel(new) in properties:
            properties[to_camel(old)] = properties[to_camel(new)] | {"description": f"deprecated: use {to_camel(new)}"}
    for old, why in removed_fields(cls).items():  # the old key, for the release that removes it: no effect
        properties[to_camel(old)] = {"description": f"deprecated, no effect: {why}"}
    return {"type": "object", "additionalProperties": False, "properties": dict(sorted(properties.items()))}


def _obj(properties: dict, required: tuple[str, ...] = ()) -> dict:
    schema = {"type": "object", "additionalProperties": False, "properties": properties}
    return schema | ({"required": list(required)} if required else {})


def _component(group: str, extra: dict, required: tuple[str, ...] = ("settings",)) -> dict:
    base = {
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 1},
        "resources": {"type": "object"},
        "nodeSelector": {"type": "object"},
        "tolerations": {"type": "array"},
        "settings": settings_schema(group, SERVICE_SETTINGS[group]),
    }
    return _obj(base | extra, required)


def _common_schema() -> dict:
    schema = settings_schema("common", CommonSettings)
    # The chart picks the worker image and device resource by accelerator: "auto" cannot choose them.
    schema["properties"]["accelerator"] = {"enum": ["cuda", "ascend", "cpu"]}
    return schema | {"required": ["model", "accelerator", "modelCacheDir", "internalHost"]}


def build_schema() -> dict:
    replicas = {"type": "integer", "minimum": 0}
    accelerators = {"type": "integer", "minimum": 1}
    # A transfer engine's RPC and data port range (kvcache shards, prefill workers with transferEngine).
    ports = _obj({"min": {"type": "integer", "minimum": 1024, "maximum": 65535},
                  "max": {"type": "integer", "minimum": 1024, "maximum": 65535}})
    hpa = {"enabled": {"type": "boolean"}, "minReplicas": {"type": "integer", "minimum": 1},
           "maxReplicas": {"type": "integer", "minimum": 1}}
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "DeepInfer chart values (generated by scripts/chart_schema.py)",
        **_obj({
            "global": {"type": "object"},
            "image": _obj({"repository": {"type": "string"}, "tag": {"type": "string"},
                           "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
            "workerImage": _obj({name: {"type": "string"} for name in ("cuda", "ascend", "cpu")}),
            "imagePullSecrets": {"type": "array"},
            "acceleratorResources": _obj({"cuda": {"type": "string"}, "ascend": {"type": "string"}}),
            "nats": {"type": "object", "properties": {"enabled": {"type": "boolean"}}},
            "secrets": _obj({name: {"type": "string"} for name in
                             ("existingSecret", "natsToken", "dataPlaneSecret", "apiKeys")}),
            "modelCache": _obj({"existingClaim": {"type": "string"}}),
            "serviceAccount": _obj({"create": {"type": "boolean"}, "name": {"type": "string"}}),
            "podSecurityContext": {"type": "object"},
            "securityContext": {"type": "object"},
            "networkPolicy": _obj({"enabled": {"type": "boolean"}, "metricsFrom": {"type": "array"}}),
            "common": _common_schema(),
            "extraEnv": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "gateway": _component("gateway", {
                "replicas": {"type": "integer", "minimum": 1},
                "processes": {"type": ["integer", "null"], "minimum": 1, "maximum": 64},
                "preStopSleepSeconds": {"type": "integer", "minimum": 0},
                "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                 "port": {"type": "integer"}}),
                "ingress": _obj({"enabled": {"type": "boolean"}, "className": {"type": "string"},
                                 "host": {"type": "string"}, "annotations": {"type": "object"},
                                 "tlsSecretName": {"type": "string"}}),
            }),
            "scheduler": _component("scheduler", {"replicas": {"type": "integer", "minimum": 2}}),
            "disaggregation": _obj({
                "groups": replicas,
                "ratio": _obj({"prefill": replicas, "decode": replicas}, ("prefill", "decode")),
            }, ("groups", "ratio")),
            "prefill": _component("prefill", {"acceleratorsPerPod": accelerators, "transferEnginePorts": ports}),
            "decode": _component("decode", {"acceleratorsPerPod": accelerators}),
            "kvcache": _component("kvcache", {
                "enabled": {"type": "boolean"}, "replicas": replicas,
                "storage": _obj({"size": {"type": "string"}, "storageClassName": {"type": "string"}}),
                "transferEnginePorts": ports,
            }),
            "podDisruptionBudget": _obj({"enabled": {"type": "boolean"}, "minAvailable": {"type": "integer"}}),
            "autoscaling": _obj({
                "gateway": _obj(hpa | {"targetCPUUtilizationPercentage": {"type": "integer"}}),
                "decode": _obj(hpa | {"metricName": {"type": "string"},
                                      "targetAverageValue": {"type": ["string", "integer"]}}),
            }),
            "serviceMonitor": _obj({"enabled": {"type": "boolean"}, "interval": {"type": "string"},
                                    "labels": {"type": "object"}}),
            "grafana": _obj({"dashboards": _obj({"enabled": {"type": "boolean"}, "namespace": {"type": "string"},
                                                 "annotations": {"type": "object"}})}),
        }),
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale: run python scripts/chart_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
