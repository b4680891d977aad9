"""The chart's Grafana dashboard (helm/deepinfer/dashboards/deepinfer.json) cannot drift from the code: every
metric its PromQL reads is a series a service defines (tests/deploy_harness.defined_metrics, read from the source),
every label it filters or groups by is one that metric carries or one added on the way (the scrape's), and
every legend names a label its query keeps."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.deploy_harness import CHART, Metric, defined_metrics

DASHBOARD = CHART / "dashboards" / "deepinfer.json"
#: Labels added outside the metric's definition: by the scrape (the ServiceMonitor's target labels, Prometheus'
#: own) and by a gateway pod's parent process, which merges its processes' samples (telemetry/exposition.py).
ADDED_LABELS = frozenset({"namespace", "pod", "service", "container", "endpoint", "instance", "job",
                          "gateway_process"})
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                       "unless", "offset", "inf", "nan"})
_SELECTOR = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)\s*")


@dataclass(frozen=True)
class Selector:
    """A series selector in a query: the metric name and the labels its matchers name."""

    name: str
    matcher_labels: frozenset[str]


def selectors(expr: str) -> list[Selector]:
    """The series selectors of a PromQL expression (functions, keywords, grouping labels and ranges left out)."""
    text = re.sub(r"\[[^\]]*\]", " ", expr)  # range vectors: [$__rate_interval], [5m]
    text = _GROUPING.sub(" ", text)
    found = []
    for match in _SELECTOR.finditer(text):
        name, braces = match.group(1), match.group(2)
        if name in _KEYWORDS or (not braces and text[match.end():].lstrip().startswith("(")):
            continue  # a function call or an operator keyword
        labels = frozenset(_MATCHER.findall(re.sub(r'"(?:[^"\\]|\\.)*"', "", braces or "")))
        found.append(Selector(name, labels))
    return found


def groupings(expr: str) -> Iterator[tuple[frozenset[str], str]]:
    """Each `by (labels) (body)` aggregation: its labels and its body's text."""
    for match in _GROUPING.finditer(expr):
        if match.group(1) != "by":
            continue
        start, depth = match.end(), 0
        for end in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            if depth == 0:
                break
        labels = frozenset(label.strip() for label in match.group(2).split(",") if label.strip())
        yield labels, expr[start : end + 1]


def series(metrics: dict[str, Metric]) -> dict[str, frozenset[str] | None]:
    """The series names /metrics exposes for the defined metrics -> their labels (a bucket's with `le`)."""
    exposed: dict[str, frozenset[str] | None] = {}
    for name, metric in metrics.items():
        if metric.kind == "counter":
            exposed[f"{name}_total"] = metric.labels
        elif metric.kind == "gauge":
            exposed[name] = metric.labels
        else:
            exposed[f"{name}_bucket"] = None if metric.labels is None else metric.labels | {"le"}
            exposed[f"{name}_sum"] = exposed[f"{name}_count"] = metric.labels
    return exposed


def targets() -> list[tuple[str, dict]]:
    """(panel title, target) for every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target) for panel in dashboard["panels"] for target in panel.get("targets", [])]


SERIES = series(defined_metrics())
TARGETS = targets()


def test_the_dashboard_queries_every_part_of_the_stack():
    names = {s.name for _, target in TARGETS for s in selectors(target["expr"])}
    for prefix in ("deepinfer_gateway_", "deepinfer_scheduler_", "deepinfer_worker_host_tier_",
                   "deepinfer_worker_store_", "deepinfer_kvstore_", "vllm:kv_cache", "vllm:spec_decode_"):
        assert any(name.startswith(prefix) for name in names), prefix


@pytest.mark.parametrize(("title", "target"), TARGETS, ids=[f"{t}-{x['refId']}" for t, x in TARGETS])
def test_every_metric_a_query_reads_is_one_the_code_defines(title, target):
    unknown = [s.name for s in selectors(target["expr"]) if s.name not in SERIES]
    assert unknown == [], f"{title}: no service defines {unknown} (tests/deploy_harness.defined_metrics)"


@pytest.mark.parametrize(("title", "target"), TARGETS, ids=[f"{t}-{x['refId']}" for t, x in TARGETS])
def test_every_label_a_query_filters_or_groups_by_is_one_its_metrics_carry(title, target):
    expr = target["expr"]
    for selector in selectors(expr):
        labels = SERIES.get(selector.name)  # an unknown name fails the test above
        if labels is not None:
            assert selector.matcher_labels <= labels | ADDED_LABELS, (title, selector)
    for grouped, body in groupings(expr):
        carried = set(ADDED_LABELS)
        for selector in selectors(body):
            carried |= SERIES.get(selector.name) or set(grouped)  # labels not literal in the code: not checked
        assert grouped <= carried, (title, grouped - carried, body)


@pytest.mark.parametrize(("title", "target"), TARGETS, ids=[f"{t}-{x['refId']}" for t, x in TARGETS])
def test_every_legend_names_a_label_the_query_keeps(title, target):
    legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
    kept = {label for grouped, _ in groupings(target["expr"]) for label in grouped}
    assert legend_labels <= kept, (title, legend_labels - kept)
    assert target["expr"].count("(") == target["expr"].count(")"), title


def test_panels_have_unique_ids_and_read_the_chosen_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {t["datasource"]["uid"] for _, t in TARGETS} == {"${datasource}"}
    assert dashboard["templating"]["list"][0] == dashboard["templating"]["list"][0] | {
        "name": "datasource", "type": "datasource", "query": "prometheus"}
    assert all('namespace=~"$namespace"' in s for _, t in TARGETS for s in re.findall(r"\{[^}]*\}", t["expr"]))


def test_the_query_reader_finds_names_and_labels():
    expr = ('histogram_quantile(0.99, sum by (le, tier) (rate(deepinfer_kvstore_read_seconds_bucket{namespace=~"$x",'
            ' tier!="ram"}[$__rate_interval]))) / scalar(sum(vllm:num_requests_running)) + 1e-3 * made_up_total')
    assert selectors(expr) == [
        Selector("deepinfer_kvstore_read_seconds_bucket", frozenset({"namespace", "tier"})),
        Selector("vllm:num_requests_running", frozenset()),
        Selector("made_up_total", frozenset()),
    ]
    assert [labels for labels, _ in groupings(expr)] == [frozenset({"le", "tier"})]
    assert "made_up_total" not in SERIES and SERIES["deepinfer_kvstore_read_seconds_bucket"] == {"tier", "le"}
    assert SERIES["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == {"position"}


def test_the_source_reader_agrees_with_the_metrics_objects():
    """defined_metrics reads the source; the metrics objects, built on a registry, define the same names, kinds
    and labels (samples' labels, `le` aside)."""
    from deepinfer.kvcache.store.metrics import StoreMetrics
    from deepinfer.telemetry import new_registry
    from deepinfer.telemetry.hops import Hops
    from deepinfer.worker.engine_loop import StepTimes
    from deepinfer.worker.host_tier_metrics import HostTierMetrics
    from deepinfer.worker.model_server_metrics import ModelServerGauges
    from deepinfer.worker.spec_decode_metrics import SpecDecodeMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.scheduler.handler import SchedulerMetrics
    from services.scheduler.kv_feed import IndexMetrics

    registry = new_registry(False)
    for build in (GatewayMetrics, SchedulerMetrics, IndexMetrics, StoreMetrics, StepTimes, ModelServerGauges,
                  SpecDecodeMetrics):
        build(registry)
    HostTierMetrics(registry, capacity_bytes=1)
    Hops(None, registry, "gateway")
    defined = defined_metrics()
    families = list(registry.collect())
    assert len(families) > 40
    for family in families:
        assert family.name in defined, family.name
        assert defined[family.name].kind == family.type, family.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= (defined[family.name].labels or set()), sample
