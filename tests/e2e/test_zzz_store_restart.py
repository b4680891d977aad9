"""The kvcache store across a restart of the whole stack (this module runs last: it stops the shared stack).

A long prompt served before the restart writes its blocks behind to the store; the stack comes back on the same
DEEPINFER_DATA_DIR with empty device caches, and the same prompt reports cached tokens from the store tier and
the same greedy text."""

from __future__ import annotations

import openai
import pytest

from deepinfer.up import Stack
from tests.e2e.conftest import metrics, wait_until

pytestmark = pytest.mark.e2e

CONTEXT = " ".join(f"Entry {i}: the lighthouse on island {i} is painted {('red', 'white', 'blue')[i % 3]}."
                   for i in range(24))
MESSAGES = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Which colour is lighthouse 7?"}]


def ask(client: openai.OpenAI, model: str):
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)


def written_behind(stack: Stack) -> float:
    samples = metrics(stack, "prefill-0")
    if samples.get("deepinfer_worker_store_write_queue_blocks", 1) != 0:
        return 0.0
    return samples.get("deepinfer_worker_store_written_blocks_total", 0.0)


def test_a_restarted_stack_serves_a_long_prompt_from_the_store(client, stack):
    before = ask(client, stack.model_name)
    num_prompt_tokens = before.usage.prompt_tokens
    assert num_prompt_tokens > 300
    wait_until(lambda: written_behind(stack) >= num_prompt_tokens // 16 - 1, 30, "the prompt's blocks written behind")
    stack.stop()

    with Stack(port=0, env_overrides=stack.env_overrides, start_timeout_s=240) as again:
        restarted = openai.OpenAI(base_url=again.base_url, api_key="e2e", max_retries=0, timeout=60)
        after = ask(restarted, again.model_name)
        details = after.usage.prompt_tokens_details
        by_tier = details.model_extra["cached_tokens_by_tier"]
        assert by_tier["store"] >= num_prompt_tokens - 32  # every full block but the one holding the last token
        assert details.cached_tokens == by_tier["store"] + by_tier["device"]
        assert after.choices[0].message.content == before.choices[0].message.content
        assert metrics(again, "prefill-0")["deepinfer_worker_store_loads_total{outcome=\"loaded\"}"] == 1
