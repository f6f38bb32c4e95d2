"""Getting one request's updates to its client: as server-sent events, or as one JSON body.

Either way, a client that goes away aborts its request, so the engine frees its KV blocks before the next step:
a streamed response closes its ``RequestStream`` however it ends (done, client gone, server shutting down), and a
non-streamed one waits for the result and for the client's disconnect at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from infer.serve.engine_loop import RequestStream
from infer.serve.errors import ApiError
from infer.serve.metrics import ServerMetrics
from infer.serve.responses import Collector

DONE_EVENT = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine request however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.request_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()


def event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def stream_events(
    stream: RequestStream, response_format, include_usage: bool, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """Chunks as the engine produces them (one per sample that moved), an optional usage chunk, then ``[DONE]``."""
    for chunk in response_format.opening_chunks():
        yield event(chunk)
    finish_reasons = []
    while True:
        update = await stream.next_update()
        if update.error is not None:
            yield event(ApiError(500, update.error, "server_error").body)
            break
        for sample in update.samples:  # one choice per chunk, as OpenAI streams n > 1: clients read choices[0]
            for chunk in response_format.chunks([sample]):
                yield event(chunk)
            if sample.finish_reason:
                finish_reasons.append(sample.finish_reason)
        if update.finished:
            for request_metrics in update.metrics:
                metrics.observe_finished(request_metrics, finish_reasons)
            if include_usage:
                yield event(response_format.usage_chunk(update.usage))
            break
    yield DONE_EVENT


async def respond_when_done(
    request: Request, stream: RequestStream, response_format, metrics: ServerMetrics
) -> Response:
    """The whole response once the request finishes; aborts it (and answers nothing) if the client leaves first."""
    collecting = asyncio.ensure_future(_collect(stream, stream.num_samples))
    disconnect = asyncio.ensure_future(_client_disconnect(request))
    try:
        await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collecting.done():
            collecting.cancel()
        stream.close()
    if not collecting.done() or collecting.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    collector = collecting.result()
    update = collector.last
    if update.error is not None:
        raise ApiError(500, update.error, "server_error")
    for request_metrics in update.metrics:
        metrics.observe_finished(request_metrics, [sample.finish_reason for sample in collector.samples])
    return JSONResponse(response_format.response(collector.samples, update.usage).model_dump())


async def _collect(stream: RequestStream, num_samples: int) -> Collector:
    collector = Collector(num_samples)
    while not collector.last or not collector.last.finished:
        collector.add(await stream.next_update())
    return collector


async def _client_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or comes after the response is sent).
    while (await request.receive())["type"] != "http.disconnect":
        pass
