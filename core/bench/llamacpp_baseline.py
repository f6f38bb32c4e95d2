"""llama.cpp's server as a peer in ``infer bench --baseline llamacpp``: the same tokenized requests, greedy, through
``llama-server`` on the very GGUF file infer reads the model from.

``llama-server`` is a binary built from llama.cpp's source (``cmake -B build && cmake --build build --target
llama-server``), named by ``--llama-server`` or ``$LLAMA_SERVER``. It is started on a free loopback port with
``model.path``'s GGUF file (the default model's alias names one; a HF folder has none to give it), as many threads as
infer's torch uses (``-t``, ``-tb``), one slot (``-np``) per request in flight at once and a context of that many
times the longest prompt plus output (each slot holds ``-c / -np`` tokens), so no request is cut short; further
arguments the user gives (``--llama-server-args``) follow. llama.cpp builds before ggml-org/llama.cpp#19925 compute
``Q4_0``/``Q4_1`` weights wrongly on their AMX path (an Intel Xeon with AMX: the default model's perplexity 260
instead of 15.1); ``--no-repack`` keeps such a build off it.

Each request goes to ``/completion`` as its prompt's token ids (a list of ids gets no BOS added), greedy
(``temperature`` 0), ``n_predict`` its ``max_tokens``, ``ignore_eos`` as the request has it (every synthetic workload's
requests ignore EOS: llama.cpp then bans the end-of-generation tokens, infer generates through them),
``cache_prompt`` false, streamed so the client times each token as it arrives. Stop token ids and stop strings are
not applied.

Convention (as vLLM's baseline): requests go at the workload's concurrency, all at once or ``batch_size`` at a time
(single-stream: one), in arrival order with arrival times ignored; a short untimed request warms the server up
first. TTFT counts from when a request is sent, TPOT is (last token - first token) / (tokens - 1), as infer's
``RequestMetrics`` count them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from infer.bench.runner import TokenizedRequest
from infer.engine.metrics import percentile
from infer.sampling_params import SamplingParams

LLAMA_SERVER_ENV = "LLAMA_SERVER"
BUILD_HINT = "in llama.cpp's source: cmake -B build && cmake --build build --target llama-server"
HOST = "127.0.0.1"
# Model loading (and the server's own warm-up pass) before /health answers 200.
STARTUP_TIMEOUT_S = 300.0
WARM_UP_TOKENS = 4


class LlamaCppBaselineError(RuntimeError):
    """llama.cpp's baseline cannot run (no binary, no GGUF file, or the server failed); the message says why."""


def find_llama_server(explicit: str | None = None) -> str:
    """The ``llama-server`` binary: ``explicit``, else ``$LLAMA_SERVER``."""
    binary = explicit or os.environ.get(LLAMA_SERVER_ENV)
    if not binary:
        raise LlamaCppBaselineError(
            f"--baseline llamacpp needs a llama-server binary: pass --llama-server PATH or set {LLAMA_SERVER_ENV} "
            f"(to build one, {BUILD_HINT})"
        )
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise LlamaCppBaselineError(
            f"llama-server {binary!r} is not an executable file; pass --llama-server PATH or set {LLAMA_SERVER_ENV} "
            f"to a built one ({BUILD_HINT})"
        )
    return binary


def gguf_file(model_path: str) -> Path:
    """The GGUF file ``model.path`` names (an alias or a ``.gguf`` path): what llama-server loads."""
    from infer.model.loader import resolve_model_path

    try:
        path = resolve_model_path(model_path)
    except FileNotFoundError as error:
        raise LlamaCppBaselineError(str(error)) from None
    if path.suffix != ".gguf":
        raise LlamaCppBaselineError(
            f"--baseline llamacpp runs llama.cpp on the same GGUF file as infer, but model.path={model_path!r} is a "
            "HF folder; set model.path to a .gguf file (or the default model's alias)"
        )
    return path


def context_size(requests: list[TokenizedRequest], slots: int) -> int:
    """llama-server's ``-c``: ``slots`` times the longest prompt plus output (each slot gets ``-c / -np``)."""
    longest = max(len(request.prompt_token_ids) + request.params.max_tokens for request in requests)
    return slots * longest


def server_command(
    binary: str, gguf: Path, port: int, threads: int, slots: int, context: int, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command line that serves ``gguf`` on loopback ``port`` with ``threads`` threads and ``slots`` slots, then
    the ``extra`` arguments the user gave."""
    return [
        binary,
        "--model",
        str(gguf),
        "--host",
        HOST,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(context),
        "--no-webui",
        *extra,
    ]


def completion_body(request: TokenizedRequest) -> dict:
    """``/completion``'s JSON for ``request``: its prompt as token ids, greedy, exactly its ``max_tokens``."""
    return {
        "prompt": list(request.prompt_token_ids),
        "n_predict": request.params.max_tokens,
        "temperature": 0.0,
        "ignore_eos": request.params.ignore_eos,
        "cache_prompt": False,
        "stream": True,
    }


@dataclass(slots=True)
class StreamedCompletion:
    """One request's tokens as they arrived: when it was sent and when each token came (``time.perf_counter``)."""

    sent: float
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def stream_completion(port: int, request: TokenizedRequest, timeout_s: float) -> StreamedCompletion:
    """Send ``request`` to ``/completion`` and read its server-sent events (``data: {...}`` lines, each with the
    next ``tokens``; the last says ``stop``) to the end of the response."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        completion = StreamedCompletion(time.perf_counter())
        connection.request(
            "POST", "/completion", json.dumps(completion_body(request)), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise LlamaCppBaselineError(
                f"llama-server answered request {request.request_id} with HTTP {response.status}: "
                f"{response.read().decode(errors='replace')[:500]}"
            )
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: ") :])
            arrived = time.perf_counter()
            completion.token_ids += event.get("tokens", [])
            completion.token_times += [arrived] * len(event.get("tokens", []))
        return completion
    finally:
        connection.close()


def run_requests(
    port: int, requests: list[TokenizedRequest], concurrency: int, timeout_s: float = 3600.0
) -> tuple[list[StreamedCompletion], float]:
    """Every request streamed from the server on ``port``, at most ``concurrency`` in flight, in order; and the wall
    time from the first send to the last token."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        completions = list(pool.map(lambda request: stream_completion(port, request, timeout_s), requests))
    return completions, time.perf_counter() - began


def summarize_completions(
    completions: list[StreamedCompletion], requests: list[TokenizedRequest], wall_time_s: float
) -> dict:
    """Throughput and latency fields named as ``infer.engine.metrics.summarize``'s."""
    output_tokens = sum(len(completion.token_ids) for completion in completions)
    prompt_tokens = sum(len(request.prompt_token_ids) for request in requests)
    ttfts = [completion.ttft_s for completion in completions if completion.ttft_s is not None]
    tpots = [completion.tpot_s for completion in completions if completion.tpot_s is not None]
    return {
        "requests": len(requests),
        "output_tokens": output_tokens,
        "wall_time_s": wall_time_s,
        "output_tok_per_s": output_tokens / wall_time_s if wall_time_s else 0.0,
        "prompt_tok_per_s": prompt_tokens / wall_time_s if wall_time_s else 0.0,
        "requests_per_s": len(requests) / wall_time_s if wall_time_s else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "output_token_ids": [completion.token_ids for completion in completions],
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def server_version(binary: str) -> str:
    """What ``llama-server --version`` says of its build (``1 (4227c9b)``: build number and commit)."""
    finished = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    for line in (finished.stdout + finished.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "unknown"


def wait_until_ready(server: subprocess.Popen, port: int, log: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll ``/health`` until it answers 200; the server's log tail in the error if it exits or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise LlamaCppBaselineError(f"llama-server exited with {server.returncode}:\n{log_tail(log)}")
        connection = http.client.HTTPConnection(HOST, port, timeout=5)
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        connection.close()
        time.sleep(0.2)
    raise LlamaCppBaselineError(f"llama-server did not answer /health within {timeout_s:.0f} s:\n{log_tail(log)}")


def log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit while the block runs (in the main thread), so that its ``finally`` clauses run: by
    default the signal ends Python at once and a child process started in the block outlives it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running_server(command: list[str], port: int) -> Iterator[None]:
    """``command`` (a llama-server on ``port``) running and ready while the block runs, stopped after it, also when
    infer is stopped with SIGTERM or Ctrl-C meanwhile."""
    with tempfile.TemporaryDirectory(prefix="infer-llamacpp-") as folder, exit_on_sigterm():
        log = Path(folder) / "server.log"
        with log.open("w") as output:
            server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_until_ready(server, port, log)
            yield
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def run_llamacpp_baseline(
    binary: str,
    model_path: str,
    requests: list[TokenizedRequest],
    num_threads: int,
    batch_size: int | None = None,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 3600.0,
) -> dict:
    """Serve ``model_path``'s GGUF file with ``binary`` (and ``extra_args``) and stream ``requests`` through it,
    ``batch_size`` at a time (None: all at once); returns ``summarize_completions``' summary with the server's
    command and settings."""
    if any(request.params.max_tokens is None for request in requests):
        raise LlamaCppBaselineError("llama.cpp's baseline needs every request's max_tokens (a prompts line's is null)")
    gguf = gguf_file(model_path)
    slots = min(batch_size or len(requests), len(requests))
    context, port = context_size(requests, slots), free_port()
    command = server_command(binary, gguf, port, num_threads, slots, context, extra_args)
    with running_server(command, port):
        warm_up = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0, ignore_eos=True)
        stream_completion(port, TokenizedRequest("warm-up", requests[0].prompt_token_ids, warm_up, 0.0), timeout_s)
        completions, wall_time_s = run_requests(port, requests, slots, timeout_s)
    return {
        "version": server_version(binary),
        "model": str(gguf),
        "threads": num_threads,
        "slots": slots,
        "context": context,
        "command": command,
        **summarize_completions(completions, requests, wall_time_s),
    }
