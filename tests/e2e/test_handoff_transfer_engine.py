"""`deepinfer up --prefill 1 --decode 2` with the P/D handoff through Mooncake Transfer Engine (the prefill worker's
`transfer_engine` on, the decode workers' `kv_transport=mooncake`: one machine standing in for two), on a tiny model
with the store off: the same greedy text as the same stack without it (every pull then over the data plane) and as
the offline engine, every pull through the engine. Skips, saying why, without the library."""

from __future__ import annotations

import openai
import pytest

from deepinfer.dataplane.transfer_engine import availability
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.up import Stack
from tests.e2e.conftest import metrics

pytestmark = pytest.mark.e2e

if reason := availability():
    pytest.skip(f"transfer engine unavailable: {reason}", allow_module_level=True)

DECODERS = ("decode-0", "decode-1")
PROMPTS = [[5 + i, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6, 70] * 3
           for i in range(4)]  # 63 tokens each: 4 blocks of 16
ENV = {
    "DEEPINFER_GATEWAY_API_KEYS": "",
    "OMP_NUM_THREADS": "1",
    "DEEPINFER_PREFILL_DTYPE": "float32",
    "DEEPINFER_DECODE_DTYPE": "float32",
    "DEEPINFER_PREFILL_TRANSFER_ENGINE": "true",
    "DEEPINFER_PREFILL_TRANSFER_ENGINE_EXPORT_BYTES": "64MiB",
    "DEEPINFER_DECODE_KV_TRANSPORT": "mooncake",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch

    torch.set_num_threads(1)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pd-te") / "llama", "llama"))


def _stack(model: str, env: dict[str, str]) -> Stack:
    return Stack(model=model, device="cpu", port=0, num_prefill=1, num_decode=2, num_kvcache=0, env_overrides=env,
                 start_timeout_s=240)


def _greedy_texts(stack: Stack) -> list[str]:
    client = openai.OpenAI(base_url=stack.base_url, api_key="e2e", max_retries=0, timeout=120)
    return [client.completions.create(model=stack.model_name, prompt=prompt, temperature=0, max_tokens=16,
                                      extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]


def _pulls(stack: Stack, via: str) -> float:
    return sum(metrics(stack, name).get(f'deepinfer_decode_kv_pulls_total{{via="{via}"}}', 0.0) for name in DECODERS)


def test_greedy_text_through_the_engine_equals_the_data_plane_handoff(tiny_model: str):
    from deepinfer import LLM, SamplingParams

    with _stack(tiny_model, ENV) as te_stack:
        through_engine = _greedy_texts(te_stack)
        assert _pulls(te_stack, "transfer_engine") == len(PROMPTS)
        assert _pulls(te_stack, "transfer_engine_fallback") == 0 and _pulls(te_stack, "data_plane") == 0
    without = {k: v for k, v in ENV.items() if "TRANSFER_ENGINE" not in k and "KV_TRANSPORT" not in k}
    with _stack(tiny_model, without) as plane_stack:
        over_data_plane = _greedy_texts(plane_stack)
        assert _pulls(plane_stack, "data_plane") == len(PROMPTS) and _pulls(plane_stack, "transfer_engine") == 0
    llm = LLM(tiny_model, dtype="float32", progress=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                       use_tqdm=False)]
    assert through_engine == over_data_plane == offline
