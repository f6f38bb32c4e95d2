"""Every built-in model family through the model plugin suite against HF transformers (tiny random-weight models
saved by transformers from the family's config class), and a planted bug in each that the suite must catch."""

from __future__ import annotations

import pytest

from infer.testing import ModelConformance


class TestLlama(ModelConformance):
    impl_name = "llama"
    hf_model_class = "LlamaForCausalLM"
    config_fields = {"head_dim": 16, "tie_word_embeddings": True}


@pytest.mark.slow  # the llama family's sliding window; Gemma 3 covers windows in the default run
class TestMistral(ModelConformance):
    impl_name = "llama"
    hf_model_class = "MistralForCausalLM"
    config_fields = {"head_dim": 16, "sliding_window": 8}


@pytest.mark.slow  # the llama family's biases
class TestQwen2(ModelConformance):
    impl_name = "llama"
    hf_model_class = "Qwen2ForCausalLM"
    config_fields = {"tie_word_embeddings": True}


class TestQwen3(ModelConformance):
    impl_name = "qwen3"
    hf_model_class = "Qwen3ForCausalLM"
    # head_dim explicit and wider than hidden / heads (as Qwen3-0.6B's 16 x 128 over 1024)
    config_fields = {
        "head_dim": 32,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }


class TestGemma3(ModelConformance):
    impl_name = "gemma3"
    hf_model_class = "Gemma3ForCausalLM"
    config_fields = {
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "num_hidden_layers": 3,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    }


class TestPhi3(ModelConformance):
    impl_name = "phi3"
    hf_model_class = "Phi3ForCausalLM"
    # Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE (short factors below the original length).
    config_fields = {
        "sliding_window": 12,
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "original_max_position_embeddings": 256,
        },
    }


def test_longrope_factors_are_one_choice_for_every_request(tmp_path):
    """Past the original context (model.max_model_len 512 > 256) every request rotates by the long factors, so a
    short request's tokens do not depend on a long one sharing its batch (and differ from the short factors')."""
    from infer.testing.model import random_prompt, save_tiny_model

    model_dir = save_tiny_model(TestPhi3.hf_model_class, TestPhi3.tiny_config(), tmp_path)
    suite = TestPhi3()
    short, long = random_prompt(20, seed=1), random_prompt(300, seed=2)
    with suite.engine(model_dir, model__max_model_len=512) as llm:
        alone = suite.engine_greedy(llm, [short])[0]
        together = suite.engine_greedy(llm, [short, long])[0]
    with suite.engine(model_dir) as llm:  # max_model_len 256: the short factors
        short_factors = suite.engine_greedy(llm, [short])[0]
    assert alone == together
    assert alone != short_factors


# -- planted bugs: each must move the logits beyond the suite's tolerance ---------------------------------------------


def test_a_wrong_rope_base_fails_the_suite(tmp_path):
    from infer.model import RotaryTable, default_inverse_frequencies
    from infer.plugins.models.qwen3 import Qwen3Architecture

    class WrongBase(Qwen3Architecture):
        @classmethod
        def rotary_tables(cls, hf_config, head_dim, max_positions):
            tables, layers = super().rotary_tables(hf_config, head_dim, max_positions)
            return (RotaryTable(default_inverse_frequencies(10_000.0, head_dim)),), layers

    assert_planted_bug_fails(TestQwen3, tmp_path, WrongBase)


def test_q_and_k_norms_after_rope_fail_the_suite(tmp_path, monkeypatch):
    from infer.model import decoder
    from infer.plugins.models.qwen3 import Qwen3Architecture

    def norms_after_rope(self, hidden, step):
        tokens = hidden.shape[0]
        qkv, heads = step.ops.rotate(self.qkv_proj(hidden), self.num_heads + self.num_kv_heads, self.head_dim)
        qkv = qkv.clone()
        qkv[:, : heads.shape[1] * self.head_dim] = heads.reshape(tokens, -1)
        qkv = step.ops.head_norms(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(step.attend(self.layer_index, q, k, v).reshape(tokens, self.q_size))

    assert_planted_bug_fails(
        TestQwen3,
        tmp_path,
        Qwen3Architecture,
        plant=lambda: monkeypatch.setattr(decoder.Attention, "forward", norms_after_rope),
    )


def test_a_missing_norm_offset_fails_the_suite(tmp_path):
    from infer.plugins.models.gemma3 import Gemma3Architecture

    class NoOffset(Gemma3Architecture):
        @classmethod
        def convert_weight(cls, name, tensor):
            return tensor

    assert_planted_bug_fails(TestGemma3, tmp_path, NoOffset)


def test_a_window_off_by_one_fails_the_suite(tmp_path):
    from infer.attention import LayerAttention
    from infer.plugins.models.gemma3 import Gemma3Architecture

    class WiderWindow(Gemma3Architecture):
        @classmethod
        def decoder_spec(cls, hf_config, max_positions=None):
            spec = super().decoder_spec(hf_config, max_positions)
            layers = tuple(
                LayerAttention(window=None if layer.window is None else layer.window + 1, scale=layer.scale)
                for layer in spec.layer_attention
            )
            return spec.replace(layer_attention=layers)

    assert_planted_bug_fails(TestGemma3, tmp_path, WiderWindow)


def assert_planted_bug_fails(suite_class, tmp_path, architecture, plant=None) -> None:
    """The suite's logit check passes the family as it is and fails ``architecture`` (after ``plant()``)."""
    import torch
    import transformers

    from infer.testing.model import save_tiny_model

    model_dir = save_tiny_model(suite_class.hf_model_class, suite_class.tiny_config(), tmp_path)
    hf_model = getattr(transformers, suite_class.hf_model_class).from_pretrained(model_dir, dtype=torch.float32)
    suite = suite_class()
    correct = suite.logit_errors(suite.load(model_dir), hf_model.eval())
    if plant is not None:
        plant()
    planted = suite.logit_errors(suite.load(model_dir, architecture), hf_model)
    assert correct < suite.tolerance < planted, (correct, planted)


def test_a_model_no_family_serves_is_refused_in_one_line(tmp_path):
    import transformers
    from click.testing import CliRunner

    from infer.cli import main
    from infer.testing.model import save_tiny_model

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    model_dir = save_tiny_model("GPT2LMHeadModel", config, tmp_path)
    result = CliRunner().invoke(main, ["run", "baseline", f"model.path={model_dir}"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "'gpt2' model, which no installed model plugin serves" in error[0]
    assert "qwen3 (qwen3)" in error[0] and "llama (llama, mistral, qwen2)" in error[0]
