"""The FastAPI application: OpenAI's ``/v1`` routes plus ``/health`` and ``/metrics``.

Handlers never touch the engine: they validate, submit to the ``EngineLoop`` and relay its updates. Every failure a
client can cause is a 4xx in OpenAI's error body, and none of them reaches another request. Before any handler:
the Host header is checked (starlette's ``TrustedHostMiddleware``; loopback names only on a loopback bind), then
the API key (``/v1`` and ``/metrics``), then the body's size.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.middleware.trustedhost import TrustedHostMiddleware

from infer.config import ServerConfig
from infer.engine.engine import RequestError
from infer.sampling_params import SamplingParamsError
from infer.serve.batched import BatchedStream
from infer.serve.delivery import EventStreamResponse, respond_when_done, stream_events
from infer.serve.engine_loop import EngineLoop, EngineStopped, ServerBusy
from infer.serve.errors import ApiError, error_response, install_error_handlers
from infer.serve.metrics import CONTENT_TYPE, ServerMetrics
from infer.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from infer.serve.responses import ChatFormat, CompletionFormat, ResponseMeta
from infer.serve.tools import ToolReading, select_tool_parser
from infer.tool_parser import ToolParser

# Seconds a refused client is told to wait; a step takes milliseconds, a queue this long drains in about that.
RETRY_AFTER_S = 1


@dataclass(slots=True)
class ServerState:
    """What the handlers share. Engine attributes read here are fixed after construction."""

    engine_loop: EngineLoop
    api_key: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: int = field(default_factory=lambda: int(time.time()))
    # Reads the model's tool calls for tool_choice auto (``server.tool_parser``); None: such requests get content.
    tool_parser: ToolParser | None = None

    @property
    def model_name(self) -> str:
        return self.engine_loop.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine_loop.engine.max_model_len

    def check_model(self, requested: str | None) -> None:
        """Accept the served name or the configured model path; OpenAI answers an unknown model with a 404."""
        engine = self.engine_loop.engine
        if requested is not None and requested not in (engine.model_name, engine.config.model.path):
            raise ApiError(
                404,
                f"the model {requested!r} does not exist; this server serves {engine.model_name!r}",
                param="model",
                code="model_not_found",
            )


LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1", "[::1]"]


class ApiKeyMiddleware:
    """Bearer-token check for ``/v1`` routes (and ``/metrics`` unless it is public), before the body is read;
    ``/health`` stays open. The scheme is case-insensitive (RFC 7235: ``bearer`` is ``Bearer``)."""

    def __init__(self, app, api_key: str, metrics_public: bool = False, metrics_paths: tuple[str, ...] = ("/metrics",)):
        self.app = app
        self.expected = api_key.encode()
        self.guarded = ("/v1",) if metrics_public else ("/v1", *metrics_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.guarded) and not self._authorized(scope):
            error = ApiError(
                401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


class BodyLimitMiddleware:
    """Refuses a request body larger than ``max_bytes`` with 413: by its Content-Length before reading it, and while
    reading a chunked one (a 10 MiB prompt otherwise held the engine thread while it was tokenized)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await error_response(self._too_large())(scope, receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"the request body is larger than server.max_body_bytes={self.max_bytes}", code="request_too_large"
        )


class _BodyTooLarge(Exception):
    pass


class JsonBodyMiddleware:
    """A ``POST /v1`` request without a Content-Type is read as JSON (curl -d and some clients send none; OpenAI's
    API accepts them) instead of failing body validation."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1"):
            headers = scope["headers"]
            if not any(name == b"content-type" for name, _ in headers):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine thread runs; the KV counts let tests and operators check that blocks come back."""
    state = server_state(request)
    snapshot = state.engine_loop.snapshot
    body = {
        "status": "ok" if state.engine_loop.alive else "engine stopped",
        "requests_running": snapshot.num_requests_running,
        "requests_waiting": snapshot.num_requests_waiting,
        "kv_blocks_used": snapshot.kv_blocks_used,
        "kv_blocks_cached": snapshot.kv_blocks_cached,
        "kv_blocks_total": snapshot.kv_blocks_total,
    }
    return JSONResponse(body, status_code=200 if state.engine_loop.alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = server_state(request)
    return PlainTextResponse(state.metrics.render(state.engine_loop.snapshot), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    card = ModelCard(id=state.model_name, created=state.started, max_model_len=state.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _generate(request, body, CompletionFormat, "cmpl")


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    choice = body.effective_tool_choice
    parser = server_state(request).tool_parser if choice == "auto" else None
    tools = ToolReading(parser, forced=body.forces_a_call, parallel=body.parallel_tool_calls)
    return await _generate(request, body, lambda meta: ChatFormat(meta, tools), "chatcmpl")


async def _generate(request: Request, body, format_class, id_prefix: str) -> Response:
    state = server_state(request)
    state.check_model(body.model)
    try:
        params = body.to_sampling_params()
    except SamplingParamsError as error:
        raise ApiError(400, str(error), param=error.field) from error
    if params.tenant is None:
        params = dataclasses.replace(params, tenant=tenant_of_api_key(request))
    if params.constraint is not None:
        await _compile_constraint(state, params, body.api_field)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    stream = await _submit_all(state, request_id, body.engine_prompts(), params, body)
    meta = ResponseMeta(
        request_id,
        int(time.time()),
        state.model_name,
        stream.num_samples,
        body.returns_logprobs,
        samples_per_prompt=params.n,
        choices_per_prompt=body.n,
    )
    if body.stream:
        response = EventStreamResponse(
            stream_events(stream, format_class(meta), body.include_usage, state.metrics), stream
        )
    else:
        response = await respond_when_done(request, stream, format_class(meta), state.metrics)
    response.headers["x-request-id"] = request_id  # the id (a batch's prompts: id-0, id-1, ...) the engine's log uses
    return response


def tenant_of_api_key(request: Request) -> str | None:
    """A request without ``user`` belongs to its API key's tenant (a digest, never the key): OpenAI clients always
    send one, and a server without ``api_key`` accepts any, so keys tell clients apart."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:12]


async def _compile_constraint(state: ServerState, params, api_field) -> None:
    """Compile the request's constraint in a worker thread (the guide caches it), so the engine thread finds it
    compiled instead of stalling every stream for the compile."""
    try:
        await asyncio.to_thread(state.engine_loop.engine.compile_constraint, params)
    except RequestError as error:
        raise ApiError(400, str(error), param=api_field(error.field)) from error


async def _submit_all(state: ServerState, request_id: str, prompts: list, params, body):
    """One engine request per prompt; a batch's streams merged into one (``BatchedStream``). A prompt refused
    aborts the ones submitted before it."""
    echo = body.echoes_prompt
    if len(prompts) == 1:
        return await _submit(state, request_id, prompts[0], params, body.api_field, echo)
    streams = []
    try:
        for index, prompt in enumerate(prompts):
            streams.append(await _submit(state, f"{request_id}-{index}", prompt, params, body.api_field, echo))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return BatchedStream(request_id, streams)


async def _submit(state: ServerState, request_id: str, prompt, params, api_field, echo: bool = False):
    try:
        return await state.engine_loop.submit(request_id, prompt, params, echo)
    except ServerBusy as error:
        state.metrics.observe_rejected("queue_full")
        raise ApiError(
            429,
            f"the server is busy: {error}; retry later",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from error
    except EngineStopped as error:
        raise ApiError(503, str(error), "server_error") from error
    except RequestError as error:
        raise ApiError(400, str(error), param=api_field(error.field)) from error


def create_app(engine_loop: EngineLoop, api_key: str | None = None, settings: ServerConfig | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and, at shutdown, aborts what is left and stops it.
    ``settings``: the config's ``server`` section (body limit, allowed hosts, whether /metrics is public)."""
    settings = settings or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        # In a worker thread: the event loop must stay free to deliver the aborted requests' last updates.
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None)
    engine = engine_loop.engine
    tool_parser = select_tool_parser(
        engine.registry, settings.tool_parser, getattr(engine.tokenizer, "chat_template", None)
    )
    app.state.server = ServerState(
        engine_loop, api_key, ServerMetrics(settings.metrics_vllm_names), tool_parser=tool_parser
    )
    install_error_handlers(app)
    app.include_router(router)
    # Each middleware added wraps the ones before: the last added runs first.
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics_public=settings.metrics_public)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings))
    return app


def allowed_hosts(settings: ServerConfig) -> list[str]:
    """The Host headers to answer: the configured ones; else, bound to loopback, only loopback names (DNS
    rebinding: a web page's script reaching a keyless local server under its own domain's name); else any."""
    if settings.allowed_hosts is not None:
        return settings.allowed_hosts
    try:
        loopback = settings.host == "localhost" or ipaddress.ip_address(settings.host).is_loopback
    except ValueError:  # a host name other than localhost
        loopback = False
    return [*LOOPBACK_HOSTS, settings.host] if loopback else ["*"]
