"""Qwen3 (dense): the Llama decoder with an RMSNorm over each query and key head before RoPE and an explicit
``head_dim`` (0.6B: 16 heads of 128 over a hidden size of 1024); the small sizes tie their embeddings."""

from __future__ import annotations

from typing import Any

from infer.model import DecoderSpec, ModelArchitecture


class Qwen3Architecture(ModelArchitecture):
    """Qwen3 checkpoints (``Qwen3ForCausalLM``)."""

    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        return super().decoder_spec(hf_config, max_positions).replace(head_norms=True)
