"""One ``infer bench`` workload on one config, timed by the CPU seconds this process spends replaying it as well as by
the wall clock: with ``OMP_NUM_THREADS=1`` the CPU seconds are the engine's work, which other jobs on a shared machine
barely change, where they stretch the wall time many times over. For comparing configs on a busy machine; quiet-machine
throughput stays ``infer bench``'s figure.

The engine is built and warmed up (one short request) before the clock starts, so startup (loading, packing, a
kernels build, calibration) is not counted; fix ``execution.fused_max_tokens`` and ``execution.large_gemm`` in the
overrides so that no calibration measured under load decides the paths. Prints one markdown row: output and prompt
tokens, CPU seconds, output tokens per CPU-second, prompt tokens per CPU-second, wall seconds, the load average.

    OMP_NUM_THREADS=1 python benchmarks/workload_cpu_time.py --workload chat execution.fused_max_tokens=128 \\
        execution.large_gemm=bf16 model.quantization=gguf
    OMP_NUM_THREADS=1 python benchmarks/workload_cpu_time.py --workload prefill --label default
"""

from __future__ import annotations

import argparse
import os
import time

from infer import LLM, SamplingParams
from infer.bench.runner import run_workload
from infer.bench.workloads import build_workload


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--workload", default="chat", help="an infer bench workload: chat, prefill, single-stream, ...")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--prompt-kind", help="single-stream: copy, open or mixed")
    parser.add_argument("--label", default="", help="a name for this run's row")
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    llm = LLM(args.config, dotlist=args.overrides)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    engine = llm.engine
    options = {"num_requests": args.num_requests, "prompt_kind": args.prompt_kind}
    workload = build_workload(args.workload, engine.tokenizer, **{k: v for k, v in options.items() if v is not None})
    cpu_began = time.process_time()
    summary = run_workload(engine, workload).summary
    cpu_s = time.process_time() - cpu_began
    print(
        f"| {args.label or engine.quantization} | {args.workload} | {summary['output_tokens']} | "
        f"{summary['prompt_tokens']} | {cpu_s:.1f} | {summary['output_tokens'] / cpu_s:.1f} | "
        f"{summary['prefill_tokens_computed'] / cpu_s:.1f} | {summary['wall_time_s']:.1f} | "
        f"{os.getloadavg()[0]:.1f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
