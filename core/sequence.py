"""The request/sequence state machine: WAITING -> RUNNING -> FINISHED, preempted back to WAITING; ``SequenceQueues``
is where a status changes."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from infer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream. A request with ``n > 1`` becomes n sequences sharing the prompt.

    ``num_computed_tokens`` counts the tokens whose K/V sit in the pool (prefix-cache hits included); everything in
    ``token_ids`` past it is still to be computed. ``draft_token_ids`` are speculative guesses for the positions after
    ``token_ids``: never committed, never cached.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    sample_index: int = 0
    seed: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), vocab] float32 when the drafter sampled its guesses (``infer.drafter.SampledDrafts``).
    draft_probs: object | None = None
    # The drafts' parents when they form a tree (``infer.drafter.DraftTree``); None: a chain.
    draft_parents: list[int] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = 0.0
    # Prefix-cache bookkeeping (set by the KV cache manager).
    cache_match: object | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Steps this sequence has waited while others were admitted ahead of it (for schedulers' aging bounds).
    num_times_passed_over: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Where the matched stop string begins in the output text (set with stop_reason).
    stop_index: int | None = None
    # The output's text, decoded incrementally (``infer.engine.detokenizer.Detokenizer``; created on first use).
    detokenizer: object | None = None
    # Timing (seconds, time.perf_counter()).
    first_scheduled_time: float | None = None  # the start of the first step that computed any of its tokens
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    # With ``params.prompt_logprobs``: prompt tokens 1, 2, ...'s logprobs as computed so far (prefill chunks add them).
    prompt_logprobs: list[dict] = field(default_factory=list)
    # Speculative decoding statistics.
    num_verify_passes: int = 0
    num_accepted_tokens: int = 0
    # Set for n > 1 followers: they wait until this sequence has computed the shared prompt.
    fork_of: Sequence | None = None
    # Structured output: this sample's position in its constraint's grammar (``infer.guide.Matcher``).
    matcher: object | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Committed tokens whose K/V is not in the pool yet (the rest of the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while some prompt token is not computed (the step's logits would not be sampled from)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt logprobs are still owed: then every prompt position must be computed (no cached prefix
        may skip one). The request's first sample computes them; its other samples share its prompt."""
        return (
            self.params.prompt_logprobs is not None
            and self.fork_of is None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]


class SequenceQueues:
    """The waiting queue (arrival order, preempted sequences at the front) and the running set (admission order):
    the one place a sequence's status changes, together with its queue. A sequence is in ``waiting`` exactly while
    WAITING and in ``running`` exactly while RUNNING."""

    def __init__(self, waiting: deque[Sequence] | None = None, running: list[Sequence] | None = None):
        self.waiting: deque[Sequence] = deque() if waiting is None else waiting
        self.running: list[Sequence] = [] if running is None else running

    def add(self, seqs: list[Sequence]) -> None:
        """New sequences join the back of the queue."""
        for seq in seqs:
            seq.status = SequenceStatus.WAITING
        self.waiting.extend(seqs)

    def start(self, seq: Sequence) -> None:
        """WAITING -> RUNNING (admitted)."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """RUNNING -> WAITING, at the front of the queue (recomputed first)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> SequenceStatus:
        """WAITING or RUNNING -> FINISHED; returns the status it had."""
        previous = seq.status
        if previous is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif previous is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        return previous
