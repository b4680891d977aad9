"""Anthropic's Messages API as one more presenter over the same request pipeline (`POST /v1/messages`).

    body = MESSAGES.parse(data)          # 400 (Anthropic's error shape) naming the bad field
    MESSAGES.response(generation)        # {"type": "message", "content": [{"type": "text", ...}], "usage": ...}
    MESSAGES.stream(generation)          # message_start, content_block_start, ping, content_block_delta...,
                                         # content_block_stop, message_delta, message_stop (or an error event)

Errors on these routes are `{"type": "error", "error": {"type", "message"}}` with Anthropic's types; an overloaded
server answers 529, as Anthropic's API does.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from services.gateway.anthropic_models import (
    AnthropicError,
    AnthropicErrorObject,
    AnthropicUsage,
    MessagesRequest,
    MessagesResponse,
    ResponseTextBlock,
    to_dict,
)
from services.gateway.errors import ApiError
from services.gateway.output import ChoiceDelta, ChoiceOutput
from services.gateway.presenters import Presenter, StreamFormatter
from services.gateway.recipe import ModelInfo, chat_prompt_token_ids
from services.gateway.vllm_models import TokenizeChatRequest

if TYPE_CHECKING:
    from services.gateway.generation import Generation

#: Anthropic's error type per HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error",
}
#: Anthropic reports an overloaded server as 529 (its SDKs retry it).
_STATUS = {503: 529}


def anthropic_error(exc: ApiError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an ApiError in Anthropic's shape."""
    status = _STATUS.get(exc.status_code, exc.status_code)
    error_type = _ERROR_TYPES.get(status, "api_error")
    return status, to_dict(AnthropicError(error=AnthropicErrorObject(type=error_type, message=exc.message)))


def anthropic_error_response(exc: ApiError) -> JSONResponse:
    """An ApiError as Anthropic's error response, its headers (Retry-After, x-ratelimit-*) kept."""
    status, body = anthropic_error(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers())


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stop_reason(output: ChoiceOutput) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if output.finish_reason == "length":
        return "max_tokens", None
    matched = getattr(output.stop_checker, "matched_stop", None) if output.stop_checker.stopped else None
    if matched is not None:
        return "stop_sequence", matched
    return ("end_turn", None) if output.finish_reason is not None else (None, None)


def _usage(generation: Generation) -> AnthropicUsage:
    usage = generation.usage()
    cached = usage.prompt_tokens_details.cached_tokens
    return AnthropicUsage(
        input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


class MessagesPresenter(Presenter):
    """Anthropic messages: `message` bodies and the Messages streaming events."""

    route = "messages"
    id_prefix = "msg_"
    body_type = MessagesRequest
    response_type = MessagesResponse

    def error_response(self, exc: ApiError) -> JSONResponse:
        """Anthropic's error shape."""
        return anthropic_error_response(exc)

    def prompt_token_ids(self, model: ModelInfo, body: MessagesRequest) -> list[int]:
        """System and turns through the model's chat template; a last assistant turn is continued (prefill)."""
        continues = body.messages[-1].role == "assistant"
        chat = TokenizeChatRequest(
            messages=body.chat_messages(), add_generation_prompt=not continues, continue_final_message=continues
        )
        return chat_prompt_token_ids(model, chat)

    def max_tokens(self, body: MessagesRequest) -> int | None:
        """max_tokens (required by the API)."""
        return body.max_tokens

    def logprobs(self, body: MessagesRequest) -> int | None:
        """None: the Messages API has no logprobs."""
        return None

    def response(self, generation: Generation) -> dict[str, Any]:
        """The message: one text block."""
        (output,) = generation.outputs
        stop_reason, stop_sequence = _stop_reason(output)
        return to_dict(MessagesResponse(
            id=generation.response_id, model=generation.model_name, content=[ResponseTextBlock(text=output.text)],
            stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(generation),
        ))

    def choice(self, generation: Generation, output: ChoiceOutput) -> Any:
        """Unused: the message is built whole by `response`."""
        raise NotImplementedError

    def stream(self, generation: Generation) -> StreamFormatter:
        """The Messages streaming events."""
        return _MessagesStream(generation)


class _MessagesStream(StreamFormatter):
    def __init__(self, generation: Generation) -> None:  # no OpenAI chunk frame to prepare
        self.generation = generation

    def opening(self) -> list[str]:
        g = self.generation
        message = MessagesResponse(
            id=g.response_id, model=g.model_name, content=[], stop_reason=None,
            usage=AnthropicUsage(input_tokens=len(g.runs[0].request.prompt_token_ids), output_tokens=0),
        )
        return [
            _event("message_start", {"type": "message_start", "message": to_dict(message)}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
            _event("ping", {"type": "ping"}),
        ]

    def delta(self, delta: ChoiceDelta) -> list[str]:
        if not delta.text:
            return []
        return [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": delta.text}})]

    def closing(self) -> list[str]:
        g = self.generation
        stop_reason, stop_sequence = _stop_reason(g.outputs[0])
        return [
            _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _event("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                     "usage": to_dict(_usage(g))}),
            _event("message_stop", {"type": "message_stop"}),
        ]

    def error(self, exc: ApiError) -> list[str]:
        _, body = anthropic_error(exc)
        return [_event("error", body)]


MESSAGES = MessagesPresenter()
