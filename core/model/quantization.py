"""Packed linear weights for CPU matmuls (``model.quantization``), through torch's fbgemm ops.

On an AVX2 CPU a decode step is bound by reading the weights from memory, and float32 weights are 4 bytes each.
fbgemm, which ships inside torch's x86 builds, multiplies float32 activations by weights packed once at load time:

- ``fp16``: half-precision weights, float32 activations and accumulation (``quantized.linear_dynamic_fp16``).
  Half the bytes of float32; relative error of a matmul about 2e-4.
- ``bf16``: bfloat16 weights (a bf16 model's own). Steps of a few tokens read them through infer's CPU kernels
  with float32 activations and sums; larger steps multiply through infer's tile kernel (AMX tiles, else
  AVX512-BF16 dot products; up to ``TILE_MAX_ROWS`` rows) or run oneDNN's bf16 GEMM over the same weights (AMX or
  AVX512-BF16; unpacked from the tiles' one copy for the call where the kernels keep tiles, else prepacked once),
  activations rounded to bf16 and float32 accumulation, the precision of a bf16 model. What ``auto`` picks on a CPU
  with native bf16: on the Intel AMX machine the GEMM at 64 rows measured 5-6x fbgemm's fp16 and 12x at 512
  (docs/performance.md).
- ``int8``: weight-only int8, one scale per 32 consecutive weights of a row (``int8_weights``), activations stay
  float32. Steps of a few tokens read the int8 weights through infer's CPU kernels (``infer.kernels.cpu``: 9/16 of
  fp16's bytes with the scales, and bytes are the decode step's bound); larger steps run fbgemm's fp16 GEMM over
  the same weights dequantized, which the scales make exact in fp16, so both paths multiply by identical weights.
  Memory: the fp16 copy plus the int8 one. One scale per row instead measured 16.7% agreement with float32's
  greedy answers, per 64 weights 28.3%, per 32 40.3% (fp16: 94.1%).
- ``int8_per_row``: the same with one scale per row: faster at batch 1 (one scale per block row to apply, no group
  sums), further from float32's answers (16.7% agreement).
- ``w8a8``: int8 weights with one scale per output row, activations quantized per call to 8 bits with one scale
  per tensor (fbgemm's ``quantized.linear_dynamic``). A quarter of the bytes; relative error about 2e-2, so this
  135M model's greedy answers change from the first tokens (``benchmarks/quantization.py`` counts them).

- ``q4_0``, ``q4_1``, ``q8_0``: GGUF's blocks of 32 weights, each block with an fp16 scale (``q4_1``: and a
  minimum): 4.5, 5 and 8.5 bits a weight. Steps of a few rows multiply through infer's block GEMV
  (``infer.kernels.cpu``: activations quantized per block to int8, integer dot products, as llama.cpp), larger ones
  through its block GEMM (AMX's bf16 tiles over panels dequantized to bf16 where AMX runs, else the GEMV's int8
  arithmetic with every output a lane of its own; docs/performance.md). ``q4`` and ``q8`` quantize a float
  checkpoint so (``q4``: ``q4_1``, whose minimum keeps closer to float32's answers; ``q8``: ``q8_0``), as
  llama.cpp's quantizers do; ``gguf`` keeps a GGUF file's own ``Q4_0``/``Q4_1``/``Q8_0`` tensors and its K-quant
  ``Q4_K``/``Q6_K`` ones (super-blocks of 256 with 6-bit or int8 sub-block scales: 4.5 and 6.6 bits a weight, the
  two a ``Q4_K_M`` file mixes) as they are (``infer.model.gguf_blocks``), no float copy kept, and packs its other
  projections as ``q8_0`` with a warning.

On an AVX2 CPU fp16 runs this model's projections about 3x faster than float32 at one row and 1.4x at 64; w8a8
about 1.2x faster than fp16; torch's own bfloat16 and weight-only int8/int4 kernels were slower than fp16 there (the
table: ``benchmarks/README.md``, "Weight packing").
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from infer.kernels.cpu.blocks import (
    GROUP_ROWS,
    QUANTIZED_KINDS,
    BlockWeight,
    bytes_per_weight,
    dequantize_blocks,
    quantize_blocks,
)
from infer.kernels.cpu.packing import can_pack, can_pack_tiles, pack_scales, pack_tiles, pack_weights, unpack_tiles
from infer.model import Linear

QUANTIZATIONS = ("none", "fp16", "bf16", "int8", "int8_per_row", "w8a8", "q4_0", "q4_1", "q8_0", "gguf")
# GGUF's block kinds (``PackedLinear`` modes, run on the block kernels; the K-quant ones only as a GGUF file stores
# them, MXFP4 as a checkpoint does), and the config's short names for two of them.
BLOCK_MODES = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "k_mixed", "mxfp4")
BLOCK_ALIASES = {"q4": "q4_1", "q8": "q8_0"}
# What ``gguf`` packs weights its file does not give as blocks in: the projections it stores otherwise, and a
# drafter's own weights (an EAGLE head, a draft model).
GGUF_OTHERS = "q8_0"
# Weights per int8 scale in mode int8 (int8_per_row: a whole row).
INT8_GROUP = 32
KERNEL_MODES = ("fp16", "bf16", "int8", "int8_per_row")
# bf16 on AVX512-BF16's dot products (no AMX): inputs of up to this many rows take infer's tile GEMM
# (``CpuKernels.linear_tiles``), larger ones (prefill chunks) oneDNN's GEMM over the tiles unpacked for the call
# (``CpuKernels.unpack_tiles``), level with it there (``benchmarks/tile_gemm.py``). On AMX every input takes the
# tiles: with the threads sharing the blocks as they finish, a prefill step of four 512-token prompts of the
# Qwen3-1.7B shape takes 1.15-1.47x less time than with oneDNN's GEMM past 256 rows (docs/performance.md).
TILE_MAX_ROWS = 256
# Block weights where the block GEMM runs on AMX: inputs of at least this many rows (prefill chunks) multiply through
# oneDNN's bf16 GEMM over the weight dequantized to bf16 for the call (``CpuKernels.dequantize_blocks_bf16``, the
# values the AMX design multiplies). One thread, bf16 rows, on the default model's and Qwen3-0.6B's gate/up and down
# projections: 0.82-1.15x the AMX design's time at 1,024 rows, 0.50-0.93x at 2,048 (a default prefill chunk), 1.3-1.6x
# at 256-512 (``benchmarks/block_gemm.py --bf16-rows``; docs/performance.md).
DENSE_BLOCK_ROWS = 1024
# CPU feature flags for native bf16 matmuls on x86 (oneDNN's bf16 GEMM runs on them).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def bf16_gemm_available() -> bool:
    """Whether this x86 CPU multiplies bf16 natively (AVX512-BF16 or AMX) through torch's oneDNN."""
    from infer.host import cpu_flags

    return (
        bool(cpu_flags() & BF16_CPU_FLAGS)
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def resolve_quantization(
    name: str, dtype_setting: str, dtype: torch.dtype, device: torch.device, path: Path | None = None, kernels=None
) -> str:
    """The quantization to apply. ``auto`` packs weights on an x86 CPU when the dtype was left to ``auto`` (which
    there resolves to float32 activations): a GGUF file's own blocks (``gguf``) where ``path`` (the resolved
    ``model.path``) is one whose projections are stored as blocks and the block GEMM runs on AMX (``kernels``,
    ``gguf_blocks_preferred``); else bf16 where the CPU multiplies bf16 natively, else fp16. An explicit ``dtype:
    float32`` stays exact."""
    if name == "auto":
        packable = device.type == "cpu" and dtype == torch.float32 and fbgemm_available()
        if not packable or dtype_setting != "auto":
            return "none"
        if path is not None and gguf_blocks_preferred(path, kernels):
            return "gguf"
        return "bf16" if bf16_gemm_available() else "fp16"
    if name == "none":
        return name
    name = BLOCK_ALIASES.get(name, name)
    if name not in QUANTIZATIONS:
        raise ValueError(
            f"unknown model.quantization {name!r}; choose one of auto, {', '.join([*QUANTIZATIONS, *BLOCK_ALIASES])}"
        )
    if device.type != "cpu" or not fbgemm_available():
        raise ValueError(
            f"model.quantization={name} needs a CPU build of torch with fbgemm (x86); this run is on "
            f"{device.type} with engines {torch.backends.quantized.supported_engines}"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"model.quantization={name} computes in float32; set model.dtype=float32 or auto (got {dtype})"
        )
    return name


def gguf_blocks_preferred(path: Path, kernels) -> bool:
    """Whether ``auto`` keeps the GGUF file ``path``'s blocks: every projection of its layers is stored as blocks the
    kernels run (``infer.model.gguf_blocks.BLOCK_TYPES``), and ``kernels`` (None: no C kernels) multiply large steps
    of blocks on AMX beside oneDNN's bf16 GEMM. There, against the same file's weights as bf16, the blocks measured
    2.3x the output tokens at batch 1, 0.87-0.98x in the 64-request chat mix and 0.87-1.02x in prefill
    (docs/performance.md); on CPUs without AMX their large steps run on the int8 design, not measured against bf16
    or fp16 there, so ``auto`` keeps those."""
    if path.suffix != ".gguf" or kernels is None or kernels.block_gemm != "amx-bf16" or not bf16_gemm_available():
        return False
    from infer.model.gguf_blocks import stores_blocks

    return stores_blocks(path)


def int8_weights(weight: torch.Tensor, group: int = INT8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights ``[n, k]`` and float32 scales ``[n, k / group]``, one per ``group`` consecutive weights
    of a row (the group's largest maps to about 127); ``k % group == 0``. Each scale is rounded up to 4 significant
    bits, so every weight times its scale (at most 127 x 16 in units of the scale's last bit, under fp16's 11) is
    exact in fp16 where the group's largest weight is above ~1e-5: fbgemm's fp16 GEMM and the int8 GEMV then compute
    with the same weights. The rounding widens the quantization step by at most 1/8 (to ~6.9 bits)."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int8 weights need in_features % {group} == 0, got {tuple(weight.shape)}")
    groups = weight.reshape(out_features, in_features // group, group)
    largest = groups.abs().amax(dim=2).clamp(min=1e-8)
    mantissa, exponent = torch.frexp(largest / 127.0)  # mantissa in [0.5, 1)
    scales = torch.ldexp(torch.ceil(mantissa * 16) / 16, exponent).float()
    quantized = torch.round(groups / scales[:, :, None]).clamp(-127, 127).to(torch.int8)
    return quantized.view(out_features, in_features), scales


def dequantize_int8(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights ``[n, k]`` that ``int8_weights`` encodes."""
    out_features, in_features = quantized.shape
    groups = quantized.view(out_features, scales.shape[1], -1).float()
    return (groups * scales[:, :, None]).view(out_features, in_features)


class PackedLinear(nn.Module):
    """A linear layer whose weight lives packed for fbgemm (see the module's docstring for the modes); float32 in,
    float32 out.

    ``weight`` stays reachable where it is asked for (``keep_weight``: the output head, whose rows drafters slice),
    except where the packed copy gives back the weight it multiplies with (bf16 mode with a bf16 weight, exactly;
    blocks); ``full_weight`` gives it either way. Otherwise the float copy is dropped.
    """

    def __init__(self, linear: nn.Linear, mode: str, keep_weight: bool = False, blocks: BlockWeight | None = None):
        """``blocks`` (block modes): the weight already as blocks (a GGUF file's), else ``linear``'s is quantized.
        Mode ``gguf`` without ``blocks`` (a weight its file has none for) packs as ``GGUF_OTHERS``."""
        super().__init__()
        mode = GGUF_OTHERS if mode == "gguf" else mode
        self.mode = mode
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Block and bf16 modes read the weight as it is held (a bf16 checkpoint's: no float32 copy); the others
        # quantize from float32.
        held = linear.weight.detach()
        weight = held if mode in BLOCK_MODES or mode == "bf16" else held.float()
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.scales: torch.Tensor | None = None  # int8 modes: [n, groups]
        self.blocks: BlockWeight | None = None  # block modes
        kernels = None
        if mode in BLOCK_MODES:
            from infer.kernels.cpu.builder import load

            kernels = load("auto")  # block weights' only fast path, whatever the step; they quantize float ones too
            self.blocks = blocks if blocks is not None else _quantized_blocks(weight, mode, kernels)
            self.packed = None
            self.nbytes = self.blocks.nbytes
        elif mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
            self.nbytes = weight.numel() * 2
        elif mode == "bf16":
            # Plain bf16 until a step needs oneDNN's layout (``forward``): the kernels lay out their tiles from it.
            self.packed = weight.to(torch.bfloat16)
            self.nbytes = weight.numel() * 2
        elif mode in ("int8", "int8_per_row"):
            group = INT8_GROUP if mode == "int8" else self.in_features
            if self.in_features % group:
                raise ValueError(
                    f"model.quantization=int8 needs in_features % {group} == 0, got a linear layer "
                    f"{self.in_features} -> {self.out_features} (int8_per_row takes any)"
                )
            quantized, self.scales = int8_weights(weight, group)
            self.packed = torch.ops.quantized.linear_prepack_fp16(dequantize_int8(quantized, self.scales), bias)
            self.nbytes = weight.numel() * 2 + self.scales.numel() * 4
        elif mode == "w8a8":
            scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0).double()
            zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
            with warnings.catch_warnings():  # quantized tensor dtypes are deprecated; fbgemm's prepack still takes them
                warnings.simplefilter("ignore", UserWarning)
                quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)
            self.nbytes = weight.numel() + weight.shape[0] * 8
        else:
            raise ValueError(f"unknown packing mode {mode!r}")
        if bias is not None:
            self.nbytes += bias.numel() * 4
        self.bias = bias
        # The weight a caller reads (``keep_weight``: drafters slice the output head's rows), unless the packing gives
        # back the weight it multiplies with (``full_weight``): bf16 mode's copy of a bf16 weight (exactly the one
        # given), and blocks (their values).
        gives_back = mode in BLOCK_MODES or (mode == "bf16" and held.dtype == torch.bfloat16)
        self.weight = linear.weight if keep_weight and not gives_back else None
        self.kernels = kernels
        self.gemv_rows = 0  # inputs of at most this many rows take the kernels' GEMV (``use_cpu_kernels``)
        # For a few rows: the weights in cpu_kernels.pack_weights' layout, fp16 (mode fp16) or int8 (int8 modes) with
        # their scales in pack_scales' layout.
        self.kernel_weight: torch.Tensor | None = None
        self.kernel_scales: torch.Tensor | None = None
        # bf16 on kernels with AMX or AVX512-BF16: the weights' one copy, in pack_tiles' layout (kernel_weight and
        # oneDNN's copy ``packed`` then None): inputs of up to TILE_MAX_ROWS rows multiply on it (every input with
        # ``tiles_only``), larger ones on oneDNN's GEMM over it unpacked for the call.
        self.tile_weight: torch.Tensor | None = None
        # bf16 with tiles where float32 FMAs outrun the bf16 dot products (``use_cpu_kernels``' ``tile_fma``): every
        # input the GEMV does not take multiplies on the tiles with float32 FMAs.
        self.tile_fma = False
        # bf16 with tiles that every input multiplies on, whatever its rows: AMX's, the FMAs, or a caller that
        # multiplies every input over them (``use_cpu_kernels``' ``tiles_only``).
        self.tiles_only = False

    def use_cpu_kernels(
        self, kernels, gemv_rows: int = 0, tile_fma: bool = False, streams: bool = False, tiles_only: bool = False
    ) -> None:
        """Compute inputs of up to ``gemv_rows`` rows (decode at small batches, verification: the execution layer's
        ``fused_max_tokens``) with ``kernels.linear`` (``fp16`` and the int8 modes, shapes ``pack_weights`` takes), over
        a copy of the weights in its layout beside fbgemm's packed one: fp16, or the int8 weights and their scales. The
        streaming GEMV has no fixed per-call cost, where fbgemm pays 20-45 us at one row (docs/performance.md). Costs
        the copy's bytes (counted in ``nbytes``). bf16 on kernels with AMX or AVX512-BF16 (``kernels.tiles``): one copy
        in ``pack_tiles``' layout instead, which ``kernels.linear_tiles`` reads for every input of up to
        ``TILE_MAX_ROWS`` rows (every input on AMX): up to one GEMV pass (``kernels.pass_rows``) its GEMV (float32
        inputs and FMAs, as fast as the GEMV over ``pack_weights``' layout), more on the tiles (docs/performance.md).
        oneDNN's copy goes: larger inputs on AVX512-BF16 run oneDNN's GEMM over the tiles unpacked into a buffer for
        the call (``dense_buffer``), as fast in whole prefills as its own prepacked copy and half the memory.
        ``streams`` keeps ``pack_weights``' layout beside the tiles too, for callers that read that (a mixture of
        experts' C call).
        ``tile_fma`` (bf16 with tiles, kernels with ``tile_fma``): every input of more rows than one GEMV pass takes
        the tiles with float32 FMAs (float32 inputs, not rounded), whatever its rows: for CPUs where that beats the
        bf16 dot products and oneDNN (``infer.execution.calibration.choose_gemm``). ``tiles_only`` (bf16 with tiles):
        inputs of any rows take the tiles, for a caller that multiplies every input over them (a mixture of
        experts' C call). Applied when the kernels are first set. ``kernels`` None undoes it."""
        self.gemv_rows = gemv_rows if kernels is not None else 0
        if self.blocks is not None:  # on the block kernels from construction (``kernels`` None: still)
            return
        if self.mode not in KERNEL_MODES or (kernels is None) == (self.kernels is None):
            return
        group = 8 if self.scales is None else self.in_features // self.scales.shape[1]
        if not can_pack(self.out_features, self.in_features, group):  # stays on fbgemm
            return
        if kernels is None:
            if self.packed is None:  # the plain weight back from the tiles (oneDNN lays it out at its first step)
                self.packed = self.bf16_weight()
                self.nbytes += self.in_features * self.out_features * 2
            for copy in (self.kernel_weight, self.tile_weight):
                self.nbytes -= 0 if copy is None else copy.numel() * copy.element_size()
            self.kernels = self.kernel_weight = self.kernel_scales = self.tile_weight = None
            self.tile_fma = self.tiles_only = False
            return
        if self.mode == "bf16":
            plain = self.bf16_weight()
            if kernels.tiles and can_pack_tiles(self.out_features, self.in_features):
                self.tile_weight = pack_tiles(plain)
                self.tile_fma = tile_fma and kernels.tile_fma
                # every input on the tiles: a caller's request, the FMAs' choice, or AMX (``TILE_MAX_ROWS``)
                self.tiles_only = tiles_only or self.tile_fma or kernels.amx
                self.packed = None  # the tiles are the one copy; the bytes are as many
            if self.tile_weight is None or streams:
                self.kernel_weight = pack_weights(plain)
        else:
            weight, _ = torch.ops.quantized.linear_unpack_fp16(self.packed)
            if self.scales is not None:  # the fp16 weights are the int8 ones times their scales, exactly
                groups = weight.float().view(self.out_features, self.scales.shape[1], -1) / self.scales[:, :, None]
                self.kernel_weight = pack_weights(torch.round(groups).to(torch.int8).view(weight.shape))
                self.kernel_scales = pack_scales(self.scales)
            else:
                self.kernel_weight = pack_weights(weight.to(torch.float16))
        if self.kernel_weight is not None:
            self.nbytes += self.kernel_weight.numel() * self.kernel_weight.element_size()
        self.kernels = kernels

    def full_weight(self) -> torch.Tensor:
        """The weight ``[n, k]``: the one kept (``keep_weight``), else the one this module multiplies with, as a copy
        where it is held packed: in bf16 mode the bf16 weight it was given, exactly; blocks' values in float32."""
        if self.weight is not None:
            return self.weight
        if self.blocks is not None:
            return dequantize_blocks(self.blocks)
        if self.mode != "bf16":
            raise ValueError(f"a {self.mode} PackedLinear keeps no weight to give back (pack it with keep_weight)")
        return self.bf16_weight()

    def bf16_weight(self) -> torch.Tensor:
        """Mode bf16: the plain bf16 weight ``[n, k]``, from whichever copy this module holds."""
        if self.packed is None:
            tiles = self.tile_weight
            return unpack_tiles(tiles) if self.kernels is None else self.kernels.unpack_tiles(tiles)
        return self.packed.to_dense() if self.packed.is_mkldnn else self.packed

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``. ``into``: a buffer ``[rows, out_features]`` the tiles write their result to
        where they multiply ``x`` and its dtype is the result's (a caller's buffer for the output head's logits,
        reused every step instead of mapped and faulted in afresh); other paths return a new tensor."""
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the engine's tokens are already flat
        rows = flat.shape[0]
        if self.blocks is not None:
            out = self.block_linear(flat)
        elif self.tile_weight is not None and (rows <= TILE_MAX_ROWS or self.tiles_only):
            fma = self.tile_fma or (rows <= self.kernels.pass_rows and self.kernels.tile_fma)  # the GEMV: float32
            rows_in = flat if flat.dtype == torch.bfloat16 else flat.float()  # float32 or bf16 rows
            usable = into is not None and into.dtype == rows_in.dtype and x.dim() == 2
            out = self.kernels.linear_tiles(rows_in, self.tile_weight, self.bias, fma, into if usable else None)
        elif self.kernels is not None and rows <= self.gemv_rows and self.kernel_weight is not None:
            out = self.kernels.linear(flat.float(), self.kernel_weight, self.kernel_scales, self.bias).to(x.dtype)
        elif self.mode == "bf16":  # bf16 rows in, bf16 rows out (``StepOps.gemm_dtype``); else float32
            out = bf16_linear(flat, self._gemm_weight())
            if self.bias is not None:
                out += self.bias
        elif self.mode in KERNEL_MODES:  # float32 out, from bf16 rows too (a large step's beside bf16 weights)
            out = torch.ops.quantized.linear_dynamic_fp16(flat.float(), self.packed)
        else:
            # reduce_range: 7-bit activations, so AVX2's 16-bit pairwise sums cannot saturate.
            out = torch.ops.quantized.linear_dynamic(flat.float(), self.packed, True)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def _gemm_weight(self) -> torch.Tensor:
        """Mode bf16: the weight oneDNN's GEMM reads for a large step: the tiles unpacked into the shared buffer where
        they are the one copy (``dense_buffer``), else the plain weight, laid out for oneDNN once."""
        if self.tile_weight is not None:
            return self.kernels.unpack_tiles(self.tile_weight, dense_buffer(self.out_features * self.in_features))
        if not self.packed.is_mkldnn and bf16_gemm_available():
            self.packed = bf16_gemm_weight(self.packed)
        return self.packed

    def block_linear(self, x: torch.Tensor) -> torch.Tensor:
        """Block modes: ``x @ weight.T + bias`` on the block GEMV for inputs of up to ``gemv_rows`` rows and at most
        one of its passes (``kernels.block_pass_rows``: beyond, it reads the weights again for every pass; float32
        out), on the block GEMM for more (``kernels.gemm_blocks``: from one pass and a row on, it measured faster on
        every shape of docs/performance.md; K-quant weights stay on their GEMV there up to 16 rows), and where that
        GEMM runs on AMX, from ``DENSE_BLOCK_ROWS`` rows on oneDNN's bf16 GEMM over the weight dequantized for the
        call; or (no C compiler here) over the dequantized weights, slowly. The GEMMs give bf16 rows for bf16 rows (a
        large step's between them, ``StepOps.gemm_dtype``), else float32."""
        if self.kernels is None:
            return torch.nn.functional.linear(x.float(), dequantize_blocks(self.blocks), self.bias).to(x.dtype)
        dense = self.blocks.kind != "mxfp4"  # (its blocks are not among the AMX design's: the GEMV for any rows)
        if dense and x.shape[0] >= DENSE_BLOCK_ROWS and self.kernels.block_gemm == "amx-bf16" and bf16_gemm_available():
            size = self.blocks.out_features * self.blocks.in_features
            weight = self.kernels.dequantize_blocks_bf16(self.blocks, dense_buffer(size))
            out = torch.nn.functional.linear(x.to(torch.bfloat16), weight).to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        if x.shape[0] <= min(self.gemv_rows, self.kernels.block_pass_rows):
            return self.kernels.linear_blocks(x.float().contiguous(), self.blocks, self.bias)
        rows = x if x.dtype == torch.bfloat16 else x.float()
        return self.kernels.gemm_blocks(rows.contiguous(), self.blocks, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


_dense_rows = torch.empty(0, dtype=torch.bfloat16)


def dense_buffer(size: int) -> torch.Tensor:
    """One bf16 buffer of at least ``size`` elements, reused by every large step's projection that hands oneDNN's GEMM
    its weight unpacked (bf16 tiles, ``TILE_MAX_ROWS``) or dequantized (blocks, ``DENSE_BLOCK_ROWS``) for the call:
    it grows to the largest projection's bf16 bytes once, instead of a fresh allocation every call."""
    global _dense_rows
    if _dense_rows.numel() < size:
        _dense_rows = torch.empty(size, dtype=torch.bfloat16)
    return _dense_rows


def _quantized_blocks(weight: torch.Tensor, kind: str, kernels) -> BlockWeight:
    """``weight`` quantized to ``kind``'s blocks: in C where ``kernels`` loaded (the same bytes, about 5x faster),
    else in torch (which also names a kind infer does not quantize to)."""
    if kernels is not None and kind in QUANTIZED_KINDS:
        return kernels.quantize_blocks(weight, kind)
    return quantize_blocks(weight, kind)


def bf16_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bf16 weight ``[n, k]`` in bf16 for oneDNN's GEMM: reordered into its blocked layout once where it
    runs bf16 natively (``to_dense`` gives the plain weight back), else plain."""
    plain = weight.to(torch.bfloat16)
    return torch.ops.mkldnn._reorder_linear_weight(plain, 64) if bf16_gemm_available() else plain


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``bf16_gemm_weight``'s result, in ``x``'s dtype: float32 (rounded to bf16 on the way
    in), or bfloat16 in and out."""
    rows = x.to(torch.bfloat16)
    if weight.is_mkldnn:
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
    else:
        out = torch.nn.functional.linear(rows, weight)
    return out.to(x.dtype)


@torch.no_grad()
def quantize_linears(
    module: nn.Module,
    mode: str,
    shared: frozenset[int] = frozenset(),
    blocks: Mapping[str, BlockWeight] | None = None,
    prefix: str = "",
) -> nn.Module:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear`` (in place; returns ``module``).
    Weights whose ``id`` is in ``shared`` are kept on the packed module (see ``PackedLinear``). ``blocks``: weights
    already as blocks by module name under ``module`` (``layers.0.self_attn.qkv_proj``), each packed in its kind; mode
    ``gguf`` packs the others as ``GGUF_OTHERS`` (``PackedLinear``)."""
    if mode == "none":
        return module
    for name, child in list(module.named_children()):
        full_name = prefix + name
        if isinstance(child, nn.Linear):
            given = (blocks or {}).get(full_name)
            setattr(
                module,
                name,
                PackedLinear(
                    child,
                    given.kind if given is not None else mode,
                    keep_weight=id(child.weight) in shared,
                    blocks=given,
                ),
            )
        else:
            quantize_linears(child, mode, shared, blocks, full_name + ".")
    return module


def pack_as_blocks(model: nn.Module, blocks: Mapping[str, BlockWeight]) -> None:
    """Replace each linear layer of ``model`` named in ``blocks`` (module names) by a ``PackedLinear`` of its blocks,
    its bias as loaded; the others stay as they are."""
    for module_name, weight in blocks.items():
        parent, _, child = module_name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, PackedLinear(getattr(owner, child), weight.kind, blocks=weight))


def projection(weight: torch.Tensor, mode: str) -> nn.Module:
    """``x @ weight.T`` as a module, packed for ``mode`` (``none``: a plain linear layer sharing ``weight``)."""
    with torch.device(weight.device):
        linear = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear if mode == "none" else PackedLinear(linear, mode)


def quantize_model(model: nn.Module, mode: str, gguf: Path | None = None) -> nn.Module:
    """Pack a ``CausalLM``'s projections and output head. The embedding table stays, and so does the output head's
    weight beside its packed copy (drafters slice rows of it; with tied embeddings it is the table), in bf16 where
    their values are bf16 values (``narrow_float_tables``), else float32.
    Mode ``gguf`` keeps the blocks of the GGUF file ``gguf`` (the model's own: ``model.path`` resolved), packing the
    projections the file stores otherwise as ``q8_0``. A head the load packed already (a GGUF file's, as its blocks)
    stays as it is."""
    if mode == "none":
        return model
    blocks = None
    if mode == "gguf":
        from infer.model.gguf_blocks import read_projections, warn_dequantized

        if gguf is None or gguf.suffix != ".gguf":
            raise ValueError(
                f"model.quantization=gguf keeps a GGUF file's blocks; model.path is {gguf} (set "
                f"model.quantization to q4 or q8 to quantize a float checkpoint)"
            )
        blocks, others = read_projections(gguf, model)
        warn_dequantized(gguf, others, GGUF_OTHERS)
    shared = frozenset({id(model.lm_head.weight)})
    return narrow_float_tables(quantize_linears(model, mode, shared, blocks))


@torch.no_grad()
def narrow_float_tables(model: nn.Module) -> nn.Module:
    """Hold the float32 tables a packed model keeps, the embedding and the output head's weight beside its packed
    copy (one tensor when tied), in bf16 where each of their values is a bf16 value, as a bf16 checkpoint's are: half
    the bytes (622 MB of the Qwen3-1.7B shape's 1.24 GB table), the same numbers, each row widened exactly as it is
    read (``CausalLM.embed``). A table with other values (a GGUF file's dequantized blocks) stays float32."""
    for owner in (model.embed_tokens, model.lm_head):
        table = owner.weight
        if table is None or table.dtype != torch.float32 or not _bf16_values(table):
            continue
        narrow = nn.Parameter(table.to(torch.bfloat16), requires_grad=False)
        for module in (model.embed_tokens, model.lm_head):
            if module.weight is table:
                module.weight = narrow
    return model


def _bf16_values(table: torch.Tensor, rows: int = 4096) -> bool:
    """Whether every float32 value of ``table`` is a bf16 value: its low 16 bits are zero. They are read as every
    other int16 of the table, in place (half the time of masking each value: 0.3-0.4 s for the Qwen3-1.7B shape's
    table on the Intel Xeon of docs/performance.md)."""
    low = 0 if sys.byteorder == "little" else 1
    halves = table.detach().reshape(table.shape[0], -1).view(torch.int16)[:, low::2]
    return all(not torch.any(chunk) for chunk in halves.split(rows))


def packed_bytes_per_weight(mode: str) -> float | None:
    """Bytes a matrix's weight takes packed for ``mode`` (resolved): bf16 2 (held once), blocks their records'; None
    where not estimated (fp16, the int8 modes, a GGUF file's blocks)."""
    if mode == "bf16":
        return 2.0
    if mode in QUANTIZED_KINDS:
        return bytes_per_weight(mode)
    return None


def packed_weight_bytes(mode: str, matrices: int, table: int, table_bytes: float, tied: bool) -> int | None:
    """What a model's weights take packed for ``mode`` (resolved; None where ``packed_bytes_per_weight`` is):
    ``matrices`` weights of its projections and untied output head at the mode's bytes a weight, the embedding
    table's ``table`` weights at ``table_bytes`` (a bf16 checkpoint's 2, float32's 4, a kept GGUF table's blocks'),
    and a tied head's packed copy of it. Norms and biases are left out: a start's estimate, made before the weights
    are read."""
    per_weight = packed_bytes_per_weight(mode)
    if per_weight is None:
        return None
    return int(per_weight * (matrices + (table if tied else 0)) + table_bytes * table)


class BlockEmbedding(nn.Module):
    """A vocabulary table held as a GGUF file's blocks (``blocks``: ``[vocab, hidden]``, one kind), as llama.cpp holds
    it: each lookup dequantizes the groups of rows its tokens fall in (``GROUP_ROWS``), float32 values as the file's
    dequantization gives them, instead of the whole table held dequantized (gpt-oss's 201,088 x 2,880 table: 2.3 GB
    as float32, 0.6 GB as ``Q8_0``). A tied output head packed from the same tensor shares ``blocks``. No
    ``weight`` is held: ``full_weight`` dequantizes a copy."""

    weight = None

    def __init__(self, blocks: BlockWeight):
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.out_features, blocks.in_features

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = GROUP_ROWS[self.blocks.kind]
        flat = input_ids.reshape(-1)
        groups, inverse = torch.unique(torch.div(flat, rows, rounding_mode="floor"), return_inverse=True)
        values = dequantize_blocks(BlockWeight(self.blocks.data[groups], self.blocks.kind, len(groups) * rows))
        return values[inverse * rows + flat % rows].reshape(*input_ids.shape, self.embedding_dim)

    def full_weight(self) -> torch.Tensor:
        """The table ``[vocab, hidden]`` in float32, a copy."""
        return dequantize_blocks(self.blocks)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.blocks.kind}"


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, packed ones included (a tied tensor, or blocks a table and its head share,
    counted once)."""
    total = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    held = {id(module.blocks.data) for module in packed if module.blocks is not None}
    tables = {
        id(module.blocks.data): module.nbytes
        for module in model.modules()
        if isinstance(module, BlockEmbedding) and id(module.blocks.data) not in held
    }
    return total + sum(module.nbytes for module in packed) + sum(tables.values())
