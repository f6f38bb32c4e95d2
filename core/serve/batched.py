"""One client request served by several engine requests: a ``/v1/completions`` body whose ``prompt`` is a list of
prompts (OpenAI's batch form) is one engine request per prompt, relayed to the client as one response."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from infer.serve.engine_loop import RequestStream
from infer.serve.updates import RequestUpdate, Usage


class BatchedStream:
    """The updates of one engine request per prompt, merged as the updates of one request (``RequestStream``'s
    interface): sample i of prompt p is choice ``p * samples_per_prompt + i`` (OpenAI's order, prompt-major), and
    the last update carries the usage summed over the prompts and every request's metrics."""

    def __init__(self, request_id: str, streams: list[RequestStream]):
        self.request_id = request_id
        self.streams = streams
        self.num_samples = sum(stream.num_samples for stream in streams)
        self.finished = False
        self._updates: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()
        offsets = [sum(stream.num_samples for stream in streams[:index]) for index in range(len(streams))]
        self._relays = [asyncio.ensure_future(self._relay(offset, stream)) for offset, stream in zip(offsets, streams)]
        self._usages: list[Usage] = []
        self._metrics: list = []

    async def _relay(self, offset: int, stream: RequestStream) -> None:
        while True:
            update = await stream.next_update()
            self._updates.put_nowait((offset, update))
            if update.finished:
                return

    async def next_update(self) -> RequestUpdate:
        while True:
            offset, update = await self._updates.get()
            samples = [replace(sample, index=sample.index + offset) for sample in update.samples]
            if update.error is not None:
                self.close()
                return RequestUpdate(samples, error=update.error)
            if update.usage is None:
                return RequestUpdate(samples)
            self._usages.append(update.usage)
            self._metrics.extend(update.metrics)
            if len(self._usages) == len(self.streams):
                self.finished = True
                return RequestUpdate(samples, usage=_summed(self._usages), metrics=self._metrics)
            if samples:
                return RequestUpdate(samples)

    def close(self) -> None:
        """Safe to call any number of times; aborts the prompts' requests that have not finished."""
        self.finished = True
        for relay in self._relays:
            relay.cancel()
        for stream in self.streams:
            stream.close()


def _summed(usages: list[Usage]) -> Usage:
    return Usage(
        prompt_tokens=sum(usage.prompt_tokens for usage in usages),
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        cached_tokens=sum(usage.cached_tokens for usage in usages),
    )
