"""``GET /metrics``: Prometheus's text format, written by ``prometheus-client``.

The engine's counters are the ones ``infer.engine.metrics.ENGINE_COUNTERS`` declares (what ``infer run`` and
``infer bench`` summarize), read from the snapshot of ``EngineStats`` the engine thread publishes after each step; its
gauges come from the same snapshot. Request latencies (queue time, TTFT, TPOT, end to end) are observed on the event
loop as requests finish, from the engine's own timestamps. All of it is touched only by the event loop, so no lock is
needed.
With ``server.metrics_vllm_names`` every series is also exported under the name a vLLM dashboard looks for
(``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from infer.engine.metrics import ENGINE_COUNTERS
from infer.outputs import RequestMetrics
from infer.serve.engine_loop import EngineSnapshot

PREFIX = "infer"
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """Observations counted into fixed buckets, with their sum (written as a Prometheus histogram)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], vllm_name: str | None = None):
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        self.vllm_name = vllm_name
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def family(self, name: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, self.help_text, buckets=buckets, sum_value=self.total)


class ServerMetrics:
    """What the server observes itself (latencies, refusals), and the exposition of it with the engine snapshot."""

    def __init__(self, vllm_names: bool = False):
        self.vllm_names = vllm_names
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "Arrival to the first step that computed the request's tokens.",
            QUEUE_BUCKETS_S,
            "vllm:request_queue_time_seconds",
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first output token, per request.",
            TTFT_BUCKETS_S,
            "vllm:time_to_first_token_seconds",
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean gap between output tokens after the first, per request.",
            TPOT_BUCKETS_S,
            "vllm:time_per_output_token_seconds",
        )
        self.latency = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "Arrival to last output token, per request.",
            LATENCY_BUCKETS_S,
            "vllm:e2e_request_latency_seconds",
        )
        self.rejected = Counter()

    def observe_finished(self, metrics: RequestMetrics | None, finish_reasons: list[str | None] = ()) -> None:
        """A request has finished (its sequences' reasons are counted by the engine)."""
        if metrics is None:
            return
        for histogram, value in (
            (self.queue_time, metrics.queue_time_s),
            (self.ttft, metrics.ttft_s),
            (self.tpot, metrics.tpot_s),
            (self.latency, metrics.latency_s),
        ):
            if value is not None:
                histogram.observe(value)

    def observe_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def render(self, snapshot: EngineSnapshot) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collected(list(self.families(snapshot))))
        return generate_latest(registry).decode()

    def families(self, snapshot: EngineSnapshot):
        stats = snapshot.stats
        gauges = [
            (
                "requests_running",
                "Requests with a sequence in the running batch.",
                snapshot.num_requests_running,
                "vllm:num_requests_running",
            ),
            (
                "requests_waiting",
                "Requests queued for admission.",
                snapshot.num_requests_waiting,
                "vllm:num_requests_waiting",
            ),
            ("kv_blocks_used", "KV blocks held by requests or the prefix cache.", snapshot.kv_blocks_used, None),
            ("kv_blocks_cached", "KV blocks held by the prefix cache.", snapshot.kv_blocks_cached, None),
            ("kv_blocks_total", "KV blocks in the pool.", snapshot.kv_blocks_total, None),
            (
                "kv_cache_usage_ratio",
                "KV blocks used / blocks in the pool.",
                snapshot.kv_blocks_used / snapshot.kv_blocks_total if snapshot.kv_blocks_total else 0.0,
                "vllm:kv_cache_usage_perc",
            ),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / prompt tokens.",
                stats.prefix_hit_rate,
                None,
            ),
            (
                "spec_decode_mean_accepted_per_pass",
                "Tokens committed per verify pass (bonus included).",
                stats.mean_accepted_per_pass,
                None,
            ),
        ]
        for name, help_text, value, vllm_name in gauges:
            yield from self._named(
                lambda full: GaugeMetricFamily(full, help_text, value=value), f"{PREFIX}_{name}", vllm_name
            )
        for counter in ENGINE_COUNTERS:
            value = getattr(stats, counter.attribute)
            yield from self._named(
                lambda full: CounterMetricFamily(full, counter.help, value=value),
                f"{PREFIX}_{counter.name}",
                counter.vllm_name,
            )
        yield from self._named(
            lambda full: _labelled(
                full,
                "Finished sequences (a request has n) by finish reason.",
                "finish_reason",
                stats.sequences_finished,
            ),
            f"{PREFIX}_sequences_finished_total",
            "vllm:request_success_total",
        )
        yield _labelled(
            f"{PREFIX}_requests_rejected_total", "Requests refused before reaching the engine.", "reason", self.rejected
        )
        for histogram in (self.queue_time, self.ttft, self.tpot, self.latency):
            yield from self._named(histogram.family, histogram.name, histogram.vllm_name)

    def _named(self, build, name: str, vllm_name: str | None):
        yield build(name)
        if self.vllm_names and vllm_name:
            yield build(vllm_name)


def _labelled(name: str, help_text: str, label: str, counts) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for key, value in sorted(counts.items()):
        family.add_metric([key], value)
    return family


class Collected:
    """A collector handing out families built beforehand (one exposition)."""

    def __init__(self, families: list):
        self._families = families

    def collect(self):
        return self._families
