"""infer's CPU kernels against fbgemm, side by side in one process (behind ``execution.fused_max_tokens``):

1. ``gemv``: the 30 layers' projections of SmolLM2-135M (fresh random weights, so every call streams from memory,
   as in a real step) at 1-8 rows: fbgemm's fp16 GEMM, the kernels' GEMV over packed fp16 weights and over int8
   ones (``model.quantization: int8``); ms per step.
2. ``steps``: decode steps of the default model at batch 1-12, one engine per execution path, chosen by config: all
   layers in one C call (``fused-stack``, the default for steps of up to 8 tokens), layer by layer as two C calls
   around the backend's attention (``fused-layers``, what a backend without ``fused_cpu_attention`` gets), and op by
   op with fbgemm's GEMM (``execution.fused_max_tokens=0``; the small-op kernels and the cpu backend in all three);
   ms per step.
3. ``simd``: the same projections at 1-32 rows through each build of the kernels this CPU runs (``-march=native``,
   then without AVX-512, then the portable C), over fp16, bf16 and int8 weights, beside oneDNN's bf16 GEMM (what
   ``model.quantization: bf16`` runs for larger steps; AMX or AVX512-BF16 where the CPU has them), and paged
   attention of a decode step (batch 1 and 16, 1,024-token contexts); ms per step.
4. ``prefetch``: the GEMV's L2 prefetch (``INFER_GEMV_L2_AHEAD`` in the C source, 6 KB ahead) against a build
   without it (its L1 prefetch only, 1 KB ahead): the 30 layers' projections and the output head over bf16
   and fp16 weights at 1-8 rows; ms per step and GB/s of weights streamed.

Each case alternates its arms ``--repeats`` times and prints every run.

    python benchmarks/cpu_kernels.py
    python benchmarks/cpu_kernels.py --only gemv
    python benchmarks/cpu_kernels.py --only simd
    python benchmarks/cpu_kernels.py --only prefetch
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from drain import drain  # beside this script: abort and release every request of an engine

from infer import LLM, SamplingParams
from infer.host import cpu_flags
from infer.kernels import cpu as cpu_kernels
from infer.model.quantization import bf16_gemm_available, bf16_gemm_weight, bf16_linear, int8_weights

# (out_features, in_features) of one SmolLM2-135M layer's projections: QKV, output, gate/up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def timed(fn, calls: int) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e3


def gemv_case(repeats: int) -> None:
    kernels = cpu_kernels.load(True)
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(30):
        for out_features, in_features in LAYER_SHAPES:
            weight = torch.randn(out_features, in_features, generator=generator) * 0.05
            quantized, scales = int8_weights(weight)
            layers.append(
                (
                    torch.ops.quantized.linear_prepack_fp16(weight, None),
                    cpu_kernels.pack_weights(weight.half()),
                    cpu_kernels.pack_weights(quantized),
                    cpu_kernels.pack_scales(scales),
                )
            )
    print("| rows | fbgemm fp16 ms | kernel GEMV fp16 ms | kernel GEMV int8 ms |\n|---|---|---|---|")
    for rows in (1, 2, 3, 4, 5, 8):
        inputs = {width: torch.randn(rows, width, generator=generator) for width in (576, 1536)}

        def fbgemm():
            for packed, half, _, _ in layers:
                torch.ops.quantized.linear_dynamic_fp16(inputs[cpu_kernels.packed_shape(half)[1]], packed)

        def kernel_fp16():
            for _, half, _, _ in layers:
                kernels.linear(inputs[cpu_kernels.packed_shape(half)[1]], half, None, None)

        def kernel_int8():
            for _, _, quantized, scales in layers:
                kernels.linear(inputs[cpu_kernels.packed_shape(quantized)[1]], quantized, scales, None)

        runs = {"fbgemm": [], "fp16": [], "int8": []}
        for _ in range(repeats):
            runs["fbgemm"].append(timed(fbgemm, 10))
            runs["fp16"].append(timed(kernel_fp16, 10))
            runs["int8"].append(timed(kernel_int8, 10))
        print(
            f"| {rows} | " + " | ".join(" / ".join(f"{value:.1f}" for value in runs[arm]) for arm in runs) + " |",
            flush=True,
        )


# Each arm's execution config; the fused arms' token limit is raised to the batch so that they run it.
STEP_ARMS = {
    "stack": lambda batch: [f"execution.fused_max_tokens={max(8, batch)}"],
    "layers": lambda batch: ["execution.paths=[fused-layers,torch]", f"execution.fused_max_tokens={max(8, batch)}"],
    "fbgemm": lambda batch: ["execution.fused_max_tokens=0"],
}


def steps_case(repeats: int) -> None:
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    print("| batch | one call (default) ms | layer by layer ms | op by op, fbgemm ms |\n|---|---|---|---|")
    for batch in (1, 2, 4, 8, 12):
        engines = {
            arm: LLM("baseline", dotlist=["cache.memory_budget=256MiB", *overrides(batch)]).engine
            for arm, overrides in STEP_ARMS.items()
        }
        for engine in engines.values():
            for index in range(batch):
                engine.add_request(
                    [{"role": "user", "content": f"Tell me a long story about lighthouse {index}."}], params
                )
            while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
                engine.step()  # prefill
        runs = {arm: [] for arm in engines}
        for _ in range(repeats):
            for arm, engine in engines.items():
                runs[arm].append(timed(engine.step, 10))
        print(
            f"| {batch} | " + " | ".join(" / ".join(f"{value:.1f}" for value in runs[arm]) for arm in runs) + " |",
            flush=True,
        )
        for engine in engines.values():
            drain(engine)
        del engines


def simd_builds() -> dict[str, cpu_kernels.CpuKernels]:
    """Each build of the kernels this CPU can run, by the instruction set it uses."""
    builds = {}
    folder = Path(tempfile.mkdtemp(prefix="infer-simd-"))
    for flags in ([], ["-mno-avx512f"], ["-mno-avx"]):
        built = cpu_kernels.load_built(cpu_kernels.build(folder, flags))
        builds.setdefault(built.simd, built)
    return builds


def simd_case(repeats: int) -> None:
    builds = simd_builds()
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(out_features, in_features, generator=generator) * 0.05
        for _ in range(30)
        for out_features, in_features in LAYER_SHAPES
    ]
    kinds = {
        "fp16": [(cpu_kernels.pack_weights(weight.half()), None) for weight in weights],
        "bf16": [(cpu_kernels.pack_weights(weight.bfloat16()), None) for weight in weights],
        "int8": [
            (cpu_kernels.pack_weights(quantized), cpu_kernels.pack_scales(scales))
            for quantized, scales in map(int8_weights, weights)
        ],
    }
    onednn = [bf16_gemm_weight(weight) for weight in weights]
    gemm = "oneDNN bf16 GEMM" + ("" if bf16_gemm_available() else " (bf16 emulated: no avx512_bf16/amx_bf16)")
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"builds: {', '.join(builds)}; CPU flags: {', '.join(flags)}")
    arms = [f"{kind} {simd}" for kind in kinds for simd in builds if simd != "portable"] + [gemm]
    print("| rows | " + " | ".join(f"{arm} ms" for arm in arms) + " |\n|---|" + "---|" * len(arms))
    for rows in (1, 2, 4, 8, 16, 32):
        inputs = {width: torch.randn(rows, width, generator=generator) for width in (576, 1536)}

        def gemv(kernels, packed):
            return lambda: [
                kernels.linear(inputs[cpu_kernels.packed_shape(weight)[1]], weight, scales, None)
                for weight, scales in packed
            ]

        functions = [gemv(builds[arm.split()[1]], kinds[arm.split()[0]]) for arm in arms[:-1]]
        functions.append(
            lambda: [bf16_linear(inputs[weight.shape[1]], packed) for weight, packed in zip(weights, onednn)]
        )
        runs = [[] for _ in arms]
        for _ in range(repeats):
            for run, function in zip(runs, functions):
                run.append(timed(function, 5))
        print(
            f"| {rows} | " + " | ".join(" / ".join(f"{value:.1f}" for value in run) for run in runs) + " |", flush=True
        )
    print(
        "\n| decode attention, 30 layers | "
        + " | ".join(f"{simd} ms" for simd in builds)
        + " |\n|---|"
        + "---|" * len(builds)
    )
    heads, kv_heads, head_dim, block_size, context = 9, 3, 64, 16, 1024
    for batch in (1, 16):
        blocks = batch * context // block_size
        pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=generator)
        tables = torch.randperm(blocks, generator=generator).view(batch, -1).to(torch.int32)
        plan = cpu_kernels.KernelAttentionPlan(None, torch.arange(batch), torch.full((batch,), context), batch, context)
        q, out = torch.randn(batch, heads, head_dim, generator=generator), torch.empty(batch, heads, head_dim)
        runs = {simd: [] for simd in builds}
        for _ in range(repeats):
            for simd, kernels in builds.items():
                runs[simd].append(
                    timed(lambda: [kernels.paged_attention(q, pool, tables, plan, 0.125, out) for _ in range(30)], 5)
                )
        print(
            f"| batch {batch} x {context} | "
            + " | ".join(" / ".join(f"{value:.1f}" for value in runs[simd]) for simd in builds)
            + " |",
            flush=True,
        )


def prefetch_case(repeats: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="infer-prefetch-"))
    builds = {
        "L1 + L2 prefetch": cpu_kernels.load_built(cpu_kernels.build(folder)),
        "L1 prefetch only": cpu_kernels.load_built(cpu_kernels.build(folder, ["-DINFER_GEMV_L2_AHEAD=0"])),
    }
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(30) for shape in LAYER_SHAPES] + [(49152, 576)]  # + the output head
    weights = [
        torch.randn(out_features, in_features, generator=generator) * 0.05 for out_features, in_features in shapes
    ]
    kinds = {
        kind: [cpu_kernels.pack_weights(weight.to(dtype)) for weight in weights]
        for kind, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    streamed = sum(out_features * in_features * 2 for out_features, in_features in shapes)
    arms = [(kind, build) for kind in kinds for build in builds]
    print(f"builds: {next(iter(builds.values())).simd}; {streamed / 1e6:.0f} MB of weights a step")
    print(
        "| rows | " + " | ".join(f"{kind} {build} ms (GB/s)" for kind, build in arms) + " |\n|---|" + "---|" * len(arms)
    )
    for rows in (1, 2, 4, 8):
        inputs = {width: torch.randn(rows, width, generator=generator) for width in (576, 1536)}
        runs = [[] for _ in arms]
        for _ in range(repeats):
            for run, (kind, build) in zip(runs, arms):
                kernels = builds[build]
                run.append(
                    timed(
                        lambda: [
                            kernels.linear(inputs[cpu_kernels.packed_shape(weight)[1]], weight, None, None)
                            for weight in kinds[kind]
                        ],
                        5,
                    )
                )
        print(
            f"| {rows} | "
            + " | ".join(" / ".join(f"{value:.1f} ({streamed / value / 1e6:.1f})" for value in run) for run in runs)
            + " |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["gemv", "steps", "simd", "prefetch"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.only in (None, "gemv"):
        gemv_case(args.repeats)
    if args.only in (None, "steps"):
        steps_case(args.repeats)
    if args.only in (None, "simd"):
        simd_case(args.repeats)
    if args.only in (None, "prefetch"):
        prefetch_case(args.repeats)


if __name__ == "__main__":
    main()
