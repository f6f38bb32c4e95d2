"""Gemma 3 (text): sliding-window layers (5 local to 1 global by default) with their own RoPE table, an RMSNorm on
each query and key head, four norms a layer (input, attention output, before and after the MLP), GeGLU with
tanh-approximated GELU, embeddings scaled by sqrt(hidden), and scores scaled by ``query_pre_attn_scalar``.

Gemma's norms multiply by ``1 + w``: the weights are stored as ``1 + w`` at load (exact in float32, where
transformers also adds in float32), so infer's RMSNorm and its kernels serve them unchanged."""

from __future__ import annotations

from typing import Any

import torch

from infer.attention import LayerAttention
from infer.model import DecoderSpec, ModelArchitecture, RotaryTable, rope_inverse_frequencies

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3Architecture(ModelArchitecture):
    """Gemma 3 text checkpoints (``Gemma3ForCausalLM``, ``model_type`` gemma3_text)."""

    model_types = ("gemma3_text",)
    architectures = ("Gemma3ForCausalLM",)
    # Our pre-MLP norm is Llama's post_attention_layernorm; Gemma's post_attention_layernorm norms attention's output.
    renamed = {
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "attn_output_norm": "post_attention_layernorm",
        "mlp_output_norm": "post_feedforward_layernorm",
    }
    unsupported_fields = ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        spec = super().decoder_spec(hf_config, max_positions)
        scale = hf_config.query_pre_attn_scalar**-0.5
        layers = tuple(LayerAttention(window=layer.window, scale=scale) for layer in spec.layer_attention)
        return spec.replace(
            head_norms=True, output_norms=True, embedding_scale=hf_config.hidden_size**0.5, layer_attention=layers
        )

    @classmethod
    def rotary_tables(
        cls, hf_config: Any, head_dim: int, max_positions: int
    ) -> tuple[tuple[RotaryTable, ...], tuple[int, ...]]:
        """Two tables: the sliding layers' (local base) first, as most layers use it, then the global layers'."""
        types = list(hf_config.layer_types)
        kinds = sorted(set(types), key=lambda kind: kind != SLIDING)
        tables = tuple(
            RotaryTable(*rope_inverse_frequencies(hf_config, head_dim, max_positions=max_positions, layer_type=kind))
            for kind in kinds
        )
        return tables, tuple(kinds.index(kind) for kind in types)

    @classmethod
    def convert_weight(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return tensor.float() + 1.0
        return tensor
