"""Attention sinks (gpt-oss) through the paged pool, in every attention backend that declares them: a learned logit
per query head joins each row's softmax denominator and takes probability without adding a value, as a float64
oracle with the sink as one more softmax column computes it. Prefill, decode, chunked prefill beside decodes, with
and without a sliding window, GQA, distinct sinks per head (the largest taking most of each row's probability), and
models whose layers carry different sinks.

Triton runs in its CPU interpreter without CUDA (``TRITON_INTERPRET`` set before anything imports it, as in
``test_triton_attention.py``), so its shapes stay tiny.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infer.attention import AttentionBackend, BackendUnavailableError, LayerAttention  # noqa: E402
from infer.kernels import cpu as cpu_kernels  # noqa: E402
from infer.plugins.attention.cpu import CpuAttentionConfig, CpuBackend  # noqa: E402
from infer.plugins.attention.sdpa import SdpaBackend, SdpaConfig  # noqa: E402
from infer.plugins.attention.triton_backend import TritonAttentionConfig, TritonBackend  # noqa: E402
from infer.testing.attention import PagedContext, build_metadata, reference_attention  # noqa: E402

NUM_KV_HEADS, QUERIES_PER_KV_HEAD, HEAD_DIM = 2, 2, 16  # GQA: two query heads per KV head
NUM_HEADS = NUM_KV_HEADS * QUERIES_PER_KV_HEAD
# One per query head, all distinct: scores here are about N(0, 1), so over a few dozen keys a sink of 3 takes about
# a third of a row's probability and one of 8 nearly all of it.
SINKS = torch.tensor([-1.5, 0.5, 3.0, 8.0])
BACKENDS = {"sdpa": SdpaBackend, "cpu": CpuBackend, "triton": TritonBackend}
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (num_cached_tokens, num_new_tokens) per sequence.
SCENARIOS = {
    "prefill_from_zero": [(0, 70), (0, 9)],
    "chunked_prefill_beside_decodes": [(29, 21), (40, 1), (53, 6), (7, 1)],
    "decode": [(100, 1), (37, 1), (70, 1), (0, 1)],
    "mixed_decode_and_prefill": [(0, 20), (45, 1), (30, 6), (90, 1), (9, 18), (0, 1)],
}
WINDOWS = [None, 3, 17]


def make_backend(
    name: str,
    block_size: int,
    layers: list[LayerAttention],
    sinks: list[torch.Tensor | None],
    *,
    num_kv_heads: int = NUM_KV_HEADS,
    queries_per_kv_head: int = QUERIES_PER_KV_HEAD,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    config=None,
) -> AttentionBackend:
    """Backend ``name`` with ``set_layers(layers, sinks)``; skipped where it cannot run here."""
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton backend needs the triton package (pip install 'infer[triton]')")
    device = TRITON_DEVICE if name == "triton" else torch.device("cpu")
    try:
        backend = BACKENDS[name](
            num_heads=num_kv_heads * queries_per_kv_head,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            device=device,
            config=config,
        )
    except BackendUnavailableError as error:
        pytest.skip(f"attention backend {name} cannot run here: {error}")
    backend.set_layers(layers, sinks)
    return backend


def attend_layer(context: PagedContext, shapes: list[tuple[int, int]], query: torch.Tensor, layer: int, metadata=None):
    """Layer ``layer``'s forward over one step of ``shapes`` (its K/V written into ``context``'s pool first)."""
    backend = context.backend
    if metadata is None:
        metadata = backend.prepare(build_metadata(context.block_tables, shapes, backend.block_size, backend.device))
    return backend.forward(layer, query, *context.new_kv(shapes), context.kv_cache, metadata)


def oracle(context: PagedContext, shapes, query, window, sinks, scale=HEAD_DIM**-0.5) -> torch.Tensor:
    outputs, start = [], 0
    for keys, values, (cached, query_len) in zip(context.keys, context.values, shapes):
        end = cached + query_len
        outputs.append(
            reference_attention(query[start : start + query_len], keys[:end], values[:end], scale, window, sinks)
        )
        start += query_len
    return torch.cat(outputs).cpu()


def step_context(backend: AttentionBackend, shapes, seed: int) -> tuple[PagedContext, torch.Tensor]:
    """A garbage-filled pool with each sequence's cached prefix written, and this step's queries."""
    context = PagedContext.create(backend, [cached + new for cached, new in shapes], seed)
    context.write_prefix([cached for cached, _ in shapes])
    return context, context.random_query(shapes)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("window", WINDOWS, ids=lambda window: f"window{window}")
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_layer_matches_the_oracle(backend, block_size, window, scenario):
    shapes = SCENARIOS[scenario]
    attention = make_backend(backend, block_size, [LayerAttention(window=window, sinks=True)], [SINKS])
    context, query = step_context(attention, shapes, seed=block_size * 100 + (window or 0))
    out = attend_layer(context, shapes, query, 0).cpu()
    expected = oracle(context, shapes, query, window, SINKS)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    # The sinks move every head's output: a backend that ignored them could not pass.
    without_sinks = oracle(context, shapes, query, window, None)
    assert ((expected - without_sinks).abs().amax(dim=(0, 2)) > 1e-3).all()


@pytest.mark.parametrize("num_kv_heads, queries_per_kv_head, head_dim", [(1, 8, 16), (4, 1, 64), (2, 3, 64)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_layouts_with_sinks_match_the_oracle(backend, num_kv_heads, queries_per_kv_head, head_dim):
    """Multi-query (one KV head for eight query heads, each with its own sink), plain multi-head and GQA at a real
    model's head size, with and without a window."""
    num_heads = num_kv_heads * queries_per_kv_head
    sinks = torch.linspace(-2.0, 7.0, num_heads)
    layers = [LayerAttention(sinks=True), LayerAttention(window=6, sinks=True)]
    attention = make_backend(
        backend,
        16,
        layers,
        [sinks, sinks.flip(0)],
        num_kv_heads=num_kv_heads,
        queries_per_kv_head=queries_per_kv_head,
        head_dim=head_dim,
    )
    shapes = SCENARIOS["chunked_prefill_beside_decodes"]
    context, query = step_context(attention, shapes, seed=num_heads * 10 + head_dim)
    pool = context.kv_cache.clone()
    for index, (layer, layer_sinks) in enumerate(zip(layers, [sinks, sinks.flip(0)])):
        context.kv_cache = pool.clone()
        out = attend_layer(context, shapes, query, index).cpu()
        expected = oracle(context, shapes, query, layer.window, layer_sinks, head_dim**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_of_layers_with_their_own_sinks_attends_each_as_declared(backend):
    """gpt-oss's pattern: windowed and full layers alternating, each with its own sinks, beside a layer without
    sinks and one with its own scale; one ``prepare`` for the whole step, as the engine runs it."""
    layers = [
        LayerAttention(window=5, sinks=True),
        LayerAttention(sinks=True),
        LayerAttention(),
        LayerAttention(window=9, scale=0.5, sinks=True),
    ]
    sinks = [SINKS, SINKS.flip(0) - 1.0, None, torch.tensor([4.0, -3.0, 0.0, 2.0])]
    attention = make_backend(backend, 4, layers, sinks)
    shapes = SCENARIOS["mixed_decode_and_prefill"]
    context, query = step_context(attention, shapes, seed=7)
    metadata = attention.prepare(build_metadata(context.block_tables, shapes, 4, attention.device))
    pool = context.kv_cache.clone()
    for index, (layer, layer_sinks) in enumerate(zip(layers, sinks)):
        context.kv_cache = pool.clone()
        out = attend_layer(context, shapes, query, index, metadata).cpu()
        scale = HEAD_DIM**-0.5 if layer.scale is None else layer.scale
        expected = oracle(context, shapes, query, layer.window, layer_sinks, scale)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dominant_sink_leaves_little_and_a_negligible_one_changes_nothing(backend):
    """A sink far above every score takes nearly all the probability (the output shrinks toward zero); one far
    below leaves plain softmax attention."""
    layers = [LayerAttention(sinks=True), LayerAttention()]
    sinks = torch.tensor([40.0, -40.0, 40.0, -40.0])
    attention = make_backend(backend, 16, layers, [sinks, None])
    shapes = SCENARIOS["chunked_prefill_beside_decodes"]
    context, query = step_context(attention, shapes, seed=9)
    pool = context.kv_cache.clone()
    with_sinks = attend_layer(context, shapes, query, 0).cpu()
    context.kv_cache = pool
    plain = attend_layer(context, shapes, query, 1).cpu()
    assert with_sinks[:, 0::2].abs().max() < 1e-8
    torch.testing.assert_close(with_sinks[:, 1::2], plain[:, 1::2], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 40], ids=lambda window: f"window{window}")
def test_triton_merges_split_decodes_with_the_sinks_once(window):
    """Decode rows far past the window with the KV axis split (flash-decoding): each split's partial softmax leaves
    the sink out, and the merge adds it once, against every split's maximum and the sink's."""
    config = TritonAttentionConfig(max_kv_splits=4, min_tokens_per_split=4)
    attention = make_backend("triton", 16, [LayerAttention(window=window, sinks=True)], [SINKS], config=config)
    shapes = [(150, 1), (97, 1)]
    context, query = step_context(attention, shapes, seed=5)
    metadata = build_metadata(context.block_tables, shapes, 16, attention.device)
    assert attention.num_kv_splits(metadata, attention.rows_per_program(metadata), window) > 1
    out = attend_layer(context, shapes, query, 0, metadata).cpu()
    torch.testing.assert_close(out.double(), oracle(context, shapes, query, window, SINKS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cascade", [True, False])
def test_sdpa_sinks_over_shared_prefix_blocks_match_the_oracle(cascade):
    """Decodes and verifications on shared system-prompt blocks: with cascade attention the shared part and each
    row's own part merge through their log-sum-exps before the sink takes its share."""
    from infer.testing.attention import SHARED_GROUPS, SHARED_QUERY_LENS, shared_prefix_step

    attention = make_backend("sdpa", 16, [LayerAttention(sinks=True)], [SINKS], config=SdpaConfig(cascade=cascade))
    context = PagedContext.create_shared(attention, SHARED_GROUPS, seed=14)
    for query_lens in (SHARED_QUERY_LENS, [1] * len(SHARED_QUERY_LENS)):
        shapes = shared_prefix_step(SHARED_GROUPS, query_lens)
        context.write_prefix([cached for cached, _ in shapes])
        query = context.random_query(shapes)
        metadata = attention.prepare(build_metadata(context.block_tables, shapes, 16, attention.device))
        assert (metadata.padded.shared is not None) == cascade
        out = attend_layer(context, shapes, query, 0, metadata)
        torch.testing.assert_close(out.double(), oracle(context, shapes, query, None, SINKS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5], ids=lambda window: f"window{window}")
def test_sdpa_sinks_in_bfloat16_match_the_oracle(window):
    """Narrower activations: decodes through the log-sum-exp call, prefill chunks through float32 tiles."""
    attention = make_backend("sdpa", 16, [LayerAttention(window=window, sinks=True)], [SINKS], dtype=torch.bfloat16)
    shapes = SCENARIOS["mixed_decode_and_prefill"]
    context, query = step_context(attention, shapes, seed=21)
    out = attend_layer(context, shapes, query, 0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle(context, shapes, query, window, SINKS), atol=2e-2, rtol=2e-2)


def test_set_layers_takes_one_sink_logit_per_query_head_for_exactly_the_layers_that_declare_sinks():
    attention = make_backend("sdpa", 4, [LayerAttention()], [None])
    with pytest.raises(ValueError, match="layer 1 declares attention sinks but set_layers got none"):
        attention.set_layers([LayerAttention(), LayerAttention(sinks=True)])
    with pytest.raises(ValueError, match="layer 0 does not declare attention sinks"):
        attention.set_layers([LayerAttention()], [SINKS])
    with pytest.raises(ValueError, match=r"shape \(3,\); expected one per query head \(4,\)"):
        attention.set_layers([LayerAttention(sinks=True)], [SINKS[:3]])
    attention.set_layers([LayerAttention(sinks=True), LayerAttention()], [SINKS.double(), None])
    assert attention.layer_sinks(0).dtype == torch.float32 and attention.layer_sinks(1) is None


def test_a_backend_without_sinks_is_refused_by_set_layers_naming_what_is_missing():
    class FullOnly(AttentionBackend):
        layer_features = frozenset({"window"})

        def forward(self, layer, q, k, v, kv_cache, metadata):
            raise AssertionError("never called")

    backend = FullOnly(
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    with pytest.raises(BackendUnavailableError, match="FullOnly does not implement sinks attention"):
        backend.set_layers([LayerAttention(window=4, sinks=True)], [SINKS])
    for name in BACKENDS:
        assert "sinks" in BACKENDS[name].layer_features


# ---- the cpu backend's other paths: bf16 prefill, a bf16 pool's dot products, other builds, the fused stack -------


@pytest.mark.parametrize("window", [None, 7, 40], ids=lambda window: f"window{window}")
@pytest.mark.parametrize(
    "kernel, pool, arithmetic",
    [
        ("torch", torch.float32, "bf16"),
        ("infer", torch.float32, "bf16"),
        ("infer", torch.bfloat16, "bf16"),
        ("infer", torch.float32, "float32"),
        ("infer", torch.bfloat16, "float32"),
    ],
)
def test_cpu_bf16_prefill_and_decode_take_the_sinks(kernels, kernel, pool, arithmetic, window):
    """``prefill_dtype: bfloat16``: the long queries go to a flash attention (torch's, whose log-sum-exp rescales
    the rows, or infer's on AMX tiles, the dot products or float32 FMAs), the rest to the kernel (on the dot
    products over a bf16 pool), each within bf16's error of the oracle with sinks, and far from the one without."""
    if kernel == "infer" and not kernels.flash:
        pytest.skip("infer's flash attention is built only where the CPU has avx512_bf16, which this one lacks")
    config = CpuAttentionConfig(
        prefill_dtype="bfloat16",
        prefill_min_tokens=8,
        prefill_kernel=kernel,
        prefill_arithmetic=arithmetic,
        kv_dtype="bfloat16" if pool == torch.bfloat16 else "float32",
        decode_arithmetic="bf16",
    )
    sinks = torch.tensor([-1.0, 2.0, 5.0, 0.5, 9.0, -4.0])  # six query heads on two KV heads
    attention = make_backend(
        "cpu",
        16,
        [LayerAttention(window=window, sinks=True)],
        [sinks],
        queries_per_kv_head=3,
        head_dim=64,
        config=config,
    )
    shapes = [(0, 70), (45, 1), (30, 6), (90, 1), (29, 40), (100, 33)]
    context, query = step_context(attention, shapes, seed=window or 0)
    metadata = attention.prepare(build_metadata(context.block_tables, shapes, 16, attention.device))
    assert (metadata.flash is not None) == (kernel == "infer") and bool(metadata.prefills) == (kernel == "torch")
    out = attend_layer(context, shapes, query, 0, metadata)
    expected = oracle(context, shapes, query, window, sinks, 64**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)
    assert (out.double() - oracle(context, shapes, query, window, None, 64**-0.5)).abs().max() > 0.2


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_cpu_kernel_sinks_in_the_avx2_and_portable_builds(build, simd_build):
    """The decode kernel's other instruction sets (built here with the flags that turn AVX-512, or all AVX, off)
    merge the sinks into a mixed batch's rows as the oracle does, over float32 and bf16 pools, with a window."""
    built = simd_build(build)
    shapes = SCENARIOS["mixed_decode_and_prefill"]
    for kv_dtype, window in ((torch.float32, None), (torch.bfloat16, 5)):
        attention = make_backend("sdpa", 4, [LayerAttention(window=window, sinks=True)], [SINKS])
        context, query = step_context(attention, shapes, seed=13)
        context.kv_cache = context.kv_cache.to(kv_dtype)  # a bf16 pool: what the oracle reads is rounded too
        context.keys, context.values = (
            [side.to(kv_dtype).float() for side in sides] for sides in (context.keys, context.values)
        )
        metadata = build_metadata(context.block_tables, shapes, 4, attention.device)
        built.write_kv(context.kv_cache, *context.new_kv(shapes), metadata.slot_mapping)
        plan = cpu_kernels.KernelAttentionPlan.every_token(metadata)
        out = built.paged_attention(
            query,
            context.kv_cache,
            metadata.block_tables,
            plan,
            HEAD_DIM**-0.5,
            torch.empty(query.shape),
            window=window,
            sinks=SINKS,
        )
        torch.testing.assert_close(out.double(), oracle(context, shapes, query, window, SINKS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype, dots", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_cpu_kernel_gives_a_query_with_sinks_the_same_bits_alone_or_beside_others(kernels, kv_dtype, dots):
    """Verification rows of one sequence share the kernel's work items; the sinks join only each row's merge, so
    each row still gets the bits it gets alone, and equals the oracle with its heads' sinks."""
    if dots and not kernels.flash:
        pytest.skip("the kernel's bf16 dot products are built only where the CPU has avx512_bf16")
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    generator = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, 48, block_size, num_kv_heads, head_dim, generator=generator).to(kv_dtype)
    block_tables = torch.tensor([list(range(24))[::-1], list(range(24, 48))], dtype=torch.int32)
    seqs, lengths = [0, 0, 0, 0, 1], [296, 297, 298, 299, 40]
    sinks = torch.linspace(-3.0, 9.0, num_heads)
    q = torch.randn(len(seqs), num_heads, head_dim, generator=generator)
    together = cpu_kernels.KernelAttentionPlan(None, torch.tensor(seqs), torch.tensor(lengths), len(seqs), max(lengths))
    out = kernels.paged_attention(q, kv_cache, block_tables, together, 0.125, torch.empty(q.shape), dots, sinks=sinks)
    for row, (seq, length) in enumerate(zip(seqs, lengths)):
        alone = cpu_kernels.KernelAttentionPlan(None, torch.tensor([seq]), torch.tensor([length]), 1, length)
        single = kernels.paged_attention(
            q[row : row + 1].contiguous(),
            kv_cache,
            block_tables,
            alone,
            0.125,
            torch.empty(1, num_heads, head_dim),
            dots,
            sinks=sinks,
        )
        assert torch.equal(out[row], single[0]), row
        keys, values = (kv_cache[half, block_tables[seq].long()].flatten(0, 1)[:length].float() for half in (0, 1))
        query = q[row : row + 1].bfloat16().float() if dots else q[row : row + 1]
        expected = reference_attention(query, keys, values, 0.125, None, sinks)
        tolerance = 1e-2 if dots else 1e-5
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=tolerance, rtol=tolerance)


def test_the_kernels_refuse_sinks_that_are_not_one_float32_per_query_head(kernels):
    attention = make_backend("cpu", 4, [LayerAttention()], [None])
    context, query = step_context(attention, [(3, 1)], seed=1)
    metadata = build_metadata(context.block_tables, [(3, 1)], 4, attention.device)
    plan = cpu_kernels.KernelAttentionPlan.every_token(metadata)
    for wrong in (SINKS.double(), SINKS[:3], SINKS.repeat(2)[::2]):
        with pytest.raises(ValueError, match="one per query head"):
            kernels.paged_attention(
                query, context.kv_cache, metadata.block_tables, plan, 0.25, torch.empty(query.shape), sinks=wrong
            )


def test_cpu_fused_stack_attends_each_layer_with_its_sinks(kernels):
    """The cpu backend's ``fused_attention`` carries each pool layer's sinks (a row of -inf for a layer without)
    into the one-call stack, whose layers then equal the same layers run one by one around the backend's own
    attention; the same stack without the sinks gives another output."""
    from infer.kernels.cpu import FusedLayer, FusedStack, pack_weights
    from infer.model import RotaryEmbedding, default_inverse_frequencies

    hidden, intermediate, head_dim, block_size = 128, 192, 32, 4
    q_width, kv_width = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    generator = torch.Generator().manual_seed(17)

    def weight(rows: int, columns: int) -> torch.Tensor:
        return pack_weights((torch.randn(rows, columns, generator=generator) * 0.2).bfloat16())

    def layer() -> FusedLayer:
        weights = [
            weight(q_width + 2 * kv_width, hidden),
            weight(hidden, q_width),
            weight(2 * intermediate, hidden),
            weight(hidden, intermediate),
        ]
        norms = (torch.rand(hidden, generator=generator) + 0.5, torch.rand(hidden, generator=generator) + 0.5)
        return FusedLayer(
            kernels, weights, [None] * 4, [None] * 4, norms, 1e-6, q_width, NUM_HEADS + NUM_KV_HEADS, head_dim
        )

    layers = [layer() for _ in range(3)]
    declared = [LayerAttention(window=3, sinks=True), LayerAttention(), LayerAttention(sinks=True)]
    attention = make_backend("cpu", block_size, declared, [SINKS, None, SINKS.flip(0)], head_dim=head_dim)
    rotary = RotaryEmbedding(default_inverse_frequencies(10000.0, head_dim), 256, torch.device("cpu"))
    shapes = [(30, 1), (21, 3)]  # a decode at 30 cached tokens and three verification rows after 21
    context, _ = step_context(attention, shapes, seed=19)
    metadata = attention.prepare(build_metadata(context.block_tables, shapes, block_size, attention.device))
    fused = attention.fused_attention(metadata)
    assert fused.sinks[1].eq(float("-inf")).all() and torch.equal(fused.sinks[2], SINKS.flip(0))
    pools = context.kv_cache.expand(len(layers), *context.kv_cache.shape).contiguous()
    hidden_states = torch.randn(4, hidden, generator=generator)
    expected_pools, residual, delta = pools.clone(), hidden_states.clone(), None
    for index, fused_layer in enumerate(layers):
        qkv = fused_layer.attention_input(residual, delta, metadata.positions, rotary.cos, rotary.sin)
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=1)
        attended = attention.forward(
            index,
            q.view(-1, NUM_HEADS, head_dim),
            k.reshape(-1, NUM_KV_HEADS, head_dim),
            v.reshape(-1, NUM_KV_HEADS, head_dim),
            expected_pools[index],
            metadata,
        )
        delta = fused_layer.feed_forward(attended.reshape(-1, q_width).contiguous(), residual)
    stack = FusedStack(kernels, layers, [0, 1, 2])
    stacked = hidden_states.clone()
    out = stack.run(stacked, metadata.positions, rotary.cos, rotary.sin, pools, fused)
    torch.testing.assert_close(pools, expected_pools, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, delta, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stacked, residual, atol=1e-4, rtol=1e-4)
    fused.sinks = None  # the same stack without sinks: another output, so the sinks above took effect
    other = stack.run(
        hidden_states.clone(),
        metadata.positions,
        rotary.cos,
        rotary.sin,
        context.kv_cache.expand(len(layers), *context.kv_cache.shape).contiguous(),
        fused,
    )
    assert (other - out).abs().max() > 1e-3


def test_the_decoder_holds_each_sink_layers_logits_and_a_tensor_parallel_rank_keeps_its_heads():
    """A layer declared with sinks gets ``self_attn.sinks`` (the HF tensor name, loaded like any weight), the model
    hands each layer's logits to ``set_layers`` (None for a layer without), and a tensor-parallel rank keeps the
    logits of its own query heads."""
    from transformers import LlamaConfig

    from infer.distributed.shards import plan_shards
    from infer.model import CausalLM, ModelArchitecture
    from infer.model.sharding import shard_model

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=64,
    )
    spec = ModelArchitecture.decoder_spec(config)
    model = CausalLM(spec.replace(layer_attention=(LayerAttention(sinks=True), LayerAttention())))
    assert [name for name, _ in model.named_parameters() if "sinks" in name] == ["layers.0.self_attn.sinks"]
    assert ModelArchitecture.hf_names("layers.0.self_attn.sinks") == ["model.layers.0.self_attn.sinks"]
    with torch.no_grad():
        model.layers[0].self_attn.sinks.copy_(SINKS)
    attention = make_backend("sdpa", 4, list(model.layer_attention), model.attention_sinks)
    assert torch.equal(attention.layer_sinks(0), SINKS) and attention.layer_sinks(1) is None
    second_rank = plan_shards(NUM_HEADS, NUM_KV_HEADS, 96, 64, 2)[1]
    shard_model(model, second_rank, group=None)
    assert torch.equal(model.attention_sinks[0], SINKS[second_rank.q_heads.start : second_rank.q_heads.stop])
    assert model.attention_sinks[1] is None
