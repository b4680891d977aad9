"""What a stranger's requests get from the whole stack (issue #40): a clear answer for that client, no harm to anyone
else. Driven by the official `openai` client, as a user would."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import wait_until, workers_idle

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: Under the gateway's 16 MiB body limit.
HUGE_PROMPT = "hello world " * 1_300_000


class SmallRequests:
    """A second client: small completions one after another until stopped, each one's outcome and latency."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client, self.model = client, model
        self.outcomes: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SmallRequests:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.client.completions.create(model=self.model, prompt="The capital of France is", max_tokens=4,
                                               temperature=0)
                outcome = "ok"
            except openai.APIError as exc:
                outcome = type(exc).__name__
            self.outcomes.append((outcome, time.monotonic() - started))
            time.sleep(0.1)


def _refused_for_length(call: Any, param: str) -> float:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    seconds = time.monotonic() - started
    error = refused.value.body
    assert (refused.value.code, refused.value.param, error["type"]) == (
        "context_length_exceeded", param, "invalid_request_error")
    assert "max_prompt_chars" in error["message"] and len(error["message"]) < 300
    return seconds


def test_huge_prompts_get_a_quick_400_while_another_clients_requests_all_succeed(client, stack):
    model = stack.model_name
    gateway_pid = stack.services["gateway-0"].pid
    huge_chat = [{"role": "user", "content": HUGE_PROMPT}]
    with SmallRequests(client, model) as small:
        time.sleep(0.5)
        seconds = [
            _refused_for_length(lambda: client.completions.create(model=model, prompt=HUGE_PROMPT, max_tokens=4),
                                "prompt"),
            _refused_for_length(lambda: client.chat.completions.create(model=model, messages=huge_chat, max_tokens=4),
                                "messages"),
        ]
        started = time.monotonic()
        tokenized = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize",
                               json={"model": model, "prompt": HUGE_PROMPT}, timeout=60)
        seconds.append(time.monotonic() - started)
        assert tokenized.status_code == 400 and tokenized.json()["error"]["code"] == "context_length_exceeded"
        time.sleep(1.0)
    assert max(seconds) < 5.0, seconds
    assert small.outcomes and all(outcome == "ok" for outcome, _ in small.outcomes), small.outcomes
    assert max(latency for _, latency in small.outcomes) < 3.0, small.outcomes
    assert stack.services["gateway-0"].pid == gateway_pid and stack.restart_count("gateway-0") == 0


def _unique_prompt(num_words: int) -> str:
    """A prompt no cache holds (~4 tokens a word)."""
    rng = random.Random(time.time_ns())
    words = ["river", "stone", "market", "violet", "engine", "harbor", "lantern", "meadow", "copper", "falcon"]
    return " ".join(f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(num_words))


@pytest.mark.parametrize("stream", [True, False])
def test_a_long_prompt_abandoned_frees_the_workers_for_the_next_request(client, stack, stream):
    base = stack.base_url.removesuffix("/v1")
    prompt = _unique_prompt(1500)
    assert httpx.post(f"{base}/tokenize", json={"model": stack.model_name, "prompt": prompt}).json()["count"] > 5000
    body = {"model": stack.model_name, "prompt": prompt, "max_tokens": 8, "stream": stream}
    with pytest.raises(httpx.TimeoutException):  # the client gives up 2 s in: its connection closes
        httpx.post(f"{base}/v1/completions", json=body, timeout=2.0)
    started = time.monotonic()
    client.completions.create(model=stack.model_name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert time.monotonic() - started < 5.0
    wait_until(lambda: workers_idle(stack), 10, "the workers to drop the abandoned prompt")


#: Schemas no finite document satisfies, or past the grammar limits: a 400 before anything runs (issue #40, 2).
IMPOSSIBLE_SCHEMAS = {
    "$ref loop": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "recursive required $ref": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "pattern ^a{100000}$": {"type": "string", "pattern": "^a{100000}$"},
    "pattern ^(x{1000}){1000}$": {"type": "string", "pattern": "^(x{1000}){1000}$"},
    "minimum > maximum": {"type": "integer", "minimum": 5, "maximum": 1},
}
INTERNALS = ("<state>", "grm_prefix", "compute_time_us", "lexer_cost", "Parser: {")


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("name", list(IMPOSSIBLE_SCHEMAS))
def test_impossible_schemas_are_a_short_400(client, stack, name):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=16,
                                       response_format=_json_schema(IMPOSSIBLE_SCHEMAS[name]))
    assert time.monotonic() - started < 5.0
    error = refused.value.body
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format.json_schema.schema")
    text = refused.value.response.text
    assert not any(marker in text for marker in INTERNALS), text
    assert "\n" not in error["message"] and len(error["message"]) < 300


def test_an_unbounded_integer_ends_and_a_cut_document_is_a_200_with_length(client, stack):
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=stack.model_name, messages=[{"role": "user", "content": "What is the population of Paris?"}],
        temperature=0, max_tokens=200, response_format=_json_schema(schema),
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert abs(json.loads(reply.choices[0].message.content)["population"]) < 10**18
    cut = client.chat.completions.create(model=stack.model_name, messages=QUESTION, temperature=0, max_tokens=3,
                                         response_format=_json_schema(schema))
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert cut.choices[0].message.content.startswith('{"')


def test_sdk_default_requests_get_the_models_recommended_sampling(client, stack):
    card = client.models.retrieve(stack.model_name)
    assert card.model_extra["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}  # SmolLM2's card
    common = {"model": stack.model_name, "messages": QUESTION, "max_tokens": 24, "seed": 1234, "n": 4}
    left_out = client.chat.completions.create(**common)
    explicit = client.chat.completions.create(**common, temperature=0.2, top_p=0.9)
    assert [c.message.content for c in left_out.choices] == [c.message.content for c in explicit.choices]
    assert sum("Paris" in c.message.content for c in left_out.choices) >= 2
