"""`MtpDrafter`: the DeepSeek-V3 family's multi-token-prediction layer drafts the next token (vLLM's `mtp` method).

    LLM(deepseek_v3, speculative_config={"method": "mtp", "num_speculative_tokens": 1})

The checkpoint's MTP layer (`model.layers.{num_hidden_layers}`, loaded into `mtp_layers`) predicts token t+2 from the
main model's final hidden state at t and the embedding of token t+1 (DeepseekV3ForCausalLM.mtp_hidden). Its attention
block has its own latent cache, one more layer's worth beside the main caches, under the same block tables and
slots. After every step (`observe_step`, EngineCore._step_sync) the layer runs over all of that step's rows, so its
cache holds a latent for every computed position, prompts included:

    row at position p of a scheduled request:   input (h_p, token p + 1)   -> its latent written at p's slot
        token p + 1 is known for every row the request kept: the next prompt token, the sampled token, an accepted
        draft or the step's correction (rejected drafts' rows get stale latents, rewritten when p is computed again)
    the request's last computed row (p = num_computed_tokens - 1, token p + 1 = its newest token): its logits'
        argmax is the draft of token p + 2, which the next step verifies

Drafts are greedy and one-hot (`has_probs = False`: rejection sampling against q = one-hot(d) is exact), one token a
step (k = 1; chaining the layer on its own output for k > 1 is to come). The pass needs every row's hidden states,
which the eager forward keeps (`ModelRunner.keep_last_step`): the engine lowers its execution mode to eager and
schedules synchronously with `mtp` for now (EngineArgs). A block reused from the prefix cache brings the latents
its first computation wrote: exact all the same, a draft at most worse (the latent at a block's last position saw the
token after it in the request that computed it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepinfer.engine.drafter import NO_DRAFT, Draft
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class MtpDrafter:
    """One-token drafts from the model's MTP layer over the last step's rows (module docstring)."""

    has_probs = False

    def __init__(self, model: torch.nn.Module, runner: ModelRunner, cache: torch.Tensor,
                 requests: Mapping[str, Request]) -> None:
        if getattr(model, "num_mtp_layers", 0) < 1:
            raise ValueError("speculative_config.method='mtp': the model has no MTP layer (num_nextn_predict_layers "
                             "in its config and model.layers.{num_hidden_layers}.* in its checkpoint)")
        self.model, self.runner, self.cache = model, runner, cache
        #: The engine's live requests (Scheduler.requests): the tokens after each row, and who decodes next.
        self.requests = requests
        runner.keep_last_step = True
        #: request_id -> (its num_tokens when drafted, the draft token): valid while the request has not moved.
        self._drafts: dict[str, tuple[int, int]] = {}

    def observe_step(self, scheduled: SchedulerOutput) -> None:
        """Run the MTP layer over the step just updated (its latents into the cache) and keep the next drafts."""
        self._drafts = {}
        last = self.runner.last_step
        self.runner.last_step = None
        if last is None:
            return
        inputs, hidden = last
        next_ids, draft_rows = self._next_tokens(scheduled.scheduled, hidden.shape[0])
        device = hidden.device
        with torch.inference_mode():
            mtp = self.model.mtp_hidden(hidden, torch.tensor(next_ids, dtype=torch.long, device=device),
                                        inputs.positions, self.cache, inputs.meta)
            if not draft_rows:
                return
            rows = torch.tensor([row for row, _ in draft_rows.values()], device=device)
            tokens = self.model.compute_logits(mtp[rows]).argmax(dim=-1).tolist()
        self._drafts = {rid: (num_tokens, token)
                        for (rid, (_, num_tokens)), token in zip(draft_rows.items(), tokens, strict=True)}

    def _next_tokens(self, scheduled: Sequence[ScheduledRequest],
                     num_rows: int) -> tuple[list[int], dict[str, tuple[int, int]]]:
        """The token after each row's position (0 where none is kept), and per request decoding next the row of its
        last computed position with its num_tokens."""
        next_ids = [0] * num_rows
        draft_rows: dict[str, tuple[int, int]] = {}
        row, running = 0, RequestStatus.RUNNING
        for s in scheduled:
            request = self.requests.get(s.request_id)
            if request is not None:
                tokens, start = request.all_token_ids, s.num_computed_tokens
                end = min(s.num_new_tokens, len(tokens) - start - 1)  # rows whose next token is kept
                next_ids[row : row + end] = tokens[start + 1 : start + 1 + end]
                last = request.num_computed_tokens - 1 - start
                if (request.status is running and request.num_tokens - request.num_computed_tokens == 1
                        and 0 <= last < s.num_new_tokens):
                    draft_rows[s.request_id] = (row + last, request.num_tokens)
            row += s.num_new_tokens
        return next_ids, draft_rows

    def propose(self, request: Request, num_tokens: int) -> Draft:
        """The request's MTP draft (one token), if it was drafted at the request's current length."""
        draft = self._drafts.get(request.request_id)
        if draft is None or num_tokens < 1 or draft[0] != request.num_tokens:
            return NO_DRAFT
        return Draft([draft[1]])
