"""The recipe of a request: model check, chat template, prompt token ids and WireSamplingParams.

Everything here is CPU work on the gateway (no worker is involved yet); every failure is a 400 naming the
field, so a bad request never reaches a worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deepinfer.model_store import recommended_sampling
from deepinfer.protocol import ErrorCode, WireSamplingParams
from deepinfer.sampling.params import SamplingParamError, check_vocab, generation_sampling
from deepinfer.sampling.params import SamplingParams as EngineSamplingParams
from deepinfer.sampling.seeds import derive_seed, draw_seed
from deepinfer.structured import Grammars
from deepinfer.tokenizer import ChatTemplateError, Tokenizer
from services.gateway.errors import (
    ApiError,
    bad_request,
    context_length,
    from_validation_error,
    model_not_found,
)
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from services.gateway.prompt_encoder import SegmentEncoder
from services.gateway.tool_calls import template_messages
from services.gateway.vllm_models import TokenizeChatRequest

# config.json keys that give a model's context length, most specific first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the model it serves: its name, tokenizer and context length (no weights)."""

    served_model_name: str
    tokenizer: Tokenizer
    max_model_len: int | None
    created: int
    #: The model's vocabulary size (config.json, as the workers read it; else the tokenizer's).
    vocab_size: int
    #: Longest prompt text tokenized (characters); None = no bound (no context length known).
    max_prompt_chars: int | None = None
    #: Sampling fields applied when a request leaves them out (SamplingParams' names): the model's recommended.
    default_sampling: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dir(
        cls, model_dir: Path, served_model_name: str, max_model_len: int | None = None,
        max_prompt_chars: int | None = None, default_sampling: dict[str, float] | None = None,
    ) -> ModelInfo:
        """Load the tokenizer and context length from a Hugging Face model directory; `max_prompt_chars` unset =
        the most characters max_model_len tokens can stand for; `default_sampling` unset = none."""
        tokenizer = Tokenizer.from_dir(model_dir)
        config_path = Path(model_dir) / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        if max_model_len is None:
            max_model_len = next((int(config[k]) for k in _CONTEXT_KEYS if isinstance(config.get(k), int)), None)
        vocab_size = config.get("vocab_size")
        if not isinstance(vocab_size, int):
            vocab_size = tokenizer.vocab_size
        if max_prompt_chars is None and max_model_len is not None:
            max_prompt_chars = max_model_len * tokenizer.max_token_chars
        return cls(served_model_name, tokenizer, max_model_len, int(time.time()), vocab_size, max_prompt_chars,
                   dict(default_sampling or {}))

    @cached_property
    def chat_encoder(self) -> SegmentEncoder | None:
        """Encodes rendered chats with the pieces between added tokens cached (None: the tokenizer's own encode)."""
        return SegmentEncoder.for_tokenizer(self.tokenizer)

    def encode_chat_text(self, text: str) -> list[int]:
        """Token ids of a rendered chat (like transformers, the template alone places BOS: no special tokens)."""
        encoder = self.chat_encoder
        if encoder is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return encoder.encode(text)

    @cached_property
    def grammars(self) -> Grammars:
        """Structured output: grammars compiled and checked against this tokenizer."""
        return Grammars(self.tokenizer)


def model_sampling_defaults(model_dir: Path, model_name: str | None) -> dict[str, float]:
    """The sampling defaults the model recommends: its generation_config.json's (vLLM's --generation-config auto),
    else the model registry's for a known model (`model_store.recommended_sampling`), else none."""
    path = Path(model_dir) / "generation_config.json"
    generation_config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return generation_sampling(generation_config) or recommended_sampling(model_name)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, and its text as the client sent it (None: it sent token ids)."""

    token_ids: list[int]
    text: str | None = None

    def echo_text(self, tokenizer: Tokenizer) -> str:
        """The prompt as echo shows it: the client's text, or its token ids decoded (special tokens kept)."""
        return self.text if self.text is not None else tokenizer.decode(self.token_ids, skip_special_tokens=False)


@dataclass
class GenerateRequest:
    """One sequence to generate: what the workers see of a request (n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: WireSamplingParams
    cache_salt: str
    #: When the client's request_timeout_s runs out (time.monotonic()).
    deadline_s: float
    #: Whether the client went away (polled while the request waits on a worker); None = never asked.
    is_disconnected: Callable[[], Awaitable[bool]] | None = None


def check_model(model: ModelInfo, name: str) -> None:
    """404 model_not_found unless `name` is the served model."""
    if name != model.served_model_name:
        raise model_not_found(name)


#: A body with a conversation for the chat template: a chat completion or a /tokenize of messages.
ChatBody = ChatCompletionRequest | TokenizeChatRequest


def _template_kwargs(body: ChatBody) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.chat_template is not None:
        kwargs["chat_template"] = body.chat_template
    return kwargs


def check_request_template(model: ModelInfo, body: ChatBody, trusted: bool) -> None:
    """400 for a chat template sent in the request (its source is code the gateway would run) unless the operator
    trusts request templates, as vLLM's --trust-request-chat-template; naming one of the model's own is fine."""
    template = _template_kwargs(body).get("chat_template")
    if template is None or trusted:
        return
    if not isinstance(template, str) or template not in model.tokenizer.chat_templates:
        param = "chat_template" if body.chat_template is not None else "chat_template_kwargs.chat_template"
        raise bad_request(
            "chat templates in requests are refused (set DEEPINFER_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE to allow "
            f"them); this model's named templates: {sorted(model.tokenizer.chat_templates)}",
            param=param,
        )


def chat_text(model: ModelInfo, body: ChatBody) -> str:
    """The conversation rendered by the model's chat template (template errors are 400)."""
    try:
        messages, tools = template_messages(
            model.tokenizer, [message.template_dict() for message in body.messages],
            body.tool_dicts if body.tool_choice != "none" else None,
        )
        return model.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            tools=tools,
            continue_final_message=body.continue_final_message,
            **_template_kwargs(body),
        )
    except (ChatTemplateError, TypeError) as exc:  # TypeError: chat_template_kwargs clashing with our keywords
        raise bad_request(f"chat template: {exc}", param="messages") from exc


def chat_prompt_token_ids(model: ModelInfo, body: ChatBody) -> list[int]:
    """The rendered conversation's token ids (like transformers, the template alone places BOS)."""
    text = chat_text(model, body)
    check_prompt_chars(model, len(text), "messages")
    token_ids = model.encode_chat_text(text)
    _check_prompt_length(model, token_ids, "messages")
    return token_ids


def completion_prompts(model: ModelInfo, body: CompletionRequest) -> list[Prompt]:
    """The prompts of a completions request: each string tokenized, each list of token ids checked."""
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    prompts = []
    for prompt in body.prompt_list:
        if isinstance(prompt, str):
            check_prompt_chars(model, len(prompt), "prompt")
            token_ids, text = model.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
            vocab_size = model.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
        _check_prompt_length(model, token_ids, "prompt")
        prompts.append(Prompt(token_ids, text))
    return prompts


#: Wire bytes of one position of a prompt's scores, at most: its logprob (a msgpack float64) and rank (a uint32),
#: two list headers; and 14 per alternative (a token id and a float64). Plus the rest of the message.
_PROMPT_LOGPROB_BYTES, _ALTERNATIVE_BYTES, _MESSAGE_BYTES = 20, 14, 4096


def check_prompt_logprobs_fit(prompts: list[Prompt], num_top: int, max_payload: int) -> None:
    """413 naming prompt_logprobs when a prompt's scores would not fit one bus message (they come back in one, from
    the worker that computed the prompt): shorten the prompt or ask fewer alternatives."""
    per_position = _PROMPT_LOGPROB_BYTES + num_top * _ALTERNATIVE_BYTES
    longest = max(len(p.token_ids) for p in prompts)
    if longest * per_position + _MESSAGE_BYTES > max_payload:
        raise ApiError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"the prompt logprobs of a {longest}-token prompt with {num_top} alternatives per position (about "
            f"{longest * per_position} bytes) exceed what the workers can send back in one message ({max_payload} "
            "bytes): ask fewer alternatives or score a shorter prompt",
            "prompt_logprobs",
        )


def check_prompt_chars(model: ModelInfo, num_chars: int, param: str) -> None:
    """400 context_length_exceeded for a prompt text longer than `model.max_prompt_chars`, before any tokenizing
    (its time and memory grow with the text: ~1-2 µs and ~120 bytes per character on the default model)."""
    limit = model.max_prompt_chars
    if limit is None or num_chars <= limit:
        return
    raise context_length(
        f"This model's maximum context length is {model.max_model_len} tokens; the prompt has {num_chars} "
        f"characters, over this server's limit of {limit} characters (max_prompt_chars)",
        param,
    )


def _check_prompt_length(model: ModelInfo, token_ids: list[int], param: str) -> None:
    if not token_ids:
        raise bad_request("the prompt is empty", param=param)
    if model.max_model_len is not None and len(token_ids) >= model.max_model_len:
        raise context_length(
            f"This model's maximum context length is {model.max_model_len} tokens; the prompt has "
            f"{len(token_ids)} tokens",
            param,
        )


def sampling_params(
    model: ModelInfo, body: SamplingFields, num_prompt_tokens: int, max_tokens: int | None, logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> WireSamplingParams:
    """WireSamplingParams from a request body; max_tokens None = the rest of the context."""
    room = None if model.max_model_len is None else model.max_model_len - num_prompt_tokens
    if max_tokens is not None and room is not None and max_tokens > room:
        raise context_length(
            f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds the model's "
            f"maximum context length of {model.max_model_len}",
            "max_tokens",
        )
    defaults = model.default_sampling
    fields = {
        "n": 1,  # each choice is its own request on the workers
        # a field the request leaves out takes the model's recommended value (none: the workers' default)
        "temperature": body.temperature if body.temperature is not None else defaults.get("temperature"),
        "top_p": body.top_p if body.top_p is not None else defaults.get("top_p"),
        "top_k": body.top_k if body.top_k is not None else defaults.get("top_k"),
        "min_p": body.min_p if body.min_p is not None else defaults.get("min_p"),
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": (
            body.repetition_penalty if body.repetition_penalty is not None else defaults.get("repetition_penalty")
        ),
        "logit_bias": {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        "seed": body.seed,
        "max_tokens": max_tokens if max_tokens is not None else room,
        "min_tokens": body.min_tokens,
        "stop": body.stop_list,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    try:  # the workers' own validation, so a bad value is a 400 here rather than a refusal after routing
        check_vocab(EngineSamplingParams(**fields), model.vocab_size)
        return WireSamplingParams(**fields)
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def split_choices(
    request_id: str, prompt_token_ids: list[int], sampling: WireSamplingParams, cache_salt: str, n: int,
    deadline_s: float, is_disconnected: Callable[[], Awaitable[bool]] | None = None, first_index: int = 0,
    num_choices: int | None = None,
) -> list[GenerateRequest]:
    """n independent sequences, each with its own seed (choice i: derived from the request's seed, drawn here when
    the client gave none), so prefill, decode and a migrated decode of one choice draw the same tokens.

    A batch of prompts calls this once per prompt: its choices are `first_index` .. + n - 1 of `num_choices` (every
    prompt's; the ids number them all), seeded as the prompt's alone would be; a request of one choice keeps the
    request's own id."""
    base_seed = sampling.seed if sampling.seed is not None else draw_seed()
    single = (num_choices if num_choices is not None else n) == 1
    requests = []
    for index in range(n):
        choice_sampling = sampling.model_copy(update={"seed": derive_seed(base_seed, index)})
        choice_id = request_id if single else f"{request_id}-{first_index + index}"
        requests.append(
            GenerateRequest(choice_id, prompt_token_ids, choice_sampling, cache_salt, deadline_s, is_disconnected)
        )
    return requests
