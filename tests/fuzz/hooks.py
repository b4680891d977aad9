"""schemathesis hooks for the fuzz run (loaded through SCHEMATHESIS_HOOKS by tests/fuzz/gateway.py).

The scripted FakeWorkers answer the same text whatever the request, so a request for structured output
(response_format, tools, tool_choice) gets an output that breaks its grammar, and the gateway answers 502
("the output broke the requested format"), as it must for a worker that ignored the grammar. That failure is the
fake upstream's, not the API's: it alone is dropped. Structured output runs for real in
tests/e2e/test_structured_output.py.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis

FAKE_UPSTREAM_MESSAGES = ("the output broke the requested format", "the output stopped before completing")


def _is_fake_upstream_failure(response: Any) -> bool:
    if response.status_code != 502:
        return False
    try:
        message = json.loads(response.content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return any(text in message for text in FAKE_UPSTREAM_MESSAGES)


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but a fake worker's ignored grammar."""
    return not _is_fake_upstream_failure(response)
