"""Packed linear weights for CPU matmuls (``model.quantization``), through torch's fbgemm ops.

On an AVX2 CPU a decode step is bound by reading the weights from memory, and float32 weights are 4 bytes each.
fbgemm, which ships inside torch's x86 builds, multiplies float32 activations by weights packed once at load time:

- ``fp16``: half-precision weights, float32 activations and accumulation (``quantized.linear_dynamic_fp16``).
  Half the bytes of float32; relative error of a matmul about 2e-4.
- ``int8``: int8 weights with one scale per output row; activations quantized per call to 8 bits with one scale
  per tensor (``quantized.linear_dynamic``). A quarter of the bytes; relative error about 2e-2, so some greedy tokens
  differ from float32 (``benchmarks/quantization.py`` counts them).

Measured on 2 cores of an AMD EPYC (AVX2, no AVX512), the 30 layers' projections of SmolLM2-135M per step:

    rows (tokens)     1         16        64
    float32          34 ms     56 ms     132 ms
    fp16             11 ms     28 ms      92 ms
    int8              9 ms     18 ms      59 ms
    bfloat16 (torch) 15 ms    171 ms     698 ms

torch's weight-only int8/int4 kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) measured 53 and
105 ms at one row on the same CPU (they are tuned for AVX512), so they are not used.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from infer.cpu_kernels import FEW_ROWS, can_pack_f16, pack_f16
from infer.model import Linear

QUANTIZATIONS = ("none", "fp16", "int8")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_quantization(name: str, dtype_setting: str, dtype: torch.dtype, device: torch.device) -> str:
    """The quantization to apply. ``auto`` packs weights in fp16 on a CPU with fbgemm when the dtype was left to
    ``auto`` and resolved to float32 (a CPU without native bfloat16); an explicit ``dtype: float32`` stays exact."""
    if name == "auto":
        packable = device.type == "cpu" and dtype == torch.float32 and fbgemm_available()
        return "fp16" if packable and dtype_setting == "auto" else "none"
    if name == "none":
        return name
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown model.quantization {name!r}; choose one of auto, {', '.join(QUANTIZATIONS)}")
    if device.type != "cpu" or not fbgemm_available():
        raise ValueError(f"model.quantization={name} needs a CPU build of torch with fbgemm (x86); this run is on "
                         f"{device.type} with engines {torch.backends.quantized.supported_engines}")
    if dtype != torch.float32:
        raise ValueError(f"model.quantization={name} computes in float32; set model.dtype=float32 or auto "
                         f"(got {dtype})")
    return name


class PackedLinear(nn.Module):
    """A linear layer whose weight lives packed for fbgemm (``fp16`` or ``int8``); float32 in, float32 out.

    ``weight`` stays reachable when it is shared with another module (a tied output head reads the embedding),
    so code that slices the head's rows still can; otherwise the float32 copy is dropped.
    """

    def __init__(self, linear: nn.Linear, mode: str, keep_weight: bool = False):
        super().__init__()
        self.mode = mode
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float()
        if mode == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
            self.nbytes = weight.numel() * 2
        elif mode == "int8":
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
        self.weight = linear.weight if keep_weight else None
        self.kernels = None
        self.half_weight: torch.Tensor | None = None  # fp16 in cpu_kernels.pack_f16's layout, for a few rows

    def use_cpu_kernels(self, kernels) -> None:
        """Compute inputs of a few rows (``FEW_ROWS``: decode at small batches, verification) with
        ``kernels.linear_f16`` (``fp16`` mode, shapes ``pack_f16`` takes), over a copy of the fp16 weights in its
        layout, beside fbgemm's packed one. The streaming GEMV has no fixed per-call cost, where fbgemm pays 20-45 us
        at one row: 30 layers' projections at one row measured 11.1-12.1 vs 14.7-14.9 ms per step (README, CPU
        performance). Costs the weights' fp16 bytes once more (counted in ``nbytes``)."""
        if self.mode != "fp16" or (kernels is None) == (self.kernels is None):
            return
        if not can_pack_f16(self.out_features, self.in_features):  # stays on fbgemm
            return
        if kernels is None:
            self.nbytes -= self.half_weight.numel() * 2
            self.kernels = self.half_weight = None
            return
        weight, _ = torch.ops.quantized.linear_unpack_fp16(self.packed)
        self.half_weight = pack_f16(weight)
        self.nbytes += self.half_weight.numel() * 2
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the engine's tokens are already flat
        if self.kernels is not None and flat.shape[0] <= FEW_ROWS:
            out = self.kernels.linear_f16(flat, self.half_weight, self.bias)
        elif self.mode == "fp16":
            out = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)
        else:
            # reduce_range: 7-bit activations, so AVX2's 16-bit pairwise sums cannot saturate.
            out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


@torch.no_grad()
def quantize_linears(module: nn.Module, mode: str, shared: frozenset[int] = frozenset()) -> nn.Module:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear`` (in place; returns ``module``).
    Weights whose ``id`` is in ``shared`` are kept on the packed module (see ``PackedLinear``)."""
    if mode == "none":
        return module
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, mode, keep_weight=id(child.weight) in shared))
        else:
            quantize_linears(child, mode, shared)
    return module


def projection(weight: torch.Tensor, mode: str) -> nn.Module:
    """``x @ weight.T`` as a module, packed for ``mode`` (``none``: a plain linear layer sharing ``weight``)."""
    with torch.device(weight.device):
        linear = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear if mode == "none" else PackedLinear(linear, mode)


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Pack a ``LlamaForCausalLM``'s projections and output head. The embedding table stays float32, and so does the
    output head's weight beside its packed copy: drafters slice rows of it (with tied embeddings it is the table)."""
    return quantize_linears(model, mode, shared=frozenset({id(model.lm_head.weight)}))


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, packed ones included (a tied tensor counted once)."""
    total = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    return total + sum(module.nbytes for module in model.modules() if isinstance(module, PackedLinear))
