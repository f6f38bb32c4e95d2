"""Per-step Python overhead: a decode step's wall time outside the model's forward pass, and the whole step's, at
batch 1 and 64, for two checkouts side by side (the before/after measurement of a change to the step's bookkeeping).

The forward pass is ``ModelRunner.forward`` (embedding, layers, output head: what every tensor-parallel rank runs);
everything else in ``Engine.step`` is overhead here: scheduling, batch metadata, sampling, accepting tokens, stop
checks, prefix-cache offers, drafting bookkeeping, counters. Each case: ``batch`` requests prefilled, 3 warm-up
steps, then ``--steps`` decode steps; the median of the per-step overheads over ``--repeats`` interleaved rounds
(each round runs every checkout once, in its own process, so that the machine's noise falls on both alike).

    OMP_NUM_THREADS=2 python benchmarks/step_overhead.py --checkout before=/tmp/before --checkout after=.
    python benchmarks/step_overhead.py --checkout after=. drafter.name=ngram     # any config override
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODULES = (("infer", "core"), ("infer.plugins", "plugins"), ("infer.configs", "configs"))


def mount(root: Path) -> None:
    """Import infer from the checkout at ``root`` (its three source folders) instead of the installed one."""
    modules = []
    for name, folder in MODULES:
        spec = importlib.util.spec_from_file_location(
            name, root / folder / "__init__.py", submodule_search_locations=[str(root / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules["infer"], name.split(".")[1], module)
        modules.append((spec, module))
    for spec, module in modules:
        spec.loader.exec_module(module)


def measure(overrides: list[str], batches: list[int], steps: int) -> dict[str, dict[str, list[float]]]:
    """Per-step overheads and whole steps (ms) of ``steps`` decode steps at each batch size."""
    from drain import drain  # beside this script (imported after ``mount``: it imports infer)

    from infer import LLM, SamplingParams

    llm = LLM("baseline", overrides)
    engine = llm.engine
    forward = engine.runner.forward
    inside = [0.0]

    def timed_forward(*args, **kwargs):
        began = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - began

    engine.runner.forward = timed_forward
    results = {}
    for batch in batches:
        params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(
                [{"role": "user", "content": f"Tell me a long story about lighthouse number {i}."}], params
            )
        while engine.waiting or any(seq.num_uncomputed_tokens > 1 for seq in engine.running):
            engine.step()
        for _ in range(3):
            engine.step()
        overheads, totals = [], []
        for _ in range(steps):
            inside[0] = 0.0
            began = time.perf_counter()
            engine.step()
            total = time.perf_counter() - began
            overheads.append((total - inside[0]) * 1e3)
            totals.append(total * 1e3)
        results[str(batch)] = {"overhead": overheads, "step": totals}
        drain(engine)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a checkout to measure (repeatable); default: this one",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mount(Path(args.worker).resolve())
        print(json.dumps(measure(args.overrides, args.batches, args.steps)))
        return
    checkouts = [item.split("=", 1) for item in args.checkout] or [["this", str(Path(__file__).parents[1])]]
    samples: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.repeats):
        for label, root in checkouts:
            command = [
                sys.executable,
                __file__,
                "--worker",
                root,
                "--steps",
                str(args.steps),
                "--batches",
                *map(str, args.batches),
                "--",
                *args.overrides,
            ]
            result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            for batch, kinds in result.items():
                for kind, values in kinds.items():
                    samples.setdefault((label, batch, kind), []).extend(values)
    heads = [f"batch {b}: {kind} ms (median, p90)" for b in args.batches for kind in ("overhead", "step")]
    print(f"| checkout | {' | '.join(heads)} |")
    print(f"|---|{'---|' * len(heads)}")
    for label, _ in checkouts:
        cells = []
        for batch in map(str, args.batches):
            for kind in ("overhead", "step"):
                values = sorted(samples[(label, batch, kind)])
                cells.append(f"{statistics.median(values):.2f} ({values[int(len(values) * 0.9)]:.2f})")
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
