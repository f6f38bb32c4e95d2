"""infer's decoder in plain torch, reading K/V through an attention backend: one ``CausalLM`` that every model
family configures through its ``DecoderSpec`` (``infer.model.architecture``): Llama, Mistral, Qwen2, Qwen3, Gemma 3,
Phi-3.

Tokens arrive flattened (``[T]``, no batch dimension, no padding); the attention backend knows which tokens belong
to which sequence from the step's ``AttentionMetadata``. Projections are fused (Q/K/V in one matmul, gate/up in
another) because on small models the number of kernel launches, not FLOPs, bounds a decode step.

Every layer reads one per-step object, ``infer.model.step.ForwardStep`` (positions, attention metadata, the pool, the
backend, the small ops): ``layer(hidden, residual, step)``. Which way a step runs through the layers (op by op here,
or infer's fused CPU kernels) is chosen once per step by the execution layer, never by the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.kernels.cpu import ACTIVATIONS, FusedLayer
from infer.model.head_screen import HeadScreen
from infer.model.hf_weights import WeightMap, load_hf_state_dict
from infer.model.layers import Embedding, Linear, RMSNorm, gated_activation
from infer.model.moe import MoE
from infer.model.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from infer.distributed import TensorParallelGroup
    from infer.kernels.cpu import CpuKernels
    from infer.model.spec import DecoderSpec
    from infer.model.step import ForwardStep


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV projection, the q/k head norms where the family has them, RoPE, the
    backend's paged attention, output projection."""

    def __init__(self, spec: DecoderSpec, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = head_dim = spec.head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.output_bias, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, spec.rms_norm_eps, dtype) if spec.head_norms else None
        self.k_norm = RMSNorm(head_dim, spec.rms_norm_eps, dtype) if spec.head_norms else None
        # Attention sinks (gpt-oss): one learned logit per query head, kept in float32 (a bf16 checkpoint's widen
        # exactly); the attention backend gets them from ``CausalLM.attention_sinks`` (``AttentionBackend.set_layers``).
        self.sinks = (
            nn.Parameter(torch.zeros(spec.num_heads, dtype=torch.float32), requires_grad=False)
            if spec.layer_attention[layer_index].sinks
            else None
        )
        # This layer's RoPE table when it is not the step's (``StepOps.rotary``); a plain attribute, not a
        # submodule: the model owns its tables.
        self.__dict__["rotary"] = rotary
        self.rotary_dim = spec.rotary[spec.layer_rotary[layer_index]].rotary_dim
        # Sharded by ``infer.model.sharding.shard_model``: this rank's heads only, and the output projection's partial
        # sums added over the ranks.
        self.tensor_parallel: TensorParallelGroup | None = None

    def forward(self, hidden: torch.Tensor, step: ForwardStep) -> torch.Tensor:  # hidden: [T, hidden]
        num_tokens = hidden.shape[0]
        # Q and K heads rotate together: one set of kernels for both (a bf16 output widened on the way).
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm, self.num_heads)
        qkv, heads = step.ops.rotate(
            self.qkv_proj(hidden), self.num_heads + self.num_kv_heads, self.head_dim, self.rotary, norms
        )
        q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = step.attend(self.layer_index, q, k, v).reshape(num_tokens, self.q_size)
        if self.tensor_parallel is not None:  # the partial sums all-reduced in float32
            return self.tensor_parallel.all_reduce(self.o_proj(attended))
        return self.o_proj(step.ops.gemm_rows(attended))


class MLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU with ``activation`` gelu_tanh) with the gate and up projections fused
    into one matmul."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        bias = spec.mlp_bias
        self.activation = spec.activation
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=bias, dtype=dtype)
        self.tensor_parallel: TensorParallelGroup | None = None  # as ``Attention``'s

    def forward(self, x: torch.Tensor, step: ForwardStep | None = None) -> torch.Tensor:
        """``x`` ``[..., hidden]``; without a step (training an EAGLE head: batched, with autograd) in torch's ops."""
        gate_up = self.gate_up_proj(x)
        if step is None:
            activated = gated_activation(gate_up, self.activation)
        else:
            activated = step.ops.gated_activation(gate_up, self.activation)
        out = self.down_proj(activated)
        return out if self.tensor_parallel is None else self.tensor_parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with ``output_norms`` (Gemma 3)
    ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``.

    The residual stream travels beside each layer's output (vLLM's layout): a layer returns ``(delta, residual)``
    and the next norm adds them, so the add and the norm are one kernel with the CPU kernels' ``StepOps``. The first
    layer takes ``residual=None``; after the last, ``step.ops.norm(final_norm, delta, residual)`` finishes.
    ``post_attention_layernorm`` is the norm before the MLP (the Llama name); ``attn_output_norm`` and
    ``mlp_output_norm`` are the output norms (``ModelArchitecture.renamed`` maps them to a family's names).
    """

    def __init__(self, spec: DecoderSpec, layer_index: int, dtype: torch.dtype, rotary: RotaryEmbedding | None = None):
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(spec, layer_index, dtype, rotary)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = MoE(spec, dtype) if spec.is_sparse(layer_index) else MLP(spec, dtype)
        self.attn_output_norm = RMSNorm(hidden, eps, dtype) if spec.output_norms else None
        self.mlp_output_norm = RMSNorm(hidden, eps, dtype) if spec.output_norms else None
        self.sharded = False  # holds a tensor-parallel rank's share (``infer.model.sharding.shard_layer``)
        # The layer's dense parts as CPU kernel calls over packed copies of its weights (``use_cpu_kernels``); the
        # execution layer runs steps of a few tokens through it.
        self.fused: FusedLayer | None = None
        # every projection multiplies inputs of any rows on its tiles (``PackedLinear.tiles_only``): the fused C calls
        # run the op-by-op path's GEMM at any step size (``infer.execution.paths.FusedLayersPath``)
        self.fuses_any_step = False

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, step: ForwardStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = step.ops.norm(self.input_layernorm, hidden, residual, gemm_input=True)
        attended = self.self_attn(normed, step)
        if self.attn_output_norm is not None:
            attended = step.ops.norm(self.attn_output_norm, attended)[0]
        return self.feed_forward(attended, residual, step)

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, step: ForwardStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense second half: the residual add, norm, MLP (what ``model.compile`` compiles)."""
        normed, residual = step.ops.norm(self.post_attention_layernorm, hidden, residual, gemm_input=True)
        out = self.mlp(normed, step)
        if self.mlp_output_norm is not None:
            out = step.ops.norm(self.mlp_output_norm, out)[0]
        return out, residual

    @property
    def kernel_shaped(self) -> bool:
        """Whether the CPU kernels' fused layer computes this layer: a dense gated MLP (SwiGLU or GeGLU), its norms
        (q/k head norms and output norms included) of one eps; any RoPE table, whole or partial heads."""
        attn, eps = self.self_attn, self.input_layernorm.eps
        norms = [self.post_attention_layernorm, attn.q_norm, attn.k_norm, self.attn_output_norm, self.mlp_output_norm]
        return (
            isinstance(self.mlp, MLP)
            and self.mlp.activation in ACTIVATIONS
            and all(norm is None or norm.eps == eps for norm in norms)
        )

    def use_cpu_kernels(self, kernels: CpuKernels | None, gemv_rows: int = 0, tile_fma: bool = False) -> None:
        """Let the packed projections compute inputs of up to ``gemv_rows`` rows with the kernels' GEMV (see
        ``PackedLinear``; ``tile_fma`` there too), and when all four then have packed copies (fp16 or int8), build
        ``self.fused``; a mixture of experts prepares its experts. ``kernels`` None undoes it."""
        attn, mlp = self.self_attn, self.mlp
        projections = [attn.qkv_proj, attn.o_proj]
        if isinstance(mlp, MoE):
            mlp.use_cpu_kernels(kernels, gemv_rows, tile_fma)
        else:
            projections += [mlp.gate_up_proj, mlp.down_proj]
        for projection in projections:
            if hasattr(projection, "use_cpu_kernels"):  # PackedLinear
                projection.use_cpu_kernels(kernels, gemv_rows, tile_fma)
        weights = [
            getattr(projection, "blocks", None) or getattr(projection, "kernel_weight", None)  # GGUF's blocks
            for projection in projections
        ]
        tiles = [getattr(projection, "tile_weight", None) for projection in projections]  # bf16's only copy
        unpacked = any(weight is None and tile is None for weight, tile in zip(weights, tiles))
        # A sharded layer all-reduces between its projections, which the fused C calls run back to back.
        if kernels is None or unpacked or attn.tensor_parallel is not None:
            self.fused = None
            return
        if not self.kernel_shaped:
            self.fused = None
            return
        norms = (self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach())
        extra: dict[str, Any] = {"rotary_dim": attn.rotary_dim, "activation": self.mlp.activation}
        if attn.q_norm is not None:
            extra["head_norms"] = (float32_vector(attn.q_norm.weight), float32_vector(attn.k_norm.weight))
        if self.attn_output_norm is not None:
            extra["output_norms"] = (
                float32_vector(self.attn_output_norm.weight),
                float32_vector(self.mlp_output_norm.weight),
            )
        if attn.rotary is not None:  # the layer's own table (Gemma 3's global layers)
            extra["rotary"] = (attn.rotary.cos, attn.rotary.sin)
        self.fuses_any_step = all(getattr(projection, "tiles_only", False) for projection in projections)
        self.fused = FusedLayer(
            kernels,
            weights,
            [projection.kernel_scales for projection in projections],
            [projection.bias for projection in projections],
            norms,
            self.input_layernorm.eps,
            attn.q_size,
            attn.num_heads + attn.num_kv_heads,
            attn.head_dim,
            tiles,
            any(projection.tile_fma for projection in projections),
            **extra,
        )


def float32_vector(weight: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the CPU kernels read it: contiguous float32."""
    return weight.detach().float().contiguous()


class CausalLM(nn.Module):
    """A decoder-only causal LM over flattened, paged batches, as ``spec`` configures it.

    Build one with ``ModelArchitecture.build`` (a family's plugin, from a HF config) or from a spec directly. The
    constructor allocates uninitialized weights on ``device`` in ``dtype``; fill them with ``load_hf_state_dict``,
    which reads checkpoint names through ``weight_map`` (the family's ``ModelArchitecture``).
    """

    def __init__(
        self,
        spec: DecoderSpec,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        weight_map: type[WeightMap] = WeightMap,
        hf_config: Any = None,
    ):
        super().__init__()
        self.spec = spec
        self.weight_map = weight_map
        self.config = hf_config  # the HF config it was built from, when it was
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.num_layers = spec.num_layers
        # The hidden states' dtype. The embedding table may be held narrower (``narrow_float_tables``); its rows are
        # widened to this as they are read.
        self.activation_dtype = dtype
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.max_positions = spec.max_positions
        self.tie_word_embeddings = spec.tie_word_embeddings
        device = torch.device(device)
        # Table 0 is every step's (``StepOps.rotary``); a layer on another keeps a reference to its own.
        self.rotary_tables = nn.ModuleList(
            RotaryEmbedding(table.inverse_frequencies, spec.max_positions, device, table.scaling)
            for table in spec.rotary
        )
        self.rotary = self.rotary_tables[0]
        with torch.device(device):
            self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                DecoderLayer(
                    spec,
                    index,
                    dtype,
                    None if spec.layer_rotary[index] == 0 else self.rotary_tables[spec.layer_rotary[index]],
                )
                for index in range(self.num_layers)
            )
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Sharded (``infer.model.sharding.shard_model``): the layers hold this rank's heads and ``lm_head`` its slice of
        # the vocabulary, whose logits rank 0 gathers.
        self.tensor_parallel: TensorParallelGroup | None = None
        # Greedy rows' int8 copy of the head (``screen_head``).
        self.head_screen: HeadScreen | None = None

    @property
    def layer_attention(self):
        """Each layer's ``infer.attention.LayerAttention`` (what its pool layer asks of the attention backend)."""
        return self.spec.layer_attention

    @property
    def attention_sinks(self) -> list[torch.Tensor | None]:
        """Each layer's attention-sink logits (``[num_heads]``, this rank's heads) where its ``layer_attention``
        declares sinks, else None: what ``AttentionBackend.set_layers`` takes beside ``layer_attention``."""
        return [layer.self_attn.sinks for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` in ``activation_dtype``, times the family's ``embedding_scale`` (rounded
        to that dtype first, as transformers rounds it to the weights')."""
        embeds = self.embed_tokens(input_ids).to(self.activation_dtype)
        scale = self.spec.embedding_scale
        if scale is None:
            return embeds
        return embeds * torch.tensor(scale, dtype=torch.float32).to(embeds.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: ForwardStep) -> torch.Tensor:
        """Run the decoder over one step's flattened tokens ``input_ids`` ``[T]`` (int64), writing their K/V into
        ``step.kv_cache``; returns the hidden states after the final norm, ``[T, hidden]``."""
        return self.run_layers(self.embed(input_ids), self.layers, step)

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
        # int8 modes, bf16 (its tiles beat oneDNN from a dozen rows) and blocks (the GEMV for a few rows, the block
        # GEMM for more); fp16: fbgemm as fast on the head
        head = self.lm_head
        if (
            getattr(head, "scales", None) is not None
            or getattr(head, "mode", None) == "bf16"
            or getattr(head, "blocks", None) is not None
        ):
            head.use_cpu_kernels(kernels, gemv_rows, tile_fma)

    def compile_dense_parts(self) -> None:
        """``torch.compile`` each layer's feed-forward half (norm, gate/up, SiLU, down, residual), with dynamic
        token counts; attention stays eager (its shapes and metadata change every step)."""
        for layer in self.layers:
            layer.feed_forward = torch.compile(layer.feed_forward, dynamic=True)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight ``[vocab, hidden]`` (a tensor-parallel rank's rows), float32 or bf16 as it is held:
        the embedding table where they are tied, else the head's own, given back by its packing where that holds it
        alone (a copy: ``PackedLinear.full_weight``; a table and head held as a GGUF file's blocks likewise)."""
        if self.tie_word_embeddings and self.embed_tokens.weight is not None:  # (a BlockEmbedding holds none)
            return self.embed_tokens.weight
        head = self.lm_head
        return head.weight if isinstance(head, nn.Linear) else head.full_weight()

    def screen_head(self, kernels: CpuKernels | None) -> bool:
        """Keep an int8 copy of the output head for greedy rows (``infer.model.head_screen.HeadScreen``) where the
        head is bf16 on ``kernels`` and not sharded; ``kernels`` None drops it. Whether the head is screened."""
        head = self.lm_head
        self.head_screen = None
        if kernels is None or self.tensor_parallel is not None or getattr(head, "mode", None) != "bf16":
            return False
        if head.kernels is None or (head.tile_weight is None and head.kernel_weight is None):
            return False
        table = self.embed_tokens.weight if self.tie_word_embeddings else None
        tied_rows = (
            table is not None
            and table.dtype == torch.bfloat16
            and table.is_contiguous()
            and tuple(table.shape) == (head.out_features, head.in_features)
        )
        self.head_screen = HeadScreen(head, kernels, table if tied_rows else None)
        return True

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, argmax_rows: list[int] | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` in float32 for hidden states ``[N, hidden]`` from ``forward``. Sharded:
        a collective every rank calls; rank 0 gets the logits, the others None.

        ``argmax_rows``: rows whose caller reads only their first maximum (greedy, nothing else asked). Where the
        head is screened (``screen_head``), every row is one of them and they are few enough for the GEMV
        (``HeadScreen.max_rows``), the rows come from the screen: their first maximum is the full head's, their other
        logits approximate (a step with other rows reads the full head once for all). ``into``: a
        float32 buffer ``[N, vocab]`` the head may write the logits to (the runner's, reused every step: 64 rows
        of a 151,936-token vocabulary are 39 MB, past what malloc keeps, mapped and faulted in afresh otherwise)."""
        screen, rows = self.head_screen, hidden.shape[0]
        if screen is not None and argmax_rows is not None and len(argmax_rows) == rows <= screen.max_rows:
            return screen.logits(hidden)
        if into is not None and self.tensor_parallel is None:
            return self.lm_head(hidden, into=into).float()
        logits = self.lm_head(hidden).float()
        return logits if self.tensor_parallel is None else self.tensor_parallel.gather_vocabulary(logits)

    def load_hf_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        prepare_layer: Callable[[nn.Module], object] | None = None,
        bf16_weights: bool = False,
        keep_blocks: bool = False,
    ) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``) into the fused
        layout, as the family's weight-name map says (``infer.model.hf_weights``); ``prepare_layer`` gets each layer
        once it is filled, ``bf16_weights`` keeps a bf16 checkpoint's matrices in bf16 and ``keep_blocks`` the
        weights it stores as the block kernels' blocks (``infer.model.hf_weights.load_hf_state_dict``)."""
        load_hf_state_dict(self, state_dict, self.weight_map, prepare_layer, bf16_weights, keep_blocks)
