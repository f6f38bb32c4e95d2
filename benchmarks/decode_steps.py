"""Decode step time at several batch sizes on one config: the before/after measurement of a change to how a step
runs (README, "CPU performance"). Uses only the public engine API, so the same script times two checkouts.

Each batch size: requests with distinct prompts, every prefill finished, 3 warm-up decode steps, then the median of
``--repeats`` runs of ``--steps`` decode steps each (ms per step). Prints one markdown row per batch size.

    OMP_NUM_THREADS=2 python benchmarks/decode_steps.py
    python benchmarks/decode_steps.py --batches 1 4 --steps 30 model.quantization=int8   # any config override
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer import LLM, SamplingParams


def decode_ms(llm: LLM, batch: int, steps: int, repeats: int) -> list[float]:
    """Milliseconds per decode step at ``batch``, one value per repeat."""
    engine = llm.engine
    params = SamplingParams(max_tokens=3 + steps * repeats + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([{"role": "user", "content": f"Tell me a long story about lighthouse number {i}."}],
                           params)
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - began) / steps * 1e3)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    for request_id in list(engine.requests):
        engine.release_request(request_id)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="", help="a name for this run's rows (e.g. before / after)")
    args = parser.parse_args()
    llm = LLM(args.config, dotlist=args.overrides)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    engine = llm.engine
    print(f"{engine.model_name}, dtype {str(engine.dtype).removeprefix('torch.')}, quantization "
          f"{engine.quantization}, attention {type(engine.attention).__name__}, threads {torch.get_num_threads()}")
    for batch in args.batches:
        times = decode_ms(llm, batch, args.steps, args.repeats)
        spread = ", ".join(f"{value:.1f}" for value in times)
        print(f"| {args.label} | decode batch {batch} | {statistics.median(times):.1f} | {spread} |", flush=True)


if __name__ == "__main__":
    main()
