"""Request and response bodies of Anthropic's Messages API (`POST /v1/messages`), as pydantic models.

The request model answers the same questions as an OpenAI body (`SamplingFields`) where the recipe asks them
(stop strings, n, usage, cache salt), so the one request pipeline serves it; Anthropic has no such knobs, so they
are constants here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.openai_models import MAX_STOP, ChatMessage, StopString


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Body):
    """`{"type": "text", "text": ...}`: the only content block a text model reads (tool blocks: not yet)."""

    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, block_type: str) -> str:
        if block_type != "text":
            raise ValueError(f"content blocks of type {block_type[:40]!r} are not supported here; only 'text'")
        return block_type


class MessageParam(_Body):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @property
    def text(self) -> str:
        """The turn's text (blocks joined)."""
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class Metadata(_Body):
    """`metadata`: accepted and ignored."""

    user_id: str | None = None


class MessagesRequest(_Body):
    """POST /v1/messages."""

    #: Fields this server cannot honour yet: a 400 naming the field (tool use arrives with the tool-call parser).
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "tools", "tool_choice", "thinking", "output_config", "mcp_servers", "container",
    )

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

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat-template messages: the system prompt first."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(block.text for block in self.system)
            messages.append(ChatMessage(role="system", content=system))
        messages += [ChatMessage(role=m.role, content=m.text) for m in self.messages]
        return messages


class ResponseTextBlock(BaseModel):
    """A text block of the answer."""

    type: Literal["text"] = "text"
    text: str


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
    content: list[ResponseTextBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None
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
