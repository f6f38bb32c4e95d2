"""The engine's greedy outputs with ``attention: triton`` (the CPU interpreter without CUDA) equal ``sdpa``'s."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = ["The quick brown fox", "A long time ago, in a galaxy far, far away, there lived", "Hello"]


def _outputs(tiny_model_dir, attention: str, **overrides):
    settings = {
        "model__path": tiny_model_dir,
        "model__dtype": "float32",
        "model__max_model_len": 128,
        "cache__num_blocks": 48,
        "attention__name": attention,
        **overrides,
    }
    llm = LLM("baseline", **settings)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_engine_outputs_equal_sdpa(tiny_model_dir, block_size):
    # max_num_batched_tokens 8 chunks the prompts, so cached-prefix prefill and mixed batches are exercised too.
    overrides = {
        "cache__block_size": block_size,
        "cache__num_blocks": 48 * 16 // block_size,
        "scheduler__max_num_batched_tokens": 8,
    }
    assert _outputs(tiny_model_dir, "triton", **overrides) == _outputs(tiny_model_dir, "sdpa", **overrides)
