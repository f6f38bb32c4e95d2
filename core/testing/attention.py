"""Conformance suite for attention backends (contract: ``infer.attention.AttentionBackend``).

Every check compares the backend with a naive softmax oracle (float64, one sequence at a time, no paging) on random
ragged batches: decodes, prefills and prefill chunks after a cached prefix, grouped-query heads, block tables that
are shuffled physical blocks, and a pool filled with garbage so that reading the wrong slot shows. A backend that
cannot run here (``BackendUnavailableError``: no GPU, unsupported block size) is skipped with its own message.

Layer features a backend declares (``AttentionBackend.layer_features``) are checked too: a backend with "sinks"
against the oracle with each head's sink logit as one more softmax column (with a sliding window as well where it
declares "window"); the checks of a feature a backend does not declare are skipped.

A plugin author's whole test file::

    from infer.testing import AttentionConformance

    class TestMyKernels(AttentionConformance):
        impl_name = "mine"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from infer.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    BackendUnavailableError,
    LayerAttention,
    write_kv,
)
from infer.testing.suite import ConformanceSuite

AttentionFactory = Callable[..., AttentionBackend]
Shape = tuple[int, int]  # (cached tokens, query tokens) of one sequence


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: one sequence's ``query`` [L, heads, D] at its last L positions, over ``keys``/``values``
    [S, kv_heads, D], bottom-right causal, in float64. ``window``: position ``p`` sees only ``p - window + 1 .. p``.
    ``sinks`` [heads]: each head's sink logit is one more column of the softmax, with no value (dropped after it)."""
    query_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    keys = keys.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, heads, D]
    values = values.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("lhd,shd->hls", query.double(), keys) * scale  # [heads, L, S]
    query_positions = torch.arange(context_len - query_len, context_len, device=query.device)[:, None]
    key_positions = torch.arange(context_len, device=query.device)[None, :]
    visible = key_positions <= query_positions  # [L, S]
    if window is not None:
        visible &= key_positions > query_positions - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().to(query.device).view(num_heads, 1, 1).expand(-1, query_len, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    weights = scores.softmax(dim=-1)[..., :context_len]
    return torch.einsum("hls,shd->lhd", weights, values)


def build_metadata(
    block_tables: list[list[int]], shapes: list[Shape], block_size: int, device: torch.device
) -> AttentionMetadata:
    """The batch metadata the engine's runner would build for sequences with these cached and query lengths."""
    return AttentionMetadata.build(
        block_tables, [cached for cached, _ in shapes], [new for _, new in shapes], block_size, device
    )


@dataclass
class PagedContext:
    """Sequences with their whole K/V (cached and new positions) and shuffled block tables into one garbage pool."""

    backend: AttentionBackend
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, D]
    block_tables: list[list[int]]
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, D]
    values: list[torch.Tensor]
    generator: torch.Generator

    @classmethod
    def create(cls, backend: AttentionBackend, seq_lens: list[int], seed: int) -> PagedContext:
        generator = torch.Generator().manual_seed(seed)
        tables_len = [-(-seq_len // backend.block_size) for seq_len in seq_lens]
        num_blocks = 1 + sum(tables_len) + 3  # spare blocks, so tables are not simply the whole pool
        shape = backend.kv_cache_shape(1, num_blocks)[1:]
        kv_cache = random_tensor(shape, generator, backend).mul_(4.0)  # garbage, the null block included
        physical = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        tables, start = [], 0
        for length in tables_len:
            tables.append(physical[start : start + length])
            start += length
        kv_shape = (backend.num_kv_heads, backend.head_dim)
        keys = [random_tensor((seq_len, *kv_shape), generator, backend) for seq_len in seq_lens]
        values = [random_tensor((seq_len, *kv_shape), generator, backend) for seq_len in seq_lens]
        return cls(backend, kv_cache, tables, keys, values, generator)

    @classmethod
    def create_shared(cls, backend: AttentionBackend, groups: list[tuple[int, list[int]]], seed: int) -> PagedContext:
        """Like ``create``, but each group ``(shared_len, seq_lens)`` holds sequences whose first ``shared_len``
        positions (whole blocks) are the same physical blocks with the same K/V, as the prefix cache shares them."""
        seq_lens = [seq_len for _, lens in groups for seq_len in lens]
        context = cls.create(backend, seq_lens, seed)
        first = 0  # each group's first sequence lends its blocks and K/V to the others
        for shared_len, lens in groups:
            assert shared_len % backend.block_size == 0, "a shared prefix is whole blocks"
            shared_blocks = shared_len // backend.block_size
            for row in range(first + 1, first + len(lens)):
                context.block_tables[row][:shared_blocks] = context.block_tables[first][:shared_blocks]
                context.keys[row][:shared_len] = context.keys[first][:shared_len]
                context.values[row][:shared_len] = context.values[first][:shared_len]
            first += len(lens)
        return context

    def write_prefix(self, cached_lens: list[int]) -> None:
        """Store the first ``cached_lens[i]`` positions of each sequence with the reference ``write_kv``."""
        metadata = build_metadata(
            self.block_tables, [(0, cached) for cached in cached_lens], self.backend.block_size, self.backend.device
        )
        write_kv(self.kv_cache, *self.new_kv([(0, cached) for cached in cached_lens]), metadata.slot_mapping)

    def new_kv(self, shapes: list[Shape]) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K and V [T, kv_heads, D]: positions ``cached .. cached + query_len`` of each sequence."""
        keys = torch.cat([k[cached : cached + query_len] for k, (cached, query_len) in zip(self.keys, shapes)])
        values = torch.cat([v[cached : cached + query_len] for v, (cached, query_len) in zip(self.values, shapes)])
        return keys, values

    def forward(self, shapes: list[Shape], query: torch.Tensor) -> torch.Tensor:
        """One step through the backend: ``query`` [T, heads, D] for the given (cached, query length) shapes."""
        metadata = self.backend.prepare(
            build_metadata(self.block_tables, shapes, self.backend.block_size, self.backend.device)
        )
        keys, values = self.new_kv(shapes)
        return self.backend.forward(0, query, keys, values, self.kv_cache, metadata)

    def random_query(self, shapes: list[Shape]) -> torch.Tensor:
        num_tokens = sum(query_len for _, query_len in shapes)
        return random_tensor((num_tokens, self.backend.num_heads, self.backend.head_dim), self.generator, self.backend)

    def expected(
        self,
        shapes: list[Shape],
        query: torch.Tensor,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The oracle's output for ``query``, sequence by sequence, for a layer declared as ``layer`` with the sink
        logits ``sinks`` (what the test gave ``set_layers``, never what the backend makes of it)."""
        window, sinks = layer.window, sinks if layer.sinks else None
        scale = self.backend.head_dim**-0.5 if layer.scale is None else layer.scale
        outputs, start = [], 0
        for keys, values, (cached, query_len) in zip(self.keys, self.values, shapes):
            end = cached + query_len
            outputs.append(
                reference_attention(query[start : start + query_len], keys[:end], values[:end], scale, window, sinks)
            )
            start += query_len
        return torch.cat(outputs)


def random_tensor(shape: tuple[int, ...], generator: torch.Generator, backend: AttentionBackend) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=backend.device, dtype=backend.dtype)


def random_shapes(seed: int, max_cached: int = 40, max_query: int = 24) -> list[Shape]:
    """A ragged mix: some decodes, some prefills from scratch, some prefill chunks after a cached prefix."""
    generator = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 6, (), generator=generator))
    shapes = []
    for _ in range(num_seqs):
        kind = int(torch.randint(3, (), generator=generator))
        cached = 0 if kind == 1 else int(torch.randint(1, max_cached + 1, (), generator=generator))
        query_len = 1 if kind == 0 else int(torch.randint(1, max_query + 1, (), generator=generator))
        shapes.append((cached, query_len))
    return shapes


# (KV heads, query heads per KV head, head dim).
HEAD_LAYOUTS = [(1, 8, 16), (4, 2, 16), (3, 1, 64), (1, 4, 128), (2, 2, 80)]

BATCHES = {
    "decode_only": [(5, 1), (17, 1), (1, 1), (33, 1)],
    "prefill_only": [(0, 7), (0, 1), (0, 20)],
    "mixed_a": random_shapes(1),
    "mixed_b": random_shapes(2),
    "mixed_c": random_shapes(3),
}


# Two groups on shared system-prompt blocks (long enough for a backend to attend them once for the whole group)
# decoding and verifying at different lengths, an unshared decode, and a prefill chunk reading shared blocks too.
SHARED_GROUPS = [(160, [171, 165, 190, 161, 200]), (144, [150, 149]), (0, [40])]
SHARED_QUERY_LENS = [1, 1, 4, 1, 25, 1, 3, 1]


def shared_prefix_step(groups: list[tuple[int, list[int]]], query_lens: list[int]) -> list[Shape]:
    """(cached, query length) of each sequence of ``PagedContext.create_shared(groups)`` at its last positions."""
    seq_lens = [seq_len for _, lens in groups for seq_len in lens]
    return [(seq_len - query_len, query_len) for seq_len, query_len in zip(seq_lens, query_lens)]


class AttentionConformance(ConformanceSuite):
    """Agreement with the naive oracle on ragged, paged, GQA batches.

    ``tolerances`` gives (atol, rtol) per dtype; ``head_dim``, ``num_kv_heads`` keep shapes small enough for Triton's
    CPU interpreter. ``device`` None means CUDA when available, else CPU.
    """

    kind = "attention"
    device: ClassVar[str | None] = None
    head_dim: ClassVar[int] = 16
    num_kv_heads: ClassVar[int] = 2
    tolerances: ClassVar[dict[torch.dtype, tuple[float, float]]] = {
        torch.float32: (1e-5, 1e-4),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (2e-2, 2e-2),
    }

    @pytest.fixture
    def attention_factory(self) -> AttentionFactory:
        """Makes a backend: ``factory(block_size=, queries_per_kv_head=, dtype=, num_kv_heads=, head_dim=)`` (the
        last two default to the class attributes). Override to construct yours."""
        return self.make_attention_factory(self.impl_name)

    def make_attention_factory(self, name: str | None) -> AttentionFactory:
        implementation = self.load_implementation(name)
        config = self.implementation_config(name)

        def make(
            block_size: int = 8,
            queries_per_kv_head: int = 1,
            dtype: torch.dtype = torch.float32,
            num_kv_heads: int | None = None,
            head_dim: int | None = None,
        ):
            num_kv_heads = num_kv_heads or self.num_kv_heads
            try:
                return implementation(
                    num_heads=num_kv_heads * queries_per_kv_head,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim or self.head_dim,
                    block_size=block_size,
                    dtype=dtype,
                    device=self.target_device(),
                    config=config,
                )
            except BackendUnavailableError as error:
                pytest.skip(f"{name}: {error}")

        return make

    def target_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = self.tolerances[actual.dtype]
        torch.testing.assert_close(actual.double(), expected.to(actual.device), atol=atol, rtol=rtol)

    @pytest.mark.parametrize("batch", sorted(BATCHES))
    @pytest.mark.parametrize("queries_per_kv_head", [1, 3])
    @pytest.mark.parametrize("block_size", [1, 8, 16, 32])
    def test_matches_the_oracle_on_ragged_paged_batches(
        self, attention_factory, block_size, queries_per_kv_head, batch
    ):
        backend = attention_factory(block_size=block_size, queries_per_kv_head=queries_per_kv_head)
        self.check_against_oracle(backend, BATCHES[batch], seed=block_size * 10 + queries_per_kv_head)

    @pytest.mark.parametrize("block_size", [1, 16])
    def test_queries_longer_than_any_tiling_match_the_oracle(self, attention_factory, block_size):
        """Prefill chunks past the tiles the built-ins use (sdpa's 64-row causal tiles, Triton's blocks), fresh and
        after a cached prefix, beside decodes, with GQA."""
        backend = attention_factory(block_size=block_size, queries_per_kv_head=3)
        self.check_against_oracle(backend, [(0, 150), (37, 1), (70, 131), (5, 2)], seed=block_size + 101)

    @pytest.mark.parametrize(
        "num_kv_heads, queries_per_kv_head, head_dim",
        HEAD_LAYOUTS,
        ids=[f"kv{kv}x{q}-d{d}" for kv, q, d in HEAD_LAYOUTS],
    )
    def test_head_layouts_match_the_oracle(self, attention_factory, num_kv_heads, queries_per_kv_head, head_dim):
        """Multi-query (one KV head for 8 query heads), grouped with more KV heads, plain multi-head, and head
        dimensions of real models (64, SmolLM2's and Llama's; 128, Llama-3's; 80, not a power of two)."""
        backend = attention_factory(
            block_size=16, queries_per_kv_head=queries_per_kv_head, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        self.check_against_oracle(backend, [(0, 9), (21, 1), (40, 5), (3, 1)], seed=num_kv_heads * 7 + head_dim)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_matches_the_oracle_in_half_precision(self, attention_factory, dtype):
        backend = attention_factory(block_size=16, queries_per_kv_head=3, dtype=dtype)
        self.check_against_oracle(backend, BATCHES["mixed_a"], seed=5)

    def check_against_oracle(
        self,
        backend: AttentionBackend,
        shapes: list[Shape],
        seed: int,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """One step of ``shapes`` through the backend against the oracle of ``layer`` (as the backend's layer 0
        was declared, with ``sinks``)."""
        context = PagedContext.create(backend, [cached + query_len for cached, query_len in shapes], seed)
        context.write_prefix([cached for cached, _ in shapes])
        query = context.random_query(shapes)
        self.assert_close(context.forward(shapes, query), context.expected(shapes, query, layer, sinks))

    def test_writes_this_steps_kv_into_its_slots_and_nowhere_else(self, attention_factory):
        backend = attention_factory(block_size=8, queries_per_kv_head=3)
        shapes = BATCHES["mixed_b"]
        context = PagedContext.create(backend, [cached + query_len for cached, query_len in shapes], seed=11)
        expected_pool = context.kv_cache.clone()
        metadata = build_metadata(context.block_tables, shapes, backend.block_size, backend.device)
        write_kv(expected_pool, *context.new_kv(shapes), metadata.slot_mapping)
        context.forward(shapes, context.random_query(shapes))
        assert torch.equal(context.kv_cache, expected_pool), "the pool differs from one with only this step's slots"

    def test_decode_after_prefill_reads_its_own_writes(self, attention_factory):
        backend = attention_factory(block_size=8, queries_per_kv_head=3)
        prompt_lens = [9, 1, 20]
        context = PagedContext.create(backend, [length + 2 for length in prompt_lens], seed=12)
        context.forward([(0, length) for length in prompt_lens], context.random_query([(0, n) for n in prompt_lens]))
        for step in range(2):
            shapes = [(length + step, 1) for length in prompt_lens]
            query = context.random_query(shapes)
            self.assert_close(context.forward(shapes, query), context.expected(shapes, query))

    @pytest.mark.parametrize(
        "block_size, dtype", [(8, torch.float32), (16, torch.float32), (16, torch.bfloat16)], ids=str
    )
    def test_sequences_sharing_prefix_blocks_match_the_oracle(self, attention_factory, block_size, dtype):
        backend = attention_factory(block_size=block_size, queries_per_kv_head=3, dtype=dtype)
        context = PagedContext.create_shared(backend, SHARED_GROUPS, seed=14)
        shapes = shared_prefix_step(SHARED_GROUPS, SHARED_QUERY_LENS)
        context.write_prefix([cached for cached, _ in shapes])
        query = context.random_query(shapes)
        self.assert_close(context.forward(shapes, query), context.expected(shapes, query))
        decodes = shared_prefix_step(SHARED_GROUPS, [1] * len(shapes))  # a pure decode step over the same pool
        query = context.random_query(decodes)
        self.assert_close(context.forward(decodes, query), context.expected(decodes, query))

    def declare_layer(self, backend: AttentionBackend, layer: LayerAttention, sinks: torch.Tensor | None = None):
        """``backend.set_layers([layer], [sinks])``, or a skip naming the layer features the backend does not
        declare."""
        missing = sorted(layer.needs - backend.layer_features)
        if missing:
            pytest.skip(f"{type(backend).__name__} does not declare {' and '.join(missing)} attention")
        backend.set_layers([layer], [sinks])

    @pytest.mark.parametrize("window", [None, 5], ids=lambda window: f"window{window}")
    @pytest.mark.parametrize("block_size", [1, 16])
    def test_attention_sinks_match_the_oracle(self, attention_factory, block_size, window):
        """A layer with attention sinks (gpt-oss): each query head's sink logit joins its rows' softmax
        denominator, the largest here taking nearly all of a row's probability. Decodes, prefills, a prefill chunk
        past the built-ins' tiles and chunks after a cached prefix, with GQA."""
        backend = attention_factory(block_size=block_size, queries_per_kv_head=3)
        layer, sinks = LayerAttention(window=window, sinks=True), torch.linspace(-2.0, 8.0, backend.num_heads)
        self.declare_layer(backend, layer, sinks)
        shapes = [(0, 70), (37, 1), (40, 21), (5, 2), (90, 1)]
        self.check_against_oracle(backend, shapes, seed=block_size + 7, layer=layer, sinks=sinks)

    def test_attention_sinks_over_shared_prefix_blocks_match_the_oracle(self, attention_factory):
        backend = attention_factory(block_size=16, queries_per_kv_head=3)
        layer, sinks = LayerAttention(sinks=True), torch.linspace(8.0, -2.0, backend.num_heads)
        self.declare_layer(backend, layer, sinks)
        context = PagedContext.create_shared(backend, SHARED_GROUPS, seed=15)
        shapes = shared_prefix_step(SHARED_GROUPS, SHARED_QUERY_LENS)
        context.write_prefix([cached for cached, _ in shapes])
        query = context.random_query(shapes)
        self.assert_close(context.forward(shapes, query), context.expected(shapes, query, layer, sinks))

    def test_prefix_hit_gives_the_same_output_as_a_miss(self, attention_factory):
        backend = attention_factory(block_size=16, queries_per_kv_head=1)
        prompt_len, cached = 40, 32
        missed = PagedContext.create(backend, [prompt_len], seed=13)
        query = missed.random_query([(0, prompt_len)])
        full = missed.forward([(0, prompt_len)], query)
        hit = PagedContext.create(backend, [prompt_len], seed=13)
        hit.write_prefix([cached])
        tail = hit.forward([(cached, prompt_len - cached)], query[cached:])
        self.assert_close(tail, full[cached:].double())
