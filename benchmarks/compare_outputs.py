"""Whether two ``infer run --output`` files hold the same completions, token for token: the before/after check of a
change that must not alter greedy output (docs/testing.md). Exits 1 listing the prompts that differ.

    infer run configs/baseline.yaml --output after.jsonl          # on this checkout
    PYTHONPATH=/path/to/before/site infer run configs/baseline.yaml --output before.jsonl
    python benchmarks/compare_outputs.py before.jsonl after.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys


def read(path: str) -> dict[int, dict]:
    with open(path) as handle:
        return {line["id"]: line for line in map(json.loads, handle)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    before, after = read(args.before), read(args.after)
    if before.keys() != after.keys():
        print(f"different prompts: {sorted(before.keys() ^ after.keys())}")
        return 1
    differ = [key for key in sorted(before) if before[key]["token_ids"] != after[key]["token_ids"]]
    for key in differ:
        first, second = before[key], after[key]
        print(f"prompt {key} ({first['prompt'][:60]!r}): {first['text'][:80]!r} vs {second['text'][:80]!r}")
    tokens = sum(len(line["token_ids"]) for line in before.values())
    print(f"{len(before) - len(differ)} of {len(before)} completions identical ({tokens} tokens before)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
