"""How a token is drawn from logits: the filters (temperature, top-k, top-p, min-p) and the seeded draw that the
engine's sampler and a sampling drafter share, so a drafter's guesses follow the distribution the engine samples.

Every random draw comes from a generator keyed by ``(request seed, absolute position)``: the token at position p of
a request is the same whatever batch it runs in.
"""

from __future__ import annotations

import torch

from infer.sampling_params import SamplingParams

MASK = float("-inf")


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    # Mix so that nearby (seed, position) pairs give unrelated streams.
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def add_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> None:
    """Add a request's ``logit_bias`` to its rows of logits ``[rows, vocab]``, in place (OpenAI's semantics: before
    any filter, so +100 all but forces a token and -100 bans it)."""
    token_ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=logits.device)
    bias = torch.tensor(list(logit_bias.values()), dtype=logits.dtype, device=logits.device)
    logits[:, token_ids] += bias


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of float32 logits; returns probabilities."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, MASK)
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
