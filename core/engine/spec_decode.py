"""Speculative decoding in one place: propose, reserve slots, verify, accept, roll back, trim.

After a step, the drafter guesses up to k tokens for each decoding sequence (``propose``); a drafter with its own KV
gets the verify step's slots first. The next step computes the committed token and its drafts together, and every
draft's logits row is scored: greedily, a draft is accepted while it equals the target's own choice; for a sampled
request whose drafter drew its guesses from a distribution q, by rejection sampling (Leviathan et al., 2023: accept
draft d with probability min(1, p(d)/q(d)), at the first rejection draw from normalize(max(0, p - q)), after the last
draft draw the bonus token from p), so each committed token follows the target's p whatever q is. The acceptance draw
comes from a generator keyed by (request seed, position) and salted apart from the sampler's own stream, so a rerun
commits the same tokens. ``accept`` commits the longest agreeing prefix plus the target's next token; ``rollback``
tells the drafter where the sequence now ends and gives back the blocks reserved for rejected drafts.

Draft trees (``infer.drafter.DraftTree``, greedy requests only): the drafts are computed in one pass as any are, a
leaf at the position of the spine draft it stands beside (``AttentionMetadata.own_keys``), and ``accept`` walks from
the root to the child that equals the target's choice, as long as there is one. A path that ends in a leaf leaves
the leaf's K/V at its own slot, past the spine: they are copied to the slot of its position before the blocks past
the committed tokens go back, and its hidden state to the row a drafter reads for that position.

With a drafter that never proposes (``none``) and no grammar-forced tokens, ``active`` is False and the engine calls
nothing here in a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infer.drafter import Drafter, DrafterConfig, spine_length, tree_depths
from infer.engine.sampler import SampleRequest
from infer.kv_cache_manager import KVCacheManager
from infer.sampling import apply_filters, position_generator, sample_row
from infer.sequence import Sequence

if TYPE_CHECKING:
    from infer.outputs import BatchRows, StepOutput

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


def verify_sampled_drafts(
    logits: torch.Tensor, requests: list[SampleRequest], draft_token_ids: list[int], draft_probs: torch.Tensor
) -> list[int]:
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
    return [*draft_token_ids, sample_row(target_probs(logits[len(draft_token_ids)], bonus), bonus.seed, bonus.position)]


class SpeculativeDecoder:
    """The engine's drafts: who gets them, how they are checked, what is committed and what is given back.

    ``stats`` is the engine's ``EngineStats`` (draft, verify-pass and accepted-token counts); ``jump_forward``: a
    grammar's forced tokens become drafts where the drafter proposed none (``guide.jump_forward``)."""

    def __init__(
        self,
        drafter: Drafter,
        config: DrafterConfig,
        kv: KVCacheManager,
        max_model_len: int,
        stats,
        jump_forward: bool = False,
    ):
        self.drafter = drafter
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.stats = stats
        self._jump_forward = jump_forward
        # Copies a token's K/V over another's in the target's pool (``ModelRunner.move_kv``): set by the engine where
        # its attention backend attends draft trees; None keeps every tree's spine only.
        self.move_kv: Callable[[Sequence, int, int], None] | None = None
        # Accepted leaves this step: sequence id -> (the leaf's row, the row of its position) within its step rows
        self._moved_rows: dict[str, tuple[int, int]] = {}

    @property
    def jump_forward(self) -> bool:
        """Forced tokens as drafts: not with a drafter that keeps state per drafted token (its own KV, the target's
        features), which would never see them."""
        drafter = self.drafter
        return self._jump_forward and not drafter.kv_bytes_per_token() and not drafter.needs_hidden_states

    @property
    def active(self) -> bool:
        """Whether a step may carry drafts (a proposing drafter, or grammar-forced tokens); else the engine calls
        nothing here. Read live: a tool may seat its own drafter in a built engine (``infer train-eagle`` does)."""
        return self.config.num_speculative_tokens > 0 and (self.drafter.proposes or self.jump_forward)

    # -- after a step: propose -----------------------------------------------------------------------------------
    def after_step(self, output: StepOutput, running: list[Sequence]) -> None:
        """Show the drafter the step (an accepted leaf's hidden state in the row of its position), then draft for the
        sequences in decode."""
        if self._moved_rows and output.hidden_states is not None:
            with torch.inference_mode():  # the forward pass's tensor
                for row in output.token_rows:
                    moved = self._moved_rows.get(row.seq.seq_id)
                    if moved is not None:
                        output.hidden_states[row.start + moved[1]] = output.hidden_states[row.start + moved[0]]
        self._moved_rows.clear()
        self.drafter.observe(output)
        self.propose(running)

    def propose(self, running: list[Sequence]) -> None:
        k = self.config.num_speculative_tokens
        decoding = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        if not decoding or len(running) > self.config.max_batch_size:
            return
        if self.drafter.kv_bytes_per_token():
            # The drafter writes KV for the guesses it feeds itself: reserve the verify step's slots now (a sequence
            # that cannot get them drafts nothing this step).
            decoding = [seq for seq in decoding if self.kv.allocate(seq, k + 1)]
        proposals = self.drafter.propose(decoding, k)
        if self.jump_forward:
            proposals = [
                drafts if drafts or seq.matcher is None else seq.matcher.forced_tokens()[:k]
                for seq, drafts in zip(decoding, proposals)
            ]
        for seq, drafts in zip(decoding, proposals):
            room = max(
                0, min(self.max_model_len - seq.num_tokens - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
            )
            probs, parents = getattr(drafts, "probs", None), getattr(drafts, "parents", None)
            tokens = list(drafts[:room])
            if parents is not None:
                tokens, parents = self._tree_that_fits(seq, list(drafts), parents, room)
            seq.draft_token_ids, seq.draft_parents = tokens, parents
            seq.draft_probs = None if probs is None else probs[: len(tokens)]
            self.stats.num_draft_tokens += len(tokens)

    def _tree_that_fits(
        self, seq: Sequence, drafts: list[int], parents: list[int], room: int
    ) -> tuple[list[int], list[int] | None]:
        """A drafter's tree for ``seq`` as this step can verify it: the drafts no deeper than ``room`` (tokens past
        it could not be committed), and only its spine (a chain: parents None) for a sampled or structured-output
        request or where the engine cannot attend trees."""
        depths = tree_depths(parents)
        if self.move_kv is None or not seq.params.greedy or seq.matcher is not None:
            return drafts[: min(spine_length(parents), room)], None
        kept = [index for index, depth in enumerate(depths) if depth <= room]
        # the spine comes first and every leaf's parent is on it, so the kept spine keeps its indices
        return [drafts[index] for index in kept], [parents[index] for index in kept]

    # -- in the step: verify and accept --------------------------------------------------------------------------
    @staticmethod
    def verify_sampled(
        logits: torch.Tensor, rows: list[BatchRows], requests: list[SampleRequest], tokens: list[int]
    ) -> None:
        """For sampled requests whose drafts came with q, replace the row's sampled tokens by rejection sampling's
        choice; ``accept`` then commits exactly those."""
        for row in rows:
            seq = row.seq
            if seq.draft_probs is None or not seq.draft_token_ids or seq.params.greedy:
                continue
            span = slice(row.start, row.start + row.count)
            chosen = verify_sampled_drafts(
                logits[span], requests[span], seq.draft_token_ids[: row.count - 1], seq.draft_probs
            )
            tokens[row.start : row.start + len(chosen)] = chosen

    def accept(self, seq: Sequence, sampled: list[int]) -> tuple[list[int], list[int]]:
        """The tokens to commit for ``seq`` out of its rows' ``sampled`` ones, and the rows they came from: the
        longest run of drafts that agrees with the target (a path from the root, in a tree), plus the target's next
        token. Clears the drafts; the K/V of the accepted ones counts as computed (rejected draft slots are
        overwritten later; an accepted leaf's are moved to its position)."""
        drafts, parents = seq.draft_token_ids, seq.draft_parents
        rows = [0]
        while len(rows) < len(sampled):
            node = rows[-1] - 1  # the draft whose row the last accepted token came from (-1: the root)
            token = sampled[rows[-1]]
            if parents is None:
                child = node + 1 if node + 1 < len(drafts) and drafts[node + 1] == token else None
            else:
                child = next(
                    (
                        index
                        for index in range(node + 1, min(len(drafts), len(sampled) - 1))
                        if parents[index] == node and drafts[index] == token
                    ),
                    None,
                )
            if child is None:
                break
            rows.append(child + 1)
        accepted = [sampled[row] for row in rows]
        if len(rows) > 1 and rows[-1] != len(rows) - 1:  # the path ends in a leaf, whose K/V sit past the spine
            committed = seq.num_tokens
            self.move_kv(seq, committed + rows[-1] - 1, committed + len(rows) - 2)
            self._moved_rows[seq.seq_id] = (rows[-1], len(rows) - 1)
        if len(sampled) > 1:
            seq.num_verify_passes += 1
            seq.num_accepted_tokens += len(accepted)
            self.stats.num_verify_passes += 1
            self.stats.num_accepted_tokens += len(accepted)
        seq.draft_token_ids = []
        seq.draft_probs = None
        seq.draft_parents = None
        seq.num_computed_tokens = seq.num_tokens + len(accepted) - 1
        return accepted, rows

    def rollback(self, seq: Sequence) -> None:
        """After ``seq``'s tokens were committed (and it goes on): the drafter forgets state past them, and the
        blocks reserved for rejected drafts go back."""
        self.kv.trim(seq)
        self.drafter.rollback(seq, seq.num_tokens)

    def release(self, seqs: list[Sequence]) -> None:
        """Sequences that left the running set (finished or preempted): the drafter drops their state."""
        for seq in seqs:
            self.drafter.release(seq)
