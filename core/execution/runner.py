"""The model runner: turns a step plan into flattened batch metadata and one ``ForwardStep``, runs the model through
the execution layer (``infer.execution.paths``), returns the logits rows needed."""

from __future__ import annotations

import torch

from infer.attention import AttentionBackend, AttentionMetadata
from infer.distributed import SingleProcess
from infer.drafter import tree_depths
from infer.execution.paths import Executor
from infer.host import HEAP_MMAP_THRESHOLD
from infer.outputs import BatchRows, StepOutput
from infer.sequence import Sequence

# Steps of at most this many logits rows write them to the runner's buffer (``ModelRunner.logits_buffer``): a decode
# step's batch; a prompt scored for prompt_logprobs (a row a token) allocates its own.
LOGITS_BUFFER_ROWS = 256


def step_tokens(seq: Sequence, num_new_tokens: int) -> list[int]:
    """The tokens computed this step: uncomputed committed tokens first, then drafts."""
    start = seq.num_computed_tokens
    end = start + num_new_tokens
    committed = seq.num_tokens
    if end <= committed:
        if num_new_tokens <= 4:
            return [seq.token_at(p) for p in range(start, end)]
        return seq.token_ids[start:end]
    tokens = [seq.token_at(p) for p in range(start, committed)]
    return tokens + seq.draft_token_ids[: end - committed]


class BlockTableError(RuntimeError):
    """A block table holds a block id outside the KV pool: a plugin that hands out blocks has a bug. Raised before
    the step runs, since infer's C kernels would read or write outside the pool (torch's ops raise IndexError)."""


class ModelRunner:
    """Owns the KV pool tensor and runs one forward pass per step, on the path ``executor`` chooses.

    ``num_blocks``: the pool's blocks; every step's block tables are checked against it (two reductions over the
    tables, a few microseconds) and a bad id is refused with ``BlockTableError`` naming ``block_sources``, the
    plugins that hand blocks out."""

    def __init__(
        self,
        model,
        attention: AttentionBackend,
        kv_cache: torch.Tensor,
        device: torch.device,
        executor: Executor | None = None,
        num_blocks: int | None = None,
        block_sources: str = "the allocator or the prefix cache",
        ranks=None,
    ):
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.device = device
        self.executor = executor or Executor()
        self.block_size = attention.block_size
        self.num_blocks = num_blocks
        self.block_sources = block_sources
        # The engine's ranks (``infer.distributed.SingleProcess``, or rank 0's ``TensorParallel`` of a sharded model):
        # each step's plan goes to the other ranks first, which run the same forward pass.
        self.ranks = ranks if ranks is not None else SingleProcess()
        # The large steps' logits buffer (``logits_buffer``).
        self.logits_held: torch.Tensor | None = None

    def build_metadata(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        for seq, num_new in scheduled:
            input_ids.extend(step_tokens(seq, num_new))
        trees = [
            tree_depths(seq.draft_parents[: num_new - 1]) if seq.draft_parents and num_new > 1 else None
            for seq, num_new in scheduled
        ]
        metadata = AttentionMetadata.build(
            [seq.block_table for seq, _ in scheduled],
            [seq.num_computed_tokens for seq, _ in scheduled],
            [num_new for _, num_new in scheduled],
            self.block_size,
            self.device,
            trees if any(trees) else None,
        )
        if self.num_blocks is not None:
            self.check_block_tables(scheduled, metadata.block_tables)
        return torch.tensor(input_ids, dtype=torch.int64, device=self.device), metadata

    def check_block_tables(self, scheduled: list[tuple[Sequence, int]], tables: torch.Tensor) -> None:
        """Raise ``BlockTableError`` when a table holds an id outside ``[0, num_blocks)`` (0 is the null block,
        the tables' padding)."""
        if tables.numel() == 0 or (int(tables.max()) < self.num_blocks and int(tables.min()) >= 0):
            return
        seq = next(seq for seq, _ in scheduled if any(not 0 <= block < self.num_blocks for block in seq.block_table))
        bad = next(block for block in seq.block_table if not 0 <= block < self.num_blocks)
        raise BlockTableError(
            f"sequence {seq.seq_id}: its block table holds block {bad}, outside the KV pool's "
            f"{self.num_blocks} blocks (ids 0..{self.num_blocks - 1}); {self.block_sources} handed "
            f"it out: a bug in that plugin (its conformance suite, infer.testing, may show it)"
        )

    def move_kv(self, seq: Sequence, source: int, target: int) -> None:
        """Copy the K/V of ``seq``'s token index ``source`` over those of ``target`` in every layer of the pool (a
        draft tree's accepted leaf, written past the spine, to its position)."""
        size, table = self.block_size, seq.block_table
        slots = self.kv_cache.flatten(2, 3)  # [layers, 2, slots, kv_heads, head_dim]
        slots[:, :, table[target // size] * size + target % size] = slots[
            :, :, table[source // size] * size + source % size
        ]

    @staticmethod
    def logits_rows(scheduled: list[tuple[Sequence, int]]) -> tuple[list[int], list[BatchRows]]:
        """Flat token indices whose logits are needed: every token at or past the sequence's last committed one."""
        indices: list[int] = []
        rows: list[BatchRows] = []
        offset = 0
        for seq, num_new in scheduled:
            end = seq.num_computed_tokens + num_new
            first = max(seq.num_computed_tokens, seq.num_tokens - 1)
            if end >= seq.num_tokens:
                rows.append(BatchRows(seq, len(indices), end - first, first + 1))
                indices.extend(range(offset + first - seq.num_computed_tokens, offset + num_new))
            offset += num_new
        return indices, rows

    @staticmethod
    def prompt_logits_rows(scheduled: list[tuple[Sequence, int]]) -> tuple[list[int], list[BatchRows]]:
        """Flat token indices of the prompt positions whose logits score the next prompt token, for sequences that
        still owe prompt logprobs (``Sequence.needs_prompt_logits``); each row at position q predicts token q + 1."""
        indices: list[int] = []
        rows: list[BatchRows] = []
        offset = 0
        for seq, num_new in scheduled:
            if seq.needs_prompt_logits:
                first = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
                end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens - 1)
                if end > first:
                    rows.append(BatchRows(seq, len(indices), end - first, first + 1))
                    start = offset - seq.num_computed_tokens
                    indices.extend(range(start + first, start + end))
            offset += num_new
        return indices, rows

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], want_hidden: bool = False) -> StepOutput:
        input_ids, metadata = self.build_metadata(scheduled)
        indices, rows = self.logits_rows(scheduled)
        prompt_indices, prompt_rows = self.prompt_logits_rows(scheduled)
        self.ranks.send_step(scheduled, input_ids, indices + prompt_indices)
        try:
            screened = getattr(self.model, "head_screen", None) is not None
            argmax_rows = self.argmax_rows(rows) if screened else None
            hidden, logits = self.forward(input_ids, metadata, indices + prompt_indices, argmax_rows)
        except RuntimeError as error:  # sharded: a collective failed, a rank is gone
            if not self.ranks.sharded:
                raise
            raise self.ranks.failure(error) from error
        logits = logits.float()
        prompt_logits = None
        if prompt_rows:
            logits, prompt_logits = logits[: len(indices)], logits[len(indices) :]
        output = StepOutput(logits=logits, rows=rows, prompt_logits=prompt_logits, prompt_rows=prompt_rows)
        if want_hidden:
            output.hidden_states, output.token_rows = hidden, self.token_rows(scheduled)
        return output

    @staticmethod
    def argmax_rows(rows: list[BatchRows]) -> list[int]:
        """The logits rows whose token is their first maximum and nothing else is read from them: greedy requests
        with no logprobs, logit bias or grammar, past their ``min_tokens`` (whose rows ban tokens). The model may
        give these rows from its head screen (``CausalLM.compute_logits``)."""
        chosen: list[int] = []
        for row in rows:
            seq, params = row.seq, row.seq.params
            if (
                params.greedy
                and params.logprobs is None
                and not params.logit_bias
                and seq.matcher is None
                and row.first_position - seq.num_prompt_tokens >= params.min_tokens
            ):
                chosen.extend(range(row.start, row.start + row.count))
        return chosen

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        indices: list[int],
        argmax_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over one step's tokens: the final hidden states ``[T, hidden]`` and the logits of the tokens at
        ``indices`` (None on a tensor-parallel rank other than 0); ``argmax_rows`` (positions in ``indices``) are
        read only for their first maximum (``argmax_rows``)."""
        step = self.executor.step(
            self.model.rotary,
            self.attention.prepare(metadata),
            self.kv_cache,
            self.attention,
            self.model.activation_dtype,
        )
        hidden = self.model(input_ids, step)
        index = torch.tensor(indices, dtype=torch.int64, device=hidden.device)
        into = self.logits_buffer(len(indices)) if hidden.device.type == "cpu" and not self.ranks.sharded else None
        return hidden, self.model.compute_logits(hidden.index_select(0, index), argmax_rows, into)

    def logits_buffer(self, rows: int) -> torch.Tensor | None:
        """A float32 buffer ``[rows, vocab]`` for the step's logits where they are larger than what malloc keeps for
        reuse (``infer.host.HEAP_MMAP_THRESHOLD``) and at most ``LOGITS_BUFFER_ROWS`` rows: one buffer, grown to the
        largest such step and written again every step (the logits of a step are read before the next one runs),
        where a fresh tensor of that size is mapped and faulted in page by page at every step: 64 rows of
        Qwen3's 151,936-token vocabulary, 39 MB, took 8.9 ms to allocate and fill fresh against 1.0 ms in place on
        a model-167 Xeon. Else None (the head allocates)."""
        vocab = self.model.vocab_size
        if rows > LOGITS_BUFFER_ROWS or rows * vocab * 4 < HEAP_MMAP_THRESHOLD:
            return None
        if self.logits_held is None or self.logits_held.shape[0] < rows:
            self.logits_held = torch.empty((rows, vocab), dtype=torch.float32)
        return self.logits_held[:rows]

    @staticmethod
    def token_rows(scheduled: list[tuple[Sequence, int]]) -> list[BatchRows]:
        """Each scheduled sequence's span of the step's flattened tokens (taken before the engine advances
        ``num_computed_tokens``)."""
        rows: list[BatchRows] = []
        offset = 0
        for seq, num_new in scheduled:
            rows.append(BatchRows(seq, offset, num_new, seq.num_computed_tokens))
            offset += num_new
        return rows
