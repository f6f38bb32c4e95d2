"""The head screen's GEMV over its int8 copy of an output head (``infer.model.head_screen.HeadScreen``): float32 rows
of x with a float32 FMA per weight (``CpuKernels.linear``) against x rounded to int16 on AVX512-VNNI's integer dot
products (``CpuKernels.screen_gemv``), on the heads of Qwen3-0.6B (151,936 x 1,024), Qwen3-1.7B (151,936 x 2,048) and
Gemma 3 1B (262,144 x 1,152), random bf16 weights quantized as the screen does. Milliseconds a call, best of
``--runs`` alternated calls, and GB/s of int8 weights (each call reads the whole copy: 156-302 MB).

    OMP_NUM_THREADS=2 python benchmarks/head_screen.py
    OMP_NUM_THREADS=2 python benchmarks/head_screen.py --heads qwen3-1.7b --rows 1 --runs 15
"""

from __future__ import annotations

import argparse
import time

import torch

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.packing import pack_scales

HEADS = {"qwen3-0.6b": (151936, 1024), "qwen3-1.7b": (151936, 2048), "gemma3-1b": (262144, 1152)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if not kernels.screen_vnni:
        raise SystemExit(f"this CPU's build has no AVX512-VNNI ({kernels.simd}): the screen multiplies x as it is")
    print(f"{kernels.simd} build, {torch.get_num_threads()} thread(s)")
    print("| head | rows | float32 x, ms (GB/s) | int16 x on VNNI, ms (GB/s) | ratio |")
    print("|---|---|---|---|---|")
    for name in args.heads:
        n, k = HEADS[name]
        weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
        quantized, scales, _, _ = kernels.screen_quantize(weight, 0.0)
        del weight
        packed_scales = pack_scales(scales[:, None].contiguous())
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = {
                "float": lambda: kernels.linear(x, quantized, packed_scales, None),
                "vnni": lambda: kernels.screen_gemv(x, quantized, packed_scales),
            }
            best = {key: float("inf") for key in calls}
            for _ in range(args.runs):  # alternated, so a busy spell falls on both alike
                for key, call in calls.items():
                    began = time.perf_counter()
                    call()
                    best[key] = min(best[key], time.perf_counter() - began)
            cells = [f"{best[key] * 1e3:.2f} ({n * k / best[key] / 1e9:.1f})" for key in calls]
            print(f"| {name} {n}x{k} | {rows} | " + " | ".join(cells) + f" | {best['float'] / best['vnni']:.2f}x |")


if __name__ == "__main__":
    main()
