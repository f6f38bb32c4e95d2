"""A GGUF file's model config completed where transformers' GGUF config mapping stops short, from what llama.cpp's
converter writes into the file: without these, the model a file loads as is not the one it was converted from. And
the tokens generation ends at, as llama.cpp takes them (``end_of_generation_ids``).

- a mixture's expert width (``expert_feed_forward_length``) and a head's width (``attention.key_length``: the qwen3
  mapping leaves Qwen3's default of 128), where the mapping leaves the config class's defaults;
- Llama 3's RoPE scaling, which the converter stores as per-pair divisors of the frequencies (the tensor
  ``rope_freqs``), put back as the ``llama3`` parameters that give those divisors; a Llama file's linear scaling and a
  Qwen2 or Qwen3 file's YaRN, stored as metadata;
- Gemma 3's linear RoPE scaling of the global layers (``rope.scaling.type``, ``rope.scaling.factor``), and its
  attention scale, which the file does not store;
- Phi-3's rotated share of each head (``rope.dimension_count``), sliding window and LongRoPE (the tensors
  ``rope_factors_long`` and ``rope_factors_short``, the original context ``rope.scaling.original_context_length``);
- gpt-oss's sliding window (``attention.sliding_window``) and YaRN (type, factor, original context; the ramp not
  truncated, as every gpt-oss checkpoint sets it), which transformers' gpt-oss mapping fails to read
  (``TRANSFORMERS_UNREADABLE``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# What ``complete_config`` adds, versioned: a converted folder in the cache carries the version it was made with, so
# one made before a completion was added is made again.
VERSION = 6

# Token texts llama.cpp ends generation at in any file, beside the eos, eot and eom ids the file names: the end of a
# turn in the chat formats of Llama 3, ChatML (Qwen), Phi-3, Gemma, gpt-oss's harmony and others.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# Architectures whose files may carry linear or YaRN RoPE scaling as metadata (``rope.scaling.type``, ``.factor``,
# ``.original_context_length``): llama.cpp's converter writes a Llama checkpoint's linear scaling and a Qwen2 or Qwen3
# checkpoint's YaRN (Qwen's long-context settings).
SCALED_ROPE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")

# Metadata transformers' GGUF config reader reads wrongly, by key prefix: its gpt-oss reader takes the first part of
# each ``rope.scaling.*`` field (its key's length) for the value and fails on it. A conversion hides these keys from
# transformers (``infer.model.loader``) and ``complete_config`` reads them.
TRANSFORMERS_UNREADABLE = ("gpt-oss.rope.scaling.",)

# Llama 3.1-3.3's RoPE scaling parameters beside the factor (Llama 3.1 and 3.3 scale by 8, 3.2 by 32).
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def complete_config(config: Any, path: Path) -> None:
    """Complete ``config`` (transformers' config of the GGUF file at ``path``) in place."""
    from infer.model.gguf_blocks import gguf_header

    file = gguf_header(path)
    metadata, arch = file.metadata, file.architecture
    expert_width = metadata.get(f"{arch}.expert_feed_forward_length")
    if expert_width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(expert_width)
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)  # qwen3's mapping leaves the class default (128)
    if arch == "llama" and "rope_freqs.weight" in file.tensors:
        _llama3_rope(config, tensor_values(file, "rope_freqs.weight"), path.name)
    elif arch in SCALED_ROPE_ARCHITECTURES and metadata.get(f"{arch}.rope.scaling.type") in ("linear", "yarn"):
        _scaled_rope(config, metadata, arch)
    elif arch == "gemma3":
        _gemma3(config, metadata)
    elif arch == "phi3":
        _phi3(config, file)
    if arch == "gpt-oss":
        _gpt_oss(config, metadata)


def end_of_generation_ids(tokenizer: Any, path: Path) -> list[int]:
    """The token ids generation ends at for the GGUF file at ``path`` (``tokenizer`` its tokenizer), as llama.cpp's
    end-of-generation set: the eos, eot and eom ids the file names, and every token whose text is in
    ``END_OF_GENERATION_TEXTS``. A file names one eos id where the HF model's generation config lists the end of a chat
    turn too (Gemma 3's ``<end_of_turn>``, Phi-3's ``<|end|>``): without it a chat reply would run on into the next
    turn."""
    from infer.model.gguf_blocks import gguf_header

    metadata = gguf_header(path).metadata
    ids = {int(metadata[key]) for key in END_OF_GENERATION_KEYS if key in metadata}
    vocabulary = tokenizer.get_vocab()
    ids.update(vocabulary[text] for text in END_OF_GENERATION_TEXTS if text in vocabulary)
    return sorted(ids)


def tensor_values(file: Any, name: str) -> np.ndarray:
    """A float32 tensor of the file, as a flat array."""
    return file.data(file.tensors[name]).view(np.float32).ravel().copy()


def llama3_divisors(theta: float, dim: int, parameters: Mapping[str, float]) -> np.ndarray:
    """What Llama 3's RoPE scaling divides each pair's frequency by (transformers' ``llama3`` rope type): 1 for the
    pairs that turn fast (wavelengths below the original context over ``high_freq_factor``), ``factor`` for the slow
    ones (above the context over ``low_freq_factor``), a blend between."""
    wavelength = 2 * math.pi / _inverse_frequencies(theta, dim)
    factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
    original = parameters["original_max_position_embeddings"]
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """Each rotary pair's unscaled frequency, in float32 as transformers and llama.cpp's converter compute it."""
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float64)


def _llama3_rope(config: Any, divisors: np.ndarray, name: str) -> None:
    """The ``llama3`` RoPE parameters whose divisors are the file's: Llama 3's published ones with the file's factor
    (its largest divisor), else the ones its blended pairs solve for; none found (a file of another scaling), the
    positions rotate unscaled, with a warning."""
    from infer.model.rotary import rope_parameters

    theta = float(rope_parameters(config)["rope_theta"])
    dim = 2 * len(divisors)
    factor = float(divisors.max())
    if factor <= 1.0:
        return
    candidates = [{"factor": factor, **LLAMA3_DEFAULTS}]
    blended = [index for index, divisor in enumerate(divisors) if 1.0 + 1e-6 < divisor < factor * (1 - 1e-6)]
    if len(blended) >= 2:  # smooth = original / wavelength - low with high = low + 1: two pairs give both
        turns = _inverse_frequencies(theta, dim)[blended] / (2 * math.pi)  # 1 / wavelength
        smooth = (1.0 / divisors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
        original, intercept = np.polyfit(turns, smooth, 1)
        low = -intercept
        candidates.append(
            {
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": low + 1.0,
                "original_max_position_embeddings": float(original),
            }
        )
    for parameters in candidates:
        if np.allclose(llama3_divisors(theta, dim, parameters), divisors, rtol=1e-4, atol=0.0):
            config.rope_parameters = {"rope_type": "llama3", "rope_theta": theta, **parameters}
            return
    logger.warning("%s: its rope_freqs are not Llama 3's RoPE scaling; its positions rotate unscaled", name)


def _scaled_rope(config: Any, metadata: Mapping[str, object], arch: str) -> None:
    """A file's linear or YaRN RoPE scaling from its metadata (YaRN's ramp and attention factor are transformers'
    defaults for the factor and original context, as llama.cpp's)."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    parameters.update(
        rope_type=metadata[f"{arch}.rope.scaling.type"], factor=float(metadata[f"{arch}.rope.scaling.factor"])
    )
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if parameters["rope_type"] == "yarn" and original:
        parameters["original_max_position_embeddings"] = int(original)
    config.rope_parameters = parameters


def _gpt_oss(config: Any, metadata: Mapping[str, object]) -> None:
    """A gpt-oss file's sliding window (transformers' mapping looks for it under another key) and its YaRN's ramp,
    not truncated in any gpt-oss checkpoint (the file does not store the choice)."""
    window = metadata.get("gpt-oss.attention.sliding_window")
    if window is not None:
        config.sliding_window = int(window)
    parameters = dict(config.rope_parameters or {})
    if parameters.get("rope_type") == "yarn":
        parameters["truncate"] = False
        config.rope_parameters = parameters


def _gemma3(config: Any, metadata: Mapping[str, object]) -> None:
    """A Gemma 3 file's global layers' linear RoPE scaling (Gemma 3 4B-27B scale by 8), and its attention scale,
    which the file does not store: llama.cpp takes hidden / heads for the 62-layer model (Gemma 3 27B: 168, against
    its head_dim of 128) and head_dim for the others, as their HF configs set ``query_pre_attn_scalar``."""
    parameters = dict(config.rope_parameters)
    if metadata.get("gemma3.rope.scaling.type") == "linear":
        full = dict(parameters.get("full_attention") or {})
        full.update(rope_type="linear", factor=float(metadata["gemma3.rope.scaling.factor"]))
        parameters["full_attention"] = full
        config.rope_parameters = parameters
    if config.num_hidden_layers == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def _phi3(config: Any, file: Any) -> None:
    """A Phi-3 file's rotated share of each head, sliding window and LongRoPE: without them a Phi-4-mini file
    rotated every dimension with the plain base frequencies."""
    metadata = file.metadata
    rope = {
        "rope_type": "default",
        "rope_theta": float(metadata.get("phi3.rope.freq_base", 10000.0)),
        "partial_rotary_factor": 1.0,
    }
    rotated = metadata.get("phi3.rope.dimension_count")
    if rotated:
        rope["partial_rotary_factor"] = int(rotated) / (config.hidden_size // config.num_attention_heads)
    config.sliding_window = int(metadata.get("phi3.attention.sliding_window") or 0) or None
    if "rope_factors_long.weight" in file.tensors and "rope_factors_short.weight" in file.tensors:
        original = int(metadata["phi3.rope.scaling.original_context_length"])
        rope.update(
            rope_type="longrope",
            long_factor=tensor_values(file, "rope_factors_long.weight").tolist(),
            short_factor=tensor_values(file, "rope_factors_short.weight").tolist(),
            original_max_position_embeddings=original,
        )
        config.original_max_position_embeddings = original
    config.rope_parameters = rope
