"""Scoring and biasing through ``infer.LLM``: ``prompt_logprobs`` equal transformers' log-softmax at every prompt
position (chunked prefill and a warm prefix cache included), ``max_tokens=0`` scores without generating, and
``logit_bias`` steers greedy, sampled and drafted decoding alike."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.sampling_params import SamplingParams
from infer.testing.models import load_hf_reference

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see what lies beyond the hill."


def tiny_llm(model_dir: str, *extra: str) -> LLM:
    return LLM(
        "baseline",
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "cache.num_blocks=128",
            "cache.block_size=4",
            *extra,
        ],
    )


def hf_prompt_logprobs(model_dir: str, token_ids: list[int]) -> list[float]:
    hf_model, _ = load_hf_reference(model_dir)
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return [float(log_probs[p - 1, token_ids[p]]) for p in range(1, len(token_ids))]


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("scheduler.max_num_batched_tokens=8",),
        ("prefix_cache.name=radix",),
        ("prefix_cache.name=hash", "scheduler.max_num_batched_tokens=8"),
    ],
)
def test_prompt_logprobs_match_transformers_at_every_position(tiny_model_dir, extra):
    with tiny_llm(tiny_model_dir, *extra) as llm:
        # The same prompt once without prompt logprobs first: a prefix cache then holds its blocks.
        llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))
        output = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    expected = hf_prompt_logprobs(tiny_model_dir, output.prompt_token_ids)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    got = [entry["logprob"] for entry in output.prompt_logprobs[1:]]
    assert got == pytest.approx(expected, abs=1e-4)
    for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:]):
        assert entry["token_id"] == token and len(entry["top"]) == 3
        assert entry["top"][0][1] >= entry["logprob"] - 1e-6


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_model_dir):
    with tiny_llm(tiny_model_dir) as llm:
        output = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))[0]
    assert [sample.token_ids for sample in output.outputs] == [[], []]
    assert {sample.finish_reason for sample in output.outputs} == {"length"}
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)


def greedy_first_tokens(llm: LLM, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, **params))[0].token_ids


@pytest.mark.parametrize("extra", [(), ("drafter.name=ngram", "drafter.num_speculative_tokens=3")])
def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(tiny_model_dir, extra):
    forced = 1234
    with tiny_llm(tiny_model_dir, *extra) as llm:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            assert greedy_first_tokens(llm, logit_bias={forced: 100}, **sampling) == [forced] * 6
            free = greedy_first_tokens(llm, **sampling)
            banned = greedy_first_tokens(llm, logit_bias={token: -100 for token in set(free)}, **sampling)
            assert not set(banned) & set(free)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_model_dir):
    with tiny_llm(tiny_model_dir) as llm:
        output = llm.generate([PROMPT], SamplingParams(max_tokens=2, logit_bias={10**6: 5}))[0]
    assert output.finish_reason == "error" and "logit_bias" in output.error


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"17": -100}).logit_bias == {17: -100}
