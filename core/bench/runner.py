"""Replays a workload against an engine (real, or ``infer simulate``'s on its simulated clock): each request is
added when its arrival time comes (and, with a batch size, when a slot is free), the engine steps until everything
finished, and the run is summarized.

TTFT counts from the moment a request could be sent: its arrival time, or later when every slot was busy then (the
time the slot it takes became free), as vLLM's benchmark starts its clock after the concurrency semaphore.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from infer.bench.workloads import Workload
from infer.engine.engine import RequestError
from infer.engine.metrics import summarize
from infer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from infer.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenizedRequest:
    """A workload request with its prompt already tokenized (tokenizing is not part of what is timed)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float


@dataclass(slots=True)
class RunResult:
    """What a run produced: per-request outputs, the wall time from start to the last finish, and the summary."""

    outputs: list[RequestOutput]
    wall_time_s: float
    summary: dict


class RequestSlots:
    """Free in-flight slots, each with the time it became free; unlimited without a batch size."""

    def __init__(self, batch_size: int | None, start: float):
        self.free_since = deque([start] * batch_size) if batch_size else None

    def available(self) -> bool:
        return self.free_since is None or bool(self.free_since)

    def take(self, arrival: float) -> float:
        """Occupy a slot for a request that arrived at ``arrival``; returns when it could first be sent."""
        return arrival if self.free_since is None else max(arrival, self.free_since.popleft())

    def give_back(self, when: float) -> None:
        if self.free_since is not None:
            self.free_since.append(when)


def tokenize_workload(engine, workload: Workload) -> list[TokenizedRequest]:
    """Every prompt as token ids with the engine's tokenizer (chat templates applied), in arrival order."""
    requests = sorted(enumerate(workload.requests), key=lambda pair: pair[1].arrival_s)
    return [
        TokenizedRequest(f"bench-{index}", engine.tokenize(request.prompt)[1], request.params, request.arrival_s)
        for index, request in requests
    ]


def run_workload(engine, workload: Workload, show_progress: bool = False) -> RunResult:
    """Replay ``workload`` on ``engine`` (fresh, or at least idle) and summarize it."""
    from tqdm import tqdm

    requests = tokenize_workload(engine, workload)
    with tqdm(
        total=len(requests), desc=workload.name, unit="req", disable=not show_progress, dynamic_ncols=True
    ) as progress:
        outputs, wall_time_s = replay(engine, requests, workload.batch_size, on_finish=lambda: progress.update(1))
    summary = summarize(outputs, engine, wall_time_s)
    summary["batch_size"] = workload.batch_size
    return RunResult(outputs, wall_time_s, summary)


def warm_up(engine, workload: Workload) -> None:
    """Run requests of the workload's prompt and output lengths and batch size through ``engine`` once, untimed, then
    start its totals again (``Engine.reset_stats``), so that the timed run is not the engine's first meeting with
    steps of its sizes: the heap has grown to them, and the KV pool's pages that its blocks lie on have been written
    (a CPU pool is mapped in as its blocks are first written, ``infer.host.zeroed_pages``, and the ``paged``
    allocator hands the most recently freed blocks out first, so the timed run's blocks are the warm-up's), as a vLLM
    baseline's timed run follows its start, which zeroes its whole pool, and a warm-up generation. The prompts are
    random token ids: no prefix of theirs is one of the workload's, so a prefix cache finds nothing of them in the
    timed run."""
    rng = random.Random(0)
    requests = [
        TokenizedRequest(
            f"warm-up-{index}",
            [rng.randrange(engine.vocab_size) for _ in request.prompt_token_ids],
            SamplingParams(max_tokens=request.params.max_tokens, temperature=0.0, ignore_eos=True),
            0.0,
        )
        for index, request in enumerate(tokenize_workload(engine, workload))
    ]
    replay(engine, requests, workload.batch_size)
    engine.reset_stats()


def replay(
    engine, requests: list[TokenizedRequest], batch_size: int | None, on_finish: Callable[[], None] = lambda: None
) -> tuple[list[RequestOutput], float]:
    """Step ``engine`` until every request (in arrival order) is added and finished, calling ``on_finish`` for each
    finished one; returns the outputs in finishing order and the wall time."""
    pending = deque(requests)
    outputs: list[RequestOutput] = []
    start = engine.clock()
    slots = RequestSlots(batch_size, start)

    def finish(output: RequestOutput, slot_free_at: float) -> None:
        outputs.append(output)
        slots.give_back(slot_free_at)
        on_finish()

    while pending or engine.has_unfinished():
        _add_due_requests(engine, pending, slots, start, finish)
        if engine.has_unfinished():
            for output in engine.step():
                engine.release_request(output.request_id)
                finish(output, output.metrics.finish_time)
        elif pending and not slots.available():
            raise RuntimeError(
                "the engine is idle but requests it was given never came back as outputs "
                f"({len(pending)} still to send); a request was dropped without an output"
            )
        elif pending:
            engine.sleep(start + pending[0].arrival_s - engine.clock())
    return outputs, engine.clock() - start


def _add_due_requests(
    engine,
    pending: deque[TokenizedRequest],
    slots: RequestSlots,
    start: float,
    finish: Callable[[RequestOutput, float], None],
) -> None:
    """Add every request whose arrival time has come, while slots are free; a refused one finishes at once."""
    while pending and slots.available() and start + pending[0].arrival_s <= engine.clock():
        request = pending.popleft()
        arrival_time = slots.take(start + request.arrival_s)
        try:
            engine.add_request(request.prompt_token_ids, request.params, request.request_id, arrival_time)
        except RequestError as error:
            finish(_refused_output(request, arrival_time, str(error)), engine.clock())


def _refused_output(request: TokenizedRequest, arrival_time: float, message: str) -> RequestOutput:
    return RequestOutput(
        request.request_id,
        None,
        request.prompt_token_ids,
        [CompletionOutput(0, "", [], "error")],
        True,
        RequestMetrics(arrival_time),
        error=message,
    )


def simulate_workload(engine, workload, show_progress: bool = False) -> dict:
    """``run_workload`` on a ``SimulatedEngine``; the summary gains the simulator's own speed."""
    import gc

    # The workload's requests live for the whole run: kept out of the collector's full passes, which would otherwise
    # walk every one of them again and again.
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    try:
        summary = run_workload(engine, workload, show_progress=show_progress).summary
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - start
    return {
        **summary,
        "simulator_wall_s": wall,
        "simulated_requests_per_wall_s": summary["requests"] / wall,
        "simulated_steps_per_wall_s": engine.stats.num_steps / wall,
    }
