"""Save random-weight models of the shapes CPU users run (Qwen3 0.6B, 1.7B, 4B and 8B, Llama 3.2 1B, Gemma 3 1B,
Phi-4-mini, a 3.3B Qwen3-MoE and its two dense twins, gpt-oss-20b) as HF folders, for ``infer bench`` against vLLM's CPU
backend on the same folder: with fixed output lengths (``ignore_eos``) throughput does not depend on the weights'
values. The tokenizer is SmolLM2's (its ids lie inside every family's vocabulary).

    python benchmarks/random_models.py qwen3-0.6b ~/models/qwen3-0.6b-random
    infer bench baseline model.path=~/models/qwen3-0.6b-random --baseline vllm --num-requests 64

gpt-oss-20b is written as OpenAI's checkpoint stores it, its experts in MXFP4 (``_blocks`` and ``_scales``; 13.8 GB in
all), a layer's tensors at a time: built in bf16 it would take 42 GB. ``--layers`` keeps the first layers of a shape
(a gpt-oss-20b of 4 layers fits this machine as bf16 weights too, for the two side by side).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def _qwen3(hidden: int, mlp: int, layers: int, heads: int, tied: bool) -> tuple[str, dict]:
    """A dense Qwen3 size: what differs between 0.6B and 8B, the rest shared (8 KV heads of 128, the vocabulary,
    40,960 positions, RoPE base 1e6)."""
    return (
        "Qwen3ForCausalLM",
        dict(
            hidden_size=hidden,
            intermediate_size=mlp,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tied,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    )


# The published configs' geometry (hidden, MLP width, layers, heads, KV heads, head_dim, vocabulary, RoPE).
SHAPES = {
    "qwen3-0.6b": _qwen3(hidden=1024, mlp=3072, layers=28, heads=16, tied=True),
    "qwen3-1.7b": _qwen3(hidden=2048, mlp=6144, layers=28, heads=16, tied=True),
    "qwen3-4b": _qwen3(hidden=2560, mlp=9728, layers=36, heads=32, tied=True),
    "qwen3-8b": _qwen3(hidden=4096, mlp=12288, layers=36, heads=32, tied=False),
    "llama3.2-1b": (
        "LlamaForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "gemma3-1b": (
        "Gemma3ForCausalLM",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            sliding_window=512,
            query_pre_attn_scalar=256,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        ),
    ),
    # Phi-4-mini: fused QKV and gate/up, partial rotary (96 of 128), LongRoPE from 4,096 positions. The factor lists'
    # values are made up (random weights): below 4,096 tokens the short factors, here 1, apply.
    "phi-4-mini": (
        "Phi3ForCausalLM",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=200064,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 4096,
                "short_factor": [1.0] * 48,
                "long_factor": [1.0 + 0.5 * index for index in range(48)],
            },
        ),
    ),
    # A CPU user's MoE: Qwen3-MoE's geometry (fine-grained experts, 4 routed per token) shrunk to 32 experts:
    # 3.3B weights (6.6 GB in bf16), 0.9B read per token (attention 0.25B, 4 experts 0.3B, the output head 0.31B).
    "qwen3-moe-3.3b": (
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    # OpenAI's gpt-oss-20b (config.json of openai/gpt-oss-20b): 24 layers alternating a 128-token window and full
    # attention, 32 experts of 2,880 x 2,880 with 4 routed per token, YaRN over 4,096 positions.
    "gpt-oss-20b": (
        "GptOssForCausalLM",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201088,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 12,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            swiglu_limit=7.0,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
    ),
}


# Dense twins of the MoE shape (its attention, embeddings and layers; one MLP a layer): as many parameters as a token
# activates (4 routed experts of 512 columns: an MLP of 2,048) and as many as the MoE holds (32 x 512: 16,384).
_MOE_ONLY = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob")
_DENSE = {key: value for key, value in SHAPES["qwen3-moe-3.3b"][1].items() if key not in _MOE_ONLY}
SHAPES["qwen3-moe-3.3b-dense-active"] = ("Qwen3ForCausalLM", {**_DENSE, "intermediate_size": 4 * 512})
SHAPES["qwen3-moe-3.3b-dense-total"] = ("Qwen3ForCausalLM", {**_DENSE, "intermediate_size": 32 * 512})


def save_random_model(
    shape: str, destination: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, layers: int | None = None
) -> Path:
    import transformers

    from infer.model.loader import DEFAULT_MODEL, hf_model_dir

    class_name, fields = SHAPES[shape]
    if layers is not None:
        fields = {**fields, "num_hidden_layers": layers}
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:layers]
    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    if class_name == "GptOssForCausalLM":
        write_mxfp4_gpt_oss(model_class, config, destination)
    else:
        with torch.device("cpu"):  # built in ``dtype``: a float32 copy of the MoE would need 13 GB
            model = model_class._from_config(config, dtype=dtype)
        model.save_pretrained(destination)
    transformers.AutoTokenizer.from_pretrained(hf_model_dir(DEFAULT_MODEL)).save_pretrained(destination)
    return destination


def write_mxfp4_gpt_oss(model_class, config, destination: Path) -> None:
    """A gpt-oss checkpoint of random weights as OpenAI's stores one: bf16 tensors (norms 1) beside MXFP4 experts
    (random codes, scales 2^-7 to 2^-4), one safetensors file a layer, the tensors named and shaped as transformers'
    model of ``config`` holds them (built on the meta device: nothing allocated)."""
    import json

    from safetensors.torch import save_file

    with torch.device("meta"):
        names = {name: tuple(tensor.shape) for name, tensor in model_class(config).state_dict().items()}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in names.items():
        parts = name.split(".")
        shard = f"layer-{int(parts[2]):02d}" if parts[1:2] == ["layers"] else "outer"
        tensors = shards.setdefault(shard, {})
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out] as MXFP4 of [out, in]
            experts, columns, rows = shape
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(120, 124, (experts, rows, columns // 32), dtype=torch.uint8)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    destination.mkdir(parents=True, exist_ok=True)
    index = {}
    for shard, tensors in shards.items():
        file = f"model-{shard}.safetensors"
        save_file(tensors, destination / file, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    (destination / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    saved = config.to_dict()
    saved["architectures"] = [model_class.__name__]  # as OpenAI's config names it (llama.cpp's converter reads it)
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (destination / "config.json").write_text(json.dumps(saved, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("destination", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="keep the shape's first layers only")
    args = parser.parse_args()
    path = save_random_model(args.shape, args.destination.expanduser(), getattr(torch, args.dtype), layers=args.layers)
    print(f"saved {args.shape} ({args.dtype}) to {path}")


if __name__ == "__main__":
    main()
