"""One presenter per API shape over the same request pipeline: how a body is read, how results are written.

    presenter = CHAT                                   # or COMPLETIONS; the Anthropic shape is one more
    body = presenter.parse(data)                       # 400 naming the bad field
    prompts = presenter.prompts(model, body)           # token ids (a completions batch has several prompts)
    ... the pipeline runs the choices (deepinfer's wire types, whatever the API) ...
    presenter.response(generation)                     # the non-streamed body
    events = presenter.stream(generation)              # SSE text: opening, per delta, closing / error
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from deepinfer.config import GatewaySettings
from services.gateway.errors import ApiError, bad_request, from_validation_error
from services.gateway.openai_models import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    ToolCallDelta,
)
from services.gateway.output import (
    ChoiceDelta,
    ChoiceOutput,
    LogprobEntry,
    chat_logprobs,
    completion_logprobs,
    prompt_entries,
    sampled_entries,
    vllm_prompt_logprobs,
)
from services.gateway.recipe import (
    ModelInfo,
    Prompt,
    chat_prompt_token_ids,
    check_request_template,
    completion_prompts,
)
from services.gateway.structured import OutputRules, output_rules
from services.gateway.tool_calls import ToolCallBuffer

if TYPE_CHECKING:
    from services.gateway.generation import Generation

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"
#: Per chunk type, its dump with no choices (StreamFormatter._empty_chunk).
_EMPTY_CHUNKS: dict[type[BaseModel], dict[str, Any]] = {}


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class StreamFormatter(ABC):
    """The SSE events of one streamed response (stateful: e.g. the completions text offsets)."""

    #: The event object (OpenAI: the chunk type); the usage event is one with no choices.
    chunk_type: type[BaseModel]

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.head, self.tail = self._frame()

    def opening(self) -> list[str]:
        """Events before the first delta."""
        return []

    @abstractmethod
    def delta(self, delta: ChoiceDelta) -> list[str]:
        """Events carrying one choice's delta (none when it carries nothing)."""

    def closing(self) -> list[str]:
        """Events after the last delta: usage when asked for, then the end marker."""
        g = self.generation
        if not g.include_usage:
            return [DONE_EVENT]
        return [sse({**self._empty_chunk(), "usage": g.usage_dict()}), DONE_EVENT]

    def error(self, exc: ApiError) -> list[str]:
        """Events for a failure after the stream started (the HTTP status is 200 by then)."""
        return [exc.sse_event(), DONE_EVENT]

    def _base(self) -> dict[str, Any]:
        g = self.generation
        return {"id": g.response_id, "created": g.created, "model": g.model_name}

    def _empty_chunk(self) -> dict[str, Any]:
        """`chunk_type(**self._base(), choices=[]).model_dump(mode="json")`, from a dump made once per chunk type
        (the base's fields are plain strings and ints: only their values differ between requests)."""
        template = _EMPTY_CHUNKS.get(self.chunk_type)
        if template is None:
            template = self.chunk_type(id="", created=0, model="", choices=[]).model_dump(mode="json")
            _EMPTY_CHUNKS[self.chunk_type] = template
        return {**template, **self._base(), "choices": []}

    def _frame(self) -> tuple[str, str]:
        """The text of an event around its one choice: `data: {"id":..,"choices":[{"index":` and `]..}` + blank line.

        The per-token path writes only the choice in between (a few string joins instead of building and dumping
        pydantic models per token); the bytes equal the pydantic path's, as tests/unit/test_gateway_sse.py checks.
        """
        empty = self._empty_chunk()
        empty.pop("usage", None)
        text = json.dumps(empty, ensure_ascii=False, separators=(",", ":"))
        assert text.endswith('"choices":[]}')
        usage = ',"usage":null' if self.generation.include_usage else ""
        return f"data: {text[:-2]}{{\"index\":", f"]{usage}}}\n\n"

    def _text_event(self, delta: ChoiceDelta, before: str, after: str) -> str:
        """The event of a delta without logprobs; its text (a JSON string) goes between `before` and `after`."""
        finish = "null" if delta.finish_reason is None else f'"{delta.finish_reason}"'
        text = json.dumps(delta.text, ensure_ascii=False)
        return f'{self.head}{delta.index},{before}{text}{after},"logprobs":null,"finish_reason":{finish}}}{self.tail}'


def check_message_counts(data: dict[str, Any]) -> None:
    """400 for more than MAX_MESSAGES messages or MAX_CONTENT_PARTS content parts (blocks), counted on the raw
    JSON before pydantic builds a model per item (pydantic checks a list's max_length only after its items)."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"Invalid 'messages': array too long. Expected an array with maximum length "
                          f"{MAX_MESSAGES}, but got an array with length {len(messages)} instead.", param="messages")
    num_parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if num_parts > MAX_CONTENT_PARTS:
        raise bad_request(f"Invalid 'messages': {num_parts} content parts; at most {MAX_CONTENT_PARTS} are accepted "
                          "over all messages", param="messages")


class Presenter(ABC):
    """One API shape: request parsing, prompt building, response and stream formatting."""

    #: Metrics label of the route.
    route: str
    #: Prefix of response ids (OpenAI: chatcmpl-, cmpl-; Anthropic: msg_).
    id_prefix: str
    body_type: type[SamplingFields]
    #: The non-streamed response object.
    response_type: type[BaseModel]

    def parse(self, data: dict[str, Any]) -> Any:
        """The validated body; 400 naming the first bad field, or a field this server does not support (an
        OpenAI field it cannot honour, a vLLM extension it does not implement); other unknown fields are logged."""
        body_type = self.body_type
        for name in getattr(body_type, "UNSUPPORTED", ()):
            if data.get(name) is not None:
                raise bad_request(f"{name} is not supported by this server", param=name)
        check_message_counts(data)
        vllm_unsupported = getattr(body_type, "VLLM_UNSUPPORTED", {})
        for name, no_op in vllm_unsupported.items():
            value = data.get(name)
            if value is not None and value != no_op and value != [] and value != {}:
                raise bad_request(f"{name} (a vLLM extension) is not supported by this server", param=name)
        try:
            body = body_type.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        if vllm_unsupported:
            unknown = data.keys() - _known_fields(body_type)
            if unknown:
                logger.warning("%s: fields ignored (unknown to this server): %s", self.route, sorted(unknown))
        return body

    def error_response(self, exc: ApiError) -> Response:
        """An error in this API's shape (OpenAI's error object)."""
        return exc.response()

    def check(self, model: ModelInfo, body: Any, settings: GatewaySettings) -> None:
        """400 for what this server refuses of a valid body: prompt_logprobs with stream (vLLM's rule: they come
        with the whole response)."""
        if getattr(body, "prompt_logprobs", None) is not None and body.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    @abstractmethod
    def prompts(self, model: ModelInfo, body: Any) -> list[Prompt]:
        """The prompt's token ids (chat template, tokenizer), one per prompt of a batch; CPU work, run off the
        event loop."""

    @abstractmethod
    def max_tokens(self, body: Any) -> int | None:
        """The body's output budget (None = the rest of the context)."""

    @abstractmethod
    def logprobs(self, body: Any) -> int | None:
        """None = no logprobs; k = the sampled token's and the top k alternatives."""

    def prompt_logprobs(self, body: Any) -> int | None:
        """The alternatives per prompt position the workers must score the prompt with (None: no scores)."""
        return getattr(body, "prompt_logprobs", None)

    def scores_only(self, body: Any) -> bool:
        """True when the response is the scored prompt alone (nothing generated is shown)."""
        return False

    def output_rules(self, model: ModelInfo, body: Any) -> OutputRules | None:
        """The grammar and tool parsing the body asks for (None: free text); CPU work, run off the event loop."""
        return None

    def response(self, generation: Generation) -> dict[str, Any]:
        """The non-streamed response body of a finished generation: one choice per output, and usage."""
        g = generation
        body = self.response_type(
            id=g.response_id, created=g.created, model=g.model_name,
            choices=[self.choice(g, output) for output in g.outputs], usage=g.usage(),
        )
        return body.model_dump(mode="json")

    @abstractmethod
    def choice(self, generation: Generation, output: ChoiceOutput) -> BaseModel:
        """One finished choice of the non-streamed response."""

    @abstractmethod
    def stream(self, generation: Generation) -> StreamFormatter:
        """A formatter for one streamed response."""


# ------------------------------------------------------------------------------------------------ chat


class ChatPresenter(Presenter):
    """OpenAI chat completions: `chat.completion` bodies and `chat.completion.chunk` events."""

    route = "chat"
    id_prefix = "chatcmpl-"
    body_type = ChatCompletionRequest
    response_type = ChatCompletionResponse

    def check(self, model: ModelInfo, body: ChatCompletionRequest, settings: GatewaySettings) -> None:
        """As every presenter; and a template sent in the request runs only where the operator trusts request
        templates."""
        super().check(model, body, settings)
        check_request_template(model, body, settings.trust_request_chat_template)

    def prompts(self, model: ModelInfo, body: ChatCompletionRequest) -> list[Prompt]:
        """The conversation through the model's chat template."""
        return [Prompt(chat_prompt_token_ids(model, body))]

    def max_tokens(self, body: ChatCompletionRequest) -> int | None:
        """max_completion_tokens, else the legacy max_tokens."""
        return body.max_completion_tokens or body.max_tokens

    def logprobs(self, body: ChatCompletionRequest) -> int | None:
        """top_logprobs alternatives when logprobs is on."""
        return (body.top_logprobs or 0) if body.logprobs else None

    def output_rules(self, model: ModelInfo, body: ChatCompletionRequest) -> OutputRules | None:
        """response_format and tools / tool_choice."""
        return output_rules(model, body)

    def response(self, generation: Generation) -> dict[str, Any]:
        """The chat.completion body; vLLM's prompt_logprobs beside the choices when asked (the prompt is theirs)."""
        g = generation
        prompt_logprobs = None
        if g.prompt_logprobs and g.outputs[0].prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(g.tokenizer, g.prompts[0].token_ids, g.outputs[0].prompt_logprobs)
        body = ChatCompletionResponse(
            id=g.response_id, created=g.created, model=g.model_name,
            choices=[self.choice(g, output) for output in g.outputs], usage=g.usage(), prompt_logprobs=prompt_logprobs,
        )
        return body.model_dump(mode="json")

    def choice(self, generation: Generation, output: ChoiceOutput) -> ChatChoice:
        """The assistant message of one choice (its tool calls parsed out when the request has tools)."""
        message, finish_reason = AssistantMessage(content=output.text), output.finish_reason
        fmt = generation.rules.tools if generation.rules is not None else None
        if fmt is not None:
            content, calls = fmt.parse(output.text)
            if calls:
                message = AssistantMessage(content=content, tool_calls=calls)
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return ChatChoice(
            index=output.index,
            message=message,
            logprobs=chat_logprobs(generation.tokenizer, output.logprobs) if generation.logprobs else None,
            finish_reason=finish_reason,
        )

    def stream(self, generation: Generation) -> StreamFormatter:
        """chat.completion.chunk events."""
        if generation.rules is not None and generation.rules.tools is not None:
            return _ToolChatStream(generation)
        return _ChatStream(generation)


class _ChatStream(StreamFormatter):
    chunk_type = ChatCompletionChunk

    def opening(self) -> list[str]:
        """The assistant role and empty content per choice (the bytes `_chunk` gives, without its models)."""
        return [f'{self.head}{o.index},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                f'"finish_reason":null}}{self.tail}' for o in self.generation.outputs]

    def delta(self, delta: ChoiceDelta) -> list[str]:
        if not (delta.text or delta.finish_reason is not None or delta.logprobs):
            return []
        g = self.generation
        if not g.logprobs:  # the per-token path: no models built
            return [self._text_event(delta, '"delta":{"content":', "}")]
        logprobs = chat_logprobs(g.tokenizer, delta.logprobs)
        return [
            self._chunk(delta.index, DeltaMessage(content=delta.text), logprobs=logprobs,
                        finish_reason=delta.finish_reason)
        ]

    def _chunk(self, index: int, delta: DeltaMessage, **choice: Any) -> str:
        """A chunk with one choice (`delta` without its unset keys, as OpenAI sends)."""
        chunk = ChatCompletionChunk(**self._base(), choices=[ChatChunkChoice(index=index, delta=delta, **choice)])
        data = _without_usage(chunk, self.generation.include_usage)
        data["choices"][0]["delta"] = delta.model_dump(mode="json", exclude_none=True)
        return sse(data)


class _ToolChatStream(_ChatStream):
    """Chat chunks of a request with tools: content streams until a call may begin; the calls go out at the end
    as tool_calls deltas (id, name, arguments), with finish_reason tool_calls."""

    def __init__(self, generation: Generation) -> None:
        super().__init__(generation)
        fmt = generation.rules.tools if generation.rules is not None else None
        assert fmt is not None
        self.buffers = [ToolCallBuffer(fmt) for _ in generation.outputs]

    def delta(self, delta: ChoiceDelta) -> list[str]:
        buffer = self.buffers[delta.index]
        text = buffer.feed(delta.text)
        logprobs = chat_logprobs(self.generation.tokenizer, delta.logprobs) if self.generation.logprobs else None
        if delta.finish_reason is None:
            if not text and not logprobs:
                return []
            return [self._chunk(delta.index, DeltaMessage(content=text), logprobs=logprobs)]
        rest, calls = buffer.finish()
        events = []
        if text + rest or logprobs:
            events.append(self._chunk(delta.index, DeltaMessage(content=text + rest), logprobs=logprobs))
        for i, call in enumerate(calls):
            function = {"name": call.function.name, "arguments": call.function.arguments}
            tool_delta = ToolCallDelta(index=i, id=call.id, type="function", function=function)
            events.append(self._chunk(delta.index, DeltaMessage(tool_calls=[tool_delta])))
        finish = "tool_calls" if calls and delta.finish_reason == "stop" else delta.finish_reason
        events.append(self._chunk(delta.index, DeltaMessage(), finish_reason=finish))
        return events


# ------------------------------------------------------------------------------------------------ completions


class CompletionsPresenter(Presenter):
    """OpenAI (legacy) completions: `text_completion` bodies and events."""

    route = "completions"
    id_prefix = "cmpl-"
    body_type = CompletionRequest
    response_type = CompletionResponse

    def check(self, model: ModelInfo, body: CompletionRequest, settings: GatewaySettings) -> None:
        """As every presenter; and max_tokens 0 only with echo (the prompt scored alone)."""
        super().check(model, body, settings)
        if body.max_tokens == 0 and not body.echo:
            raise bad_request("max_tokens 0 needs echo (it returns the prompt alone, scored with logprobs)",
                              param="max_tokens")

    def prompts(self, model: ModelInfo, body: CompletionRequest) -> list[Prompt]:
        """Each prompt of the batch: a string or token ids."""
        return completion_prompts(model, body)

    def max_tokens(self, body: CompletionRequest) -> int | None:
        """max_tokens (OpenAI's default 16); 0 (echo: the prompt alone) runs as 1, its token dropped (as vLLM)."""
        return 1 if body.max_tokens == 0 else body.max_tokens

    def logprobs(self, body: CompletionRequest) -> int | None:
        """The legacy integer logprobs."""
        return body.logprobs

    def prompt_logprobs(self, body: CompletionRequest) -> int | None:
        """vLLM's prompt_logprobs, and echo with logprobs: the echoed prompt's (the larger k serves both)."""
        echoed = body.logprobs if body.echo else None
        if echoed is None or body.prompt_logprobs is None:
            return body.prompt_logprobs if echoed is None else echoed
        return max(echoed, body.prompt_logprobs)

    def scores_only(self, body: CompletionRequest) -> bool:
        """echo with max_tokens 0."""
        return body.echo and body.max_tokens == 0

    def output_rules(self, model: ModelInfo, body: CompletionRequest) -> OutputRules | None:
        """response_format (vLLM's extension)."""
        return output_rules(model, body)

    def choice(self, generation: Generation, output: ChoiceOutput) -> CompletionChoice:
        """The text of one choice (after its prompt with echo), its logprobs, and vLLM's prompt_logprobs if asked."""
        g = generation
        prompt, text, entries = g.prompt_of(output), output.text, sampled_entries(output.logprobs)
        if g.echo:
            text = prompt.echo_text(g.tokenizer) + text
            if g.logprobs:
                entries = itertools.chain(_echoed_entries(output), entries)
        prompt_logprobs = None
        if g.prompt_logprobs and output.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(g.tokenizer, prompt.token_ids, output.prompt_logprobs)
        return CompletionChoice(
            index=output.index,
            text=text,
            logprobs=completion_logprobs(g.tokenizer, entries, 0, g.num_top_logprobs)[0] if g.logprobs else None,
            finish_reason=output.finish_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def stream(self, generation: Generation) -> StreamFormatter:
        """text_completion events (the same object type as the body, as OpenAI sends)."""
        return _CompletionsStream(generation)


class _CompletionsStream(StreamFormatter):
    chunk_type = CompletionResponse

    def __init__(self, generation: Generation) -> None:
        super().__init__(generation)
        self.text_offsets = [0] * len(generation.outputs)
        #: echo: whether each choice's prompt went out (with its first event).
        self.echoed = [not generation.echo] * len(generation.outputs)

    def delta(self, delta: ChoiceDelta) -> list[str]:
        echo = not self.echoed[delta.index]
        if not (echo or delta.text or delta.finish_reason is not None or delta.logprobs):
            return []
        g = self.generation
        if not (g.logprobs or echo):  # the per-token path: no models built
            return [self._text_event(delta, '"text":', "")]
        text, entries = delta.text, sampled_entries(delta.logprobs)
        if echo:  # the choice's first event: its prompt, then what it generated so far
            self.echoed[delta.index] = True
            output = g.outputs[delta.index]
            text = g.prompt_of(output).echo_text(g.tokenizer) + text
            if g.logprobs:
                entries = itertools.chain(_echoed_entries(output), entries)
        logprobs = None
        if g.logprobs:
            logprobs, self.text_offsets[delta.index] = completion_logprobs(
                g.tokenizer, entries, self.text_offsets[delta.index], g.num_top_logprobs
            )
        choice = CompletionChoice(index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason)
        return [sse(_without_usage(CompletionResponse(**self._base(), choices=[choice]), g.include_usage))]


def _echoed_entries(output: ChoiceOutput) -> Iterator[LogprobEntry]:
    """The logprob entries of an echoed prompt (echo with logprobs always asks the workers for its scores)."""
    assert output.prompt_logprobs is not None, "echo with logprobs: the prompt's scores came with the first chunk"
    return prompt_entries(output.prompt_token_ids, output.prompt_logprobs)


@functools.cache
def _known_fields(body_type: type[BaseModel]) -> frozenset[str]:
    """Every field name a body type reads, refuses or ignores knowingly (aliases included)."""
    names = {name for name, info in body_type.model_fields.items() for name in (name, info.alias) if name}
    names |= set(getattr(body_type, "UNSUPPORTED", ())) | set(getattr(body_type, "VLLM_UNSUPPORTED", {}))
    return frozenset(names | getattr(body_type, "IGNORED", frozenset()))


def _without_usage(chunk: BaseModel, include_usage: bool) -> dict[str, Any]:
    data = chunk.model_dump(mode="json")
    if not include_usage:
        data.pop("usage", None)
    return data


CHAT = ChatPresenter()
COMPLETIONS = CompletionsPresenter()
