"""vLLM's tokenizer endpoints over the served model's tokenizer: `POST /tokenize`, `POST /detokenize`.

Same validation as the completion routes (strict types, the model name, request chat templates refused unless
trusted); CPU work runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ValidationError

from deepinfer.config import GatewaySettings
from services.gateway.errors import bad_request, from_validation_error
from services.gateway.presenters import check_message_counts
from services.gateway.recipe import (
    ModelInfo,
    chat_text,
    check_model,
    check_prompt_chars,
    check_request_template,
)
from services.gateway.vllm_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


def _parse(body_type: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return body_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _check_model(model: ModelInfo, name: str | None) -> None:
    if name is not None:
        check_model(model, name)


async def tokenize(model: ModelInfo, settings: GatewaySettings, data: dict[str, Any]) -> dict[str, Any]:
    """A prompt (or a conversation, through the chat template) as token ids, as vLLM answers /tokenize."""
    if "messages" in data:
        check_message_counts(data)
        body: TokenizeChatRequest | TokenizeCompletionRequest = _parse(TokenizeChatRequest, data)
    else:
        body = _parse(TokenizeCompletionRequest, data)
    _check_model(model, body.model)
    if isinstance(body, TokenizeChatRequest):
        check_request_template(model, body, settings.trust_request_chat_template)
    return await asyncio.to_thread(_tokenize, model, body)


def _tokenize(model: ModelInfo, body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict[str, Any]:
    text = chat_text(model, body) if isinstance(body, TokenizeChatRequest) else body.prompt
    check_prompt_chars(model, len(text), "messages" if isinstance(body, TokenizeChatRequest) else "prompt")
    tokens = model.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = [model.tokenizer.backend.id_to_token(t) for t in tokens]
    return TokenizeResponse(
        count=len(tokens), max_model_len=model.max_model_len, tokens=tokens, token_strs=token_strs
    ).model_dump(mode="json")


async def detokenize(model: ModelInfo, data: dict[str, Any]) -> dict[str, Any]:
    """The text of token ids (special tokens kept, as vLLM's /detokenize); ids outside the vocabulary are a 400."""
    body: DetokenizeRequest = _parse(DetokenizeRequest, data)
    _check_model(model, body.model)
    vocab_size = model.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    text = await asyncio.to_thread(model.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text).model_dump(mode="json")
