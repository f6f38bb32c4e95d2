"""The ctypes side of infer's CPU kernels: the C functions' signatures and structs, and ``CpuKernels``, one small
Python wrapper per kernel that checks the layout of every tensor the C side will read.

The kernels work on float32 CPU tensors: RMSNorm with its residual add, RoPE, SiLU-and-multiply, the KV write,
paged attention read straight from the pool, and a streaming GEMV over weights packed by ``infer.kernels.cpu.packing``
(fp16, bf16, or int8 with a scale per group of weights). ``infer.kernels.cpu.fused`` chains them into whole layers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infer.host import streamed_empty
from infer.kernels.cpu.blocks import (
    BLOCK,
    BLOCK_COLUMNS,
    BLOCK_KINDS,
    GROUP_ROWS,
    QUANTIZE_CHUNK,
    QUANTIZED_KINDS,
    RECORD_BYTES,
    BlockWeight,
    well_formed,
)
from infer.kernels.cpu.packing import can_pack, packed_shape, tiles_shape

if TYPE_CHECKING:
    from infer.attention import AttentionMetadata

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
_FLOAT = ctypes.c_float
_SIGNATURES = {
    "infer_linear_f16": [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT],
    "infer_linear_bf16": [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT],
    "infer_linear_i8": [_POINTER, _INT, _INT, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _INT],
    "infer_linear_blocks": [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT],
    "infer_gemm_blocks": [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT],
    "infer_gemm_blocks_bf16": [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT],
    "infer_moe_experts": [
        _POINTER,
        _INT,
        _INT,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _INT,
        _INT,
        _POINTER,
        _POINTER,
        _INT,
        _FLOAT,
        _FLOAT,
        _POINTER,
    ],
    "infer_moe_experts_tiles": [_POINTER, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER]
    + [_POINTER, _POINTER, _POINTER, _INT, _FLOAT, _FLOAT, _INT, _POINTER],
    "infer_moe_experts_blocks": [_POINTER, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER]
    + [_INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _FLOAT, _FLOAT, _POINTER],
    "infer_layer_attention_input": [_POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER],
    "infer_layer_feed_forward": [_POINTER, _INT, _POINTER, _POINTER, _POINTER],
    "infer_add_rms_norm_mixed": [_POINTER, _POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT, _FLOAT],
    "infer_silu_mul": [_POINTER, _POINTER, _INT, _INT],
    "infer_gelu_tanh_mul": [_POINTER, _POINTER, _INT, _INT],
    "infer_silu_mul_bf16": [_POINTER, _POINTER, _INT, _INT],
    "infer_gelu_tanh_mul_bf16": [_POINTER, _POINTER, _INT, _INT],
    "infer_rope": [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _INT],
    "infer_rope_widen": [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _INT],
    "infer_rope_norms": [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _INT]
    + [_POINTER, _POINTER, _FLOAT],
    "infer_write_kv": [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _INT, _INT],
    "infer_paged_attention": [
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _INT,
        _INT,
        _INT,
        _INT,
        _INT,
        _INT,
        _FLOAT,
        _INT,
        _INT,
        _INT,
        _POINTER,
    ],
    "infer_layers_few": [
        _POINTER,
        _POINTER,
        _INT,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
    ],
    "infer_draft_head_step": [
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
    ],
    "infer_apply_bitmask": [_POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT],
    "infer_argmax_rows": [_POINTER, _INT, _INT, _INT, _POINTER],
    "infer_screen_rows": [
        _POINTER,
        _INT,
        _INT,
        _POINTER,
        _INT,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _INT,
        _POINTER,
    ],
    "infer_screen_quantize": [_POINTER, _INT, _INT, _FLOAT, _POINTER, _POINTER, _POINTER, _POINTER],
    "infer_linear_tiles": [_POINTER, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT],
    "infer_unpack_tiles": [_POINTER, _INT, _INT, _POINTER],
    "infer_flash_attention": [
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        _POINTER,
        _INT,
        _POINTER,
        _INT,
        _INT,
        _INT,
        _INT,
        _INT,
        _FLOAT,
        _INT,
        _INT,
        _INT,
        _POINTER,
    ],
}


# How the C side reads a packed weight (``KIND_*`` in the source), by the packed tensor's dtype.
WEIGHT_KINDS = {torch.float16: 0, torch.int8: 1, torch.bfloat16: 2}
# A gated MLP's activation as the C side names it (``ACT_*``), by ``DecoderSpec.activation``.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# An expert's activation (cpu_kernels.h's ACTIVATION_*, ``infer.model.spec.ExpertsSpec.activation``).
EXPERT_ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}
# Experts over ``pack_tiles``' layout that take at least this many tokens multiply on AMX tiles (x and the
# activations rounded to bf16), fewer with float32 FMAs over the widened weights, a pass of 8 rows at a time
# (``moe_experts``' ``tile_rows``). One expert of qwen3-moe-3.3b's shape from memory, one thread, AMX's time over the
# FMAs': 1.26 at 1 token, 1.07 at 8, 0.79 at 12, 0.40 at 32 (``benchmarks/moe_layer.py --switch``): past one FMA
# pass, AMX.
MOE_TILE_ROWS = 9
# The block kinds whose experts run in one C call (``PackedExperts.of_blocks``, ``infer_moe_experts_blocks``).
MOE_BLOCK_KINDS = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "mxfp4")
# The pool dtypes the KV write and paged attention read (queries and results stay float32).
KV_DTYPES = (torch.float32, torch.bfloat16)
# What ``infer_simd_width`` reports: the instruction set the kernels were compiled for (``-march=native``).
SIMD_NAMES = {512: "avx512", 256: "avx2", 0: "portable"}
# How ``CpuKernels.gemm_blocks`` multiplies, by the C side's number (``infer_block_gemm_kind``).
BLOCK_GEMM_DESIGNS = {2: "amx-bf16", 1: "int8", 0: "portable"}
TILE_KINDS = {2: "AMX tiles", 1: "AVX512-BF16", 0: None}
# The head sizes whose bf16 K/V the attention kernels multiply as the pool holds them: the flash attention on AMX
# tiles (FLASH_AMX_HEAD_DIMS in the C source) and the decode kernel's rows read in place, widened in registers or on
# the dot products (DIRECT_HEAD_DIMS). Other sizes take the kernels' general paths.
DIRECT_HEAD_DIMS = (64, 128, 256)


class LayerStruct(ctypes.Structure):
    """``infer_layer`` in the C source: one decoder layer's weights and shapes."""

    _fields_ = [
        (name, _POINTER)
        for name in (
            "qkv",
            "o",
            "gate_up",
            "down",
            "qkv_scales",
            "o_scales",
            "gate_up_scales",
            "down_scales",
            "qkv_bias",
            "o_bias",
            "gate_up_bias",
            "down_bias",
            "input_norm",
            "post_norm",
        )
    ]
    _fields_ += [("eps", _FLOAT)] + [
        (name, _INT)
        for name in (
            "hidden",
            "qkv_width",
            "q_width",
            "intermediate",
            "rotated_heads",
            "head_dim",
            "qkv_groups",
            "o_groups",
            "gate_up_groups",
            "down_groups",
            "qkv_kind",
            "o_kind",
            "gate_up_kind",
            "down_kind",
        )
    ]
    _fields_ += [(name, _POINTER) for name in ("qkv_tiles", "o_tiles", "gate_up_tiles", "down_tiles")]
    _fields_ += [("tiles_fma", _INT), ("q_norm", _POINTER), ("k_norm", _POINTER)]
    _fields_ += [(name, _POINTER) for name in ("attn_out_norm", "mlp_out_norm", "cos_table", "sin_table")]
    _fields_ += [("rotary_dim", _INT), ("activation", _INT)]


class DraftHeadStruct(ctypes.Structure):
    """``infer_draft_head`` in the C source: an EAGLE draft head's norms, fc and draft-vocabulary output."""

    _fields_ = [(name, _POINTER) for name in ("embed_norm", "feature_norm", "norm")] + [("eps", _FLOAT)]
    _fields_ += [(name, _POINTER) for name in ("fc", "fc_scales", "fc_bias")]
    _fields_ += [(name, _INT) for name in ("fc_groups", "fc_kind")]
    _fields_ += [(name, _POINTER) for name in ("out", "out_scales")]
    _fields_ += [(name, _INT) for name in ("out_groups", "out_kind", "vocab", "hidden")]


class AttentionStepStruct(ctypes.Structure):
    """``infer_attention_step`` in the C source: one step's attention through ``infer_paged_attention``."""

    _fields_ = [("block_tables", _POINTER), ("table_stride", _INT)]
    _fields_ += [(name, _POINTER) for name in ("slots", "rows", "seq_of_query", "context_lens")]
    _fields_ += [
        (name, _INT)
        for name in ("queries", "max_context", "num_heads", "num_kv_heads", "head_dim", "block_size", "num_blocks")
    ]
    _fields_ += [("scale", _FLOAT), ("kv_bf16", _INT), ("own_keys", _POINTER), ("dots", _INT), ("windows", _POINTER)]
    _fields_ += [("sinks", _POINTER)]


@dataclass(slots=True)
class KernelAttentionPlan:
    """Which token rows ``paged_attention`` computes: query ``i`` is row ``rows[i]`` (all rows in order when None)
    of sequence ``seq_of_query[i]``, attending to its first ``context_lens[i]`` tokens (int64 each); where
    ``own_keys[i] >= 0`` (a draft tree's leaf, ``AttentionMetadata.own_keys``), the last of them is read from the
    sequence's token ``own_keys[i]`` instead."""

    rows: torch.Tensor | None
    seq_of_query: torch.Tensor
    context_lens: torch.Tensor
    num_queries: int
    max_context: int
    own_keys: torch.Tensor | None = None

    @classmethod
    def every_token(cls, metadata: AttentionMetadata) -> KernelAttentionPlan:
        """Every token of a step as a query of its own sequence, seeing its own position and all before (the
        bottom-right causal mask of ``AttentionMetadata``)."""
        query_lens = metadata.query_lens_cpu
        if metadata.max_query_len == 1:  # pure decode: query i is sequence i
            seq_of_query = torch.arange(len(query_lens))
        else:
            # from a list: torch.repeat_interleave alone cost ~40 us, most of an EAGLE chain step's planning
            seq_of_query = torch.tensor(
                [seq for seq, count in enumerate(query_lens) for _ in range(count)], dtype=torch.int64
            )
        return cls(
            None, seq_of_query, metadata.positions + 1, metadata.num_tokens, metadata.max_seq_len, metadata.own_keys
        )

    def of_rows(self, rows: list[int]) -> KernelAttentionPlan:
        """The plan of this every-token plan's queries at ``rows`` only (the step's others attended elsewhere)."""
        index = torch.tensor(rows, dtype=torch.int64)
        own = None if self.own_keys is None else self.own_keys[index].contiguous()
        return KernelAttentionPlan(
            index,
            self.seq_of_query[index].contiguous(),
            self.context_lens[index].contiguous(),
            len(rows),
            self.max_context,
            own,
        )


@dataclass(frozen=True, eq=False)
class PackedExperts:
    """``num_experts`` experts of ``hidden`` x ``width``: ``gate_up[i]`` ``[2 * width, hidden]`` (gate's rows first)
    and ``down[i]`` ``[hidden, width]`` packed by ``pack_weights`` (int8 ones with their packed scales) or, with
    ``tiles``, bf16 ones by ``pack_tiles``; their float32 biases where they have them; ``activation``
    (``EXPERT_ACTIVATIONS``), with ``limit`` and ``alpha`` for ``clamped_swiglu``. Keeps the tensors alive while the
    tables hold their addresses."""

    gate_up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    gate_up_scales: tuple[torch.Tensor, ...] | None
    down_scales: tuple[torch.Tensor, ...] | None
    hidden: int
    width: int
    kind: int
    tables: dict[str, torch.Tensor]  # int64 addresses: gate_up, down (their scales' for int8, their biases')
    biases: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None  # gate_up's, down's
    activation: str = "silu"
    limit: float = 0.0
    alpha: float = 0.0
    tiles: bool = False
    # experts kept as GGUF's blocks (``of_blocks``): gate_up's block kind and down's; None: packed
    blocks: tuple[str, str] | None = None

    @classmethod
    def of(
        cls,
        gate_up: Sequence[torch.Tensor],
        down: Sequence[torch.Tensor],
        gate_up_scales: Sequence[torch.Tensor] | None = None,
        down_scales: Sequence[torch.Tensor] | None = None,
        *,
        gate_up_bias: Sequence[torch.Tensor] | None = None,
        down_bias: Sequence[torch.Tensor] | None = None,
        activation: str = "silu",
        limit: float = 0.0,
        alpha: float = 0.0,
        tiles: bool = False,
    ) -> PackedExperts:
        """Check every expert's packed weights (same shapes, same storage; ``tiles``: bf16 from ``pack_tiles``, no
        scales) and biases (float32, contiguous, ``[2 * width]`` and ``[hidden]``; both or neither), and tabulate
        their addresses."""
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"experts need gate_up and down weights each, got {len(gate_up)} and {len(down)}")
        shape = tiles_shape if tiles else packed_shape
        width2, hidden = shape(gate_up[0])
        width = width2 // 2
        if width % (32 if tiles else 4):
            raise ValueError(
                f"an expert's width {width} must be a multiple of {32 if tiles else 4} (gate's and up's blocks apart)"
            )
        for index, (first, second) in enumerate(zip(gate_up, down, strict=True)):
            if tiles:
                check_tiles(first, gate_up_scales)
                check_tiles(second, down_scales)
            else:
                check_packed(first, None if gate_up_scales is None else gate_up_scales[index])
                check_packed(second, None if down_scales is None else down_scales[index])
            if (
                shape(first) != (2 * width, hidden)
                or shape(second) != (hidden, width)
                or first.dtype != gate_up[0].dtype
                or second.dtype != gate_up[0].dtype
            ):
                raise ValueError(f"expert {index}'s weights differ in shape or storage from expert 0's")
        tables = {"gate_up": addresses(gate_up), "down": addresses(down)}
        if gate_up_scales is not None:
            tables["gate_up_scales"], tables["down_scales"] = addresses(gate_up_scales), addresses(down_scales)
        biases = expert_biases(tables, len(gate_up), hidden, width, gate_up_bias, down_bias, activation)
        return cls(
            tuple(gate_up),
            tuple(down),
            None if gate_up_scales is None else tuple(gate_up_scales),
            None if down_scales is None else tuple(down_scales),
            hidden,
            width,
            WEIGHT_KINDS[gate_up[0].dtype],
            tables,
            biases,
            activation,
            limit,
            alpha,
            tiles,
        )

    @classmethod
    def of_blocks(
        cls,
        gate_up: Sequence[BlockWeight],
        down: Sequence[BlockWeight],
        *,
        gate_up_bias: Sequence[torch.Tensor] | None = None,
        down_bias: Sequence[torch.Tensor] | None = None,
        activation: str = "silu",
        limit: float = 0.0,
        alpha: float = 0.0,
    ) -> PackedExperts:
        """Experts whose weights are kept as GGUF's blocks (``infer_moe_experts_blocks``): every expert's gate_up of
        one kind in ``MOE_BLOCK_KINDS``, its down of one (the same or another: a ``Q4_K_M`` file's down projections
        are ``Q6_K`` in some layers, its gate and up ``Q4_K``); biases and activation as ``of``."""
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"experts need gate_up and down weights each, got {len(gate_up)} and {len(down)}")
        kinds = (gate_up[0].kind, down[0].kind)
        if not set(kinds) <= set(MOE_BLOCK_KINDS):
            raise ValueError(
                f"experts in {'/'.join(kinds)} blocks have no C call; it takes {', '.join(MOE_BLOCK_KINDS)}"
            )
        hidden, width = gate_up[0].in_features, gate_up[0].out_features // 2
        if hidden % BLOCK_COLUMNS[kinds[0]] or width % BLOCK_COLUMNS[kinds[1]]:
            raise ValueError(
                f"experts of {hidden} x {width} in {'/'.join(kinds)} blocks need {hidden} a multiple of "
                f"{BLOCK_COLUMNS[kinds[0]]} and {width} of {BLOCK_COLUMNS[kinds[1]]}"
            )
        for index, (first, second) in enumerate(zip(gate_up, down, strict=True)):
            if (
                (first.kind, second.kind) != kinds
                or not (well_formed(first) and well_formed(second))
                or (first.out_features, first.in_features) != (2 * width, hidden)
                or (second.out_features, second.in_features) != (hidden, width)
            ):
                raise ValueError(f"expert {index}'s blocks differ in kinds or shape from expert 0's")
        tables = {
            "gate_up": addresses([weight.data for weight in gate_up]),
            "down": addresses([weight.data for weight in down]),
        }
        biases = expert_biases(tables, len(gate_up), hidden, width, gate_up_bias, down_bias, activation)
        return cls(
            tuple(weight.data for weight in gate_up),
            tuple(weight.data for weight in down),
            None,
            None,
            hidden,
            width,
            BLOCK_KINDS[kinds[0]],
            tables,
            biases,
            activation,
            limit,
            alpha,
            blocks=kinds,
        )

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def scale_groups(self) -> tuple[int, int]:
        """Int8 scales per row of gate_up's and down's weights (0 without scales)."""
        if self.gate_up_scales is None:
            return 0, 0
        return scale_groups(self.gate_up_scales[0]), scale_groups(self.down_scales[0])


def expert_biases(
    tables: dict[str, torch.Tensor],
    num_experts: int,
    hidden: int,
    width: int,
    gate_up_bias: Sequence[torch.Tensor] | None,
    down_bias: Sequence[torch.Tensor] | None,
    activation: str,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """Check the experts' biases (float32, contiguous, ``[2 * width]`` and ``[hidden]``; both or neither) and
    activation, and add the biases' addresses to ``tables``; the biases kept alive, or None."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; the kernel has {', '.join(EXPERT_ACTIVATIONS)}")
    if gate_up_bias is None and down_bias is None:
        return None
    biases = (tuple(gate_up_bias or ()), tuple(down_bias or ()))
    for name, tensors, length in (("gate_up", biases[0], 2 * width), ("down", biases[1], hidden)):
        if len(tensors) != num_experts or any(
            bias.dtype != torch.float32 or not bias.is_contiguous() or tuple(bias.shape) != (length,)
            for bias in tensors
        ):
            raise ValueError(f"every expert needs a contiguous float32 {name} bias [{length}]")
    tables["gate_up_bias"], tables["down_bias"] = addresses(biases[0]), addresses(biases[1])
    return biases


def addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64)


class CpuKernels:
    """The compiled kernels, on float32 CPU tensors. Each method checks the layout of what the C side will read and
    raises ``ValueError`` on a tensor it cannot read (``FusedLayer`` is fed by the model's own buffers)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        for name, argtypes in _SIGNATURES.items():  # infer_rope -> self._rope, ...
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = None
            setattr(self, "_" + name.removeprefix("infer_"), function)
        simd_width, pass_rows, tile_kind = library.infer_simd_width, library.infer_pass_rows, library.infer_tile_kind
        flash_kind, block_pass_rows = library.infer_flash_kind, library.infer_block_pass_rows
        for query in (simd_width, pass_rows, tile_kind, flash_kind, block_pass_rows):
            query.argtypes, query.restype = [], _INT
        self.simd = SIMD_NAMES[simd_width()]
        # The GEMV streams the weights once per this many rows of x.
        self.pass_rows = pass_rows()
        # The block GEMV (``linear_blocks``) keeps this many rows of x in registers over a group of weights.
        self.block_pass_rows = block_pass_rows()
        # The designs ``gemm_blocks`` runs here (see there), and the one it takes by default past 16 rows (int8 up to
        # 16 where it runs: AMX's dequantized panels pay back only over more rows).
        gemm_kind, gemm_runs = library.infer_block_gemm_kind, library.infer_block_gemm_runs
        gemm_kind.argtypes, gemm_kind.restype = [], _INT
        gemm_runs.argtypes, gemm_runs.restype = [_INT], _INT
        self.block_gemm = BLOCK_GEMM_DESIGNS[gemm_kind()]
        self.block_gemm_designs = tuple(name for number, name in BLOCK_GEMM_DESIGNS.items() if gemm_runs(number))
        self._dequantize_blocks_bf16 = library.infer_dequantize_blocks_bf16
        self._dequantize_blocks_bf16.argtypes = [_POINTER, _INT, _INT, _INT, _POINTER]
        self._dequantize_blocks_bf16.restype = _INT
        self._quantize_blocks = library.infer_quantize_blocks
        self._quantize_blocks.argtypes = [_POINTER, _INT, _INT, _INT, _POINTER]
        self._quantize_blocks.restype = _INT
        self._screen_gemv = library.infer_screen_gemv
        self._screen_gemv.argtypes = [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT, _POINTER]
        self._screen_gemv.restype = _INT
        # Whether ``screen_gemv`` runs here (AVX512-VNNI builds).
        screen_vnni = library.infer_screen_vnni
        screen_vnni.argtypes, screen_vnni.restype = [], _INT
        self.screen_vnni = screen_vnni() == 1
        # How ``linear_tiles`` multiplies: "AMX tiles" (the build has AMX and the OS lets this process use it),
        # "AVX512-BF16" (its dot products), or None (plain C, the slow reference).
        self.tiles = TILE_KINDS[tile_kind()]
        self.amx = self.tiles == "AMX tiles"
        # Whether ``linear_tiles`` can multiply float32 rows with float32 FMAs (``fma``; AVX-512 builds).
        self.tile_fma = self.simd == "avx512"
        # Whether ``flash_attention`` exists in this build (it needs AVX512-BF16), and whether its bf16 products
        # run on AMX tiles (as ``linear_tiles``: the build has AMX and the OS lets this process use it).
        flash = flash_kind()
        self.flash, self.flash_amx = flash > 0, flash == 2

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for a few rows ``x`` ``[rows, k]`` (float32, contiguous) and weights packed by
        ``pack_weights``: fp16 or bf16 (``scales`` None), or int8 times ``scales`` (one per group of consecutive
        weights of a row, packed by ``pack_scales``); float32 ``[rows, n]``, accumulated in float32. Streams the
        weights once whatever the rows, so it beats a GEMM only at a few rows (``infer.execution.paths`` sets how
        many)."""
        check_flat(x)
        check_packed(packed, scales)
        out_features, in_features = packed_shape(packed)
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        bias_pointer = address(bias)
        if scales is None:
            linear = self._linear_bf16 if packed.dtype == torch.bfloat16 else self._linear_f16
            linear(x.data_ptr(), x.shape[0], in_features, packed.data_ptr(), bias_pointer, out.data_ptr(), out_features)
        else:
            self._linear_i8(
                x.data_ptr(),
                x.shape[0],
                in_features,
                packed.data_ptr(),
                scales.data_ptr(),
                scales.shape[1],
                bias_pointer,
                out.data_ptr(),
                out_features,
            )
        return out

    def linear_blocks(self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for rows ``x`` ``[rows, k]`` (float32, contiguous) and a weight kept as GGUF's
        blocks (``infer.kernels.cpu.blocks``): each row of ``x`` quantized per 32 columns to int8 (llama.cpp's
        ``Q8_1`` activations), integer dot products per block, float32 sums; float32 ``[rows, n]``. The weights are
        read from memory once whatever the rows. K-quant super-blocks (``q4_k``, ``q6_k``, ``k_mixed``) take the same
        activations, multiplied lane by lane within their sub-blocks (``csrc/gemv_kquants.c``)."""
        check_blocks(x, weight, bias, "linear_blocks")
        out = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
        self._linear_blocks(
            x.data_ptr(),
            x.shape[0],
            weight.in_features,
            weight.data.data_ptr(),
            BLOCK_KINDS[weight.kind],
            address(bias),
            out.data_ptr(),
            weight.out_features,
        )
        return out

    def gemm_blocks(
        self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, design: str | None = None
    ) -> torch.Tensor:
        """``linear_blocks``' product for steps of many rows (prefill chunks, large decode batches), ``[rows, n]`` in
        ``x``'s dtype: float32, or bfloat16 rows in and out (a large step's between bf16 GEMMs; the ``amx-bf16`` design
        reads and writes them as they are, the others widen them). ``design`` (one of ``block_gemm_designs``; default:
        ``int8`` for up to 16 rows where it runs, else ``block_gemm``; K-quant weights keep ``portable`` up to 16
        rows, 12 in AVX2 builds): ``amx-bf16`` multiplies on AMX's bf16 tiles over the weights dequantized to bf16 a
        panel at a time, ``x`` rounded to bf16; ``int8`` with integer dot products over ``x`` quantized per 32
        columns as ``linear_blocks`` quantizes it (its arithmetic, summed in another order); ``portable`` is
        ``linear_blocks`` itself. K-quant weights (``q4_k``, ``q6_k``, ``k_mixed``) take every design, ``int8`` over
        their records unpacked into its layout. ``mxfp4`` weights, which ``amx-bf16`` does not read, take ``int8``
        for any design where it runs."""
        if design is not None and design not in self.block_gemm_designs:
            raise ValueError(
                f"gemm_blocks design {design!r} does not run here; this {self.simd} build runs "
                f"{', '.join(self.block_gemm_designs)}"
            )
        check_blocks(x, weight, bias, "gemm_blocks", bf16_rows=True)
        out = torch.empty((x.shape[0], weight.out_features), dtype=x.dtype)
        number = -1 if design is None else {name: number for number, name in BLOCK_GEMM_DESIGNS.items()}[design]
        gemm = self._gemm_blocks_bf16 if x.dtype == torch.bfloat16 else self._gemm_blocks
        gemm(
            x.data_ptr(),
            x.shape[0],
            weight.in_features,
            weight.data.data_ptr(),
            BLOCK_KINDS[weight.kind],
            address(bias),
            out.data_ptr(),
            weight.out_features,
            number,
        )
        return out

    def dequantize_blocks_bf16(self, weight: BlockWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` as plain bf16 rows ``[out_features, in_features]``: the values ``gemm_blocks``' ``amx-bf16``
        design multiplies (each weight rounded once to bf16), for a bf16 GEMM library's GEMM over many rows of x.
        Written into ``out`` when given (a reused buffer of at least that many elements; the result is a view of
        it). Builds without AMX and AVX512-BF16 (``amx-bf16`` not among ``block_gemm_designs``) raise."""
        if "amx-bf16" not in self.block_gemm_designs:
            raise ValueError(f"dequantize_blocks_bf16 needs a build with AMX and AVX512-BF16, not {self.simd}")
        if not well_formed(weight) or weight.kind == "mxfp4":
            raise ValueError(f"dequantize_blocks_bf16 needs a weight packed by pack_blocks (not mxfp4): {weight.kind}")
        rows = bf16_rows(out, weight.out_features, weight.in_features, "dequantize_blocks_bf16")
        self._dequantize_blocks_bf16(
            weight.data.data_ptr(), BLOCK_KINDS[weight.kind], weight.out_features, weight.in_features, rows.data_ptr()
        )
        return rows

    def quantize_blocks(self, weight: torch.Tensor, kind: str) -> BlockWeight:
        """``infer.kernels.cpu.blocks.quantize_blocks`` in C: a float weight ``[n, k]`` (``k % 32 == 0``) as
        ``q4_0``, ``q4_1`` or ``q8_0`` blocks in the block kernels' layout, the same bytes, written directly: the
        Qwen3-1.7B shape's layers as q4_1 in 1.3-1.6 s against 7.0-7.4 s (docs/performance.md, Startup)."""
        if kind not in QUANTIZED_KINDS:
            raise ValueError(f"quantize_blocks makes q4_0, q4_1 or q8_0 blocks, not {kind!r}")
        if weight.dim() != 2 or weight.shape[1] % BLOCK or weight.device.type != "cpu":
            raise ValueError(
                f"quantize_blocks needs a CPU weight [n, k] with k % {BLOCK} == 0, got {tuple(weight.shape)}"
            )
        out_features, in_features = weight.shape
        group_rows = GROUP_ROWS[kind]
        groups = -(-out_features // group_rows)
        data = streamed_empty((groups, in_features // BLOCK, RECORD_BYTES[kind]), torch.uint8)
        # A few MB of float32 rows at a time (whole groups): a bf16 weight is never widened whole (an output head
        # of 152k x 4,096 would take 2.5 GB).
        step = max(1, QUANTIZE_CHUNK // in_features // group_rows) * group_rows
        for start in range(0, out_features, step):
            rows = weight[start : start + step].detach().float().contiguous()
            out = data[start // group_rows :]
            self._quantize_blocks(rows.data_ptr(), BLOCK_KINDS[kind], rows.shape[0], in_features, out.data_ptr())
        return BlockWeight(data, kind, out_features)

    def linear_tiles(
        self,
        x: torch.Tensor,
        tiles: torch.Tensor,
        bias: torch.Tensor | None,
        fma: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for rows ``x`` ``[rows, k]`` (float32 or bfloat16, contiguous; rounded to bf16)
        and a bf16 weight packed by ``pack_tiles``, accumulated in float32, in ``x``'s dtype: on AMX's tiles or with
        AVX512-BF16's dot products (``tiles``), the same arithmetic in plain C elsewhere (slow: the reference). Any
        number of rows; from about a dozen it beats oneDNN's bf16 GEMM on the model's shapes with float32 rows
        (docs/performance.md). ``fma`` (needs ``tile_fma``): ``x`` is not rounded; float32 FMAs over the widened
        bf16 weights instead, faster where the CPU's float32 rate is more than half its bf16 dot products'. ``out``:
        where the result goes (``[rows, n]``, ``x``'s dtype, contiguous), else a new tensor."""
        if fma and not self.tile_fma:
            raise ValueError(f"linear_tiles' float32 FMAs need an AVX-512 build of the kernels, not {self.simd}")
        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"linear_tiles needs contiguous float32 or bfloat16 CPU rows, got {x.dtype} on {x.device}")
        if tiles.dtype != torch.bfloat16 or tiles.dim() != 6 or not tiles.is_contiguous():
            raise ValueError("linear_tiles needs a bf16 weight packed by pack_tiles")
        out_features, in_features = tiles_shape(tiles)
        if x.shape[1] != in_features or (
            bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,))
        ):
            raise ValueError(
                f"linear_tiles: x {tuple(x.shape)} and bias do not fit weights [{out_features}, {in_features}]"
            )
        if out is None:
            out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
        elif out.dtype != x.dtype or tuple(out.shape) != (x.shape[0], out_features) or not out.is_contiguous():
            raise ValueError(f"linear_tiles' out must be contiguous {x.dtype} [{x.shape[0]}, {out_features}]")
        bf16 = x.dtype == torch.bfloat16
        self._linear_tiles(
            x.data_ptr(),
            bf16,
            x.shape[0],
            in_features,
            tiles.data_ptr(),
            address(bias),
            out.data_ptr(),
            bf16,
            out_features,
            fma,
        )
        return out

    def unpack_tiles(self, tiles: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The plain bf16 weight ``[n, k]`` that ``pack_tiles`` laid out as ``tiles`` (``packing.unpack_tiles`` in
        C, at memory speed): what a projection that keeps only the tiles hands oneDNN's GEMM for a large step.
        Written into ``out`` when given (a reused buffer of at least ``n * k`` elements; the result is a view of it)."""
        if tiles.dtype != torch.bfloat16 or tiles.dim() != 6 or not tiles.is_contiguous():
            raise ValueError("unpack_tiles needs a bf16 weight packed by pack_tiles")
        out_features, in_features = tiles_shape(tiles)
        rows = bf16_rows(out, out_features, in_features, "unpack_tiles")
        self._unpack_tiles(tiles.data_ptr(), out_features, in_features, rows.data_ptr())
        return rows

    def moe_experts(
        self,
        x: torch.Tensor,
        experts: PackedExperts,
        expert_ids: torch.Tensor,
        starts: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        tile_rows: int | None = None,
    ) -> None:
        """``out[tokens[p]] += weights[p] * expert(x[tokens[p]])`` for a step's (token, expert) pairs grouped by
        expert: the ``i``-th group is expert ``expert_ids[i]``'s, pairs ``starts[i]`` to ``starts[i + 1] - 1`` (int64
        ``[groups + 1]``); each expert a gated MLP over ``experts``' packed weights and biases (``PackedExperts``),
        read once for all its tokens. ``x`` and ``out`` ``[tokens, hidden]`` float32, contiguous; ``out`` is added to in
        place, each of its columns by one thread, experts in the order given. Experts on the tiles
        (``experts.tiles``) of at least ``tile_rows`` tokens (None: ``MOE_TILE_ROWS``) multiply on AMX where it runs
        (rows rounded to bf16), others with float32 FMAs; ``pack_weights``' layout streams them in passes of
        ``pass_rows`` rows, and GGUF's blocks (``experts.blocks``) in passes of ``block_pass_rows`` rows with the
        rows and activations quantized as ``linear_blocks`` quantizes them (both meant for a few tokens an expert)."""
        check_flat(x)
        check_flat(out)
        if x.shape[1] != experts.hidden or out.shape[1] != experts.hidden:
            raise ValueError(
                f"moe_experts: x {tuple(x.shape)} and out {tuple(out.shape)} need {experts.hidden} columns"
            )
        groups = expert_ids.shape[0]
        for name, tensor, dtype, length in (
            ("expert_ids", expert_ids, torch.int64, groups),
            ("starts", starts, torch.int64, groups + 1),
            ("tokens", tokens, torch.int64, tokens.shape[0]),
            ("weights", weights, torch.float32, tokens.shape[0]),
        ):
            if tensor.dtype != dtype or tensor.dim() != 1 or tensor.shape[0] != length or not tensor.is_contiguous():
                raise ValueError(
                    f"moe_experts: {name} must be contiguous {dtype} [{length}], got {tensor.dtype} "
                    f"{tuple(tensor.shape)}"
                )
        if groups and (
            int(starts[0]) != 0
            or int(starts[-1]) != tokens.shape[0]
            or int(expert_ids.min()) < 0
            or int(expert_ids.max()) >= experts.num_experts
        ):
            raise ValueError("moe_experts: starts must run from 0 to the number of pairs, expert ids index experts")
        if tokens.shape[0] and (int(tokens.min()) < 0 or int(tokens.max()) >= x.shape[0] or x.shape[0] != out.shape[0]):
            raise ValueError(f"moe_experts: tokens must index the {x.shape[0]} rows of x and out")
        tables = experts.tables
        pairs = (  # every layout's call starts with the step's pairs
            x.data_ptr(),
            experts.hidden,
            experts.width,
            groups,
            expert_ids.data_ptr(),
            starts.data_ptr(),
            tokens.data_ptr(),
            weights.data_ptr(),
        )
        activation = (  # and takes the biases and activation after the weights
            address(tables.get("gate_up_bias")),
            address(tables.get("down_bias")),
            EXPERT_ACTIVATIONS[experts.activation],
            experts.limit,
            experts.alpha,
        )
        gate_up, down = tables["gate_up"].data_ptr(), tables["down"].data_ptr()
        if experts.blocks is not None:
            kinds = [BLOCK_KINDS[kind] for kind in experts.blocks]
            self._moe_experts_blocks(*pairs, gate_up, kinds[0], down, kinds[1], *activation, out.data_ptr())
        elif experts.tiles:
            rows = MOE_TILE_ROWS if tile_rows is None else tile_rows
            self._moe_experts_tiles(*pairs, gate_up, down, *activation, rows, out.data_ptr())
        else:
            gate_up_groups, down_groups = experts.scale_groups
            gate_up_scales, down_scales = address(tables.get("gate_up_scales")), address(tables.get("down_scales"))
            self._moe_experts(
                *pairs, gate_up, gate_up_scales, gate_up_groups, down, down_scales, down_groups, experts.kind,
                *activation, out.data_ptr(),
            )  # fmt: skip

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension of ``x`` ``[rows, dim]``, in
        ``out_dtype`` (float32, or bfloat16 rounded to nearest: a bf16 GEMM's input)."""
        check_flat(x)
        return self._norm(x, None, weight, eps, out_dtype)

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``residual += delta`` in place, then the RMSNorm of the sum (a new tensor in ``out_dtype``). ``delta``
        float32, or bfloat16 (a bf16 GEMM's output, widened as it is added)."""
        check_flat(residual)
        if delta.dtype == torch.bfloat16:
            if delta.device.type != "cpu" or not delta.is_contiguous() or delta.shape != residual.shape:
                raise ValueError("the CPU kernels' RMSNorm adds a contiguous CPU delta of the residual's shape")
        else:
            check_flat(delta)
        return self._norm(residual, delta, weight, eps, out_dtype)

    def _norm(self, residual, delta, weight, eps, out_dtype) -> torch.Tensor:
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the CPU kernels' RMSNorm writes float32 or bfloat16, not {out_dtype}")
        out = torch.empty(residual.shape, dtype=out_dtype)
        self._add_rms_norm_mixed(
            residual.data_ptr(),
            address(delta),
            delta is not None and delta.dtype == torch.bfloat16,
            out.data_ptr(),
            out_dtype == torch.bfloat16,
            weight.data_ptr(),
            residual.shape[0],
            residual.shape[1],
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * width]`` (gate first) -> ``[rows, width]``: float32,
        or bfloat16 in and out (between two bf16 GEMMs; computed in float32, rounded once)."""
        return self._gated_mul(gate_up, self._silu_mul, self._silu_mul_bf16)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` for ``gate_up`` ``[rows, 2 * width]`` (gate first) -> ``[rows, width]``: GeGLU's
        activation, computed as ``gate * sigmoid(2u)`` with ``u`` GELU's tanh argument; float32, or bfloat16 in and
        out as ``silu_mul``."""
        return self._gated_mul(gate_up, self._gelu_tanh_mul, self._gelu_tanh_mul_bf16)

    @staticmethod
    def _gated_mul(gate_up: torch.Tensor, float32_call, bf16_call) -> torch.Tensor:
        bf16 = gate_up.dtype == torch.bfloat16
        if not bf16:
            check_flat(gate_up)
        elif gate_up.device.type != "cpu" or not gate_up.is_contiguous():
            raise ValueError("the CPU kernels' gated activations need contiguous float32 or bfloat16 CPU rows")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        (bf16_call if bf16 else float32_call)(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out

    def rope_(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        head_dim: int,
    ) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``qkv`` ``[T, width]`` in place, by the tables
        ``cos``/``sin`` ``[max_positions, rotary_dim]`` (``RotaryEmbedding``'s, sin's first half negated): each
        head's first ``rotary_dim`` values, the rest as they are (partial rotary)."""
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or positions.dtype != torch.int64:
            raise ValueError("the CPU kernels' RoPE needs float32 rows with contiguous columns and int64 positions")
        self._rope(
            qkv.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            num_heads,
            head_dim,
            rotary_table_width(cos, sin, head_dim),
        )

    def rope_widened(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """``rope_`` over a bf16 GEMM's output ``qkv`` ``[T, width]`` (contiguous): a new float32 ``[T, width]``,
        ``qkv`` widened with its first ``num_heads`` heads rotated, in one pass."""
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or positions.dtype != torch.int64:
            raise ValueError("rope_widened needs contiguous bfloat16 rows and int64 positions")
        out = torch.empty(qkv.shape, dtype=torch.float32)
        self._rope_widen(
            qkv.data_ptr(),
            out.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.shape[0],
            qkv.shape[1],
            num_heads,
            head_dim,
            rotary_table_width(cos, sin, head_dim),
        )
        return out

    def rope_norms(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_heads: int,
        num_heads: int,
        head_dim: int,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``rope_`` with each rotated head RMSNormed first (the first ``q_heads`` of the ``num_heads`` by ``q_norm``,
        the rest by ``k_norm``, float32 ``[head_dim]`` each), in one pass over ``qkv`` ``[T, width]`` (contiguous):
        float32 rows normed and rotated in place and returned; bfloat16 rows (a bf16 GEMM's output) widened into a
        new float32 ``[T, width]`` as they are."""
        if (
            qkv.dtype not in (torch.float32, torch.bfloat16)
            or not qkv.is_contiguous()
            or positions.dtype != torch.int64
        ):
            raise ValueError("rope_norms needs contiguous float32 or bfloat16 rows and int64 positions")
        for norm in (q_norm, k_norm):
            if norm.dtype != torch.float32 or not norm.is_contiguous() or norm.shape != (head_dim,):
                raise ValueError(f"rope_norms needs contiguous float32 norm weights [{head_dim}]")
        out = qkv if qkv.dtype == torch.float32 else torch.empty(qkv.shape, dtype=torch.float32)
        self._rope_norms(
            None if out is qkv else qkv.data_ptr(),
            out.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.shape[0],
            qkv.shape[1],
            q_heads,
            num_heads,
            head_dim,
            q_norm.data_ptr(),
            k_norm.data_ptr(),
            eps,
        )
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum (int64 ``[N]``) of float32 ``logits`` ``[N, vocab]`` (contiguous
        columns): ``logits.max(dim=-1).indices``, a NaN ranked above every number, in one pass over the rows' reads
        (greedy decoding's choice)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or logits.device.type != "cpu":
            raise ValueError("the CPU kernels' argmax needs 2-D float32 CPU logits with contiguous columns")
        if logits.shape[1] == 0:
            raise ValueError("the CPU kernels' argmax needs at least one column")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
        return out

    def screen_rows(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        bounds: torch.Tensor,
        weight: torch.Tensor,
        cap: int,
        extra: torch.Tensor | None = None,
        steps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy rows over an int8 copy of the output head (``infer.model.head_screen.HeadScreen``): ``logits``
        ``[rows, n]`` (float32, contiguous columns) as the copy gave them for ``x`` ``[rows, k]``, each within
        ``bounds[j] * |x|_1`` of the bf16 head's, plus ``extra[j] * steps[r]`` where the copy multiplied x rounded
        (``screen_gemv``: ``extra`` the int8 rows' L1 norms, ``steps`` its rows' rounding steps); every token whose
        upper bound reaches the row's largest lower bound gets its exact logit from ``weight``, the bf16 head as
        plain rows ``[n, k]`` (a tied head's embedding table), in ``pack_tiles``' layout (5-D and more) or
        ``pack_weights``' (3-D), in place: the row's first maximum is then the full head's. Returns each row's
        candidates (int64), -1 for a row with more than ``cap`` of them (left as it was: the caller's full head)."""
        check_flat(x)
        rows, k = x.shape
        n = logits.shape[1]
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or tuple(logits.shape) != (rows, n):
            raise ValueError("the head screen needs float32 logits [rows, vocab] with contiguous columns")
        if bounds.dtype != torch.float32 or not bounds.is_contiguous() or bounds.numel() != n:
            raise ValueError(f"the head screen needs {n} float32 bounds, one per token")
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or weight.numel() != n * k:
            raise ValueError(f"the head screen needs the bf16 head [{n}, {k}], packed and contiguous")
        if (extra is None) != (steps is None):
            raise ValueError("the head screen's extra bounds and rounding steps go together")
        if extra is not None and (extra.dtype != torch.float32 or not extra.is_contiguous() or extra.numel() != n):
            raise ValueError(f"the head screen needs {n} float32 extra bounds, one per token")
        if steps is not None and (steps.dtype != torch.float32 or not steps.is_contiguous() or steps.numel() != rows):
            raise ValueError(f"the head screen needs {rows} float32 rounding steps, one per row")
        layout = 2 if weight.dim() == 2 else 0 if weight.dim() >= 5 else 1
        counts = torch.empty(rows, dtype=torch.int64)
        self._screen_rows(
            x.data_ptr(),
            rows,
            k,
            logits.data_ptr(),
            n,
            logits.stride(0),
            bounds.data_ptr(),
            address(extra),
            address(steps),
            weight.data_ptr(),
            layout,
            cap,
            counts.data_ptr(),
        )
        return counts

    def screen_gemv(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head screen's int8 copy (``screen_quantize``'s weights and ``pack_scales``' per-row scales) times
        ``x`` ``[rows, k]`` (float32, contiguous) with each row of x rounded to int16 (its largest magnitude to
        32,767) on AVX512-VNNI's integer dot products: float32 logits ``[rows, n]`` and each row's rounding step (no
        element of the rounded row lies further from x), for ``screen_rows``' ``steps``. None where this build has
        no AVX512-VNNI (``screen_vnni``)."""
        check_flat(x)
        check_packed(packed, scales)
        if packed.dtype != torch.int8 or scales.shape[1] != 1:
            raise ValueError("the screen's GEMV takes int8 weights with one scale per row")
        out_features, in_features = packed_shape(packed)
        if x.shape[1] != in_features:
            raise ValueError(f"the screen's GEMV needs rows of {in_features} values, got {x.shape[1]}")
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        steps = torch.empty(x.shape[0], dtype=torch.float32)
        ran = self._screen_gemv(
            x.data_ptr(),
            x.shape[0],
            in_features,
            packed.data_ptr(),
            scales.data_ptr(),
            out.data_ptr(),
            out_features,
            steps.data_ptr(),
        )
        return (out, steps) if ran else None

    def screen_quantize(
        self, weight: torch.Tensor, rounding: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head screen's int8 copy of a bf16 head ``weight`` ``[n, k]`` (plain rows, contiguous): the int8
        weights in ``pack_weights``' layout, each row's float32 scale (its largest magnitude / 127), each row's
        bound: its largest difference between a weight and its int8 value times the scale, plus ``rounding`` scales,
        times 1.001, and each row's norm: the L1 norm of its int8 values times the scale, rounded up by 1e-5
        (``screen_rows``' ``extra``; ``infer.model.head_screen.HeadScreen``). A row holding a NaN or an infinity gets
        a NaN scale."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("the head screen quantizes a contiguous bf16 weight [n, k]")
        n, k = weight.shape
        if not can_pack(n, k):
            raise ValueError(f"the head screen's int8 copy needs n % 4 == 0 and k % 8 == 0, got [{n}, {k}]")
        quantized = streamed_empty((n // 4, k // 8, 4, 8), torch.int8)
        scales, bounds, norms = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        self._screen_quantize(
            weight.data_ptr(),
            n,
            k,
            rounding,
            quantized.data_ptr(),
            scales.data_ptr(),
            bounds.data_ptr(),
            norms.data_ptr(),
        )
        return quantized, scales, bounds, norms

    def apply_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Forbidden tokens of ``bitmask[i]`` (int32 ``[n, words]``, ``infer.guide``'s layout) to -inf in row
        ``rows[i]`` (int64) of ``logits`` ``[N, vocab]`` (float32, contiguous columns), in place."""
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.device.type != "cpu":
            raise ValueError("the CPU kernels' bitmask needs float32 CPU logits with contiguous columns")
        if (
            bitmask.dtype != torch.int32
            or not bitmask.is_contiguous()
            or rows.dtype != torch.int64
            or len(rows) != len(bitmask)
            or -(-logits.shape[1] // 32) > bitmask.shape[1]
        ):
            raise ValueError("the bitmask must be contiguous int32 [rows, ceil(vocab / 32)] with int64 row indices")
        if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]:
            raise ValueError("a bitmask row index is outside the logits")
        self._apply_bitmask(
            logits.data_ptr(),
            logits.stride(0),
            bitmask.data_ptr(),
            bitmask.shape[1],
            rows.data_ptr(),
            len(rows),
            logits.shape[1],
        )

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Token ``t``'s K/V ``[T, kv_heads, head_dim]`` (float32, rows may be strided) into one layer's pool
        ``[2, num_blocks, block_size, kv_heads, head_dim]`` (float32, or bfloat16: rounded to nearest) at
        ``slots[t]`` (int64; negative: skipped)."""
        check_rows(k)
        check_rows(v)
        check_pool(kv_cache)
        check_slots(slots)
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        self._write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            kv_cache.data_ptr(),
            slots.data_ptr(),
            k.shape[0],
            k.shape[1] * k.shape[2],
            num_slots,
            kv_cache.dtype == torch.bfloat16,
        )

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        plan: KernelAttentionPlan,
        scale: float,
        out: torch.Tensor,
        dots: bool = False,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rows of ``q`` ``[T, heads, head_dim]`` (rows may be strided) that ``plan`` names attend to their
        contexts, read through ``block_tables`` (int32) from one layer's pool; results land in the same rows of
        ``out`` ``[T, heads, head_dim]`` (contiguous), which is returned. ``dots`` (a bf16 pool, a head size in
        ``DIRECT_HEAD_DIMS``, ``self.flash``'s AVX512-BF16 build; ignored elsewhere): the queries and the probabilities
        rounded to bf16 and multiplied on the dot products, scores and sums float32 (the flash attention's precision);
        else float32 queries and probabilities over the widened K/V. ``window``: a sliding window, each query sees the
        last ``window`` tokens of its context (blocks wholly before them are not read); None: all of them. ``sinks``:
        attention sinks, a float32 logit per query head (contiguous ``[heads]``; -inf: none) in each row's softmax
        denominator; None: none."""
        check_rows(q)
        check_pool(kv_cache)
        check_block_tables(block_tables)
        _, num_heads, head_dim = q.shape
        check_sinks(sinks, num_heads)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        rows = address(plan.rows)
        self._paged_attention(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            rows,
            plan.seq_of_query.data_ptr(),
            plan.context_lens.data_ptr(),
            address(plan.own_keys),
            out.data_ptr(),
            plan.num_queries,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            plan.max_context,
            scale,
            kv_cache.dtype == torch.bfloat16,
            dots,
            window_arg(window),
            address(sinks),
        )
        return out

    def flash_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        chunks: FlashChunks,
        scale: float,
        out: torch.Tensor,
        fma: bool = False,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention for the prefill chunks ``chunks`` names (rows of ``q`` ``[T, heads, head_dim]``, rows
        may be strided) over their contexts in one layer's pool, at the precision of torch's bf16 flash attention
        (Q, K, V and the probabilities rounded to bf16, scores and sums float32); results land in the same rows of
        ``out`` ``[T, heads, head_dim]`` (contiguous), which is returned. Needs ``self.flash`` and a head size that
        is a multiple of 64. The bf16 products run on AMX tiles where ``self.flash_amx`` and the head size is in
        ``DIRECT_HEAD_DIMS``, else on AVX512-BF16's dot products. ``fma``: float32 FMAs over the widened K/V instead, Q
        and the probabilities not rounded (faster where the CPU's float32 rate beats its bf16 dot products, as
        ``linear_tiles``' ``fma``). ``window``: a sliding window, each row sees its own position and the ``window - 1``
        before it (keys before the window of a chunk's first row are not read); None: every one. ``sinks``: as
        ``paged_attention``'s."""
        check_rows(q)
        check_pool(kv_cache)
        check_block_tables(block_tables)
        _, num_heads, head_dim = q.shape
        check_sinks(sinks, num_heads)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        if not self.flash or head_dim % 64:
            raise ValueError(
                f"flash_attention needs an AVX512-BF16 build and head_dim a multiple of 64 (build: "
                f"{self.flash}, head_dim {head_dim})"
            )
        if not out.is_contiguous() or out.shape != q.shape or out.dtype != torch.float32:
            raise ValueError("flash_attention writes a contiguous float32 out of q's shape")
        self._flash_attention(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            chunks.starts.data_ptr(),
            chunks.query_lens.data_ptr(),
            chunks.contexts.data_ptr(),
            chunks.tables.data_ptr(),
            chunks.count,
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            scale,
            kv_cache.dtype == torch.bfloat16,
            fma,
            window_arg(window),
            address(sinks),
        )
        return out


@dataclass(slots=True)
class FlashChunks:
    """The prefill chunks ``flash_attention`` computes: chunk ``i`` is token rows ``starts[i]`` onwards,
    ``query_lens[i]`` of them, the last positions of a context of ``contexts[i]`` tokens read through block table
    row ``tables[i]`` (int64 each)."""

    starts: torch.Tensor
    query_lens: torch.Tensor
    contexts: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def of(cls, chunks: list[tuple[int, int, int, int]]) -> FlashChunks:
        """From ``(start, query_len, context, table_row)`` per chunk."""
        columns = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 4).t().contiguous()
        return cls(*columns)

    @property
    def count(self) -> int:
        return len(self.starts)


def bf16_rows(out: torch.Tensor | None, out_features: int, in_features: int, caller: str) -> torch.Tensor:
    """Plain bf16 rows ``[out_features, in_features]`` for a kernel to write a weight into: a view of the start of
    ``out`` (a reused buffer, at least that many elements), else fresh."""
    size = out_features * in_features
    if out is None:
        out = torch.empty(size, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < size:
        raise ValueError(f"{caller} needs a contiguous bf16 buffer of at least {size} elements")
    return out.view(-1)[:size].view(out_features, in_features)


def address(tensor: torch.Tensor | None) -> int | None:
    """Where ``tensor``'s data starts, for a C struct field (None: NULL)."""
    return None if tensor is None else tensor.data_ptr()


def window_arg(window: int | None) -> int:
    """A sliding window as the C side takes it: its length, 0 for none."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one token, got {window}")
    return window or 0


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Attention sinks as the C side reads them: None, or ``num_heads`` contiguous float32 logits."""
    if sinks is not None and (
        sinks.dtype != torch.float32 or not sinks.is_contiguous() or tuple(sinks.shape) != (num_heads,)
    ):
        raise ValueError(
            f"attention sinks are {num_heads} contiguous float32 logits, one per query head; got "
            f"{tuple(sinks.shape)} {sinks.dtype}"
        )


def scale_groups(scales: torch.Tensor | None) -> int:
    """Scales per row of int8 weights packed by ``pack_scales`` (0: fp16 or bf16 weights, which take none)."""
    return 0 if scales is None else scales.shape[1]


def check_blocks(
    x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, name: str, bf16_rows: bool = False
) -> None:
    """Rows ``x`` (float32, or with ``bf16_rows`` bfloat16 too), a weight kept as blocks and a bias that ``name`` (a
    block kernel) can read together."""
    if not (bf16_rows and x.dtype == torch.bfloat16):
        check_flat(x)
    elif x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"{name} needs contiguous bf16 CPU rows, got them on {x.device} with strides {x.stride()}")
    data = weight.data
    if not well_formed(weight):
        raise ValueError(
            f"{name} needs a {weight.kind} weight packed by pack_blocks, got {data.dtype} {tuple(data.shape)}"
        )
    if x.shape[1] != weight.in_features or (
        bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.out_features,))
    ):
        raise ValueError(
            f"{name}: x {tuple(x.shape)} and bias do not fit weights [{weight.out_features}, {weight.in_features}]"
        )


def check_flat(x: torch.Tensor) -> None:
    """A matrix the kernels can read: float32 on the CPU, contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(
            f"the CPU kernels need contiguous float32 CPU tensors, got {x.dtype} on {x.device} with "
            f"strides {x.stride()}"
        )


def check_tiles(tiles: torch.Tensor, scales: object) -> None:
    """A bf16 weight from ``pack_tiles`` (which takes no scales)."""
    if tiles.dim() != 6 or not tiles.is_contiguous() or tiles.dtype != torch.bfloat16 or scales is not None:
        raise ValueError("experts on the tiles need bf16 weights packed by pack_tiles, without scales")


def check_packed(packed: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Weights from ``pack_weights``: fp16 or bf16 without scales, or int8 with their scales from ``pack_scales``."""
    if packed.dim() != 4 or not packed.is_contiguous() or packed.dtype not in WEIGHT_KINDS:
        raise ValueError("the CPU kernels need weights packed by pack_weights (fp16, bf16 or int8)")
    if (packed.dtype == torch.int8) != (scales is not None):
        raise ValueError("int8 weights need their scales (pack_scales), fp16 and bf16 weights take none")
    if scales is None:
        return
    out_features, in_features = packed_shape(packed)
    groups = scales.shape[1] if scales.dim() == 3 else 0
    usable = groups and in_features % groups == 0 and (in_features // groups) % 8 == 0
    if (
        not usable
        or scales.dtype != torch.float32
        or scales.shape != (out_features // 4, groups, 4)
        or not scales.is_contiguous()
    ):
        raise ValueError(
            f"int8 weights [{out_features}, {in_features}] need float32 scales packed by pack_scales "
            f"([{out_features // 4}, groups, 4], groups of a multiple of 8 weights), got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )


def check_block_tables(block_tables: torch.Tensor) -> None:
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("the CPU kernels need block tables as int32 rows")


def check_slots(slots: torch.Tensor) -> None:
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError("the CPU kernels need the slot mapping as contiguous int64")


def check_pool(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype not in KV_DTYPES or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("the CPU kernels need one layer's KV pool as a contiguous float32 or bfloat16 CPU tensor")


def check_rows(x: torch.Tensor) -> None:
    """Rows of heads the kernels can read: float32 on the CPU, each row's heads contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(
            f"the CPU kernels need float32 CPU rows of contiguous heads, got {x.dtype} on {x.device} "
            f"with strides {x.stride()}"
        )


def rotary_table_width(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    """The rotated values a head has under the RoPE tables ``cos``/``sin`` ``[max_positions, rotary_dim]``
    (contiguous float32, ``rotary_dim`` even and at most ``head_dim``)."""
    rotary_dim = cos.shape[-1]
    if (
        cos.shape != sin.shape
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or not (cos.is_contiguous() and sin.is_contiguous())
        or rotary_dim % 2
        or rotary_dim > head_dim
    ):
        raise ValueError(
            f"the CPU kernels' RoPE needs contiguous float32 tables of the same shape, [positions, an even width "
            f"up to head_dim {head_dim}]; got cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}"
        )
    return rotary_dim
