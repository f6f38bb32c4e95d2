"""``drafter: model``: a small model drafts k tokens, one forward pass per token, for the target to verify.

The draft is any model with the target's tokenizer (``path``), or, without a path, the target itself cut short:
its first ``layers`` decoder layers, then its final norm and head (self-speculative drafting, no extra weights).

The draft keeps its KV in its own pool of the target's block geometry, addressed through each sequence's own
``block_table``, so the allocator and the prefix cache serve both pools. Per sequence the drafter remembers how many
committed tokens its KV covers and which guesses it fed itself after them. Each ``propose`` first catches up on the
committed tokens it has not seen (at least the last one, whose logits give the first guess), then feeds its guesses
back one pass at a time. A guess the target accepted keeps its KV (same token, same position); rejected ones are
overwritten by the next catch-up.

Prefix-cache hits: the draft-pool side of a cached block holds the draft KV of whichever sequence last wrote it, for
the same tokens when that sequence drafted over them, and stale data when it did not (drafting switched off, or the
block cached before the drafter caught up). The drafter cannot tell which, so a sequence it has not seen yet starts
at position 0 and computes the draft KV of its whole prefix itself: cached blocks then hold valid draft KV for the
same tokens whoever wrote them last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import Field

from infer.attention import AttentionMetadata
from infer.drafter import Drafter, DrafterConfig, DrafterContext, SampledDrafts
from infer.sampling import apply_filters, sample_row

# Keeps the drafter's random draw at a position independent of the target's (the same seed keys both).
_DRAFT_SALT = 0x2545F4914F6CDD1D


class ModelDrafterConfig(DrafterConfig):
    name: str = "model"
    path: str | None = Field(
        None,
        description="Draft model (alias, HF folder or GGUF file) with the target's "
        "tokenizer; unset: self-speculative, the target's first layers.",
    )
    layers: int | None = Field(
        None,
        ge=1,
        description="Self-speculative mode: draft with this many of the "
        "target's first layers, then its final norm and head "
        "(default: half of them).",
    )
    sampling: bool = Field(
        False,
        description="For sampled requests, sample guesses from the draft's own "
        "distribution (the engine verifies with min(1, p/q)); false: guess "
        "the draft's argmax.",
    )


class TargetLayers:
    """The target's first ``num_layers`` decoder layers, then its final norm and head: a draft model with no weights
    of its own. Its layers are the target's layers 0..num_layers-1, so they index a ``num_layers``-layer pool."""

    def __init__(self, target, num_layers: int):
        if num_layers > target.num_layers:
            raise ValueError(f"drafter.layers={num_layers} exceeds the target's {target.num_layers} layers")
        self.target = target
        self.num_layers = num_layers
        self.num_kv_heads = target.num_kv_heads
        self.head_dim = target.head_dim
        self.rotary = target.rotary

    @torch.inference_mode()
    def __call__(self, input_ids, step) -> torch.Tensor:
        target = self.target
        return target.run_layers(target.embed(input_ids), target.layers[: self.num_layers], step)

    def compute_logits(self, hidden: torch.Tensor, argmax_rows: list[int] | None = None) -> torch.Tensor:
        return self.target.compute_logits(hidden, argmax_rows)


@dataclass(slots=True)
class DraftProgress:
    """What one sequence's draft KV holds: committed tokens ``[0, num_computed)``, then the guesses fed after them."""

    num_computed: int = 0
    guesses: list[int] = field(default_factory=list)

    def valid_length(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` whose draft KV is right: the committed ones, plus the guesses that came true."""
        length = self.num_computed
        for guess in self.guesses:
            if length >= len(token_ids) or token_ids[length] != guess:
                break
            length += 1
        return length


class ModelDrafter(Drafter):
    """Drafts with a small model (or the target's first layers) that keeps its own paged KV."""

    config_model = ModelDrafterConfig
    needs_target = True

    def __init__(self, config: ModelDrafterConfig | None = None, context: DrafterContext | None = None):
        super().__init__(config, context)
        self.device = context.device
        self.dtype = context.dtype
        self.vocab_size = context.target.vocab_size
        self.block_size = context.block_size
        self.draft, self.attention, self.executor = self._load_draft(context)
        self.kv_cache: torch.Tensor | None = None
        self._progress: dict[str, DraftProgress] = {}

    def _load_draft(self, context: DrafterContext):
        if self.config.path is None:
            layers = self.config.layers or max(1, context.target.num_layers // 2)
            return TargetLayers(context.target, layers), context.attention, context.executor
        model, tokenizer = context.load_model(self.config.path)
        if tokenizer.get_vocab() != context.tokenizer.get_vocab():
            raise ValueError(
                f"drafter.path={self.config.path!r} does not use the target's tokenizer; a draft model "
                f"must share it token for token"
            )
        draft = context.quantize(model)
        executor = context.executor.for_another(draft)  # the target's kernels and paths, if it runs on them
        if getattr(context.target, "head_screen", None) is not None:  # greedy guesses through its head's screen too
            draft.screen_head(executor.kernels)
        attention = context.build_attention(
            draft.num_heads, draft.num_kv_heads, draft.head_dim, draft.layer_attention, draft.attention_sinks
        )
        return draft, attention, executor

    # -- the draft pool ------------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return self.attention.kv_bytes_per_token(self.draft.num_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.attention.allocate_kv_cache(self.draft.num_layers, num_blocks)

    # -- drafting ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sequences, k):
        drafts: list[list[int]] = [[] for _ in sequences]
        probs: list[list[torch.Tensor]] = [[] for _ in sequences]
        limits = [self._max_drafts(seq, k) for seq in sequences]
        drafting = [i for i, limit in enumerate(limits) if limit > 0]
        if drafting:
            self._catch_up_and_guess(sequences, drafting, drafts, probs)
        active = drafting
        for step in range(1, k):
            active = [i for i in active if len(drafts[i]) < limits[i]]
            if not active:
                break
            self._guess(sequences, active, drafts, probs, step)
        for i in drafting:
            seq = sequences[i]
            # Every guess but the last was fed back, so its KV sits at the positions after the committed tokens.
            self._progress[seq.seq_id] = DraftProgress(seq.num_tokens, drafts[i][:-1])
        return [SampledDrafts(tokens, torch.stack(rows)) if rows else tokens for tokens, rows in zip(drafts, probs)]

    def _max_drafts(self, seq, k: int) -> int:
        """Guesses whose KV fits in the sequence's blocks: the guess at position p needs the slot of p - 1."""
        capacity = len(seq.block_table) * self.block_size
        return max(0, min(k, capacity - seq.num_tokens + 1))

    def _catch_up_and_guess(self, sequences, active, drafts, probs) -> None:
        """First pass: the committed tokens the draft KV lacks (at least the last one), then the first guess."""
        starts, token_lists = [], []
        for i in active:
            seq = sequences[i]
            token_ids = seq.token_ids
            progress = self._progress.get(seq.seq_id, DraftProgress())
            start = min(progress.valid_length(token_ids), seq.num_tokens - 1)
            starts.append(start)
            token_lists.append(token_ids[start:])
        logits = self._forward([sequences[i] for i in active], token_lists, starts)
        self._choose(sequences, active, logits, drafts, probs)

    def _guess(self, sequences, active, drafts, probs, step: int) -> None:
        """Feed each active sequence its latest guess (at position ``num_tokens + step - 1``) for the next one."""
        seqs = [sequences[i] for i in active]
        logits = self._forward(seqs, [[drafts[i][-1]] for i in active], [seq.num_tokens + step - 1 for seq in seqs])
        self._choose(sequences, active, logits, drafts, probs)

    def _forward(self, seqs, token_lists: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's tokens (writing their KV); logits ``[len(seqs), vocab]`` of each
        sequence's last token, those of sequences guessed by argmax read only for it (a screened head's)."""
        metadata = AttentionMetadata.build(
            [seq.block_table for seq in seqs], starts, [len(t) for t in token_lists], self.block_size, self.device
        )
        step = self.executor.step(
            self.draft.rotary, self.attention.prepare(metadata), self.kv_cache, self.attention, self.dtype
        )
        input_ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64, device=self.device)
        hidden = self.draft(input_ids, step)
        last = (metadata.query_start_loc[1:] - 1).to(torch.int64)
        greedy = [row for row, seq in enumerate(seqs) if not self.config.sampling or seq.params.greedy]
        return self.draft.compute_logits(hidden.index_select(0, last), greedy)[:, : self.vocab_size].float()

    def _choose(self, sequences, active, logits: torch.Tensor, drafts, probs) -> None:
        """Append each active sequence's next guess: the argmax, or a sample from q for sampled requests."""
        argmax = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(active):
            seq = sequences[i]
            if not self.config.sampling or seq.params.greedy:
                drafts[i].append(argmax[row])
                continue
            position = seq.num_tokens + len(drafts[i])
            q = apply_filters(logits[row], seq.params)
            drafts[i].append(sample_row(q, seq.seed + _DRAFT_SALT, position))
            probs[i].append(q)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def rollback(self, seq, num_tokens):
        progress = self._progress.get(seq.seq_id)
        if progress is not None:
            valid = min(progress.valid_length(seq.token_ids), num_tokens)
            self._progress[seq.seq_id] = DraftProgress(valid)

    def release(self, seq):
        self._progress.pop(seq.seq_id, None)
