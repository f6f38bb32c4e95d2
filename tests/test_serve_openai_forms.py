"""The request forms clients and harnesses send, through the official ``openai`` client against a real ``infer
serve`` (the default model, float32, with the ``ngram`` drafter so that every form also runs through draft
verification): batched prompts, ``echo`` (lm-evaluation-harness's scoring form), ``best_of``, ``logit_bias``,
``top_k: -1``, ``tools: []``; fields infer does not implement get a 400 naming them."""

from __future__ import annotations

import httpx
import openai
import pytest

from infer.serve.process import ServerProcess

MODEL = "smollm2-135m-instruct"
API_KEY = "forms-key"
OVERRIDES = [
    "model.dtype=float32",
    "model.max_model_len=512",
    "cache.num_blocks=256",
    "scheduler.max_num_seqs=16",
    "prefix_cache.name=radix",
    "drafter.name=ngram",
    "drafter.num_speculative_tokens=3",
]
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess("baseline", OVERRIDES, api_key=API_KEY, log_path=log_path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(client, **body):
    return client.completions.create(model=MODEL, **body)


def test_batched_prompts_give_one_choice_per_prompt_and_sample_in_order_with_summed_usage(client):
    alone = [complete(client, prompt=prompt, max_tokens=5, temperature=0) for prompt in PROMPTS]
    batched = complete(client, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert [choice.index for choice in batched.choices] == list(range(6))
    assert [choice.text for choice in batched.choices] == [one.choices[0].text for one in alone for _ in range(2)]
    assert batched.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert batched.usage.completion_tokens == 2 * sum(one.usage.completion_tokens for one in alone)


def test_token_id_prompts_batched_and_streamed(client):
    ids = [[504, 3575, 282], [1848, 30, 827]]
    whole = complete(client, prompt=ids, max_tokens=4, temperature=0)
    streamed = {0: "", 1: ""}
    for chunk in complete(client, prompt=ids, max_tokens=4, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [choice.text for choice in whole.choices] == [streamed[0], streamed[1]]
    assert whole.usage.prompt_tokens == 6


def test_echo_puts_the_prompt_first_and_false_changes_nothing(client):
    plain = complete(client, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert (
        complete(client, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=False).choices[0].text
        == plain.choices[0].text
    )
    echoed = complete(client, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = "".join(
        chunk.choices[0].text
        for chunk in complete(client, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, stream=True)
        if chunk.choices
    )
    assert streamed == echoed.choices[0].text


def test_echo_with_max_tokens_zero_scores_the_prompt_as_the_model_does(client):
    """lm-evaluation-harness's log-likelihood request; the numbers equal ``infer.LLM``'s prompt logprobs."""
    from infer import LLM
    from infer.sampling_params import SamplingParams

    prompt = "The quick brown fox jumps over the lazy dog"
    scored = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == prompt and logprobs.text_offset[0] == 0
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    with LLM("baseline", ["model.dtype=float32", "model.max_model_len=512", "cache.num_blocks=64"]) as llm:
        expected = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    assert logprobs.token_logprobs[1:] == pytest.approx([entry["logprob"] for entry in expected[1:]], abs=1e-4)


def test_best_of_returns_the_sample_of_highest_cumulative_logprob(client):
    body = dict(prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=11)
    drawn = complete(client, n=4, logprobs=0, **body)
    totals = [sum(choice.logprobs.token_logprobs) for choice in drawn.choices]
    best = complete(client, best_of=4, **body)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == drawn.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == drawn.usage.completion_tokens
    two = complete(client, best_of=4, n=2, logprobs=0, **body)
    assert [choice.text for choice in two.choices] == [
        drawn.choices[i].text for i in sorted(range(4), key=lambda i: -totals[i])[:2]
    ]
    assert complete(client, best_of=1, **body).choices[0].text == complete(client, **body).choices[0].text


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from infer.model.loader import hf_model_dir

    return AutoTokenizer.from_pretrained(hf_model_dir(MODEL))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_logit_bias_forces_and_bans_tokens(client, tokenizer, sampling):
    forced_text = tokenizer.decode([1234])  # any token: +100 outweighs every logit the model gives
    forced = complete(client, prompt=PROMPTS[0], max_tokens=6, logprobs=0, logit_bias={"1234": 100}, **sampling)
    assert forced.choices[0].logprobs.tokens == [forced_text] * 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        logit_bias={"1234": 100},
        logprobs=True,
        **sampling,
    )
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [forced_text] * 6
    free = complete(client, prompt=PROMPTS[0], max_tokens=6, logprobs=0, **sampling).choices[0]
    assert complete(client, prompt=PROMPTS[0], max_tokens=6, logit_bias={}, **sampling).choices[0].text == free.text
    banned_ids = set(tokenizer(free.text, add_special_tokens=False)["input_ids"])
    banned = complete(
        client,
        prompt=PROMPTS[0],
        max_tokens=6,
        logprobs=0,
        **sampling,
        logit_bias={str(token): -100 for token in banned_ids},
    ).choices[0]
    assert not set(banned.logprobs.tokens) & {tokenizer.decode([token]) for token in banned_ids}


def test_top_k_minus_one_is_disabled(client):
    body = dict(prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=3)
    disabled = complete(client, **body, extra_body={"top_k": -1})
    assert disabled.choices[0].text == complete(client, **body).choices[0].text


def test_chat_accepts_an_empty_tool_list(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, tools=[]
    )
    assert reply.choices[0].message.content


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        ("completions", "suffix", "the end"),
        ("completions", "presence_penalty", 0.5),
        ("completions", "logit_bias", {"abc": 1}),
        ("completions", "logit_bias", {"5": 101}),
        ("completions", "logit_bias", {"99999999": 1}),
        ("completions", "best_of", 0),
        ("chat", "functions", [{"name": "f"}]),
        ("chat", "audio", {"voice": "alloy"}),
        ("chat", "store", True),
        ("chat", "prediction", {"type": "content", "content": "x"}),
    ],
)
def test_fields_infer_does_not_implement_get_a_400_naming_them(server, endpoint, field, value):
    body = (
        {"prompt": "Hi", "max_tokens": 2}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = httpx.post(
        f"{server.url}{path}", json={**body, field: value}, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_best_of_below_n_or_streamed_is_refused(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body in ({"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}):
        response = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body}, headers=headers, timeout=60
        )
        assert response.status_code == 400 and response.json()["error"]["param"] in ("best_of", None), response.text
