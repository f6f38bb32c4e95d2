"""Prefix caching inside the engine: hits change nothing but the work done."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(tiny_model_dir, cache: str, **overrides):
    settings = {
        "model__path": tiny_model_dir,
        "model__dtype": "float32",
        "model__max_model_len": 256,
        "cache__num_blocks": 128,
        "prefix_cache__name": cache,
        **overrides,
    }
    return LLM("baseline", **settings)


def _capture_logits(llm):
    """Record the logits rows the sampler sees."""
    captured = []
    original = llm.engine.sampler.sample

    def sample(logits, requests):
        captured.append(logits.clone())
        return original(logits, requests)

    llm.engine.sampler.sample = sample
    return captured


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_prefix_hit_gives_same_logits_as_miss(tiny_model_dir, cache):
    shared = list(range(300, 340))  # 40 tokens: 2 full blocks of 16 are cacheable
    prompt = shared + [7, 8, 9, 10, 11]
    cached = _llm(tiny_model_dir, cache)
    cached.generate([shared + [1, 2, 3]], GREEDY)
    logits_hit = _capture_logits(cached)
    hit = cached.generate([prompt], GREEDY)[0]
    assert hit.metrics.num_cached_prompt_tokens == 32
    uncached = _llm(tiny_model_dir, "none")
    logits_miss = _capture_logits(uncached)
    miss = uncached.generate([prompt], GREEDY)[0]
    assert hit.token_ids == miss.token_ids
    for a, b in zip(logits_hit, logits_miss):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("cache", "block_size", "expected"), [("radix", 1, 37), ("hash", 16, 32)])
def test_shared_prefix_of_37_tokens_is_reused(tiny_model_dir, cache, block_size, expected):
    shared = list(range(500, 537))
    llm = _llm(tiny_model_dir, cache, cache__block_size=block_size, cache__num_blocks=2048 // block_size)
    llm.generate([shared + [1, 2, 3, 4]], GREEDY)
    second = llm.generate([shared + [9, 8, 7, 6]], GREEDY)[0]
    assert second.metrics.num_cached_prompt_tokens == expected


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_multi_turn_chat_reuses_turn_one_and_matches_no_cache(tiny_model_dir, cache):
    turn1 = [{"role": "user", "content": "Name three rivers in Europe and say which is longest."}]
    outputs = {}
    for name in ("none", cache):
        llm = _llm(tiny_model_dir, name)
        first = llm.generate([turn1], GREEDY)[0]
        turn2 = turn1 + [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And which one flows through Vienna?"},
        ]
        second = llm.generate([turn2], GREEDY)[0]
        outputs[name] = (first.token_ids, second.token_ids, second.metrics.num_cached_prompt_tokens)
    assert outputs[cache][:2] == outputs["none"][:2]
    assert outputs[cache][2] >= 32 and outputs["none"][2] == 0


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_eviction_under_a_tiny_pool_keeps_outputs_and_conserves_blocks(tiny_model_dir, cache):
    groups = [list(range(1000 + 100 * g, 1048 + 100 * g)) for g in range(8)]
    prompts = [groups[i % 8] + [i + 1, i + 2] for i in range(24)]
    reference = _llm(tiny_model_dir, "none", cache__num_blocks=256).generate(prompts, GREEDY)
    # 24 usable blocks: fewer than the 8 groups' prefixes (3 blocks each) plus the running requests need, so entries
    # get evicted.
    small = _llm(tiny_model_dir, cache, model__max_model_len=128, cache__num_blocks=25)
    outputs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = small.engine.prefix_cache.stats
    assert stats.evicted_blocks > 0 and stats.hit_tokens > 0
    small.engine.check_idle()
