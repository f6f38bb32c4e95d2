"""The HF transformers baseline: ``generate`` with static batches on the same requests, model and dtype.

Convention: requests go in arrival order in batches of ``batch_size`` (arrival times themselves are ignored: it is
an offline run), left-padded, greedy. Each batch generates ``max_new_tokens`` = the largest ``max_tokens`` in it,
with EOS not stopping generation, and each request counts only its own tokens: ``max_tokens`` of them with
``ignore_eos``, else up to and including its first EOS or stop token id past ``min_tokens``. Stop strings and
sampling settings are not applied (the baseline is always greedy). Tokens generated past a request's own length
are the static batch's waste and are reported separately, not counted as output.
"""

from __future__ import annotations

import time

import torch

from infer.bench.runner import TokenizedRequest


def run_hf_baseline(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    requests: list[TokenizedRequest],
    batch_size: int,
    eos_token_ids: set[int],
    show_progress: bool = False,
) -> dict:
    """Load the HF model for ``model_path`` and time static-batch ``generate`` over ``requests``; returns a summary
    comparable with ``infer.engine.metrics.summarize``'s throughput fields."""
    from tqdm import tqdm

    from infer.testing.models import load_hf_reference

    if any(request.params.max_tokens is None for request in requests):
        raise ValueError(
            "the HF baseline runs each batch to a fixed length: give every request a max_tokens "
            "(a prompts line's max_tokens is null)"
        )
    model, tokenizer = load_hf_reference(model_path, dtype)
    model.to(device)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_token_ids)
    output_tokens = generated_tokens = 0
    wall_time_s = 0.0
    for first in tqdm(
        range(0, len(requests), batch_size), desc="HF batches", disable=not show_progress, dynamic_ncols=True
    ):
        batch = requests[first : first + batch_size]
        start = time.perf_counter()
        new_tokens = generate_batch(model, batch, pad_token_id, device)
        wall_time_s += time.perf_counter() - start
        output_tokens += sum(own_output_length(row, request, eos_token_ids) for row, request in zip(new_tokens, batch))
        generated_tokens += new_tokens.numel()
    return {
        "requests": len(requests),
        "batch_size": batch_size,
        "dtype": str(dtype).removeprefix("torch."),
        "output_tokens": output_tokens,
        "generated_tokens": generated_tokens,
        "wall_time_s": wall_time_s,
        "output_tok_per_s": output_tokens / wall_time_s if wall_time_s else 0.0,
        "prompt_tok_per_s": (sum(len(r.prompt_token_ids) for r in requests) / wall_time_s if wall_time_s else 0.0),
        "requests_per_s": len(requests) / wall_time_s if wall_time_s else 0.0,
    }


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [batch, longest prompt], padding on the left so every row's last prompt
    token sits in the last column (where ``generate`` appends)."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def generate_batch(model, batch: list[TokenizedRequest], pad_token_id: int, device: torch.device) -> torch.Tensor:
    """The new tokens [batch, max_new_tokens] of one static batch, greedy, running to max_new_tokens."""
    max_new_tokens = max(request.params.max_tokens for request in batch)
    input_ids, attention_mask = left_pad([request.prompt_token_ids for request in batch], pad_token_id)
    with torch.inference_mode():
        # eos_token_id=None as a keyword (a GenerationConfig field of None is overridden by the model's default).
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_token_id,
        )
    new_tokens = output[:, input_ids.shape[1] :].cpu()
    if new_tokens.shape[1] != max_new_tokens:
        raise RuntimeError(
            f"HF generate stopped after {new_tokens.shape[1]} of {max_new_tokens} new tokens; "
            "the baseline's token counts would be wrong"
        )
    return new_tokens


def own_output_length(row: torch.Tensor, request: TokenizedRequest, eos_token_ids: set[int]) -> int:
    """How many of the batch row's tokens belong to this request (see the module docstring's convention)."""
    params = request.params
    limit = min(params.max_tokens, len(row))
    if params.ignore_eos and not params.stop_token_ids:
        return limit
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    tokens = row[:limit].tolist()
    # The engine bans stop tokens before min_tokens; counting from there keeps both sides' lengths comparable.
    return next((index + 1 for index in range(params.min_tokens, limit) if tokens[index] in stops), limit)
