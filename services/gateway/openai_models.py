"""Request and response bodies of the OpenAI API (plus vLLM's sampling extras), as pydantic models.

Requests are validated here, before anything reaches a worker: a bad field is a 400 naming it in `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

#: Most choices one request may ask for (each runs as its own request on the workers).
MAX_N = 16
#: Most alternatives per position (OpenAI's limit for chat).
MAX_TOP_LOGPROBS = 20
#: Most tools one request may offer.
MAX_TOOLS = 128
#: Most messages of one conversation (OpenAI's limit), and most content parts over all of them: each is a model
#: pydantic builds (~6 µs, with the event loop held), so 250k one-part messages in a 15 MB body held it ~7 s.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048
#: Most stop strings, and the longest one (every generated token is checked against them).
MAX_STOP = 64
MAX_STOP_CHARS = 1024
#: Most entries of logit_bias and of stop_token_ids.
MAX_TOKEN_ID_ENTRIES = 1024
#: Longest cache_salt (it is hashed into every block's identity; 1 KiB is ample for any tenant scheme).
MAX_CACHE_SALT_CHARS = 1024
#: Most prompts one completions request may batch (each runs as its own request on the workers, n each).
MAX_PROMPTS = 256
#: The lowest logprob written (-inf has no JSON form; OpenAI and vLLM write this floor too).
MIN_LOGPROB = -9999.0
_MAX_TOKEN_ID_DIGITS = 20

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI's API does for forward compatibility; types are strict, as OpenAI's
    # are ("stream": "yes" and "max_tokens": true are 400s, not coerced).
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    """One `{"type": "text", "text": ...}` part of a message's content (a text model reads no other part)."""

    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, part_type: str) -> str:
        if part_type != "text":
            raise ValueError(f"content parts of type {part_type[:40]!r} are not supported: this model reads text")
        return part_type


class ChatMessage(BaseModel):
    """A chat message; extra keys (tool_calls, tool_call_id, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "\n".join(part.text or "" for part in self.content)
        return data


class StreamOptions(_Body):
    """`stream_options`: only include_usage is honoured."""

    include_usage: bool = False


class JsonSchemaSpec(_Body):
    """`response_format.json_schema`: a named schema; strict asks that the output follow it exactly."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`response_format`: text (free), json_object (any JSON object) or json_schema (enforced while decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check_schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionDefinition(_Body):
    """A tool's function: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """One entry of `tools` (only function tools exist)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    """`tool_choice.function`."""

    name: str


class NamedToolChoice(_Body):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


#: vLLM's request extensions this server does not implement, with the value that asks for nothing (vLLM's
#: default): any other value is a 400 naming the field, never a silent drop (`Presenter.parse`).
VLLM_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "truncate_prompt_tokens": None, "return_tokens_as_token_ids": False, "return_token_ids": False,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structural_tag": None,
    "structured_outputs": None, "logits_processors": None, "priority": 0, "kv_transfer_params": None,
    "vllm_xargs": None, "spaces_between_special_tokens": True, "prompt_embeds": None, "documents": None,
    "mm_processor_kwargs": None, "media_io_kwargs": None, "return_logprobs": None,
}


class SamplingFields(_Body):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extras).

    Refused with a 400 naming the field: `UNSUPPORTED` (OpenAI's fields this server cannot honour) and
    `VLLM_UNSUPPORTED` unless at their no-op value; accepted without effect, unlogged: `IGNORED` (OpenAI's
    bookkeeping fields); any other unknown field is ignored with a warning in the log (as vLLM does)."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()
    VLLM_UNSUPPORTED: ClassVar[dict[str, Any]] = VLLM_UNSUPPORTED
    IGNORED: ClassVar[frozenset[str]] = frozenset({"request_id"})  # vLLM's id for its logs: ours are our own

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_ID_ENTRIES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_ID_ENTRIES)
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    #: vLLM's extension: each prompt token's logprob, rank and the top k at its position (not streamed).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (logit_bias or {}).items():
            # a token id is a short run of digits (a 5,000-digit key is not parsed as an int at all)
            if not (key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return logit_bias

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list (a single string becomes one entry)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    #: OpenAI fields this server cannot honour: a 400 naming the field, never a silent drop.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "audio", "prediction", "web_search_options", "functions", "function_call",
    )
    #: vLLM's chat `echo` (the last message repeated) and the template's special tokens are not served either.
    VLLM_UNSUPPORTED: ClassVar[dict[str, Any]] = {**VLLM_UNSUPPORTED, "echo": False, "add_special_tokens": False}
    #: OpenAI's fields that change nothing for this server.
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "request_id", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "reasoning_effort", "verbosity",
    })

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: A template of the request's own (vLLM's field): refused unless trust_request_chat_template is set.
    chat_template: str | None = None
    #: Output modalities: text only ("audio" is a 400).
    modalities: list[Literal["text"]] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template sees them."""
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt (a string or token ids) or a batch of them."""

    #: vLLM's completions tokenize prompts with special tokens, as here; asking otherwise is not served.
    VLLM_UNSUPPORTED: ClassVar[dict[str, Any]] = {**VLLM_UNSUPPORTED, "add_special_tokens": True}

    #: A string, token ids, or a batch of either (choice i * n + j is prompt i's j-th).
    prompt: str | list[int] | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)
    ]
    #: 0 with echo: the prompt alone, scored (its logprobs with `logprobs`); nothing is generated.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: The prompt comes back before the completion, in the text and (with logprobs) the logprobs.
    echo: bool = False
    suffix: str | None = None
    #: vLLM's extension: structured output on completions too.
    response_format: ResponseFormat | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def prompt_list(self) -> list[str] | list[list[int]]:
        """The prompts of the batch (one prompt is a batch of one)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: how many prompt tokens came from the KV cache."""

    cached_tokens: int = 0
    #: Ours (the SDKs ignore it): where cached_tokens came from, e.g. {"device": 16, "store": 512}.
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)


class Usage(BaseModel):
    """Token counts of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    """One alternative at a position (chat shape)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at a position and its alternatives (chat shape)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """`choices[i].logprobs` of a chat response or chunk."""

    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    """`choices[i].logprobs` of a completions response or chunk (the legacy parallel lists). With echo the prompt's
    tokens come first, and its first token has no logprob (null, as its top_logprobs); each top_logprobs entry
    holds the position's token and the `logprobs` most likely ones (up to logprobs + 1 entries, as OpenAI)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """One token of vLLM's prompt_logprobs: its logprob, rank (1 = most likely) and text."""

    logprob: float
    rank: int | None
    decoded_token: str


#: vLLM's prompt_logprobs: null for the first prompt token, then per token {token id: its entry, and the top k'}.
PromptLogprobList = list[dict[int, PromptTokenLogprob] | None]


def _without_absent(data: dict[str, Any], *names: str) -> dict[str, Any]:
    """`data` without the fields of vLLM's extensions the request did not ask for (absent, not null)."""
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data


class FunctionCall(BaseModel):
    """A called function: its name and its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The message of a non-streamed chat choice (content None when it only calls tools)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)  # absent, as OpenAI answers a message that calls nothing
        return data


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    #: vLLM's extension, when asked: the (templated) prompt's, once for every choice.
    prompt_logprobs: PromptLogprobList | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extensions(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "prompt_logprobs")


class ToolCallDelta(BaseModel):
    """One tool call in a streamed delta: id, type and name on its first delta, arguments as they come."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class DeltaMessage(BaseModel):
    """`delta` of a streamed chat chunk: role on the first chunk, content after."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    """One choice of a completion (streamed or not)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's extension, when asked: the choice's prompt's.
    prompt_logprobs: PromptLogprobList | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extensions(self, handler: Any) -> dict[str, Any]:
        return _without_absent(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    """A completion, or one SSE event of a streamed one (same object type, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int | None = None
    #: Sampling fields a request that leaves them out gets (the model's recommended; {} = OpenAI's defaults).
    default_sampling_params: dict[str, float] = Field(default_factory=dict)


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
