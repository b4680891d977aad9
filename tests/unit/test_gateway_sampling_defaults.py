"""The model's recommended sampling (generation_config.json, else the model registry) fills what a request leaves
out; the request's own values win; `sampling_defaults=openai` turns it off; /v1/models lists it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.defaults import DEFAULT_MODEL
from deepinfer.model_store import recommended_sampling
from deepinfer.sampling.params import generation_sampling
from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.recipe import model_sampling_defaults
from tests.gateway_harness import MODEL, make_harness

MESSAGES = [{"role": "user", "content": "Hi there"}]
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.3, "top_p": 0.8, "top_k": 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


def test_the_models_files_first_then_the_registry(model_dir: Path, tmp_path: Path):
    assert model_sampling_defaults(model_dir, str(model_dir)) == {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    bare = write_tokenizer_dir(tmp_path / "bare")  # no generation_config.json
    assert model_sampling_defaults(bare, DEFAULT_MODEL) == {"temperature": 0.2, "top_p": 0.9}
    assert model_sampling_defaults(bare, "HuggingFaceTB/SmolLM2-135M-Instruct") == recommended_sampling(None)
    assert model_sampling_defaults(bare, str(bare)) == {}
    assert generation_sampling({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}


async def test_a_field_left_out_takes_the_models_value_and_the_requests_own_wins(model_dir: Path):
    h = await make_harness(model_dir)
    client = h.openai()
    await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, extra_body={"top_k": 5})
    await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    left_out, own, greedy = (r.sampling for r in h.fake.decode_requests)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.3, 0.8, 20)
    assert (own.temperature, own.top_p, own.top_k) == (1.0, 0.8, 5)
    assert greedy.temperature == 0.0
    card = (await client.models.list()).data[0]
    assert card.model_extra["default_sampling_params"] == {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    await h.fake.stop()


async def test_openai_defaults_apply_none(model_dir: Path):
    h = await make_harness(model_dir, settings={"sampling_defaults": "openai"})
    client = h.openai()
    await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    (sampling,) = (r.sampling for r in h.fake.decode_requests)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)  # the wire's own defaults
    assert (await client.models.list()).data[0].model_extra["default_sampling_params"] == {}
    await h.fake.stop()
