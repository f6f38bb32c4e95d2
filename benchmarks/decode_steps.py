"""Decode step time at several batch sizes on one config, and one prefill step: the before/after measurement of a
change to how a step runs (docs/performance.md). Uses only the public engine API, so the same script times
two checkouts.

Each batch size: requests with distinct prompts, every prefill finished, 3 warm-up decode steps, then the median of
``--repeats`` runs of ``--steps`` decode steps each (ms per step), and the best single step of them all (a figure
that other processes on a shared machine can only make worse). Then ``--prefill`` prompts of 512 random tokens
prefilled in one step (median of ``--repeats``). Prints one markdown row per case.

    OMP_NUM_THREADS=2 python benchmarks/decode_steps.py
    python benchmarks/decode_steps.py --batches 1 4 --steps 30 model.quantization=int8   # any config override
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from drain import drain  # beside this script: abort and release every request of an engine

from infer import LLM, SamplingParams


def decode_ms(llm: LLM, batch: int, steps: int, repeats: int) -> tuple[list[float], float]:
    """Milliseconds per decode step at ``batch``, one value per repeat, and the fastest single step's."""
    engine = llm.engine
    params = SamplingParams(max_tokens=3 + steps * repeats + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([{"role": "user", "content": f"Tell me a long story about lighthouse number {i}."}], params)
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    times, best = [], float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(steps):
            step_began = time.perf_counter()
            engine.step()
            best = min(best, time.perf_counter() - step_began)
        times.append((time.perf_counter() - began) / steps * 1e3)
    drain(engine)
    return times, best * 1e3


def python_calls_per_step(llm: LLM, steps: int) -> tuple[float, str]:
    """Function calls per decode step at batch 1 under cProfile, and the function taking most time itself."""
    import cProfile
    import pstats

    engine = llm.engine
    engine.add_request(
        [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True),
    )
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
        engine.step()
    engine.step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    drain(engine)
    stats = pstats.Stats(profile)
    (name, _, function), (_, _, tottime, _, _) = max(stats.stats.items(), key=lambda item: item[1][2])
    where = f"{function} ({name.rsplit('/', 1)[-1]})"
    return stats.total_calls / steps, f"most time: {where} {tottime / steps * 1e3:.1f} ms"


def prefill_ms(llm: LLM, batch: int, length: int, repeats: int) -> list[float]:
    """Milliseconds of one step prefilling ``batch`` prompts of ``length`` random tokens, one value per repeat."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(repeats):
        for _ in range(batch):
            engine.add_request(
                torch.randint(1000, 20000, (length,), generator=generator).tolist(),
                SamplingParams(max_tokens=1, temperature=0.0),
            )
        began = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - began) * 1e3)
        drain(engine)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=4, help="prompts of 512 tokens in the prefill step (0: none)")
    parser.add_argument("--label", default="", help="a name for this run's rows (e.g. before / after)")
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also count Python function calls per decode step at batch 1 (cProfile, 100 steps): "
        "a figure the machine's noise does not move",
    )
    args = parser.parse_args()
    llm = LLM(args.config, dotlist=args.overrides)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    engine = llm.engine
    print(
        f"{engine.model_name}, dtype {str(engine.dtype).removeprefix('torch.')}, quantization "
        f"{engine.quantization}, attention {type(engine.attention).__name__}, threads {torch.get_num_threads()}"
    )
    for batch in args.batches:
        times, best = decode_ms(llm, batch, args.steps, args.repeats)
        spread = ", ".join(f"{value:.1f}" for value in times)
        print(
            f"| {args.label} | decode batch {batch} | {statistics.median(times):.1f} | {spread} | best {best:.1f} |",
            flush=True,
        )
    if args.calls:
        calls, tottime = python_calls_per_step(llm, 100)
        print(f"| {args.label} | python calls per step, batch 1 | {calls:.0f} | {tottime} |", flush=True)
    if args.prefill:
        times = prefill_ms(llm, args.prefill, 512, args.repeats)
        spread = ", ".join(f"{value:.0f}" for value in times)
        median = statistics.median(times)
        print(f"| {args.label} | prefill {args.prefill} x 512 | {median:.0f} | {spread} |", flush=True)


if __name__ == "__main__":
    main()
