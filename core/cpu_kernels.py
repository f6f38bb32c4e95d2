"""infer's CPU kernels (``csrc/cpu_kernels.c``): the small float32 ops of a step fused, paged attention that reads
K/V straight from the pool, and steps of a few tokens with all layers in one call.

In eager PyTorch a decode step at batch 1 is mostly dispatch: RMSNorm alone is about ten kernels (26 us for 576
floats), RoPE five, SiLU-and-multiply three, and attention gathers every K/V block before it reads it. These kernels
do each in one pass. Linear layers over a few rows get a plain streaming GEMV over packed fp16 weights (fbgemm's fp16
GEMM costs a fixed 20-45 us per call at one row), or int8 ones with a scale per 32 weights (9/16 of the bytes).
``FusedLayer`` chains them so that a decoder layer over a few tokens is two calls around the attention backend's;
``FusedStack`` runs all layers of such a step, attention included, in one.

They are C, compiled once per machine with the system's C compiler (``gcc -O3 -march=native -fopenmp``) into the
cache directory and called through ctypes; OpenMP there is torch's own runtime, so both share one thread pool.

``load(mode)`` gives the kernels or None: ``False`` never builds; ``"auto"`` builds when a compiler is found and
otherwise warns once (callers then run torch's ops); ``True`` raises when they cannot be built. (Booleans, not
on/off strings: YAML and OmegaConf read ``on``/``off`` as booleans.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
_FLOAT = ctypes.c_float
_SIGNATURES = {
    "infer_linear_f16": [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT],
    "infer_linear_i8": [_POINTER, _INT, _INT, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _INT],
    "infer_layer_attention_input": [_POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER],
    "infer_layer_feed_forward": [_POINTER, _INT, _POINTER, _POINTER, _POINTER],
    "infer_add_rms_norm": [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _FLOAT],
    "infer_silu_mul": [_POINTER, _POINTER, _INT, _INT],
    "infer_rope": [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT],
    "infer_write_kv": [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _INT],
    "infer_paged_attention": [_POINTER, _INT, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER,
                              _INT, _INT, _INT, _INT, _INT, _INT, _INT, _FLOAT],
    "infer_layers_few": [_POINTER, _POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER,
                         _INT, _POINTER],
}


class _LayerStruct(ctypes.Structure):
    """``infer_layer`` in the C source: one decoder layer's weights and shapes."""

    _fields_ = [(name, _POINTER) for name in ("qkv", "o", "gate_up", "down", "qkv_scales", "o_scales",
                                              "gate_up_scales", "down_scales", "qkv_bias", "o_bias", "gate_up_bias",
                                              "down_bias", "input_norm", "post_norm")]
    _fields_ += [("eps", _FLOAT)] + [(name, _INT) for name in ("hidden", "qkv_width", "q_width", "intermediate",
                                                               "rotated_heads", "head_dim", "qkv_groups", "o_groups",
                                                               "gate_up_groups", "down_groups")]


class _AttentionStepStruct(ctypes.Structure):
    """``infer_attention_step`` in the C source: one step's attention through ``infer_paged_attention``."""

    _fields_ = [("block_tables", _POINTER), ("table_stride", _INT)]
    _fields_ += [(name, _POINTER) for name in ("slots", "rows", "seq_of_query", "context_lens")]
    _fields_ += [(name, _INT) for name in ("queries", "max_context", "num_heads", "num_kv_heads", "head_dim",
                                           "block_size", "num_blocks")]
    _fields_ += [("scale", _FLOAT)]


class FusedLayer:
    """A decoder layer's dense parts for a few tokens (decode at small batches, verification) as two C calls around
    attention: norm, QKV projection and RoPE; then output projection, norm, gate/up, SiLU-and-multiply, down. Holds
    references to the tensors whose memory the C side reads."""

    def __init__(self, kernels: CpuKernels, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
                 biases: list[torch.Tensor | None], norms: tuple[torch.Tensor, torch.Tensor], eps: float,
                 q_width: int, rotated_heads: int, head_dim: int):
        """``weights``/``scales``/``biases``: packed by ``pack_weights`` (fp16, or int8 with scales packed by
        ``pack_scales``, else None), and float32 (or None) for the QKV, output, gate/up and down projections, in
        that order; ``norms``: the input and post-attention RMSNorm weights."""
        for weight, scale in zip(weights, scales):
            _check_packed(weight, scale)
        self._keep = [*weights, *scales, *biases, *norms]
        (qkv_width, _), (hidden, _), _, (_, intermediate) = (packed_shape(weight) for weight in weights)
        pointer = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
        groups = [0 if scale is None else scale.shape[1] for scale in scales]
        self.struct = _LayerStruct(*(pointer(tensor) for tensor in (*weights, *scales, *biases, *norms)), eps,
                                   hidden, qkv_width, q_width, intermediate, rotated_heads, head_dim, *groups)
        self.hidden = hidden
        self.qkv_width = qkv_width
        self._attention_input = kernels._layer_attention_input
        self._feed_forward = kernels._layer_feed_forward

    def attention_input(self, residual: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """For ``T`` tokens: ``residual += delta`` (``[T, hidden]`` each, in place; no add when None), RMSNorm, QKV
        projection, RoPE at ``positions`` with ``RotaryEmbedding``'s tables: returns the rotated ``[T, qkv_width]``."""
        tokens = residual.shape[0]
        qkv = torch.empty((tokens, self.qkv_width), dtype=torch.float32)
        self._attention_input(ctypes.byref(self.struct), tokens, residual.data_ptr(),
                              None if delta is None else delta.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                              sin.data_ptr(), qkv.data_ptr())
        return qkv

    def feed_forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """From attention's output ``[T, q_width]``: ``residual +=`` its projection (in place), then the MLP of the
        sum's norm, returned as the layer's delta ``[T, hidden]``."""
        tokens = residual.shape[0]
        delta = torch.empty((tokens, self.hidden), dtype=torch.float32)
        self._feed_forward(ctypes.byref(self.struct), tokens, attended.data_ptr(), residual.data_ptr(),
                           delta.data_ptr())
        return delta


class FusedStack:
    """Consecutive decoder layers (``FusedLayer`` each) over a few tokens in one C call, attention included, when
    the attention backend hands its step to the kernels (``AttentionBackend.kernel_attention``). A step of a few
    tokens is otherwise ~5 calls from Python per layer, and that glue measured about a fifth of a decode step at
    batch 1."""

    def __init__(self, kernels: CpuKernels, layers: list[FusedLayer], kv_layers: list[int]):
        """``kv_layers[i]``: the index of layer ``i``'s pool in the KV cache."""
        if len({(layer.hidden, layer.qkv_width, layer.struct.q_width) for layer in layers}) > 1:
            raise ValueError("a fused stack needs layers of one shape")
        self.layers = (_LayerStruct * len(layers))(*(layer.struct for layer in layers))
        self.kv_layers = torch.tensor(kv_layers, dtype=torch.int64)
        self._keep = layers
        self._run = kernels._layers_few

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_cache: torch.Tensor, step: KernelAttentionStep) -> torch.Tensor:
        """The layers over embeddings ``hidden`` ``[T, hidden]``, which become the residual stream (in place);
        returns the last layer's output ``[T, hidden]`` (the final norm adds the two). ``kv_cache``: all layers'
        pools ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
        _check_flat(hidden)
        _check_pool(kv_cache)
        step.check()
        _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        plan = step.plan
        struct = _AttentionStepStruct(
            step.block_tables.data_ptr(), step.block_tables.stride(0), step.slots.data_ptr(),
            None if plan.rows is None else plan.rows.data_ptr(), plan.seq_of_query.data_ptr(),
            plan.context_lens.data_ptr(), plan.num_queries, plan.max_context, step.num_heads, num_kv_heads, head_dim,
            block_size, num_blocks, step.scale)
        delta = torch.empty_like(hidden)
        self._run(self.layers, self.kv_layers.data_ptr(), len(self.layers), hidden.shape[0], hidden.data_ptr(),
                  delta.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
                  kv_cache.stride(0), ctypes.byref(struct))
        return delta


# Steps of at most this many tokens take the kernels' linear layers and ``FusedStack`` (or ``FusedLayer``) instead
# of fbgemm's GEMM (a fixed 20-45 us per call at one row). Decode step in ms, one call vs op by op with fbgemm
# (benchmarks/cpu_kernels.py --only steps: same process, alternating, 3 runs each): batch 1 12.6-13.7 vs 22.7-33.5;
# 2: 12.6-14.2 vs 25.8-28.9; 4: 20.1-21.7 vs 29.9-36.6; 8: 29.4-32.7 vs 39.1-47.3; 12: 49.1-52.4 vs 49.0-54.6.
FEW_ROWS = 8


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here; the message says why."""


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

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for a few rows ``x`` ``[rows, k]`` (float32, contiguous) and weights packed by
        ``pack_weights``: fp16 (``scales`` None), or int8 times ``scales`` (one per group of consecutive weights of
        a row, packed by ``pack_scales``); float32 ``[rows, n]``. Streams the weights once whatever the rows (see
        ``FEW_ROWS``)."""
        _check_flat(x)
        _check_packed(packed, scales)
        out_features, in_features = packed_shape(packed)
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        bias_pointer = None if bias is None else bias.data_ptr()
        if scales is None:
            self._linear_f16(x.data_ptr(), x.shape[0], in_features, packed.data_ptr(), bias_pointer, out.data_ptr(),
                             out_features)
        else:
            self._linear_i8(x.data_ptr(), x.shape[0], in_features, packed.data_ptr(), scales.data_ptr(),
                            scales.shape[1], bias_pointer, out.data_ptr(), out_features)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension of ``x`` ``[rows, dim]``."""
        _check_flat(x)
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None, out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += delta`` in place, then the RMSNorm of the sum (a new tensor)."""
        _check_flat(residual)
        _check_flat(delta)
        out = torch.empty_like(residual)
        self._add_rms_norm(residual.data_ptr(), delta.data_ptr(), out.data_ptr(), weight.data_ptr(),
                           residual.shape[0], residual.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * width]`` (gate first) -> ``[rows, width]``."""
        _check_flat(gate_up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              num_heads: int, head_dim: int) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``qkv`` ``[T, width]`` in place, by the tables
        ``cos``/``sin`` ``[max_positions, head_dim]`` (``RotaryEmbedding``'s, sin's first half negated)."""
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or positions.dtype != torch.int64:
            raise ValueError("the CPU kernels' RoPE needs float32 rows with contiguous columns and int64 positions")
        self._rope(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
                   qkv.stride(0), num_heads, head_dim)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Token ``t``'s K/V ``[T, kv_heads, head_dim]`` (rows may be strided) into one layer's pool
        ``[2, num_blocks, block_size, kv_heads, head_dim]`` at ``slots[t]`` (int64; negative: skipped)."""
        _check_rows(k)
        _check_rows(v)
        _check_pool(kv_cache)
        _check_slots(slots)
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(), slots.data_ptr(),
                       k.shape[0], k.shape[1] * k.shape[2], num_slots)

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        plan: KernelAttentionPlan, scale: float, out: torch.Tensor) -> torch.Tensor:
        """The rows of ``q`` ``[T, heads, head_dim]`` (rows may be strided) that ``plan`` names attend to their
        contexts, read through ``block_tables`` (int32) from one layer's pool; results land in the same rows of
        ``out`` ``[T, heads, head_dim]`` (contiguous), which is returned."""
        _check_rows(q)
        _check_pool(kv_cache)
        _check_block_tables(block_tables)
        _, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        rows = None if plan.rows is None else plan.rows.data_ptr()
        self._paged_attention(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(),
                              block_tables.stride(0), rows, plan.seq_of_query.data_ptr(),
                              plan.context_lens.data_ptr(), out.data_ptr(), plan.num_queries, num_heads,
                              num_kv_heads, head_dim, block_size, num_blocks, plan.max_context, scale)
        return out


def can_pack(out_features: int, in_features: int, group: int = 8) -> bool:
    """Whether ``pack_weights`` lays out this shape, with int8 scales per ``group`` weights of a row if given."""
    return out_features % 4 == 0 and in_features % 8 == 0 and group % 8 == 0 and in_features % group == 0


def pack_weights(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight ``[n, k]`` (fp16, or int8 to be scaled per output row) in ``linear``'s layout:
    blocks of four output rows, each ``[k / 8, 4, 8]`` (eight weights of each of the four rows per 64-byte line in
    fp16, per 32 bytes in int8), so a block is one sequential stream. Needs ``n % 4 == 0`` and ``k % 8 == 0``
    (``can_pack``)."""
    out_features, in_features = weight.shape
    if weight.dtype not in (torch.float16, torch.int8):
        raise ValueError(f"pack_weights takes fp16 or int8 weights, got {weight.dtype}")
    if not can_pack(out_features, in_features):
        raise ValueError(f"pack_weights needs out_features % 4 == 0 and in_features % 8 == 0, got "
                         f"{tuple(weight.shape)}")
    blocks = weight.detach().view(out_features // 4, 4, in_features // 8, 8)
    return blocks.permute(0, 2, 1, 3).contiguous()


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Int8 weights' scales ``[n, groups]`` (float32, one per ``k / groups`` consecutive weights of a row) in
    ``linear``'s layout: per block of four output rows, ``[groups, 4]``."""
    out_features, groups = scales.shape
    if scales.dtype != torch.float32 or out_features % 4:
        raise ValueError(f"pack_scales takes float32 scales [n, groups] with n % 4 == 0, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    return scales.view(out_features // 4, 4, groups).permute(0, 2, 1).contiguous()


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """``(out_features, in_features)`` of a weight packed by ``pack_weights``."""
    return packed.shape[0] * 4, packed.shape[1] * 8


@dataclass(slots=True)
class KernelAttentionPlan:
    """Which token rows ``paged_attention`` computes: query ``i`` is row ``rows[i]`` (all rows in order when None)
    of sequence ``seq_of_query[i]``, attending to its first ``context_lens[i]`` tokens (int64 each)."""

    rows: torch.Tensor | None
    seq_of_query: torch.Tensor
    context_lens: torch.Tensor
    num_queries: int
    max_context: int


@dataclass(slots=True)
class KernelAttentionStep:
    """A step's attention as the kernels run it inside ``FusedStack``: every token is a short query of
    ``plan``, its K/V written at ``slots`` (int64, negative: skipped), contexts read through ``block_tables``."""

    plan: KernelAttentionPlan
    block_tables: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    scale: float

    def check(self) -> None:
        _check_block_tables(self.block_tables)
        _check_slots(self.slots)


def _check_flat(x: torch.Tensor) -> None:
    """A matrix the kernels can read: float32 on the CPU, contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"the CPU kernels need contiguous float32 CPU tensors, got {x.dtype} on {x.device} with "
                         f"strides {x.stride()}")


def _check_packed(packed: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Weights from ``pack_weights``: fp16 without scales, or int8 with their scales from ``pack_scales``."""
    if packed.dim() != 4 or not packed.is_contiguous() or packed.dtype not in (torch.float16, torch.int8):
        raise ValueError("the CPU kernels need weights packed by pack_weights (fp16 or int8)")
    if (packed.dtype == torch.int8) != (scales is not None):
        raise ValueError("int8 weights need their scales (pack_scales), fp16 weights take none")
    if scales is None:
        return
    out_features, in_features = packed_shape(packed)
    groups = scales.shape[1] if scales.dim() == 3 else 0
    usable = groups and in_features % groups == 0 and (in_features // groups) % 8 == 0
    if not usable or scales.dtype != torch.float32 or scales.shape != (out_features // 4, groups, 4) or \
            not scales.is_contiguous():
        raise ValueError(f"int8 weights [{out_features}, {in_features}] need float32 scales packed by pack_scales "
                         f"([{out_features // 4}, groups, 4], groups of a multiple of 8 weights), got {scales.dtype} "
                         f"{tuple(scales.shape)}")


def _check_block_tables(block_tables: torch.Tensor) -> None:
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("the CPU kernels need block tables as int32 rows")


def _check_slots(slots: torch.Tensor) -> None:
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError("the CPU kernels need the slot mapping as contiguous int64")


def _check_pool(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype != torch.float32 or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("the CPU kernels need one layer's KV pool as a contiguous float32 CPU tensor")


def _check_rows(x: torch.Tensor) -> None:
    """Rows of heads the kernels can read: float32 on the CPU, each row's heads contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"the CPU kernels need float32 CPU rows of contiguous heads, got {x.dtype} on {x.device} "
                         f"with strides {x.stride()}")


def source() -> str:
    return resources.files("infer").joinpath("csrc", "cpu_kernels.c").read_text()


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its CPU flags (a cached build must not move between
    CPUs)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def build(directory: Path) -> Path:
    """Compile the kernels into ``directory`` (once per source, flags and CPU) and return the library's path."""
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC, or install gcc)")
    text = source()
    key = hashlib.sha256("\n".join([text, *FLAGS, cc, _cpu_signature()]).encode()).hexdigest()[:16]
    target = directory / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as staging:
            source_path = Path(staging) / "cpu_kernels.c"
            source_path.write_text(text)
            built = Path(staging) / target.name
            result = subprocess.run([cc, *FLAGS, "-o", str(built), str(source_path), "-lm"], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise KernelBuildError(f"{cc} failed to compile the CPU kernels:\n{result.stderr.strip()}")
            os.replace(built, target)  # atomic: concurrent builders each publish a complete file
    except OSError as error:  # a cache folder that cannot be written, a compiler that cannot run
        raise KernelBuildError(f"could not build the CPU kernels in {directory}: {error}") from error
    return target


@functools.cache
def _load() -> CpuKernels:
    from infer.loader import cache_dir

    path = build(cache_dir() / "kernels")
    try:
        return CpuKernels(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"could not load the CPU kernels from {path}: {error}") from error


def load(mode: str | bool = "auto") -> CpuKernels | None:
    """The kernels for ``mode`` (``"auto"``, True, False); None when False, or when ``"auto"`` and they cannot be
    built here (warned once)."""
    if mode not in ("auto", True, False):
        raise ValueError(f"unknown CPU kernels mode {mode!r}; choose auto, true or false")
    if mode is False:
        return None
    try:
        return _load()
    except KernelBuildError as error:
        if mode is True:
            raise
        _warn_unavailable(str(error))
        return None


@functools.cache
def _warn_unavailable(reason: str) -> None:
    logger.warning("CPU kernels unavailable, using torch ops (slower): %s", reason)
