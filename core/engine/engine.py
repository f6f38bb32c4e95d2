"""The engine: one ``step()`` = schedule -> execute (run the model) -> postprocess (sample, verify drafts, commit
tokens, finish sequences, draft the next step's guesses).

Offline generation (``infer.LLM``, ``infer run``) and serving (``infer serve``) both drive ``Engine.step()``.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from infer.config import ConfigError
from infer.distributed import SingleProcess
from infer.drafter import Drafter, DrafterContext
from infer.engine.detokenizer import Detokenizer
from infer.engine.sampler import Sampler, SampleRequest
from infer.engine.spec_decode import SpeculativeDecoder
from infer.engine.tensor_parallel import TensorParallel
from infer.execution.calibration import signature
from infer.execution.kv_pool import free_device_memory, plan_kv_pool
from infer.execution.memory import cached_peak_bytes, measure_peak_bytes
from infer.execution.paths import build_model_stack, load_for_stack
from infer.execution.runner import ModelRunner
from infer.guide import GuideError, TokenizerInfo, constrain_logits
from infer.kv_cache_manager import KVCacheManager
from infer.model.quantization import model_weight_bytes
from infer.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, StepOutput, StepStats
from infer.plugin_api import build_drafter
from infer.prompts import ChatPrompt
from infer.sampling import add_logit_bias
from infer.sampling_params import SamplingParams
from infer.scheduler import SchedulerView, StepPlan, StepShape
from infer.sequence import Sequence, SequenceQueues, SequenceStatus

logger = logging.getLogger("infer")


class RequestError(ValueError):
    """A request was refused (over-long or empty prompt, bad sampling value); the engine keeps serving others."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def request_metrics(request: Request) -> RequestMetrics:
    """A request's timings and counts so far (``RequestOutput.metrics``; the server's latency histograms read the
    same)."""
    seqs, lead = request.seqs, request.seqs[0]
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
        finish_time=max((s.finish_time for s in seqs if s.finish_time), default=None),
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_prompt_tokens=lead.num_cached_prompt_tokens,
        num_output_tokens=sum(s.num_output_tokens for s in seqs),
        num_preemptions=sum(s.num_preemptions for s in seqs),
        num_verify_passes=sum(s.num_verify_passes for s in seqs),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in seqs),
        token_times=list(lead.token_times),
        priority=request.params.priority,
        tenant=request.params.tenant,
        ttft_slo_s=request.params.ttft_slo_s,
    )


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    aborted: bool = False
    outputs_cache: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class Engine:
    """Loads the model and the configured plugins, sizes the KV pool, and runs steps."""

    def __init__(self, config, registry=None):
        from infer.model.loader import resolve_dtype
        from infer.registry import get_registry

        self.config = config
        self.registry = registry or get_registry(config.plugins.load)
        self.device = torch.device(config.model.resolved_device())
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        torch.manual_seed(config.model.seed)
        self._rng = random.Random(config.model.seed)
        # Sharded over ranks (``infer.distributed``): the others start loading their shards while this one loads.
        self.ranks = self._launch_tensor_parallel() if config.parallel.tensor_parallel_size > 1 else SingleProcess()
        try:
            # Each layer sharded (tensor parallelism) and packed as soon as it is read.
            shard_layer = self.ranks.shard_layer if self.ranks.sharded else None
            self._build(config, load_for_stack(config, self.registry, self.device, self.dtype, shard_layer))
        except BaseException:
            self.close()
            raise
        logger.info(self.pool_plan.describe())
        self.registry.hook.engine_started(stats=self.stats, config=self.config, engine=self)

    def _build(self, config, loaded) -> None:
        stack = build_model_stack(
            self.registry,
            config,
            loaded.model,
            self.device,
            self.dtype,
            shard=self.ranks.shard if self.ranks.sharded else None,
        )
        self.model, self.quantization, self.executor = stack.model, stack.quantization, stack.executor
        self.attention_name, self.attention = stack.attention_name, stack.attention
        self.calibration = stack.calibration
        self.reuses_freed_memory = stack.reuses_freed_memory
        self.vocab_size = self.model.vocab_size
        self.tokenizer = loaded.tokenizer
        self.max_token_bytes = max(len(token.encode()) for token in self.tokenizer.get_vocab())
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.model_name = loaded.name
        self.max_model_len = config.model.max_model_len
        self._check_max_model_len(loaded)
        self.ranks.connect()
        # Before sizing the pool: a drafter with its own KV takes its share of the budget.
        drafter = build_drafter(self._plugin("drafter"), config.drafter, self.drafter_context())
        self.pool_plan = self._size_pool(drafter)
        self.executor.counts.clear()  # the pool-sizing pass above is no step
        self.ranks.reset_counters()
        self.ranks.send_pool(self.pool_plan.num_blocks)
        self.kv_cache = self.attention.allocate_kv_cache(self.model.num_layers, self.pool_plan.num_blocks)
        if drafter.kv_bytes_per_token():
            drafter.allocate_kv_cache(self.pool_plan.num_blocks)
        self.guide = self._plugin("guide")(
            TokenizerInfo(self.tokenizer, self.model.vocab_size, tuple(sorted(self.eos_token_ids))), config.guide
        )
        # Tokens a grammar forces become drafts where the drafter proposed none (``SpeculativeDecoder``).
        self._init_scheduling(
            self.pool_plan.num_blocks, drafter, jump_forward=config.guide.jump_forward and config.guide.name != "none"
        )
        self.runner = ModelRunner(
            self.model,
            self.attention,
            self.kv_cache,
            self.device,
            self.executor,
            self.pool_plan.num_blocks,
            f"allocator {config.allocator.name!r} or prefix cache {config.prefix_cache.name!r}",
            self.ranks,
        )
        if self.attention.draft_trees and not self.ranks.sharded:  # other ranks' pools would not follow a move
            self.speculation.move_kv = self.runner.move_kv
        self.sampler = Sampler(self.executor.kernels)

    def _launch_tensor_parallel(self) -> TensorParallel:
        """Start the other ranks, once the drafter and the model's heads are known to allow the split."""
        from transformers import AutoConfig

        from infer.model.loader import hf_model_dir

        size = self.config.parallel.tensor_parallel_size
        if not self._plugin("drafter").works_with_tensor_parallel:
            raise ValueError(
                f"drafter {self.config.drafter.name!r} cannot run with parallel.tensor_parallel_size="
                f"{size}: it may run the target model on rank 0 alone, whose layers are sharded; use "
                f"drafter ngram or none (a drafter declares works_with_tensor_parallel = True when it "
                f"never runs engine.model)"
            )
        return TensorParallel.launch(self.config, AutoConfig.from_pretrained(hf_model_dir(self.config.model.path)))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; nothing to do in one process). Steps fail after."""
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.close()

    # -- construction ------------------------------------------------------------------------------------------
    def _plugin(self, kind: str):
        return self.registry.load(kind, getattr(self.config, kind).name)

    def drafter_context(self) -> DrafterContext:
        """What a drafter may use of this engine (``infer.drafter.DrafterContext``): its parts and callables bound
        to this target."""
        from infer.execution.calibration import calibrate_rows
        from infer.model.loader import load_model
        from infer.model.quantization import projection, quantize_linears

        model, attention, executor, quantization = self.model, self.attention, self.executor, self.quantization
        recalibrate = self.config.execution.recalibrate

        def quantize(module, mode=None):
            head = getattr(module, "lm_head", None)
            shared = frozenset({id(head.weight)}) if head is not None else frozenset()
            return quantize_linears(module, mode or quantization, shared)

        def load(path):
            loaded = load_model(path, self.dtype, self.device, registry=self.registry)
            return loaded.model, loaded.tokenizer

        return DrafterContext(
            target=model,
            model_name=self.model_name,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            device=self.device,
            block_size=attention.block_size,
            seed=self.config.model.seed,
            quantization=quantization,
            attention=attention,
            executor=executor,
            free_verify_rows=lambda: calibrate_rows(
                model, attention, executor, quantization, self.device, self.dtype, recalibrate
            ),
            quantize=quantize,
            projection=lambda weight, mode=None: projection(weight, mode or quantization),
            load_model=load,
        )

    def _init_scheduling(self, num_blocks: int, drafter: Drafter, jump_forward: bool = False) -> None:
        """The allocator, prefix cache and scheduler plugins over a pool of ``num_blocks``, the queues, the counters
        and speculative decoding with ``drafter``: everything a step's bookkeeping touches (``infer simulate``'s
        engine builds the same)."""
        config = self.config
        self.allocator = self._plugin("allocator")(
            num_blocks, config.cache.block_size, self.max_model_len, config.allocator
        )
        self.prefix_cache = self._plugin("prefix_cache")(self.allocator, config.cache.block_size, config.prefix_cache)
        self.scheduler = self._plugin("scheduler")(config.scheduler)
        self.kv = KVCacheManager(self.allocator, self.prefix_cache, self.max_model_len)
        self.queues = SequenceQueues()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.speculation = SpeculativeDecoder(
            drafter, config.drafter, self.kv, self.max_model_len, self.stats, jump_forward
        )
        # A list here collects every step's (shape, duration) (``infer simulate --fit`` reads it); None: nothing.
        self.step_log: list[tuple[StepShape, float]] | None = None
        self._request_counter = 0

    @property
    def waiting(self) -> deque[Sequence]:
        return self.queues.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.queues.running

    @property
    def drafter(self) -> Drafter:
        return self.speculation.drafter

    def describe_execution(self) -> str:
        """One line for ``infer run``: the dtypes, the attention backend, the kernels and the execution paths in use."""
        cpu = self.executor.kernels
        tiles = f", {cpu.tiles}" if cpu is not None and cpu.tiles and self.quantization == "bf16" else ""
        kernels = f"infer's CPU kernels ({cpu.simd}{tiles})" if cpu is not None else "torch's ops"
        weights = "" if self.quantization == "none" else f", {self.quantization} weights"
        kinds = {getattr(getattr(module, "blocks", None), "kind", None) for module in self.model.modules()}
        weights += " (MXFP4 experts)" if "mxfp4" in kinds else ""  # a checkpoint's, kept under auto
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        kv = "" if self.attention.kv_dtype == self.dtype else f", {name(self.attention.kv_dtype)} KV"
        dtypes = f"{name(self.dtype)}{weights}{kv}"
        paths = " > ".join(path.name for path in self.executor.paths)
        chosen = f"{self.attention_name} (auto)" if self.config.attention.name == "auto" else self.attention_name
        how = self.attention.describe()
        chosen += f", {how}" if how else ""
        parallel = f"; {self.ranks.describe()}" if self.ranks.sharded else ""
        fused = (
            self.calibration.describe()
            if self.calibration is not None
            else f"fused up to {self.executor.fused_max_tokens} tokens"
        )
        gemm = "" if self.executor.gemm is None else f"; {self.executor.gemm.describe()}"
        heap = "; malloc keeps freed memory" if self.reuses_freed_memory else ""
        drafts = self.drafter.describe()
        drafts = f"; {drafts}" if drafts else ""
        return (
            f"{dtypes}; attention {chosen}; {kernels}; execution paths {paths} ({fused}){gemm}{heap}{parallel}{drafts}"
        )

    def _check_max_model_len(self, loaded) -> None:
        limit = getattr(loaded.hf_config, "max_position_embeddings", None)
        if limit is not None and self.max_model_len > limit:  # a config mistake: one line from the CLI
            raise ConfigError(
                [
                    f"model.max_model_len: {self.max_model_len} exceeds the model's limit "
                    f"(max_position_embeddings={limit}); lower model.max_model_len"
                ]
            )

    def _size_pool(self, drafter: Drafter):
        """The pool's blocks from this host's budget. Sharded, every rank's pool has as many blocks (one block
        table addresses them all) over its own KV heads, and the budget covers the ranks on this host: their KV bytes
        per token, weights and activations (rank 0's times the ranks, an estimate) together."""
        cache, model = self.config.cache, self.model
        rank_bytes = self.ranks.kv_bytes_per_token(self.attention, model.num_layers)
        local_ranks = self.ranks.local_ranks
        bytes_per_token = sum(rank_bytes[:local_ranks]) + drafter.kv_bytes_per_token()
        weight_bytes = model_weight_bytes(model) * local_ranks
        activation_bytes = 0 if cache.num_blocks is not None else self._activation_peak() * local_ranks
        return plan_kv_pool(
            budget_bytes=cache.budget_bytes(
                free_device_memory(self.device) + weight_bytes, weight_bytes + activation_bytes
            ),
            weight_bytes=weight_bytes,
            activation_bytes=activation_bytes,
            bytes_per_token=bytes_per_token,
            block_size=cache.block_size,
            max_model_len=self.max_model_len,
            num_blocks_override=cache.num_blocks,
            rank_bytes_per_token=tuple(rank_bytes) if self.ranks.sharded else (),
        )

    def _activation_peak(self) -> int:
        """``_profile_activations``, measured once per machine, model and settings on a CPU: later starts read it
        from the calibration folder (9 s of a start of the Qwen3-1.7B shape; ``execution.recalibrate`` measures
        again). A sharded model, or one on another device, measures it at every start."""
        if self.ranks.sharded or self.device.type != "cpu":
            return self._profile_activations()
        config = self.config
        build = self.executor.kernels.path.name if self.executor.kernels is not None else ""
        key = [
            "activation peak",
            signature(self.model, self.quantization, self.dtype, build)[1],
            self.attention_name,
            config.model.compile,
            config.attention.model_dump(mode="json"),
            config.execution.model_dump(mode="json", exclude={"recalibrate"}),
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            config.cache.block_size,
        ]
        return cached_peak_bytes(key, self._profile_activations, config.execution.recalibrate)

    def _profile_activations(self) -> int:
        """Peak memory of one worst-case step (a full token budget split over max_num_seqs sequences, plus their
        logits), measured on a scratch pool just large enough for it."""
        budget = self.config.scheduler.max_num_batched_tokens
        num_seqs = max(1, min(self.config.scheduler.max_num_seqs, budget))
        block_size = self.config.cache.block_size
        lengths = [budget // num_seqs + (1 if i < budget % num_seqs else 0) for i in range(num_seqs)]
        lengths = [n for n in lengths if n > 0]
        num_blocks = sum(-(-n // block_size) for n in lengths) + 1
        scratch = self.attention.allocate_kv_cache(self.model.num_layers, num_blocks)
        scratch.zero_()  # resident before the measurement: the step's K/V writes are not activations
        self.ranks.send_pool(num_blocks)
        runner = ModelRunner(self.model, self.attention, scratch, self.device, self.executor, ranks=self.ranks)
        seqs, next_block = [], 1
        for i, n in enumerate(lengths):
            seq = Sequence(seq_id=f"profile-{i}", prompt_token_ids=[0] * n, params=SamplingParams())
            blocks = -(-n // block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            seqs.append((seq, n))
        peak = measure_peak_bytes(lambda: runner.execute(seqs), self.device)
        del scratch
        return peak

    # -- requests ----------------------------------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt is a string, a list of token ids, or chat messages (a list of ``{"role", "content"}``, or a
        ``ChatPrompt`` with tools for the template). Text too
        long to fit ``max_model_len`` whatever its tokens is refused before it is tokenized."""
        if isinstance(prompt, str):
            self._check_text_length(prompt)
            return prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = ChatPrompt(prompt)
        if isinstance(prompt, ChatPrompt):
            text = self.tokenizer.apply_chat_template(
                prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=False
            )
            self._check_text_length(text)
            return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # (bool is not int here)
            return None, list(prompt)
        raise RequestError("prompt must be a string, a list of token ids, or a list of chat messages", "prompt")

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raises ``RequestError`` (and queues nothing) when it cannot be served."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{self._next_request_number()}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        text, token_ids = self.tokenize(prompt)
        self._validate_prompt(request_id, token_ids)
        params = self._fit_max_tokens(request_id, params, len(token_ids))
        self._check_logit_bias(request_id, params)
        compiled = self.compile_constraint(params, request_id)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        arrival_time = arrival_time if arrival_time is not None else self.clock()
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=f"{request_id}/{index}",
                prompt_token_ids=list(token_ids),
                params=params,
                request_id=request_id,
                sample_index=index,
                seed=seed + index,
                arrival_time=arrival_time,
                fork_of=seqs[0] if seqs else None,
            )
            if compiled is not None:
                seq.matcher = self.guide.matcher(compiled)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, text, list(token_ids), params, seqs, arrival_time)
        self.queues.add(seqs)
        self.stats.num_prompt_tokens += len(token_ids) * params.n
        return request_id

    def compile_constraint(self, params: SamplingParams, request_id: str = "") -> object | None:
        """The guide's compiled form of ``params.constraint`` (None without one), cached by the guide; raises
        ``RequestError`` naming the field when the guide cannot serve it. Thread-safe: a server may call it off the
        engine thread first, so the engine finds it compiled."""
        if params.constraint is None:
            return None
        try:
            return self.guide.compile(params.constraint)
        except GuideError as error:
            raise RequestError(f"request {request_id}: {error}" if request_id else str(error), error.field) from None

    def _check_text_length(self, text: str) -> None:
        """Refuse text that must exceed ``max_model_len`` tokens: a token stands for at most ``max_token_bytes``
        bytes of text (the longest vocabulary entry's UTF-8 length, which is never shorter than the text it encodes;
        doubled for normalizers that shrink text). Tokenizing a 10 MiB prompt held the engine for seconds."""
        limit = 2 * self.max_model_len * self.max_token_bytes
        if len(text) > limit // 4 and len(text.encode()) > limit:
            raise RequestError(
                f"the prompt is {len(text.encode())} bytes of text, more than any "
                f"{self.max_model_len} tokens (model.max_model_len) can hold; shorten it",
                "prompt",
            )

    def _next_request_number(self) -> int:
        self._request_counter += 1
        return self._request_counter

    def _validate_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError(f"request {request_id}: the prompt is empty", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"request {request_id}: the prompt has {len(token_ids)} tokens but model.max_model_len is "
                f"{self.max_model_len} (room is needed for at least one output token); shorten the prompt",
                "prompt",
            )
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestError(f"request {request_id}: token ids must be in [0, {vocab})", "prompt")

    def _check_logit_bias(self, request_id: str, params: SamplingParams) -> None:
        outside = [token for token in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise RequestError(
                f"request {request_id}: logit_bias names token {outside[0]}, outside the vocabulary "
                f"(ids 0..{self.vocab_size - 1})",
                "logit_bias",
            )

    def _fit_max_tokens(self, request_id: str, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """``max_tokens`` None becomes the room left in the context; a number past it is refused (OpenAI's policy:
        a silent cut would hand the client fewer tokens than it asked for with no way to tell)."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise RequestError(
                f"request {request_id}: the prompt has {num_prompt_tokens} tokens and max_tokens is "
                f"{params.max_tokens}, {num_prompt_tokens + params.max_tokens} in all, but model.max_model_len is "
                f"{self.max_model_len}; ask for at most {room} tokens, or send max_tokens null to generate until the "
                f"context ends",
                "max_tokens",
            )
        return params

    def abort(self, request_id: str) -> None:
        """Stop a request now (client gone); its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.aborted = True
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_stats(self) -> None:
        """Start the totals (``stats``, the execution paths' step counts, the ranks' collective counters) again from
        zero, as after the engine started; what the prefix cache holds stays."""
        self.stats.reset()
        self.executor.counts.clear()
        self.ranks.reset_counters()

    def check_idle(self) -> None:
        """Integrity check when no request is left: every block is free or held by the prefix cache alone."""
        if self.has_unfinished():
            raise AssertionError("check_idle called while requests are unfinished")
        held_by_cache = self.prefix_cache.num_cached_blocks
        if self.allocator.num_free + held_by_cache != self.allocator.capacity:
            raise AssertionError(
                f"block leak: {self.allocator.num_free} free + {held_by_cache} cached != "
                f"{self.allocator.capacity} capacity"
            )

    @property
    def num_blocks_used(self) -> int:
        return self.allocator.capacity - self.allocator.num_free

    # -- the step ----------------------------------------------------------------------------------------------
    def clock(self) -> float:
        """The engine's time in seconds: arrivals, token times, step durations and ``SchedulerView.now`` are on it
        (``time.perf_counter``; simulated time under ``infer simulate``)."""
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        """Wait on the engine's clock (a replay waiting for the next arrival)."""
        time.sleep(max(0.0, seconds))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it."""
        start = self.clock()
        plan = self._schedule(start)
        output = self._execute(plan) if plan else None
        return self._postprocess(plan, output, start)

    def _schedule(self, now: float) -> StepPlan:
        """The scheduler's plan for this step; preempted sequences are back in waiting, their drafts dropped."""
        view = SchedulerView(
            self.queues.waiting,
            self.queues.running,
            self.kv,
            self.config.scheduler.max_num_seqs,
            self.config.scheduler.max_num_batched_tokens,
            self.max_model_len,
            now=now,
        )
        plan = self.scheduler.schedule(view)
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        if self._wants_shapes():
            plan.shape()  # computed now, from the sequences as the step finds them
        if plan.preempted:
            self.stats.num_preemptions += len(plan.preempted)
            if self.speculation.active:
                self.speculation.release(plan.preempted)
        return plan

    def _execute(self, plan: StepPlan) -> StepOutput:
        """Run the plan through the model (``infer simulate`` prices ``plan.shape()`` instead)."""
        return self.runner.execute(plan.scheduled, want_hidden=self.drafter.needs_hidden_states)

    def _postprocess(self, plan: StepPlan, output: StepOutput | None, start: float) -> list[RequestOutput]:
        """Commit what the step computed (or refuse the head request when nothing could run), draft for the next
        step, record the step; the outputs of the requests that finished."""
        if output is not None:
            finished = self._commit_step(plan, output)
            if self.speculation.active:
                self.speculation.after_step(output, self.queues.running)
        elif self.waiting and not self.running:
            finished = self._refuse_unschedulable()
        else:
            finished = []
        self._record_step(plan, self.clock() - start)
        return [self._request_output(request) for request in finished]

    def _wants_shapes(self) -> bool:
        """Whether anyone reads the steps' ``StepShape`` (the step log, ``step_finished`` observers): it is computed
        only then (``infer simulate``'s cost model always reads it)."""
        return self.step_log is not None or bool(self.registry.hook.step_finished.get_hookimpls())

    def _commit_step(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Advance the computed counts, sample every logits row, commit each sequence's tokens, offer newly filled
        blocks to the prefix cache; the requests that finished."""
        for seq, num_new in plan.scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.num_prefill_tokens_computed += min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
        self._record_prompt_logprobs(output)
        tokens, logprobs = self._sample(output)
        now = self.clock()
        speculating = self.speculation.active
        finished: list[Request] = []
        for row in output.rows:
            span = slice(row.start, row.start + row.count)
            self._commit(row.seq, tokens[span], logprobs[span], now, speculating)
            if row.seq.is_finished and self.requests[row.seq.request_id].finished:
                finished.append(self.requests[row.seq.request_id])
        for seq in self.queues.running:
            self.kv.offer(seq)
        return finished

    def _sample(self, output: StepOutput) -> tuple[list[int], list[dict | None]]:
        """One token per logits row (grammar masks, ``min_tokens`` bans and rejection sampling of sampled drafts
        applied), with its logprobs where asked for."""
        requests = [
            SampleRequest(
                row.seq.params,
                row.first_position + j,
                row.seq.seed,
                self._banned_tokens(row.seq, row.first_position + j),
            )
            for row in output.rows
            for j in range(row.count)
        ]
        logits = self._constrained_logits(output, self._biased_logits(output))
        tokens = self.sampler.sample(logits, requests)
        if self.speculation.active:
            self.speculation.verify_sampled(logits, output.rows, requests, tokens)
        return tokens, self.sampler.logprobs(output.logits, tokens, [r.params.logprobs for r in requests])

    @staticmethod
    def _biased_logits(output: StepOutput) -> torch.Tensor:
        """The step's logits with each request's ``logit_bias`` added to its rows (a copy: logprobs come from the
        raw logits); every row a sampled or verified token comes from sees it, drafts' included."""
        rows = [row for row in output.rows if row.seq.params.logit_bias]
        if not rows:
            return output.logits
        logits = output.logits.clone()
        for row in rows:
            add_logit_bias(logits[row.start : row.start + row.count], row.seq.params.logit_bias)
        return logits

    def _constrained_logits(self, output: StepOutput, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (the step's, maybe biased) with structured-output rows masked by their grammar
        (``infer.guide``); in place unless they are the raw logits and a constrained row asks for logprobs, which
        come from the raw logits."""
        rows = [row for row in output.rows if row.seq.matcher is not None]
        if not rows:
            return logits
        keep_raw = logits is output.logits and any(row.seq.params.logprobs is not None for row in rows)
        return constrain_logits(
            logits,
            [(row.seq.matcher, row.start, row.seq.draft_token_ids[: row.count - 1]) for row in rows],
            copy=keep_raw,
            kernels=self.executor.kernels,
        )

    def _record_prompt_logprobs(self, output: StepOutput) -> None:
        """Prompt logprobs of the prompt positions this step computed, for the requests that asked for them; a
        position computed again (after a preemption) keeps its first entry."""
        if not output.prompt_rows:
            return
        log_probs = torch.log_softmax(output.prompt_logits, dim=-1)
        for row in output.prompt_rows:
            seq = row.seq
            num_top = seq.params.prompt_logprobs
            for j in range(row.count):
                position = row.first_position + j
                if position != len(seq.prompt_logprobs) + 1:
                    continue
                token = seq.prompt_token_ids[position]
                entry = {"token_id": token, "logprob": float(log_probs[row.start + j, token]), "top": []}
                if num_top:
                    values, indices = torch.topk(log_probs[row.start + j], num_top)
                    entry["top"] = [(int(i), float(v)) for v, i in zip(values, indices)]
                seq.prompt_logprobs.append(entry)

    def _banned_tokens(self, seq: Sequence, position: int) -> tuple[int, ...]:
        if position - seq.num_prompt_tokens >= seq.params.min_tokens:
            return ()
        return tuple(self.eos_token_ids) + tuple(seq.params.stop_token_ids)

    def _commit(self, seq: Sequence, sampled: list[int], logprobs: list, now: float, speculating: bool) -> None:
        """Commit the tokens of ``seq``'s logits rows: with drafts, those ``SpeculativeDecoder.accept`` keeps
        (``speculating``: ``self.speculation.active``, read once per step)."""
        if seq.params.max_tokens == 0:  # the prompt is computed (scored); nothing is generated
            self._finish(seq, "length")
            return
        if seq.draft_token_ids:
            sampled, rows = self.speculation.accept(seq, sampled)
            logprobs = [logprobs[row] for row in rows]
        for token, logprob in zip(sampled, logprobs):
            self._append_token(seq, token, logprob, now)
            if seq.is_finished:
                return
        if speculating:
            self.speculation.rollback(seq)

    def _append_token(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> None:
        seq.output_token_ids.append(token)
        seq.token_times.append(now)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.stats.num_output_tokens += 1
        if seq.matcher is not None and seq.matcher.accept([token]) != 1:
            raise RuntimeError(
                f"{seq.seq_id}: guide {self.config.guide.name!r} refused token {token} that its own mask allowed"
            )
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, *reason)

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        params = seq.params
        num_output = seq.num_output_tokens
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop", None  # the grammar is complete and its stop token taken (even with ignore_eos)
        if num_output >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            stop = self._find_stop_string(seq) if params.stop else None
            if stop is not None:
                return "stop", stop
        if num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def _find_stop_string(self, seq: Sequence) -> str | None:
        """The stop string that the newest token's text completes (it may begin up to ``len(stop) - 1`` characters
        before that text), the earliest if several; records where it begins. A stop string counts only when it
        begins in text produced after the first ``min_tokens`` tokens: one completed earlier never matches later,
        and text from before ``min_tokens`` never cuts the output."""
        detokenizer = self._detokenizer(seq)
        text = detokenizer.update(seq.output_token_ids)
        new_start = detokenizer.text_start_of_token(seq.num_output_tokens - 1)
        floor = detokenizer.text_start_of_token(seq.params.min_tokens)
        found = [
            (index, stop)
            for stop in seq.params.stop
            if (index := text.find(stop, max(floor, new_start - len(stop) + 1))) >= 0
        ]
        if not found:
            return None
        index, stop = min(found)
        seq.stop_index = index
        return stop

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.finish_time = self.clock()
        request = self.requests.get(seq.request_id)
        previous = self.queues.finish(seq)
        if previous is SequenceStatus.RUNNING:
            followers_waiting = request is not None and any(
                s.status is SequenceStatus.WAITING for s in request.seqs[1:]
            )
            self.kv.free_finished(seq, followers_waiting)
        elif previous is SequenceStatus.WAITING:
            self.kv.free(seq)
        seq.matcher = None
        self.stats.num_cached_prompt_tokens += seq.num_cached_prompt_tokens
        self.stats.sequences_finished[reason] = self.stats.sequences_finished.get(reason, 0) + 1
        if self.speculation.active:
            self.speculation.release([seq])
        if request is not None and request.finished:
            self.stats.num_requests_finished += 1
            self.stats.num_requests_aborted += request.aborted
            self.kv.release_fork_pin(request.seqs[0])
            self.registry.hook.request_finished(output=self._request_output(request), engine=self)

    def _refuse_unschedulable(self) -> list[Request]:
        """Nothing runs and nothing could be admitted: fail the head request rather than spin forever."""
        seq = self.waiting[0]
        logger.error("request %s cannot be scheduled with an empty batch; finishing it with an error", seq.request_id)
        request = self.requests[seq.request_id]
        for member in request.seqs:
            if not member.is_finished:
                self._finish(member, "error")
        return [request]

    def _record_step(self, plan: StepPlan, duration: float) -> None:
        stats = self.stats
        shape = plan.shape() if self._wants_shapes() else None
        used_blocks = self.num_blocks_used
        stats.num_steps += 1
        stats.peak_blocks_used = max(stats.peak_blocks_used, used_blocks)
        stats.peak_running = max(stats.peak_running, len(self.running))
        if plan:
            if self.step_log is not None:
                self.step_log.append((shape, duration))
            stats.busy_time_s += duration
            reserved = sum(len(seq.block_table) for seq in self.running) * self.kv.block_size
            used = sum(min(seq.num_computed_tokens, seq.num_tokens) for seq in self.running)
            stats.weighted_reserved_slots += reserved * duration
            stats.weighted_used_slots += used * duration
            stats.weighted_running += len(self.running) * duration
        if self.registry.hook.step_finished.get_hookimpls():
            step = StepStats(
                num_seqs=len(plan.scheduled),
                num_batched_tokens=plan.num_batched_tokens,
                num_prefill_tokens=shape.num_prefill_tokens,
                num_decode_tokens=shape.num_decode_tokens,
                num_draft_tokens=sum(len(seq.draft_token_ids) for seq in self.running),
                num_preempted=len(plan.preempted),
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                kv_blocks_used=used_blocks,
                duration_s=duration,
                shape=shape,
            )
            self.registry.hook.step_finished(step_stats=step, engine=self)

    # -- outputs -----------------------------------------------------------------------------------------------
    def _request_output(self, request: Request) -> RequestOutput:
        completions = [self._completion(seq) for seq in request.seqs]
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None:
            prompt_logprobs = [None, *request.seqs[0].prompt_logprobs]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            completions,
            request.finished,
            request_metrics(request),
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        return CompletionOutput(
            index=seq.sample_index,
            text=self.output_text(seq),
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    def _detokenizer(self, seq: Sequence) -> Detokenizer:
        if seq.detokenizer is None:
            seq.detokenizer = Detokenizer(self.tokenizer)
        return seq.detokenizer

    def sequence_text(self, seq: Sequence) -> str:
        """The text of ``seq``'s output tokens so far, uncut (a running sequence's stream reads it)."""
        return self._detokenizer(seq).update(seq.output_token_ids)

    def output_text(self, seq: Sequence) -> str:
        """Detokenized output; a matched stop string and what follows it are cut (unless asked to keep it). Always
        a continuation of every earlier ``sequence_text`` short of the stop string: one detokenizer makes both."""
        text = self.sequence_text(seq)
        stop = seq.stop_reason
        if isinstance(stop, str) and seq.stop_index is not None:
            text = text[: seq.stop_index + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        return text

    def release_request(self, request_id: str) -> None:
        """Forget a finished request (its output was delivered)."""
        self.requests.pop(request_id, None)
