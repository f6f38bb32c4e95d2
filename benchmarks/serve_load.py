"""Load test for ``infer serve``: Poisson arrivals at several rates, streamed chat completions, latency percentiles.

For each rate, ``--num-requests`` requests start at the times of a seeded Poisson process (exponential gaps) and
stream concurrently. Metrics are client-side, defined as in vLLM's serving benchmark: TTFT = send to first content
chunk; ITL = gaps between content chunks, pooled over requests; TPOT = (latency - TTFT) / (output tokens - 1), per
request with more than one token; throughput = output tokens / the rate's wall time. Outputs have a fixed length
(``ignore_eos``) so rates are comparable. Bounded: loopback servers only, ``--num-requests`` per rate, and each rate
stops at ``--max-duration-s`` (unfinished requests count as errors). Prints a markdown table.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --rates 0.5 1 2
    python benchmarks/serve_load.py --launch baseline model.dtype=float32 --rates 0.5 1 2   # starts its own server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from infer.engine.metrics import percentile
from infer.prompts import BUILTIN_PROMPTS


@dataclass(slots=True)
class RequestResult:
    """One request, timed from its send: content chunk arrival times, end, tokens, or what went wrong."""

    chunk_times_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class RateResult:
    rate: float
    results: list[RequestResult]
    wall_time_s: float


def request_body(index: int, model: str | None, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": BUILTIN_PROMPTS[index % len(BUILTIN_PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body | ({"model": model} if model else {})


async def send(client: httpx.AsyncClient, body: dict) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                _record(result, line, time.perf_counter() - start)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency_s = time.perf_counter() - start
    return result


def _record(result: RequestResult, line: str, elapsed_s: float) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = json.loads(line.removeprefix("data: "))
    if "error" in chunk:
        result.error = chunk["error"]["message"]
    if chunk.get("usage"):
        result.output_tokens = chunk["usage"]["completion_tokens"]
    if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
        result.chunk_times_s.append(elapsed_s)


async def send_at(client: httpx.AsyncClient, body: dict, delay_s: float) -> RequestResult:
    await asyncio.sleep(delay_s)
    return await send(client, body)


async def run_rate(client: httpx.AsyncClient, rate: float, args) -> RateResult:
    """``args.num_requests`` requests at Poisson arrivals of ``rate`` per second, cut off at the duration limit."""
    arrivals = random.Random(args.seed)
    delay, tasks = 0.0, []
    for index in range(args.num_requests):
        body = request_body(index, args.model, args.max_tokens)
        tasks.append(asyncio.ensure_future(send_at(client, body, delay)))
        delay += arrivals.expovariate(rate)
    start = time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=args.max_duration_s)
    wall_time = time.perf_counter() - start
    for task in pending:
        task.cancel()
    results = [task.result() if task in done else RequestResult(error="timed out") for task in tasks]
    return RateResult(rate, results, wall_time)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(rates: list[RateResult]) -> str:
    header = (
        "| rate (req/s) | done / sent | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
        "| ITL p50 | ITL p99 | E2E p50 |"
    )
    lines = [header, "|" + "---:|" * (header.count("|") - 1)]
    for rate in rates:
        served = [r for r in rate.results if r.error is None]
        ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
        tpots = [r.tpot_s for r in served if r.tpot_s is not None]
        itls = [b - a for r in served for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
        tokens = sum(r.output_tokens for r in served)
        lines.append(
            f"| {rate.rate:g} | {len(served)} / {len(rate.results)} | {len(served) / rate.wall_time_s:.2f} "
            f"| {tokens / rate.wall_time_s:.1f} | {_ms(percentile(ttfts, 50))} | {_ms(percentile(ttfts, 99))} "
            f"| {_ms(percentile(tpots, 50))} | {_ms(percentile(tpots, 99))} | {_ms(percentile(itls, 50))} "
            f"| {_ms(percentile(itls, 99))} | {_ms(percentile([r.latency_s for r in served], 50))} |"
        )
    return "\n".join(lines)


async def benchmark(url: str, args) -> list[RateResult]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.num_requests + 1)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(args.max_duration_s)
    ) as client:
        warmup = await send(client, request_body(0, args.model, 2))  # pays one-time costs outside the measurement
        if warmup.error:
            raise SystemExit(f"the warm-up request failed: {warmup.error}")
        return [await run_rate(client, rate, args) for rate in args.rates]


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"refusing to load-test {url!r}: only loopback servers (127.0.0.1, ::1, localhost)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="A running server on this machine, e.g. http://127.0.0.1:8000.")
    target.add_argument(
        "--launch",
        nargs="+",
        metavar="CONFIG_OR_OVERRIDE",
        help="Start a server for the run: a config then key=value overrides.",
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="Requests per second.")
    parser.add_argument("--num-requests", type=int, default=32, help="Requests per rate (at most 1024).")
    parser.add_argument("--max-tokens", type=int, default=32, help="Output tokens per request.")
    parser.add_argument("--max-duration-s", type=float, default=300.0, help="Time limit per rate.")
    parser.add_argument("--model", help="Model name to send (default: the server's own).")
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the arrival times.")
    args = parser.parse_args()
    if not 1 <= args.num_requests <= 1024 or any(rate <= 0 for rate in args.rates):
        parser.error("--num-requests must be in [1, 1024] and every rate > 0")
    return args


def main() -> None:
    args = parse_args()
    with contextlib.ExitStack() as stack:
        if args.launch:
            from infer.serve.process import ServerProcess

            server = stack.enter_context(ServerProcess(args.launch[0], args.launch[1:], api_key=args.api_key))
            url = server.url
        else:
            url = args.url.rstrip("/")
        check_loopback(url)
        rates = asyncio.run(benchmark(url, args))
    print(
        f"{args.num_requests} requests per rate, {args.max_tokens} output tokens each, Poisson arrivals "
        f"(seed {args.seed}); latencies in ms\n"
    )
    print(table(rates))


if __name__ == "__main__":
    main()
