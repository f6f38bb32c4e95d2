"""The ``triton`` attention backend agrees with a naive softmax oracle on ragged, paged, GQA batches.

Without CUDA the kernels run in Triton's CPU interpreter (correct, slow), so every shape here is tiny. Triton reads
``TRITON_INTERPRET`` when it is first imported, so the variable is set here, before anything imports it, for the rest
of the session: on a machine without CUDA that is the only way Triton kernels can run at all.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import infer.plugins.attention as attention_plugins  # noqa: E402
from infer.attention import AttentionMetadata, BackendUnavailableError, write_kv  # noqa: E402
from infer.plugins.attention.triton_backend import TritonAttentionConfig, TritonBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# (query_len, seq_len): a fresh prefill, a chunk after a cached prefix, a decode, a 1 + 3 verification, a first token.
MIXED_BATCH = [(9, 9), (6, 23), (1, 37), (4, 18), (1, 1)]


@dataclass
class PagedBatch:
    """One step's inputs, plus every sequence's full K/V kept outside the pool for the oracle."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim], this step's tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], cached prefixes already written
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_batch(
    query_and_seq_lens: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A ragged batch whose blocks are scattered over the pool in shuffled order, with cached prefixes in place."""
    generator = torch.Generator().manual_seed(seed)
    query_lens = [query_len for query_len, _ in query_and_seq_lens]
    seq_lens = [seq_len for _, seq_len in query_and_seq_lens]
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len in seq_lens]
    num_blocks = 1 + 2 * sum(blocks_per_seq)  # block 0 is the null block; spare blocks leave gaps
    free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(blocks_per_seq) + 2  # padding columns the kernel must never need
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([free_blocks.pop() for _ in range(count)])

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    keys = [random(seq_len, num_kv_heads, head_dim) for seq_len in seq_lens]
    values = [random(seq_len, num_kv_heads, head_dim) for seq_len in seq_lens]
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    cached = [range(seq_len - query_len) for query_len, seq_len in query_and_seq_lens]
    new = [range(seq_len - query_len, seq_len) for query_len, seq_len in query_and_seq_lens]
    write_kv(
        kv_cache,
        torch.cat([k[: len(p)] for k, p in zip(keys, cached)]),
        torch.cat([v[: len(p)] for v, p in zip(values, cached)]),
        slots(block_tables, cached, block_size),
    )
    num_tokens = sum(query_lens)
    # Slices of one fused QKV tensor, as a model produces them: strided, not contiguous.
    fused = random(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    fused[:, num_heads : num_heads + num_kv_heads] = torch.cat([k[p.start :] for k, p in zip(keys, new)])
    fused[:, num_heads + num_kv_heads :] = torch.cat([v[p.start :] for v, p in zip(values, new)])
    fused = fused.to(DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        positions=torch.tensor([p for r in new for p in r], device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=slots(block_tables, new, block_size).to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(
        query=fused[:, :num_heads],
        key=fused[:, num_heads : num_heads + num_kv_heads],
        value=fused[:, num_heads + num_kv_heads :],
        kv_cache=kv_cache.to(DEVICE),
        metadata=metadata,
        keys=keys,
        values=values,
    )


def slots(block_tables: torch.Tensor, positions_per_seq: list[range], block_size: int) -> torch.Tensor:
    return torch.tensor(
        [
            int(block_tables[seq, position // block_size]) * block_size + position % block_size
            for seq, positions in enumerate(positions_per_seq)
            for position in positions
        ],
        dtype=torch.int64,
    )


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Full softmax per sequence in float64, bottom-right causal, on the K/V kept outside the pool."""
    outputs = []
    query = batch.query.cpu().double()
    starts = batch.metadata.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.metadata.seq_lens_cpu):
        seq_query = query[starts[seq] : starts[seq + 1]]  # [q, num_heads, head_dim]
        group = seq_query.shape[1] // batch.keys[seq].shape[1]
        keys = batch.keys[seq].double().repeat_interleave(group, dim=1)
        values = batch.values[seq].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", seq_query, keys) * scale
        query_positions = torch.arange(seq_len - seq_query.shape[0], seq_len)
        visible = torch.arange(seq_len)[None, :] <= query_positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outputs)


def make_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, **config
) -> TritonBackend:
    return TritonBackend(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        config=TritonAttentionConfig(**config),
    )


def run_and_compare(backend: TritonBackend, batch: PagedBatch) -> None:
    output = backend.forward(0, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    expected = reference_attention(batch, backend.scale)
    assert output.shape == batch.query.shape and output.dtype == batch.query.dtype
    torch.testing.assert_close(output.cpu().double(), expected, **TOLERANCES[backend.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_mixed_batch_matches_softmax_oracle(block_size, num_heads, num_kv_heads, dtype):
    backend = make_backend(num_heads, num_kv_heads, 32, block_size, dtype)
    batch = make_batch(
        MIXED_BATCH, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size, dtype=dtype
    )
    assert backend.num_kv_splits(batch.metadata, backend.rows_per_program(batch.metadata)) == 1
    run_and_compare(backend, batch)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_prefill_longer_than_one_query_tile_matches_oracle(num_heads, num_kv_heads):
    backend = make_backend(num_heads, num_kv_heads, 32, 16, torch.float32)
    batch = make_batch(
        [(70, 90), (1, 5), (33, 33)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    assert backend.rows_per_program(batch.metadata) // backend.queries_per_kv < 70
    run_and_compare(backend, batch)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_every_supported_head_dim_matches_oracle_in_float16(head_dim):
    backend = make_backend(4, 2, head_dim, 16, torch.float16)
    batch = make_batch(
        MIXED_BATCH, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float16, seed=1
    )
    run_and_compare(backend, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("query_lens", [(1, 1), (3, 1)], ids=["decode", "verification"])
def test_long_decode_splits_the_kv_axis_and_matches_oracle(query_lens, dtype):
    backend = make_backend(4, 1, 32, 8, dtype, min_tokens_per_split=32)
    seq_lens = (150, 97)
    batch = make_batch(
        list(zip(query_lens, seq_lens)), num_heads=4, num_kv_heads=1, head_dim=32, block_size=8, dtype=dtype, seed=2
    )
    assert backend.num_kv_splits(batch.metadata, backend.rows_per_program(batch.metadata)) == 4
    run_and_compare(backend, batch)


def test_split_count_follows_the_batch():
    backend = make_backend(4, 1, 32, 8, torch.float32, min_tokens_per_split=32, max_kv_splits=2)

    def splits(query_and_seq_lens):
        metadata = make_batch(
            query_and_seq_lens, num_heads=4, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float32
        ).metadata
        return backend.num_kv_splits(metadata, backend.rows_per_program(metadata))

    assert splits([(1, 150)]) == 2, "capped by max_kv_splits"
    assert splits([(1, 40)]) == 1, "too short to split"
    assert splits([(1, 150)] * 8) == 1, "enough sequences to fill the device"
    assert splits([(30, 150)]) == 1, "a prefill chunk already spans several programs"


def test_kv_write_stores_every_token_at_its_slot_and_skips_padding():
    backend = make_backend(2, 2, 16, 8, torch.float32)
    batch = make_batch([(5, 12), (3, 3)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    slot_mapping = batch.metadata.slot_mapping.clone()
    slot_mapping[[1, 6]] = -1
    pool = torch.full_like(batch.kv_cache, 7.0)
    expected = pool.clone()
    write_kv(expected, batch.key, batch.value, slot_mapping)
    backend.kernels.store_kv(pool, batch.key, batch.value, slot_mapping)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize(
    "query_and_seq_lens,config",
    [(MIXED_BATCH, {}), ([(1, 150), (3, 97)], {"min_tokens_per_split": 32})],
    ids=["mixed", "split-decode"],
)
def test_matches_sdpa_backend_on_the_same_inputs(query_and_seq_lens, config):
    sdpa = pytest.importorskip("infer.plugins.attention.sdpa")
    shape = {"num_heads": 4, "num_kv_heads": 1, "head_dim": 32, "block_size": 8, "dtype": torch.float32}
    batch = make_batch(query_and_seq_lens, **shape, seed=3)
    outputs = [
        backend.forward(0, batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata)
        for backend in (make_backend(**shape, **config), sdpa.SdpaBackend(**shape, device=DEVICE))
    ]
    torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCES[torch.float32])


@pytest.mark.skipif(torch.cuda.is_available(), reason="only a machine without CUDA refuses")
def test_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU; set TRITON_INTERPRET=1.*attention.name=sdpa"):
        make_backend(2, 2, 32, 16, torch.float32)


@pytest.mark.parametrize(
    "head_dim,block_size,dtype,message",
    [(80, 16, torch.float32, "head_dim"), (32, 12, torch.float32, "block_size"), (32, 16, torch.float64, "dtypes")],
)
def test_refuses_unsupported_settings(head_dim, block_size, dtype, message):
    with pytest.raises(BackendUnavailableError, match=message):
        make_backend(2, 2, head_dim, block_size, dtype)


def test_registry_loads_the_backend_and_its_config_by_name():
    from infer.registry import Registry

    registry = Registry.from_plugins([attention_plugins])
    assert registry.load("attention", "triton") is TritonBackend
    assert registry.config_model("attention", "triton") is TritonAttentionConfig


def run_python(code: str, **environment: str) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **environment}, capture_output=True, text=True)


def test_registering_imports_neither_torch_nor_triton():
    """Every built-in plugin package registers from its ``__init__`` with lazy targets: importing them all (what
    ``infer plugins`` does) loads no heavy module."""
    result = run_python(
        "import sys, importlib\n"
        "for package in ('allocators', 'schedulers', 'attention', 'prefix_cache', 'drafters', 'drafters.eagle',\n"
        "                'guides'):\n"
        "    importlib.import_module(f'infer.plugins.{package}')\n"
        "print(sorted({'torch', 'triton', 'xgrammar', 'llguidance'} & set(sys.modules)))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA an early import is the normal case")
def test_interpreter_requested_after_triton_import_is_refused_clearly():
    result = run_python(
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from infer.plugins.attention.triton_backend import TritonBackend\n"
        "TritonBackend(num_heads=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device='cpu')"
    )
    assert "TRITON_INTERPRET=1 was set after triton was imported" in result.stderr
