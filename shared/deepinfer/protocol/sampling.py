"""Sampling parameters on the wire; the engine's plain class (`deepinfer.SamplingParams`) uses the same field names."""

from __future__ import annotations

from pydantic import Field

from deepinfer.protocol.base import Message


class WireSamplingParams(Message):
    """How to pick each output token, as the client asked (OpenAI/vLLM meanings); the engine's is `SamplingParams`."""

    kind = "sampling_params"

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    #: 0 or -1 = off.
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    #: token id -> additive bias; msgpack keeps the int keys (decoded with strict_map_key=False).
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    #: None = up to the model's context length.
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    #: None = off; 0 = only the sampled token's logprob; k = also the top k alternatives.
    logprobs: int | None = Field(None, ge=0)
    #: vLLM's prompt_logprobs: None = off; k = each prompt token's logprob and rank, and the top k alternatives
    #: at its position (2.7).
    prompt_logprobs: int | None = Field(None, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: llguidance grammar text (deepinfer.structured) every output token must follow; None = free text. (2.3)
    grammar: str | None = Field(None, min_length=1)
