"""vLLM's /tokenize and /detokenize, and /openapi.json built from the typed request models (validation errors are
still OpenAI's 400, never FastAPI's 422)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.openai_models import ChatCompletionRequest
from tests.gateway_harness import MAX_MODEL_LEN, MODEL, Harness, make_harness

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir)
    yield h
    await h.fake.stop()


async def test_tokenize_a_prompt_and_a_conversation_as_vllm(harness: Harness):
    tokenizer = harness.tokenizer
    async with harness.http() as http:
        prompt = (await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there",
                                                     "return_token_strs": True})).json()
        chat = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        bare = (await http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False})).json()
    ids = tokenizer.encode("Hello there")
    assert prompt == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                      "token_strs": [tokenizer.backend.id_to_token(i) for i in ids]}
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES) and chat["token_strs"] is None
    assert bare["tokens"] == tokenizer.encode("Hello", add_special_tokens=False)


async def test_detokenize_round_trips(harness: Harness):
    ids = harness.tokenizer.encode("Hello there", add_special_tokens=False)
    async with harness.http() as http:
        text = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert text.json() == {"prompt": "Hello there"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'a' * 200000000 }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 384]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
async def test_tokenizer_routes_refuse_bad_bodies_in_openais_shape(harness: Harness, path, body, status, param):
    async with harness.http() as http:
        response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


async def test_openapi_documents_every_api_route_with_its_typed_body(harness: Harness):
    async with harness.http() as http:
        doc = (await http.get("/openapi.json")).json()
        invalid = await http.post("/v1/chat/completions", json={"model": MODEL})
    routes = {r.path.replace(":path", "") for r in harness.app.routes if isinstance(r, APIRoute) and r.include_in_schema}
    assert routes == set(doc["paths"]) and "/openapi.json" not in doc["paths"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert set(schema["properties"]) == set(ChatCompletionRequest.model_json_schema()["properties"])
    assert schema["properties"]["model"] == {"type": "string", "enum": [MODEL]}
    assert set(chat["responses"]) >= {"200", "400", "401", "404", "413", "429", "503"} and "422" not in chat["responses"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert doc["paths"]["/health"]["get"]["security"] == [] and chat["security"] == [{"bearer": []}, {"anthropic": []}]
    # what the document calls invalid is OpenAI's 400 naming the field
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages"
