"""``GET /metrics`` in the Prometheus text format (version 0.0.4), without a client library.

Engine gauges and counters come from the snapshot the engine thread publishes after each step; request latencies
(TTFT, TPOT, end-to-end) are observed on the event loop as requests finish, from the engine's own timestamps.
All of it is touched only by the event loop, so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from infer.outputs import RequestMetrics
from infer.serve.engine_loop import EngineSnapshot

PREFIX = "infer"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative buckets, sum and count, rendered the Prometheus way (``le`` labels, ``+Inf`` last)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """What the server counts itself, plus rendering of the engine snapshot."""

    def __init__(self):
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Arrival to first output token, per request.", TTFT_BUCKETS_S)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean gap between output tokens after the first, per request.", TPOT_BUCKETS_S)
        self.latency = Histogram(f"{PREFIX}_request_latency_seconds",
                                 "Arrival to last output token, per request.", LATENCY_BUCKETS_S)
        self.finished = Counter()
        self.rejected = Counter()

    def observe_finished(self, metrics: RequestMetrics | None, finish_reasons: list[str | None]) -> None:
        for reason in finish_reasons:
            self.finished[reason or "unknown"] += 1
        if metrics is None:
            return
        for histogram, value in ((self.ttft, metrics.ttft_s), (self.tpot, metrics.tpot_s),
                                 (self.latency, metrics.latency_s)):
            if value is not None:
                histogram.observe(value)

    def observe_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def render(self, snapshot: EngineSnapshot) -> str:
        lines = [*_engine_lines(snapshot),
                 *_labelled("counter", "sequences_finished_total",
                            "Finished sequences (a request has n) by finish reason.", "finish_reason", self.finished),
                 *_labelled("counter", "requests_rejected_total", "Requests refused before reaching the engine.",
                            "reason", self.rejected),
                 *self.ttft.render(), *self.tpot.render(), *self.latency.render()]
        return "\n".join(lines) + "\n"


def _engine_lines(snapshot: EngineSnapshot) -> list[str]:
    rows = [
        ("gauge", "requests_running", "Requests with a sequence in the running batch.", snapshot.num_requests_running),
        ("gauge", "requests_waiting", "Requests queued for admission.", snapshot.num_requests_waiting),
        ("gauge", "kv_blocks_used", "KV blocks held by requests or the prefix cache.", snapshot.kv_blocks_used),
        ("gauge", "kv_blocks_cached", "KV blocks held by the prefix cache.", snapshot.kv_blocks_cached),
        ("gauge", "kv_blocks_total", "KV blocks in the pool.", snapshot.kv_blocks_total),
        ("gauge", "prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.",
         snapshot.prefix_hit_rate),
        ("counter", "prompt_tokens_total", "Prompt tokens of admitted requests.", snapshot.num_prompt_tokens),
        ("counter", "prompt_tokens_cached_total", "Prompt tokens found in the prefix cache.",
         snapshot.num_cached_prompt_tokens),
        ("counter", "generation_tokens_total", "Output tokens generated.", snapshot.num_output_tokens),
        ("counter", "preemptions_total", "Sequences preempted for KV space.", snapshot.num_preemptions),
        ("counter", "engine_steps_total", "Engine steps run.", snapshot.num_steps),
        ("counter", "spec_decode_draft_tokens_total", "Draft tokens proposed.", snapshot.num_draft_tokens),
        ("counter", "spec_decode_accepted_tokens_total", "Tokens committed by verify passes (bonus included).",
         snapshot.num_accepted_tokens),
        ("gauge", "spec_decode_mean_accepted_per_pass", "Tokens committed per verify pass (bonus included).",
         snapshot.mean_accepted_per_pass),
    ]
    lines = []
    for kind, name, help_text, value in rows:
        lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}", f"{PREFIX}_{name} {value}"]
    return lines


def _labelled(kind: str, name: str, help_text: str, label: str, counts: Counter) -> list[str]:
    lines = [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
    lines += [f'{PREFIX}_{name}{{{label}="{key}"}} {value}' for key, value in sorted(counts.items())]
    return lines
