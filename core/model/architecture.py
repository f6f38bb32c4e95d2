"""The model plugin contract: a model family tells infer which Hugging Face checkpoints it serves, how their config
maps onto infer's decoder (``DecoderSpec``), how their tensor names map onto its parameters, and what each layer's
attention needs (``infer.attention.LayerAttention``), so the KV pool, the prefix caches and every attention backend
learn a layer's needs from the model.

A family registers its ``ModelArchitecture`` subclass with the ``register_models`` hook; the loader picks the one
that serves a checkpoint's ``model_type`` (or ``architectures``) and builds ``infer.model.CausalLM`` from the spec
the family's ``decoder_spec`` returns. The base class adapts a Llama-shaped config; a family overrides what differs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from infer.attention import FULL_ATTENTION, LayerAttention
from infer.model.decoder import CausalLM
from infer.model.hf_weights import WeightMap
from infer.model.rotary import rope_inverse_frequencies
from infer.model.spec import DecoderSpec, RotaryTable

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class UnsupportedModelError(ValueError):
    """A checkpoint uses something its family's plugin does not implement; the message names it in one line."""


class ModelArchitecture(WeightMap):
    """A model family (contract of plugin kind ``model``). Subclass it, set ``model_types`` (HF ``model_type``
    values) and/or ``architectures`` (entries of HF ``config.architectures``), and override what differs from a
    Llama: ``decoder_spec`` (the config adapter), and the weight-name map it inherits from ``WeightMap``
    (``fused_projections``, ``renamed``, ``hf_names``, ``convert_weight``). Everything is a class method: the family is
    a description, not a stateful object.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    # HF config fields that change the computation and that this family does not implement when set (truthy).
    unsupported_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def serves(cls, hf_config: Any) -> bool:
        """Whether this family runs the checkpoint of ``hf_config`` (its ``model_type`` or an architecture name)."""
        names = set(getattr(hf_config, "architectures", None) or ())
        return getattr(hf_config, "model_type", None) in cls.model_types or bool(names & set(cls.architectures))

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        """The decoder of ``hf_config``, its RoPE tables sized for ``max_positions`` (default: the config's
        ``max_position_embeddings``). Raises ``UnsupportedModelError`` naming what this family cannot run."""
        set_fields = [field for field in cls.unsupported_fields if getattr(hf_config, field, None)]
        if set_fields:
            raise UnsupportedModelError(
                f"{hf_config.model_type} config sets {', '.join(set_fields)}, which infer does not implement"
            )
        activation = getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", "silu")
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported activation {activation!r} in the model config; supported: {', '.join(ACTIVATIONS)}"
            )
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        max_positions = max_positions or hf_config.max_position_embeddings
        bias = bool(getattr(hf_config, "attention_bias", False))
        windows = layer_windows(hf_config)
        tables, layer_tables = cls.rotary_tables(hf_config, head_dim, max_positions)
        return DecoderSpec(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_positions=max_positions,
            rotary=tables,
            layer_rotary=layer_tables,
            layer_attention=tuple(
                FULL_ATTENTION if window is None else LayerAttention(window=window) for window in windows
            ),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=bias,
            output_bias=bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            activation=ACTIVATIONS[activation],
        )

    @classmethod
    def rotary_tables(
        cls, hf_config: Any, head_dim: int, max_positions: int
    ) -> tuple[tuple[RotaryTable, ...], tuple[int, ...]]:
        """The RoPE tables and each layer's index into them: one table for every layer (the config's RoPE type,
        ``partial_rotary_factor`` honoured; LongRoPE's factors chosen once from ``max_positions``)."""
        inverse, scaling = rope_inverse_frequencies(hf_config, head_dim, max_positions=max_positions)
        return (RotaryTable(inverse, scaling),), (0,) * hf_config.num_hidden_layers

    @classmethod
    def build(
        cls,
        hf_config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> CausalLM:
        """infer's model for ``hf_config``, weights uninitialized (fill them with ``CausalLM.load_hf_state_dict``)."""
        return CausalLM(
            cls.decoder_spec(hf_config, max_positions), dtype=dtype, device=device, weight_map=cls, hf_config=hf_config
        )

    @classmethod
    def from_hf(
        cls, hf_model_or_config: Any, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> CausalLM:
        """infer's model for a HF config (weights uninitialized) or a HF model (its weights copied), in eval mode."""
        if isinstance(hf_model_or_config, torch.nn.Module):
            model = cls.build(hf_model_or_config.config, dtype=dtype, device=device)
            model.load_hf_state_dict(hf_model_or_config.state_dict())
        else:
            model = cls.build(hf_model_or_config, dtype=dtype, device=device)
        return model.eval()


def layer_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window from a HF config: ``layer_types`` names the sliding layers where the config has it
    (Qwen2/3, Gemma 3, gpt-oss); otherwise a ``sliding_window`` applies to every layer (Mistral, Phi-3) unless
    ``use_sliding_window`` is false."""
    layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * layers
