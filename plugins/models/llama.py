"""The Llama decoder and the families that are Llama but for their config: Mistral (a sliding window on every
layer) and Qwen2 (biases on the Q/K/V projections)."""

from __future__ import annotations

from typing import Any

from infer.model import DecoderSpec, ModelArchitecture


class LlamaArchitecture(ModelArchitecture):
    """Llama, Mistral and Qwen2 checkpoints (``ModelArchitecture``'s defaults are Llama's)."""

    model_types = ("llama", "mistral", "qwen2")
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        spec = super().decoder_spec(hf_config, max_positions)
        if hf_config.model_type == "qwen2":
            # Qwen2 configs have no attention_bias field: Q/K/V always carry a bias, the output projection never.
            spec = spec.replace(qkv_bias=True, output_bias=False)
        return spec
