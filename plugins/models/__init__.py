"""infer's built-in model families, registered as lazy ``"module:Class"`` targets: Llama (with Mistral and Qwen2),
Qwen3, Qwen3-MoE, gpt-oss, Gemma 3 (text) and Phi-3 (Phi-3.5, Phi-4-mini). Each is a
``infer.model.ModelArchitecture`` that adapts its HF config to infer's decoder and maps its tensor names."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_models(register):
    register(
        "llama",
        "infer.plugins.models.llama:LlamaArchitecture",
        description="Llama, Mistral, Qwen2 (SmolLM2, Llama 3.x, Mistral 7B, Qwen2.5): the Llama decoder",
    )
    register(
        "qwen3",
        "infer.plugins.models.qwen3:Qwen3Architecture",
        description="Qwen3 dense: per-head q/k RMSNorm before RoPE, explicit head_dim",
    )
    register(
        "qwen3_moe",
        "infer.plugins.models.qwen3_moe:Qwen3MoeArchitecture",
        description="Qwen3-MoE: Qwen3's attention, a mixture of experts (softmax router, top-k) in the sparse layers",
    )
    register(
        "gpt_oss",
        "infer.plugins.models.gpt_oss:GptOssArchitecture",
        description="gpt-oss: attention sinks, sliding and full layers alternating, YaRN, a mixture of experts "
        "(top-k then softmax, clamped SwiGLU, biases) in every layer",
    )
    register(
        "gemma3",
        "infer.plugins.models.gemma3:Gemma3Architecture",
        description="Gemma 3 text: 5 sliding-window layers to 1 global, two RoPE tables, four norms a layer, GeGLU",
    )
    register(
        "phi3",
        "infer.plugins.models.phi3:Phi3Architecture",
        description="Phi-3, Phi-3.5, Phi-4-mini: fused qkv/gate_up tensors, partial rotary, LongRoPE",
    )
