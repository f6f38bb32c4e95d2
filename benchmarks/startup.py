"""What an engine's start costs: building the C kernels into an empty folder (once per machine and source), reading a
GGUF file's header (infer's reader against the gguf package's ``GGUFReader``, which ``gguf.GGUFReader``-based code
pays), making the HF folder a first run makes of a GGUF file (once, into an empty cache folder: the config and
tokenizer of a file infer reads itself, transformers' float conversion of any other), and constructing
``LLM(config)`` in a fresh process with the kernels and that folder already cached,
with the start's peak memory and what the engine holds once started. Prints markdown rows; each figure the median
of ``--repeats``.

    OMP_NUM_THREADS=2 python benchmarks/startup.py
    python benchmarks/startup.py --gguf /path/model-Q4_K_M.gguf --engine-overrides model.path=/path/model-Q4_K_M.gguf
    python benchmarks/startup.py --engine-only --engine-overrides model.path=DIR model.quantization=q4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The start's peak anonymous memory, sampled every 10 ms: what the process itself holds. The resident-set peak
# (``ru_maxrss``) also counts the safetensors files' pages mapped while they are read, which the page cache gives
# back under pressure.
ENGINE_SCRIPT = """
import re, sys, threading, time
def anonymous_bytes():
    with open("/proc/self/status") as status:
        return int(re.search(r"RssAnon:\\s+(\\d+) kB", status.read()).group(1)) * 1024
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], anonymous_bytes())
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
from infer import LLM
llm = LLM(sys.argv[1], dotlist=sys.argv[2:])
print(time.perf_counter() - start)
held = anonymous_bytes()
print(max(peak[0], held))
print(held)
print(llm.engine.describe_execution().split(";")[0])
"""

CONVERSION_SCRIPT = """
import sys, time
from infer.model.loader import hf_model_dir
start = time.perf_counter()
hf_model_dir(sys.argv[1])
print(time.perf_counter() - start)
"""


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", type=Path, nargs="*", help="GGUF files to read (default: the default model's)")
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--engine-overrides", nargs="*", default=[], help="config overrides for the engine row")
    parser.add_argument("--engine-only", action="store_true", help="time the engine's start alone")
    args = parser.parse_args()

    import gguf

    from infer.kernels.cpu import builder
    from infer.model.gguf_file import GgufFile
    from infer.model.loader import DEFAULT_MODEL, resolve_model_path

    print("| what | seconds |")
    print("|---|---|")

    def build() -> None:
        with tempfile.TemporaryDirectory() as folder:
            builder.build(Path(folder))

    if not args.engine_only:
        print(f"| C kernels, built into an empty folder | {median_seconds(build, args.repeats):.2f} |")
    for path in [] if args.engine_only else args.gguf or [resolve_model_path(DEFAULT_MODEL)]:
        ours = median_seconds(lambda: GgufFile(path), args.repeats)
        theirs = median_seconds(lambda: gguf.GGUFReader(path), args.repeats)
        print(f"| {path.name}: header, infer's GgufFile | {ours:.3f} |")
        print(f"| {path.name}: header, gguf.GGUFReader | {theirs:.3f} |")
        with tempfile.TemporaryDirectory() as cache:
            result = subprocess.run(
                [sys.executable, "-c", CONVERSION_SCRIPT, str(path)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "INFER_CACHE_DIR": cache},
            )
        print(f"| {path.name}: its HF folder made (first run, once) | {float(result.stdout.split()[-1]):.1f} |")

    command = [sys.executable, "-c", ENGINE_SCRIPT, args.config, *args.engine_overrides]
    subprocess.run(command, capture_output=True, check=True)  # converts and builds what is missing, not timed
    times, peaks, helds, execution = [], [], [], ""
    for _ in range(args.repeats):
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        seconds, peak, held, execution = result.stdout.strip().splitlines()[-4:]
        times.append(float(seconds))
        peaks.append(int(peak))
        helds.append(int(held))
    print(f"| `LLM({args.config!r})` in a fresh process, caches warm ({execution}) | {statistics.median(times):.2f} |")
    print(f"| the same: peak anonymous memory of the start, GiB | {statistics.median(peaks) / 2**30:.2f} |")
    print(f"| the same: anonymous memory once started, GiB | {statistics.median(helds) / 2**30:.2f} |")


if __name__ == "__main__":
    main()
