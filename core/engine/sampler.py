"""Token sampling and speculative verification.

Every random draw comes from a generator keyed by ``(request seed, absolute position)``: the token at position p of
a request is the same whatever batch it runs in, and whether or not drafts were proposed for it (a deterministic
drafter never changes the output, at any temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.sampling import MASK, apply_filters, sample_row
from infer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infer.kernels.cpu import CpuKernels


@dataclass(slots=True)
class SampleRequest:
    """One logits row to sample from: the params, the absolute position of the token being chosen, the seed, and
    the token ids that may not end the sequence yet (``min_tokens``)."""

    params: SamplingParams
    position: int
    seed: int
    banned_token_ids: tuple[int, ...] = ()


class Sampler:
    """Chooses tokens from logits rows; greedy rows take a batched argmax fast path: infer's CPU kernels'
    (``kernels``, a ``CpuKernels``) where the engine runs on them, else torch's max."""

    def __init__(self, kernels: CpuKernels | None = None):
        self.kernels = kernels

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        """``logits`` [N, vocab] float32, one row per request; returns N token ids."""
        logits = self._ban(logits, requests)
        tokens = self._first_maxima(logits).tolist()
        for row, request in enumerate(requests):
            if not request.params.greedy:
                probs = apply_filters(logits[row], request.params)
                tokens[row] = sample_row(probs, request.seed, request.position)
        return tokens

    def _first_maxima(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum. The kernels' scan of a 64-row step over a 151,936-token vocabulary took 1.5 ms
        on one thread of an AMX Xeon where torch's max took 11.2 (max's indices: argmax's, and 2.8x faster than
        argmax over [64, 49152])."""
        flat = logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
        if self.kernels is not None and flat and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return self.kernels.argmax_rows(logits)
        return logits.max(dim=-1).indices

    @staticmethod
    def _ban(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        banned = [(row, r.banned_token_ids) for row, r in enumerate(requests) if r.banned_token_ids]
        if not banned:
            return logits
        logits = logits.clone()
        for row, token_ids in banned:
            logits[row, list(token_ids)] = MASK
        return logits

    @staticmethod
    def logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]) -> list[dict | None]:
        """Log-probabilities (of the raw logits) of the chosen tokens, with the top ``num_top[row]`` alternatives."""
        if all(n is None for n in num_top):
            return [None] * len(token_ids)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        results: list[dict | None] = []
        for row, (token, n) in enumerate(zip(token_ids, num_top)):
            if n is None:
                results.append(None)
                continue
            entry = {"token_id": token, "logprob": float(log_probs[row, token]), "top": []}
            if n > 0:
                values, indices = torch.topk(log_probs[row], n)
                entry["top"] = [(int(i), float(v)) for v, i in zip(values, indices)]
            results.append(entry)
        return results
