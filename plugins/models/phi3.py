"""Phi-3, Phi-3.5 and Phi-4-mini: checkpoints whose Q/K/V and gate/up tensors come fused (``qkv_proj``,
``gate_up_proj``, in infer's order), a sliding window on every layer when the config sets one, partial rotary
(Phi-4-mini rotates 3/4 of each head) and LongRoPE, whose short or long factors are chosen once from
``model.max_model_len`` (long beyond ``original_max_position_embeddings``): one request's length never changes
another's rotation."""

from __future__ import annotations

from infer.model import ModelArchitecture


class Phi3Architecture(ModelArchitecture):
    """Phi-3 family checkpoints (``Phi3ForCausalLM``, ``model_type`` phi3)."""

    model_types = ("phi3",)
    architectures = ("Phi3ForCausalLM",)
    fused_projections = {}  # the checkpoint's tensors are already ours, one to one
