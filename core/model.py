"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) in plain torch, reading K/V through an attention backend.

Tokens arrive flattened (``[T]``, no batch dimension, no padding); the attention backend knows which tokens belong
to which sequence from the step's ``AttentionMetadata``. Projections are fused (Q/K/V in one matmul, gate/up in
another) because on small models the number of kernel launches, not FLOPs, bounds a decode step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention import AttentionBackend, AttentionMetadata
from infer.cpu_kernels import FEW_ROWS, FusedLayer, FusedStack

# HF projections that our fused projections concatenate, in order (rows of the fused weight).
_FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some HF checkpoints carry that hold nothing we load (recomputed RoPE tables).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def rope_parameters(config: Any) -> dict:
    """The RoPE settings of a HF config as one dict with ``rope_theta`` and ``rope_type`` always present.

    transformers 5 stores ``config.rope_parameters = {"rope_theta": ..., "rope_type": ...}``; older versions store
    ``config.rope_theta`` plus an optional ``config.rope_scaling`` (whose type key is ``rope_type`` or ``type``).
    """
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    parameters.update(getattr(config, "rope_scaling", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    parameters["rope_type"] = parameters.get("rope_type") or parameters.get("type") or "default"
    return parameters


def rope_inverse_frequencies(parameters: dict, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """Per-pair rotation speeds ``[head_dim // 2]`` (float32) for rope types ``default``, ``linear`` and ``llama3``."""
    base = parameters["rope_theta"]
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = parameters["rope_type"]
    if rope_type == "default":
        return inverse
    if rope_type == "linear":
        return inverse / parameters["factor"]
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inverse, parameters, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} in the model config; supported: default, linear, llama3")


def _llama3_inverse_frequencies(inverse: torch.Tensor, parameters: dict, max_position_embeddings: int) -> torch.Tensor:
    # Llama 3.1: slow rotations are stretched by `factor`, fast ones kept, the band between interpolated smoothly.
    factor = parameters["factor"]
    low_freq_factor = parameters["low_freq_factor"]
    high_freq_factor = parameters["high_freq_factor"]
    old_context_len = parameters.get("original_max_position_embeddings", max_position_embeddings)
    wavelength = 2 * math.pi / inverse
    scaled = torch.where(wavelength > old_context_len / low_freq_factor, inverse / factor, inverse)
    smooth = (old_context_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= old_context_len / high_freq_factor) & (wavelength <= old_context_len / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


class Linear(nn.Linear):
    """``nn.Linear`` whose weights start uninitialized: every one is overwritten from a checkpoint, and random
    initialization of a large model costs seconds."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weights start uninitialized (see ``Linear``)."""

    def reset_parameters(self) -> None:
        pass


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position below ``max_positions``; a step only indexes them.

    The sin table's first half is negated (``[-sin, sin]``) so that ``apply_rotary`` needs only a half swap, no
    negation."""

    def __init__(self, inverse_frequencies: torch.Tensor, max_positions: int, device: torch.device):
        super().__init__()
        # Computed on the CPU whatever the device, so every device rotates by bit-identical angles.
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies)
        sin = angles.sin()
        self.register_buffer("cos", torch.cat((angles, angles), dim=-1).cos().to(device), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, ``[T, 1, head_dim]`` each (broadcast over heads), in ``dtype``."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., heads, head_dim]`` by ``RotaryEmbedding``'s tables (HF's half-split layout: pairs are
    (i, i + head_dim/2)): ``x * cos + swap_halves(x) * [-sin, sin]``, three kernels."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[..., 2 * width]``, gate first (SwiGLU's activation, in torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight (as HF does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class StepOps:
    """How one forward pass runs its small ops (RMSNorm with the residual add before it, RoPE, SiLU-and-multiply):
    torch's ops, or infer's CPU kernels (``infer.cpu_kernels``, float32 on a CPU), which do each in one pass.

    Built once per forward pass from its positions; the layers call it instead of the torch functions.
    """

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, kernels=None):
        self.kernels = kernels
        self.rotary = rotary
        self.positions = positions
        if kernels is None:
            self.cos, self.sin = rotary(positions, dtype)

    def rotate(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
        """The first ``num_heads`` heads of ``qkv`` ``[T, width]`` rotated, ``[T, num_heads, head_dim]`` (with the
        kernels: rotated in place, a view of ``qkv``)."""
        heads = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        if self.kernels is None:
            return apply_rotary(heads, self.cos, self.sin)
        self.kernels.rope_(qkv, self.positions, self.rotary.cos, self.rotary.sin, num_heads, head_dim)
        return heads

    def norm(self, norm: RMSNorm, x: torch.Tensor,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` for ``s = residual + x`` (``s = x`` without a residual). The kernels add in place into
        ``residual``."""
        if residual is None:
            normed = norm(x) if self.kernels is None else self.kernels.rms_norm(x, norm.weight, norm.eps)
            return normed, x
        if self.kernels is None:
            residual = residual + x
            return norm(residual), residual
        return self.kernels.add_rms_norm(residual, x, norm.weight, norm.eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * width]``, gate first."""
        return silu_and_mul(gate_up) if self.kernels is None else self.kernels.silu_mul(gate_up)


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV projection, RoPE, the backend's paged attention, output projection."""

    def __init__(self, config: Any, layer_index: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        qkv_bias, output_bias = _attention_biases(config)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=output_bias, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        ops: StepOps,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # Q and K heads rotate together: one set of kernels for both.
        q, k = ops.rotate(qkv, self.num_heads + self.num_kv_heads, self.head_dim).split(
            [self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention.forward(self.layer_index, q, k, v, kv_cache[self.layer_index], metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} in the model config; supported: silu")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: StepOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(silu_and_mul(gate_up) if ops is None else ops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The residual stream travels beside each layer's output (vLLM's layout): a layer returns ``(delta, residual)``
    and the next norm adds them, so the add and the norm are one kernel with ``StepOps``' CPU kernels. The first
    layer takes ``residual=None``; after the last, ``StepOps.norm(final_norm, delta, residual)`` finishes.
    """

    def __init__(self, config: Any, layer_index: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_index, head_dim, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)
        self.fused = None  # infer.cpu_kernels.FusedLayer, when the CPU kernels can run this layer's dense parts

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ops: StepOps, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, attention: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and ops.kernels is not None and hidden.shape[0] <= FEW_ROWS:
            return self._forward_fused(hidden, residual, ops, kv_cache, metadata, attention)
        normed, residual = ops.norm(self.input_layernorm, hidden, residual)
        return self.feed_forward(self.self_attn(normed, ops, kv_cache, metadata, attention), residual, ops)

    def _forward_fused(self, hidden, residual, ops, kv_cache, metadata,
                       attention) -> tuple[torch.Tensor, torch.Tensor]:
        """A few tokens (decode at small batches, verification): the dense parts in two C calls (``FusedLayer``),
        attention through the backend as always. At a few tokens a layer is ~15 small ops around 4 memory-bound
        matrix products, and calling them one by one from Python costs about a third of the step (measurements at
        ``infer.cpu_kernels.FEW_ROWS``)."""
        if residual is None:  # the first layer: the embedding is the residual stream, nothing to add yet
            residual, hidden = hidden, None
        tokens = residual.shape[0]
        qkv = self.fused.attention_input(residual, hidden, ops.positions, ops.rotary.cos, ops.rotary.sin)
        attn = self.self_attn
        q, k, v = qkv.view(tokens, -1, attn.head_dim).split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads],
                                                            dim=1)
        out = attention.forward(attn.layer_index, q, k, v, kv_cache[attn.layer_index], metadata)
        # contiguous(): a no-op for the built-in backends; the C side reads plain rows whatever a plugin returns.
        return self.fused.feed_forward(out.reshape(tokens, attn.q_size).contiguous(), residual), residual

    def use_cpu_kernels(self, kernels) -> None:
        """Let the projections compute inputs of a few rows with ``kernels`` (see ``PackedLinear``), and when all
        four then have packed copies (fp16 or int8), run steps of a few tokens through ``FusedLayer``."""
        attn, mlp = self.self_attn, self.mlp
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        for projection in projections:
            if hasattr(projection, "use_cpu_kernels"):  # PackedLinear
                projection.use_cpu_kernels(kernels)
        weights = [getattr(projection, "kernel_weight", None) for projection in projections]
        if kernels is None or any(weight is None for weight in weights):
            self.fused = None
            return
        norms = (self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach())
        self.fused = FusedLayer(kernels, weights, [projection.kernel_scales for projection in projections],
                                [projection.bias for projection in projections], norms, self.input_layernorm.eps,
                                attn.q_size, attn.num_heads + attn.num_kv_heads, attn.head_dim)

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor,
                     ops: StepOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense second half: the residual add, norm, MLP (what ``model.compile`` compiles)."""
        normed, residual = ops.norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(normed, ops), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over flattened, paged batches.

    Built from a HF ``LlamaConfig``-like config (``Qwen2Config`` and ``MistralConfig`` work too). The constructor
    allocates uninitialized weights on ``device`` in ``dtype``; fill them with ``load_hf_state_dict``.
    """

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_positions = max_positions or config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device(device):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                DecoderLayer(config, index, self.head_dim, dtype) for index in range(self.num_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inverse_frequencies = rope_inverse_frequencies(
            rope_parameters(config), self.head_dim, config.max_position_embeddings
        )
        self.rotary = RotaryEmbedding(inverse_frequencies, self.max_positions, torch.device(device))
        self.kernels = None  # infer.cpu_kernels.CpuKernels, used for float32 on a CPU (see ``use_cpu_kernels``)
        self._stacks: dict[tuple[int, ...], FusedStack | None] = {}  # by the layers' ids (see ``_fused_stack``)

    @classmethod
    def from_hf(
        cls,
        hf_model_or_config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LlamaForCausalLM:
        """Build from a HF config (weights uninitialized) or from a HF model (its weights copied), in eval mode."""
        if isinstance(hf_model_or_config, nn.Module):
            model = cls(hf_model_or_config.config, dtype=dtype, device=device)
            model.load_hf_state_dict(hf_model_or_config.state_dict())
        else:
            model = cls(hf_model_or_config, dtype=dtype, device=device)
        return model.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run the decoder over one step's flattened tokens, writing their K/V into ``kv_cache``.

        The caller runs ``attention.prepare(metadata)`` once per step before this, as for any backend.
        """
        return self.run_layers(self.embed_tokens(input_ids), positions, self.layers, kv_cache, metadata, attention)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, layers, kv_cache: torch.Tensor,
                   metadata: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        """``layers`` (this model's, in order) over embeddings ``hidden`` ``[T, hidden]``, then the final norm.
        A step of a few tokens whose attention the backend hands to the CPU kernels runs all ``layers`` in one C
        call (``FusedStack``); otherwise layer by layer."""
        ops = self.step_ops(positions, hidden.dtype, hidden.device)
        if ops.kernels is not None and hidden.shape[0] <= FEW_ROWS:
            stack = self._fused_stack(layers)
            step = attention.kernel_attention(metadata) if stack is not None else None
            if step is not None:
                delta = stack.run(hidden, positions, self.rotary.cos, self.rotary.sin, kv_cache, step)
                return ops.norm(self.norm, delta, hidden)[0]
        residual = None
        for layer in layers:
            hidden, residual = layer(hidden, residual, ops, kv_cache, metadata, attention)
        return ops.norm(self.norm, hidden, residual)[0]

    def use_cpu_kernels(self, kernels) -> None:
        """Run the small ops of float32 CPU forward passes with ``kernels`` (``infer.cpu_kernels.CpuKernels``;
        None: torch's ops), and steps of a few tokens through ``FusedStack`` / ``FusedLayer`` where the projections
        are packed (fp16 or int8; with int8 the output head's few rows too). Call it once the weights are final: the
        kernels read copies of them and their addresses."""
        self.kernels = kernels
        self._stacks = {}
        for layer in self.layers:
            layer.use_cpu_kernels(kernels)
        if getattr(self.lm_head, "scales", None) is not None:  # int8 modes (fp16: fbgemm as fast on the head)
            self.lm_head.use_cpu_kernels(kernels)

    def _fused_stack(self, layers) -> FusedStack | None:
        """``layers`` as one ``FusedStack`` (built once per list of layers), or None when one of them has no
        ``FusedLayer`` (or there are none)."""
        key = tuple(map(id, layers))
        if key not in self._stacks:
            fused = [layer.fused for layer in layers]
            usable = bool(fused) and self.kernels is not None and all(layer is not None for layer in fused)
            self._stacks[key] = (FusedStack(self.kernels, fused, [layer.self_attn.layer_index for layer in layers])
                                 if usable else None)
        return self._stacks[key]

    def step_ops(self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device) -> StepOps:
        """How a forward pass over ``positions`` in ``dtype`` runs its small ops (see ``StepOps``)."""
        usable = self.kernels is not None and dtype == torch.float32 and device.type == "cpu"
        return StepOps(self.rotary, positions, dtype, self.kernels if usable else None)

    def compile_dense_parts(self) -> None:
        """``torch.compile`` each layer's feed-forward half (norm, gate/up, SiLU, down, residual), with dynamic
        token counts; attention stays eager (its shapes and metadata change every step)."""
        for layer in self.layers:
            layer.feed_forward = torch.compile(layer.feed_forward, dynamic=True)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` in float32 for hidden states ``[N, hidden]`` from ``forward``."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``) into the fused
        layout, converting dtype and device. Raises ``ValueError`` naming any missing or unexpected tensors."""
        used: set[str] = set()
        missing: list[str] = []
        for name, parameter in self.named_parameters():
            sources = _hf_names(name)
            if all(source in state_dict for source in sources):
                parameter.copy_(torch.cat([state_dict[source] for source in sources]))
                used.update(sources)
            else:
                missing.extend(source for source in sources if source not in state_dict)
        unexpected = [name for name in state_dict if name not in used and not self._is_ignorable(name)]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model config: missing {missing}, unexpected {unexpected}")

    def _is_ignorable(self, hf_name: str) -> bool:
        # Tied checkpoints may still carry an lm_head copy of the embedding.
        return hf_name.endswith(_IGNORED_HF_SUFFIXES) or (self.tie_word_embeddings and hf_name == "lm_head.weight")


def _hf_names(name: str) -> list[str]:
    """The HF tensor names whose concatenation fills our parameter ``name``."""
    if name.startswith("lm_head."):
        return [name]
    for fused, parts in _FUSED_PROJECTIONS.items():
        if f".{fused}." in name:
            return [f"model.{name.replace(fused, part)}" for part in parts]
    return [f"model.{name}"]


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """Whether the Q/K/V projection and the output projection carry biases."""
    if getattr(config, "model_type", None) == "qwen2":
        # Qwen2 configs have no attention_bias field: Q/K/V always carry a bias, the output projection never.
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias
