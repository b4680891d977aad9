"""`EngineCore`: one engine's step loop — schedule → execute → update — over a loaded model."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from deepinfer.defaults import default_model_cache_dir
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.async_scheduler import AsyncScheduler
from deepinfer.engine.async_step import PendingSample
from deepinfer.engine.block_pool import KvCacheEvent
from deepinfer.engine.chunk_timer import ChunkTimer
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.draft_controller import DraftController
from deepinfer.engine.drafter import Drafter, make_drafter, propose_drafts
from deepinfer.engine.errors import ContextLengthExceeded
from deepinfer.engine.execution import RunnerConfig
from deepinfer.engine.host_tier import HostTier
from deepinfer.engine.kv_groups import KVGroup, kv_groups
from deepinfer.engine.kv_transfer import block_nbytes
from deepinfer.engine.memory import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KvCachePlan,
    default_host_tier_bytes,
    plan_kv_cache,
    zeroed_kv_cache,
)
from deepinfer.engine.mtp_drafter import MtpDrafter
from deepinfer.engine.outputs import EngineOutput, PromptLogprobs, SampledToken
from deepinfer.engine.piecewise_graphs import MAX_BUCKET_TOKENS
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner, warm_up_query_lens
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.engine.spec_config import SpeculativeConfig
from deepinfer.engine.spec_decode_stats import SpecDecodeStats
from deepinfer.engine.start_progress import StartProgress
from deepinfer.hashing import model_fingerprint
from deepinfer.host_memory import usable_memory
from deepinfer.kernels import compile_watch, get_ops, resolve_accelerator
from deepinfer.kv_rates import MeasuredRates
from deepinfer.loader.dummy import load_dummy_model
from deepinfer.loader.hf import load_generation_config, load_model, load_model_config
from deepinfer.model_store import resolve_model
from deepinfer.models import cpu as cpu_modules
from deepinfer.models.layers import Attention
from deepinfer.sampling.params import SamplingParams, check_vocab
from deepinfer.sampling.seeds import draw_seed
from deepinfer.structured import GrammarMatcher, Grammars
from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Full-length sequences the default CPU KV budget holds (below its byte cap).
CPU_KV_SEQUENCES = 8

#: What a process's CUDA context and library handles take outside torch's allocator (about 0.5 GiB on a H200).
CUDA_CONTEXT_BYTES = 512 << 20

#: Default cap on max_model_len when the model's own limit is larger.
DEFAULT_MAX_MODEL_LEN_CAP = 8192

#: Async scheduling with "auto" drafts: asynchronous steps between two checks whether drafting may pay (the check
#: sorts every running request's k draft positions: ~0.3 ms at 64 requests x 8 in Python, too much for every step).
WORTH_DRAFTING_EVERY = 8

#: How long an engine with only host-tier copies in flight sleeps between polls.
HOST_COPY_POLL_S = 0.0002


class EngineCore:
    """Loads a model, plans its KV cache and runs the continuous-batching loop."""

    def __init__(self, args: EngineArgs, progress: StartProgress | None = None) -> None:
        """Load the model, plan and allocate its KV cache, capture and warm up: seconds to minutes. `progress`, when
        given, is told as each phase of that begins (a worker logs it while the start is slow)."""
        self.args = args
        progress = progress or StartProgress()
        progress.begin("preparing the model")
        cache_dir = args.model_cache_dir or default_model_cache_dir()
        self.model_dir = resolve_model(args.model, cache_dir, progress=args.progress)
        self.model_config = load_model_config(self.model_dir)
        # No tokenizer.json (a bare config for load_format="dummy"): token ids in, token ids out.
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(self.model_dir) if has_tokenizer else None
        self.generation_config = load_generation_config(self.model_dir)
        self.device = args.resolve_device()
        self.bind_thread()
        self.dtype = args.resolve_dtype(self.device)
        self.ops = get_ops(resolve_accelerator(args.accelerator, self.device))
        #: Triton compiles of this process (each one after the start is logged: a step waited for it).
        self.compiles = compile_watch.install()
        progress.begin("loading weights")
        if args.tensor_parallel_size > 1:  # this process is rank 0; spawned workers hold the other shards
            from deepinfer.executor.start import start_tensor_parallel

            model, self.model_config = start_tensor_parallel(args, self.model_dir, self.dtype, self.device, self.ops)
        elif args.load_format == "dummy":
            model = load_dummy_model(self.model_dir, self.dtype, self.device, self.ops, seed=args.dummy_seed)
        else:
            model = load_model(self.model_dir, self.dtype, self.device, self.ops, progress=args.progress)
        if self.device.type == "cpu":  # float32 linears through oneDNN (deepinfer.models.cpu)
            cpu_modules.install(model)
        progress.begin("planning the KV cache")
        self.max_model_len = self._max_model_len()
        #: The execution mode asked for, resolved for this device (the runner's `mode` is what it built).
        self.execution_mode = args.resolve_execution_mode(self.device, self.ops.accelerator)
        #: KV by layer type (EngineArgs.enable_hybrid_kv_cache): the model's KV groups; () = one block table.
        self.kv_groups: tuple[KVGroup, ...] = self._kv_groups(model)
        #: Speculative decoding (EngineArgs.speculative_config): the config in force (`install_drafter` may change
        #: its draft length) and the drafter (None = off). A draft model is built before the KV plan: on CUDA
        #: its weights and KV are then this engine's allocations, which the target's KV budget leaves out.
        self.spec_config: SpeculativeConfig | None = (spec := args.speculative_config)
        self.drafter: Drafter | None = self._make_drafter(model, progress)
        self.kv_plan = self._plan_kv_cache(model)
        if self.tokenizer is not None:
            self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        else:
            eos = self.generation_config.get("eos_token_id")
            eos_ids = (eos if isinstance(eos, list) else [eos]) if eos is not None else []
            self.eos_token_ids = {int(t) for t in eos_ids} | set(self.model_config.eos_token_ids)
        #: Structured output: grammars compiled against this tokenizer (llguidance's view is built on first use).
        self.grammars = Grammars(self.tokenizer) if self.tokenizer is not None else None
        self.fingerprint = model_fingerprint(self.model_dir, args.model_revision)
        #: Async scheduling, resolved for this device (EngineArgs.async_scheduling: None = auto).
        self.async_scheduling = args.resolve_async_scheduling(self.device)
        scheduler_class = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_class(
            EngineConfig(
                num_blocks=self.kv_plan.num_blocks,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching,
                model_fingerprint=self.fingerprint,
                enable_kv_events=args.enable_kv_events,
                admission_window_s=args.admission_window_s,
                kv_groups=self.kv_groups,
                hybrid_checkpoint_tokens=args.hybrid_checkpoint_tokens if self.kv_groups else None,
            )
        )
        #: Speculative decoding's counters.
        self.spec_decode_stats = SpecDecodeStats()
        #: num_speculative_tokens="auto": chooses each step's draft lengths; with an int every draft is verified.
        self.draft_controller = DraftController() if spec is not None and spec.adaptive else None
        self._auto_controller = self.draft_controller  # kept while install_drafter switches to a fixed k and back
        #: (auto) request_id -> first token of a draft the controller did not verify: scored against the step's token.
        self._unverified_drafts: dict[str, int] = {}
        #: Some running request carries draft tokens for the next step (it then runs synchronously).
        self._drafts_scheduled = False
        #: (async scheduling, auto) asynchronous steps left before the next `_worth_drafting` check.
        self._steps_until_worth_check = 1
        #: Time-bounded prompt steps (synchronous scheduling): None = the token budget alone.
        self.chunk_timer = self._make_chunk_timer()
        #: Measured prefill and load rates (deepinfer.kv_rates): load-or-recompute at admission, the heartbeat.
        self.rates = MeasuredRates.for_device(self.device.type, always_load=self.args.kv_load_choice == "load")
        with self.compiles.starting():  # CUDA graph capture and the warm-ups compile the kernels
            self.runner = self._make_runner(model, progress)
            if spec is not None and spec.method == "mtp":  # it reads the runner's steps and drafts after each
                self.drafter = MtpDrafter(model, self.runner, self._allocate_mtp_cache(), self.scheduler.requests)
            progress.begin("allocating the host KV tier")
            #: The host-memory KV tier (None = off).
            self.host_tier = self._make_host_tier()
        progress.finish()
        #: Async scheduling: the step launched last and not updated yet.
        self._in_flight: tuple[SchedulerOutput, PendingSample] | None = None
        #: `SchedulerOutput.kind` of the step the last `step()` call spent its time on (async: the one it waited for),
        #: and its batched tokens.
        self.last_step_kind = "empty"
        self.last_step_tokens = 0
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%d tokens), max_model_len=%d",
            self.model_config.architecture, self.device, self.dtype, self.kv_plan.num_blocks,
            args.block_size, self.kv_plan.num_tokens, self.max_model_len,
        )

    def bind_thread(self) -> None:
        """Make this engine's device the calling thread's current CUDA device (per thread): Triton launches its
        kernels on the current device, so a thread stepping an engine on cuda:1 must call this first."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _make_runner(self, model: torch.nn.Module, progress: StartProgress) -> ModelRunner:
        """The runner over freshly allocated KV caches, with its execution mode's CUDA graphs captured and, on one
        CUDA device, its eager path warmed up (no Triton compile left for a request's step to wait on)."""
        args = self.args
        progress.begin("allocating the KV cache")
        kv_caches = self._allocate_kv_caches()
        progress.begin("capturing CUDA graphs" if self.execution_mode.decode_graphs else "building the runner")
        runner = ModelRunner(model, kv_caches, RunnerConfig(
            block_size=args.block_size,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            eos_token_ids=tuple(self.eos_token_ids),
            max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            execution_mode=self.execution_mode,
            graph_sampling=args.graph_sampling,
            batch_invariant=args.batch_invariant,
            mixed_step_decode_kernel=args.mixed_step_decode_kernel,
            eager_step_switch_interval_s=args.eager_step_switch_interval_s,
            kv_group_of_layer=self._kv_group_of_layer(),
        ))
        if self.ops.accelerator == "cuda" and args.tensor_parallel_size == 1:
            progress.begin("warming up")
            runner.warm_up(warm_up_query_lens(args.max_num_batched_tokens, self.max_model_len))
        return runner

    # -- requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        cache_salt: str = "",
        *,
        output_token_ids: Sequence[int] = (),
        hold_blocks: bool = False,
    ) -> None:
        """Queue a request; ValueError (naming what is wrong) for an empty, too long or out-of-vocab prompt.

        `output_token_ids`: tokens already generated elsewhere (a resumed or re-prefilled request); they are
        recomputed with the prompt. `hold_blocks`: keep the KV blocks referenced after the request finishes
        (a prefill worker's lease; see deepinfer.engine.handoff).
        """
        request = self.new_request(request_id, prompt_token_ids, sampling_params, cache_salt, output_token_ids,
                                   hold_blocks)
        if self.host_tier is not None and self.host_tier.start_load(self.scheduler, request):
            return  # its prefix loads from the host tier (WAITING_FOR_REMOTE_KVS), then it runs
        self.scheduler.add_request(request)

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        cache_salt: str = "",
        output_token_ids: Sequence[int] = (),
        hold_blocks: bool = False,
    ) -> Request:
        """A validated Request for this engine (seed drawn if the params have none), not queued yet."""
        self.check_prompt(prompt_token_ids, sampling_params)
        if len(prompt_token_ids) + len(output_token_ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"output_token_ids: no room left within max_model_len={self.max_model_len}"
            )
        if sampling_params.seed is None:
            sampling_params = sampling_params.clone(seed=draw_seed())
        request = Request(request_id, prompt_token_ids, sampling_params, self.eos_token_ids, cache_salt=cache_salt)
        request.append_output_token_ids(output_token_ids)
        if sampling_params.grammar is not None:
            request.grammar = self._grammar_matcher(sampling_params.grammar, output_token_ids)
        request.hold_blocks = hold_blocks
        if sampling_params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs()
        return request

    def _grammar_matcher(self, grammar: str, output_token_ids: Sequence[int]) -> GrammarMatcher:
        """A matcher for a request's grammar (GrammarError, a ValueError, when it does not compile); tokens
        generated elsewhere (the prefill worker's first) must be ones the grammar allows."""
        if self.grammars is None:
            raise ValueError("grammar: this engine has no tokenizer to build token masks from")
        matcher = self.grammars.matcher(grammar)
        if not matcher.accept_all(list(output_token_ids)):
            raise ValueError(f"output_token_ids: not allowed by the request's grammar ({matcher.error})")
        return matcher

    def check_prompt(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> None:
        """Validate a prompt against this engine's limits without queueing it."""
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        vocab_size = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
        check_vocab(sampling_params, vocab_size)  # the gateway runs the same check before routing

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests now and drop every block reference they hold."""
        self.scheduler.abort_requests(list(request_ids))

    def close(self) -> None:
        """Release what should not wait for the garbage collector: the host tier's pinned memory (a process that
        builds several engines would run out of it) and the tensor-parallel worker processes. The engine cannot
        step after."""
        if self.host_tier is not None:
            self.host_tier.close()
            self.host_tier = None
        for part in (self.runner.model, self.drafter):
            close = getattr(part, "close", None)
            if close is not None:
                close()

    def has_unfinished_requests(self) -> bool:
        """True while a request is running or waiting, or a host-tier copy is in flight (steps poll it)."""
        return self.scheduler.has_unfinished_requests() or (self.host_tier is not None and self.host_tier.busy)

    def take_kv_events(self) -> list[KvCacheEvent]:
        """Prefix-cache events of the device pool, then of the host tier, since the last call."""
        events = self.scheduler.take_kv_events()
        return events + self.host_tier.take_events() if self.host_tier is not None else events

    # -- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One engine step: schedule → execute → update (async scheduling: see `_step_async`). With the host tier:
        completed copies are finished first (loaded requests join), and blocks cached by the step are offloaded."""
        host_tier = self.host_tier
        if host_tier is not None:
            host_tier.poll(self.scheduler)
            if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
                time.sleep(HOST_COPY_POLL_S)  # only copies in flight: poll again soon
                self.last_step_kind = "empty"
                return []
        started_s = time.monotonic()
        if not self.async_scheduling:
            outputs = self._step_sync()
        elif self.drafter is None:
            outputs = self._step_async()
        else:
            outputs = self._step_speculative()
        if self.last_step_kind in ("prefill", "mixed"):  # async: the call's time is mostly its wait for that step
            self.rates.observe_step(self.last_step_tokens, time.monotonic() - started_s, self.args.block_size)
        if host_tier is not None:
            host_tier.offload(flush=not self.scheduler.has_unfinished_requests())
        return outputs

    def _step_sync(self) -> list[EngineOutput]:
        """schedule → execute → update, then (speculative decoding) draft for the next step. A step whose decodes
        carry drafts is verified (`ModelRunner.execute_verify`) and may give a request several tokens."""
        scheduled = self.scheduler.schedule()
        self.last_step_kind, self.last_step_tokens = scheduled.kind, scheduled.num_batched_tokens
        started_s = time.monotonic()
        requests = self.scheduler.requests
        verifies = scheduled.num_draft_tokens > 0
        sampled = self.runner.execute_verify(scheduled, requests) if verifies else self.runner.execute(scheduled, requests)
        if self.draft_controller is not None and scheduled.kind == "decode":
            self.draft_controller.observe_step(len(scheduled.scheduled), scheduled.num_batched_tokens,
                                               time.monotonic() - started_s)
        if self.chunk_timer is not None and scheduled.kind in ("prefill", "mixed"):
            self.chunk_timer.observe(scheduled.num_batched_tokens, time.monotonic() - started_s)
            self.scheduler.max_prefill_tokens = self.chunk_timer.max_prefill_tokens
        if verifies:
            outputs = self._update_verified(scheduled, sampled)
        else:
            outputs = self.scheduler.update_sampled(scheduled, sampled)
        if self.draft_controller is not None:
            self._observe_acceptance(scheduled, sampled, outputs)
        if self.drafter is not None:
            observe_step = getattr(self.drafter, "observe_step", None)  # the MTP drafter runs over every step
            if observe_step is not None:
                observe_step(scheduled)
            self._propose_drafts()
        return outputs

    def _step_speculative(self) -> list[EngineOutput]:
        """Async scheduling with a drafter: asynchronous steps while no request carries a draft; a step whose
        requests carry drafts runs synchronously (`_step_sync`: verify, update, propose), after the step in flight
        is finished. After an asynchronous step the engine finishes it and proposes drafts when drafting may pay
        (`_worth_drafting`), so the next step verifies them (docs/speculative.md, "Async scheduling")."""
        if self._drafts_scheduled:
            outputs = self.finish_in_flight() if self._in_flight is not None else []
            return outputs + self._step_sync()
        waited, started_s = self._in_flight, time.monotonic()
        outputs = self._step_async()
        controller = self.draft_controller
        if controller is not None and waited is not None and waited[0].kind == "decode":
            # A plain step's period with the host work hidden: what a verify step must beat.
            controller.observe_step(len(waited[0].scheduled), waited[0].num_batched_tokens,
                                    time.monotonic() - started_s)
        if self._in_flight is not None and self._worth_drafting():
            outputs += self.finish_in_flight()
            self._propose_drafts()
        return outputs

    def _worth_drafting(self) -> bool:
        """Whether to stop stepping asynchronously and propose drafts: always with a fixed k (every draft is
        verified); with "auto", when the draft controller would verify a draft of the full length from every
        running request (checked every WORTH_DRAFTING_EVERY steps, and never while the decodes fill the graphs'
        verify rows)."""
        controller = self.draft_controller
        if controller is None:
            return True
        running = self.scheduler.running
        max_query_tokens = self.runner.max_graphed_verify_tokens
        if max_query_tokens is not None and len(running) >= max_query_tokens:
            return False
        self._steps_until_worth_check -= 1
        if self._steps_until_worth_check > 0:
            return False
        self._steps_until_worth_check = WORTH_DRAFTING_EVERY
        k = self.spec_config.max_num_draft_tokens
        if getattr(self.drafter, "propose_batch", None) is not None:  # a model drafter: its rounds' cost counted
            return controller.draft_depth([r.request_id for r in running], k, max_query_tokens) > 0
        lengths = controller.draft_lengths({r.request_id: k for r in running}, max_query_tokens)
        return any(lengths.values())

    def _update_verified(
        self, scheduled: SchedulerOutput, verified: dict[str, list[SampledToken]]
    ) -> list[EngineOutput]:
        """Update after a step whose decodes carried draft tokens (speculative decoding, a synchronous step
        always) with every emitted token, count acceptance, and attach the emitted tokens' logprobs."""
        updates = self.scheduler.update(scheduled, {rid: [t.token_id for t in ts] for rid, ts in verified.items()})
        for s in scheduled.scheduled:
            if s.num_draft_tokens and s.request_id in verified:
                self.spec_decode_stats.observe(s.num_draft_tokens, len(verified[s.request_id]) - 1)
        for u in updates:
            tokens = verified.get(u.request_id)
            if u.new_token_ids and tokens is not None:
                u.new_logprobs = tokens[: len(u.new_token_ids)]
        return updates

    def install_drafter(self, drafter: Drafter | None, num_speculative_tokens: int | str | None = None) -> None:
        """Replace the drafter `speculative_config.method` made with one no method names (the GPU bench's oracle,
        deepinfer.testing's ScriptedDrafter), optionally with another draft length (an int k, or "auto"); None
        stops drafting (plain steps) until another is installed. Only on an engine built with a speculative_config
        (its logits budget is that config's), never with more draft tokens than it
        sized for; from the next step's drafts on. The draft controller's measured step costs outlive a change."""
        built = self.args.speculative_config
        if built is None:
            raise ValueError("install_drafter: this engine was built without a speculative_config")
        spec = built if num_speculative_tokens is None else replace(built, num_speculative_tokens=num_speculative_tokens)
        if spec.max_num_draft_tokens > built.max_num_draft_tokens:
            raise ValueError(f"install_drafter: num_speculative_tokens={num_speculative_tokens!r} drafts more than "
                             f"the {built.max_num_draft_tokens} tokens this engine was built for")
        self.spec_config, self.drafter = spec, drafter
        auto = drafter is not None and spec.adaptive
        if auto and self._auto_controller is None:
            self._auto_controller = DraftController()
        self.draft_controller = self._auto_controller if auto else None
        self._unverified_drafts = {}
        self._drafts_scheduled = False
        for request in self.scheduler.running:
            request.draft_token_ids = ()

    def _propose_drafts(self) -> None:
        """Ask the drafter for the next step's drafts of every running request that decodes next (with a grammar,
        each cut before the first token it forbids: never verified); with "auto", keep only the leading tokens
        the draft controller finds worth verifying, rows and drafts within what the runner's graphs verify. With
        "auto", when the decodes alone fill the graphs' rows no draft could be verified: none is proposed (n-gram
        lookups cost 0.1-0.4 ms a request on the dev VM, bench/spec/suffix_cost.py: 256 of them, a step or more).
        A drafter with `propose_batch` (a draft model) is called once for all decodes; with "auto", asked for as many
        tokens as the controller would verify at most."""
        drafter, k = self.drafter, self.spec_config.max_num_draft_tokens
        decodes = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in self.scheduler.running:
            request.draft_token_ids = ()
        self._drafts_scheduled = False
        max_query_tokens = self.runner.max_graphed_verify_tokens
        if self.draft_controller is not None and max_query_tokens is not None and len(decodes) >= max_query_tokens:
            self._unverified_drafts = {}
            return
        model_round = self.draft_controller is not None and getattr(drafter, "propose_batch", None) is not None
        if model_round:
            # A model drafter pays a forward a draft position before the step: as deep as pays, the round's measured
            # seconds counted (DraftController.draft_depth); no round at all when none does (but a probe now and then).
            k = self.draft_controller.draft_depth([r.request_id for r in decodes], k, max_query_tokens)
            if k == 0:
                self._unverified_drafts = {}
                return
        started = time.perf_counter()
        proposed = propose_drafts(drafter, decodes, k)
        if model_round:
            self.draft_controller.observe_draft_round(len(decodes), k, time.perf_counter() - started)
        for request in decodes:
            draft = proposed[request.request_id]
            if draft and request.grammar is not None:  # cut at the first token the grammar forbids
                proposed[request.request_id] = draft[: request.grammar.num_allowed(draft)]
        if self.draft_controller is None:
            for request in decodes:
                request.draft_token_ids = proposed[request.request_id]
            self._drafts_scheduled = any(proposed.values())
            return
        lengths = self.draft_controller.draft_lengths({rid: len(d) for rid, d in proposed.items()}, max_query_tokens)
        self._unverified_drafts = {rid: d[0] for rid, d in proposed.items() if d and lengths[rid] == 0}
        for request in decodes:
            if lengths[request.request_id]:
                request.draft_token_ids = proposed[request.request_id][: lengths[request.request_id]]
        self._drafts_scheduled = any(lengths.values())

    def _observe_acceptance(self, scheduled: SchedulerOutput, sampled: dict, outputs: list[EngineOutput]) -> None:
        """(auto) Feed the draft controller this step's verified drafts, its unverified drafts' first tokens
        against the emitted ones; drop the state of requests gone."""
        controller = self.draft_controller
        for s in scheduled.scheduled:
            if s.num_draft_tokens and s.request_id in sampled:
                controller.observe_draft(s.request_id, s.num_draft_tokens, len(sampled[s.request_id]) - 1)
        for u in outputs:
            draft_token_id = self._unverified_drafts.get(u.request_id)
            if draft_token_id is not None and u.new_token_ids:
                controller.observe_unverified(u.request_id, draft_token_id, u.new_token_ids[0])
        self._unverified_drafts = {}
        controller.retain(self.scheduler.requests)

    def _step_async(self) -> list[EngineOutput]:
        """schedule(N+1) → launch(N+1) → update(N) with N's tokens: the device never waits for the host.

        Returns step N's outputs (nothing on the first call). Once no request is left, the step still in flight
        (whose tokens all belong to finished requests) is drained, so no stale step outlives the batch.
        """
        outputs: list[EngineOutput] = []
        waited = self._in_flight  # this call waits for it: its kind names the call's time (else the launched one)
        if self._in_flight is not None and self._in_flight[1].needs_sync:
            outputs = self.finish_in_flight()  # its tokens feed the next step's penalties on the host
        scheduled = self.scheduler.schedule()
        timed = waited[0] if waited is not None else scheduled
        self.last_step_kind, self.last_step_tokens = timed.kind, timed.num_batched_tokens
        launched = (scheduled, self.runner.execute_async(scheduled, self.scheduler.requests))
        if self._in_flight is not None:
            outputs += self.finish_in_flight()
        self._in_flight = launched
        if not self.scheduler.has_unfinished_requests():
            outputs += self.finish_in_flight()
        return outputs

    def finish_in_flight(self) -> list[EngineOutput]:
        scheduled, pending = self._in_flight
        self._in_flight = None
        return self.scheduler.update_sampled(scheduled, pending.result())

    # -- start-up -----------------------------------------------------------------------------------------------
    def _make_chunk_timer(self) -> ChunkTimer | None:
        """A ChunkTimer when prompt steps are bounded by time (EngineArgs.prefill_chunk_s), sync scheduling only."""
        target_s = self.args.resolve_prefill_chunk_s()
        if target_s is None or self.async_scheduling:
            return None
        timer = ChunkTimer(target_s, self.args.block_size, self.args.max_num_batched_tokens)
        self.scheduler.max_prefill_tokens = timer.max_prefill_tokens
        return timer

    def _make_drafter(self, model: torch.nn.Module, progress: StartProgress) -> Drafter | None:
        """The drafter `speculative_config.method` names (None without a config); a draft model is loaded here,
        into an engine of its own (engine/draft_model.py) with its own KV (`_draft_kv_tokens`); `mtp` is built
        once the runner is (None here; a model without an MTP layer is refused now)."""
        spec = self.spec_config
        if spec is None:
            return None
        if spec.method == "mtp":
            if getattr(model, "num_mtp_layers", 0) < 1:
                raise ValueError(f"speculative_config.method='mtp': {self.model_config.architecture} has no MTP layer "
                                 "(num_nextn_predict_layers in config.json and its tensors in the checkpoint)")
            return None
        if spec.method != "draft_model":
            return make_drafter(spec)
        from deepinfer.engine.draft_model import DraftModelDrafter

        progress.begin("loading the draft model")
        args = self.args
        draft_dir = resolve_model(spec.model, args.model_cache_dir or default_model_cache_dir(), progress=args.progress)
        draft_config = load_model_config(draft_dir)
        block_size = args.block_size
        draft_bytes_per_token = draft_config.kv_bytes_per_token(self.dtype)
        # The target's tokens, then per sequence a draft past them and the partial block a round recomputes.
        num_blocks = (-(-self._draft_kv_tokens(draft_bytes_per_token) // block_size) + 1
                      + args.max_num_seqs * (-(-spec.max_num_draft_tokens // block_size) + 1))
        return DraftModelDrafter.build(
            draft_dir, args, device=self.device, dtype=self.dtype, max_model_len=self.max_model_len,
            kv_cache_bytes=num_blocks * block_size * draft_bytes_per_token,
            target_vocab_size=self.model_config.vocab_size, target_tokenizer=self.tokenizer,
        )

    def _draft_kv_tokens(self, draft_bytes_per_token: int) -> int:
        """Tokens a draft model's KV pool holds beside the target's: as many as the target's pool (a round then
        never waits for draft blocks while the target holds its requests' KV), at most max_num_seqs full-length
        sequences. On CUDA without kv_cache_bytes the two pools split the device budget so both hold that many;
        otherwise the target's budget is its own and the draft's comes on top."""
        target_bytes_per_token = self.model_config.kv_bytes_per_token(self.dtype)
        budget = self.args.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            num_tokens = self._device_kv_budget() // (target_bytes_per_token + draft_bytes_per_token)
        else:
            if budget is None:
                budget = self._cpu_kv_budget(target_bytes_per_token * self.args.block_size)
            num_tokens = budget // target_bytes_per_token
        return max(0, min(num_tokens, self.args.max_num_seqs * self.max_model_len))

    def _max_model_len(self) -> int:
        model_limit = self.model_config.max_position_embeddings
        if self.args.max_model_len is None:
            return min(model_limit, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.args.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={self.args.max_model_len} exceeds the model's max_position_embeddings={model_limit}"
            )
        return self.args.max_model_len

    def _plan_kv_cache(self, model: torch.nn.Module) -> KvCachePlan:
        # The model config says what one token costs: K/V heads, or one latent row per layer for MLA models.
        per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.args.block_size
        if self.spec_config is not None and self.spec_config.method == "mtp":  # the MTP layer's cache: one layer more
            per_block += per_block // self.model_config.num_hidden_layers
        budget = self.args.kv_cache_bytes
        if budget is None:
            budget = self._device_kv_budget() if self.device.type == "cuda" else self._cpu_kv_budget(per_block)
        num_layers = self.model_config.num_hidden_layers
        group_size = len(self.kv_groups[0].layers) if self.kv_groups else num_layers
        return plan_kv_cache(
            budget_bytes=budget,
            bytes_per_block=per_block * group_size // num_layers,  # KV groups: a block (page) holds one group
            block_size=self.args.block_size,
            max_model_len=self.max_model_len,
            what=str(self.device),
            tables_per_sequence=max(1, len(self.kv_groups)),
        )

    def _kv_groups(self, model: torch.nn.Module) -> tuple[KVGroup, ...]:
        """The model's KV groups by attention window when enable_hybrid_kv_cache is set (ValueError for a model
        without sliding-window layers or whose layers are not all paged K/V attention), else ()."""
        if not self.args.enable_hybrid_kv_cache:
            return ()
        windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
        if len(windows) != self.model_config.num_hidden_layers or self.model_config.mla is not None:
            raise ValueError(f"enable_hybrid_kv_cache: {self.model_config.architecture} has layers other than "
                             "paged K/V attention; KV by layer type is for sliding-window models (Gemma 3, Mistral)")
        if all(w is None for w in windows):
            raise ValueError(f"enable_hybrid_kv_cache: {self.model_config.architecture} has no sliding-window "
                             "layer: every layer keeps every block anyway")
        groups = tuple(kv_groups(windows))
        logger.info("KV by layer type: %d groups of %d layers (%s)", len(groups), len(groups[0].layers),
                    ", ".join("global" if g.sliding_window is None else f"window {g.sliding_window}" for g in groups))
        return groups

    def _kv_group_of_layer(self) -> tuple[int, ...]:
        """Each layer's KV group index (() without groups)."""
        group_of = {layer: g for g, group in enumerate(self.kv_groups) for layer in group.layers}
        return tuple(group_of[layer] for layer in range(len(group_of)))

    def _cpu_kv_budget(self, bytes_per_block: int) -> int:
        """Room for CPU_KV_SEQUENCES full-length sequences, capped at DEFAULT_CPU_KV_CACHE_BYTES: a small model does
        not pin a whole GiB of RAM per engine (tests build dozens), a large one gets the cap."""
        blocks_per_sequence = -(-self.max_model_len // self.args.block_size)
        return min(DEFAULT_CPU_KV_CACHE_BYTES, (CPU_KV_SEQUENCES * blocks_per_sequence + 1) * bytes_per_block)

    def _device_kv_budget(self) -> int:
        """GPU bytes left for KV: this engine's utilisation share minus what this process holds, minus activation
        headroom, and never more than is free. Another process on the same GPU (a prefill worker beside a decode
        worker) takes its own share: counting its memory against ours starved whichever worker started second."""
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        tokens = self.args.max_num_batched_tokens
        # Peak activations of one step (MLP or MoE, MLA's expanded K/V); logits are float32 per sampled row.
        activations = tokens * cfg.activation_bytes_per_token(elem)
        logits = 3 * self._max_sampled_rows() * cfg.vocab_size * 4
        mode = self.execution_mode
        if mode.decode_graphs:
            # The CUDA graphs' private pool: one decode step of max_num_seqs rows, split-K partials included.
            num_seqs, num_partitions = self.args.max_num_seqs, -(-self.max_model_len // 512)
            head_dim = cfg.head_dim if cfg.mla is None else cfg.mla.kv_lora_rank
            activations += num_seqs * cfg.activation_bytes_per_token(elem)
            activations += num_seqs * cfg.num_attention_heads * num_partitions * (head_dim + 2) * 4
            if self.args.graph_sampling and not self.args.batch_invariant:
                # The graphs' logits: the static float32 buffer, and in the pool the LM head's output, its float32
                # copy and the raw logprobs of max_num_seqs rows.
                logits += num_seqs * cfg.vocab_size * (elem + 12)
            if mode.prompt_graphs:
                # The piecewise graphs' static buffers and the pieces' intermediates, beside the eager step's.
                activations += min(tokens, MAX_BUCKET_TOKENS) * cfg.activation_bytes_per_token(elem)
        # Live tensors are ours; memory the caching allocator holds but no tensor uses (an earlier engine of this
        # process, freed) is free to the KV cache, which the allocator carves from it or returns to CUDA for.
        allocated = torch.cuda.memory_allocated(self.device)
        cached = torch.cuda.memory_reserved(self.device) - allocated
        headroom = activations + logits + (256 << 20)
        return min(int(total * self.args.gpu_memory_utilization) - allocated - CUDA_CONTEXT_BYTES - headroom,
                   free + cached - headroom)

    def _max_sampled_rows(self) -> int:
        """Most rows one step computes logits for: one per sequence, or with speculative decoding k + 1 per
        sequence (a verify step), never more than the step's tokens."""
        spec, args = self.args.speculative_config, self.args
        if spec is None:
            return args.max_num_seqs
        return max(args.max_num_seqs, min(args.max_num_seqs * (1 + spec.max_num_draft_tokens),
                                          args.max_num_batched_tokens))

    def _make_host_tier(self) -> HostTier | None:
        budget = self.args.kv_host_cache_bytes
        if self.args.tensor_parallel_size > 1:  # rank 0's cache holds only its share of the KV heads
            if budget:
                logger.info("host KV tier off: tensor_parallel_size > 1")
            return None
        if budget is None:  # unset: on for one CUDA device, sized from the host's memory (not with KV groups yet)
            on = self.device.type == "cuda" and not self.kv_groups
            budget = default_host_tier_bytes(usable_memory()) if on else 0
        if budget == 0 or not self.args.enable_prefix_caching:
            return None
        kv_caches = self.runner.kv_caches
        num_slots = budget // block_nbytes(kv_caches)  # a slot is one block of every layer
        if num_slots == 0:
            logger.warning("host KV tier off: kv_host_cache_bytes=%d holds no block", budget)
            return None
        tier = HostTier(kv_caches, num_slots, self.scheduler.block_pool, ops=self.ops, rates=self.rates)
        # A preempted request resuming looks here too, as admission does (at the head of the queue, in schedule()).
        self.scheduler.resume_loader = functools.partial(tier.start_load, self.scheduler)
        logger.info("host KV tier: %d blocks (%.2f GiB)", num_slots, tier.capacity_bytes / (1 << 30))
        return tier

    def _allocate_mtp_cache(self) -> torch.Tensor:
        """The MTP layer's latent cache: one main layer's shape, under the same block ids (engine/mtp_drafter.py)."""
        shape = self.model_config.kv_cache_shape(self.kv_plan.num_blocks, self.args.block_size)
        return zeroed_kv_cache(shape, self.dtype, self.device)

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        """One cache per layer; with KV groups one per position in a group, shared by the groups' layers at that
        position (a page is one block of one group's layers: engine/kv_groups.py)."""
        cfg = self.model_config
        shape = cfg.kv_cache_shape(self.kv_plan.num_blocks, self.args.block_size)
        if not self.kv_groups:
            return [zeroed_kv_cache(shape, self.dtype, self.device) for _ in range(cfg.num_hidden_layers)]
        slots = [zeroed_kv_cache(shape, self.dtype, self.device) for _ in self.kv_groups[0].layers]
        position = {layer: j for group in self.kv_groups for j, layer in enumerate(group.layers)}
        return [slots[position[layer]] for layer in range(cfg.num_hidden_layers)]

