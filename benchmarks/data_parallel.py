"""Data parallelism on one box: one engine against two replicas behind the router (``prefix_affinity`` and
``round_robin``), over HTTP on loopback, on the chat and shared-prefix workloads (``infer bench``'s generators, the
same requests for every server): output throughput, TTFT p50/p99 (send to first streamed token), prefix hit rate
(from the servers' ``/metrics``: cached / prompt tokens over the run).

Every server is started fresh for each workload (cold caches), one after another; all requests are sent at once
(``rate`` none) as streamed completions of token-id prompts with fixed output lengths.

    python benchmarks/data_parallel.py [--workloads chat shared-prefix] [--json dp.json] [overrides ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infer.bench.workloads import build_workload
from infer.engine.metrics import percentile
from infer.host import cpu_signature
from infer.model.loader import load_tokenizer
from infer.serve.process import ServerProcess

SERVERS = [
    ("one engine (2 threads)", []),
    ("DP=2 prefix_affinity (1 thread each)", ["parallel.data_parallel_size=2", "router.policy=prefix_affinity"]),
    ("DP=2 round_robin (1 thread each)", ["parallel.data_parallel_size=2", "router.policy=round_robin"]),
]
BASE = ["model.dtype=float32", "prefix_cache.name=radix", "cache.memory_budget=1GiB"]


async def stream_one(client: httpx.AsyncClient, url: str, request, start: float) -> tuple[float | None, int]:
    """Send one streamed completion at its arrival time; (TTFT, output tokens)."""
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    body = {
        "prompt": request.prompt,
        "max_tokens": request.params.max_tokens,
        "temperature": request.params.temperature,
        "ignore_eos": request.params.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def run(url: str, requests) -> dict:
    before = counters(url)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1024)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, url, request, start) for request in requests))
        wall = time.perf_counter() - start
    after = counters(url)
    prompt = after["infer_prompt_tokens_total"] - before["infer_prompt_tokens_total"]
    cached = after["infer_prompt_tokens_cached_total"] - before["infer_prompt_tokens_cached_total"]
    ttfts = [ttft for ttft, _ in results if ttft is not None]
    return {
        "wall_s": wall,
        "output_tok_per_s": sum(tokens for _, tokens in results) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["chat", "shared-prefix"])
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*", help="config overrides for every server (key=value)")
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2-135m-instruct")[0]
    print(f"CPU: {cpu_signature()}; {os.cpu_count()} cores")
    rows = []
    for workload_name in args.workloads:
        requests = build_workload(workload_name, tokenizer).requests
        for name, overrides in SERVERS:
            with ServerProcess("baseline", [*BASE, *args.overrides, *overrides]) as server:
                row = {"workload": workload_name, "server": name, **asyncio.run(run(server.url, requests))}
            rows.append(row)
            print(
                f"{workload_name:<14} | {name:<38} | {row['output_tok_per_s']:7.1f} tok/s | TTFT p50 "
                f"{1000 * row['ttft_p50_s']:7.0f} ms, p99 {1000 * row['ttft_p99_s']:7.0f} ms | prefix hits "
                f"{row['prefix_hit_rate']:.1%}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cpu": cpu_signature(), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
