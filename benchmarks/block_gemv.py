"""The CPU kernels' GEMV over each weight format against the machine's memory bandwidth, in one run.

Weights: the default model's 30 layers of projections (QKV 960 x 576, output 576 x 576, gate/up 3072 x 576, down
576 x 1536; random values, ~106M weights), or ``--shape N K`` matrices (``--copies`` of them, so that a pass reads
more than the caches hold), in fp16, int8 (a scale per 32), GGUF's blocks q4_0, q4_1, q8_0 and its K-quant
super-blocks q4_k, q6_k (where K is a multiple of 256; infer.testing.kquants quantizes them). For each format and
row count, the sum over the matrices of each one's best call in a few passes over all of them (formats alternated,
repeats interleaved, so a busy machine disturbs them alike; a call is short enough to run between other jobs'
time slices, where a whole pass is not): milliseconds, weight bytes, and bytes / time. The bandwidth line is a
streaming read of 1 GiB (torch's sum over float32 with the same threads): the floor a decode step's weight reads can
approach.

    OMP_NUM_THREADS=2 python benchmarks/block_gemv.py
    python benchmarks/block_gemv.py --rows 1 8 64 --repeats 5
    python benchmarks/block_gemv.py --shape 1024 3072 --copies 28 --rows 1 16   # Qwen3-0.6B's down projections
    python benchmarks/block_gemv.py --shape 151936 1024 --copies 1 --rows 1 16  # its output head
"""

from __future__ import annotations

import argparse
import time

import torch

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.blocks import pack_blocks, quantize_blocks
from infer.model.quantization import int8_weights
from infer.testing.kquants import QUANTIZERS

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
FORMATS = ("fp16", "int8", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", nargs=2, type=int, metavar=("N", "K"), help="a matrix shape for the model's")
    parser.add_argument("--copies", type=int, default=LAYERS, help="matrices of --shape a pass reads")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    return parser.parse_args()


def packed_layers(kernels, name: str, shapes: list[tuple[int, int]]) -> list[tuple[object, torch.Tensor | None, int]]:
    """Every matrix of ``shapes`` in ``name``'s format: (weight, int8 scales or None, bytes)."""
    generator = torch.Generator().manual_seed(0)
    matrices = []
    for shape in shapes:
        weight = torch.randn(*shape, generator=generator) * 0.05
        if name == "fp16":
            matrices.append((cpu_kernels.pack_weights(weight.half()), None, weight.numel() * 2))
        elif name == "int8":
            quantized, scales = int8_weights(weight)
            packed = (cpu_kernels.pack_weights(quantized), cpu_kernels.pack_scales(scales))
            matrices.append((*packed, quantized.numel() + scales.numel() * 4))
        else:
            raw = QUANTIZERS[name](weight.numpy()) if name in QUANTIZERS else None
            blocks = quantize_blocks(weight, name) if raw is None else pack_blocks(raw, name, shape[0])
            matrices.append((blocks, None, blocks.nbytes))
    return matrices


def width(weight) -> int:
    """The in_features of a packed weight: kept as blocks, or in pack_weights' layout (8 columns a group)."""
    return weight.shape[1] * 8 if isinstance(weight, torch.Tensor) else weight.in_features


def call_seconds(kernels, matrices, rows: int) -> list[float]:
    """Each matrix's best call with ``rows`` rows of x over three passes over all of them (a pass reads every matrix
    in turn, so none is still in the caches from its last call)."""
    inputs = {k: torch.randn(rows, k) for k in {width(weight) for weight, _, _ in matrices}}
    best = [float("inf")] * len(matrices)
    for _ in range(3):
        for index, (weight, scales, _) in enumerate(matrices):
            x = inputs[width(weight)]
            began = time.perf_counter()
            if isinstance(weight, torch.Tensor):
                kernels.linear(x, weight, scales, None)
            else:
                kernels.linear_blocks(x, weight, None)
            best[index] = min(best[index], time.perf_counter() - began)
    return best


def read_bandwidth() -> float:
    """Bytes a second of a streaming read of 1 GiB (float32 sum), the best of five."""
    data = torch.ones(2**28)
    data.sum()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.numel() * 4 / best


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the table's heading."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    args = parse_arguments()
    kernels = cpu_kernels.load(True)
    shapes = [tuple(args.shape)] * args.copies if args.shape else SHAPES * LAYERS
    names = [name for name in args.formats if name not in QUANTIZERS or all(k % 256 == 0 for _, k in shapes)]
    formats = {name: packed_layers(kernels, name, shapes) for name in names}
    bandwidth = [read_bandwidth()]
    print(f"{cpu_name()}; kernels {kernels.simd}; threads {torch.get_num_threads()}")
    if len(names) < len(args.formats):
        print(f"(no {', '.join(sorted(set(args.formats) - set(names)))}: a K not a multiple of 256)")
    print("| rows | weights | MB | ms | GB/s |\n|---|---|---|---|---|")
    for rows in args.rows:
        calls = {name: [float("inf")] * len(matrices) for name, matrices in formats.items()}
        for _ in range(args.repeats):
            for name, matrices in formats.items():
                calls[name] = list(map(min, calls[name], call_seconds(kernels, matrices, rows)))
            bandwidth.append(read_bandwidth())
        seconds = {name: sum(best) for name, best in calls.items()}
        for name, matrices in formats.items():
            total = sum(size for _, _, size in matrices)
            print(
                f"| {rows} | {name} | {total / 1e6:.1f} | {seconds[name] * 1e3:.2f} | "
                f"{total / seconds[name] / 1e9:.1f} |"
            )
    print(
        f"\nstreaming read (1 GiB float32 sum): {max(bandwidth) / 1e9:.1f} GB/s at best, "
        f"{min(bandwidth) / 1e9:.1f} at worst of {len(bandwidth)}"
    )


if __name__ == "__main__":
    main()
