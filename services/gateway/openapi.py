"""`GET /openapi.json`: the API described from the typed request and response models the routes validate with.

The routes read their bodies themselves (size limit while reading, strict JSON, OpenAI's 400 for any invalid field
instead of FastAPI's 422), so FastAPI cannot see their body types: this module puts them in. The served model fixes
a few bounds the models cannot: `model` is the served name, token ids are below the vocabulary size and
`max_tokens` is below the context length. Every operation documents the statuses the error table can produce,
with OpenAI's error object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import deepinfer
from services.gateway.anthropic_models import AnthropicError, MessagesRequest, MessagesResponse
from services.gateway.errors import HTTP_ERRORS
from services.gateway.openai_models import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from services.gateway.recipe import ModelInfo
from services.gateway.vllm_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

_REF = "#/components/schemas/{model}"


class ErrorObject(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error response: `{"error": {...}}`."""

    error: ErrorObject


@dataclass(frozen=True)
class Operation:
    """What the document says of one route: its body types, and whether it may answer an SSE stream."""

    request: tuple[type[BaseModel], ...] = ()
    response: type[BaseModel] | None = None
    #: The event object of an SSE answer (stream: true), if the route streams.
    chunk: type[BaseModel] | None = None
    #: Answered without an API key.
    open: bool = False
    #: Anthropic's API: its error object, its key header, its stream events.
    anthropic: bool = False


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "post"): Operation((ChatCompletionRequest,), ChatCompletionResponse, ChatCompletionChunk),
    ("/v1/completions", "post"): Operation((CompletionRequest,), CompletionResponse, CompletionResponse),
    ("/v1/models", "get"): Operation(response=ModelList),
    ("/v1/models/{model_id}", "get"): Operation(response=ModelCard),
    ("/v1/messages", "post"): Operation((MessagesRequest,), MessagesResponse, anthropic=True),
    ("/tokenize", "post"): Operation((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    ("/detokenize", "post"): Operation((DetokenizeRequest,), DetokenizeResponse),
    ("/health", "get"): Operation(open=True),
    ("/version", "get"): Operation(open=True),
}
#: Fields whose integers are token ids, and those bounded by the context length.
_TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "tokens")
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def openapi_document(app: FastAPI, model: ModelInfo) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`'s routes, with the body schemas filled in for `model`."""
    doc = get_openapi(title="DeepInfer gateway", version=deepinfer.__version__, routes=app.routes)
    models = {m for op in OPERATIONS.values() for m in (*op.request, op.response, op.chunk) if m is not None}
    _, schemas = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
        + [(ErrorResponse, "serialization"), (AnthropicError, "serialization")],
        ref_template=_REF,
    )
    components = schemas.get("$defs", {})
    _bind_to_model(components, model)
    doc.setdefault("components", {})["schemas"] = components
    doc["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "anthropic": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    for (path, method), operation in OPERATIONS.items():
        spec = doc["paths"].get(path, {}).get(method)
        if spec is not None:
            _describe(spec, operation)
    return doc


def _describe(spec: dict[str, Any], op: Operation) -> None:
    # either key header serves any route; each API's own is listed first
    keys = [{"anthropic": []}, {"bearer": []}] if op.anthropic else [{"bearer": []}, {"anthropic": []}]
    spec["security"] = [] if op.open else keys
    if op.request:
        refs = [{"$ref": _REF.format(model=m.__name__)} for m in op.request]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        spec["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    ok = spec.setdefault("responses", {}).setdefault("200", {"description": "Successful Response"})
    if op.response is not None:
        ok["content"] = {"application/json": {"schema": {"$ref": _REF.format(model=op.response.__name__)}}}
        if op.chunk is not None:
            ok["content"]["text/event-stream"] = {"schema": _sse_event(op.chunk)}
        if op.anthropic:
            ok["content"]["text/event-stream"] = {"schema": _ANTHROPIC_EVENT}
    error_model = "AnthropicError" if op.anthropic else "ErrorResponse"
    error = {"application/json": {"schema": {"$ref": _REF.format(model=error_model)}}}
    statuses = sorted({http.status_code for http in HTTP_ERRORS.values()} | {405} | ({529} if op.anthropic else set()))
    for status in statuses:
        if status != 401 or not op.open:
            spec["responses"][str(status)] = {"description": "OpenAI's error object", "content": error}
    spec["responses"].pop("422", None)  # validation errors are OpenAI's 400, never FastAPI's 422


#: One event of a Messages stream: `event: <type>` and a JSON object of that type.
_ANTHROPIC_EVENT = {
    "type": "object", "required": ["event", "data"],
    "properties": {
        "event": {"enum": ["message_start", "content_block_start", "ping", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"type": "object", "required": ["type"]}},
    },
}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk or an error object as JSON, or the closing `[DONE]`."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model="ErrorResponse")}]}
    data = {"anyOf": [
        {"type": "string", "const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
    ]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _bind_to_model(components: dict[str, Any], model: ModelInfo) -> None:
    """The bounds only the served model knows, on every request schema's fields."""
    for schema in components.values():
        properties = schema.get("properties", {})
        if "model" in properties:
            _replace_strings(properties["model"], {"type": "string", "enum": [model.served_model_name]})
        for name in _TOKEN_ID_FIELDS:
            if name in properties:
                _bound_integers(properties[name], model.vocab_size - 1, minimum=0)
        if model.max_model_len is not None:
            for name in _LENGTH_FIELDS:
                if name in properties:
                    _bound_integers(properties[name], model.max_model_len - 1)


def _bound_integers(node: Any, maximum: int, minimum: int | None = None) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(maximum, node.get("maximum", maximum))
            if minimum is not None:
                node["minimum"] = max(minimum, node.get("minimum", minimum))
        for value in node.values():
            _bound_integers(value, maximum, minimum)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value, maximum, minimum)


def _replace_strings(node: dict[str, Any], replacement: dict[str, Any]) -> None:
    if node.get("type") == "string":
        node.clear()
        node.update(replacement)
    for branch in node.get("anyOf", []):
        _replace_strings(branch, replacement)
