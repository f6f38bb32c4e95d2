"""Large steps over bf16 weights with and without bf16 rows between the GEMMs (``Executor.bf16_gemm_inputs``, on by
default with ``model.quantization: bf16``): decode steps at batch 64 of one engine, the switch flipped between
alternating runs of 10 steps, ms per step (docs/performance.md). Needs a CPU where ``auto`` picks
bf16 weights, or ``model.quantization=bf16``.

    python benchmarks/bf16_gemm_inputs.py
    python benchmarks/bf16_gemm_inputs.py model.quantization=bf16 --pairs 4
"""

from __future__ import annotations

import argparse
import time

from infer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    engine = LLM("baseline", dotlist=["cache.memory_budget=1GiB", *args.overrides]).engine
    if engine.quantization != "bf16":
        raise SystemExit(f"the weights are {engine.quantization}, not bf16: pass model.quantization=bf16")
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for index in range(args.batch):
        engine.add_request([{"role": "user", "content": f"Tell me a long story about lighthouse {index}."}], params)
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
        engine.step()  # prefill
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.pairs):
        for narrow in (True, False):
            engine.executor.bf16_gemm_inputs = narrow
            began = time.perf_counter()
            for _ in range(10):
                engine.step()
            runs[narrow].append((time.perf_counter() - began) / 10 * 1e3)
    for narrow, label in ((True, "bf16 rows between the GEMMs"), (False, "float32 rows, cast at each GEMM")):
        print(f"{label}: " + " / ".join(f"{value:.1f}" for value in runs[narrow]) + " ms per step")


if __name__ == "__main__":
    main()
