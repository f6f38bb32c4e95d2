"""infer's bf16 tile GEMM (``CpuKernels.linear_tiles``: AMX's tiles or AVX512-BF16's dot products) against
oneDNN's prepacked bf16 GEMM on the default model's projection shapes, hot weights, ms per call (best of three runs
of ``--repeats`` calls): float32 rows in and out (how the fused stack and the output head call it) and bf16 in and
out (large steps' rows between the GEMMs). ``TILE_MAX_ROWS`` in ``infer.model.quantization`` follows from where
oneDNN wins.

    OMP_NUM_THREADS=2 python benchmarks/tile_gemm.py
    python benchmarks/tile_gemm.py --rows 17 64 --repeats 50
    python benchmarks/tile_gemm.py --shapes qwen3-0.6b --rows 512 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import torch

from infer.kernels import cpu as cpu_kernels
from infer.model.quantization import bf16_gemm_available, bf16_gemm_weight, bf16_linear

# The projections' (out_features, in_features): the default model (SmolLM2-135M) and Qwen3-0.6B.
MODEL_SHAPES = {
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}


def best_ms(call, repeats: int) -> float:
    call()
    runs = []
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(repeats):
            call()
        runs.append((time.perf_counter() - began) / repeats * 1e3)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[17, 64, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", choices=list(MODEL_SHAPES), default="smollm2-135m")
    args = parser.parse_args()
    shapes = MODEL_SHAPES[args.shapes]
    kernels = cpu_kernels.load(True)
    if not kernels.tiles or not bf16_gemm_available():
        raise SystemExit("needs AMX or AVX512-BF16 and oneDNN's bf16 GEMM: this CPU or build has neither")
    print(f"infer's kernel: {kernels.tiles}")
    print("| rows | io | " + " | ".join(f"{name} tiles / oneDNN" for name in shapes) + " |")
    print("|---" * (len(shapes) + 2) + "|")
    for rows in args.rows:
        for dtype in (torch.float32, torch.bfloat16):
            cells = []
            for n, k in shapes.values():
                weight = torch.randn(n, k).to(torch.bfloat16)
                tiles, packed = cpu_kernels.pack_tiles(weight), bf16_gemm_weight(weight.float())
                x = torch.randn(rows, k).to(dtype)
                tiled = best_ms(lambda: kernels.linear_tiles(x, tiles, None), args.repeats)
                onednn = best_ms(lambda: bf16_linear(x, packed), args.repeats)
                cells.append(f"{tiled:.3f} / {onednn:.3f}")
            print(f"| {rows} | {str(dtype).removeprefix('torch.')} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
