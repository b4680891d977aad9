"""The OpenAI-compatible HTTP API (FastAPI): auth, size limit, validation, then the handler's pipeline.

    POST /v1/chat/completions, POST /v1/completions   stream (SSE) or not
    GET  /v1/models, GET /v1/models/{model}

Every error is OpenAI's error object with its status; /health, /ready and /metrics live on the internal port.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer.telemetry import request_context
from services.gateway.errors import (
    ApiError,
    bad_request,
    from_validation_error,
    internal,
    not_found,
    overloaded,
    too_large,
    unauthorized,
)
from services.gateway.handler import GatewayHandler
from services.gateway.metrics import GatewayMetrics, RequestRecord
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from services.gateway.output import ChoiceOutput
from services.gateway.recipe import (
    ModelInfo,
    cache_salt_for,
    chat_prompt_token_ids,
    check_model,
    completion_prompt_token_ids,
    sampling_params,
    split_choices,
)
from services.gateway.responses import Generation, full_response, start_choices, stream_events

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ApiState:
    """What the routes need: the pipeline, the model, limits, metrics and whether new work is taken."""

    handler: GatewayHandler
    model: ModelInfo
    metrics: GatewayMetrics
    api_keys: list[str] = field(default_factory=list)
    max_request_bytes: int = 16 * 1024 * 1024
    accepting: bool = True


class SseResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a failed send (ASGI 2.4 disconnect) still
    runs the generator's cleanup (Cancel to the workers) at once instead of at garbage collection."""

    async def stream_response(self, send: Send) -> None:
        """Stream, then close the body generator whatever happened."""
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route when keys are configured; the key rides in scope state."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """401 unless the bearer token is one of the keys (compared in constant time)."""
        if scope["type"] != "http" or not self.api_keys:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        token = token.strip()
        ok = scheme.lower() == "bearer" and token != ""
        ok = ok and any([hmac.compare_digest(token.encode(), key) for key in self.api_keys])
        if not ok:
            message = "Incorrect API key provided" if token else "Missing API key (Authorization: Bearer ...)"
            await unauthorized(message).response()(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = token
        await self.app(scope, receive, send)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object: 413 over `max_bytes` (checked while reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_large(max_bytes)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


class Routes:
    """The API routes over one ApiState."""

    def __init__(self, state: ApiState) -> None:
        self.state = state

    async def list_models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model."""
        return ModelList(data=[self._card()]).model_dump(mode="json")

    async def get_model(self, model_id: str) -> Response:
        """GET /v1/models/{model}."""
        if model_id != self.state.model.served_model_name:
            return not_found(f"The model '{model_id}' does not exist", "model", "model_not_found").response()
        return JSONResponse(self._card().model_dump(mode="json"))

    def _card(self) -> ModelCard:
        model = self.state.model
        return ModelCard(id=model.served_model_name, created=model.created, max_model_len=model.max_model_len)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._serve(request, "completions")

    async def _serve(self, request: Request, api: str) -> Response:
        record = self.state.metrics.begin(api)
        request_id = f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        with request_context(request_id):
            try:
                stream, generation = await self._start(request, api, request_id, record)
            except ApiError as exc:
                record.end(exc.status_code)
                return exc.response()
            except Exception:
                logger.exception("request failed before generation")
                record.end(500)
                return internal(request_id).response()
            if stream:
                return SseResponse(
                    stream_events(generation, request.is_disconnected),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
            return await self._collect(generation)

    async def _collect(self, generation: Generation) -> Response:
        try:
            body = await full_response(generation)
        except ApiError as exc:
            generation.end(exc.status_code)
            return exc.response()
        except Exception:
            logger.exception("request failed during generation")
            generation.end(500)
            return internal(generation.response_id).response()
        generation.end(200)
        return JSONResponse(body)

    async def _start(
        self, request: Request, api: str, request_id: str, record: RequestRecord
    ) -> tuple[bool, Generation]:
        """Validate → recipe → start every choice on the workers; the Generation streams the rest."""
        state = self.state
        if not state.accepting:
            raise overloaded("the server is shutting down")
        data = await read_json(request, state.max_request_bytes)
        body_cls = ChatCompletionRequest if api == "chat" else CompletionRequest
        try:
            body: Any = body_cls.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        check_model(state.model, body.model)
        if api == "chat":
            prompt_token_ids = await asyncio.to_thread(chat_prompt_token_ids, state.model, body)
            max_tokens = body.max_completion_tokens or body.max_tokens
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompt_token_ids = await asyncio.to_thread(completion_prompt_token_ids, state.model, body)
            max_tokens, logprobs = body.max_tokens, body.logprobs
        sampling = sampling_params(state.model, body, len(prompt_token_ids), max_tokens, logprobs)
        api_key = getattr(request.state, "api_key", None)
        requests = split_choices(request_id, prompt_token_ids, sampling, cache_salt_for(api_key, body), body.n)
        record.prompt(len(prompt_token_ids))
        runs = await start_choices(state.handler, requests)
        tokenizer = state.model.tokenizer
        generation = Generation(
            api=api,  # type: ignore[arg-type]
            response_id=request_id,
            created=int(time.time()),
            model_name=state.model.served_model_name,
            tokenizer=tokenizer,
            runs=runs,
            outputs=[
                ChoiceOutput(i, tokenizer, r.request.prompt_token_ids, r.request.sampling) for i, r in enumerate(runs)
            ],
            logprobs=logprobs is not None,
            top_logprobs=bool(logprobs),
            include_usage=body.include_usage,
            record=record,
        )
        return body.stream, generation


def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return not_found("Unknown route", code="not_found").response()
    return ApiError(exc.status_code, str(exc.detail), "invalid_request_error").response()


def create_app(state: ApiState) -> FastAPI:
    """The API app over `state` (FastAPI's docs routes are off: the API surface is OpenAI's)."""
    routes = Routes(state)
    app = FastAPI(title="DeepInfer gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = state
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(ApiKeyMiddleware, api_keys=state.api_keys)
    return app
