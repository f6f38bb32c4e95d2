"""infer's YaRN RoPE tables against transformers' rope init, for the configs that use YaRN: Llama and Qwen3 long-context
settings, gpt-oss's (no truncation of the ramp), DeepSeek-style ``mscale``, an explicit ``attention_factor``, partial
rotary, and a factor left to ``max_position_embeddings`` over the original context."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from infer.model import rope_inverse_frequencies
from infer.model.rotary import yarn_inverse_frequencies

SHAPES = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
)

YARN_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **SHAPES,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 500_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        },
    ),
    # Qwen3's long-context setting (its model card: factor 4 over 32,768 positions)
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPES,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    ),
    # gpt-oss's: the ramp's ends not rounded to whole pairs
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPES, max_position_embeddings=131072),
    "llama_mscale": lambda: transformers.LlamaConfig(
        **SHAPES,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 40.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 24,
            "beta_slow": 2,
            "original_max_position_embeddings": 4096,
        },
    ),
    "qwen3_attention_factor": lambda: transformers.Qwen3Config(
        **SHAPES,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 2.0,
            "attention_factor": 1.25,
            "truncate": False,
            "original_max_position_embeddings": 2048,
        },
    ),
    "llama_partial_rotary": lambda: transformers.LlamaConfig(
        **SHAPES,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 8.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 1024,
        },
    ),
    "llama_implicit_factor": lambda: transformers.LlamaConfig(
        **SHAPES,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": None,
            "original_max_position_embeddings": 2048,
        },
    ),
}


@pytest.mark.parametrize("name", YARN_CONFIGS)
def test_yarn_tables_equal_transformers_rope_init(name):
    config = YARN_CONFIGS[name]()
    want, want_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    got, scaling = rope_inverse_frequencies(config, config.head_dim)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want.float()), (got - want).abs().max()
    assert scaling == want_scaling


def test_yarn_slows_the_slow_pairs_by_the_factor_and_keeps_the_fast_ones():
    """The ramp's behaviour, independent of transformers: the fastest pairs keep their speed, the slowest turn
    ``factor`` times slower, cos/sin are scaled by ``0.1 ln(factor) + 1``."""
    from infer.model import default_inverse_frequencies, rope_parameters

    config = YARN_CONFIGS["gpt_oss"]()
    inverse, scaling = yarn_inverse_frequencies(config, rope_parameters(config), config.head_dim)
    plain = default_inverse_frequencies(150_000.0, config.head_dim)
    assert torch.equal(inverse[:4], plain[:4])
    torch.testing.assert_close(inverse[-4:], plain[-4:] / 32.0)
    assert ((inverse <= plain) & (inverse >= plain / 32.0 * (1 - 1e-6))).all()
    assert scaling == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1.0)
