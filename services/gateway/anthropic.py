"""Anthropic's Messages API as one more presenter over the same request pipeline (`POST /v1/messages`).

    body = MESSAGES.parse(data)          # 400 (Anthropic's error shape) naming the bad field
    MESSAGES.response(generation)        # {"type": "message", "content": [{"type": "text", ...}], "usage": ...}
    MESSAGES.stream(generation)          # message_start, content_block_start, ping, content_block_delta...,
                                         # content_block_stop, message_delta, message_stop (or an error event)

Tool use runs on the chat route's machinery (`MessagesRequest.chat_request`): tools rendered by the chat template,
tool_choice any / tool enforced by the call grammar, the output parsed by the model family's parser into
`tool_use` blocks (stop_reason "tool_use"). Streamed, text goes out as it comes until a call may begin; the calls
follow, each a tool_use block: content_block_start (empty input), one input_json_delta, content_block_stop.

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
    ResponseToolUseBlock,
    to_dict,
)
from services.gateway.errors import ApiError
from services.gateway.openai_models import ToolCall
from services.gateway.output import ChoiceDelta, ChoiceOutput
from services.gateway.presenters import Presenter, StreamFormatter
from services.gateway.recipe import ModelInfo, Prompt, chat_prompt_token_ids
from services.gateway.structured import OutputRules, output_rules
from services.gateway.tool_calls import ToolCallBuffer

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


def _stop_reason(output: ChoiceOutput, called: bool = False) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output; "tool_use" when it ended on calls (`called`)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    matched = getattr(output.stop_checker, "matched_stop", None) if output.stop_checker.stopped else None
    if matched is not None:
        return "stop_sequence", matched
    if output.finish_reason is None:
        return None, None
    return ("tool_use" if called else "end_turn"), None


def _tool_uses(calls: list[ToolCall]) -> list[ResponseToolUseBlock] | None:
    """The parsed calls as tool_use blocks; None when one's input is not a JSON object (then the output is text)."""
    blocks = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        if not isinstance(arguments, dict):
            return None
        blocks.append(ResponseToolUseBlock(id="toolu_" + call.id.removeprefix("call_"), name=call.function.name,
                                           input=arguments))
    return blocks


def _content(generation: Generation, text: str) -> list[ResponseTextBlock | ResponseToolUseBlock]:
    """A finished output's content: its text, or the text before the calls and a tool_use block per call."""
    fmt = generation.rules.tools if generation.rules is not None else None
    if fmt is not None:
        before, calls = fmt.parse(text)
        uses = _tool_uses(calls) if calls else None
        if uses:
            return [*([ResponseTextBlock(text=before)] if before else []), *uses]
    return [ResponseTextBlock(text=text)]


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

    def prompts(self, model: ModelInfo, body: MessagesRequest) -> list[Prompt]:
        """System, turns and tools through the model's chat template, as the chat route renders them; a last
        assistant turn is continued (prefill)."""
        return [Prompt(chat_prompt_token_ids(model, body.chat_request))]

    def max_tokens(self, body: MessagesRequest) -> int | None:
        """max_tokens (required by the API)."""
        return body.max_tokens

    def logprobs(self, body: MessagesRequest) -> int | None:
        """None: the Messages API has no logprobs."""
        return None

    def output_rules(self, model: ModelInfo, body: MessagesRequest) -> OutputRules | None:
        """tools / tool_choice, as the chat route reads them (any / tool: the call grammar)."""
        return output_rules(model, body.chat_request)

    def response(self, generation: Generation) -> dict[str, Any]:
        """The message: a text block, or the text before the calls and their tool_use blocks."""
        (output,) = generation.outputs
        content = _content(generation, output.text)
        stop_reason, stop_sequence = _stop_reason(output, called=content[-1].type == "tool_use")
        return to_dict(MessagesResponse(
            id=generation.response_id, model=generation.model_name, content=content,
            stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(generation),
        ))

    def choice(self, generation: Generation, output: ChoiceOutput) -> Any:
        """Unused: the message is built whole by `response`."""
        raise NotImplementedError

    def stream(self, generation: Generation) -> StreamFormatter:
        """The Messages streaming events."""
        if generation.rules is not None and generation.rules.tools is not None:
            return _ToolMessagesStream(generation)
        return _MessagesStream(generation)


def _block_start(index: int, block: dict[str, Any]) -> str:
    return _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> str:
    return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> str:
    return _event("content_block_stop", {"type": "content_block_stop", "index": index})


class _MessagesStream(StreamFormatter):
    """One text block, streamed as it comes."""

    def __init__(self, generation: Generation) -> None:  # no OpenAI chunk frame to prepare
        self.generation = generation

    def opening(self) -> list[str]:
        return [self._message_start(), _block_start(0, {"type": "text", "text": ""}), _event("ping", {"type": "ping"})]

    def delta(self, delta: ChoiceDelta) -> list[str]:
        if not delta.text:
            return []
        return [_block_delta(0, {"type": "text_delta", "text": delta.text})]

    def closing(self) -> list[str]:
        return [_block_stop(0), *self._message_end(called=False)]

    def _message_start(self) -> str:
        g = self.generation
        message = MessagesResponse(
            id=g.response_id, model=g.model_name, content=[], stop_reason=None,
            usage=AnthropicUsage(input_tokens=len(g.runs[0].request.prompt_token_ids), output_tokens=0),
        )
        return _event("message_start", {"type": "message_start", "message": to_dict(message)})

    def _message_end(self, called: bool) -> list[str]:
        g = self.generation
        stop_reason, stop_sequence = _stop_reason(g.outputs[0], called)
        return [
            _event("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                     "usage": to_dict(_usage(g))}),
            _event("message_stop", {"type": "message_stop"}),
        ]

    def error(self, exc: ApiError) -> list[str]:
        _, body = anthropic_error(exc)
        return [_event("error", body)]


class _ToolMessagesStream(_MessagesStream):
    """A request with tools: a text block opens once some text is surely not a call; the calls go out at the end,
    one tool_use block each (its input as one input_json_delta)."""

    def __init__(self, generation: Generation) -> None:
        super().__init__(generation)
        assert generation.rules is not None and generation.rules.tools is not None
        self.buffer = ToolCallBuffer(generation.rules.tools)
        self.text_open = False

    def opening(self) -> list[str]:
        return [self._message_start(), _event("ping", {"type": "ping"})]

    def delta(self, delta: ChoiceDelta) -> list[str]:
        return self._text(self.buffer.feed(delta.text))

    def closing(self) -> list[str]:
        held = self.buffer.held
        rest, calls = self.buffer.finish()
        uses = _tool_uses(calls) if calls else []
        if uses is None:  # a call whose input is no object: the output is text, as the whole response says
            rest, uses = held, []
        events = self._text(rest)
        if not uses and not self.text_open:
            events += self._text("", force=True)
        index = 0
        if self.text_open:
            events.append(_block_stop(0))
            index = 1
        for offset, use in enumerate(uses):
            block = {"type": "tool_use", "id": use.id, "name": use.name, "input": {}}
            arguments = json.dumps(use.input, ensure_ascii=False, separators=(",", ":"))
            events += [_block_start(index + offset, block),
                       _block_delta(index + offset, {"type": "input_json_delta", "partial_json": arguments}),
                       _block_stop(index + offset)]
        return events + self._message_end(called=bool(uses))

    def _text(self, text: str, force: bool = False) -> list[str]:
        """Events for text of the answer (block 0): the block's start first, once."""
        if not text and not force:
            return []
        events = [] if self.text_open else [_block_start(0, {"type": "text", "text": ""})]
        self.text_open = True
        return events + ([_block_delta(0, {"type": "text_delta", "text": text})] if text else [])


MESSAGES = MessagesPresenter()
