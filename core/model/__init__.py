"""The model: infer's decoder in torch, configured per model family, one concept a file.

- ``architecture``: the model plugin contract (``ModelArchitecture``: which checkpoints a family serves, its config
  adapter to ``DecoderSpec``, its weight-name map, each layer's attention).
- ``spec``: ``DecoderSpec``, the decoder as a family configures it (and its RoPE tables, ``RotaryTable``).
- ``layers``: the layer kinds (uninitialized ``Linear``/``Embedding``, ``RMSNorm``, the gated activations).
- ``rotary``: RoPE settings, inverse frequencies (YaRN's computed here, transformers' other scaling types),
  cos/sin tables.
- ``ops``: ``StepOps``, a step's small ops in torch or in infer's CPU kernels.
- ``decoder``: attention, MLP, decoder layer and ``CausalLM``.
- ``hf_weights``: loading HF-named tensors into the decoder's fused layout.
"""

from infer.model.architecture import ModelArchitecture, UnsupportedModelError
from infer.model.decoder import MLP, Attention, CausalLM, DecoderLayer
from infer.model.layers import Embedding, Linear, RMSNorm, gated_activation, silu_and_mul
from infer.model.ops import StepOps
from infer.model.rotary import (
    RotaryEmbedding,
    apply_rotary,
    default_inverse_frequencies,
    rope_inverse_frequencies,
    rope_parameters,
)
from infer.model.spec import DecoderSpec, RotaryTable

__all__ = [
    "MLP",
    "Attention",
    "CausalLM",
    "DecoderLayer",
    "DecoderSpec",
    "Embedding",
    "Linear",
    "ModelArchitecture",
    "RMSNorm",
    "RotaryEmbedding",
    "RotaryTable",
    "StepOps",
    "UnsupportedModelError",
    "apply_rotary",
    "default_inverse_frequencies",
    "gated_activation",
    "rope_inverse_frequencies",
    "rope_parameters",
    "silu_and_mul",
]
