"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) in plain torch, reading K/V through an attention backend.

Tokens arrive flattened (``[T]``, no batch dimension, no padding); the attention backend knows which tokens belong
to which sequence from the step's ``AttentionMetadata``. Projections are fused (Q/K/V in one matmul, gate/up in
another) because on small models the number of kernel launches, not FLOPs, bounds a decode step.

Every layer reads one per-step object, ``infer.model.step.ForwardStep`` (positions, attention metadata, the pool, the
backend, the small ops): ``layer(hidden, residual, step)``. Which way a step runs through the layers (op by op here,
or infer's fused CPU kernels) is chosen once per step by the execution layer, never by the layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.kernels.cpu import FusedLayer
from infer.model.hf_weights import load_hf_state_dict
from infer.model.layers import Embedding, Linear, RMSNorm, silu_and_mul
from infer.model.rotary import RotaryEmbedding, rope_inverse_frequencies

if TYPE_CHECKING:
    from infer.kernels.cpu import CpuKernels
    from infer.model.step import ForwardStep
    from infer.distributed import TensorParallelGroup


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
        # Sharded by ``infer.model.sharding.shard_model``: this rank's heads only, and the output projection's partial
        # sums added over the ranks.
        self.tensor_parallel: TensorParallelGroup | None = None

    def forward(self, hidden: torch.Tensor, step: ForwardStep) -> torch.Tensor:  # hidden: [T, hidden]
        num_tokens = hidden.shape[0]
        # Q and K heads rotate together: one set of kernels for both (a bf16 output widened on the way).
        qkv, heads = step.ops.rotate(self.qkv_proj(hidden), self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = step.attend(self.layer_index, q, k, v).reshape(num_tokens, self.q_size)
        if self.tensor_parallel is not None:  # the partial sums all-reduced in float32
            return self.tensor_parallel.all_reduce(self.o_proj(attended))
        return self.o_proj(step.ops.gemm_rows(attended))


class MLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} in the model config; supported: silu")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias, dtype=dtype)
        self.tensor_parallel: TensorParallelGroup | None = None  # as ``Attention``'s

    def forward(self, x: torch.Tensor, step: ForwardStep | None = None) -> torch.Tensor:
        """``x`` ``[..., hidden]``; without a step (training an EAGLE head: batched, with autograd) in torch's ops."""
        gate_up = self.gate_up_proj(x)
        out = self.down_proj(silu_and_mul(gate_up) if step is None else step.ops.silu_mul(gate_up))
        return out if self.tensor_parallel is None else self.tensor_parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The residual stream travels beside each layer's output (vLLM's layout): a layer returns ``(delta, residual)``
    and the next norm adds them, so the add and the norm are one kernel with the CPU kernels' ``StepOps``. The first
    layer takes ``residual=None``; after the last, ``step.ops.norm(final_norm, delta, residual)`` finishes.
    """

    def __init__(self, config: Any, layer_index: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_index, head_dim, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)
        # The layer's dense parts as CPU kernel calls over packed copies of its weights (``use_cpu_kernels``); the
        # execution layer runs steps of a few tokens through it.
        self.fused: FusedLayer | None = None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = step.ops.norm(self.input_layernorm, hidden, residual, gemm_input=True)
        return self.feed_forward(self.self_attn(normed, step), residual, step)

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor,
                     step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense second half: the residual add, norm, MLP (what ``model.compile`` compiles)."""
        normed, residual = step.ops.norm(self.post_attention_layernorm, hidden, residual, gemm_input=True)
        return self.mlp(normed, step), residual

    def use_cpu_kernels(self, kernels: CpuKernels | None, gemv_rows: int = 0, tile_fma: bool = False) -> None:
        """Let the packed projections compute inputs of up to ``gemv_rows`` rows with the kernels' GEMV (see
        ``PackedLinear``; ``tile_fma`` there too), and when all four then have packed copies (fp16 or int8), build
        ``self.fused``. ``kernels`` None undoes it."""
        attn, mlp = self.self_attn, self.mlp
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        for projection in projections:
            if hasattr(projection, "use_cpu_kernels"):  # PackedLinear
                projection.use_cpu_kernels(kernels, gemv_rows, tile_fma)
        weights = [getattr(projection, "kernel_weight", None) for projection in projections]
        # A sharded layer all-reduces between its projections, which the fused C calls run back to back.
        if kernels is None or any(weight is None for weight in weights) or attn.tensor_parallel is not None:
            self.fused = None
            return
        norms = (self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach())
        self.fused = FusedLayer(kernels, weights, [projection.kernel_scales for projection in projections],
                                [projection.bias for projection in projections], norms, self.input_layernorm.eps,
                                attn.q_size, attn.num_heads + attn.num_kv_heads, attn.head_dim,
                                [projection.tile_weight for projection in projections],
                                any(projection.tile_fma for projection in projections))


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
        inverse_frequencies, scaling = rope_inverse_frequencies(config, self.head_dim)
        self.rotary = RotaryEmbedding(inverse_frequencies, self.max_positions, torch.device(device), scaling)
        # Sharded (``infer.model.sharding.shard_model``): the layers hold this rank's heads and ``lm_head`` its slice of
        # the vocabulary, whose logits rank 0 gathers.
        self.tensor_parallel: TensorParallelGroup | None = None

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
    def forward(self, input_ids: torch.Tensor, step: ForwardStep) -> torch.Tensor:
        """Run the decoder over one step's flattened tokens ``input_ids`` ``[T]`` (int64), writing their K/V into
        ``step.kv_cache``; returns the hidden states after the final norm, ``[T, hidden]``."""
        return self.run_layers(self.embed_tokens(input_ids), self.layers, step)

    def run_layers(self, hidden: torch.Tensor, layers: Sequence[DecoderLayer], step: ForwardStep) -> torch.Tensor:
        """``layers`` (this model's, in order) over embeddings ``hidden`` ``[T, hidden]`` the way the step's
        execution layer chooses, then the final norm."""
        delta, residual = step.run_layers(layers, hidden)
        return step.ops.norm(self.norm, delta, residual)[0]

    def use_cpu_kernels(self, kernels: CpuKernels | None, gemv_rows: int = 0, tile_fma: bool = False) -> None:
        """Prepare the weights for ``kernels`` (``infer.kernels.cpu``; None: torch's ops only): each layer's
        ``FusedLayer`` where its projections are packed (fp16 or int8), and the GEMV for inputs of up to
        ``gemv_rows`` rows (with int8 the output head's too); ``tile_fma``: bf16 weights' larger inputs on the tile
        kernel's float32 FMAs (``PackedLinear``). Call it once the weights are final: the kernels read copies of them
        and their addresses. The execution layer calls it (``infer.execution.paths.Executor``)."""
        for layer in self.layers:
            layer.use_cpu_kernels(kernels, gemv_rows, tile_fma)
        # int8 modes, and bf16 (its tiles beat oneDNN from a dozen rows); fp16: fbgemm as fast on the head
        if getattr(self.lm_head, "scales", None) is not None or getattr(self.lm_head, "mode", None) == "bf16":
            self.lm_head.use_cpu_kernels(kernels, gemv_rows, tile_fma)

    def compile_dense_parts(self) -> None:
        """``torch.compile`` each layer's feed-forward half (norm, gate/up, SiLU, down, residual), with dynamic
        token counts; attention stays eager (its shapes and metadata change every step)."""
        for layer in self.layers:
            layer.feed_forward = torch.compile(layer.feed_forward, dynamic=True)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` in float32 for hidden states ``[N, hidden]`` from ``forward``. Sharded:
        a collective every rank calls; rank 0 gets the logits, the others None."""
        logits = self.lm_head(hidden).float()
        return logits if self.tensor_parallel is None else self.tensor_parallel.gather_vocabulary(logits)

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``) into the fused
        layout (``infer.model.hf_weights``)."""
        load_hf_state_dict(self, state_dict)


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """Whether the Q/K/V projection and the output projection carry biases."""
    if getattr(config, "model_type", None) == "qwen2":
        # Qwen2 configs have no attention_bias field: Q/K/V always carry a bias, the output projection never.
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias
