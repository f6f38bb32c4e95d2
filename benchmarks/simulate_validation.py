"""``infer simulate``'s validation: the shipped workloads and the prefix ablation's grid, each run for real and
simulated on the measured cost model, side by side: output tok/s and TTFT p50 (with their ratio), prefix hit rate,
preemptions, steps. Then the simulator's own speed on the 70B/8xH100 roofline as the batch and the queue grow.

Fit the cost model first (``infer simulate CONFIG --fit``, about 160 s on 2 cores); its fit workloads use other seeds
and sizes than these, so the comparison is out of sample. Real runs alternate with their simulations in one process.

    infer simulate baseline --fit
    python benchmarks/simulate_validation.py --json validation.json
    python benchmarks/simulate_validation.py --only speed
"""

from __future__ import annotations

import argparse
import json
import time

from infer.bench.runner import run_workload, simulate_workload
from infer.bench.workloads import build_workload
from infer.config import load_config
from infer.engine.engine import Engine
from infer.simulate.engine import SimulatedEngine

PREFIX_WORKLOAD = {
    "name": "shared-prefix",
    "groups": 4,
    "questions": 16,
    "system_len": 600,
    "question_len": 30,
    "output_len": 32,
}  # configs/ablations/prefix.yaml
CASES = [
    ("chat", {"name": "chat"}, []),
    ("shared-prefix", {"name": "shared-prefix"}, []),
    ("long-prompt", {"name": "long-prompt"}, []),
    *[
        (
            f"prefix ablation: {cache} / {scheduler}",
            PREFIX_WORKLOAD,
            [f"prefix_cache.name={cache}", f"scheduler.name={scheduler}"],
        )
        for cache in ("none", "hash", "radix")
        for scheduler in ("fcfs", "lpm")
    ],
]
ROOFLINE_70B = [
    "simulate.cost=roofline",
    "simulate.geometry=llama-3-70b",
    "simulate.tensor_parallel_size=8",
    "model.max_model_len=4096",
    "scheduler.max_num_batched_tokens=8192",
    "prefix_cache.name=radix",
]


def run_case(base: str, overrides: list[str], workload: dict) -> tuple[dict, dict]:
    config = load_config(base, overrides)
    options = dict(workload)
    name = options.pop("name")
    real_engine = Engine(config)
    real = run_workload(real_engine, build_workload(name, real_engine.tokenizer, **options)).summary
    real["steps"] = real_engine.stats.num_steps
    del real_engine
    sim_engine = SimulatedEngine(config)
    sim = simulate_workload(sim_engine, build_workload(name, sim_engine.tokenizer, **options))
    sim["steps"] = sim_engine.stats.num_steps
    return real, sim


def ratio(sim: float | None, real: float | None) -> str:
    return f"{sim / real:.3f}" if sim is not None and real else "-"


def validation(base: str, overrides: list[str]) -> list[dict]:
    print(
        "| case | output tok/s real / sim (ratio) | TTFT p50 s real / sim (ratio) | prefix hit real / sim | "
        "preemptions real / sim | steps real / sim |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for label, workload, case_overrides in CASES:
        real, sim = run_case(base, [*overrides, *case_overrides], workload)
        print(
            f"| {label} | {real['output_tok_per_s']:.1f} / {sim['output_tok_per_s']:.1f} "
            f"({ratio(sim['output_tok_per_s'], real['output_tok_per_s'])}) | {real['ttft_p50_s']:.3f} / "
            f"{sim['ttft_p50_s']:.3f} ({ratio(sim['ttft_p50_s'], real['ttft_p50_s'])}) | "
            f"{real['prefix_hit_rate']:.1%} / {sim['prefix_hit_rate']:.1%} | {real['preemptions']} / "
            f"{sim['preemptions']} | {real['steps']} / {sim['steps']} |",
            flush=True,
        )
        rows.append({"case": label, "real": real, "simulated": sim})
    return rows


def speed(base: str) -> list[dict]:
    """Simulated requests and steps per second of wall time: the batch limit grows, then the queue (all requests
    sent at once: every step orders the whole waiting queue)."""
    print("| max_num_seqs | requests (queue) | arrival | requests/s wall | steps/s wall | mean running |")
    print("|---|---|---|---|---|---|")
    rows = []
    cases = [(32, 5000, 50.0), (128, 5000, 50.0), (256, 5000, 50.0), (256, 1000, None), (256, 5000, None)]
    for max_num_seqs, num_requests, rate in cases:
        engine = SimulatedEngine(load_config(base, [*ROOFLINE_70B, f"scheduler.max_num_seqs={max_num_seqs}"]))
        workload = build_workload(
            "synthetic",
            engine.tokenizer,
            num_requests=num_requests,
            rate=rate,
            num_systems=16,
            system_len=512,
            input_len=256,
            output_len=128,
        )
        summary = simulate_workload(engine, workload)
        arrival = f"{rate:g}/s" if rate else "all at once"
        print(
            f"| {max_num_seqs} | {num_requests} | {arrival} | {summary['simulated_requests_per_wall_s']:.0f} | "
            f"{summary['simulated_steps_per_wall_s']:.0f} | {summary['mean_running']:.0f} |",
            flush=True,
        )
        rows.append({"max_num_seqs": max_num_seqs, "num_requests": num_requests, "rate": rate, **summary})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--override", action="append", default=[], help="key=value for every case's config")
    parser.add_argument("--only", choices=["validation", "speed"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    results = {"date": started}
    if args.only != "speed":
        results["validation"] = validation(args.config, args.override)
    if args.only != "validation":
        results["speed"] = speed(args.config)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)


if __name__ == "__main__":
    main()
