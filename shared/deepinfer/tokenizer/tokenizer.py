"""A torch-free tokenizer for a Hugging Face model directory, behaving like transformers' fast tokenizer."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from deepinfer.tokenizer.chat_template import ChatTemplateError, compile_chat_template, render_chat_template

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
#: Texts longer than this are encoded with the GIL released (`encode_batch`): `encode` holds it for the whole call,
#: ~1-2 µs per character: a 1 MB prompt on a tokenizer thread would stall the event loop for a second or more.
GIL_FREE_ENCODE_CHARS = 4096
#: Compiled chat templates kept per tokenizer (a model has a few; more are requests' own templates).
MAX_COMPILED_TEMPLATES = 8


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates; transformers' precedence: chat_template.jinja, chat_template.json, the config key."""
    templates: dict[str, str] = {}
    source = config.get("chat_template")
    json_file = _read_json(model_dir / "chat_template.json").get("chat_template")
    if json_file is not None:
        source = json_file
    if isinstance(source, list):
        templates.update({entry["name"]: entry["template"] for entry in source})
    elif isinstance(source, str):
        templates["default"] = source
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        templates.update({path.stem: path.read_text(encoding="utf-8") for path in sorted(extra_dir.glob("*.jinja"))})
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


def _eos_ids_from(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


class Tokenizer:
    """tokenizer.json + tokenizer_config.json + chat template + generation_config EOS ids; no torch."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        chat_templates: dict[str, str],
        generation_eos_token_ids: set[int],
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_templates = chat_templates
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        #: Compiled templates by source, least recently used first (bounded: a source may come from a request).
        self._compiled_templates: OrderedDict[str, Any] = OrderedDict()
        self._compiled_lock = threading.Lock()  # prompts are rendered on worker threads
        eos_ids = set(generation_eos_token_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (tokenizer.json is required)."""
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
        backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {name: _token_content(config.get(name)) for name in _NAMED_SPECIAL_TOKENS}
        special_tokens = {name: token for name, token in special_tokens.items() if token is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra_tokens = [_token_content(token) for token in (extra.values() if isinstance(extra, dict) else extra)]
        _register_special_tokens(backend, [*special_tokens.values(), *filter(None, extra_tokens)])
        # Like transformers 5: with a tokenizer.json, its post-processor alone decides BOS/EOS
        # (tokenizer_config's add_bos_token/add_eos_token are ignored).
        generation = _read_json(model_dir / "generation_config.json")
        return cls(
            backend,
            special_tokens,
            _load_chat_templates(model_dir, config),
            _eos_ids_from(generation.get("eos_token_id")),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the post-processor adds (BOS for some models). A long
        text is encoded with the GIL released, so other threads run meanwhile."""
        return encode_ids(self.backend, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`, as transformers' `decode` gives it."""
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleans_up() else text

    def decode_batch(self, token_id_lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each list, in one call into the tokenizer library (which releases the GIL for it)."""
        texts = self.backend.decode_batch(token_id_lists, skip_special_tokens=skip_special_tokens)
        return [_clean_up_tokenization(text) for text in texts] if self._cleans_up() else texts

    def _cleans_up(self) -> bool:
        """Whether decoded text gets transformers' clean-up of spaces: never for BPE output (it would corrupt it),
        only for WordPiece-style models that ask for it."""
        return self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE"

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None."""
        return self.backend.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its decoded text): a text of more than
        `n * max_token_chars` characters cannot be fewer than n tokens (~0.1 s for a 50k vocabulary: once)."""
        texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, max(map(len, texts), default=1))

    @property
    def bos_token_id(self) -> int | None:
        """The BOS token's id, or None when the model has none."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (see eos_token_ids for every id that ends generation)."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id, or None."""
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's EOS and generation_config's eos_token_id(s)."""
        return set(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (named ones and added tokens marked special), ascending."""
        ids = {token_id for token_id, token in self.backend.get_added_tokens_decoder().items() if token.special}
        ids.update(i for name in self.special_tokens if (i := self._special_id(name)) is not None)
        return sorted(ids)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered to text by the model's chat template (ChatTemplateError on failure)."""
        template = self._compiled(self._select_template(chat_template, tools))
        template_kwargs = {**self.special_tokens, **kwargs}
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; like transformers, the template alone places BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _select_template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(f"no default chat template; pick one of {sorted(self.chat_templates)}")
        raise ChatTemplateError("this model has no chat template; use the completions API instead")

    def _compiled(self, source: str) -> Any:
        cache = self._compiled_templates
        with self._compiled_lock:
            if source in cache:
                cache.move_to_end(source)
                return cache[source]
        compiled = compile_chat_template(source)
        with self._compiled_lock:
            cache[source] = compiled
            while len(cache) > MAX_COMPILED_TEMPLATES:
                cache.popitem(last=False)
        return compiled


def encode_ids(backend: BackendTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """`backend.encode(text).ids`; past GIL_FREE_ENCODE_CHARS through `encode_batch`, which releases the GIL."""
    if len(text) > GIL_FREE_ENCODE_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _register_special_tokens(backend: BackendTokenizer, tokens: list[str]) -> None:
    # transformers adds the config's special tokens to the backend when tokenizer.json lacks them as added tokens.
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(tokens) if t not in added]
    if missing:
        backend.add_special_tokens(missing)


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization, for WordPiece-style decoders.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
