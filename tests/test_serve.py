"""``infer serve`` end to end: the official ``openai`` client against a real server process on a loopback port.

The default model serves the API tests (float32, greedy, short outputs); a tiny random model serves the tests that
need their own server (queue limit, SIGTERM), since they only exercise the server's plumbing. The incremental
detokenizer behind streaming is also checked alone, token by token, against a full decode.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from infer.serve.process import ServerProcess
from infer.serve.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 512
DEFAULT_OVERRIDES = [
    "model.dtype=float32",
    f"model.max_model_len={MAX_MODEL_LEN}",
    "cache.num_blocks=256",
    "scheduler.max_num_seqs=16",
    "guide.name=xgrammar",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess("baseline", DEFAULT_OVERRIDES, api_key=API_KEY, log_path=log_path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from infer.testing.models import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model")))


def tiny_overrides(model_dir: str, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=256", "cache.num_blocks=128", *extra]


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def metric_values(server, api_key: str | None = API_KEY) -> dict[str, float]:
    """Unlabelled samples of ``/metrics`` as name -> value, parsed by ``prometheus_client``'s parser."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{server.url}/metrics", timeout=10, headers=headers).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def wait_until_idle(server, timeout_s: float = 10.0) -> dict:
    """/health once no request runs or waits, or as it is after ``timeout_s`` (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = health(server)
        if (state["requests_running"] == 0 and state["requests_waiting"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


# -- streamed text ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from infer.model.loader import hf_model_dir

    return AutoTokenizer.from_pretrained(hf_model_dir(MODEL))


def stream_token_by_token(tokenizer, token_ids: list[int], stop: list[str]) -> str:
    """Feed ``token_ids`` one per step through ``RequestProgress`` the way the engine produces them (finishing at the
    first stop string, whose text is cut); returns the concatenated stream."""
    from infer import SamplingParams
    from infer.engine.detokenizer import Detokenizer
    from infer.serve.updates import RequestProgress

    detokenizer = Detokenizer(tokenizer)  # the sequence's own, as the engine keeps it

    def sequence_text(seq) -> str:  # Engine.sequence_text
        return detokenizer.update(seq.output_token_ids)

    def output_text(seq) -> str:  # Engine.output_text
        text = sequence_text(seq)
        return text[: text.find(seq.stop_reason)] if seq.stop_reason else text

    params = SamplingParams(stop=stop)
    seq = SimpleNamespace(
        output_token_ids=[],
        is_finished=False,
        finish_reason=None,
        stop_reason=None,
        params=params,
        logprobs=[],
        sample_index=0,
        request_id="r",
        num_output_tokens=0,
        num_cached_prompt_tokens=0,
        first_scheduled_time=None,
        first_token_time=None,
        finish_time=None,
        num_preemptions=0,
        num_verify_passes=0,
        num_accepted_tokens=0,
        token_times=[],
    )
    request = SimpleNamespace(seqs=[seq], finished=False, prompt_token_ids=[1], arrival_time=0.0, params=params)
    engine = SimpleNamespace(tokenizer=tokenizer, output_text=output_text, sequence_text=sequence_text)
    progress, streamed = RequestProgress(1, str), ""
    for token_id in token_ids:
        seq.output_token_ids.append(token_id)
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        seq.stop_reason = next((s for s in stop if s in text), None)
        if seq.stop_reason or len(seq.output_token_ids) == len(token_ids):
            seq.is_finished = request.finished = True
        update = progress.advance(engine, request)
        streamed += "".join(delta.text for delta in update.samples) if update else ""
        if request.finished:
            return streamed
    raise AssertionError("the sequence never finished")


@pytest.mark.parametrize("stop", [[], ["wörld, 世"], ["🙂!"], ["  end"]])
def test_incremental_stream_adds_up_to_the_full_decode(tokenizer, stop):
    text = "Héllo wörld, 世界! Emoji 🙂! and <|im_end|> spaces   end"
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(token_ids) > len(text.split())  # multibyte characters span several tokens
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    expected = full[: full.find(stop[0])] if stop else full
    assert stream_token_by_token(tokenizer, token_ids, stop) == expected


# -- completions and chat ----------------------------------------------------------------------------------------
def test_streamed_completion_equals_non_streamed(client):
    request = dict(model=MODEL, prompt="The three primary colors are", max_tokens=16, temperature=0)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert whole.choices[0].text.strip()
    assert streamed == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    usage = whole.usage
    assert 0 < usage.completion_tokens <= 16 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # baseline has no prefix cache


def test_streamed_chat_equals_non_streamed(client):
    request = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert "Paris" in whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"


def test_stop_string_is_cut_the_same_way_when_streamed(client):
    request = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    text = client.chat.completions.create(**request).choices[0].message.content
    stop = "Paris"
    assert stop in text
    whole = client.chat.completions.create(**request, stop=[stop])
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**request, stop=[stop], stream=True)
    )
    assert whole.choices[0].message.content == text[: text.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].message.content


def test_a_stop_string_before_min_tokens_is_ignored_and_streaming_agrees(client):
    """The issue's repro: " to" appears in the first four tokens, before min_tokens=5 is reached; neither answer may be
    cut there (both were), and the streamed text equals the whole one (it diverged)."""
    request = dict(model=MODEL, prompt="The history of Rome", max_tokens=40, temperature=0)
    free = client.completions.create(**request, logprobs=0).choices[0]
    before_min_tokens = "".join(free.logprobs.tokens[:4])
    assert " to" in before_min_tokens
    whole = client.completions.create(**request, stop=[" to"], extra_body={"min_tokens": 5}).choices[0]
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(**request, stop=[" to"], extra_body={"min_tokens": 5}, stream=True)
    )
    assert streamed == whole.text
    assert free.text.startswith(whole.text) and len(whole.text) > len(before_min_tokens) - len(" to")


def test_completion_logprobs_cover_every_token(client):
    whole = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == whole.usage.completion_tokens
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_match_between_stream_and_whole(client):
    request = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token for entry in content)
    streamed = [
        entry
        for chunk in client.chat.completions.create(**request, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def test_seeded_samples_are_reproducible_and_streamed_alike(client):
    request = dict(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=2, extra_body={"top_k": 50}
    )
    first = client.chat.completions.create(**request)
    again = client.chat.completions.create(**request)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1]
    assert texts == [choice.message.content for choice in again.choices]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**request, stream=True):
        assert len(chunk.choices) == 1  # one choice per chunk, as OpenAI streams n > 1
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert streamed == texts


def test_sampling_extensions_are_accepted(client):
    whole = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        stop="a stop string longer than sixteen characters",
        extra_body={"ignore_eos": True, "min_tokens": 6, "min_p": 0.05},
    )
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"


def test_scheduling_fields_reach_the_sampling_params():
    """vLLM's priority, a TTFT target, and OpenAI's user as the tenant; without a user, a digest of the bearer key."""
    from starlette.requests import Request

    from infer.serve.app import tenant_of_api_key

    body = CompletionRequest.model_validate({"prompt": "Hi", "priority": -1, "ttft_slo_s": 0.5, "user": "alice"})
    params = body.to_sampling_params()
    assert (params.priority, params.ttft_slo_s, params.tenant) == (-1, 0.5, "alice")

    def request(authorization: str | None) -> Request:
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        return Request({"type": "http", "headers": headers})

    first, again = tenant_of_api_key(request("Bearer sk-one")), tenant_of_api_key(request("bearer sk-one"))
    assert first == again and first.startswith("key-") and "sk-one" not in first
    assert tenant_of_api_key(request("Bearer sk-two")) != first
    assert tenant_of_api_key(request(None)) is None


# -- models, auth, errors ----------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_wrong_api_key_is_refused_but_health_stays_open(server):
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # server.metrics_public is false by default


def test_a_foreign_host_header_and_an_oversized_body_are_refused(server):
    """DNS rebinding: a page on another domain reaching the loopback server sends its own domain as Host. And a
    body past server.max_body_bytes is refused by its length, before anything reads it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    foreign = httpx.get(f"{server.url}/v1/models", headers={**headers, "Host": "attacker.example"}, timeout=10)
    assert foreign.status_code == 400
    assert httpx.get(f"{server.url}/v1/models", headers={**headers, "Host": "localhost"}, timeout=10).is_success
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 * 2**20), "max_tokens": 1}).encode()
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=huge,
        timeout=30,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


BAD_REQUESTS = [
    ("completions", b'{"prompt": "Hi",', None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "Hi", "max_tokens": "8"}, "max_tokens"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    ("completions", b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ("completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
    ("completions", {"prompt": [1] * 500, "max_tokens": 13}, "max_tokens"),
    ("completions", {"prompt": "Hi", "temperature": 2.01}, "temperature"),
    ("completions", {"prompt": "Hi", "n": 0}, "n"),
    ("completions", {"prompt": "Hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "Hi", "suffix": "and so on"}, "suffix"),
    ("completions", {"prompt": "Hi", "stop": ["a"] * 17}, "stop"),
    ("completions", {"prompt": "Hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ("completions", {"prompt": "Hi", "presence_penalty": 1.5}, "presence_penalty"),
    ("completions", {"prompt": [1] * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("completions", {"prompt": "word " * (MAX_MODEL_LEN * 2)}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 50}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**9}, "max_tokens"),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        },
        "response_format",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    ("completions", {"prompt": "Hi", "guided_regex": "([a-z"}, "guided_regex"),
    ("completions", {"prompt": "Hi", "guided_choice": []}, "guided_choice"),
    ("completions", {"prompt": "Hi", "guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
    ("completions", {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completions", {"prompt": "Hi", "structured_outputs": {"jsn": {}}}, "structured_outputs"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": MAX_MODEL_LEN},
        "max_completion_tokens",
    ),
    ("completions", {"prompt": "Hi", "ttft_slo_s": -1}, "ttft_slo_s"),
]


def test_max_tokens_null_means_until_the_context_ends_and_absent_means_the_default():
    """Completions: absent is OpenAI's 16, null is "until the context ends" (vLLM's reading), which the engine
    resolves once it knows the prompt's length; chat: absent and null both mean until the context ends."""
    assert CompletionRequest.model_validate({"prompt": "Hi"}).to_sampling_params().max_tokens == 16
    null = CompletionRequest.model_validate({"prompt": "Hi", "max_tokens": None})
    assert null.to_sampling_params().max_tokens is None
    chat = {"messages": CHAT}
    assert ChatCompletionRequest.model_validate(chat).to_sampling_params().max_tokens is None
    assert ChatCompletionRequest.model_validate({**chat, "max_tokens": None}).to_sampling_params().max_tokens is None
    limited = ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 5})
    assert limited.to_sampling_params().max_tokens == 5


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS)
def test_bad_request_gets_400_naming_the_field_and_server_keeps_serving(server, client, route, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server.url}/v1/{route}",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].finish_reason


def test_nulls_a_lower_case_bearer_and_no_content_type_are_accepted(server):
    """What OpenAI and vLLM accept: ``null`` for a field with a default, an assistant turn with ``content: null``, the
    auth scheme in any case, a body without a Content-Type; every answer carries its request id."""
    headers = {"Authorization": f"bearer {API_KEY}"}  # and no Content-Type
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 2,
        "temperature": 0,
        "stream": None,
        "n": None,
        "logprobs": None,
        "min_tokens": None,
        "ignore_eos": None,
    }
    response = httpx.post(
        f"{server.url}/v1/completions", content=json.dumps(body).encode(), headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == response.json()["id"]
    chat = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": None,
        "stream": None,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Again"},
        ],
    }
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=json.dumps(chat).encode(), headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


# -- observability and lifecycle ---------------------------------------------------------------------------------
def test_metrics_report_engine_and_latency(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    values = metric_values(server)
    for name in (
        "infer_requests_running",
        "infer_requests_waiting",
        "infer_kv_blocks_used",
        "infer_kv_blocks_total",
        "infer_prefix_cache_hit_rate",
        "infer_spec_decode_mean_accepted_per_pass",
        "infer_prompt_tokens_total",
        "infer_generation_tokens_total",
    ):
        assert name in values, name
    assert values["infer_kv_blocks_total"] == health(server)["kv_blocks_total"] > 0
    assert values["infer_generation_tokens_total"] >= 4
    assert values["infer_time_to_first_token_seconds_count"] >= 1
    assert values["infer_time_per_output_token_seconds_count"] >= 1
    assert values["infer_time_to_first_token_seconds_sum"] > 0


def test_metrics_equal_an_offline_runs_summary_and_speak_vllms_names_too(tiny_model_dir, tmp_path):
    """The same requests, one after another, through the server and through ``LLM`` (what ``infer run``
    summarizes): every engine counter ``/metrics`` exports equals the summary's."""
    from infer import LLM, SamplingParams
    from infer.engine.metrics import ENGINE_COUNTERS, summarize

    overrides = tiny_overrides(tiny_model_dir, "prefix_cache.name=radix", "server.metrics_vllm_names=true")
    prompts = [[1] + list(range(100, 140)) + [200 + index] for index in range(4)]  # a shared 41-token prefix
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as tiny:
        for prompt in prompts:
            response = httpx.post(
                f"{tiny.url}/v1/completions",
                timeout=60,
                json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text
        served = metric_values(tiny, api_key=None)
    llm = LLM("baseline", dotlist=overrides)
    outputs = [
        llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0] for prompt in prompts
    ]
    counters = summarize(outputs, llm.engine, wall_time_s=1.0)["counters"]
    assert counters["prompt_tokens_cached_total"] > 0 and counters["requests_finished_total"] == 4
    assert {counter.name: served[f"infer_{counter.name}"] for counter in ENGINE_COUNTERS} == counters
    assert served["vllm:prompt_tokens_total"] == counters["prompt_tokens_total"]
    assert served["vllm:num_requests_running"] == 0 and served["infer_request_queue_time_seconds_count"] == 4


def test_client_leaving_mid_stream_frees_its_blocks(server):
    before = metric_values(server)
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 5:
                assert health(server)["kv_blocks_used"] > 0
                break  # leaving the line iterator closes the connection
    state = wait_until_idle(server)
    assert state["requests_running"] == 0 and state["kv_blocks_used"] == state["kv_blocks_cached"] == 0
    after = metric_values(server)
    assert after["infer_generation_tokens_total"] - before["infer_generation_tokens_total"] < 400  # cut short
    assert after["infer_requests_aborted_total"] == before["infer_requests_aborted_total"] + 1


def test_client_leaving_before_a_non_streamed_answer_frees_its_blocks(server):
    before = metric_values(server)["infer_generation_tokens_total"]
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=2, headers={"Authorization": f"Bearer {API_KEY}"})
    state = wait_until_idle(server)
    assert state["requests_running"] == 0 and state["kv_blocks_used"] == state["kv_blocks_cached"] == 0
    assert metric_values(server)["infer_generation_tokens_total"] - before < 400


def test_full_queue_is_refused_with_429_and_retry_after(tiny_model_dir, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, "scheduler.max_num_seqs=1", "server.max_waiting=1")
    body = {"prompt": "Hi", "max_tokens": 32, "ignore_eos": True}
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as tiny:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            responses = list(
                pool.map(lambda _: httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=60), range(6))
            )
        refused = [r for r in responses if r.status_code == 429]
        assert refused and all(r.status_code in (200, 429) for r in responses)
        assert refused[0].headers["Retry-After"] == "1"
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=60).status_code == 200


def _stream_lines(url: str, body: dict, sigterm_after: int, server: ServerProcess) -> list[str]:
    """Data lines of one streamed completion; SIGTERMs the server after ``sigterm_after`` of them."""
    lines = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                if len(lines) == sigterm_after:
                    server.process.terminate()
    except httpx.TransportError:
        pass  # the server cut the stream at its shutdown timeout
    return lines


def test_sigterm_lets_the_in_flight_stream_finish_then_exits_zero(tiny_model_dir, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, "server.shutdown_timeout_s=30")
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as tiny:
        body = {"prompt": "Hi", "max_tokens": 48, "ignore_eos": True, "stream": True}
        lines = _stream_lines(tiny.url, body, sigterm_after=3, server=tiny)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert tiny.process.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{tiny.url}/health", timeout=2)


def test_sigterm_past_the_shutdown_timeout_aborts_and_exits_zero(tiny_model_dir, tmp_path):
    # 2000 tokens take far longer than the 1 s the server grants in-flight requests at shutdown.
    overrides = [
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=2048",
        "cache.num_blocks=160",
        "server.shutdown_timeout_s=1",
    ]
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as tiny:
        body = {"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        lines = _stream_lines(tiny.url, body, sigterm_after=3, server=tiny)
        assert tiny.process.wait(30) == 0
        # Cut off at the deadline, not finished, yet ended cleanly: a last chunk saying why, then [DONE].
        assert lines[-1] == "data: [DONE]" and len(lines) < 2000
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
        assert time.monotonic() - start < 20


def test_sigterm_past_the_shutdown_timeout_answers_a_non_streamed_request_with_json(tiny_model_dir, tmp_path):
    """A non-streamed request still running at the deadline gets its JSON answer (finish_reason "abort"), not
    uvicorn's plain-text 500 from a cancelled handler, and the process exits 0 within the timeout."""
    overrides = [
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=2048",
        "cache.num_blocks=160",
        "server.shutdown_timeout_s=2",
    ]
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as tiny:
        body = {"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{tiny.url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while httpx.get(f"{tiny.url}/health", timeout=5).json()["requests_running"] == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
            stopped = time.monotonic()
            tiny.process.terminate()
            response = answer.result(timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
        assert response.json()["choices"][0]["finish_reason"] == "abort"
        assert tiny.process.wait(30) == 0 and time.monotonic() - stopped < 2 + 1.5


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


def test_response_format_json_schema_through_the_openai_client_streamed_and_not(client):
    import jsonschema

    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    whole = client.chat.completions.create(**request)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**request, stream=True)
        if chunk.choices
    )
    assert streamed == text


def test_json_object_and_vllm_style_constraints(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object, please."}],
        max_tokens=240,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    regex = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text), regex.choices[0].text
    choice = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=5,
        temperature=0.7,
        n=3,
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}},
    )
    assert {c.text for c in choice.choices} <= {"blue", "green"} and len(choice.choices) == 3
