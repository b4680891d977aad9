"""Merge the Prometheus text expositions of several processes of one service into one, each sample labelled with
the process it came from (a gateway's parent serves its children's /metrics this way).

    merge_expositions({"0": text_of_child_0, "1": text_of_child_1}, "gateway_process")

Families keep one HELP and TYPE line; the label makes every series distinct, so nothing is duplicated or summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector that yields fixed, already merged families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        """The merged families, in the order first seen."""
        return iter(self._families)


def merge_expositions(expositions: Mapping[str, str], label: str) -> str:
    """One text exposition holding every sample of every input, with `label` set to the input's key.

    A family seen in several inputs is written once (the first input's HELP and type). A sample that already
    carries `label` gets the key instead (the parent's view is the one that tells processes apart).
    ValueError when an input is not a valid exposition.
    """
    families: dict[str, Metric] = {}
    for value, text in expositions.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, label: value}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
