"""The model: a Llama-family decoder in torch, one concept a file.

- ``layers``: the layer kinds (uninitialized ``Linear``/``Embedding``, ``RMSNorm``, SwiGLU's ``silu_and_mul``).
- ``rotary``: RoPE settings, inverse frequencies (transformers' scaling types), cos/sin tables.
- ``ops``: ``StepOps``, a step's small ops in torch or in infer's CPU kernels.
- ``llama``: attention, MLP, decoder layer and ``LlamaForCausalLM``.
- ``hf_weights``: HF checkpoint names and the fused layout.
"""

from infer.model.layers import Embedding, Linear, RMSNorm, silu_and_mul
from infer.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from infer.model.ops import StepOps
from infer.model.rotary import (RotaryEmbedding, apply_rotary, default_inverse_frequencies, rope_inverse_frequencies,
                                rope_parameters)

__all__ = ["MLP", "Attention", "DecoderLayer", "Embedding", "Linear", "LlamaForCausalLM", "RMSNorm",
           "RotaryEmbedding", "StepOps", "apply_rotary", "default_inverse_frequencies", "rope_inverse_frequencies",
           "rope_parameters", "silu_and_mul"]
