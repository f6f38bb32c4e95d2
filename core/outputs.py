"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else "error"
