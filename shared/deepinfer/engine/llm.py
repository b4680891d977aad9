"""`LLM`: the offline API, familiar to vLLM users — `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.engine import Engine
from deepinfer.engine.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    PromptLogprobDicts,
    PromptLogprobs,
    RequestOutput,
)
from deepinfer.engine.requests import EngineRequest
from deepinfer.protocol import FinishReason
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.seeds import derive_seed, draw_seed
from deepinfer.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

#: A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt" for display), as in vLLM.
PromptType = str | dict[str, Any]
Message = dict[str, Any]


@dataclass
class _Sequence:
    """Host-side state of one generated sequence: detokenizer, stop strings, accumulated output."""

    index: int
    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None: the model has no tokenizer (token ids only)
    stop_checker: StopChecker
    #: No stop strings: nothing reads the text before the sequence finishes, so it is detokenized then, in one
    #: batch (`IncrementalDetokenizer.step_each`: the same text as token by token).
    text_at_end: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    submitted: bool = False


class LLM:
    """An engine in this process: load a model once, then generate for batches of prompts."""

    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        self._attach(Engine(EngineArgs(model=model, **engine_args)))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """An LLM over an engine already built, or over anything with an `Engine`'s face (`tokenizer`,
        `generation_config`, `add_request`, `step`, ...): a bench's stand-in that replays tokens, for one."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.default_sampling_params = SamplingParams.from_generation_config(engine.generation_config)
        self._request_counter = itertools.count()
        #: token id -> its text alone (the decoded_token of logprobs), decoded once per id.
        self._decoded_tokens: dict[int, str] = {}

    def close(self) -> None:
        """Free the host tier's pinned memory and stop the engine's worker processes (tensor parallelism) now,
        not when the object is collected; `with LLM(...) as llm:` closes it at the block's end."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (with its chat template)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in the order of the prompts."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        token_lists = [self._tokenize(p) for p in prompt_list]
        texts = [p if isinstance(p, str) else p.get("prompt") for p in prompt_list]
        return self._run(texts, token_lists, self._params_per_prompt(sampling_params, len(prompt_list)), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = chat_template_kwargs or {}
        texts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt, **kwargs)
            for c in conversations
        ]
        token_lists = [
            self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt, **kwargs)
            for c in conversations
        ]
        params = self._params_per_prompt(sampling_params, len(conversations))
        return self._run(texts, token_lists, params, use_tqdm)

    # -- internals ----------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return self.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
        raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"sampling_params: {len(params)} given for {num_prompts} prompts")
        return params

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        # Validate everything first, so a bad prompt rejects the call without leaving half of it queued.
        for token_ids, params in zip(token_lists, params_list, strict=True):
            self.engine.check_request(EngineRequest("", token_ids, params))
        outputs: list[RequestOutput] = []
        sequences: dict[str, tuple[RequestOutput, _Sequence]] = {}
        for text, token_ids, params in zip(texts, token_lists, params_list, strict=True):
            output = RequestOutput(str(next(self._request_counter)), text, token_ids)
            outputs.append(output)
            seed = params.seed if params.seed is not None else draw_seed()
            for index in range(params.n):
                # The prompt's logprobs come from sequence 0; its siblings reuse its cached prompt instead.
                changes = {"prompt_logprobs": None} if index and params.prompt_logprobs is not None else {}
                seq = self._new_sequence(output, index, params.clone(seed=derive_seed(seed, index), **changes))
                sequences[seq.request_id] = (output, seq)
            self._submit(sequences[f"{output.request_id}-0"])
        self._drive(sequences, outputs, use_tqdm)
        return outputs

    def _new_sequence(self, output: RequestOutput, index: int, params: SamplingParams) -> _Sequence:
        stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        return _Sequence(
            index=index,
            request_id=f"{output.request_id}-{index}",
            params=params,
            detokenizer=None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, output.prompt_token_ids, params.skip_special_tokens
            ),
            stop_checker=stop_checker,
            text_at_end=not stop_checker.stop,
            logprobs=[] if params.logprobs is not None else None,
        )

    def _submit(self, entry: tuple[RequestOutput, _Sequence]) -> None:
        output, seq = entry
        self.engine.add_request(EngineRequest(seq.request_id, output.prompt_token_ids, seq.params))
        seq.submitted = True

    def _drive(self, sequences: dict[str, tuple[RequestOutput, _Sequence]], outputs, use_tqdm: bool) -> None:
        """Step until every sequence finished. The siblings of an n > 1 request are submitted once sequence 0
        has computed the prompt, so they take its full blocks from the prefix cache instead of recomputing."""
        bar = tqdm(total=len(outputs), desc="Processed prompts", disable=not use_tqdm or len(outputs) < 2)
        remaining = {id(o): 0 for o in outputs}  # unfinished sequences per prompt
        siblings: dict[str, list[tuple[RequestOutput, _Sequence]]] = {}  # sequence 0's id -> siblings to submit
        for output, seq in sequences.values():
            remaining[id(output)] += 1
            if not seq.submitted:
                siblings.setdefault(f"{output.request_id}-0", []).append((output, seq))
        def apply(seq: _Sequence, engine_output: EngineOutput, output: RequestOutput, delta: str | None) -> None:
            if self._apply(seq, engine_output, output, delta):
                remaining[id(output)] -= 1
                if remaining[id(output)] == 0:
                    output.outputs = sorted(output.outputs, key=lambda c: c.index)
                    output.finished = True
                    bar.update(1)

        while self.engine.has_unfinished_requests():
            # Sequences with stop strings and one new token: their text windows are decoded together, below.
            batched: list[tuple[_Sequence, EngineOutput, RequestOutput]] = []
            for engine_output in self.engine.step():
                output, seq = sequences[engine_output.request_id]
                if siblings and engine_output.new_token_ids:
                    for entry in siblings.pop(engine_output.request_id, ()):
                        self._submit(entry)
                if not seq.text_at_end and seq.detokenizer is not None and len(engine_output.new_token_ids) == 1:
                    batched.append((seq, engine_output, output))
                else:
                    apply(seq, engine_output, output, None)
            if batched:
                for (seq, engine_output, output), delta in zip(batched, self._detokenize(batched), strict=True):
                    apply(seq, engine_output, output, delta)
        bar.close()

    def _detokenize(self, batched: list[tuple[_Sequence, EngineOutput, RequestOutput]]) -> list[str]:
        """Each sequence's `detokenizer.step(new_token_ids)`, with every window decoded in one `decode_batch`
        call per skip_special_tokens setting (the same text as one decode per window)."""
        windows: dict[bool, list[list[int]]] = {}
        for seq, engine_output, _ in batched:
            detokenizer = seq.detokenizer
            windows.setdefault(detokenizer.skip_special_tokens, []).extend(
                detokenizer.next_windows(engine_output.new_token_ids))
        texts = {skip: iter(self.tokenizer.decode_batch(ids, skip_special_tokens=skip)) for skip, ids in windows.items()}
        deltas = []
        for seq, _, _ in batched:
            detokenizer = seq.detokenizer
            decoded = texts[detokenizer.skip_special_tokens]
            prefix_text = next(decoded)
            deltas.append(detokenizer.take_windows(prefix_text, next(decoded)))
        return deltas

    def _apply(self, seq: _Sequence, out: EngineOutput, request_output: RequestOutput, delta: str | None = None) -> bool:
        """Fold one step's output into a sequence; True when the sequence finished. Several tokens (a step that
        verified drafts) are folded one at a time, so a stop string ends the text and the token ids exactly where
        one token per step would. `delta`: the detokenizer's step already taken (`_detokenize`)."""
        if seq.text_at_end:
            return self._apply_text_at_end(seq, out, request_output)
        if len(out.new_token_ids) > 1:
            return self._apply_each(seq, out, request_output)
        self._keep_tokens(seq, out, request_output)
        if delta is None:
            delta = seq.detokenizer.step(out.new_token_ids) if seq.detokenizer is not None else ""
        text, stopped = seq.stop_checker.step(delta)
        seq.text += text
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stopped:
            if finish_reason is None:
                self.engine.abort([seq.request_id])
            finish_reason, stop_reason = FinishReason.STOP, seq.stop_checker.matched_stop
        if finish_reason is None:
            return False
        if not stopped:
            tail, stopped = seq.stop_checker.step(seq.detokenizer.flush() if seq.detokenizer is not None else "")
            seq.text += tail if stopped else tail + seq.stop_checker.flush()
            if stopped:
                finish_reason, stop_reason = FinishReason.STOP, seq.stop_checker.matched_stop
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        request_output.outputs.append(
            CompletionOutput(seq.index, seq.text, seq.token_ids, seq.logprobs, finish_reason, stop_reason)
        )
        return True

    def _apply_text_at_end(self, seq: _Sequence, out: EngineOutput, request_output: RequestOutput) -> bool:
        """`_apply` for a sequence without stop strings: only the engine ends it, so its tokens (all of a step's at
        once) and logprobs are kept as they come and the text is made once it finished, exactly as token by token
        (a stop checker without stop strings passes every delta through and holds nothing back)."""
        self._keep_tokens(seq, out, request_output)
        finish_reason = out.finish_reason
        if finish_reason is None:
            return False
        detokenizer = seq.detokenizer
        if detokenizer is not None:
            seq.text = detokenizer.step_each(seq.token_ids) + detokenizer.flush()
        seq.finish_reason, seq.stop_reason = finish_reason, out.stop_reason
        request_output.outputs.append(
            CompletionOutput(seq.index, seq.text, seq.token_ids, seq.logprobs, finish_reason, out.stop_reason)
        )
        return True

    def _keep_tokens(self, seq: _Sequence, out: EngineOutput, request_output: RequestOutput) -> None:
        """A step's tokens and their logprobs into the sequence (and, from the first choice, the prompt's cache
        count and logprobs into the request's output)."""
        if seq.index == 0:
            request_output.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                request_output.prompt_logprobs = self._prompt_logprob_dicts(request_output.prompt_token_ids,
                                                                            out.prompt_logprobs)
        seq.token_ids.extend(out.new_token_ids)
        if seq.logprobs is not None and out.new_logprobs:
            seq.logprobs.extend(self._logprobs_entry(s) for s in out.new_logprobs)

    def _apply_each(self, seq: _Sequence, out: EngineOutput, request_output: RequestOutput) -> bool:
        last = len(out.new_token_ids) - 1
        for i, token_id in enumerate(out.new_token_ids):
            one = dataclasses.replace(
                out, new_token_ids=[token_id],
                new_logprobs=None if out.new_logprobs is None else out.new_logprobs[i : i + 1],
                finish_reason=out.finish_reason if i == last else None,
                stop_reason=out.stop_reason if i == last else None,
                prompt_logprobs=out.prompt_logprobs if i == 0 else None,
            )
            if self._apply(seq, one, request_output):
                return True
        return False

    def _prompt_logprob_dicts(self, prompt_token_ids: list[int], scores: PromptLogprobs) -> PromptLogprobDicts:
        """vLLM's prompt_logprobs: None for the first token, then {token: Logprob, top-k alternatives...}."""
        dicts: PromptLogprobDicts = [None]
        for token_id, logprob, rank, top_ids, top_logprobs in zip(
            prompt_token_ids[1:], scores.logprobs, scores.ranks, scores.top_token_ids, scores.top_logprobs,
            strict=True,
        ):
            entry = {token_id: Logprob(logprob, rank, self._decode_one(token_id))}
            for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
                entry.setdefault(top_id, Logprob(top_logprob, top_rank, self._decode_one(top_id)))
            dicts.append(entry)
        return dicts

    def _decode_one(self, token_id: int) -> str | None:
        """One token's text alone (special tokens kept), decoded once per id."""
        if self.tokenizer is None:
            return None
        text = self._decoded_tokens.get(token_id)
        if text is None:
            text = self._decoded_tokens[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logprobs_entry(self, sampled) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        decoded, decode_one = self._decoded_tokens, self._decode_one
        for rank, (token_id, logprob) in enumerate(sampled.top_logprobs or (), start=1):
            text = decoded.get(token_id)
            entry[token_id] = Logprob(logprob, rank, text if text is not None else decode_one(token_id))
        if sampled.token_id not in entry:
            entry[sampled.token_id] = Logprob(sampled.logprob, None, self._decode_one(sampled.token_id))
        return entry
