"""Summaries of a finished run (``infer run``, ``infer bench``): throughput, latency percentiles, KV use."""

from __future__ import annotations

from dataclasses import dataclass

from infer.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class EngineCounter:
    """A total of the engine's (an ``EngineStats`` attribute), exported by ``/metrics`` as ``infer_<name>`` (and,
    with ``server.metrics_vllm_names``, under vLLM's name too) and read by the summaries."""

    name: str
    attribute: str
    help: str
    vllm_name: str | None = None


# The engine's counters, declared once: ``/metrics`` exports these, ``summarize`` reports them by attribute.
ENGINE_COUNTERS = (
    EngineCounter(
        "prompt_tokens_total", "num_prompt_tokens", "Prompt tokens of admitted requests.", "vllm:prompt_tokens_total"
    ),
    EngineCounter(
        "prompt_tokens_cached_total",
        "num_cached_prompt_tokens",
        "Prompt tokens found in the prefix cache.",
        "vllm:prefix_cache_hits_total",
    ),
    EngineCounter(
        "prefill_tokens_computed_total",
        "num_prefill_tokens_computed",
        "Prompt tokens computed (not found in the cache; recomputed after preemption included).",
    ),
    EngineCounter(
        "generation_tokens_total", "num_output_tokens", "Output tokens generated.", "vllm:generation_tokens_total"
    ),
    EngineCounter(
        "preemptions_total", "num_preemptions", "Sequences preempted for KV space.", "vllm:num_preemptions_total"
    ),
    EngineCounter("engine_steps_total", "num_steps", "Engine steps run."),
    EngineCounter("requests_finished_total", "num_requests_finished", "Requests finished, aborted ones included."),
    EngineCounter(
        "requests_aborted_total",
        "num_requests_aborted",
        "Requests finished by an abort (the client went away, or the server shut down).",
    ),
    EngineCounter(
        "spec_decode_draft_tokens_total",
        "num_draft_tokens",
        "Draft tokens proposed.",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    EngineCounter("spec_decode_verify_passes_total", "num_verify_passes", "Verification passes run."),
    EngineCounter(
        "spec_decode_accepted_tokens_total",
        "num_accepted_tokens",
        "Tokens committed by verify passes (bonus included).",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100], numpy's default method); None for an empty list."""
    if not values:
        return None
    import numpy

    return float(numpy.percentile(values, q))


def inter_token_latencies(outputs: list[RequestOutput]) -> list[float]:
    gaps: list[float] = []
    for output in outputs:
        times = output.metrics.token_times
        gaps.extend(b - a for a, b in zip(times, times[1:]) if b > a)
    return gaps


def summarize(outputs: list[RequestOutput], engine, wall_time_s: float) -> dict:
    """Numbers for the summary table; latencies in seconds."""
    served = [o for o in outputs if o.error is None]
    stats = engine.stats
    ttfts = [o.metrics.ttft_s for o in served if o.metrics.ttft_s is not None]
    queue_times = [o.metrics.queue_time_s for o in served if o.metrics.queue_time_s is not None]
    tpots = [o.metrics.tpot_s for o in served if o.metrics.tpot_s is not None]
    itls = inter_token_latencies(served)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in served)
    output_tokens = sum(len(c.token_ids) for o in served for c in o.outputs)
    return {
        "requests": len(outputs),
        "errors": len(outputs) - len(served),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_time_s": wall_time_s,
        "output_tok_per_s": output_tokens / wall_time_s if wall_time_s else 0.0,
        "prompt_tok_per_s": stats.num_prefill_tokens_computed / wall_time_s if wall_time_s else 0.0,
        "requests_per_s": len(served) / wall_time_s if wall_time_s else 0.0,
        "queue_time_p50_s": percentile(queue_times, 50),
        "queue_time_p99_s": percentile(queue_times, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "prefill_tokens_computed": stats.num_prefill_tokens_computed,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "kv_utilization": stats.kv_utilization,
        "peak_kv_blocks": stats.peak_blocks_used,
        "total_kv_blocks": engine.allocator.capacity,
        "peak_running": stats.peak_running,
        "mean_running": stats.mean_running,
        "preemptions": stats.num_preemptions,
        "spec_accepted_per_pass": stats.mean_accepted_per_pass,
        "counters": {counter.name: getattr(stats, counter.attribute) for counter in ENGINE_COUNTERS},
        "ttft_slo_attainment": slo_attainment(served),
        **grouped_ttfts(served),
        **tensor_parallel_numbers(engine),
    }


def tensor_parallel_numbers(engine) -> dict:
    """With a sharded model: the ranks, each rank's KV bytes per token, and rank 0's time in collectives (the
    plan's broadcast, two all-reduces per layer, the logits' gather, waits for slower ranks included) as a share of
    the engine's busy time."""
    parallel = getattr(engine, "tensor_parallel", None)
    if parallel is None:
        return {}
    stats = engine.stats
    return {
        "tensor_parallel_size": parallel.world_size,
        "kv_bytes_per_token_by_rank": list(engine.pool_plan.rank_bytes_per_token),
        "tp_comm_share": parallel.comm_time_s / stats.busy_time_s if stats.busy_time_s else 0.0,
        "tp_all_reduces_per_step": parallel.group.num_all_reduces / stats.num_steps if stats.num_steps else 0.0,
    }


def slo_attainment(served: list[RequestOutput]) -> float | None:
    """The share of requests with a TTFT target (``ttft_slo_s``) whose first token came within it; None: no
    targets."""
    targeted = [o.metrics for o in served if o.metrics.ttft_slo_s is not None]
    if not targeted:
        return None
    return sum(m.ttft_s is not None and m.ttft_s <= m.ttft_slo_s for m in targeted) / len(targeted)


def grouped_ttfts(served: list[RequestOutput]) -> dict:
    """TTFT p50 and p99 per priority and per tenant, where requests have more than one of either (what the priority
    and fair schedulers change)."""
    groups = {}
    for name, key in (("priority", lambda m: str(m.priority)), ("tenant", lambda m: str(m.tenant))):
        by_group: dict[str, list[float]] = {}
        for output in served:
            if output.metrics.ttft_s is not None:
                by_group.setdefault(key(output.metrics), []).append(output.metrics.ttft_s)
        if len(by_group) > 1:
            groups[f"ttft_by_{name}"] = {
                group: {"p50_s": percentile(values, 50), "p99_s": percentile(values, 99), "requests": len(values)}
                for group, values in sorted(by_group.items())
            }
    return groups


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def format_summary(summary: dict) -> str:
    """A two-column text table."""
    rows = [
        ("requests", f"{summary['requests']} ({summary['errors']} refused)"),
        ("prompt / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}"),
        ("wall time", f"{summary['wall_time_s']:.2f} s"),
        ("output tok/s", f"{summary['output_tok_per_s']:.1f}"),
        ("prefill tok/s (computed)", f"{summary.get('prompt_tok_per_s', 0.0):.1f}"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        ("queue time p50 / p99", f"{_ms(summary.get('queue_time_p50_s'))} / {_ms(summary.get('queue_time_p99_s'))}"),
        ("TTFT p50 / p99", f"{_ms(summary['ttft_p50_s'])} / {_ms(summary['ttft_p99_s'])}"),
        ("TPOT p50 / p99", f"{_ms(summary['tpot_p50_s'])} / {_ms(summary['tpot_p99_s'])}"),
        ("ITL p50 / p99", f"{_ms(summary['itl_p50_s'])} / {_ms(summary['itl_p99_s'])}"),
        ("prefill tokens computed", str(summary["prefill_tokens_computed"])),
        ("prefix hit rate", f"{summary['prefix_hit_rate']:.1%}"),
        ("peak KV blocks in use / total", f"{summary['peak_kv_blocks']} / {summary['total_kv_blocks']}"),
        ("KV utilization (time-avg)", f"{summary['kv_utilization']:.1%}"),
        ("running seqs peak / mean", f"{summary['peak_running']} / {summary['mean_running']:.1f}"),
        ("preemptions", str(summary["preemptions"])),
        (
            "spec tokens per verify pass",
            f"{summary['spec_accepted_per_pass']:.2f}" if summary["spec_accepted_per_pass"] else "-",
        ),
    ]
    if summary.get("tensor_parallel_size"):
        rows.append(
            (
                "tensor parallel ranks",
                f"{summary['tensor_parallel_size']} (KV B/token per rank: "
                f"{' / '.join(map(str, summary['kv_bytes_per_token_by_rank']))})",
            )
        )
        rows.append(
            (
                "collectives' share of busy time",
                f"{summary['tp_comm_share']:.1%} ({summary['tp_all_reduces_per_step']:.0f} all-reduces/step)",
            )
        )
    if summary.get("ttft_slo_attainment") is not None:
        rows.append(("TTFT SLO met", f"{summary['ttft_slo_attainment']:.1%}"))
    for name in ("priority", "tenant"):
        for group, values in summary.get(f"ttft_by_{name}", {}).items():
            rows.append(
                (
                    f"TTFT p50 / p99, {name} {group}",
                    f"{_ms(values['p50_s'])} / {_ms(values['p99_s'])} ({values['requests']} requests)",
                )
            )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
