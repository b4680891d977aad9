"""Request and response bodies of Anthropic's Messages API (`POST /v1/messages`), as pydantic models.

The request model answers the same questions as an OpenAI body (`SamplingFields`) where the recipe asks them
(stop strings, n, usage, cache salt), so the one request pipeline serves it; Anthropic has no such knobs, so they
are constants here. Tool use maps onto the chat route's machinery: `chat_request()` is the conversation as an
OpenAI chat body (tools as functions, `tool_use` blocks as `tool_calls`, `tool_result` blocks as tool messages).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.openai_models import MAX_STOP, MAX_TOOLS, ChatCompletionRequest, ChatMessage, StopString

#: A tool's name, as Anthropic's API (and OpenAI's) allows it.
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Body):
    """`{"type": "text", "text": ...}`: the text a text model reads (images and documents it cannot)."""

    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, block_type: str) -> str:
        if block_type != "text":
            raise ValueError(f"content blocks of type {block_type[:40]!r} are not supported here; only 'text'")
        return block_type


class ToolUseBlock(_Body):
    """An earlier call of the assistant's: `{"type": "tool_use", "id", "name", "input": {...}}`."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: ToolName
    input: dict[str, Any]


class ToolResultBlock(_Body):
    """What a call returned, in a user turn: its text (a string or text blocks), `is_error` when it failed."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        """The result's text; a failed call's marked as an error, so the model reads it as one."""
        text = self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class _TextInput(TextBlock):
    type: Literal["text"]  # type: ignore[assignment]


#: One block of a turn's content, told apart by `type` (any other type is a 400 naming it).
ContentBlock = Annotated[_TextInput | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(_Body):
    """One turn of the conversation: text, and tool_use blocks (assistant) or tool_result blocks (user)."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        misplaced = "tool_result" if self.role == "assistant" else "tool_use"
        if any(block.type == misplaced for block in self.blocks):
            raise ValueError(f"{misplaced} blocks belong in {'user' if self.role == 'assistant' else 'assistant'} "
                             "turns")
        return self

    @property
    def blocks(self) -> list[_TextInput | ToolUseBlock | ToolResultBlock]:
        """The content as blocks (a string is one text block)."""
        return [_TextInput(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    @property
    def text(self) -> str:
        """The turn's text (its text blocks joined)."""
        return "".join(block.text for block in self.blocks if isinstance(block, _TextInput))

    def chat_messages(self) -> list[dict[str, Any]]:
        """The turn as the chat route's messages: an assistant message with its `tool_calls`; a user turn's tool
        results as `tool` messages (before any text the turn adds)."""
        if self.role == "assistant":
            calls = [
                {"id": b.id, "type": "function",
                 "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in self.blocks if isinstance(b, ToolUseBlock)
            ]
            if not calls:
                return [{"role": "assistant", "content": self.text}]
            return [{"role": "assistant", "content": self.text or None, "tool_calls": calls}]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
            for b in self.blocks if isinstance(b, ToolResultBlock)
        ]
        text = self.text
        return results + [{"role": "user", "content": text}] if text or not results else results


class ToolParam(_Body):
    """A client tool: its name, what it does, and the JSON schema of its `input`. Server tools (web search, code
    execution, ...: a `type` other than "custom") are a 400."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]

    def function(self) -> dict[str, Any]:
        """The tool as the chat route's function tool."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Body):
    """`tool_choice`: auto (the model decides), any (some tool must be called), tool (this one), none (no tools);
    `disable_parallel_tool_use` keeps it to one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only it takes one")
        return self

    def openai(self) -> str | dict[str, Any]:
        """The chat route's tool_choice."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Metadata(_Body):
    """`metadata`: accepted and ignored."""

    user_id: str | None = None


class MessagesRequest(_Body):
    """POST /v1/messages."""

    #: Fields this server cannot honour: a 400 naming the field, never a silent drop.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("thinking", "output_config", "mcp_servers", "container")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    # What the recipe asks of an OpenAI body, fixed for Anthropic's API.
    n: ClassVar[int] = 1
    include_usage: ClassVar[bool] = True
    cache_salt: ClassVar[str | None] = None
    min_p: ClassVar[float | None] = None
    presence_penalty: ClassVar[float | None] = None
    frequency_penalty: ClassVar[float | None] = None
    repetition_penalty: ClassVar[float | None] = None
    logit_bias: ClassVar[dict[str, float] | None] = None
    seed: ClassVar[int | None] = None
    min_tokens: ClassVar[int] = 0
    stop_token_ids: ClassVar[list[int] | None] = None
    ignore_eos: ClassVar[bool] = False
    skip_special_tokens: ClassVar[bool] = True
    include_stop_str_in_output: ClassVar[bool] = False

    @property
    def stop_list(self) -> list[str]:
        """`stop_sequences` as the stop strings."""
        return list(self.stop_sequences or [])

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat route's messages: the system prompt first."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(block.text for block in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += message.chat_messages()
        return messages

    @cached_property
    def chat_request(self) -> ChatCompletionRequest:
        """The request as the chat route reads it (messages, tools, tool_choice): the same template rendering,
        call grammar and tool-call parsing. A last assistant turn is continued (prefill)."""
        continues = self.messages[-1].role == "assistant"
        choice = self.tool_choice
        return ChatCompletionRequest(
            model=self.model,
            messages=[ChatMessage.model_validate(m) for m in self.chat_messages()],
            tools=None if self.tools is None else [tool.function() for tool in self.tools],
            tool_choice=None if choice is None else choice.openai(),
            parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
            add_generation_prompt=not continues,
            continue_final_message=continues,
        )


class ResponseTextBlock(BaseModel):
    """A text block of the answer."""

    type: Literal["text"] = "text"
    text: str


class ResponseToolUseBlock(BaseModel):
    """A call the model made: `id` ("toolu_..."), the tool's `name`, its `input` object."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    """Token counts: `input_tokens` excludes those read from the cache (Anthropic counts them apart)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    """A non-streamed message."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseTextBlock | ResponseToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorObject(BaseModel):
    """Anthropic's error object."""

    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error on the Messages API: `{"type": "error", "error": {...}}`."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject


def to_dict(model: BaseModel) -> dict[str, Any]:
    """A response model as JSON data."""
    return model.model_dump(mode="json")
