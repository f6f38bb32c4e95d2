"""``drafter: eagle``: a one-layer head drafts from the target's own features (EAGLE, Li et al., 2024), as a chain or
as a dynamic tree along it (EAGLE-2, Li et al., 2024).

The head reads pairs (f_t, x_{t+1}) of a target feature and the token it chose (see ``head`` beside this module).
After every target step the drafter keeps the features of the tokens the target committed (``observe``); ``propose``
then runs the head over the pairs it has not seen, whose last output guesses the next token, and feeds each guess
back with its own predicted feature for the following ones. The head's KV lives in a one-layer pool of the target's
block geometry, addressed through the sequences' own block tables.

Trees (``tree_width`` > 1, greedy requests, an attention backend that attends them): each head run along the chain
offers its ``tree_width`` likeliest guesses; the likeliest continues the chain (the tree's spine), the others are
leaves beside it, and of all of them the ``tree_budget`` with the largest path probability under the head (the
product of the guesses' probabilities from the root) are verified, EAGLE-2's reranking. The chain grows while its
next guess could enter that set. Verifying a few more rows costs a decode step little where the GEMV streams the
weights once for them (``tree_budget: auto`` measures how many), and on the shipped head's chat answers the head's
second and third guesses at the first depth were right 13% and 9% of the time, its first 39%.

Guesses never count as computed: after verification the head re-runs the accepted tokens with the target's true
features. Prefix-cache hits: the head cannot compute KV for positions the target did not compute for this sequence
(no features), so it keeps what the pool holds there: the head KV that the sequence which computed those blocks wrote
for the same tokens, or stale data when that sequence never drafted over them, which costs acceptance, never
correctness.
"""

from __future__ import annotations

import importlib.resources
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, field_validator

from infer.attention import AttentionMetadata
from infer.drafter import Drafter, DrafterConfig, DrafterContext, DraftTree, RowsCalibration
from infer.kernels.cpu import FusedDraftHead, KernelAttentionPlan, KernelAttentionStep
from infer.model.quantization import KERNEL_MODES, QUANTIZATIONS, PackedLinear
from infer.plugins.drafters.eagle.head import EagleHead, draft_head_weight, load_head, random_head

SHIPPED_HEADS = "heads"  # package data of this plugin: heads/<model name>/head.safetensors and its README card


class EagleDrafterConfig(DrafterConfig):
    name: str = "eagle"
    head: str = Field(
        "auto",
        description='Trained head: "auto" (the one shipped for the target model), a path to a '
        '.safetensors head or its folder, or "random" (untrained, for tests).',
    )
    min_confidence: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Chains: end a sequence's chain after a guess "
        "whose probability under the head is below "
        "this (0: always draft num_speculative_tokens). "
        "Doubtful guesses are mostly rejected, and "
        "each costs a draft step and a verified token.",
    )
    tree_width: int = Field(
        3,
        ge=1,
        le=8,
        description="Guesses each head run offers a greedy request: the "
        "likeliest continues the chain, the others are leaves beside "
        "it, and the tree_budget likeliest by path probability are "
        "verified (EAGLE-2's dynamic tree). 1: chains "
        "ended by min_confidence (sampled and structured-output "
        "requests always get chains, and so does every request where "
        "the attention backend does not attend draft trees).",
    )
    tree_budget: int | Literal["auto"] = Field(
        "auto",
        description="Trees: the most drafts a tree verifies (at most num_speculative_tokens). auto: the "
        "query rows the target computes for about one decode step's time on this CPU (measured "
        "once and cached: infer.execution.calibration.calibrate_rows), shared by the sequences "
        "drafting in a step, one row each for its own token: as many drafts a sequence as fit, "
        "none where none do (chains are capped alike).",
    )
    head_quantization: str = Field(
        "auto",
        description="Weight packing of the head's layer, fc and draft-vocabulary "
        'output (any model.quantization), or "target" (the target\'s '
        'packing). "auto": int8_per_row where the target\'s '
        "projections run on infer's CPU kernels (half the bytes of "
        "bf16 or fp16 a draft step streams), else the target's. The "
        "head only guesses: its precision never changes the output.",
    )

    @field_validator("head_quantization")
    @classmethod
    def _known_packing(cls, value: str) -> str:
        if value not in ("auto", "target", *QUANTIZATIONS):
            raise ValueError(
                f"unknown head_quantization {value!r}; choose auto, target or one of {', '.join(QUANTIZATIONS)}"
            )
        return value


def head_packing(choice: str, context: DrafterContext) -> str:
    """The weight packing ``head_quantization: choice`` means for a head beside ``context``'s target. A draft step
    streams the head's layer and its draft-vocabulary output from memory for a row or two, so on the CPU kernels'
    GEMV its time is their bytes: int8 with one scale per row halves bf16's (on an AMX Xeon, drafting 1.10 -> 0.90
    ms a verify pass, tokens per pass 1.53 either way)."""
    if choice == "target":
        return context.quantization
    if choice != "auto":
        return choice
    on_kernels = context.executor.kernels is not None and context.quantization in KERNEL_MODES
    return "int8_per_row" if on_kernels else context.quantization


def shipped_head_path(model_name: str) -> Path:
    """Where this plugin ships the trained head for ``model_name`` (which may not exist)."""
    package = importlib.resources.files("infer.plugins.drafters.eagle")
    return Path(str(package / SHIPPED_HEADS / model_name / "head.safetensors"))


@dataclass(slots=True)
class FeatureLog:
    """One sequence: the head's KV covers pair positions ``[0, num_computed)``; ``features`` hold the target's
    features for positions ``num_computed`` onwards, in order."""

    num_computed: int
    features: list[torch.Tensor] = field(default_factory=list)
    num_features: int = 0

    @property
    def end(self) -> int:
        return self.num_computed + self.num_features

    def append(self, first_position: int, rows: torch.Tensor) -> None:
        if first_position != self.end:
            # Not where the last features ended (the target restarted this sequence): start over from here.
            self.num_computed, self.features, self.num_features = first_position, [], 0
        self.features.append(rows)
        self.num_features += rows.shape[0]

    def take(self, end: int) -> torch.Tensor:
        """Features of positions ``[num_computed, end)``; afterwards the log starts at ``end - 1``, whose pair the
        next ``propose`` re-runs (its output gives the first guess even when nothing new was committed)."""
        stacked = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        used = stacked[: end - self.num_computed]
        self.features = [stacked[end - 1 - self.num_computed :]]
        self.num_features = self.features[0].shape[0]
        self.num_computed = end - 1
        return used


@dataclass(slots=True)
class TreeGrowth:
    """One sequence's dynamic draft tree while its chain grows: every guess so far as (path probability, depth, rank
    among its run's guesses, token); rank 0 continues the chain (the spine). ``budget``: drafts verified."""

    budget: int
    spine_probability: float = 1.0
    guesses: list[tuple[float, int, int, int]] = field(default_factory=list)

    def add(self, tokens: list[int], probabilities: list[float]) -> bool:
        """One head run's guesses after the spine's end, likeliest first; whether the chain should grow past its new
        end: whether the next run's likeliest guess would be among the ``budget`` likeliest, were the head as sure of
        it as of this run's (on the shipped head's chat answers this ran 1.73 head runs a pass at a budget of 3,
        where growing while any guess after the end could still enter ran 2.42, for the same tokens a pass)."""
        depth = 1 + sum(rank == 0 for _, _, rank, _ in self.guesses)
        for rank, (token, probability) in enumerate(zip(tokens, probabilities)):
            self.guesses.append((self.spine_probability * probability, depth, rank, token))
        self.spine_probability *= probabilities[0]
        chosen = self._chosen()
        return len(chosen) < self.budget or self.spine_probability * probabilities[0] > chosen[-1][0]

    def _chosen(self) -> list[tuple[float, int, int, int]]:
        # the likeliest first; of equal ones the shallower, and the spine's: a guess never outranks its parent
        return sorted(self.guesses, key=lambda guess: (-guess[0], guess[1], guess[2]))[: self.budget]

    def tree(self) -> DraftTree:
        """The ``budget`` likeliest guesses as a ``DraftTree``: the chosen spine, then each leaf beside the spine's
        guess at its depth."""
        chosen = self._chosen()
        spine = sorted((depth, token) for _, depth, rank, token in chosen if rank == 0)
        leaves = sorted((depth, rank, token) for _, depth, rank, token in chosen if rank > 0)
        return DraftTree(
            [token for _, token in spine] + [token for _, _, token in leaves],
            [index - 1 for index in range(len(spine))] + [depth - 2 for depth, _, _ in leaves],
        )


class EagleDrafter(Drafter):
    """Chain or tree drafting with an EAGLE head over the target's features."""

    config_model = EagleDrafterConfig
    needs_target = True
    needs_hidden_states = True

    def __init__(self, config: EagleDrafterConfig | None = None, context: DrafterContext | None = None):
        super().__init__(config, context)
        self.target = context.target
        self.attention = context.attention  # the head's layer has the target's layer shapes
        self.device = context.device
        self.dtype = context.dtype
        self.block_size = context.block_size
        self.executor = context.executor  # the head runs on the target's kernels and paths
        self.head_quantization = head_packing(self.config.head_quantization, context)
        self.head = context.quantize(self._load_head(context), self.head_quantization)
        self.draft_logits = context.projection(
            draft_head_weight(self.target, self.head.vocab_ids), self.head_quantization
        )
        for module in (self.head.layer, self.head.fc, self.draft_logits):  # one row per chain step: the GEMV
            self.executor.prepare(module)
        self._vocab_ids = self.head.vocab_ids.tolist()  # a draft-vocabulary index -> its target token id
        self._fused_head = self._build_fused_head()
        self._fused_head_accepted: bool | None = None  # the executor's verdict on the head's layer (asked once)
        # drafts a lone sequence's tree holds (None: chains only), and the measurement behind an auto budget
        self.rows: RowsCalibration | None = None
        self.tree_budget = self._tree_budget(context)
        self.kv_cache: torch.Tensor | None = None
        self._logs: dict[str, FeatureLog] = {}

    def _tree_budget(self, context: DrafterContext) -> int | None:
        """``tree_budget`` resolved for one sequence drafting alone: None where trees are off (``tree_width`` 1, or
        a backend that does not attend them), else the drafts its tree holds."""
        config = self.config
        if config.tree_width <= 1 or not self.attention.draft_trees:
            return None
        if config.tree_budget != "auto":
            return min(config.tree_budget, config.num_speculative_tokens)
        self.rows = context.free_verify_rows()
        return self.drafts_each(1, config.num_speculative_tokens)

    def drafts_each(self, sequences: int, k: int) -> int:
        """The most drafts each of ``sequences`` sequences drafting in one step gets: with ``tree_budget: auto``, the
        measured free rows shared among them less one row each for its own token (0: drafting does not pay at this
        batch), at least one for a sequence alone (its first draft is right about 40% of the time, worth more than a
        second row costs), else ``k``; a fixed ``tree_budget`` caps a tree. On a Zen 4 EPYC with 4 free rows, trees
        of 3 drafts ran 0.98x no drafter at 2 sequences, 0.76x at 4, 0.74x at 8 (chains 1.21x, 0.88x, 0.91x)."""
        if self.rows is None:
            return k if self.tree_budget is None else min(k, self.tree_budget)
        return min(k, max(int(sequences == 1), self.rows.free_rows // sequences - 1))

    def describe(self) -> str:
        if self.tree_budget is None:
            return f"eagle chains of up to {self.config.num_speculative_tokens} drafts"
        measured = (
            "" if self.rows is None else (f" (measured rows shared by the sequences drafting): {self.rows.describe()}")
        )
        return f"eagle trees of up to {self.tree_budget} drafts, {self.config.tree_width} guesses a run{measured}"

    def _load_head(self, context: DrafterContext) -> EagleHead:
        choice = self.config.head
        config = self.target.config
        if choice == "random":
            return random_head(config, self.target, self.dtype, self.device, context.seed)
        path = shipped_head_path(context.model_name) if choice == "auto" else Path(choice)
        if path.is_dir():
            path = path / "head.safetensors"
        if not path.is_file():
            hint = (
                f"no EAGLE head is shipped for model {context.model_name!r}"
                if choice == "auto"
                else f"drafter.head: no file at {path}"
            )
            raise FileNotFoundError(
                f"{hint}; train one with `infer train-eagle CONFIG --out DIR` and set drafter.head=DIR"
            )
        return load_head(path, config, self.dtype, self.device)

    # -- the head's pool -----------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return self.attention.kv_bytes_per_token(1)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.attention.allocate_kv_cache(1, num_blocks)

    # -- features ------------------------------------------------------------------------------------------------
    def observe(self, output):
        if output.hidden_states is None:
            return
        for row in output.token_rows:
            seq = row.seq
            # Rows past num_computed_tokens scored rejected drafts; a finished sequence was already released.
            count = min(row.count, seq.num_computed_tokens - row.first_position)
            if seq.is_finished or count <= 0:
                continue
            rows = output.hidden_states[row.start : row.start + count].clone()
            log = self._logs.get(seq.seq_id)
            if log is None:
                self._logs[seq.seq_id] = log = FeatureLog(row.first_position)
            log.append(row.first_position, rows)

    # -- drafting ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sequences, k):
        chains: list[list[int]] = [[] for _ in sequences]
        each = self.drafts_each(len(sequences), k)
        trees = [TreeGrowth(each) if each and self._grows_tree(seq) else None for seq in sequences]
        width = self.config.tree_width if any(trees) else 1
        limits = [min(each, self._max_drafts(seq, k)) for seq in sequences]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        features = None
        for step in range(k):
            if not active:
                break
            if step == 0:
                features, guesses, probabilities = self._first_pass(sequences, active, width)
            else:
                features, guesses, probabilities = self._chain_step(sequences, active, features, chains, step, width)
            keep = []
            for j, i in enumerate(active):
                chains[i].append(guesses[j][0])
                if trees[i] is not None:
                    grows = trees[i].add(guesses[j], probabilities[j])
                else:  # a doubtful guess ends its chain
                    grows = self.config.min_confidence <= 0.0 or probabilities[j][0] >= self.config.min_confidence
                if grows and len(chains[i]) < limits[i]:
                    keep.append(j)
            active, features = [active[j] for j in keep], features[keep]
        return [chain if tree is None or not chain else tree.tree() for chain, tree in zip(chains, trees)]

    def _grows_tree(self, seq) -> bool:
        """Whether ``seq`` gets a tree: ``tree_width`` > 1, a greedy request without a grammar (the engine verifies
        only their trees), and an attention backend that attends draft trees."""
        return self.tree_budget is not None and seq.params.greedy and seq.matcher is None

    def _max_drafts(self, seq, k: int) -> int:
        """Drafts this sequence can get: the head needs the features of every pair up to its last committed token,
        and a slot for each pair it runs (guess j runs at position num_tokens + j - 3)."""
        log = self._logs.get(seq.seq_id)
        last_pair = seq.num_tokens - 2
        if log is None or last_pair < log.num_computed or log.end <= last_pair:
            return 0
        capacity = len(seq.block_table) * self.block_size
        return max(0, min(k, capacity - last_pair))

    def _first_pass(self, sequences, active, width: int) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
        """The pairs each sequence has not run yet (at least its last one); returns what ``_run`` does."""
        starts, tokens, features = [], [], []
        for i in active:
            seq = sequences[i]
            log = self._logs[seq.seq_id]
            start, last_pair = log.num_computed, seq.num_tokens - 2
            starts.append(start)
            tokens.append(seq.token_ids[start + 1 : last_pair + 2])
            features.append(log.take(last_pair + 1))
        return self._run(sequences, active, starts, tokens, torch.cat(features), width)

    def _chain_step(
        self, sequences, active, features: torch.Tensor, chains, step: int, width: int
    ) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
        """Feed each active sequence the latest guess of its chain with the feature predicted for it."""
        starts = [sequences[i].num_tokens - 2 + step for i in active]
        return self._run(sequences, active, starts, [[chains[i][-1]] for i in active], features, width)

    def _run(
        self, sequences, active, starts, tokens, features, width: int
    ) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
        """Run the head; for each active sequence, the feature it predicts for its guess (``[len(active), hidden]``)
        and its ``width`` likeliest guesses (target token ids, likeliest first) with their probabilities under the
        head."""
        seqs = [sequences[i] for i in active]
        lengths = [len(t) for t in tokens]
        metadata = AttentionMetadata.build(
            [seq.block_table for seq in seqs], starts, lengths, self.block_size, self.device
        )
        input_ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int64, device=self.device)
        embeds = self.target.embed(input_ids)
        last_rows = list(itertools.accumulate(lengths, initial=-1))[1:]  # each sequence's last pair
        run = self._run_fused if self._takes_fused_head(metadata, embeds.dtype) else self._run_layers
        last, choices, probabilities = run(metadata, embeds, features, last_rows, width)
        vocab_ids = self._vocab_ids
        return last, [[vocab_ids[index] for index in row] for row in choices.tolist()], probabilities.tolist()

    def _run_fused(
        self, metadata, embeds, features, last_rows, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head as one C call: the last rows' predicted features, their ``width`` likeliest guesses
        (draft-vocabulary indices, ``[rows, width]``) and the head's probability of each."""
        self.executor.count_fused()
        rotary = self.target.rotary
        plan = KernelAttentionStep(
            KernelAttentionPlan.every_token(metadata),
            metadata.block_tables,
            metadata.slot_mapping,
            self.attention.num_heads,
            self.attention.scale,
        )
        return self._fused_head.run(
            embeds, features, metadata.positions, rotary.cos, rotary.sin, self.kv_cache, plan, last_rows, width
        )

    def _run_layers(
        self, metadata, embeds, features, last_rows, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_run_fused``'s results through the executor's path for the head's layer and the modules around it."""
        step = self.executor.step(
            self.target.rotary, self.attention.prepare(metadata), self.kv_cache, self.attention, embeds.dtype
        )
        predicted = self.head(embeds, features, step)
        last = predicted.index_select(0, torch.tensor(last_rows, dtype=torch.int64, device=self.device))
        probabilities, choices = torch.softmax(self.draft_logits(last).float(), dim=-1).topk(width, dim=-1)
        return last, choices, probabilities

    def _build_fused_head(self) -> FusedDraftHead | None:
        """The head as one C call (``FusedDraftHead``) where its layer and projections run on the CPU kernels'
        GEMV, else None (torch, or the path the executor picks for the layer)."""
        head, out = self.head, self.draft_logits
        norms = (head.embed_norm, head.feature_norm, head.norm)
        kernel_projections = all(  # the C head reads pack_weights' layout (bf16 on tiles holds only theirs)
            isinstance(module, PackedLinear) and module.kernel_weight is not None for module in (head.fc, out)
        )
        if (
            self.executor.kernels is None
            or head.layer.fused is None
            or not kernel_projections
            or len({norm.eps for norm in norms}) > 1
            or any(norm.weight.dtype != torch.float32 for norm in norms)
        ):
            return None
        return FusedDraftHead(
            self.executor.kernels,
            head.layer.fused,
            tuple(norm.weight.detach() for norm in norms),
            head.norm.eps,
            (head.fc.kernel_weight, head.fc.kernel_scales, head.fc.bias),
            (out.kernel_weight, out.kernel_scales),
        )

    def _takes_fused_head(self, metadata: AttentionMetadata, dtype: torch.dtype) -> bool:
        """Whether this head run takes ``FusedDraftHead``: the projections take the GEMV for its rows (the fused head
        never takes the tiles' GEMM), and the executor would run the layer in one C call. What the executor decides
        beside the step's size (kernels, dtype, backend, packing) is fixed for the drafter's life: asked once."""
        if self._fused_head is None:
            return False
        fc, out, kernels = self.head.fc, self.draft_logits, self.executor.kernels

        def limit(module) -> int:
            return module.gemv_rows if module.tile_weight is None else min(module.gemv_rows, kernels.pass_rows)

        if metadata.num_tokens > min(limit(fc), self.executor.fused_max_tokens) or metadata.num_seqs > limit(out):
            return False
        if self._fused_head_accepted is None:
            step = self.executor.step(
                self.target.rotary, self.attention.prepare(metadata), self.kv_cache, self.attention, dtype
            )
            self._fused_head_accepted = self.executor.fuses([self.head.layer], step)
        return self._fused_head_accepted

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def release(self, seq):
        self._logs.pop(seq.seq_id, None)
