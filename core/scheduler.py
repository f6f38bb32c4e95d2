"""The scheduler contract and the budgeted base class the built-in schedulers share.

A scheduler decides, every step, who runs and with how many tokens. The budget mechanics (token budget, sequence
limit, block allocation, preemption by recompute) live in ``BudgetedScheduler``; a policy only orders the waiting
queue (and may hold some requests back) by overriding ``order_waiting``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from infer.kv_cache_manager import KVCacheManager
from infer.sequence import Sequence, SequenceQueues


class SchedulerConfig(BaseModel):
    """Config section ``scheduler``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "fcfs"
    max_num_seqs: int = Field(64, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Most tokens (prefill + decode + drafts) in one step.")
    preemption: Literal["newest", "fewest_computed"] = Field(
        "newest",
        description="Who is preempted when blocks run out: the most recently admitted running sequence "
        "(vLLM's choice), or the one with the fewest computed tokens (the least work lost).",
    )


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, in the quantities its cost grows with (``infer simulate``'s cost models read it, the
    ``step_finished`` hook's ``StepStats`` carries it). A row is a *decode* row when its sequence has one committed
    token left to compute (the tokens are that one and its drafts), else a *prefill* chunk (a prompt, or a preempted
    sequence's recompute)."""

    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_logit_rows: int = 0
    decode_context_tokens: int = 0  # keys the decode rows attend over: the sum of their context lengths
    prefill_attention_pairs: int = 0  # query-key pairs in the prefill chunks' attention
    decode_context_blocks: int = 0  # distinct KV blocks the decode rows read (a shared prefix's once)

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]]) -> StepShape:
        """The shape of ``scheduled`` (pairs of a plan, before the step runs)."""
        prefill = decode = rows = decode_context = pairs = 0
        blocks: set[int] = set()
        for seq, num_new in scheduled:
            computed, total = seq.num_computed_tokens, seq.num_tokens
            if total - computed == 1:
                decode += num_new
                decode_context += num_new * computed + num_new * (num_new + 1) // 2
                blocks.update(seq.block_table)
            else:
                prefill += num_new
                pairs += num_new * computed + num_new * (num_new + 1) // 2
            if computed + num_new >= total:
                rows += computed + num_new - max(computed, total - 1)
        return cls(len(scheduled), prefill, decode, rows, decode_context, pairs, len(blocks))

    def features(self) -> tuple[int, ...]:
        """The shape as a cost model's regressors: a constant, then each count."""
        return (
            1,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            self.num_seqs,
            self.num_logit_rows,
            self.decode_context_tokens,
            self.prefill_attention_pairs,
            self.decode_context_blocks,
        )


FEATURE_NAMES = (
    "step",
    "prefill_token",
    "decode_token",
    "sequence",
    "logit_row",
    "decode_context_token",
    "prefill_attention_pair",
    "decode_context_block",
)


@dataclass(slots=True)
class StepPlan:
    """What runs this step: ``(sequence, num_new_tokens)`` pairs in batch order, and who was preempted."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    _shape: StepShape | None = field(default=None, repr=False, compare=False)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def shape(self) -> StepShape:
        """``StepShape.of(scheduled)``, computed once (read before the step runs: it changes the sequences)."""
        if self._shape is None:
            self._shape = StepShape.of(self.scheduled)
        return self._shape

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class SchedulerView:
    """What a scheduler sees and may do in one step. The engine builds one; tests build one over a real allocator.

    ``waiting`` is in arrival order (preempted sequences go back to the front); ``running`` in admission order.
    Actions (``admit``, ``allocate``, ``preempt``) change block tables and queues immediately. ``now`` is the engine's
    clock at the start of the step, on the clock ``Sequence.arrival_time`` is on (seconds; simulated time under ``infer
    simulate``, the step number in the scheduler suite): time-aware policies measure waiting with it, never with the
    wall clock.
    """

    def __init__(
        self,
        waiting: deque[Sequence],
        running: list[Sequence],
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        now: float = 0.0,
    ):
        self.waiting = waiting
        self.running = running
        self._queues = SequenceQueues(waiting, running)
        self._kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.now = now

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus blocks the prefix cache would give back on demand."""
        return self._kv.num_available_blocks

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens of waiting ``seq`` an admission now would not compute (cache hit or shared fork prefix)."""
        return self._kv.cached_prefix_len(seq)

    def is_ready(self, seq: Sequence) -> bool:
        """False for an n > 1 follower while its leader has not computed the shared prompt yet."""
        return self._kv.is_ready(seq)

    def num_pending_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` would compute this step if the budget allowed: the uncomputed committed tokens plus its
        draft tokens (a budget cut drops drafts from the end)."""
        pending = seq.num_uncomputed_tokens + len(seq.draft_token_ids)
        return min(pending, self.max_model_len - seq.num_computed_tokens)

    def admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Move waiting ``seq`` to running with room for ``num_new_tokens`` tokens past its cached prefix."""
        if not self._kv.admit(seq, num_new_tokens):
            return False
        self._queues.start(seq)
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow running ``seq``'s blocks to hold ``num_new_tokens`` more tokens (evicting cached blocks if needed);
        False, and no change, when they cannot be had."""
        return self._kv.allocate(seq, num_new_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: release ``seq``'s blocks (its prefix stays cached) and put it at the front of waiting."""
        self._kv.free(seq)
        seq.draft_token_ids = []
        seq.draft_probs = None
        seq.draft_parents = None
        seq.num_preemptions += 1
        self._queues.preempt(seq)


class Scheduler(ABC):
    """Decides who runs this step. Plugin authors usually subclass ``BudgetedScheduler`` instead."""

    config_model: ClassVar[type[SchedulerConfig]] = SchedulerConfig

    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or self.config_model()

    @abstractmethod
    def schedule(self, view: SchedulerView) -> StepPlan:
        """Plan one step. Must respect ``max_num_batched_tokens`` and ``max_num_seqs``, schedule a sequence at most
        once, and allocate through ``view`` the blocks every scheduled sequence needs. A sequence is scheduled for at
        most its uncomputed tokens: one admitted with a prefix hit (``view.cached_prefix_len``) or a shared fork
        prompt arrives with those computed. A waiting ``n > 1`` follower is admitted only once ``view.is_ready``
        (else it computes the prompt its leader is computing). The scheduler suite checks each of these."""


class BudgetedScheduler(Scheduler):
    """Token-budget mechanics shared by every built-in policy (vLLM v1's unified loop, Sarathi-style mixing).

    1. Running sequences, in order, take what they need (1 decode token, 1 + k with drafts, or the next prefill
       chunk). When blocks run out the most recently admitted running sequence is preempted (recompute).
    2. If nobody was preempted, waiting sequences are admitted in ``order_waiting`` order while the budget, the
       sequence limit and the blocks last; a prompt larger than the remaining budget is chunked.
    """

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        """The waiting sequences to try, best first. Leaving one out holds it back this step. Default: FCFS."""
        return list(view.waiting)

    def pick_victim(self, view: SchedulerView, scheduled: dict[Sequence, int]) -> Sequence:
        """The running sequence to preempt when blocks run out (``scheduled``: who already has tokens this step).
        Override for a policy of your own; any running sequence is a valid answer. Default: ``preemption_choice``
        over all of them."""
        return self.preemption_choice(view.running)

    def preemption_choice(self, candidates: list[Sequence]) -> Sequence:
        """The config's ``preemption`` policy over ``candidates`` (in admission order): the most recently admitted,
        or the one with the fewest computed tokens (the latest admitted among equals)."""
        if self.config.preemption == "fewest_computed":
            return min(reversed(candidates), key=lambda seq: seq.num_computed_tokens)
        return candidates[-1]

    def schedule(self, view: SchedulerView) -> StepPlan:
        plan = StepPlan()
        scheduled: dict[Sequence, int] = {}
        budget = view.max_num_batched_tokens
        preempted: set[Sequence] = set()
        for seq in list(view.running):
            if seq in preempted:  # earlier in this loop (a set: a list lookup made a big batch's step quadratic)
                continue
            num_new = min(view.num_pending_tokens(seq), budget)
            if num_new <= 0:
                continue
            while not view.allocate(seq, num_new):
                victim = self.pick_victim(view, scheduled)
                budget += scheduled.pop(victim, 0)
                view.preempt(victim)
                plan.preempted.append(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new
                budget -= num_new
        if not plan.preempted:
            self._admit_waiting(view, scheduled, budget)
        plan.scheduled = list(scheduled.items())
        return plan

    def _admit_waiting(self, view: SchedulerView, scheduled: dict[Sequence, int], budget: int) -> None:
        for seq in self.order_waiting(view):
            if budget <= 0 or len(view.running) >= view.max_num_seqs:
                break
            if not view.is_ready(seq):
                continue
            cached = view.cached_prefix_len(seq)
            num_new = min(seq.num_tokens - cached, budget)
            if not view.admit(seq, num_new):
                break  # head-of-line: waiting requests never preempt running ones
            num_new = min(num_new, seq.num_tokens - seq.num_computed_tokens)
            scheduled[seq] = num_new
            budget -= num_new
