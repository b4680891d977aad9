"""Request and response bodies of vLLM's tokenizer endpoints (`POST /tokenize`, `POST /detokenize`), same shapes.

    {"prompt": "Hello"}  or  {"messages": [...], "add_generation_prompt": true}   →  {"count", "max_model_len",
                                                                                      "tokens", "token_strs"}
    {"tokens": [9906, 0]}                                                         →  {"prompt": "Hello!"}
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.openai_models import MAX_TOOLS, ChatMessage, ToolDefinition

#: Most token ids one /detokenize may send (decoding is CPU work on the gateway).
MAX_DETOKENIZE_TOKENS = 262_144


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TokenizeCompletionRequest(_Body):
    """POST /tokenize of a plain prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """POST /tokenize of a conversation, rendered by the model's chat template first."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    #: A template of the request's own: refused unless trust_request_chat_template is set.
    chat_template: str | None = None
    #: Tools are rendered as a chat completion with tool_choice "auto" renders them.
    tool_choice: ClassVar[None] = None

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template sees them."""
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]


class TokenizeResponse(BaseModel):
    """The prompt's token ids, their count and the model's context length."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str
