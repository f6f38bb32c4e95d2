"""Decode attention's achieved memory bandwidth on a CUDA GPU, as a fraction of the device's peak.

Decode attention is memory-bound: each step reads every cached K and V once. Achieved bandwidth is those bytes
(batch x context x 2 x num_kv_heads x head_dim x dtype size) over the time of one layer's ``forward`` (which also
writes one token's K/V per sequence: negligible). Each call is timed from a cold L2 (``triton.testing.do_bench``
flushes it), so small batches cannot read from cache. Prints a markdown table, one row per (batch, context).

    python benchmarks/attention_bandwidth.py                    # triton next to sdpa, peak looked up by device name
    python benchmarks/attention_bandwidth.py --peak-gbps 3350 --batch-sizes 1 8 --context-lens 2048

Backends are loaded by name through the plugin registry, so any registered backend can be compared.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from infer.attention import AttentionBackend, AttentionMetadata

# Peak HBM bandwidth in GB/s (1e9 bytes/s) from vendor datasheets, matched against torch's device name in order:
# the first entry whose key is part of the name wins, so specific variants come before their family.
PEAK_BANDWIDTH_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB variants
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, help="device peak memory bandwidth in GB/s (default: by name)")
    parser.add_argument("--backends", nargs="+", default=["triton", "sdpa"], help="registered attention backends")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--context-lens", nargs="+", type=int, default=[1024, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    return parser.parse_args()


def peak_bandwidth_gbps(device_name: str) -> float | None:
    for key, gbps in PEAK_BANDWIDTH_GBPS:
        if key in device_name:
            return gbps
    return None


def decode_step(arguments: argparse.Namespace, batch_size: int, context_len: int, device: torch.device):
    """A decode step (one new token per sequence at position ``context_len - 1``) over blocks scattered through
    the pool in random order, as a long-running server's pool ends up. Returns ``(q, k, v, kv_cache, metadata)``."""
    dtype = DTYPES[arguments.dtype]
    blocks_per_seq = math.ceil(context_len / arguments.block_size)
    num_blocks = 1 + batch_size * blocks_per_seq  # block 0 is the null block
    block_tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch_size, blocks_per_seq).int()
    kv_cache = torch.randn(
        2, num_blocks, arguments.block_size, arguments.num_kv_heads, arguments.head_dim, dtype=dtype, device=device
    )
    position = context_len - 1
    slot_mapping = block_tables[:, position // arguments.block_size].long() * arguments.block_size
    metadata = AttentionMetadata(
        positions=torch.full((batch_size,), position, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch_size,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=slot_mapping + position % arguments.block_size,
        max_query_len=1,
        max_seq_len=context_len,
        query_lens_cpu=[1] * batch_size,
        seq_lens_cpu=[context_len] * batch_size,
    )
    q = torch.randn(batch_size, arguments.num_heads, arguments.head_dim, dtype=dtype, device=device)
    k, v = torch.randn(2, batch_size, arguments.num_kv_heads, arguments.head_dim, dtype=dtype, device=device)
    return q, k, v, kv_cache, metadata


def make_backend(name: str, arguments: argparse.Namespace, device: torch.device) -> AttentionBackend:
    from infer.registry import get_registry

    backend_class = get_registry().load("attention", name)
    return backend_class(
        num_heads=arguments.num_heads,
        num_kv_heads=arguments.num_kv_heads,
        head_dim=arguments.head_dim,
        block_size=arguments.block_size,
        dtype=DTYPES[arguments.dtype],
        device=device,
    )


def time_forward_ms(backend: AttentionBackend, q, k, v, kv_cache, metadata: AttentionMetadata) -> float:
    """Median milliseconds of one ``forward`` from a cold L2; the per-step ``prepare`` is left out, as in a model
    it runs once for all layers."""
    from triton.testing import do_bench

    prepared = backend.prepare(metadata)
    return do_bench(lambda: backend.forward(0, q, k, v, kv_cache, prepared), return_mode="median")


def kv_bytes_read(arguments: argparse.Namespace, batch_size: int, context_len: int) -> int:
    element_size = torch.empty((), dtype=DTYPES[arguments.dtype]).element_size()
    return 2 * batch_size * context_len * arguments.num_kv_heads * arguments.head_dim * element_size


def main() -> None:
    arguments = parse_arguments()
    if not torch.cuda.is_available():
        sys.exit(
            "attention_bandwidth.py measures GPU memory bandwidth and needs a CUDA device; none was found. "
            "(To check the triton kernels' correctness on the CPU: pytest tests/test_triton_attention.py)"
        )
    device = torch.device("cuda")
    device_name = torch.cuda.get_device_name(device)
    peak = arguments.peak_gbps or peak_bandwidth_gbps(device_name)
    if peak is None:
        sys.exit(f"no peak bandwidth known for {device_name!r}; pass --peak-gbps (the datasheet value, in GB/s)")
    backends = {name: make_backend(name, arguments, device) for name in arguments.backends}
    print(
        f"{device_name}, peak {peak:.0f} GB/s; decode, {arguments.dtype}, {arguments.num_heads} query / "
        f"{arguments.num_kv_heads} KV heads, head_dim {arguments.head_dim}, block_size {arguments.block_size}\n"
    )
    header = ["batch", "context", "KV read (MB)"]
    for name in backends:
        header += [f"{name} µs", f"{name} GB/s", f"{name} % of peak"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for context_len in arguments.context_lens:
        for batch_size in arguments.batch_sizes:
            inputs = decode_step(arguments, batch_size, context_len, device)
            num_bytes = kv_bytes_read(arguments, batch_size, context_len)
            row = [str(batch_size), str(context_len), f"{num_bytes / 1e6:.1f}"]
            for backend in backends.values():
                milliseconds = time_forward_ms(backend, *inputs)
                gbps = num_bytes / (milliseconds * 1e-3) / 1e9
                row += [f"{milliseconds * 1e3:.1f}", f"{gbps:.0f}", f"{100 * gbps / peak:.0f}%"]
            print("| " + " | ".join(row) + " |")
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
