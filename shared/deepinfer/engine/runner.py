"""The model runner: owns the model, the paged KV tensors and the sampler; turns a SchedulerOutput into tokens.

The scheduler decides *what* runs (ints and block ids); the runner builds the flat ragged batch from that,
runs one forward over it and samples the rows that reached the end of their known tokens:

    scheduled     | req A: prefill chunk 0..5 | req B: decode 1 token | req C: 3 tokens over a cached prefix |
    input_ids     | a0 a1 a2 a3 a4 a5         | b_last                | c16 c17 c18                          |
    positions     | 0  1  2  3  4  5          | 40                    | 16  17  18                           |
    logits rows   |                a5 (if sample)  b_last             |             c18 (if sample)          |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledRequest
from deepinfer.kernels.metadata import AttentionMetadata, build_attention_metadata
from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.sampler import Sampler


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its raw logprob and, when asked, the top logprobs of that position."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ModelInputs:
    """The flat batch of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: row of the last token of each sampled request
    sampled: list[ScheduledRequest]


class ModelRunner:
    """Runs forward + sample for the scheduler's batch; the only engine part that touches tensors."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)  # banned while a request is below its min_tokens
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> dict[str, SampledToken]:
        """Forward the batch and sample one token for each request whose `sample` flag is set."""
        if not scheduled:
            return {}
        inputs = self.prepare_inputs(scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        chosen = [requests[s.request_id] for s in inputs.sampled]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in chosen],
            positions=[s.num_computed_tokens + s.num_new_tokens for s in inputs.sampled],
            seeds=[r.sampling_params.seed for r in chosen],
            prompt_token_ids=[r.prompt_token_ids for r in chosen],
            output_token_ids=[r.output_token_ids for r in chosen],
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=self.eos_token_ids,
        )
        return self._to_host(self.sampler(logits, meta), chosen)

    def prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> ModelInputs:
        """Flatten the scheduled requests into input ids, positions, slot mapping and attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        bs = self.block_size
        for s in scheduled:
            start = s.num_computed_tokens
            span = range(start, start + s.num_new_tokens)
            input_ids.extend(s.token_ids)
            positions.extend(span)
            slot_mapping.extend(s.block_ids[p // bs] * bs + p % bs for p in span)
            if s.sample:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(s)
        meta = build_attention_metadata(
            query_lens=[s.num_new_tokens for s in scheduled],
            seq_lens=[s.num_computed_tokens + s.num_new_tokens for s in scheduled],
            block_tables=[s.block_ids for s in scheduled],
            slot_mapping=slot_mapping,
            device=self.device,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampled=sampled,
        )

    def _to_host(self, out, chosen: list[Request]) -> dict[str, SampledToken]:
        # One device->host copy per step for all rows.
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result: dict[str, SampledToken] = {}
        for i, request in enumerate(chosen):
            k = request.sampling_params.logprobs
            top = None
            if k and top_ids is not None:
                top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
            result[request.request_id] = SampledToken(token_ids[i], logprobs[i], top)
        return result
