"""The data-parallel router: one OpenAI-compatible endpoint in front of N ``infer serve`` replicas.

``infer serve CONFIG --data-parallel-size N`` starts N replicas (each its own process on a free loopback port, with
its share of the cores) and this router on the configured address; ``infer router --replica URL ...`` fronts
replicas started elsewhere. Built on FastAPI and httpx (the server's own stack) rather than on ``sglang-router``
(docs/serving.md): that one rewrites request bodies with SGLang's fields (which an unmodified infer refuses with
400), drops infer's own fields from chat requests without a word, and its circuit breaker counts clients' 400s as
replica failures.

- **Routing** (``router.policy``): ``round_robin``; ``prefix_affinity``, SGLang's cache-aware rule over the router's
  own record of what it sent where: the prompt's text in blocks of ``block_chars`` characters, chained hashes (a
  block is known only after the blocks before it, as vLLM's block hashes), remembered per replica; the request goes
  to the replica matching the longest prefix, unless less than ``cache_threshold`` of it matched or that replica is
  busier than the idlest by ``balance_abs_threshold`` requests in flight and ``balance_rel_threshold`` times: then the
  idlest (ties in turn).
- **Health**: every replica's ``/health`` each ``health_interval_s``; ``failure_threshold`` failures in a row (or a
  refused connection) take it out, one success brings it back. Only a replica's own failures count (a connection
  error, a 503 from a stopped engine), never a client's 4xx.
- **Failover**: a request whose replica fails before answering is sent to the next healthy one (the generation
  starts over there); a stream already under way when its replica dies ends with an error event and ``[DONE]``;
  with no healthy replica the answer is a 503 in OpenAI's error body.
- **Metrics**: ``/metrics`` is every healthy replica's counters, gauges and histograms summed (the prefix hit rate
  recomputed from the summed token counts), plus the router's own per-replica counts (``infer_router_*``);
  ``/replicas/{i}/metrics`` is replica ``i``'s own. Parsed and written with ``prometheus_client``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.config import RouterConfig
from infer.serve.app import ApiKeyMiddleware
from infer.serve.errors import ApiError, install_error_handlers

logger = logging.getLogger("infer.router")

# Hop-by-hop headers and those httpx and uvicorn set themselves: never forwarded either way.
_DROPPED_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "content-encoding",
}
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Replica:
    """One replica as the router sees it."""

    index: int
    url: str
    healthy: bool = False
    in_flight: int = 0
    failures_in_row: int = 0
    routed: int = 0
    failovers: int = 0
    blocks: OrderedDict = field(default_factory=OrderedDict)  # chained block hash -> None, least recent first

    def describe(self) -> dict:
        return {
            "index": self.index,
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "failovers": self.failovers,
        }


def routing_text(body: object) -> str:
    """The text a request's prefix is judged by: a completion's prompt (the first of a batch; token ids as text),
    a chat's messages as role and content lines. Empty when the body has neither."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt)) if isinstance(prompt, list) else ""
    lines = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        lines.append(f"{message.get('role', '')}\n{content or ''}\n")
    return "".join(lines)


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained hashes of ``text``'s whole blocks of ``block_chars`` characters."""
    hashes, previous = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes


class ReplicaSet:
    """The replicas, their health and load, and the routing decision."""

    def __init__(self, urls: list[str], settings: RouterConfig):
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        self.replicas = [Replica(index, url.rstrip("/")) for index, url in enumerate(urls)]
        self.settings = settings
        self._turn = itertools.count()

    @property
    def healthy(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.healthy]

    def choose(self, text: str, exclude: set[int] = frozenset()) -> tuple[Replica | None, int]:
        """The replica for a request whose routing text is ``text`` and the blocks it is believed to hold of it;
        ``(None, 0)`` when none is healthy (outside ``exclude``)."""
        candidates = [replica for replica in self.healthy if replica.index not in exclude]
        if not candidates:
            return None, 0
        if self.settings.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)], 0
        hashes = block_hashes(text, self.settings.block_chars)
        matched = {replica.index: _leading_matches(replica.blocks, hashes) for replica in candidates}
        least = min(replica.in_flight for replica in candidates)
        best = max(candidates, key=lambda replica: (matched[replica.index], -replica.in_flight))
        busy = (
            best.in_flight > least + self.settings.balance_abs_threshold
            and best.in_flight > least * self.settings.balance_rel_threshold
        )
        enough = hashes and matched[best.index] * self.settings.block_chars >= self.settings.cache_threshold * len(text)
        if busy or not enough or matched[best.index] == 0:
            idlest = [replica for replica in candidates if replica.in_flight == least]
            best = idlest[next(self._turn) % len(idlest)]
        return best, matched[best.index]

    def remember(self, replica: Replica, text: str) -> None:
        """``replica`` is about to compute ``text``: its blocks are now (believed) in its cache."""
        if self.settings.policy != "prefix_affinity":
            return
        blocks = replica.blocks
        for value in block_hashes(text, self.settings.block_chars):
            blocks[value] = None
            blocks.move_to_end(value)
        while len(blocks) > self.settings.max_blocks_per_replica:
            blocks.popitem(last=False)

    def mark(self, replica: Replica, healthy: bool, at_once: bool = False) -> None:
        if healthy:
            if not replica.healthy:
                logger.info("replica %d (%s) is healthy", replica.index, replica.url)
            replica.healthy, replica.failures_in_row = True, 0
            return
        replica.failures_in_row += 1
        if replica.healthy and (at_once or replica.failures_in_row >= self.settings.failure_threshold):
            logger.warning(
                "replica %d (%s) is out: %s",
                replica.index,
                replica.url,
                "it refused or dropped a connection" if at_once else f"{replica.failures_in_row} failed health checks",
            )
            replica.healthy = False
            replica.blocks.clear()  # what it held may be gone with it


def _leading_matches(blocks: OrderedDict, hashes: list[int]) -> int:
    count = 0
    for value in hashes:
        if value not in blocks:
            break
        count += 1
    return count


class ReplicaFailed(Exception):
    """The replica failed this request before answering it (so another may take it)."""


def create_router_app(
    urls: list[str], settings: RouterConfig | None = None, api_key: str | None = None, metrics_public: bool = False
) -> FastAPI:
    """The router's app over replicas at ``urls``. With ``api_key``, ``/v1`` needs it (as the replicas, to which the
    router forwards the Authorization header), and so do ``/metrics`` and ``/replicas/...`` unless ``metrics_public``
    (the server's ``ApiKeyMiddleware``)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge

    settings = settings or RouterConfig()
    replicas = ReplicaSet(urls, settings)
    registry = CollectorRegistry()
    routed = Counter(
        "infer_router_requests", "Requests the router sent to each replica.", ["replica"], registry=registry
    )
    failovers = Counter(
        "infer_router_failovers", "Requests moved off a replica that failed them.", ["replica"], registry=registry
    )
    up = Gauge(
        "infer_router_replica_up", "1 while the replica passes its health checks.", ["replica"], registry=registry
    )
    in_flight = Gauge(
        "infer_router_requests_in_flight", "Requests the replica is answering now.", ["replica"], registry=registry
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=1024)
        )
        checks = asyncio.create_task(_health_loop(app.state.client, replicas))
        await _check_all(app.state.client, replicas)
        yield
        checks.cancel()
        await app.state.client.aclose()

    app = FastAPI(title="infer router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.replicas = replicas
    install_error_handlers(app)
    if api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=api_key, metrics_public=metrics_public, metrics_paths=("/metrics", "/replicas")
        )

    async def route(request: Request) -> Response:
        body = await request.body()
        try:
            text = routing_text(json.loads(body))
        except ValueError:
            text = ""  # not JSON: a replica answers the 400
        stream = b'"stream"' in body and _wants_stream(body)
        tried: set[int] = set()
        while True:
            replica, _ = replicas.choose(text, tried)
            if replica is None:
                raise ApiError(
                    503,
                    "no replica is healthy; the router retries them every "
                    f"{settings.health_interval_s:g} s (see GET /health)",
                    "server_error",
                    code="no_healthy_replica",
                )
            tried.add(replica.index)
            replicas.remember(replica, text)
            replica.routed += 1
            routed.labels(str(replica.index)).inc()
            try:
                return await _forward(request, body, replica, replicas, stream)
            except ReplicaFailed as failure:
                replica.failovers += 1
                failovers.labels(str(replica.index)).inc()
                logger.warning("replica %d failed a request (%s); trying another", replica.index, failure)

    for path in ROUTED_PATHS:
        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for replica in replicas.healthy:
            try:
                response = await request.app.state.client.get(
                    f"{replica.url}/v1/models", headers=_forwarded(request.headers)
                )
            except httpx.HTTPError:
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        raise ApiError(503, "no replica is healthy", "server_error", code="no_healthy_replica")

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = replicas.healthy
        body = {
            "status": "ok" if alive else "no healthy replica",
            "policy": settings.policy,
            "replicas": [replica.describe() for replica in replicas.replicas],
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import generate_latest

        texts = await _replica_metrics(request.app.state.client, replicas.healthy)
        for replica in replicas.replicas:
            up.labels(str(replica.index)).set(1 if replica.healthy else 0)
            in_flight.labels(str(replica.index)).set(replica.in_flight)
        return Response(
            aggregate_metrics(texts) + generate_latest(registry).decode(),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/replicas/{index}/metrics")
    async def replica_metrics(index: int, request: Request) -> Response:
        if not 0 <= index < len(replicas.replicas):
            raise ApiError(404, f"no replica {index}; there are {len(replicas.replicas)}", code="not_found")
        replica = replicas.replicas[index]
        try:
            response = await request.app.state.client.get(
                f"{replica.url}/metrics", headers=_forwarded(request.headers), timeout=5.0
            )
        except httpx.HTTPError as error:
            raise ApiError(503, f"replica {index} did not answer: {error}", "server_error") from error
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    return app


def _wants_stream(body: bytes) -> bool:
    try:
        return bool(json.loads(body).get("stream"))
    except (ValueError, AttributeError):
        return False


def _forwarded(headers) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in _DROPPED_HEADERS}


async def _forward(request: Request, body: bytes, replica: Replica, replicas: ReplicaSet, stream: bool) -> Response:
    """Send the request to ``replica``: a whole response, or a stream relayed as it comes. Raises
    ``ReplicaFailed`` when the replica fails it before answering."""
    client: httpx.AsyncClient = request.app.state.client
    outgoing = client.build_request(
        "POST",
        f"{replica.url}{request.url.path}",
        content=body,
        headers=_forwarded(request.headers),
        params=request.query_params,
    )
    replica.in_flight += 1
    try:
        response = await client.send(outgoing, stream=True)
    except httpx.HTTPError as error:
        replica.in_flight -= 1
        replicas.mark(replica, healthy=False, at_once=True)
        raise ReplicaFailed(f"{type(error).__name__}: {error}") from error
    if response.status_code == 503 and b"engine" in (await _peek(response)):
        replica.in_flight -= 1
        replicas.mark(replica, healthy=False, at_once=True)
        raise ReplicaFailed("its engine has stopped (503)")
    headers = _forwarded(response.headers)
    if not stream or not response.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await response.aread()
        except httpx.HTTPError as error:
            replicas.mark(replica, healthy=False, at_once=True)
            raise ReplicaFailed(f"the answer broke off: {error}") from error
        finally:
            replica.in_flight -= 1
            await response.aclose()
        return Response(content, response.status_code, headers=headers)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:
            replicas.mark(replica, healthy=False, at_once=True)
            logger.warning("replica %d broke off a stream: %s", replica.index, error)
            message = {
                "error": {
                    "message": f"replica {replica.index} failed mid-stream; the request was not completed",
                    "type": "server_error",
                    "param": None,
                    "code": "replica_failed",
                }
            }
            yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.in_flight -= 1
            await response.aclose()

    return StreamingResponse(relay(), response.status_code, headers=headers)


async def _peek(response: httpx.Response) -> bytes:
    """A (small, error) response's body, read so that it can still be relayed."""
    await response.aread()
    return response.content


async def _check_all(client: httpx.AsyncClient, replicas: ReplicaSet) -> None:
    async def check(replica: Replica) -> None:
        try:
            response = await client.get(f"{replica.url}/health", timeout=max(2.0, replicas.settings.health_interval_s))
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        replicas.mark(replica, healthy)

    await asyncio.gather(*(check(replica) for replica in replicas.replicas))


async def _health_loop(client: httpx.AsyncClient, replicas: ReplicaSet) -> None:
    while True:
        await asyncio.sleep(replicas.settings.health_interval_s)
        await _check_all(client, replicas)


async def _replica_metrics(client: httpx.AsyncClient, replicas: list[Replica]) -> list[str]:
    async def fetch(replica: Replica) -> str | None:
        try:
            response = await client.get(f"{replica.url}/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    return [text for text in await asyncio.gather(*(fetch(replica) for replica in replicas)) if text]


# Gauges that are ratios: recomputed from the summed series they divide instead of summed.
_RATIO_GAUGES = {
    "infer_prefix_cache_hit_rate": ("infer_prompt_tokens_cached_total", "infer_prompt_tokens_total"),
    "vllm:kv_cache_usage_perc": ("infer_kv_blocks_used", "infer_kv_blocks_total"),
    "infer_kv_cache_usage_ratio": ("infer_kv_blocks_used", "infer_kv_blocks_total"),
    "infer_spec_decode_mean_accepted_per_pass": (
        "infer_spec_decode_accepted_tokens_total",
        "infer_spec_decode_verify_passes_total",
    ),
}


def aggregate_metrics(texts: list[str]) -> str:
    """Replicas' ``/metrics`` texts as one: every sample summed over the replicas by name and labels (counters,
    gauges, histogram buckets, sums and counts), ratio gauges recomputed. Prometheus text format."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from infer.serve.metrics import Collected

    families: dict[str, Metric] = {}
    sums: dict[tuple[str, str, tuple], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
    totals = {sample_name: value for (_, sample_name, labels), value in sums.items() if not labels}
    for (family_name, sample_name, labels), value in sums.items():
        if sample_name in _RATIO_GAUGES:
            numerator, denominator = (totals.get(part, 0.0) for part in _RATIO_GAUGES[sample_name])
            value = numerator / denominator if denominator else 0.0
        families[family_name].add_sample(sample_name, dict(labels), value if math.isfinite(value) else 0.0)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected(list(families.values())))
    return generate_latest(registry).decode()
