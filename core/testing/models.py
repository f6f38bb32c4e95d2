"""Models for tests, in infer's own suite and in plugin authors': tiny random Llamas the whole engine can load, and
the HF transformers reference the oracle tests compare against. Needs no pytest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from infer.model.loader import DEFAULT_MODEL, hf_checkpoint_dir, hf_model_dir


def load_hf_reference(path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The transformers model (eval, CPU) and tokenizer for a model path, the oracle tests compare against: a GGUF
    file converted by transformers (``hf_checkpoint_dir``), which infer reads itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = hf_checkpoint_dir(path)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return hf_model.eval(), AutoTokenizer.from_pretrained(model_dir)


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` small enough for unit tests, sharing SmolLM2's vocabulary and special tokens so its
    tokenizer works. ``overrides`` replace any field."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        # Wider than HF's 0.02 so attention is far from uniform and logits rarely tie: tests then see mistakes.
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaConfig(**{**fields, **overrides})


def make_tiny_model_dir(destination: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialized tiny Llama (``tiny_llama_config(**overrides)``) with SmolLM2's tokenizer as a HF
    folder the whole engine can load. The tokenizer comes from the default model (fetched and converted once)."""
    from transformers import AutoTokenizer
    from transformers import LlamaForCausalLM as HfLlamaForCausalLM

    destination = Path(destination)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = HfLlamaForCausalLM(tiny_llama_config(**overrides))
    hf_model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(hf_model_dir(DEFAULT_MODEL)).save_pretrained(destination)
    return destination
