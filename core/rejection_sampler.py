"""Verification of drafts that a drafter sampled from its own distribution q (Leviathan et al., 2023).

Draft token d at position t is accepted with probability min(1, p(d) / q(d)); at the first rejection the token is
drawn from normalize(max(0, p - q)); when every draft is accepted the bonus token is drawn from p. Whatever q is, each
committed token then follows the target's p. The acceptance draw comes from a generator keyed by (request seed,
position) and salted apart from the sampler's own stream, so a rerun commits the same tokens.
"""

from __future__ import annotations

import torch

from infer.sampler import SampleRequest, apply_filters, position_generator, sample_row

# Keeps the acceptance draw independent of the token draw at the same (seed, position).
_ACCEPT_SALT = 0x5DEECE66D


def target_probs(logits: torch.Tensor, request: SampleRequest) -> torch.Tensor:
    """The target's sampling distribution for one row of float32 logits (bans, temperature, top-k/p, min-p)."""
    if request.banned_token_ids:
        logits = logits.clone()
        logits[list(request.banned_token_ids)] = float("-inf")
    return apply_filters(logits, request.params)


def accept_draw(seed: int, position: int) -> float:
    """u ~ U[0, 1) in float64 (float32 can round to exactly 0, which would accept a draft p gives no mass)."""
    generator = position_generator(seed + _ACCEPT_SALT, position, torch.device("cpu"))
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def verify_sampled_drafts(logits: torch.Tensor, requests: list[SampleRequest], draft_token_ids: list[int],
                          draft_probs: torch.Tensor) -> list[int]:
    """The tokens to commit for one sequence: the accepted drafts, then one token drawn by the target.

    ``logits`` is ``[len(draft_token_ids) + 1, vocab]`` (row j scores the token after draft j - 1), ``requests`` the
    matching sample requests, ``draft_probs`` ``[len(draft_token_ids), vocab]`` the q each draft was drawn from.
    """
    for j, draft in enumerate(draft_token_ids):
        request = requests[j]
        p = target_probs(logits[j], request)
        q = draft_probs[j].to(p.device, torch.float32)
        if q[draft] > 0 and accept_draw(request.seed, request.position) * q[draft] < p[draft]:
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        # p == q to rounding: a rejection is then a numerical accident, and p itself is the right law.
        residual = residual / total if total > 0 else p
        return [*draft_token_ids[:j], sample_row(residual, request.seed, request.position)]
    bonus = requests[len(draft_token_ids)]
    return [*draft_token_ids, sample_row(target_probs(logits[len(draft_token_ids)], bonus), bonus.seed,
                                         bonus.position)]
