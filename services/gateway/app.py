"""The OpenAI-compatible HTTP API (FastAPI): auth, size limit, validation, then the request pipeline.

    POST /v1/chat/completions, POST /v1/completions   stream (SSE) or not; one presenter per API shape
    GET  /v1/models, GET /v1/models/{model}
    POST /v1/messages                                  Anthropic's Messages API (x-api-key), the same pipeline
    POST /tokenize, POST /detokenize                   vLLM's shapes
    GET  /openapi.json                                 from the typed request models (services/gateway/openapi.py)
    GET  /health (200 when serving, else 503), GET /version: on the API port, no API key (as vLLM, SGLang)

Every error is OpenAI's error object with its status (Anthropic's on /v1/messages); /ready and /metrics live on
the internal port.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

import deepinfer
from deepinfer.config import GatewaySettings
from deepinfer.protocol import ErrorCode
from deepinfer.telemetry import request_context
from deepinfer.telemetry.hops import Hops
from services.gateway.anthropic import MESSAGES, anthropic_error_response
from services.gateway.auth import KeyRing, cache_salt
from services.gateway.errors import (
    ApiError,
    bad_request,
    internal,
    model_not_found,
    overloaded,
    too_large,
)
from services.gateway.generation import Generation, collect, start_choices, stream_events
from services.gateway.limits import RateLimits
from services.gateway.metrics import GatewayMetrics, RequestRecord
from services.gateway.middleware import ApiKeyMiddleware, RequestIdMiddleware, is_anthropic_path
from services.gateway.openai_models import ModelCard, ModelList
from services.gateway.openapi import openapi_document
from services.gateway.output import ChoiceOutput
from services.gateway.pipeline import RequestPipeline
from services.gateway.presenters import CHAT, COMPLETIONS, Presenter
from services.gateway.recipe import (
    ModelInfo,
    check_model,
    check_prompt_logprobs_fit,
    sampling_params,
    split_choices,
)
from services.gateway.structured import compiles_grammar
from services.gateway.tokenizer_routes import detokenize, tokenize

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

#: Request bodies up to this size are templated and tokenized on the event loop (~1 µs per token: a 4 KiB body
#: is ~1k tokens, ~1 ms of CPU); larger ones in a worker thread, so a 100k-token prompt never blocks the loop.
INLINE_PROMPT_BYTES = 4096

T = TypeVar("T")

#: FastAPI's own OpenTelemetry (0.165 on): the gateway traces its requests itself (gateway.request and its hops),
#: and FastAPI's check whether a global provider is set (three provider look-ups reading os.environ) cost every
#: request ~2% of the gateway's CPU under a burst for spans it never made (deepinfer sets no global provider).
_NO_FASTAPI_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
)


@dataclass
class ApiState:
    """What the routes need: the pipeline, the model, metrics, the settings and whether new work is taken."""

    pipeline: RequestPipeline
    model: ModelInfo
    metrics: GatewayMetrics
    settings: GatewaySettings
    hops: Hops
    accepting: bool = True
    #: Per-key requests and tokens per minute (from the settings).
    limits: RateLimits = field(init=False)

    def __post_init__(self) -> None:
        self.limits = RateLimits(self.settings.requests_per_minute, self.settings.tokens_per_minute)

    def not_ready_reason(self) -> str:
        """Why requests cannot be served now ("" when they can). A decode worker is enough: without a prefill
        worker the scheduler sends the whole request to it and it computes the prompt."""
        if not self.accepting:
            return "draining"
        if not self.pipeline.membership.has_decode():
            return "no decode-capable worker seen in heartbeats"
        return ""


class SseResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a failed send (ASGI 2.4 disconnect) still
    runs the generator's cleanup (Cancel to the workers) at once instead of at garbage collection.

    It streams on the request's own task under every ASGI version. Starlette, under a server that speaks ASGI
    < 2.4 (uvicorn says 2.3), runs the body in a task group beside a second task that only waits for the
    client's disconnect: two tasks and a cancel scope per response. The gateway does not need it: a streaming
    request checks for the disconnect itself every `poll_interval_s` (RunningRequest), and then ends the
    generator, which cancels the request on the workers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the body (then any background task), as Starlette does under ASGI 2.4."""
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        """Stream, then close the body generator whatever happened."""
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object: 413 over `max_bytes` (checked while reading), 400 if not JSON."""
    return (await read_json_sized(request, max_bytes))[0]


async def read_json_sized(request: Request, max_bytes: int) -> tuple[dict[str, Any], int]:
    """`read_json`, and the body's size in bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_large(max_bytes)
    try:
        # pydantic's JSON parser: nesting deeper than 200 levels and lone surrogates (which no tokenizer can encode)
        # are parse errors here, not a RecursionError or UnicodeEncodeError later on.
        data = pydantic_core.from_json(bytes(body), allow_inf_nan=False)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data, len(body)


class Routes:
    """The API routes over one ApiState."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        self._openapi: dict[str, Any] | None = None

    async def health(self) -> Response:
        """GET /health: 200 while requests can be served, else 503 saying why."""
        reason = self.state.not_ready_reason()
        if reason:
            return overloaded(f"not serving: {reason}", self.state.settings.retry_after_s).response()
        return JSONResponse({"status": "ok"})

    async def version(self) -> dict[str, str]:
        """GET /version."""
        return {"version": deepinfer.__version__}

    async def list_models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model."""
        return ModelList(data=[self._card()]).model_dump(mode="json")

    async def get_model(self, model_id: str) -> Response:
        """GET /v1/models/{model}."""
        if model_id != self.state.model.served_model_name:
            return model_not_found(model_id).response()
        return JSONResponse(self._card().model_dump(mode="json"))

    def _card(self) -> ModelCard:
        model = self.state.model
        return ModelCard(id=model.served_model_name, created=model.created, max_model_len=model.max_model_len,
                         default_sampling_params=model.default_sampling)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: built once, from the typed request and response models."""
        if self._openapi is None:
            self._openapi = openapi_document(request.app, self.state.model)
        return JSONResponse(self._openapi)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's shape)."""
        return await self._tokenizer_route(request, lambda data: tokenize(self.state.model, self.state.settings, data))

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's shape)."""
        return await self._tokenizer_route(request, lambda data: detokenize(self.state.model, data))

    async def _tokenizer_route(
        self, request: Request, handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Response:
        try:
            data = await read_json(request, int(self.state.settings.max_request_bytes))
            return JSONResponse(await handle(data))
        except ApiError as exc:
            return exc.response()
        except Exception:
            logger.exception("tokenizer route failed")
            return internal(uuid.uuid4().hex).response()

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._serve(request, CHAT)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._serve(request, COMPLETIONS)

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (Anthropic's Messages API)."""
        return await self._serve(request, MESSAGES)

    async def _serve(self, request: Request, presenter: Presenter) -> Response:
        """receive → start every choice on the workers → stream or collect, in the presenter's shape."""
        deadline_s = time.monotonic() + self.state.settings.request_timeout_s
        request_id = f"{presenter.id_prefix}{uuid.uuid4().hex}"
        attributes = {"request_id": request_id, "route": presenter.route}
        # scope["state"] is what request.state wraps; read as a dict, a missing key is no AttributeError raised
        client_request_id = _scope_state(request).get("client_request_id")
        if client_request_id is not None:
            attributes["client_request_id"] = client_request_id
        # The request's root span: every hop below, on every service, is in its trace; RequestRecord.end ends it.
        # With the exporter none the tracer is a no-op one: no span object, nothing attached (Hops.current).
        hops = self.state.hops
        span = hops.tracer.start_span("gateway.request", kind=SpanKind.SERVER, attributes=attributes)
        record = self.state.metrics.begin(presenter.route, span)
        headers = {"x-request-id": request_id}  # the client's own replaces it (RequestIdMiddleware)
        with request_context(request_id), hops.current(span):
            try:
                stream, generation = await self._start(request, presenter, request_id, record, deadline_s, headers)
            except ApiError as exc:
                record.end(exc.status_code)
                return _with_headers(presenter.error_response(exc), headers)
            except Exception:
                logger.exception("request failed before generation")
                record.end(500)
                return _with_headers(presenter.error_response(internal(request_id)), headers)
            if stream:
                return SseResponse(
                    stream_events(generation),
                    media_type="text/event-stream",
                    headers={**_SSE_HEADERS, **headers},
                )
            return _with_headers(await self._collect(generation, presenter), headers)

    async def _collect(self, generation: Generation, presenter: Presenter) -> Response:
        try:
            body = await collect(generation)
        except ApiError as exc:
            generation.end(exc.status_code)
            return presenter.error_response(exc)
        except Exception:
            logger.exception("request failed during generation")
            generation.end(500)
            return presenter.error_response(internal(generation.response_id))
        if body is None:
            generation.end(499)  # client closed the connection; the workers got a Cancel
            return Response(status_code=499)
        generation.end(200)
        return JSONResponse(body)

    async def _start(
        self, request: Request, presenter: Presenter, request_id: str, record: RequestRecord, deadline_s: float,
        headers: dict[str, str],
    ) -> tuple[bool, Generation]:
        """Validate → recipe → rate limits → start every choice on the workers; the Generation streams the rest.
        `headers` gets the response's x-ratelimit-* headers."""
        state = self.state
        if not state.accepting:
            raise overloaded("the server is shutting down", state.settings.retry_after_s)
        tenant = _scope_state(request).get("tenant")
        if state.limits:
            state.limits.check_requests(tenant or "")  # before the body is read: a flood costs nothing more
        data, body_bytes = await read_json_sized(request, int(state.settings.max_request_bytes))
        body = presenter.parse(data)
        check_model(state.model, body.model)
        presenter.check(state.model, body, state.settings)
        with state.hops.span("tokenize"):
            prompts = await off_loop_if(body_bytes > INLINE_PROMPT_BYTES, presenter.prompts, state.model, body)
        logprobs, prompt_logprobs = presenter.logprobs(body), presenter.prompt_logprobs(body)
        if prompt_logprobs is not None:
            check_prompt_logprobs_fit(prompts, prompt_logprobs, state.pipeline.bus.max_payload)
        samplings = [sampling_params(state.model, body, len(p.token_ids), presenter.max_tokens(body), logprobs,
                                     prompt_logprobs) for p in prompts]
        rules = None
        if any(getattr(body, name, None) is not None for name in ("response_format", "tools", "tool_choice")):
            with state.hops.span("grammar"):
                rules = await off_loop_if(compiles_grammar(body), presenter.output_rules, state.model, body)
        if rules is not None:
            samplings = [rules.apply(sampling) for sampling in samplings]
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        if state.limits:
            headers.update(state.limits.admit(
                tenant or "", num_prompt_tokens + sum(sampling.max_tokens or 0 for sampling in samplings)))
        salt = cache_salt(tenant, body.cache_salt)
        requests = [
            choice
            for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True))
            for choice in split_choices(request_id, prompt.token_ids, sampling, salt, body.n, deadline_s,
                                        request.is_disconnected, first_index=i * body.n,
                                        num_choices=len(prompts) * body.n)
        ]
        record.prompt(num_prompt_tokens)
        record.span.set_attribute("num_prompt_tokens", num_prompt_tokens)
        runs = await start_choices(state.pipeline, requests)
        tokenizer, scores_only = state.model.tokenizer, presenter.scores_only(body)
        generation = Generation(
            presenter=presenter,
            response_id=request_id,
            created=int(time.time()),
            model_name=state.model.served_model_name,
            tokenizer=tokenizer,
            runs=runs,
            outputs=[
                ChoiceOutput(i, tokenizer, r.request.prompt_token_ids, r.request.sampling,
                             None if rules is None else rules.checker(state.model), scores_only=scores_only)
                for i, r in enumerate(runs)
            ],
            logprobs=logprobs is not None,
            num_top_logprobs=logprobs or 0,
            include_usage=body.include_usage,
            record=record,
            hops=state.hops,
            rules=rules,
            prompts=prompts,
            n=body.n,
            echo=bool(getattr(body, "echo", False)),
            prompt_logprobs=getattr(body, "prompt_logprobs", None) is not None,
        )
        return body.stream, generation


def _scope_state(request: Request) -> dict[str, Any]:
    """What the middlewares put in the request's state (`request.state` is a view of this dict)."""
    return request.scope.get("state") or {}


async def off_loop_if(slow: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread when `slow`, else right here on the event loop: for a short prompt the thread
    hop (a queue, a self-pipe wakeup, GIL hand-offs behind a busy loop) costs more than the work, and under a burst
    each hop waits behind every other request's."""
    if slow:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    """`response` with `headers` added (those it set itself, e.g. a 429's x-ratelimit-*, win)."""
    for name, value in headers.items():
        if name not in response.headers:
            response.headers[name] = value
    return response


def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (unknown route, wrong method) in the route's API shape, their status kept."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        error = ApiError(ErrorCode.NOT_FOUND, "Unknown route")
    else:
        error = bad_request(str(exc.detail))
        error.status_code = exc.status_code
    response = anthropic_error_response(error) if is_anthropic_path(request.url.path) else error.response()
    return _with_headers(response, dict(exc.headers or {}))  # a 405's Allow


def create_app(state: ApiState) -> FastAPI:
    """The API app over `state` (FastAPI's docs routes are off: the API surface is OpenAI's)."""
    routes = Routes(state)
    app = FastAPI(title="DeepInfer gateway", docs_url=None, redoc_url=None, openapi_url=None, **_NO_FASTAPI_TELEMETRY)
    app.state.api = state
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/openapi.json", routes.openapi, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(ApiKeyMiddleware, keys=KeyRing.from_settings(state.settings))
    app.add_middleware(RequestIdMiddleware, gateway_id=state.settings.gateway_id)  # outermost: a 401 carries x-request-id too
    return app
