"""ASGI middleware of the API app: API keys (tenant in scope state), x-request-id and x-deepinfer-gateway (the
answering gateway process's id: several share one port) on every response.

    app.add_middleware(ApiKeyMiddleware, keys=KeyRing.from_settings(settings))
    app.add_middleware(RequestIdMiddleware, gateway_id=settings.gateway_id)
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.anthropic import anthropic_error_response
from services.gateway.auth import KeyRing
from services.gateway.errors import unauthorized

#: Routes answered without an API key: load balancers and benchmark tools probe them.
OPEN_PATHS = frozenset({"/health", "/version"})
#: Longest client x-request-id echoed back (a longer or non-printable one is replaced by the gateway's own).
MAX_REQUEST_ID_CHARS = 256
#: The response header naming the gateway process that answered.
GATEWAY_HEADER = "x-deepinfer-gateway"


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route but the probes when keys are
    configured; the key's tenant id (its digest, never the key) rides in scope state."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """401 unless the bearer token is one of the keys (compared by digest, in constant time)."""
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        tokens = presented_keys(Headers(scope=scope))
        tenants = {self.keys.tenant_of(token) for token in tokens}
        # every key presented must be right, and name one tenant: a wrong key is never outvoted by a right one
        tenant = tenants.pop() if len(tenants) == 1 else None
        if tenant is None:
            message = "Incorrect API key provided" if tokens else "Missing API key (Authorization: Bearer ...)"
            error = unauthorized(message)
            response = anthropic_error_response(error) if is_anthropic_path(scope["path"]) else error.response()
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """`x-request-id` on every response: the client's (when printable and at most 256 characters), else the one a
    route set (a completion's id), else a new one. The client's id rides in scope state as `client_request_id`.
    With `gateway_id`, `x-deepinfer-gateway: <gateway_id>` too."""

    def __init__(self, app: ASGIApp, gateway_id: str | None = None) -> None:
        self.app = app
        self.gateway_id = gateway_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the client's id, then add the header to the response's start unless a route set it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = client_request_id(Headers(scope=scope).get("x-request-id"))
        scope.setdefault("state", {})["client_request_id"] = client_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if client_id is not None:
                    headers["x-request-id"] = client_id
                elif "x-request-id" not in headers:
                    headers["x-request-id"] = uuid.uuid4().hex
                if self.gateway_id is not None:
                    headers[GATEWAY_HEADER] = self.gateway_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def presented_keys(headers: Headers) -> list[str]:
    """The keys a request presents: `Authorization: Bearer <key>` and Anthropic's `x-api-key: <key>`."""
    keys = []
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if "authorization" in headers:
        keys.append(token.strip() if scheme.lower() == "bearer" else "")  # another scheme: a wrong key
    if "x-api-key" in headers:
        keys.append(headers["x-api-key"].strip())
    return keys


def is_anthropic_path(path: str) -> bool:
    """Whether a path belongs to Anthropic's API (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def client_request_id(value: str | None) -> str | None:
    """The client's x-request-id when it is one we echo (printable ASCII, at most MAX_REQUEST_ID_CHARS)."""
    if value is None or not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        return None
    return value if value.isascii() and value.isprintable() else None
