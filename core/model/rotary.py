"""Rotary position embeddings: the settings of a HF config, the inverse frequencies of every scaling type
transformers knows (YaRN computed here, the others through transformers' ``ROPE_INIT_FUNCTIONS``), and the
precomputed cos/sin tables a step indexes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE settings of a HF config as one dict with ``rope_theta``, ``rope_type`` and ``partial_rotary_factor``
    always present; ``layer_type`` picks a per-layer-type entry (Gemma 3: ``sliding_attention``,
    ``full_attention``).

    transformers 5 stores ``config.rope_parameters = {"rope_theta": ..., "rope_type": ...}`` (or one such dict per
    layer type); older versions store ``config.rope_theta`` plus an optional ``config.rope_scaling`` (whose type key
    is ``rope_type`` or ``type``).
    """
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(parameters.get(layer_type), Mapping):
        parameters = dict(parameters[layer_type])
    else:
        parameters.update(getattr(config, "rope_scaling", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    parameters.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    parameters["rope_type"] = parameters.get("rope_type") or parameters.get("type") or "default"
    return parameters


def default_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """Unscaled per-pair rotation speeds ``[dim // 2]`` (float32) for ``dim`` rotated features, exactly as
    transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def yarn_inverse_frequencies(config: Any, parameters: Mapping[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's per-pair rotation speeds ``[rotary_dim // 2]`` (float32) and its cos/sin factor, for ``parameters``
    (``rope_parameters``' dict of a ``yarn`` config), as transformers computes them (``_compute_yarn_parameters``).

    Pairs that turn more than ``beta_fast`` times over the original context keep their speed, pairs that turn fewer
    than ``beta_slow`` times are slowed by ``factor``, and a linear ramp over the pair index blends the two between
    them; ``truncate`` (default true; gpt-oss sets it false) rounds the ramp's ends outward to whole pairs. cos and
    sin are scaled by ``attention_factor``, else ``0.1 * ln(factor) + 1`` (with DeepSeek's ``mscale`` and
    ``mscale_all_dim``, the ratio of two such terms). ``factor`` missing: ``max_position_embeddings`` over the
    original context."""
    base = parameters["rope_theta"]
    dim = int(head_dim * parameters["partial_rotary_factor"])
    # Phi-3-style configs keep the original context beside the RoPE settings, and it wins there (as transformers').
    original = getattr(config, "original_max_position_embeddings", None) or parameters.get(
        "original_max_position_embeddings", config.max_position_embeddings
    )
    factor = parameters.get("factor") or config.max_position_embeddings / original
    scaling = parameters.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns ``turns`` times over original
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    speeds = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kept = 1 - ramp  # the share of each pair's original speed
    inverse = 1.0 / (factor * speeds) * (1 - kept) + 1.0 / speeds * kept
    return inverse, float(scaling)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inverse_frequencies(
    config: Any, head_dim: int, *, max_positions: int | None = None, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds ``[rotary_dim // 2]`` (float32; ``rotary_dim`` is ``head_dim`` times the config's
    ``partial_rotary_factor``) and the factor cos/sin are scaled by (1.0 but for ``yarn`` and ``longrope``), for the
    rope type of a HF config (of ``layer_type``'s entry where the config has one per layer type). ``yarn`` is
    ``yarn_inverse_frequencies``; the other scaled types come from transformers' ``ROPE_INIT_FUNCTIONS``
    (``linear``, ``llama3``, ``longrope``, ...), computed on the CPU like the reference. ``longrope`` takes its long
    factors when ``max_positions`` exceeds the original context and its short ones otherwise: one choice for the
    whole run, so one request's length never changes another's rotation. ``dynamic`` rescales with the sequence
    length at run time, which precomputed tables cannot do."""
    parameters = rope_parameters(config, layer_type)
    rope_type = parameters["rope_type"]
    if rope_type == "default":
        dim = int(head_dim * parameters["partial_rotary_factor"])
        return default_inverse_frequencies(parameters["rope_theta"], dim), 1.0
    if rope_type == "yarn":
        return yarn_inverse_frequencies(config, parameters, head_dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    supported = sorted({"default", *ROPE_INIT_FUNCTIONS} - {"dynamic"})
    if rope_type not in supported:
        raise ValueError(f"unsupported rope_type {rope_type!r} in the model config; supported: {', '.join(supported)}")
    options: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        options["seq_len"] = max_positions
    inverse, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **options)
    return inverse.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position below ``max_positions``; a step only indexes them.

    The sin table's first half is negated (``[-sin, sin]``) so that ``apply_rotary`` needs only a half swap, no
    negation."""

    def __init__(
        self, inverse_frequencies: torch.Tensor, max_positions: int, device: torch.device, scaling: float = 1.0
    ):
        super().__init__()
        self.rotary_dim = 2 * inverse_frequencies.numel()
        # Computed on the CPU whatever the device, so every device rotates by bit-identical angles.
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies)
        sin = angles.sin()
        cos = torch.cat((angles, angles), dim=-1).cos()
        sin = torch.cat((-sin, sin), dim=-1)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, ``[T, 1, rotary_dim]`` each (broadcast over heads), in ``dtype``."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., heads, head_dim]`` by ``RotaryEmbedding``'s tables (HF's half-split layout: pairs are
    (i, i + rotary_dim/2)): ``x * cos + swap_halves(x) * [-sin, sin]``, three kernels. Tables narrower than
    ``head_dim`` rotate the first ``rotary_dim`` features and pass the rest (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)
