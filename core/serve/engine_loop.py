"""The engine thread that runs beside the asyncio event loop.

The engine is not thread-safe, so while serving only this thread touches it. The event loop talks to it through a
thread-safe command queue (submit, abort, stop); the thread answers by scheduling callbacks on the event loop
(``loop.call_soon_threadsafe``), once per step for all requests together, which push each request's update into
its own asyncio queue. Between steps the thread applies every queued command, so an abort frees the request's KV
blocks before the next step runs. With nothing to run it blocks on the queue instead of spinning.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from functools import partial

from infer.distributed import TensorParallelError
from infer.engine.engine import EngineStats, RequestError
from infer.sampling_params import SamplingParams
from infer.serve.updates import RequestProgress, RequestUpdate

logger = logging.getLogger("infer.serve")


class ServerBusy(Exception):
    """More requests are waiting than ``server.max_waiting`` allows; the client should retry later."""


class EngineStopped(Exception):
    """The engine thread is not running (it failed, or the server is shutting down)."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine gauges and a copy of its counters (``EngineStats``), taken by the engine thread after every step for
    ``/metrics`` and ``/health``."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0
    stats: EngineStats = field(default_factory=EngineStats)

    @classmethod
    def capture(cls, engine) -> EngineSnapshot:
        stats = engine.stats
        running = {seq.request_id for seq in engine.running}
        waiting = {seq.request_id for seq in engine.waiting} - running
        return cls(
            num_requests_running=len(running),
            num_requests_waiting=len(waiting),
            kv_blocks_used=engine.num_blocks_used,
            kv_blocks_cached=engine.prefix_cache.num_cached_blocks,
            kv_blocks_total=engine.allocator.capacity,
            stats=replace(stats, sequences_finished=dict(stats.sequences_finished)),
        )


class RequestStream:
    """The event-loop side of one request: its updates, in order. ``close()`` aborts it if it has not finished."""

    def __init__(self, request_id: str, num_samples: int, engine_loop: EngineLoop):
        self.request_id = request_id
        self.num_samples = num_samples
        self.finished = False
        self._engine_loop = engine_loop
        self._updates: asyncio.Queue[RequestUpdate] = asyncio.Queue()

    def push(self, update: RequestUpdate) -> None:
        self._updates.put_nowait(update)

    async def next_update(self) -> RequestUpdate:
        update = await self._updates.get()
        self.finished = self.finished or update.finished
        return update

    def close(self) -> None:
        """Safe to call any number of times; only an unfinished request is aborted."""
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self.request_id)


@dataclass(slots=True)
class _Submit:
    stream: RequestStream
    prompt: object
    params: SamplingParams
    accepted: asyncio.Future
    echo: bool = False


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Tracked:
    stream: RequestStream
    progress: RequestProgress


_STOP = object()
_ABORT_ALL = object()


class EngineLoop:
    """Owns the engine thread. ``start`` it from the event loop, ``submit`` requests, ``stop`` it at shutdown."""

    def __init__(self, engine, max_waiting: int):
        self.engine = engine
        self.max_waiting = max_waiting
        self.snapshot = EngineSnapshot.capture(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        # Engine-thread state: the requests it reports on, and decoded token texts for logprobs.
        self._tracked: dict[str, _Tracked] = {}
        self._token_texts: dict[int, str] = {}
        self._stopping = False
        # Event-loop state: submissions the engine thread has not taken yet (they count as waiting).
        self._num_submitting = 0

    # -- event-loop side ---------------------------------------------------------------------------------------
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Abort what is still running (its streams end with ``finish_reason="abort"``) and end the thread.
        Blocks: call it from a worker thread when the event loop must keep delivering the final updates."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_submitting + self.snapshot.num_requests_waiting

    async def submit(self, request_id: str, prompt, params: SamplingParams, echo: bool = False) -> RequestStream:
        """Queue a request. Raises ``ServerBusy`` when too many wait, ``RequestError`` when the engine refuses it.
        ``echo``: each sample's first update carries the prompt (``RequestProgress``)."""
        if not self.alive:
            raise EngineStopped("the engine is not running; see the server log")
        if self.num_waiting >= self.max_waiting:
            raise ServerBusy(f"{self.num_waiting} requests are waiting (server.max_waiting={self.max_waiting})")
        stream = RequestStream(request_id, params.n, self)
        accepted = self._event_loop.create_future()
        self._num_submitting += 1
        self._commands.put(_Submit(stream, prompt, params, accepted, echo))
        try:
            await accepted
        except asyncio.CancelledError:
            # The client left before the engine took the request: the abort follows the submit in the queue.
            self.abort(request_id)
            raise
        finally:
            self._num_submitting -= 1
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (each ends with ``finish_reason="abort"``); the thread keeps running. What
        a server's shutdown calls when its grace period is nearly over, while the handlers can still answer."""
        self._commands.put(_ABORT_ALL)

    # -- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        except Exception:
            logger.exception("the engine thread failed; requests in flight are failed and the server stays down")
            self._deliver(self._fail_all("the engine thread failed; see the server log"))

    def _serve_once(self) -> bool:
        """Apply queued commands, run one step if anything is unfinished, publish. False once told to stop."""
        replies: list = []
        for command in self._take_commands(block=not self.engine.has_unfinished()):
            replies.extend(self._apply(command))
        if self._stopping:
            replies.extend(self._abort_all())
        elif self.engine.has_unfinished():
            replies.extend(self._step())
        # Published before the replies so that a request the event loop sees accepted is already counted waiting.
        self.snapshot = EngineSnapshot.capture(self.engine)
        self._deliver(replies)
        return not self._stopping

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> list:
        if command is _STOP:
            self._stopping = True
            return []
        if isinstance(command, _Abort):
            self._forget(command.request_id, abort=True)
            return []
        if command is _ABORT_ALL:
            return self._abort_all()
        if self._stopping:
            return [partial(_settle, command.accepted, EngineStopped("the server is shutting down"))]
        return self._add(command)

    def _add(self, command: _Submit) -> list:
        request_id = command.stream.request_id
        try:
            self.engine.add_request(command.prompt, command.params, request_id)
        except RequestError as error:
            return [partial(_settle, command.accepted, error)]
        except Exception as error:
            # add_request changes nothing before it tokenizes and validates: this is the client's prompt (a chat
            # template refusing the messages, say), not engine trouble.
            logger.warning("request %s: could not prepare the prompt: %s", request_id, error)
            refusal = RequestError(f"could not prepare the prompt: {error}", "prompt")
            return [partial(_settle, command.accepted, refusal)]
        self._tracked[request_id] = _Tracked(
            command.stream, RequestProgress(command.params.n, self._token_text, command.echo)
        )
        return [partial(_settle, command.accepted, None)]

    def _step(self) -> list:
        try:
            self.engine.step()
        except TensorParallelError:
            raise  # no step can run any more: the thread ends, failing what is in flight, and /health turns 503
        except Exception:
            logger.exception("an engine step failed; failing every request in flight")
            return self._fail_all("the engine failed while running this request; see the server log")
        return self._collect_updates()

    def _collect_updates(self) -> list:
        replies = []
        for request_id, tracked in list(self._tracked.items()):
            request = self.engine.requests[request_id]
            update = tracked.progress.advance(self.engine, request)
            if update is not None:
                replies.append(partial(tracked.stream.push, update))
            if request.finished:
                self._forget(request_id, abort=False)
        return replies

    def _abort_all(self) -> list:
        for request_id in list(self._tracked):
            self.engine.abort(request_id)
        return self._collect_updates()

    def _fail_all(self, message: str) -> list:
        replies = [partial(tracked.stream.push, RequestUpdate(error=message)) for tracked in self._tracked.values()]
        for request_id in list(self._tracked):
            try:
                self._forget(request_id, abort=True)
            except Exception:
                logger.exception("request %s: abort failed after an engine error", request_id)
        return replies

    def _forget(self, request_id: str, abort: bool) -> None:
        if abort:
            self.engine.abort(request_id)
        self.engine.release_request(request_id)
        self._tracked.pop(request_id, None)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def _deliver(self, replies: list) -> None:
        if not replies or self._event_loop is None or self._event_loop.is_closed():
            return
        try:
            self._event_loop.call_soon_threadsafe(_run_all, replies)
        except RuntimeError:
            logger.warning("the event loop closed before %d replies could be delivered", len(replies))


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the submitter was cancelled (client gone)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _run_all(callbacks: list) -> None:
    for callback in callbacks:
        callback()
