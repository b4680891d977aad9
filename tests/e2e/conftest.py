"""One stack for the e2e session: nats-server, scheduler, prefill, decode and gateway as separate processes,
serving the default model on the CPU, driven by the official `openai` client."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from deepinfer.up import Stack

STACK_ENV = {
    "DEEPINFER_GATEWAY_API_KEYS": "",
    "OMP_NUM_THREADS": "1",  # two workers share two cores
    # float32, not "auto" (bfloat16 on a CPU with bf16 instructions): the tier asserts answers equal token for token
    # across a prefix-cache hit, a store load and a migrated stream, which holds in float32 and not in bfloat16
    # (docs/cpu.md, "The auto dtype"); the lm-eval parity is against transformers in float32. test_demo runs the
    # default dtype.
    "DEEPINFER_PREFILL_DTYPE": "float32",
    "DEEPINFER_DECODE_DTYPE": "float32",
    # Short leases and timeouts so failure tests finish quickly; defaults are for production.
    "DEEPINFER_SCHEDULER_WORKER_LEASE_S": "2",
    # The shared stack has one decode worker: its failure tests check the clean error a lost worker leaves when
    # nothing is migrated (as with a spent budget); test_migration.py runs a stack of its own with migration on.
    "DEEPINFER_GATEWAY_MIGRATION": "false",
    # Every service writes its spans beside its log (stack.trace_dir), exported every 0.2 s.
    "DEEPINFER_OTEL_EXPORTER": "file",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
}


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data"))}  # the store's segments
    with Stack(port=0, env_overrides=env, start_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="session")
def client(stack: Stack) -> openai.OpenAI:
    # the timeout only stops a hang: the first json_schema request took over 60 s with both cores busy
    return openai.OpenAI(base_url=stack.base_url, api_key="e2e", max_retries=0, timeout=300)


def metrics(stack: Stack, name: str) -> dict[str, float]:
    """A service's Prometheus samples (name{labels} → value) from its internal port."""
    text = httpx.get(f"http://127.0.0.1:{stack.services[name].internal_port}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][^ ]*) ([-+0-9.eEinfNa]+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll until predicate() is truthy; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def workers_idle(stack: Stack) -> bool:
    """No request running, waiting or holding blocks (or a lease) on decode-0 and prefill-0."""
    decode, prefill = metrics(stack, "decode-0"), metrics(stack, "prefill-0")
    return (
        decode["deepinfer_worker_running_requests"] == 0
        and decode["deepinfer_worker_waiting_requests"] == 0
        and decode["deepinfer_worker_free_blocks"] == decode["deepinfer_worker_total_blocks"]
        and prefill["deepinfer_worker_running_requests"] == 0
        and prefill["deepinfer_worker_held_leases"] == 0
        and prefill["deepinfer_worker_free_blocks"] == prefill["deepinfer_worker_total_blocks"]
    )


@pytest.fixture(scope="session")
def offline_llm(stack):
    """The offline engine on the same model and dtype (float32, as STACK_ENV pins the workers), the reference for
    the disaggregated path."""
    import torch

    from deepinfer import LLM

    torch.set_num_threads(1)
    return LLM(stack.model, dtype=STACK_ENV["DEEPINFER_DECODE_DTYPE"], progress=False)
