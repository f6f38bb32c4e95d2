"""Python calls per decode step: how many Python functions ``Engine.step()`` calls per decode step at batch 1 and 8,
for checkouts side by side (the before/after count of a change to the step's code, free of the machine's noise).

``sys.setprofile`` counts the "call" events inside ``engine.step()`` (the step's own call excluded; a generator's
every resumption is one), and the "c_call" events (calls of built-in functions) apart. Calls inside
``ModelRunner.forward`` (embedding, layers, output head; their number depends on the execution path the config picks)
are counted in "all" and left out of "outside forward", which is the engine's own bookkeeping: scheduling, batch
metadata, sampling, accepting tokens, stop checks, counters. Each case: ``batch`` requests with ``ignore_eos``,
greedy, float32 by default, prefilled, 3 warm-up decode steps, then ``--steps`` counted decode steps (every sequence
decoding in each; garbage collection paused so that no finalizer lands in a step); averages per step. Distinct
functions: the Python functions called at least once in the counted steps. Only the calling thread is profiled.
Third-party plugins stay unloaded unless ``INFER_PLUGINS`` names them (default ``none`` here: an installed
``step_finished`` observer would add its calls, and the plan's shape, to every step). Each checkout runs in its own
process, imported from its three source folders; prints a table, then each checkout's top functions outside the
forward pass by calls per step.

    OMP_NUM_THREADS=2 python benchmarks/step_calls.py --checkout before=/tmp/before --checkout after=.
    python benchmarks/step_calls.py --checkout after=. drafter.name=ngram     # any config override
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from drain import drain  # beside this script: the public engine API only
from step_overhead import mount  # beside this script; imports nothing of infer


class CallCounter:
    """A ``sys.setprofile`` hook counting the calls made inside ``step_code``, split by whether a frame of
    ``forward_code`` is on the stack."""

    def __init__(self, step_code, forward_code):
        self.step_code, self.forward_code = step_code, forward_code
        self.step_depth = self.forward_depth = 0
        self.calls = [Counter(), Counter()]  # [outside forward, inside forward]: code object -> calls
        self.c_calls = [Counter(), Counter()]  # the same for built-ins: name -> calls
        self.modules: dict = {}  # code object -> its module's name

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            if code is self.step_code:
                self.step_depth += 1
                return
            if not self.step_depth:
                return
            if code is self.forward_code:
                self.forward_depth += 1
            self.calls[self.forward_depth > 0][code] += 1
            if code not in self.modules:
                self.modules[code] = frame.f_globals.get("__name__", "?")
        elif event == "return":
            code = frame.f_code
            if code is self.step_code:
                self.step_depth -= 1
            elif code is self.forward_code and self.step_depth:
                self.forward_depth -= 1
        elif event == "c_call" and self.step_depth:
            self.c_calls[self.forward_depth > 0][c_name(arg)] += 1

    def name(self, code) -> str:
        """``module.qualname``, with the first line for a lambda, comprehension or generator expression."""
        line = f":{code.co_firstlineno}" if "<" in code.co_name else ""
        return f"{self.modules[code]}.{code.co_qualname}{line}"


def c_name(function) -> str:
    owner = getattr(function, "__module__", None)
    if owner is None:
        bound = getattr(function, "__self__", None)
        owner = type(bound).__module__ if bound is not None else "?"
    return f"{owner}.{getattr(function, '__qualname__', repr(function))}"


def measure(overrides: list[str], batches: list[int], steps: int, top: int) -> dict[str, dict]:
    """Calls per counted decode step at each batch size, and the top functions outside the forward pass."""
    from infer import LLM, SamplingParams

    llm = LLM("baseline", overrides)
    engine = llm.engine
    step_code = type(engine).step.__code__
    forward_code = engine.runner.forward.__func__.__code__
    results = {}
    for batch in batches:
        options = {"ignore_eos": True} if "ignore_eos" in inspect.signature(SamplingParams).parameters else {}
        params = SamplingParams(max_tokens=steps + 16, temperature=0.0, **options)
        for i in range(batch):
            engine.add_request(
                [{"role": "user", "content": f"Tell me a long story about lighthouse number {i}."}], params
            )
        while engine.waiting or any(seq.num_uncomputed_tokens > 1 for seq in engine.running):
            engine.step()
        for _ in range(3):
            engine.step()
        counter = CallCounter(step_code, forward_code)
        gc.collect()
        gc.disable()
        try:
            for _ in range(steps):
                if len(engine.running) != batch or engine.waiting:
                    raise RuntimeError(f"batch {batch}: {len(engine.running)} running, {len(engine.waiting)} waiting")
                sys.setprofile(counter)
                engine.step()
                sys.setprofile(None)
        finally:
            sys.setprofile(None)
            gc.enable()
        outside, inside = counter.calls
        results[str(batch)] = {
            "calls": (sum(outside.values()) + sum(inside.values())) / steps,
            "calls_outside": sum(outside.values()) / steps,
            "distinct": len(outside.keys() | inside.keys()),
            "distinct_outside": len(outside),
            "c_calls": (sum(counter.c_calls[0].values()) + sum(counter.c_calls[1].values())) / steps,
            "c_calls_outside": sum(counter.c_calls[0].values()) / steps,
            "top_outside": [[counter.name(code), count / steps] for code, count in outside.most_common(top)],
        }
        drain(engine)
    results["dtype"] = str(engine.dtype).removeprefix("torch.")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (model.dtype=float32 comes first)")
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a checkout to measure (repeatable); default: this one",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = ["model.dtype=float32", *args.overrides]
    if args.worker:
        mount(Path(args.worker).resolve())
        print(json.dumps(measure(overrides, args.batches, args.steps, args.top)))
        return
    checkouts = [item.split("=", 1) for item in args.checkout] or [["this", str(Path(__file__).parents[1])]]
    results = {}
    for label, root in checkouts:
        command = [
            sys.executable,
            __file__,
            "--worker",
            root,
            "--steps",
            str(args.steps),
            "--top",
            str(args.top),
            "--batches",
            *map(str, args.batches),
            "--",
            *args.overrides,
        ]
        environment = {**os.environ, "INFER_PLUGINS": os.environ.get("INFER_PLUGINS") or "none"}
        run = subprocess.run(command, capture_output=True, text=True, env=environment)
        if run.returncode:
            print(f"{label} ({root}) failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            continue
        results[label] = json.loads(run.stdout.strip().splitlines()[-1])
    if not results:
        sys.exit(1)
    print(f"{args.steps} decode steps per case, averages per step; overrides: {' '.join(overrides)}\n")
    print(
        "| checkout | dtype | batch | calls/step (all) | calls/step (outside forward) "
        "| distinct functions (all / outside) | C calls/step (all / outside) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, result in results.items():
        for batch in map(str, args.batches):
            case = result[batch]
            print(
                f"| {label} | {result['dtype']} | {batch} | {case['calls']:,.1f} | {case['calls_outside']:,.1f} "
                f"| {case['distinct']} / {case['distinct_outside']} "
                f"| {case['c_calls']:,.1f} / {case['c_calls_outside']:,.1f} |"
            )
    for label, result in results.items():
        for batch in map(str, args.batches):
            print(f"\n{label}, batch {batch}: top {args.top} functions outside the forward pass, calls per step\n")
            print("| function | calls/step |\n|---|---|")
            for name, count in result[batch]["top_outside"]:
                print(f"| `{name}` | {count:,.2f} |")


if __name__ == "__main__":
    main()
