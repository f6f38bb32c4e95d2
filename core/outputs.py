"""What the engine hands back: a request's output, the step and engine statistics observers receive, and one step's
model output (``StepOutput``) that a drafter observes."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from infer.scheduler import StepShape

if TYPE_CHECKING:
    from infer.sequence import Sequence


@dataclass(slots=True)
class CompletionOutput:
    """One of the request's ``n`` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_verify_passes: int = 0
    num_accepted_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    # The request's scheduling fields (``SamplingParams``), so summaries can group by them.
    priority: int = 0
    tenant: str | None = None
    ttft_slo_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to the first step that computed any of the request's tokens."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def to_dict(self) -> dict:
        data = {key: value for key, value in asdict(self).items() if key != "token_times"}
        data.update(queue_time_s=self.queue_time_s, ttft_s=self.ttft_s, tpot_s=self.tpot_s, latency_s=self.latency_s)
        return data


@dataclass(slots=True)
class RequestOutput:
    """A finished (or, when streaming, in-progress) request. ``text``/``token_ids``/``finish_reason`` are the first
    sample's, for the common ``n == 1`` case."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for the first, which nothing
    # predicts), each ``{"token_id", "logprob", "top": [(token_id, logprob), ...]}`` as ``CompletionOutput.logprobs``.
    prompt_logprobs: list[dict | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else "error"


@dataclass(slots=True)
class StepStats:
    """One step's counts and timing (the ``step_finished`` hook receives it)."""

    num_seqs: int = 0
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # one per decoding sequence plus its drafts (``shape``'s)
    num_draft_tokens: int = 0  # drafts proposed in this step, for the next one to verify
    num_preempted: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    duration_s: float = 0.0
    shape: StepShape = field(default_factory=StepShape)  # what the step computed (``infer.scheduler.StepShape``)


@dataclass(slots=True)
class EngineStats:
    """Totals since start: what ``infer run``'s and ``infer bench``'s summaries and the server's ``/metrics`` report
    (``infer.engine.metrics.ENGINE_COUNTERS`` names the exported ones)."""

    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0  # finished by an abort (a client gone, the server shutting down)
    sequences_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> sequences
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    peak_blocks_used: int = 0
    peak_running: int = 0
    num_verify_passes: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens: int = 0
    busy_time_s: float = 0.0
    # Time-weighted sums for KV utilization: token slots holding real tokens / slots reserved by running sequences.
    weighted_used_slots: float = 0.0
    weighted_reserved_slots: float = 0.0
    weighted_running: float = 0.0

    def reset(self) -> None:
        """Every total back to its start, in place (the engine's parts that count into this object keep it)."""
        for item in fields(self):
            setattr(self, item.name, item.default_factory() if item.default is MISSING else item.default)

    @property
    def kv_utilization(self) -> float:
        return self.weighted_used_slots / self.weighted_reserved_slots if self.weighted_reserved_slots else 0.0

    @property
    def mean_running(self) -> float:
        return self.weighted_running / self.busy_time_s if self.busy_time_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens committed per verify pass (bonus token included)."""
        return self.num_accepted_tokens / self.num_verify_passes if self.num_verify_passes else 0.0


@dataclass(slots=True)
class BatchRows:
    """Which logits rows belong to which sequence: ``seq``'s rows are ``start .. start + count - 1`` and predict the
    tokens at positions ``first_position .. first_position + count - 1``."""

    seq: Sequence
    start: int
    count: int
    first_position: int


@dataclass(slots=True)
class StepOutput:
    # [num_rows, vocab] float32; valid until the runner's next step, which may write the same buffer
    # (``ModelRunner.logits_buffer``)
    logits: torch.Tensor
    rows: list[BatchRows]
    # When a drafter needs them: the final hidden state of every token of the step, [num_tokens, hidden], and where
    # each scheduled sequence's tokens sit in it (``token_rows``; there ``first_position`` is the position of the
    # span's first token itself, not of a predicted one).
    hidden_states: torch.Tensor | None = None
    token_rows: list[BatchRows] | None = None
    # Requests with ``prompt_logprobs``: logits of prompt positions [num_prompt_rows, vocab] float32, and whose they
    # are (``first_position``: the prompt token the first row predicts).
    prompt_logits: torch.Tensor | None = None
    prompt_rows: list[BatchRows] = field(default_factory=list)
