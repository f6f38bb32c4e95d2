"""Engine behaviour on a tiny random model: sampling reproducibility, bad input, n > 1, stops, aborts, metrics."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.config import ConfigError
from infer.sampling_params import SamplingParamsError

PROMPTS = [f"Tell me fact number {i} about the ocean, please." for i in range(16)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        "baseline", model__path=tiny_model_dir, model__dtype="float32", model__max_model_len=256, cache__num_blocks=256
    )


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(llm):
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i) for i in range(len(PROMPTS))
    ]
    batched = llm.generate(PROMPTS, params)
    alone = llm.generate([PROMPTS[5]], [params[5]])[0]
    assert alone.token_ids == batched[5].token_ids
    assert len({tuple(o.token_ids) for o in batched}) > 1  # different seeds do sample differently


def test_unseeded_sampling_differs_between_requests(llm):
    outputs = llm.generate([PROMPTS[0]] * 4, SamplingParams(max_tokens=8, temperature=1.0))
    assert len({tuple(o.token_ids) for o in outputs}) > 1


def test_over_long_prompt_is_refused_while_others_finish(llm):
    too_long = list(range(100, 400))  # 300 tokens >= max_model_len 256
    outputs = llm.generate([PROMPTS[0], too_long, PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0))
    assert outputs[1].finish_reason == "error"
    assert "max_model_len" in outputs[1].error and "300 tokens" in outputs[1].error
    assert [len(outputs[0].token_ids), len(outputs[2].token_ids)] == [4, 4]


def test_text_longer_than_any_tokenization_can_fit_is_refused_untokenized(llm, monkeypatch):
    engine = llm.engine
    too_big = "word " * (2 * engine.max_model_len * engine.max_token_bytes // 5 + 1)
    tokenized = []
    tokenizer = engine.tokenizer
    monkeypatch.setattr(
        engine,
        "tokenizer",
        type(
            "Spy",
            (),
            {
                "__call__": lambda self, text, **kwargs: tokenized.append(len(text)) or tokenizer(text, **kwargs),
                "__getattr__": lambda self, name: getattr(tokenizer, name),
            },
        )(),
    )
    outputs = llm.generate([too_big, PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
    assert outputs[0].finish_reason == "error" and "bytes of text" in outputs[0].error
    assert len(outputs[1].token_ids) == 2 and tokenized == [len(PROMPTS[0])]


def test_max_tokens_none_generates_until_the_context_ends(llm):
    prompt = list(range(1000, 1250))  # 250 tokens: room for 6 more
    output = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(output.token_ids) == 6 and output.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [7, 50, 10**9])
def test_max_tokens_past_the_context_is_refused_not_cut(llm, max_tokens):
    """One policy (OpenAI's): prompt + max_tokens over max_model_len is an error naming max_tokens (it was served
    with fewer tokens than asked, and a 200). The other prompts in the call still run; filling the context exactly is
    allowed."""
    prompt = list(range(1000, 1250))
    too_many = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    exactly = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    refused, filled = llm.generate([prompt, prompt], [too_many, exactly])
    assert refused.finish_reason == "error" and "max_tokens" in refused.error and "at most 6 tokens" in refused.error
    assert len(filled.token_ids) == 6 and filled.finish_reason == "length"


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(llm, temperature):
    """Below 1e-5 (vLLM's bound) a temperature samples greedily: dividing logits by 1e-40 overflowed them to inf and
    the softmax gave NaN probabilities."""
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tiny = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True))
    assert [output.token_ids for output in tiny] == [output.token_ids for output in greedy]
    assert SamplingParams(temperature=1e-5).greedy is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -3),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("temperature", -1.0),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("min_p", 2.0),
        ("n", 0),
        ("prompt_logprobs", 21),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field and field in str(error.value)


def test_unknown_config_key_names_the_path(tiny_model_dir):
    with pytest.raises(ConfigError) as error:
        LLM("baseline", model__path=tiny_model_dir, scheduler__max_num_seq=4)
    assert "scheduler.max_num_seq" in str(error.value) and "max_num_seqs" in str(error.value)


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = list(range(2000, 2100))  # 100 tokens = 6 full blocks of 16 + 4
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=4)
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    seen_shared = False
    while engine.has_unfinished():
        engine.step()
        seqs = engine.requests[request_id].seqs
        tables = [s.block_table for s in seqs if s.block_table]
        if len(tables) == 4:
            seen_shared |= all(t[:6] == tables[0][:6] for t in tables)
    output = engine._request_output(engine.requests[request_id])
    engine.release_request(request_id)
    assert seen_shared
    assert len(output.outputs) == 4 and len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0))[0]
    stop_at = free.token_ids[3]
    stopped = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at
    delayed = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at], min_tokens=10)
    )[0]
    assert len(delayed.token_ids) == 10 and stop_at not in delayed.token_ids


def test_stop_string_cuts_the_text(llm):
    free = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0))[0]
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), "need a non-blank stop string"
    stopped = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text)


def test_logprobs_of_chosen_tokens(llm):
    output = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    entries = output.outputs[0].logprobs
    assert len(entries) == 5
    for token, entry in zip(output.token_ids, entries):
        assert entry["token_id"] == token and len(entry["top"]) == 3
        assert entry["top"][0][0] == token  # greedy picks the most likely token
        assert entry["logprob"] == pytest.approx(entry["top"][0][1])


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[5], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.num_blocks_used > 0
    engine.abort(request_id)
    engine.release_request(request_id)
    assert engine.num_blocks_used == 0 and not engine.has_unfinished()


def test_metrics_are_reported(llm):
    output = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert output.metrics.ttft_s > 0 and output.metrics.tpot_s > 0
    assert output.metrics.num_prompt_tokens == len(output.prompt_token_ids)


def test_pool_too_small_for_max_model_len_refuses_to_start(tiny_model_dir):
    from infer.execution.kv_pool import KVPoolTooSmallError

    with pytest.raises(KVPoolTooSmallError, match="Largest max_model_len that fits: 64"):
        LLM("baseline", model__path=tiny_model_dir, model__max_model_len=256, cache__num_blocks=5)


def test_a_block_id_outside_the_pool_is_refused_naming_the_plugins(tiny_model_dir, monkeypatch):
    """infer's C kernels trust the block tables (an out-of-pool id read or wrote outside the pool and crashed the
    process): the runner refuses such a step first, naming the plugins that hand blocks out."""
    from infer.execution.runner import BlockTableError

    llm = LLM(
        "baseline", model__path=tiny_model_dir, model__dtype="float32", model__max_model_len=256, cache__num_blocks=64
    )
    engine = llm.engine
    allocate = engine.allocator.allocate
    monkeypatch.setattr(engine.allocator, "allocate", lambda n: [b + 1000 for b in allocate(n)])
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(
        BlockTableError,
        match=r"block 10\d\d, outside the KV pool's 64 blocks.*allocator 'paged' or "
        r"prefix cache 'none'",
    ):
        engine.step()
    monkeypatch.undo()
    seq = engine.running[0] if engine.running else engine.waiting[0]
    seq.block_table = [b - 1000 for b in seq.block_table]  # put the real blocks back so the engine ends idle
    engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    engine.release_request(seq.request_id)


def test_samples_beyond_max_num_seqs_share_the_prompt_after_the_first_finishes(tiny_model_dir):
    """n above max_num_seqs: the first sample computes the prompt and finishes; the later ones, admitted after it,
    still share its computed blocks (they recomputed the whole prompt each: n x 96 tokens instead of 96 + n x 16)."""
    llm = LLM(
        "baseline",
        model__path=tiny_model_dir,
        model__dtype="float32",
        model__max_model_len=256,
        cache__num_blocks=64,
        scheduler__max_num_seqs=2,
    )
    prompt = list(range(1000, 1096))  # 6 full blocks of 16
    output = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0, seed=5, n=6))[0]
    assert len(output.outputs) == 6
    # The leader computes all 96 tokens; each follower shares 5 blocks (80 tokens: the last prompt token is always
    # computed) and computes the last 16.
    assert llm.engine.stats.num_prefill_tokens_computed == 96 + 5 * 16


def stream_and_whole(llm, prompt, params) -> tuple[str, str, list[int]]:
    """A request run step by step through the server's incremental updates: the streamed text, the final text and
    the token ids."""
    from infer.serve.updates import RequestProgress

    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    request = engine.requests[request_id]
    progress = RequestProgress(1, lambda token: engine.tokenizer.decode([token]))
    streamed = ""
    while not request.finished:
        engine.step()
        update = progress.advance(engine, request)
        streamed += "".join(delta.text for delta in update.samples) if update else ""
    (seq,) = request.seqs
    engine.release_request(request_id)
    return streamed, engine.output_text(seq), list(seq.output_token_ids)


@pytest.mark.parametrize("where", ["before", "across", "after"])
def test_stop_strings_count_only_in_text_after_min_tokens_streamed_and_whole_alike(llm, where):
    """A stop string wholly in the first ``min_tokens`` tokens' text, or beginning there and ending after it, never
    cuts the output (the first cut it before); one wholly after them cuts it at its first such occurrence. The
    streamed text equals the whole text in each case."""
    from infer.engine.detokenizer import Detokenizer

    min_tokens = 6
    free = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    detokenizer = Detokenizer(llm.engine.tokenizer)
    text = detokenizer.update(free.token_ids)
    floor = detokenizer.text_start_of_token(min_tokens)  # the first min_tokens tokens' text ends here
    assert 3 <= floor <= len(text) - 8, "the free text is too short for the three cases"
    start = {"before": floor - 3, "across": floor - 2, "after": floor + 4}[where]
    stop = text[start : start + 3]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
    streamed, whole, token_ids = stream_and_whole(llm, PROMPTS[4], params)
    cut = text.find(stop, floor)
    if where == "after":
        assert 0 <= cut <= start
    else:
        assert text.find(stop) < floor, "an occurrence from before min_tokens was reached"
    if cut < 0:
        assert whole == text and token_ids == free.token_ids
    else:
        assert whole == text[:cut]
        assert token_ids == free.token_ids[: detokenizer.token_of_char(cut + len(stop) - 1) + 1]
    assert streamed == whole
