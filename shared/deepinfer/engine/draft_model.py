"""`DraftModelDrafter`: a smaller checkpoint with the target's vocabulary drafts greedily (vLLM's `draft_model`).

    LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})

The draft side is an `EngineCore` of its own over the draft model, in the target's process, on its device and in its
dtype: its own scheduler, block pool (prefix caching on) and runner, so its KV never takes a block of the target's
pool. Each `propose_batch` (EngineCore._propose_drafts, after the target's update):

    mirrors   one Request per target request that decodes next: prompt = the target's tokens so far (prompt and
              output), greedy, max_tokens = its draft length (k cut to what the target's next step could keep)
    steps     the draft engine steps until every mirror has finished: a first step computes each mirror's tokens
              past its prefix-cache hit (the target's tokens since the last round, and the partial last block),
              then k - 1 decode steps of all mirrors together: one forward a draft position, not one a request
    drafts    the mirrors' outputs; finished, the mirrors hold no block between rounds

Rollback: a mirror lives one round; what outlives it is its full blocks in the draft pool's prefix cache, keyed by
the hash chain of their tokens. A block holding a draft token the target rejected hashes tokens the target never
kept, so no later mirror matches it (it ages out of the free queue); the accepted prefix is found again, and a round
recomputes at most the last block (<= block_size tokens a request: a hit leaves one token to compute) beyond the
target's new tokens. Requests that finish or abort leave nothing behind: the drafter keeps no state of a request
past the round it drafted in (the block hashes it carries to the next round are kept for that round's requests).

Exactness: drafts are the draft model's argmax tokens, one-hot (`has_probs = False`). The target keeps a draft token
iff it samples that token at its row with its own noise: rejection sampling against q = one-hot(d), exact (vLLM V1's
EAGLE proposer drafts greedily too), so greedy and seeded requests emit the tokens of a run without speculation.

Vocabulary: both tokenizers (when both have one) must map every token to the same id, else both models must have
the same vocab_size; refused at start otherwise. A draft vocab_size padded past the target's (same tokenizer) is
allowed: a draft stops before an id the target does not have.

KV size (EngineCore._draft_kv_tokens): the draft pool holds as many tokens as the target's (at most max_num_seqs
full-length sequences), plus a draft and a partial block per sequence: a round never waits for draft blocks while
the target holds its requests' KV. With a CUDA budget the two pools share it so that both hold that many tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.drafter import NO_DRAFT, Draft
from deepinfer.engine.request import Request
from deepinfer.loader.hf import load_model_config
from deepinfer.sampling.params import SamplingParams
from deepinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore

logger = logging.getLogger(__name__)


class DraftModelDrafter:
    """Greedy drafts from a draft model's EngineCore, all requests of a step batched (module docstring)."""

    #: Greedy drafts are one-hot: verified exactly by the sampler's own noise (deepinfer.sampling.rejection).
    has_probs = False

    def __init__(self, core: EngineCore, target_vocab_size: int, target_max_model_len: int) -> None:
        #: The draft model's engine (its scheduler holds the mirrors during a round, nothing between rounds).
        self.core = core
        self.target_vocab_size = target_vocab_size
        self.target_max_model_len = target_max_model_len
        #: Greedy params by draft length (a round builds one mirror per request: no validation per mirror).
        self._params: dict[int, SamplingParams] = {}
        #: request_id -> (the target's Request, the block hashes of its tokens as the last round saw them): a
        #: running request's tokens only grow, so its next mirror adopts them instead of hashing its whole context
        #: again. Only the last round's requests are kept (no state outlives a request by more than a round).
        self._block_hashes: dict[str, tuple[Request, list[bytes]]] = {}

    @classmethod
    def build(cls, draft_dir: Path, target_args: EngineArgs, *, device: torch.device, dtype: torch.dtype,
              max_model_len: int, kv_cache_bytes: int, target_vocab_size: int,
              target_tokenizer: Tokenizer | None) -> DraftModelDrafter:
        """Load the draft model (after checking its vocabulary against the target's: ValueError if they differ)
        into an engine of its own: the target's device, dtype, block size and batch limits, prefix caching on,
        synchronous steps, no speculation, no host tier, `kv_cache_bytes` of KV."""
        from deepinfer.engine.core import EngineCore  # core imports this module

        draft_config = load_model_config(draft_dir)
        draft_tokenizer = Tokenizer.from_dir(draft_dir) if (draft_dir / "tokenizer.json").is_file() else None
        check_same_vocabulary(target_vocab_size, target_tokenizer, draft_config.vocab_size, draft_tokenizer)
        args = target_args
        core = EngineCore(EngineArgs(
            model=str(draft_dir),
            dtype=dtype,
            device=str(device),
            accelerator=args.accelerator,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=min(max_model_len, draft_config.max_position_embeddings),
            kv_cache_bytes=kv_cache_bytes,
            kv_host_cache_bytes=0,
            enable_prefix_caching=True,
            model_cache_dir=args.model_cache_dir,
            progress=args.progress,
            load_format=args.load_format,
            dummy_seed=args.dummy_seed,
            execution_mode=args.execution_mode,
            enforce_eager=args.enforce_eager,
            mixed_step_decode_kernel=args.mixed_step_decode_kernel,
            graph_sampling=args.graph_sampling,
            admission_window_s=0.0,
            async_scheduling=False,
        ))
        logger.info("draft model: %s, %d KV blocks (%d tokens)", draft_dir, core.kv_plan.num_blocks,
                    core.kv_plan.num_tokens)
        return cls(core, target_vocab_size, max_model_len)

    def propose(self, request: Request, num_tokens: int) -> Draft:
        """One request's draft (`propose_batch` of one)."""
        return self.propose_batch([request], num_tokens).get(request.request_id, NO_DRAFT)

    def propose_batch(self, requests: Sequence[Request], num_tokens: int) -> dict[str, Draft]:
        """Greedy drafts of up to `num_tokens` tokens for every request, one draft-model forward a position."""
        scheduler, block_size = self.core.scheduler, self.core.args.block_size
        hashed, self._block_hashes = self._block_hashes, {}
        mirrors: list[tuple[Request, Request]] = []  # (target request, its mirror)
        for request in requests:
            num_draft_tokens = self._num_draft_tokens(request, num_tokens)
            if num_draft_tokens <= 0:
                continue
            mirror = Request(request.request_id, request.all_token_ids, self._greedy(num_draft_tokens),
                             cache_salt=request.cache_salt)
            scheduler.add_request(mirror)
            previous = hashed.get(request.request_id)
            if previous is not None and previous[0] is request:
                mirror.adopt_block_hashes(previous[1])
            mirrors.append((request, mirror))
        while scheduler.has_unfinished_requests():
            self.core.step()
        drafts = {}
        for request, mirror in mirrors:
            drafts[request.request_id] = Draft(self._in_target_vocab(mirror.output_token_ids))
            # The blocks within the target's tokens (a mirror's later blocks hold its drafts).
            self._block_hashes[request.request_id] = (
                request, mirror.block_hashes[: mirror.num_prompt_tokens // block_size])
        return drafts

    def _num_draft_tokens(self, request: Request, num_tokens: int) -> int:
        """num_tokens cut as the target's scheduler cuts a draft (max_model_len, max_tokens) and to the draft
        model's max_model_len (its mirror must fit)."""
        num_context = request.num_tokens
        num_tokens = min(num_tokens, self.target_max_model_len - num_context - 1,
                         self.core.max_model_len - num_context)
        max_tokens = request.stop_rule.max_tokens
        if max_tokens is not None:
            num_tokens = min(num_tokens, max_tokens - request.num_output_tokens - 1)
        return num_tokens

    def _greedy(self, num_tokens: int) -> SamplingParams:
        params = self._params.get(num_tokens)
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, seed=0)
            self._params[num_tokens] = params
        return params

    def _in_target_vocab(self, token_ids: list[int]) -> list[int]:
        """The draft up to its first id the target's vocabulary lacks (a draft vocab_size padded past it)."""
        vocab_size = self.target_vocab_size
        return next((token_ids[:i] for i, t in enumerate(token_ids) if t >= vocab_size), token_ids)

    def close(self) -> None:
        """Release the draft engine (EngineCore.close)."""
        self.core.close()


def check_same_vocabulary(target_vocab_size: int, target_tokenizer: Tokenizer | None, draft_vocab_size: int,
                          draft_tokenizer: Tokenizer | None) -> None:
    """ValueError unless the draft model reads and writes the target's token ids: the same token -> id map when both
    have a tokenizer, else the same vocab_size."""
    if target_tokenizer is None or draft_tokenizer is None:
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocab_size={draft_vocab_size} differs "
                             f"from the target's {target_vocab_size}: a draft model must share the target's vocabulary")
        return
    target_vocab = target_tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft_tokenizer.backend.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differ = sorted(t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t))
        raise ValueError(f"speculative_config.model: the draft model's tokenizer differs from the target's "
                         f"({len(draft_vocab)} against {len(target_vocab)} tokens, {len(differ)} with another id or "
                         f"missing, e.g. {differ[0]!r}): a draft model must share the target's vocabulary")
