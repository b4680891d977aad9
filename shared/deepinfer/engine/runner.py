"""The model runner: owns the model, the paged KV tensors and the sampler; turns a SchedulerOutput into tokens.

The scheduler decides *what* runs (ints and block ids); the runner builds the flat ragged batch from that,
runs one forward over it and samples the rows that reached the end of their known tokens:

    scheduled     | req A: prefill chunk 0..5 | req B: decode 1 token | req C: 3 tokens over a cached prefix |
    input_ids     | a0 a1 a2 a3 a4 a5         | b_last                | c16 c17 c18                          |
    positions     | 0  1  2  3  4  5          | 40                    | 16  17  18                           |
    logits rows   |                a5 (if sample)  b_last             |             c18 (if sample)          |

Block tables persist across steps in a host `BlockTable` (one row per running request, updated from the
scheduler's new block ids, freed from its finished and preempted ids). Which steps replay CUDA graphs is the
execution mode (`execution`): decode-only steps a decode graph (`cuda_graphs`); steps with prompt rows of a
Llama-family model one graph per token bucket with attention inside (`full_graphs`), or piecewise graphs (all but
attention, `piecewise_graphs`); every other step, and every step on the CPU or in eager mode, runs eagerly.

Speculative decoding: a decode that carries k draft tokens feeds them after its last token and is sampled at
all k + 1 rows (`execute_verify`: through the full graphs while its rows fit a bucket's sequence slots, else the
piecewise graphs or eagerly); it emits the target's tokens up to the first draft it disagrees
with (deepinfer.sampling.rejection).

Batch-invariant mode: linears go through a fixed-tile matmul (`kernels.triton_matmul`), decode attention
always splits into max_model_len / 512 partitions, prefill attention always uses its largest query tile,
and a step that mixes decode rows with prefill rows runs them as two forwards, so no row's arithmetic
depends on which other rows share its step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from deepinfer.engine.async_step import PendingSample, SampledTokenBuffer, SampleLanding, sampled_tokens
from deepinfer.engine.execution import ExecutionMode, RunnerConfig
from deepinfer.engine.inputs import (
    BlockTable,
    HostBatch,
    InputStager,
    ModelInputs,
    build_host_batch,
    group_slots,
)
from deepinfer.engine.outputs import SampledToken
from deepinfer.engine.prompt_logprobs import PromptRows, score_prompt_rows
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.kernels import batch_invariant_linear
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.rejection import accepted_prefix
from deepinfer.sampling.sampler import Sampler, SamplerOutput

if TYPE_CHECKING:
    from deepinfer.engine.cuda_graphs import CudaGraphRunner, GraphStep, StagedIndices
    from deepinfer.engine.full_graphs import FullGraphRunner
    from deepinfer.engine.piecewise_graphs import PiecewiseGraphRunner

#: Batch-invariant prefill steps claim at least this max_query_len, so the prefill attention kernel always
#: takes its largest query tile (it picks min(largest, next_pow2(max_query_len)), largest <= 128).
_INVARIANT_MIN_QUERY_LEN = 128
#: One warm-up forward per query tile of the prefill attention kernel (16, 32, 64, 128 rows).
_TILE_QUERY_LENS = (16, 32, 64, 128)


def warm_up_query_lens(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """The lengths `ModelRunner.warm_up` forwards: one per prefill query tile, and the largest step (its MoE row
    blocks), none past max_model_len."""
    return sorted({min(n, max_model_len) for n in (*_TILE_QUERY_LENS, max_num_batched_tokens)})


class ModelRunner:
    """Runs forward + sample for the scheduler's batch; the only engine part that touches tensors.

    Built from one `RunnerConfig`: its execution mode (deepinfer.engine.execution) says which steps replay CUDA
    graphs, and `forward` dispatches each step to one of them (decode graphs, full or piecewise prompt graphs, eager).
    `mode` is the mode that was built: on the CPU always eager, and a model without graph-mode attention runs its
    prompt steps eagerly. Batch-invariant mode: see the module docstring (eager but for decode graphs).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], config: RunnerConfig) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.config = config
        self.block_size = config.block_size
        self.vocab_size = config.vocab_size
        self.device = device = torch.device(config.device)
        self.eos_token_ids = sorted(config.eos_token_ids)  # banned while a request is below its min_tokens
        self.max_model_len = config.max_model_len
        self.max_num_seqs = max_num_seqs = config.max_num_seqs
        self.sampler = Sampler()
        #: Per-step sampling metadata from per-request constants and reusable staging memory.
        self.sampling_metadata = SamplingMetadataBuilder(device)
        self.stager = InputStager(device)
        #: Async scheduling: the last sampled id of each block-table row, read by the next step's placeholders.
        self.sampled_tokens = SampledTokenBuffer(max_num_seqs + 1, device)
        #: Reused pinned memory the sampled tensors come back to the host through (CUDA; None: read in place).
        self.sample_landing = SampleLanding(pinned=True) if device.type == "cuda" else None
        # Columns grow on demand when max_model_len is unknown.
        self.block_table = BlockTable(max_num_seqs, -(-(config.max_model_len or 1024) // config.block_size))
        self.batch_invariant = config.batch_invariant
        #: Split a mixed step's attention (single-row sequences to the decode kernel); off in batch-invariant mode.
        self.mixed_step_decode_kernel = config.mixed_step_decode_kernel and not config.batch_invariant
        #: Python's switch interval while a step with prompt rows launches its layers (None: unchanged). Each
        #: Triton launch releases the GIL; a busy event loop in the same process then holds it until the
        #: interval forces it back, once per launch (several a layer).
        self.eager_step_switch_interval_s = config.eager_step_switch_interval_s
        accelerator = "cuda" if device.type == "cuda" else "cpu"
        self._linear_impl = batch_invariant_linear(accelerator) if config.batch_invariant else None
        #: The graphs of decode-only steps, and the full or else piecewise graphs of steps with prompt rows (None:
        #: those steps run eagerly). Set by the build from the mode (tests may set them to uncaptured runners).
        self.graphs: CudaGraphRunner | None = None
        self.full_graphs: FullGraphRunner | None = None
        self.piecewise: PiecewiseGraphRunner | None = None
        mode = config.execution_mode if device.type == "cuda" else ExecutionMode.EAGER
        if config.batch_invariant:
            mode = mode.at_most(ExecutionMode.DECODE)
        if mode.decode_graphs:
            self._capture_graphs(mode)
        #: The execution mode that was built (the one asked for, lowered to what this device and model run).
        self.mode = _built_mode(self.graphs, self.full_graphs, self.piecewise)
        #: True: an eager forward keeps its inputs and every row's hidden states in `last_step` (the MTP drafter
        #: reads them after the step, engine/mtp_drafter.py); None after a step forwarded otherwise.
        self.keep_last_step = False
        self.last_step: tuple[ModelInputs, torch.Tensor] | None = None

    def _capture_graphs(self, mode: ExecutionMode) -> None:
        """Capture the mode's graphs: decode graphs, then (piecewise, full) those of steps with prompt rows in
        their pool, the full ones with the decode graphs' logits tail when `graph_sampling` is on."""
        from deepinfer.engine.cuda_graphs import CudaGraphRunner

        config, model = self.config, self.model
        sampling = config.graph_sampling and not config.batch_invariant
        self.graphs = CudaGraphRunner(
            model, self.kv_caches, config.block_size, config.max_num_seqs, config.max_model_len, self.device,
            batch_invariant=config.batch_invariant, capture_context=self._linear_mode(),
            logits=model.compute_logits if sampling else None,
        )
        self.graphs.capture()
        if mode.prompt_graphs:
            from deepinfer.engine.full_graphs import capture_prompt_graphs

            self.full_graphs, self.piecewise = capture_prompt_graphs(
                model, self.kv_caches, self.graphs, config.max_num_batched_tokens, config.block_size,
                full=mode is ExecutionMode.FULL, sampling=sampling)

    @torch.inference_mode()
    def warm_up(self, query_lens: Sequence[int]) -> None:
        """One eager forward of a single sequence per length in `query_lens`, then the sampler (greedy and
        top-k/top-p rows): Triton compiles the eager path's variants (the prefill kernel's query tile, MoE
        row blocks) here and not in a step a request waits on (see `deepinfer.kernels.compile_watch`).
        Writes no KV (every slot -1; the rows read the null block 0) and leaves no row in the block table."""
        table = BlockTable(1, self.block_table.max_blocks_per_seq)
        hidden = None
        for q_len in query_lens:
            blocks = [0] * -(-q_len // self.block_size)
            scheduled = ScheduledRequest("warm-up", [0] * q_len, 0, q_len, blocks, sample=True, is_new=True)
            batch = build_host_batch([scheduled], table, self.block_size)
            batch.slot_mapping[:] = [-1] * q_len
            inputs = self.stager.stage(batch, table)
            if self.batch_invariant:  # as forward(invariant_prefill=True): always the largest query tile
                inputs.meta.max_query_len = max(inputs.meta.max_query_len, _INVARIANT_MIN_QUERY_LEN)
            with self._linear_mode():
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if hidden is None:
            return
        with self._linear_mode():
            logits = self.model.compute_logits(hidden[-2:])
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.95, top_k=50)]
        params = params[: logits.shape[0]]
        meta = SamplingMetadata.build(params, positions=[1] * len(params), seeds=[0] * len(params),
                                      prompt_token_ids=[[0]] * len(params), output_token_ids=[[]] * len(params),
                                      vocab_size=logits.shape[-1], device=self.device)
        self.sampler(logits, meta).token_ids.tolist()

    def _linear_mode(self) -> contextlib.AbstractContextManager:
        """Where linears run through the batch-invariant matmul (a no-op context outside that mode)."""
        if self._linear_impl is None:
            return contextlib.nullcontext()
        from deepinfer.kernels.triton_matmul import BatchInvariantLinear

        return BatchInvariantLinear(self._linear_impl)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput | Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> dict[str, SampledToken]:
        """Forward the batch and sample one token for each request whose `sample` flag is set.

        Pass the whole SchedulerOutput, so the rows of finished and preempted requests are freed at once; a
        bare list of ScheduledRequest also works (rows of requests no longer running are then reclaimed from
        `requests` when the table runs out of rows).
        """
        assert not getattr(output, "num_draft_tokens", 0), "a step with draft tokens goes through execute_verify"
        launched = self._forward_and_sample(output, requests)
        return {} if launched is None else self._to_host(launched.output, launched.requests)

    @torch.inference_mode()
    def execute_verify(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, list[SampledToken]]:
        """`execute` for a step whose decodes carry draft tokens (speculative decoding): every
        sampled request's emitted tokens. A request with k drafts is sampled at its k + 1 rows as a step without
        drafts would sample each (same processing, same noise for its seed and position), and emits the target's
        tokens of its first m + 1 rows, m = the drafts equal to the target's (deepinfer.sampling.rejection)."""
        launched = self._forward_and_sample(output, requests)
        if launched is None:
            return {}
        out = launched.output
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        top_ids = None if out.top_logprob_ids is None else out.top_logprob_ids.tolist()
        top_logprobs = None if out.top_logprobs is None else out.top_logprobs.tolist()
        emitted: dict[str, list[SampledToken]] = {}
        row = 0
        for s in launched.scheduled:
            num_rows = s.num_draft_tokens + 1
            num_accepted = accepted_prefix(s.token_ids[1:], token_ids[row : row + num_rows]) if num_rows > 1 else 0
            k = requests[s.request_id].sampling_params.logprobs
            tokens = []
            for i in range(row, row + num_accepted + 1):
                top = list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)) if k and top_ids else None
                tokens.append(SampledToken(token_ids[i], logprobs[i], top))
            emitted[s.request_id] = tokens
            row += num_rows
        return emitted

    @torch.inference_mode()
    def execute_async(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> PendingSample:
        """Launch forward + sample without waiting for the device: the sampled ids stay on the device for the
        next step's placeholders and travel to the host in the background (`PendingSample.result()`)."""
        launched = self._forward_and_sample(output, requests)
        if launched is None:
            return PendingSample(None, [])
        rows = launched.staged_sampled_rows  # uploaded with the step's inputs
        if rows is None:
            table_rows = self.block_table.rows
            rows = [table_rows[s.request_id] for s in launched.scheduled]
        self.sampled_tokens.record(rows, launched.output.token_ids, self.block_table.table.shape[0])
        return PendingSample(launched.output, launched.requests, launched.needs_sync, self.sample_landing)

    def _forward_and_sample(
        self, output: SchedulerOutput | Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> _Sampled | None:
        """Forward the step and sample its sampled rows; None when no row samples."""
        num_draft_tokens = 0
        if self.batch_invariant:
            forward, sampled = self._forward_invariant(self._release_rows(output, requests), requests)
            num_seqs = -1  # two forwards: the sampled rows' positions are counted per row
        else:
            batch = self.prepare_batch(output, requests)
            if not batch.num_seqs:
                return None
            forward, sampled, num_seqs = self.forward(batch), batch.sampled, batch.num_seqs
            num_draft_tokens = batch.num_draft_tokens
            if forward.prompt_hidden is not None:
                self._score_prompt_rows(forward.prompt_hidden, batch.prompt_rows)
        if not sampled:
            return None
        if num_draft_tokens:
            return self._sample_with_drafts(forward, sampled, requests)
        chosen = [requests[s.request_id] for s in sampled]
        params = [r.sampling_params for r in chosen]
        graph_step, num_sampled = forward.graph_step, len(sampled)
        if graph_step is None:
            with self._linear_mode():
                logits = self.model.compute_logits(forward.hidden)
        else:  # a graph computed the logits of every sampled row, and their greedy tokens
            logits = graph_step.logits[:num_sampled]
            if self._plain_greedy(chosen, params, logits.shape[-1]):
                token_ids, logprobs = graph_step.greedy_token_ids[:num_sampled], graph_step.greedy_logprobs[:num_sampled]
                if self.sample_landing is None:  # read where they are, later: the next replay rewrites them
                    token_ids, logprobs = token_ids.clone(), logprobs.clone()
                return _Sampled(SamplerOutput(token_ids, logprobs, None, None), chosen, sampled, False,
                                forward.staged_sampled_rows)
        if num_sampled == num_seqs:
            positions = batch.seq_lens  # every sequence samples, at its last position
        else:
            positions = [s.num_computed_tokens + s.num_new_tokens for s in sampled]
        meta = self.sampling_metadata.build(
            params,
            positions=positions,
            seeds=None,  # each request's params carry its seed (EngineCore.new_request draws one when unset)
            prompt_token_ids=_TokenLists(chosen, sampled, output=False),
            output_token_ids=_TokenLists(chosen, sampled, output=True),
            vocab_size=logits.shape[-1],
            eos_token_ids=self.eos_token_ids,
            grammar_bitmasks=[None if r.grammar is None else r.grammar.bitmask() for r in chosen],
        )
        # Penalties and grammars read the previous token on the host: async scheduling updates before the next step.
        needs_sync = meta.need_penalties or meta.allowed is not None
        return _Sampled(self.sampler(logits, meta), chosen, sampled, needs_sync, forward.staged_sampled_rows)

    def _sample_with_drafts(
        self, forward: ForwardResult, sampled: list[ScheduledRequest], requests: Mapping[str, Request]
    ) -> _Sampled:
        """Sample every verified row: row j of a request with k drafts samples the token at position
        num_computed_tokens + j + 1 after its output and drafts 0 .. j-1 (what penalties and min_tokens read)."""
        rows = [(requests[s.request_id], s, j) for s in sampled for j in range(s.num_draft_tokens + 1)]
        chosen = [r for r, _, _ in rows]
        if forward.graph_step is not None:  # the full graph computed every verified row's logits
            logits = forward.graph_step.logits[: len(rows)]
        else:
            with self._linear_mode():
                logits = self.model.compute_logits(forward.hidden)  # [sum(k + 1), V]
        meta = self.sampling_metadata.build(
            [r.sampling_params for r in chosen],
            positions=[s.num_computed_tokens + j + 1 for _, s, j in rows],
            seeds=None,
            prompt_token_ids=[r.prompt_token_ids for r in chosen],
            output_token_ids=_DraftTokenLists(rows),
            vocab_size=logits.shape[-1],
            eos_token_ids=self.eos_token_ids,
            grammar_bitmasks=_draft_bitmasks(sampled, requests),
        )
        return _Sampled(self.sampler(logits, meta), chosen, sampled, False, None)

    def _plain_greedy(self, chosen: Sequence[Request], params: Sequence[SamplingParams], vocab_size: int) -> bool:
        """True when the sampler would take every row's argmax of the raw logits (no grammar, penalties, bias
        or top logprobs): the graph's greedy tokens are the step's."""
        return (all(r.grammar is None for r in chosen)
                and self.sampling_metadata.plain_greedy(params, vocab_size, self.eos_token_ids))

    def prepare_batch(
        self, output: SchedulerOutput | Sequence[ScheduledRequest], requests: Mapping[str, Request] | None = None
    ) -> HostBatch:
        """Free released rows, apply the new block ids and flatten the step into a HostBatch (host only); with
        `requests`, the rows that score prompt tokens (prompt logprobs) are listed too."""
        scheduled = self._release_rows(output, requests or {})
        batch = build_host_batch(scheduled, self.block_table, self.block_size, requests or None)
        if self.config.kv_group_of_layer:
            group_slots(batch, scheduled, self.block_table, self.block_size, self.config.num_kv_groups)
        return batch

    def _release_rows(
        self, output: SchedulerOutput | Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> Sequence[ScheduledRequest]:
        if isinstance(output, SchedulerOutput):
            self.block_table.free(output.finished_request_ids)
            self.block_table.free(output.preempted_request_ids)
            return output.scheduled
        rows = self.block_table.rows
        num_new_rows = sum(1 for s in output if s.is_new and s.request_id not in rows)
        if num_new_rows > self.block_table.num_free_rows and requests:
            running = RequestStatus.RUNNING
            self.block_table.free_stale(lambda rid: getattr(requests.get(rid), "status", None) is running)
        return output

    @property
    def max_graphed_verify_tokens(self) -> int | None:
        """The most query tokens (rows and draft tokens) a decode step verifying drafts may have and still replay
        graphs: the full graphs sample at most a bucket's sequence slots (max_num_seqs), the piecewise graphs any
        row of their largest bucket; None when verify steps run eagerly whatever their size (no graphs for them)."""
        if self.full_graphs is not None:
            return min(self.full_graphs.attention.max_seqs, self.full_graphs.buckets[-1])
        if self.piecewise is not None:
            return self.piecewise.buckets[-1]
        return None

    # -- the forward: one dispatcher over the mode's graphs ------------------------------------------------------
    def forward(self, batch: HostBatch, *, invariant_prefill: bool = False) -> ForwardResult:
        """The step's sampled rows: a decode graph replay when one fits the batch; for a step with prompt rows the
        full or else the piecewise graphs when they fit; else eager (decode steps too when the decode graphs are
        set aside, as benches do, or for a batch-invariant prompt forward).

        Rows that score prompt tokens (`batch.prompt_logits_indices`, prompt logprobs) come back as
        `prompt_hidden`: decode graphs and piecewise graphs give every row's hidden states, so those are read
        there; the full graphs end at the sampled rows', so a step with such rows runs eagerly instead."""
        if self.graphs is not None and not invariant_prefill and self.graphs.can_run(batch):
            return self._replay_decode(batch)
        inputs = self.stager.stage(batch, self.block_table)
        if not self.mixed_step_decode_kernel:
            inputs.meta.num_decodes = None  # not counted: one attention kernel for the step
        if self.config.kv_group_of_layer:
            inputs.meta.layer_metas = self._layer_metas(batch, inputs.meta)
        staged_rows = self._fill_placeholders(batch, inputs.input_ids) if batch.placeholder_indices else None
        # A step verifying drafts (k + 1 rows to sample a sequence) runs the full graphs while its rows fit the
        # bucket's sequence slots, else the piecewise graphs (every row's hidden states) or eagerly.
        if not batch.is_decode_only:
            if (self.full_graphs is not None and not batch.prompt_logits_indices
                    and self.full_graphs.can_run(batch.num_tokens, len(batch.logits_indices))):
                step = self.full_graphs.run(inputs.input_ids, inputs.positions, inputs.meta, batch.logits_indices)
                return ForwardResult(step.hidden, step if step.logits is not None else None, staged_rows)
            if self.piecewise is not None and self.piecewise.can_run(batch.num_tokens):
                with switch_interval(self.eager_step_switch_interval_s):
                    hidden = self.piecewise.run(inputs.input_ids, inputs.positions, inputs.meta)
                return ForwardResult(hidden[inputs.logits_indices], None, staged_rows,
                                     self._prompt_hidden(batch, hidden))
        hidden = self._forward_eager(batch, inputs, invariant_prefill)
        if self.keep_last_step:
            self.last_step = (inputs, hidden)
        return ForwardResult(hidden[inputs.logits_indices], None, staged_rows, self._prompt_hidden(batch, hidden))

    def _layer_metas(self, batch: HostBatch, meta: AttentionMetadata) -> list[AttentionMetadata]:
        """KV groups: each layer's metadata, its group's columns of the interleaved block table and its group's
        slot mapping (eager steps only)."""
        num_groups = self.config.num_kv_groups
        groups = [
            replace(meta, block_tables=meta.block_tables[:, g::num_groups].contiguous(), layer_shared={},
                    slot_mapping=torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True))
            for g, slots in enumerate(batch.group_slot_mappings)
        ]
        return [groups[g] for g in self.config.kv_group_of_layer]

    def _prompt_hidden(self, batch: HostBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        """The hidden states of the rows that score prompt tokens, from every row's [T, hidden] (None: no row does)."""
        if not batch.prompt_logits_indices:
            return None
        return hidden[torch.tensor(batch.prompt_logits_indices, device=hidden.device)]

    def _score_prompt_rows(self, hidden: torch.Tensor, rows: Sequence[PromptRows]) -> None:
        """Prompt logprobs of the step's scoring rows, appended to their requests (deepinfer.engine.prompt_logprobs)."""
        with self._linear_mode():
            score_prompt_rows(hidden, rows, self.model.compute_logits, self.max_num_seqs)

    def _replay_decode(self, batch: HostBatch) -> ForwardResult:
        """A decode graph's replay: the sampled rows' hidden states, and its logits tail when every row samples (a
        row that scores a prompt token, a one-token prompt chunk, is read from the graph's hidden states too)."""
        staged: list[torch.Tensor] = []
        step = self.graphs.run(batch, self.block_table, self._graph_fill(batch, staged))
        staged_rows = staged[0] if staged else None
        prompt_hidden = self._prompt_hidden(batch, step.hidden)
        if len(batch.sampled) == batch.num_seqs:
            return ForwardResult(step.hidden[: batch.num_seqs], step if step.logits is not None else None, staged_rows,
                                 prompt_hidden)
        return ForwardResult(step.hidden[torch.tensor(batch.logits_indices, device=self.device)], None, staged_rows,
                             prompt_hidden)

    def _forward_eager(self, batch: HostBatch, inputs: ModelInputs, invariant_prefill: bool) -> torch.Tensor:
        """The model's layers launched one by one: every row's hidden states [T, hidden]."""
        if self.batch_invariant:
            if invariant_prefill:
                inputs.meta.max_query_len = max(inputs.meta.max_query_len, _INVARIANT_MIN_QUERY_LEN)
            else:
                assert batch.is_decode_only, "batch-invariant decode forward got a prefill row"
                inputs.meta.max_seq_len = self.max_model_len
        interval_s = None if batch.is_decode_only else self.eager_step_switch_interval_s  # the eager launches' GIL
        with self._linear_mode(), switch_interval(interval_s):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _fill_placeholders(self, batch: HostBatch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Write the previous step's sampled ids into the batch's placeholder rows of input_ids, on the device.
        The batch's sampled rows go in the same copy (returned, for execute_async's record), unless the step is
        split in two forwards (batch-invariant mode: None)."""
        sampled_rows = () if self.batch_invariant else batch.sampled_rows
        staged = self.sampled_tokens.fill(input_ids, batch.placeholder_indices, batch.placeholder_rows, sampled_rows)
        return staged if sampled_rows else None

    def _graph_fill(self, batch: HostBatch, staged: list[torch.Tensor]) -> Callable[[torch.Tensor, StagedIndices], None]:
        """_fill_placeholders for a graph replay: the index lists came with the graph's inputs (one copy); the
        sampled rows' device indices are appended to `staged` (not in batch-invariant mode)."""

        def fill(input_ids: torch.Tensor, indices: StagedIndices) -> None:
            if batch.placeholder_indices:
                self.sampled_tokens.fill_staged(input_ids, indices.placeholder_indices, indices.placeholder_rows)
            if not self.batch_invariant:
                staged.append(indices.sampled_rows)

        return fill

    def _forward_invariant(
        self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> tuple[ForwardResult, list[ScheduledRequest]]:
        """Decode rows (one output token fed) and all other rows as two forwards: (hidden, sampled) in order."""
        decodes, others = [], []
        for s in scheduled:
            is_decode = s.num_new_tokens == 1 and s.num_computed_tokens >= requests[s.request_id].num_prompt_tokens
            (decodes if is_decode else others).append(s)
        parts: list[tuple[torch.Tensor, list[ScheduledRequest]]] = []
        for part, invariant_prefill in ((decodes, False), (others, True)):
            if part:
                batch = build_host_batch(part, self.block_table, self.block_size, requests)
                result = self.forward(batch, invariant_prefill=invariant_prefill)
                if result.prompt_hidden is not None:
                    self._score_prompt_rows(result.prompt_hidden, batch.prompt_rows)
                if batch.sampled:
                    parts.append((result.hidden, batch.sampled))
        if not parts:
            return ForwardResult(torch.empty(0), None, None), []
        hidden = torch.cat([h for h, _ in parts])
        return ForwardResult(hidden, None, None), [s for _, sampled in parts for s in sampled]

    @torch.inference_mode()
    def prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> ModelInputs:
        """Device inputs of requests given with their whole block tables (is_new), outside the running batch's
        table (for kernel benches and tests)."""
        table = BlockTable(len(scheduled), 1)
        batch = build_host_batch(scheduled, table, self.block_size)
        return self.stager.stage(batch, table)

    def _to_host(self, out: SamplerOutput, chosen: list[Request]) -> dict[str, SampledToken]:
        # One device->host copy per tensor per step for all rows.
        tensors = (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
        return sampled_tokens(chosen, *(None if t is None else t.tolist() for t in tensors))


class ForwardResult(NamedTuple):
    """What `ModelRunner.forward` leaves on the device for the step's sampled rows."""

    hidden: torch.Tensor  # [S, hidden] final hidden states of the sampled rows, in batch order
    #: The graph that ran computed the rows' logits and greedy tokens (its static buffers: read before the next
    #: replay); None: the logits are computed from `hidden`.
    graph_step: GraphStep | None
    #: Async scheduling: the sampled rows' block-table rows, uploaded with the step's inputs (None: not uploaded).
    staged_sampled_rows: torch.Tensor | None
    #: [R, hidden] final hidden states of the rows that score prompt tokens (`HostBatch.prompt_logits_indices`),
    #: in batch order; None when no row does.
    prompt_hidden: torch.Tensor | None = None


class _Sampled(NamedTuple):
    """A step's sampling, launched: the sampler's output and which requests it is for."""

    output: SamplerOutput
    requests: list[Request]
    scheduled: list[ScheduledRequest]
    #: The next step needs these tokens on the host first (penalties, grammars).
    needs_sync: bool
    staged_sampled_rows: torch.Tensor | None


def _built_mode(graphs: object, full_graphs: object, piecewise: object) -> ExecutionMode:
    """The execution mode a runner's captured graphs amount to."""
    if graphs is None:
        return ExecutionMode.EAGER
    if full_graphs is not None:
        return ExecutionMode.FULL
    return ExecutionMode.PIECEWISE if piecewise is not None else ExecutionMode.DECODE


class _TokenLists(Sequence[list[int]]):
    """The sampled requests' prompt or output ids, row i = chosen[i], read only for the rows the sampler asks
    (penalties, min_tokens). A row fed a placeholder has one more output token than the host knows: its count
    matters for min_tokens (penalties never see a placeholder: the engine updates before scheduling after a step
    that used them), so a stand-in id is appended there."""

    __slots__ = ("_chosen", "_output", "_sampled")

    def __init__(self, chosen: list[Request], sampled: list[ScheduledRequest], output: bool) -> None:
        self._chosen, self._sampled, self._output = chosen, sampled, output

    def __len__(self) -> int:
        return len(self._chosen)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        request = self._chosen[i]
        if not self._output:
            return request.prompt_token_ids
        s = self._sampled[i]
        if len(s.token_ids) < s.num_new_tokens and request.sampling_params.min_tokens:
            return [*request.output_token_ids, 0]
        return request.output_token_ids


def _draft_bitmasks(sampled: list[ScheduledRequest], requests: Mapping[str, Request]) -> list[bytes | None]:
    """Each verified row's grammar mask, in the rows' order: a request with a grammar and k drafts (all allowed:
    EngineCore cut them) has the masks after its output and after each draft prefix; one without, None."""
    masks: list[bytes | None] = []
    for s in sampled:
        grammar = requests[s.request_id].grammar
        if grammar is None:
            masks.extend([None] * (s.num_draft_tokens + 1))
        else:
            masks.extend(grammar.bitmasks_along(s.token_ids[len(s.token_ids) - s.num_draft_tokens :]))
    return masks


class _DraftTokenLists(Sequence[list[int]]):
    """The output ids row (request, scheduled, j) of a verify step samples after: the request's output and its
    first j drafts (read only for the rows the sampler asks: penalties, min_tokens)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[tuple[Request, ScheduledRequest, int]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        request, scheduled, j = self._rows[i]
        if j == 0:
            return request.output_token_ids
        return [*request.output_token_ids, *scheduled.token_ids[1 : j + 1]]


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """sys.setswitchinterval(seconds) for the block, then the previous interval (None: leave it alone)."""
    if seconds is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
