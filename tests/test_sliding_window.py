"""Sliding-window attention through the paged pool, in every attention backend (``sdpa``, ``cpu``, ``triton``): the
query at position ``p`` sees the keys at ``p - window + 1 .. p``, as a float64 oracle computes it, for prefill from
the start, chunked prefill, decode far past the window, mixed batches, GQA, and models whose layers differ; the
blocks wholly before a window are never read (they hold NaN here, which any read would spread).

Triton runs in its CPU interpreter without CUDA (``TRITON_INTERPRET`` set before anything imports it, as in
``test_triton_attention.py``), so its shapes stay tiny.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infer.attention import AttentionBackend, AttentionMetadata, BackendUnavailableError, LayerAttention, write_kv  # noqa: E402
from infer.kernels import cpu as cpu_kernels  # noqa: E402
from infer.plugins.attention.cpu import CpuAttentionConfig, CpuBackend  # noqa: E402
from infer.plugins.attention.sdpa import SdpaBackend, SdpaConfig  # noqa: E402
from infer.plugins.attention.triton_backend import TritonAttentionConfig, TritonBackend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16  # GQA: two query heads per KV head
LARGER_THAN_ANY_CONTEXT = 1000
BACKENDS = {"sdpa": SdpaBackend, "cpu": CpuBackend, "triton": TritonBackend}
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (num_cached_tokens, num_new_tokens) per sequence.
SCENARIOS = {
    "prefill_from_zero": [(0, 70), (0, 9)],
    "chunked_prefill_mid_sequence": [(29, 21), (53, 6)],
    "decode_past_several_windows": [(100, 1), (37, 1), (70, 1)],
    "mixed_decode_and_prefill": [(0, 20), (45, 1), (30, 6), (90, 1), (9, 18), (0, 1)],
}


def windows_for(block_size: int) -> list[int]:
    """1, 3, either side of a block and a block exactly, and one longer than every context."""
    return sorted({1, 3, block_size - 1, block_size, block_size + 1, LARGER_THAN_ANY_CONTEXT})


WINDOWS = [(block_size, window) for block_size in (4, 16) for window in windows_for(block_size)]


@dataclass
class Step:
    """One step's inputs, plus each sequence's full K/V history kept outside the pool for the oracle."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    block_tables: list[list[int]]


def make_step(
    sequences: list[tuple[int, int]],
    block_size: int,
    *,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
    kv_dtype: torch.dtype = torch.float32,
) -> Step:
    """Each sequence over shuffled pool blocks with its cached prefix written, and this step's Q/K/V; the pool's
    other slots hold garbage. A bf16 pool's K/V are what the oracle sees too."""
    generator = torch.Generator().manual_seed(seed)
    num_cached = [cached for cached, _ in sequences]
    num_new = [new for _, new in sequences]
    blocks_needed = [math.ceil((cached + new) / block_size) for cached, new in sequences]
    num_blocks = 1 + 2 * sum(blocks_needed)
    free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = [[free_blocks.pop() for _ in range(count)] for count in blocks_needed]
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=generator).to(kv_dtype)

    def history(total: int) -> torch.Tensor:
        return torch.randn(total, NUM_KV_HEADS, head_dim, generator=generator).to(kv_dtype).float()

    keys = [history(cached + new) for cached, new in sequences]
    values = [history(cached + new) for cached, new in sequences]
    prefix = AttentionMetadata.build(block_tables, [0] * len(sequences), num_cached, block_size)
    write_kv(
        kv_cache,
        torch.cat([key[:cached] for key, cached in zip(keys, num_cached)]),
        torch.cat([value[:cached] for value, cached in zip(values, num_cached)]),
        prefix.slot_mapping,
    )
    q = torch.randn(sum(num_new), NUM_HEADS, head_dim, generator=generator)
    k = torch.cat([key[cached:] for key, cached in zip(keys, num_cached)])
    v = torch.cat([value[cached:] for value, cached in zip(values, num_cached)])
    metadata = AttentionMetadata.build(block_tables, num_cached, num_new, block_size)
    return Step(q, k, v, kv_cache, metadata, keys, values, block_tables)


def poison_blocks_outside_the_window(step: Step, window: int) -> int:
    """NaN in every block that lies wholly before the window of each sequence's first query (so before every query's
    window): a backend that reads one spreads NaN into its output. Returns how many blocks were poisoned."""
    block_size = step.kv_cache.shape[2]
    poisoned = 0
    for table, cached in zip(
        step.block_tables, (s - q for s, q in zip(step.metadata.seq_lens_cpu, step.metadata.query_lens_cpu))
    ):
        first_key = max(0, cached - window + 1)
        outside = table[: first_key // block_size]
        step.kv_cache[:, outside] = float("nan")
        poisoned += len(outside)
    return poisoned


def windowed_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention in float64: query i of L sits at position S - L + i and sees positions p - window + 1 .. p
    (every earlier one without a window)."""
    query_len, num_heads, head_dim = q.shape
    seq_len = keys.shape[0]
    per_kv = num_heads // keys.shape[1]
    keys = keys.double().repeat_interleave(per_kv, dim=1)
    values = values.double().repeat_interleave(per_kv, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), keys) * (head_dim**-0.5 if scale is None else scale)
    query_positions = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_positions = torch.arange(seq_len)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hls,shd->lhd", weights, values)


def oracle(step: Step, window: int | None, scale: float | None = None) -> torch.Tensor:
    starts = step.metadata.query_start_loc.tolist()
    return torch.cat(
        [
            windowed_attention(step.q[start:end], keys, values, window, scale)
            for start, end, keys, values in zip(starts, starts[1:], step.keys, step.values)
        ]
    )


def make_backend(
    name: str, block_size: int, layers: list[LayerAttention], *, head_dim: int = HEAD_DIM, config=None
) -> AttentionBackend:
    """Backend ``name`` for the model's heads with ``set_layers(layers)``; skipped where it cannot run here."""
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton backend needs the triton package (pip install 'infer[triton]')")
    device = TRITON_DEVICE if name == "triton" else torch.device("cpu")
    try:
        backend = BACKENDS[name](
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=head_dim,
            block_size=block_size,
            dtype=torch.float32,
            device=device,
            config=config,
        )
    except BackendUnavailableError as error:
        pytest.skip(f"attention backend {name} cannot run here: {error}")
    backend.set_layers(layers)
    return backend


def attend(
    backend: AttentionBackend,
    step: Step,
    layer: int = 0,
    kv_cache: torch.Tensor | None = None,
    metadata: AttentionMetadata | None = None,
) -> torch.Tensor:
    """Layer ``layer``'s forward over the step (its K/V written first), on the backend's device, back on the CPU."""
    device = backend.device
    if metadata is None:
        metadata = backend.prepare(moved(step.metadata, device))
    kv_cache = step.kv_cache if kv_cache is None else kv_cache
    pool = kv_cache.to(device)
    out = backend.forward(layer, step.q.to(device), step.k.to(device), step.v.to(device), pool, metadata)
    kv_cache.copy_(pool.cpu())
    return out.cpu()


def moved(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return metadata
    fields = {name: getattr(metadata, name) for name in metadata.__dataclass_fields__}
    return AttentionMetadata(
        **{name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in fields.items()}
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size, window", WINDOWS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_windowed_layer_matches_the_oracle_without_reading_blocks_outside_the_window(
    backend, block_size, window, scenario
):
    step = make_step(SCENARIOS[scenario], block_size, seed=block_size * 1000 + window)
    poison_blocks_outside_the_window(step, window)
    out = attend(make_backend(backend, block_size, [LayerAttention(window=window)]), step)
    torch.testing.assert_close(out.double(), oracle(step, window), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_changes_the_output_once_the_context_exceeds_it(backend):
    """Decodes at contexts of 5 and 40 under a window of 8: the first sees its whole context (the same output as
    full attention), the second does not (a different one), on the same pool."""
    step = make_step([(4, 1), (39, 1)], 4, seed=3)
    full = attend(make_backend(backend, 4, [LayerAttention()]), step)
    windowed = attend(make_backend(backend, 4, [LayerAttention(window=8)]), step)
    torch.testing.assert_close(windowed[0], full[0], atol=2e-5, rtol=1e-4)
    assert (windowed[1] - full[1]).abs().max() > 1e-2
    torch.testing.assert_close(windowed.double(), oracle(step, 8), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_of_windowed_and_full_layers_attends_each_layer_as_it_declares(backend, block_size):
    """Four pool layers through ``set_layers`` (Gemma 3's pattern: windowed layers around a full one, one with its
    own softmax scale), one step of a mixed batch: each layer equals the oracle of its own window and scale."""
    layers = [
        LayerAttention(window=5),
        LayerAttention(),
        LayerAttention(window=block_size + 1),
        LayerAttention(window=3, scale=0.5),
    ]
    attention = make_backend(backend, block_size, layers)
    step = make_step(SCENARIOS["mixed_decode_and_prefill"], block_size, seed=11)
    pools = [step.kv_cache.clone() for _ in layers]
    metadata = attention.prepare(moved(step.metadata, attention.device))  # once for every layer, as the engine does
    for index, layer in enumerate(layers):
        out = attend(attention, step, index, pools[index], metadata)
        torch.testing.assert_close(out.double(), oracle(step, layer.window, layer.scale), atol=2e-5, rtol=1e-4)
    assert attention.layer_scale(3) == 0.5 and attention.layer_scale(0) == HEAD_DIM**-0.5


def test_a_backend_without_windows_is_refused_by_set_layers_naming_what_is_missing():
    class FullOnly(AttentionBackend):
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
    backend.set_layers([LayerAttention(), LayerAttention(scale=0.25)])  # nothing beyond what every backend does
    with pytest.raises(BackendUnavailableError, match="FullOnly does not implement window attention"):
        backend.set_layers([LayerAttention(), LayerAttention(window=4)])
    for name in BACKENDS:
        assert "window" in BACKENDS[name].layer_features


def test_triton_splits_a_windowed_decode_over_the_window_only():
    """Decode rows far past the window with the KV axis split (flash-decoding): the splits divide the window's
    positions, each query's own among them, and merge to the oracle."""
    config = TritonAttentionConfig(max_kv_splits=4, min_tokens_per_split=4)
    step = make_step([(150, 1), (97, 1)], 16, seed=5)
    poison_blocks_outside_the_window(step, 40)
    attention = make_backend("triton", 16, [LayerAttention(window=40)], config=config)
    assert attention.num_kv_splits(step.metadata, attention.rows_per_program(step.metadata), 40) > 1
    torch.testing.assert_close(attend(attention, step).double(), oracle(step, 40), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cascade", [True, False])
def test_sdpa_attends_a_windowed_layer_without_cascade_over_a_shared_prefix(cascade):
    """Decodes over one long shared prefix: full layers attend it once for all rows (cascade), a windowed layer
    takes the plain padded call over each row's window, and both equal their oracles."""
    block_size, shared = 16, 160
    sequences = [(shared + extra, 1) for extra in (3, 9, 20, 31)]
    step = make_step(sequences, block_size, seed=7)
    for table in step.block_tables[1:]:  # every row's first 10 blocks are row 0's: one cached prompt
        table[: shared // block_size] = step.block_tables[0][: shared // block_size]
    for keys, values in zip(step.keys[1:], step.values[1:]):
        keys[:shared], values[:shared] = step.keys[0][:shared], step.values[0][:shared]
    step.metadata = AttentionMetadata.build(step.block_tables, [c for c, _ in sequences], [1] * 4, block_size)
    attention = make_backend(
        "sdpa", block_size, [LayerAttention(), LayerAttention(window=24)], config=SdpaConfig(cascade=cascade)
    )
    metadata = attention.prepare(step.metadata)
    assert (metadata.padded.shared is not None) == cascade and metadata.window_plans[24][0].shared is None
    full_pool, window_pool = step.kv_cache.clone(), step.kv_cache.clone()
    torch.testing.assert_close(
        attend(attention, step, 0, full_pool, metadata).double(), oracle(step, None), atol=2e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        attend(attention, step, 1, window_pool, metadata).double(), oracle(step, 24), atol=2e-5, rtol=1e-4
    )


def test_sdpa_in_bfloat16_masks_the_window_in_its_sdpa_calls():
    """Below float32 sdpa's prefill chunks take SDPA with a boolean mask: banded for a windowed layer."""
    attention = SdpaBackend(
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=4,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    attention.set_layers([LayerAttention(window=6)])
    step = make_step(SCENARIOS["mixed_decode_and_prefill"], 4, seed=9, kv_dtype=torch.bfloat16)
    step.kv_cache = step.kv_cache.bfloat16()
    step.q = step.q.bfloat16().float()
    poison_blocks_outside_the_window(step, 6)
    metadata = attention.prepare(step.metadata)
    out = attention.forward(0, step.q.bfloat16(), step.k.bfloat16(), step.v.bfloat16(), step.kv_cache, metadata)
    torch.testing.assert_close(out.double(), oracle(step, 6), atol=3e-2, rtol=3e-2)


# ---- the cpu backend's other paths: bf16 prefill, a bf16 pool's dot products, the fused stack ---------------------


@pytest.mark.parametrize("window", [1, 7, 16, 33, LARGER_THAN_ANY_CONTEXT])
@pytest.mark.parametrize("head_dim", [64, 128])
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
def test_cpu_bf16_prefill_and_decode_honour_the_window(kernels, kernel, pool, arithmetic, head_dim, window):
    """``prefill_dtype: bfloat16``: the long queries go to a flash attention (torch's, or infer's on AMX tiles or
    the dot products, or its float32 FMAs), the rest to the kernel (on the dot products over a bf16 pool), every
    one within bf16's error of the windowed oracle, and none reading a block before its window, at SmolLM2's and
    Qwen3's head sizes."""
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
    attention = make_backend("cpu", 16, [LayerAttention(window=window)], head_dim=head_dim, config=config)
    step = make_step(
        [(0, 70), (45, 1), (30, 6), (90, 1), (29, 40), (100, 33)], 16, seed=window, head_dim=head_dim, kv_dtype=pool
    )
    poison_blocks_outside_the_window(step, window)
    metadata = attention.prepare(step.metadata)
    assert (metadata.flash is not None) == (kernel == "infer") and bool(metadata.prefills) == (kernel == "torch")
    torch.testing.assert_close(
        attend(attention, step, metadata=metadata).double(), oracle(step, window), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_cpu_kernel_windows_in_the_avx2_and_portable_builds(build, simd_build):
    """The decode kernel's other instruction sets (built here with the flags that turn AVX-512, or all AVX, off)
    attend a windowed mixed batch as the oracle does, over float32 and bf16 pools, without reading blocks before
    the window."""
    built = simd_build(build)
    for kv_dtype in (torch.float32, torch.bfloat16):
        step = make_step(SCENARIOS["mixed_decode_and_prefill"], 4, seed=13, kv_dtype=kv_dtype)
        poison_blocks_outside_the_window(step, 5)
        metadata = step.metadata
        built.write_kv(step.kv_cache, step.k, step.v, metadata.slot_mapping)
        plan = cpu_kernels.KernelAttentionPlan.every_token(metadata)
        out = built.paged_attention(
            step.q, step.kv_cache, metadata.block_tables, plan, HEAD_DIM**-0.5, torch.empty(step.q.shape), window=5
        )
        torch.testing.assert_close(out.double(), oracle(step, 5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype, dots", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_cpu_kernel_gives_a_windowed_query_the_same_bits_alone_or_beside_others(
    kernels, kv_dtype, dots, head_dim, window
):
    """Verification rows of one sequence share the kernel's work items, which start at the earliest window among
    them: each row still gets the bits it gets alone (a verified draft equals the decode row it stands for)."""
    if dots and not kernels.flash:
        pytest.skip("the kernel's bf16 dot products are built only where the CPU has avx512_bf16")
    num_heads, num_kv_heads, block_size, scale = 9, 3, 16, head_dim**-0.5
    generator = torch.Generator().manual_seed(window)
    kv_cache = torch.randn(2, 48, block_size, num_kv_heads, head_dim, generator=generator).to(kv_dtype)
    block_tables = torch.tensor([list(range(24))[::-1], list(range(24, 48))], dtype=torch.int32)
    seqs, lengths = [0, 0, 0, 0, 0, 1], [296, 297, 298, 299, 300, 129]
    q = torch.randn(len(seqs), num_heads, head_dim, generator=generator)
    together = cpu_kernels.KernelAttentionPlan(None, torch.tensor(seqs), torch.tensor(lengths), len(seqs), max(lengths))
    out = kernels.paged_attention(q, kv_cache, block_tables, together, scale, torch.empty(q.shape), dots, window)
    for row, (seq, length) in enumerate(zip(seqs, lengths)):
        alone = cpu_kernels.KernelAttentionPlan(None, torch.tensor([seq]), torch.tensor([length]), 1, length)
        single = kernels.paged_attention(
            q[row : row + 1].contiguous(),
            kv_cache,
            block_tables,
            alone,
            scale,
            torch.empty(1, num_heads, head_dim),
            dots,
            window,
        )
        assert torch.equal(out[row], single[0]), row
        keys, values = (kv_cache[half, block_tables[seq].long()].flatten(0, 1)[:length].float() for half in (0, 1))
        expected = windowed_attention(
            q[row : row + 1].bfloat16().float() if dots else q[row : row + 1], keys, values, window, scale
        )
        tolerance = 1e-2 if dots else 1e-5
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim, pool", [(32, torch.float32), (128, torch.bfloat16)])
def test_cpu_fused_stack_attends_each_layer_with_its_window(kernels, head_dim, pool):
    """The cpu backend's ``fused_attention`` carries each pool layer's window into the one-call stack, whose layers
    then equal the same layers run one by one around the backend's own attention (over a bf16 pool at Qwen3's head
    size on the dot products, where the kernels have them); a model whose layers' scales differ keeps attention per
    layer (None: the stack takes one scale)."""
    from infer.kernels.cpu import FusedLayer, FusedStack, pack_weights
    from infer.model import RotaryEmbedding, default_inverse_frequencies

    hidden, intermediate, block_size = 128, 192, 4
    bf16 = pool == torch.bfloat16
    config = CpuAttentionConfig(kv_dtype="bfloat16", decode_arithmetic="bf16") if bf16 else None
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
    windows = [LayerAttention(window=3), LayerAttention(), LayerAttention(window=6)]
    attention = make_backend("cpu", block_size, windows, head_dim=head_dim, config=config)
    rotary = RotaryEmbedding(default_inverse_frequencies(10000.0, head_dim), 256, torch.device("cpu"))
    # a decode at 30 cached tokens and three verification rows after 21
    step = make_step([(30, 1), (21, 3)], block_size, seed=19, head_dim=head_dim, kv_dtype=pool)
    metadata = attention.prepare(step.metadata)
    fused = attention.fused_attention(metadata)
    assert fused.windows.tolist() == [3, 0, 6]
    assert fused.dots == (bf16 and kernels.flash)
    pools = step.kv_cache.expand(len(layers), *step.kv_cache.shape).contiguous()
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
    unwindowed = attention.fused_attention(metadata)
    unwindowed.windows = None  # the same stack without windows: another output, so the windows above took effect
    other = stack.run(
        hidden_states.clone(),
        metadata.positions,
        rotary.cos,
        rotary.sin,
        step.kv_cache.expand(len(layers), *step.kv_cache.shape).contiguous(),
        unwindowed,
    )
    assert (other - out).abs().max() > 1e-3
    scaled = make_backend("cpu", block_size, [LayerAttention(window=3), LayerAttention(scale=0.5)], head_dim=head_dim)
    assert scaled.fused_attention(scaled.prepare(step.metadata)) is None
