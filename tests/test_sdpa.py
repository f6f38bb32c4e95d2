"""The ``sdpa`` attention backend (and ``cpu``, infer's C kernels, on the same sweep) agrees with a naive softmax
oracle on ragged, paged, GQA batches."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

import infer.plugins.attention as attention_plugins
from infer.attention import AttentionMetadata, write_kv
from infer.plugins.attention import sdpa as sdpa_plugin
from infer.plugins.attention.cpu import CpuBackend
from infer.plugins.attention.sdpa import MAX_PADDED_QUERY_LEN, SdpaBackend

HEAD_DIM = 8
HEAD_LAYOUTS = [(4, 4), (4, 2), (6, 1)]  # (num_heads, num_kv_heads): MHA, GQA, MQA
LONG = MAX_PADDED_QUERY_LEN + 3  # long enough to take the per-sequence path
# (num_cached_tokens, num_new_tokens) per sequence.
SCENARIOS = {
    "decode_only": [(5, 1), (17, 1), (1, 1), (33, 1)],
    "fresh_prefills": [(0, LONG), (0, 3), (0, LONG + 9)],
    "prefill_chunks_after_cached_prefixes": [(7, LONG), (16, LONG + 1)],
    "uniform_verification": [(9, 4), (20, 4), (3, 4)],
    "mixed": [(0, LONG), (12, 1), (5, LONG + 2), (30, 5), (0, 1), (8, 2)],
    "one_decode": [(37, 1)],  # no mask: the call reads exactly the sequence's keys
    "decodes_at_one_length": [(20, 1), (20, 1), (20, 1)],
    # Several causal query tiles, fresh and after a cached prefix.
    "long_chunks": [(0, 3 * sdpa_plugin.CAUSAL_TILE + 5), (40, 2 * sdpa_plugin.CAUSAL_TILE), (3, 1)],
}


@dataclass
class Step:
    """One step's inputs plus each sequence's full K/V history, kept outside the pool for the oracle."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_step(
    sequences, *, num_heads, num_kv_heads, block_size, seed=0, dtype=torch.float32, head_dim=HEAD_DIM
) -> Step:
    """Scatter each sequence over shuffled pool blocks, write its cached prefix, and draw this step's Q/K/V."""
    generator = torch.Generator().manual_seed(seed)
    num_cached = [cached for cached, _ in sequences]
    num_new = [new for _, new in sequences]
    blocks_needed = [math.ceil((cached + new) / block_size) for cached, new in sequences]
    num_blocks = 1 + 2 * sum(blocks_needed)  # spare blocks leave gaps between a sequence's blocks
    free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = [[free_blocks.pop() for _ in range(count)] for count in blocks_needed]
    # Garbage everywhere, so reading a slot that was never written shows up as a mismatch.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    keys = [torch.randn(c + n, num_kv_heads, head_dim, generator=generator).to(dtype) for c, n in sequences]
    values = [torch.randn(c + n, num_kv_heads, head_dim, generator=generator).to(dtype) for c, n in sequences]
    prefix = AttentionMetadata.build(block_tables, [0] * len(sequences), num_cached, block_size)
    cached_keys = torch.cat([key[:cached] for key, cached in zip(keys, num_cached)])
    cached_values = torch.cat([value[:cached] for value, cached in zip(values, num_cached)])
    write_kv(kv_cache, cached_keys, cached_values, prefix.slot_mapping)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=generator).to(dtype)
    k = torch.cat([key[cached:] for key, cached in zip(keys, num_cached)])
    v = torch.cat([value[cached:] for value, cached in zip(values, num_cached)])
    metadata = AttentionMetadata.build(block_tables, num_cached, num_new, block_size)
    return Step(q, k, v, kv_cache, metadata, keys, values)


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64; query i of L sits at position S - L + i and sees positions <= its own."""
    query_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    keys = keys.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    values = values.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), keys) / math.sqrt(head_dim)
    query_positions = torch.arange(seq_len - query_len, seq_len)
    visible = torch.arange(seq_len)[None, :] <= query_positions[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hls,shd->lhd", weights, values)


def oracle(step: Step) -> torch.Tensor:
    starts = step.metadata.query_start_loc.tolist()
    return torch.cat(
        [
            naive_attention(step.q[start:end], keys, values)
            for start, end, keys, values in zip(starts, starts[1:], step.keys, step.values)
        ]
    )


def run_backend(
    step: Step, *, num_heads, num_kv_heads, block_size, dtype=torch.float32, backend_class=SdpaBackend
) -> torch.Tensor:
    backend = backend_class(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        block_size=block_size,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    metadata = backend.prepare(step.metadata)
    return backend.forward(0, step.q, step.k, step.v, step.kv_cache, metadata)


# sdpa's torch path, and the cpu backend's C kernel (built with the machine's C compiler), on the same steps.
BACKENDS = pytest.mark.parametrize("backend_class", [SdpaBackend, CpuBackend], ids=["sdpa", "cpu"])


@BACKENDS
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_naive_softmax_oracle(scenario, num_heads, num_kv_heads, block_size, backend_class):
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    step = make_step(SCENARIOS[scenario], **heads)
    out = run_backend(step, backend_class=backend_class, **heads)
    torch.testing.assert_close(out.double(), oracle(step), atol=1e-5, rtol=1e-5)


def infer_flash_or_skip() -> None:
    from infer.kernels import cpu as cpu_kernels

    if not cpu_kernels.load(True).flash:
        pytest.skip("infer's flash attention is built only where the CPU has avx512_bf16, which this one lacks")


@pytest.mark.parametrize(
    "kernel, pool, head_dim",
    [
        ("torch", torch.float32, HEAD_DIM),
        ("infer", torch.float32, 64),
        ("infer", torch.bfloat16, 64),
        ("infer", torch.float32, 128),
        ("infer", torch.bfloat16, 128),
        ("infer-fma", torch.float32, 64),
        ("infer-fma", torch.bfloat16, 64),
        ("infer-fma", torch.bfloat16, 128),
    ],
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cpu_bf16_prefill_attends_long_queries_in_bf16_and_keeps_the_rest_exact(
    scenario, num_heads, num_kv_heads, block_size, kernel, pool, head_dim
):
    """``prefill_dtype: bfloat16``: sequences of at least ``prefill_min_tokens`` query tokens go to a flash
    attention in bf16, torch's or infer's own (AVX512-BF16, head sizes a multiple of 64, SmolLM2's 64 and Qwen3's
    128 here; AMX tiles where the CPU has them; skipped where the CPU lacks it; on bf16 products or float32 FMAs),
    within bf16's error of the oracle, cached prefix or not, from a float32 or a bf16 pool; every other row stays the
    kernel's float32 (exact over the pool's K/V)."""
    from infer.plugins.attention.cpu import CpuAttentionConfig

    arithmetic = "float32" if kernel == "infer-fma" else "bf16"
    kernel = kernel.removesuffix("-fma")
    if kernel == "infer":
        infer_flash_or_skip()
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    step = make_step(SCENARIOS[scenario], head_dim=head_dim, **heads)
    if pool == torch.bfloat16:  # the oracle sees the K/V the pool holds
        step.kv_cache = step.kv_cache.to(pool)
        for index, (keys, values) in enumerate(zip(step.keys, step.values)):
            step.keys[index], step.values[index] = keys.bfloat16().float(), values.bfloat16().float()
    backend = CpuBackend(
        head_dim=head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
        config=CpuAttentionConfig(
            prefill_dtype="bfloat16", prefill_min_tokens=4, prefill_kernel=kernel, prefill_arithmetic=arithmetic
        ),
        **heads,
    )
    assert backend.prefill_kernel == kernel and backend.prefill_fma == (kernel == "infer" and arithmetic == "float32")
    metadata = backend.prepare(step.metadata)
    out = backend.forward(0, step.q, step.k, step.v, step.kv_cache, metadata).double()
    expected = oracle(step)
    long_rows = torch.zeros(len(out), dtype=torch.bool)
    if kernel == "infer":
        assert not metadata.prefills
        chunks = metadata.flash
        for start, query_len in zip(chunks.starts.tolist(), chunks.query_lens.tolist()) if chunks else ():
            long_rows[start : start + query_len] = True
    else:
        assert metadata.flash is None
        for prefill in metadata.prefills:
            long_rows[prefill.start : prefill.end] = True
    starts = step.metadata.query_start_loc.tolist()
    assert long_rows.tolist() == [
        new >= 4 for (_, new), start, end in zip(SCENARIOS[scenario], starts, starts[1:]) for _ in range(start, end)
    ]
    torch.testing.assert_close(out[~long_rows], expected[~long_rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[long_rows], expected[long_rows], atol=3e-2, rtol=3e-2)


def test_cpu_prefill_kernel_auto_takes_infers_flash_where_it_is_built_unless_amx_is_there_and_it_cannot_use_it(
    monkeypatch,
):
    """``prefill_kernel: auto``: infer's flash attention with this build's AVX512-BF16 code and a head size it
    takes; on a CPU with AMX only where its products run on the tiles (head sizes 64, 128 and 256), else torch's
    (oneDNN's AMX code), as where the kernel is missing; asking for infer's where it cannot run names what is
    missing."""
    from infer.attention import BackendUnavailableError
    from infer.plugins.attention import cpu as cpu_plugin

    def backend(head_dim: int, kernel: str = "auto") -> CpuBackend:
        config = cpu_plugin.CpuAttentionConfig(prefill_dtype="bfloat16", prefill_kernel=kernel)
        return CpuBackend(
            num_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
            config=config,
        )

    built = backend(64).kernels.flash
    flags = cpu_plugin.cpu_flags()
    monkeypatch.setattr(cpu_plugin, "cpu_flags", lambda: flags - {"amx_bf16"})
    assert backend(64).prefill_kernel == ("infer" if built else "torch")
    assert backend(32).prefill_kernel == "torch"
    assert not backend(64).prefill_fma  # arithmetic auto, unresolved by an engine: bf16
    assert (
        CpuBackend(
            num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=torch.device("cpu")
        ).prefill_kernel
        is None
    )  # prefill_dtype float32: no flash at all
    monkeypatch.setattr(cpu_plugin, "cpu_flags", lambda: flags | {"amx_bf16"})
    kernels = backend(64).kernels
    monkeypatch.setattr(kernels, "flash_amx", False)  # a build or an OS without the tiles
    assert backend(64).prefill_kernel == "torch"
    monkeypatch.setattr(kernels, "flash_amx", built)  # the tiles, where the kernel is built at all
    assert backend(64).prefill_kernel == ("infer" if built else "torch")
    assert backend(128).prefill_kernel == ("infer" if built else "torch")  # Qwen3's and Llama 3's head size
    assert backend(192).prefill_kernel == "torch"  # a multiple of 64 the tile kernel does not take
    assert backend(64, "torch").prefill_kernel == "torch"
    with pytest.raises(BackendUnavailableError, match="head size 32"):
        backend(32, "infer")


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cpu_bf16_pool_stores_kv_rounded_and_attends_exactly_over_it(scenario, num_heads, num_kv_heads, block_size):
    """``kv_dtype: bfloat16``: the step's K/V are written rounded to bf16, and every query attends over the rounded
    K/V exactly (float32 queries and sums), as the oracle does over the same rounded K/V."""
    from infer.plugins.attention.cpu import CpuAttentionConfig

    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    step = make_step(SCENARIOS[scenario], **heads)
    step.kv_cache = step.kv_cache.to(torch.bfloat16)
    for index, (keys, values) in enumerate(zip(step.keys, step.values)):
        step.keys[index], step.values[index] = keys.bfloat16().float(), values.bfloat16().float()
    backend = CpuBackend(
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
        config=CpuAttentionConfig(kv_dtype="bfloat16"),
        **heads,
    )
    assert backend.kv_dtype == torch.bfloat16
    out = backend.forward(0, step.q, step.k, step.v, step.kv_cache, backend.prepare(step.metadata))
    torch.testing.assert_close(out.double(), oracle(step), atol=1e-5, rtol=1e-5)
    slots = step.metadata.slot_mapping
    assert torch.equal(step.kv_cache[0].view(-1, num_kv_heads, HEAD_DIM)[slots], step.k.bfloat16())


def test_cpu_prefill_dtype_auto_follows_the_weights(tiny_model_dir):
    """The engine resolves ``auto``: with bf16 weights bf16 prefill attention and a bf16 pool (half the bytes a
    token), else the kernel alone over a float32 pool."""
    from infer import LLM

    base = dict(
        model__path=tiny_model_dir,
        model__dtype="float32",
        attention__name="cpu",
        model__max_model_len=256,
        cache__num_blocks=64,
    )
    bf16 = LLM("baseline", **base, model__quantization="bf16").engine
    assert bf16.attention.prefill_min_tokens == 32 and bf16.kv_cache.dtype == torch.bfloat16
    fp16 = LLM("baseline", **base, model__quantization="fp16").engine
    assert fp16.attention.prefill_min_tokens is None and fp16.kv_cache.dtype == torch.float32
    assert bf16.pool_plan.bytes_per_token * 2 == fp16.pool_plan.bytes_per_token


@BACKENDS
@pytest.mark.parametrize("seed", range(8))
def test_random_ragged_batches_match_oracle(seed, backend_class):
    rng = random.Random(seed)
    num_heads, num_kv_heads = rng.choice(HEAD_LAYOUTS)
    block_size = rng.choice([1, 8, 16])
    sequences = [(rng.choice([0, rng.randint(1, 40)]), rng.choice([1, rng.randint(1, 40)])) for _ in range(6)]
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    step = make_step(sequences, seed=seed, **heads)
    out = run_backend(step, backend_class=backend_class, **heads)
    torch.testing.assert_close(out.double(), oracle(step), atol=1e-5, rtol=1e-5)


@BACKENDS
def test_writes_this_steps_kv_at_slot_mapping(backend_class):
    heads = dict(num_heads=4, num_kv_heads=2, block_size=8)
    step = make_step(SCENARIOS["mixed"], **heads)
    run_backend(step, backend_class=backend_class, **heads)
    flat = step.kv_cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
    torch.testing.assert_close(flat[0, step.metadata.slot_mapping], step.k)
    torch.testing.assert_close(flat[1, step.metadata.slot_mapping], step.v)


@BACKENDS
def test_unprepared_metadata_gives_same_output(backend_class):
    heads = dict(num_heads=4, num_kv_heads=2, block_size=8)
    step = make_step(SCENARIOS["mixed"], **heads)
    backend = backend_class(head_dim=HEAD_DIM, dtype=torch.float32, device=torch.device("cpu"), **heads)
    out = backend.forward(0, step.q, step.k, step.v, step.kv_cache, step.metadata)
    torch.testing.assert_close(out.double(), oracle(step), atol=1e-5, rtol=1e-5)


def test_bfloat16_stays_within_dtype_tolerance():
    heads = dict(num_heads=4, num_kv_heads=2, block_size=16)
    step = make_step(SCENARIOS["mixed"], dtype=torch.bfloat16, **heads)
    out = run_backend(step, dtype=torch.bfloat16, **heads)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle(step), atol=3e-2, rtol=3e-2)


def test_registers_as_sdpa():
    registered = {}

    def register(name, target, config=None, description=""):
        registered[name] = (target, description)

    attention_plugins.register_attention_backends(register)
    target, description = registered["sdpa"]
    module_name, class_name = target.split(":")
    assert getattr(__import__(module_name, fromlist=[class_name]), class_name) is SdpaBackend
    assert description


def test_shared_block_prefixes_groups_rows_by_their_deepest_shared_run():
    tables = [
        [1, 2, 3, 4, 9],  # shares 4 blocks with row 1
        [1, 2, 3, 4, 8],
        [1, 2, 5, 6],  # shares only blocks 1, 2 with rows 0, 1, 2 and 3 blocks with row 3
        [1, 2, 5, 7],
        [1, 2, 6],  # shares 2 blocks with rows 0-3, whose deeper runs claim them
        [3, 3, 3],  # shares nothing
    ]
    groups = sdpa_plugin.shared_block_prefixes(tables, limits=[5, 4, 4, 4, 3, 3])
    assert sorted(groups) == [(3, [2, 3]), (4, [0, 1])]
    # A limit stops the run: row 1 may share only its first 2 blocks (its query starts in block 3).
    assert sorted(sdpa_plugin.shared_block_prefixes(tables[:2], limits=[5, 2])) == [(2, [0, 1])]


@pytest.mark.parametrize("query_len", [1, 3])
def test_cascade_attends_each_shared_prefix_once_and_matches_without_it(monkeypatch, query_len):
    # 6 sequences: two groups of 3 sharing 160 / 144 tokens of blocks, decoding or verifying 3 tokens.
    from infer.testing.attention import PagedContext, shared_prefix_step

    groups = [(160, [170, 181, 200]), (144, [150, 149, 160])]
    backends = {
        cascade: SdpaBackend(
            num_heads=6,
            num_kv_heads=2,
            head_dim=HEAD_DIM,
            block_size=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
            config=sdpa_plugin.SdpaConfig(cascade=cascade),
        )
        for cascade in (True, False)
    }
    shapes = shared_prefix_step(groups, [query_len] * 6)
    calls = []
    gather = sdpa_plugin.gather_blocks
    monkeypatch.setattr(
        sdpa_plugin,
        "gather_blocks",
        lambda cache, ids, dtype, out=None: calls.append(len(ids)) or gather(cache, ids, dtype, out),
    )
    outputs = {}
    for cascade, backend in backends.items():
        context = PagedContext.create_shared(backend, groups, seed=3)
        context.write_prefix([cached for cached, _ in shapes])
        query = context.random_query(shapes)
        calls.clear()
        outputs[cascade] = context.forward(shapes, query)
        torch.testing.assert_close(outputs[cascade].double(), context.expected(shapes, query), atol=1e-5, rtol=1e-5)
        metadata = backend.prepare(AttentionMetadata.build(context.block_tables, *zip(*shapes), 16))
        if cascade:
            assert metadata.padded.shared.num_groups == 2
            # Each row's own blocks after the shared ones (at most 3), then both groups' shared blocks (10, padded).
            assert calls == [6 * 3, 2 * 10]
        else:
            assert metadata.padded.shared is None and calls == [6 * 13]
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots_and_writes_the_rest():
    kv_cache = torch.zeros(2, 4, 2, 1, HEAD_DIM)  # 8 slots
    k, v = torch.randn(3, 1, HEAD_DIM), torch.randn(3, 1, HEAD_DIM)
    write_kv(kv_cache, k, v, torch.tensor([5, -1, 0]))
    flat = kv_cache.view(2, 8, 1, HEAD_DIM)
    assert torch.equal(flat[0, [5, 0]], k[[0, 2]]) and torch.equal(flat[1, [5, 0]], v[[0, 2]])
    assert flat[:, [1, 2, 3, 4, 6, 7]].abs().sum() == 0
