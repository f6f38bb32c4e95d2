"""Token sampling and speculative verification.

Every random draw comes from a generator keyed by ``(request seed, absolute position)``: the token at position p of
a request is the same whatever batch it runs in, and whether or not drafts were proposed for it (a deterministic
drafter never changes the output, at any temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.sampling_params import SamplingParams

_MASK = float("-inf")


@dataclass(slots=True)
class SampleRequest:
    """One logits row to sample from: the params, the absolute position of the token being chosen, the seed, and
    the token ids that may not end the sequence yet (``min_tokens``)."""

    params: SamplingParams
    position: int
    seed: int
    banned_token_ids: tuple[int, ...] = ()


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    # Mix so that nearby (seed, position) pairs give unrelated streams.
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of float32 logits; returns probabilities."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, _MASK)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (the token crossing it stays).

    Sorting a 49k vocabulary costs ~7 ms a row on one core; the set nearly always lies within the few hundred most
    likely tokens, so take the 256 most likely (a partial sort) and sort everything only when their mass falls short
    of ``top_p``; otherwise every token past them is dropped, exactly as a full sort would drop it."""
    values, order = torch.topk(probs, min(256, probs.shape[-1]))
    cumulative = torch.cumsum(values, dim=-1)
    if float(cumulative[-1]) < top_p:  # a flat distribution: sort it all
        values, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(values, dim=-1)
    kept = values.masked_fill(cumulative - values >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, kept)


def sample_row(probs: torch.Tensor, seed: int, position: int) -> int:
    """Draw from ``probs`` by inverting its cumulative distribution at one uniform number keyed by (seed, position):
    a sum over the vocabulary and one random draw (an exponential race, which draws a random number per token, took
    4 ms a row over 49k tokens). A token of probability 0 is never drawn."""
    generator = position_generator(seed, position, probs.device)
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    point = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, point, right=True)), probs.shape[-1] - 1)


class Sampler:
    """Chooses tokens from logits rows; greedy rows take a batched argmax fast path."""

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        """``logits`` [N, vocab] float32, one row per request; returns N token ids."""
        logits = self._ban(logits, requests)
        # max's indices: the first maximum, as argmax's, and 2.8x faster over [64, 49152] on the CPU (0.8 vs 2.3 ms)
        tokens = logits.max(dim=-1).indices.tolist()
        for row, request in enumerate(requests):
            if not request.params.greedy:
                probs = apply_filters(logits[row], request.params)
                tokens[row] = sample_row(probs, request.seed, request.position)
        return tokens

    @staticmethod
    def _ban(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        banned = [(row, r.banned_token_ids) for row, r in enumerate(requests) if r.banned_token_ids]
        if not banned:
            return logits
        logits = logits.clone()
        for row, token_ids in banned:
            logits[row, list(token_ids)] = _MASK
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
