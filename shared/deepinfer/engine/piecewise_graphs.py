"""Piecewise CUDA graphs for steps with a prompt in them (prefill and mixed prefill+decode steps).

The eager forward of such a step is host-bound (~440 us of Python and Triton launches a layer of a 1B model, far
more than the GPU needs for a few hundred tokens). Decode-only steps replay whole-model graphs (`cuda_graphs`), but
a step with prompt rows cannot: its attention depends on the ragged layout (query_start_loc, max_query_len, the
kernel and grid chosen from host ints). So, as vLLM's piecewise graphs, everything but attention is captured per
token-count bucket and attention runs eagerly between the pieces, on the step's real rows and metadata:

    piece 0      embed + layer 0 before attention (input norm, QKV, q/k norm, RoPE, K/V write) -> q
    attention    layer 0 paged attention, eager, rows [0, T) -> attn_out (one AttentionPlan a step: the
                 Triton launches recorded on layer 0 are launched again for the others, kernels.triton_ops)
    piece i      layer i-1 after attention (o_proj, post norm, MLP) + layer i before attention -> q, residual
    ...
    piece L      layer L-1 after attention + the final norm -> hidden

A step of T tokens runs the smallest bucket n >= T: its rows T..n-1 are padding, with KV slot -1 (no KV write)
and whatever token ids and positions an earlier step left there (real ones: every row stays finite, and no
real row reads a padding row: only attention mixes rows, and it runs on rows 0..T-1). Buckets: 16, 32, 64, 128, 256, 384, 512, then every 256 up to max_num_batched_tokens (and
it), at most 4096. Up to ~512 tokens a step of a small model costs about the same whatever its size (launch-
bound), so doubling buckets waste nothing that matters; above, compute grows with the tokens, and steps of 256
keep the padding under a third of a step (a seventh at 2048). Past ~2k tokens even a 1B model's layer keeps the
GPU busier than its launches keep the host (~0.4 ms a layer), so the eager launches hide behind the device: a
step above the largest bucket runs eagerly, and buckets stop at 4096 (a 16k budget would otherwise capture 69
buckets x L+1 graphs for little).

Every piece reads and writes only static buffers sized for the largest bucket (input_ids, positions, slot_mapping,
q, attn_out, residual, hidden), so piece i+1 reads what piece i and the eager attention left there. All pieces of
all buckets share one memory pool (the decode graphs' when given): they never run at the same time.

Without CUDA (`use_graphs=False`) "capture" records the pieces as callables and `run` executes them eagerly over
the same static buffers: the padding and buffer logic is tested on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable

import torch

from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.models.layers import Attention, DecoderStack, PreNormBlock

logger = logging.getLogger(__name__)

#: Buckets up to 512 tokens; above, one every _LARGE_BUCKET_STEP tokens up to MAX_BUCKET_TOKENS.
_SMALL_BUCKETS = (16, 32, 64, 128, 256, 384, 512)
_LARGE_BUCKET_STEP = 256
#: The largest bucket whatever the step budget (larger steps are compute-bound: they run eagerly).
MAX_BUCKET_TOKENS = 4096


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts to capture: _SMALL_BUCKETS, then every 256 tokens, ending at the step budget (at most
    MAX_BUCKET_TOKENS)."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    largest = min(max_num_batched_tokens, MAX_BUCKET_TOKENS)
    buckets = [b for b in _SMALL_BUCKETS if b < largest]
    size = _SMALL_BUCKETS[-1] + _LARGE_BUCKET_STEP
    while size < largest:
        buckets.append(size)
        size += _LARGE_BUCKET_STEP
    return [*buckets, largest]


def smallest_bucket(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest of the ascending `buckets` that holds num_tokens rows; None above the largest."""
    return next((b for b in buckets if b >= num_tokens), None)


def supports_piecewise(model: torch.nn.Module) -> bool:
    """True for a single-rank model whose blocks are all pre-norm blocks over the paged `Attention` (Llama,
    Mistral, Qwen2, Qwen3, Gemma 3); DeepSeek (MLA, MoE) and tensor-parallel shards run their prompt steps
    eagerly."""
    stack = getattr(model, "model", None)
    tp = getattr(model, "tp", None)
    if not isinstance(stack, DecoderStack) or (tp is not None and tp.world_size != 1):
        return False
    layers = list(stack.layers)
    return bool(layers) and all(
        isinstance(layer, PreNormBlock) and type(layer.self_attn) is Attention for layer in layers
    )


def capture_piecewise(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    max_num_batched_tokens: int,
    device: torch.device,
    pool: tuple[int, int] | None = None,
) -> PiecewiseGraphRunner | None:
    """The captured piecewise graphs of `model` on CUDA, or None (logged) when it has no piecewise forward."""
    if not supports_piecewise(model):
        logger.info("piecewise CUDA graphs off: %s is not a single-rank Llama-family model; prompt steps run "
                    "eagerly", type(model).__name__)
        return None
    runner = PiecewiseGraphRunner(model, kv_caches, max_num_batched_tokens, device)
    runner.capture(pool)
    return runner


class PiecewiseGraphRunner:
    """Captures a Llama-family model's forward as L+1 pieces per token bucket and runs steps through them."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_batched_tokens: int,
        device: torch.device,
        *,
        use_graphs: bool = True,
        capture_context: contextlib.AbstractContextManager | None = None,
    ) -> None:
        if not supports_piecewise(model):
            raise ValueError(f"{type(model).__name__} has no piecewise forward (see supports_piecewise)")
        self.stack: DecoderStack = model.model
        self.layers: list[PreNormBlock] = list(self.stack.layers)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        self.kv_caches = kv_caches
        self.buckets = token_buckets(max_num_batched_tokens)
        self.use_graphs = use_graphs
        max_tokens = self.buckets[-1]
        embed = self.stack.embed_tokens.weight
        attn = self.layers[0].self_attn
        hidden_size, dtype = embed.shape[1], embed.dtype

        def buffer(*shape: int, dtype: torch.dtype = dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buffer(max_tokens, dtype=torch.int64)
        self.positions = buffer(max_tokens, dtype=torch.int64)
        self.slot_mapping = buffer(max_tokens, dtype=torch.int64, fill=-1)  # -1 = no KV write
        self.q = buffer(max_tokens, attn.num_heads, attn.head_dim)
        self.attn_out = buffer(max_tokens, attn.num_heads, attn.head_dim)
        self.residual = buffer(max_tokens, hidden_size)
        self.hidden = buffer(max_tokens, hidden_size)
        #: bucket -> its pieces, in order (graph replays, or the pieces themselves without graphs)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []
        #: Steps run through the pieces so far.
        self.num_runs = 0
        self._capture_context = capture_context or contextlib.nullcontext()

    @property
    def num_graphs(self) -> int:
        """Piece graphs captured (0 without graphs)."""
        return len(self._graphs)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds num_tokens rows; None above the largest."""
        return smallest_bucket(self.buckets, num_tokens)

    def can_run(self, num_tokens: int) -> bool:
        """True once captured, for a step of 1..largest bucket tokens."""
        return bool(self.pieces) and 0 < num_tokens <= self.buckets[-1]

    def _write_meta(self, n: int) -> AttentionMetadata:
        """What the before-attention halves read of the metadata: the static slot_mapping (the rest is unread)."""
        empty = self.slot_mapping.new_zeros(0, dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=empty, seq_lens=empty, block_tables=empty.view(0, 1), slot_mapping=self.slot_mapping[:n],
            max_query_len=0, max_seq_len=0, query_start_loc_cpu=[0], seq_lens_cpu=[],
        )

    def _piece(self, n: int, index: int, meta: AttentionMetadata) -> None:
        """Piece `index` over the first n rows of the static buffers (see the module docstring)."""
        if index == 0:
            hidden, residual = self.stack.embed(self.input_ids[:n]), None
        else:
            hidden, residual = self.layers[index - 1].after_attention(self.attn_out[:n], self.residual[:n])
        if index == len(self.layers):
            self.hidden[:n].copy_(self.stack.final_norm(hidden, residual))
            return
        layer = self.layers[index]
        q, residual = layer.before_attention(self.positions[:n], hidden, residual, self.kv_caches[index], meta)
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Capture every bucket's pieces, largest bucket first, into `pool` (a new one if None); without graphs,
        record the pieces. Nothing is written to the KV cache (every static slot is -1 meanwhile)."""
        self.slot_mapping.fill_(-1)
        started = time.perf_counter()
        device = self.slot_mapping.device
        free_before = torch.cuda.mem_get_info(device)[0] if self.use_graphs else 0
        if self.use_graphs and pool is None:
            pool = torch.cuda.graph_pool_handle()
        if self.use_graphs:
            logger.info("capturing piecewise CUDA graphs: %d pieces x %d token buckets (%d..%d)",
                        len(self.layers) + 1, len(self.buckets), self.buckets[0], self.buckets[-1])
        with self._capture_context:
            for n in reversed(self.buckets):
                meta = self._write_meta(n)
                pieces = [functools.partial(self._piece, n, i, meta) for i in range(len(self.layers) + 1)]
                self.pieces[n] = self._capture_bucket(pieces, pool) if self.use_graphs else pieces
        if not self.use_graphs:
            return
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "piecewise CUDA graphs: %d piece graphs for %d token buckets (%d..%d) in %.1f s, %.0f MiB",
            self.num_graphs, len(self.buckets), self.buckets[0], self.buckets[-1], time.perf_counter() - started,
            used / (1 << 20),
        )

    def _capture_bucket(self, pieces: list[Callable[[], None]], pool: tuple[int, int]) -> list[Callable[[], None]]:
        stream = torch.cuda.Stream(self.slot_mapping.device)
        # Warm-up off the capture: Triton compiles this bucket's specialisations and cuBLAS picks kernels here.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for piece in pieces:
                piece()
        torch.cuda.current_stream().wait_stream(stream)
        replays = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                piece()
            self._graphs.append(graph)
            replays.append(graph.replay)
        return replays

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T tokens (its device inputs and real metadata, T within the
        largest bucket): pieces replayed over the static buffers padded to the bucket, attention eager between.

        The result is a view of the static hidden buffer: read it before the next run."""
        num_tokens = input_ids.shape[0]
        n = self.bucket(num_tokens)
        assert n is not None and self.pieces, (num_tokens, self.buckets[-1])
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if num_tokens < n:
            self.slot_mapping[num_tokens:n].fill_(-1)  # padding rows write no KV (ids and positions: any real ones)
        pieces = self.pieces[n]
        # the step's attention planned once, launched for each layer into the static buffer (kernels' AttentionPlan)
        plan = self.layers[0].self_attn.ops.attention_plan(self.q[:num_tokens], self.attn_out[:num_tokens], meta)
        pieces[0]()
        for layer, kv_cache, piece in zip(self.layers, self.kv_caches, pieces[1:], strict=True):
            plan(kv_cache, layer.self_attn.scale, layer.self_attn.sliding_window)
            piece()
        self.num_runs += 1
        return self.hidden[:num_tokens]
