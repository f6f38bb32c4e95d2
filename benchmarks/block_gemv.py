"""The CPU kernels' GEMV over each weight format against the machine's memory bandwidth, in one run.

Weights: the default model's 30 layers of projections (QKV 960 x 576, output 576 x 576, gate/up 3072 x 576, down
576 x 1536; random values, ~106M weights) in fp16, int8 (a scale per 32) and GGUF's blocks q4_0, q4_1, q8_0. For
each format and row count, the best of a few passes over all 120 matrices (formats alternated, repeats
interleaved, so a busy machine disturbs them alike): milliseconds, weight bytes, and bytes / time. The bandwidth
line is a streaming read of 1 GiB (torch's sum over float32 with the same threads): the floor a decode step's
weight reads can approach.

    OMP_NUM_THREADS=2 python benchmarks/block_gemv.py
    python benchmarks/block_gemv.py --rows 1 8 64 --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.blocks import quantize_blocks
from infer.model.quantization import int8_weights

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
FORMATS = ("fp16", "int8", "q4_0", "q4_1", "q8_0")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def packed_layers(kernels, name: str) -> list[tuple[object, torch.Tensor | None, int]]:
    """Every matrix of the 30 layers in ``name``'s format: (weight, int8 scales or None, bytes)."""
    generator = torch.Generator().manual_seed(0)
    matrices = []
    for _ in range(LAYERS):
        for shape in SHAPES:
            weight = torch.randn(*shape, generator=generator) * 0.05
            if name == "fp16":
                matrices.append((cpu_kernels.pack_weights(weight.half()), None, weight.numel() * 2))
            elif name == "int8":
                quantized, scales = int8_weights(weight)
                matrices.append(
                    (
                        cpu_kernels.pack_weights(quantized),
                        cpu_kernels.pack_scales(scales),
                        quantized.numel() + scales.numel() * 4,
                    )
                )
            else:
                blocks = quantize_blocks(weight, name)
                matrices.append((blocks, None, blocks.nbytes))
    return matrices


def pass_seconds(kernels, matrices, rows: int) -> float:
    """One pass over every matrix with ``rows`` rows of x: the best of three."""
    inputs = {k: torch.randn(rows, k) for k in {shape[1] for shape in SHAPES}}

    def once() -> None:
        for weight, scales, _ in matrices:
            if scales is None and not isinstance(weight, torch.Tensor):
                kernels.linear_blocks(inputs[weight.in_features], weight, None)
            else:
                kernels.linear(inputs[weight.shape[1] * 8], weight, scales, None)

    once()
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - began)
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
    formats = {name: packed_layers(kernels, name) for name in FORMATS}
    bandwidth = [read_bandwidth()]
    print(f"{cpu_name()}; kernels {kernels.simd}; threads {torch.get_num_threads()}")
    print("| rows | weights | MB | ms | GB/s |\n|---|---|---|---|---|")
    for rows in args.rows:
        seconds = {name: float("inf") for name in FORMATS}
        for _ in range(args.repeats):
            for name, matrices in formats.items():
                seconds[name] = min(seconds[name], pass_seconds(kernels, matrices, rows))
            bandwidth.append(read_bandwidth())
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
