"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of each prompt token given the tokens before it,
scored from the hidden states of the rows a step computes for the prompt.

A row at position p predicts the token at p + 1; so a chunk of the prompt scores the prompt tokens after each of its
rows, up to the last prompt token (whose row predicts the first output token: that one is sampled, not scored):

    prompt          | t0 t1 t2 t3 t4 t5 t6 |              P = 7, two chunks of 4 and 3 rows
    chunk 1 rows    | t0 t1 t2 t3 |                       score t1 t2 t3 t4   (the row of t3 predicts t4)
    chunk 2 rows                | t4 t5 t6 |              score t5 t6; t6's row samples the first output token

A request gathers its entries chunk by chunk (`Request.prompt_logprobs`, `PromptLogprobs` in token order) and hands
them out with its first token. Positions it has scored already are not scored again (a request preempted while
its prompt is computed recomputes from position 0). It is never given cached prefix blocks while it owes them
(`Request.needs_prompt_logits`), so every prompt row is computed here, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request


@dataclass(slots=True)
class PromptRows:
    """One request's rows of a step that score its prompt: prompt tokens first .. first + num_rows - 1."""

    request: Request
    #: Prompt position of the first token scored (the row at first - 1 predicts it).
    first: int
    num_rows: int


def prompt_rows(request: Request, num_computed_tokens: int, num_new_tokens: int) -> PromptRows | None:
    """The rows of this chunk (positions num_computed_tokens .. + num_new_tokens - 1) that score prompt tokens the
    request has not scored yet; None when none do."""
    gathered = request.prompt_logprobs
    if gathered is None:
        return None
    first = len(gathered) + 1  # the next prompt position to score
    assert num_computed_tokens <= first - 1, (request.request_id, num_computed_tokens, first)  # no gap before it
    # The chunk's last row (position c + n - 1) scores position c + n, while that is still a prompt token.
    end = min(num_computed_tokens + num_new_tokens + 1, request.num_prompt_tokens)  # last scored position + 1
    return PromptRows(request, first, end - first) if end > first else None


@torch.inference_mode()
def score_prompt_rows(
    hidden: torch.Tensor,
    rows: Sequence[PromptRows],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    max_rows_per_pass: int,
) -> None:
    """Score the prompt tokens of `rows` from their rows' final hidden states ([R, hidden], in `rows` order) and
    append each request's entries to its `prompt_logprobs`. The LM head runs over at most `max_rows_per_pass` rows
    at a time (the logits headroom the KV plan keeps is the sampler's, max_num_seqs rows); the results are read on
    the host here, so a step that scores prompt tokens waits for its device work."""
    device = hidden.device
    targets = torch.tensor(
        [t for r in rows for t in r.request.prompt_token_ids[r.first : r.first + r.num_rows]], device=device
    )  # [R]: the token each row scores
    num_top = max(r.request.sampling_params.prompt_logprobs for r in rows)
    chosen, ranks, top_ids, top_logprobs = [], [], [], []
    for start in range(0, targets.numel(), max_rows_per_pass):
        end = start + max_rows_per_pass
        logprobs = torch.log_softmax(compute_logits(hidden[start:end]).float(), dim=-1)  # [r, V], raw
        token_logprobs = logprobs.gather(1, targets[start:end].unsqueeze(1))  # [r, 1]
        chosen.append(token_logprobs.squeeze(1))
        ranks.append((logprobs > token_logprobs).sum(dim=-1) + 1)  # 1 + tokens strictly more likely
        if num_top:
            top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
            top_ids.append(top.indices)
            top_logprobs.append(top.values)
    chosen_list, rank_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    top_id_list = torch.cat(top_ids).tolist() if num_top else None
    top_logprob_list = torch.cat(top_logprobs).tolist() if num_top else None
    start = 0
    for r in rows:
        gathered, end, k = r.request.prompt_logprobs, start + r.num_rows, r.request.sampling_params.prompt_logprobs
        assert gathered is not None and len(gathered) + 1 == r.first, (r.request.request_id, len(gathered), r.first)
        gathered.logprobs += chosen_list[start:end]
        gathered.ranks += rank_list[start:end]
        if k and top_id_list is not None and top_logprob_list is not None:
            gathered.top_token_ids += [ids[:k] for ids in top_id_list[start:end]]
            gathered.top_logprobs += [lps[:k] for lps in top_logprob_list[start:end]]
        else:
            gathered.top_token_ids += [[] for _ in range(r.num_rows)]
            gathered.top_logprobs += [[] for _ in range(r.num_rows)]
        start = end
