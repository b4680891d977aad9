"""The model runner: owns the model, the paged KV tensors and the sampler; turns a SchedulerOutput into tokens.

The scheduler decides *what* runs (ints and block ids); the runner builds the flat ragged batch from that,
runs one forward over it and samples the rows that reached the end of their known tokens:

    scheduled     | req A: prefill chunk 0..5 | req B: decode 1 token | req C: 3 tokens over a cached prefix |
    input_ids     | a0 a1 a2 a3 a4 a5         | b_last                | c16 c17 c18                          |
    positions     | 0  1  2  3  4  5          | 40                    | 16  17  18                           |
    logits rows   |                a5 (if sample)  b_last             |             c18 (if sample)          |

Decode-only steps (every request feeds one token) replay a CUDA graph on CUDA (`cuda_graphs`); every other
step, and every step on the CPU or with enforce_eager, runs the model eagerly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledRequest
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.sampler import Sampler

if TYPE_CHECKING:
    from deepinfer.engine.cuda_graphs import CudaGraphRunner

#: Staging segments start on multiples of this many elements, so every device view is 64-byte aligned.
_ALIGN = 16


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its raw logprob and, when asked, the top logprobs of that position."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ModelInputs:
    """The flat batch of one step, on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: row of the last token of each sampled request
    sampled: list[ScheduledRequest]


@dataclass
class HostBatch:
    """One step's flat batch as host ints, before any device copy (see the module docstring for the layout)."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    slot_mapping: list[int] = field(default_factory=list)  # [T]: block_id * block_size + offset; -1 = padding
    query_lens: list[int] = field(default_factory=list)  # [B]
    seq_lens: list[int] = field(default_factory=list)  # [B]: context incl. this step's tokens
    block_ids: list[list[int]] = field(default_factory=list)  # [B][blocks of that sequence]
    logits_indices: list[int] = field(default_factory=list)  # [S]: row of each sampled request's last token
    sampled: list[ScheduledRequest] = field(default_factory=list)  # [S]

    @property
    def num_tokens(self) -> int:
        """Rows T of the flat batch."""
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences B in the batch."""
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence feeds exactly one token (the shape CUDA graphs are captured for)."""
        return self.num_tokens == self.num_seqs


def block_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1: one Python step per block, not per token."""
    slots: list[int] = []
    position = start
    while position < end:
        offset = position % block_size
        stop = min(end, position - offset + block_size)
        base = block_ids[position // block_size] * block_size
        slots.extend(range(base + offset, base + offset + stop - position))
        position = stop
    return slots


def build_host_batch(scheduled: Sequence[ScheduledRequest], block_size: int) -> HostBatch:
    """Flatten the scheduler's requests into host lists (no tensors, no device)."""
    batch = HostBatch()
    for s in scheduled:
        start, num_new = s.num_computed_tokens, s.num_new_tokens
        batch.input_ids.extend(s.token_ids)
        if num_new == 1:
            batch.positions.append(start)
            batch.slot_mapping.append(s.block_ids[start // block_size] * block_size + start % block_size)
        else:
            batch.positions.extend(range(start, start + num_new))
            batch.slot_mapping.extend(block_slots(s.block_ids, start, start + num_new, block_size))
        batch.query_lens.append(num_new)
        batch.seq_lens.append(start + num_new)
        batch.block_ids.append(s.block_ids)
        if s.sample:
            batch.logits_indices.append(len(batch.input_ids) - 1)
            batch.sampled.append(s)
    return batch


def pad_decode_batch(batch: HostBatch, num_seqs: int) -> HostBatch:
    """A decode-only batch grown to `num_seqs` rows: padding rows feed token 0 at position 0, write no KV
    (slot -1) and attend to one key in the reserved null block 0 (seq_len 1), so every row stays finite."""
    assert batch.is_decode_only and num_seqs >= batch.num_seqs, (batch.num_tokens, batch.num_seqs, num_seqs)
    num_pad = num_seqs - batch.num_seqs
    return HostBatch(
        input_ids=batch.input_ids + [0] * num_pad,
        positions=batch.positions + [0] * num_pad,
        slot_mapping=batch.slot_mapping + [-1] * num_pad,
        query_lens=batch.query_lens + [1] * num_pad,
        seq_lens=batch.seq_lens + [1] * num_pad,
        block_ids=batch.block_ids + [[0]] * num_pad,
        logits_indices=batch.logits_indices,
        sampled=batch.sampled,
    )


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_block_tables(out: np.ndarray, block_ids: Sequence[Sequence[int]]) -> None:
    """Row i of out [B, W] starts with block_ids[i]; entries past a row's blocks are never read by the kernels."""
    for row, ids in zip(out, block_ids, strict=False):
        row[: len(ids)] = ids


class InputStager:
    """Host→device transfer of a step's batch: ints written into one pinned int64 and one pinned int32 buffer,
    then one non_blocking copy each. The buffers are reused, so each write first waits for the previous copy.

    Layout (segments aligned to 16 elements):  int64 | input_ids T | positions T | slot_mapping T | logits S |
                                               int32 | query_start_loc B+1 | seq_lens B | block_tables B x W |
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host64 = self._dev64 = torch.empty(0, dtype=torch.int64)
        self._host32 = self._dev32 = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event() if self._pinned else None

    def _ensure(self, num64: int, num32: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffers
        if num64 > self._host64.numel():
            self._host64, self._dev64 = self._alloc(2 * num64, torch.int64)
        if num32 > self._host32.numel():
            self._host32, self._dev32 = self._alloc(2 * num32, torch.int32)

    def _alloc(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.zeros(numel, dtype=dtype, pin_memory=self._pinned)
        return host, (torch.empty(numel, dtype=dtype, device=self.device) if self._pinned else host)

    def stage(self, batch: HostBatch) -> ModelInputs:
        """Copy the batch to the device and return its tensors (views of the device buffers)."""
        num_tokens, num_seqs, num_sampled = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
        width = max((len(ids) for ids in batch.block_ids), default=0) or 1
        t, s = _aligned(num_tokens), _aligned(num_sampled)
        b1, b = _aligned(num_seqs + 1), _aligned(num_seqs)
        self._ensure(3 * t + s, b1 + b + num_seqs * width)
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        h64[:num_tokens] = batch.input_ids
        h64[t : t + num_tokens] = batch.positions
        h64[2 * t : 2 * t + num_tokens] = batch.slot_mapping
        h64[3 * t : 3 * t + num_sampled] = batch.logits_indices
        query_start_loc = np.cumsum([0, *batch.query_lens])
        h32[: num_seqs + 1] = query_start_loc
        h32[b1 : b1 + num_seqs] = batch.seq_lens
        tables = h32[b1 + b : b1 + b + num_seqs * width].reshape(num_seqs, width)
        tables.fill(0)
        write_block_tables(tables, batch.block_ids)
        d64, d32 = self._dev64, self._dev32
        if self._pinned:
            d64[: 3 * t + s].copy_(self._host64[: 3 * t + s], non_blocking=True)
            n32 = b1 + b + num_seqs * width
            d32[:n32].copy_(self._host32[:n32], non_blocking=True)
            self._copied.record()
        meta = AttentionMetadata(
            query_start_loc=d32[: num_seqs + 1],
            seq_lens=d32[b1 : b1 + num_seqs],
            block_tables=d32[b1 + b : b1 + b + num_seqs * width].view(num_seqs, width),
            slot_mapping=d64[2 * t : 2 * t + num_tokens],
            max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=list(batch.seq_lens),
        )
        return ModelInputs(
            input_ids=d64[:num_tokens],
            positions=d64[t : t + num_tokens],
            meta=meta,
            logits_indices=d64[3 * t : 3 * t + num_sampled],
            sampled=batch.sampled,
        )


class ModelRunner:
    """Runs forward + sample for the scheduler's batch; the only engine part that touches tensors.

    With `max_model_len` given and `use_cuda_graphs` set on a CUDA device, decode-only batches of up to
    `max_num_seqs` requests replay CUDA graphs captured at start (see `deepinfer.engine.cuda_graphs`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        use_cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = sorted(eos_token_ids)  # banned while a request is below its min_tokens
        self.sampler = Sampler()
        self.stager = InputStager(self.device)
        self.graphs: CudaGraphRunner | None = None
        if use_cuda_graphs and self.device.type == "cuda":
            if max_model_len is None:
                raise ValueError("CUDA graphs need max_model_len (the width of the captured block tables)")
            from deepinfer.engine.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(model, kv_caches, block_size, max_num_seqs, max_model_len, self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]
    ) -> dict[str, SampledToken]:
        """Forward the batch and sample one token for each request whose `sample` flag is set."""
        if not scheduled:
            return {}
        batch = build_host_batch(scheduled, self.block_size)
        hidden = self.forward(batch)
        if not batch.sampled:
            return {}
        logits = self.model.compute_logits(hidden)
        chosen = [requests[s.request_id] for s in batch.sampled]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in chosen],
            positions=[s.num_computed_tokens + s.num_new_tokens for s in batch.sampled],
            seeds=[r.sampling_params.seed for r in chosen],
            prompt_token_ids=[r.prompt_token_ids for r in chosen],
            output_token_ids=[r.output_token_ids for r in chosen],
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=self.eos_token_ids,
        )
        return self._to_host(self.sampler(logits, meta), chosen)

    def forward(self, batch: HostBatch) -> torch.Tensor:
        """Final hidden states of the sampled rows [S, hidden]: a graph replay when one fits, else eager."""
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
            num_sampled = len(batch.sampled)
            if num_sampled == batch.num_seqs:
                return hidden[:num_sampled]
            return hidden[torch.tensor(batch.logits_indices, device=self.device)]
        inputs = self.stager.stage(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return hidden[inputs.logits_indices]

    @torch.inference_mode()
    def prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> ModelInputs:
        """Flatten the scheduled requests into input ids, positions, slot mapping and attention metadata."""
        batch = build_host_batch(scheduled, self.block_size)
        staged = self.stager.stage(batch)
        return ModelInputs(staged.input_ids, staged.positions, staged.meta, staged.logits_indices, batch.sampled)

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


def load_dummy_model(
    model_dir, dtype: torch.dtype, device: torch.device | str, ops, seed: int = 0, std: float = 0.02
) -> torch.nn.Module:
    """Build the model of `model_dir/config.json` with random weights on `device` (vLLM's load_format="dummy").

    Weights ~ N(0, std) drawn on the device from `seed` (norm gains 1), so no weight file is read and an 8B
    model is ready in about a second. Same seed, device and dtype give the same weights.
    """
    from deepinfer.loader.hf import load_model_config
    from deepinfer.models.registry import get_model_class

    config = load_model_config(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
    model.rebuild_buffers()
    return model.eval()
