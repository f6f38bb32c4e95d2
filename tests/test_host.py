"""``infer.host``: the KV pool's memory (zeroed pages the kernel maps in as they are first written), the streamed
weights' huge pages, and the heap's freed pages handed back during a load."""

from __future__ import annotations

import sys

import pytest
import torch

from infer.host import HUGE_PAGE, streamed_empty, trim_heap, zeroed_pages


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_zeroed_pages_are_zero_writable_and_shaped():
    pool = zeroed_pages((3, 2, 5, 16, 2, 8), torch.bfloat16)
    assert pool.shape == (3, 2, 5, 16, 2, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any()
    pool[1, 0, 4] = 2.5
    assert pool.sum().item() == 2.5 * 16 * 2 * 8
    assert zeroed_pages((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_zeroed_pages_become_resident_only_when_written():
    size = 256 << 20
    before = resident_bytes()
    pool = zeroed_pages((size // 4,), torch.float32)
    assert resident_bytes() - before < size // 4
    pool[: size // 8].fill_(1.0)  # half of it written
    assert resident_bytes() - before >= size // 2 - (8 << 20)
    assert pool[size // 8 :].abs().sum().item() == 0 and pool.sum().item() == size // 8


def test_large_mappings_start_on_a_huge_page_and_small_weights_stay_on_the_heap():
    for count in (HUGE_PAGE // 2, 3 * HUGE_PAGE // 2 + 6, 5 * HUGE_PAGE // 2):  # bytes of bf16: 1, 3 and 5 MiB (+12)
        tensor = zeroed_pages((count,), torch.bfloat16)
        assert tensor.numel() == count and not tensor.any()
        if count * 2 >= HUGE_PAGE:
            assert tensor.data_ptr() % HUGE_PAGE == 0
        tensor[-1] = 1.0  # the mapping's last element is the tensor's: the slack lies before it
        assert tensor.sum().item() == 1.0
    small = streamed_empty((HUGE_PAGE // 8,), torch.float32)  # a quarter of a huge page: torch's allocator
    large = streamed_empty((HUGE_PAGE // 2, 2), torch.int8)
    assert small.untyped_storage().nbytes() == HUGE_PAGE // 2 and large.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mappings' huge pages from /proc")
def test_packed_weights_lie_on_huge_pages_where_the_kernel_offers_them():
    """A tile-packed projection of 8 MiB is backed by transparent huge pages when the kernel grants them on
    request; where it grants none (``never``, or no free huge page), it still equals the plain packing."""
    from infer.kernels.cpu.packing import pack_tiles, unpack_tiles

    weight = torch.randn(4096, 1024).to(torch.bfloat16)
    tiles = pack_tiles(weight)
    assert torch.equal(unpack_tiles(tiles), weight) and tiles.data_ptr() % HUGE_PAGE == 0
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
        if "[never]" in mode.read():
            pytest.skip("transparent huge pages are off on this host")
    start = tiles.data_ptr()
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    huge = 0
    for i, line in enumerate(lines):
        fields = line.split()
        if "-" in fields[0] and int(fields[0].split("-")[0], 16) <= start < int(fields[0].split("-")[1], 16):
            huge = next(int(entry.split()[1]) for entry in lines[i + 1 :] if entry.startswith("AnonHugePages:"))
            break
    if huge == 0:
        pytest.skip("the kernel granted no huge page (none free, or defragmentation off)")
    assert huge * 1024 >= 6 * HUGE_PAGE // 2  # 3 of the 4 whole huge pages at least


def test_a_cpu_backend_allocates_its_pool_over_zeroed_pages(monkeypatch):
    from infer import attention
    from infer.attention import AttentionBackend

    calls = []
    monkeypatch.setattr(
        attention, "zeroed_pages", lambda shape, dtype: calls.append(shape) or torch.zeros(shape, dtype=dtype)
    )
    backend = type("Backend", (AttentionBackend,), {"forward": lambda *args: None})(
        num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32, device=torch.device("cpu")
    )
    pool = backend.allocate_kv_cache(num_layers=3, num_blocks=5)
    assert pool.shape == (3, 2, 5, 16, 2, 8) and calls == [pool.shape]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, read from /proc")
def test_trim_heap_hands_back_the_pages_of_freed_blocks_between_live_ones():
    """Every other one of 2,000 heap blocks of 64 KiB freed: the holes stay resident until ``trim_heap``, which
    hands back most of their 62 MiB while the live blocks keep their bytes."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 10  # under glibc's mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(2000)]
    for block in blocks:
        ctypes.memset(block, 7, size)
    for block in blocks[::2]:
        libc.free(block)
    before = resident_bytes()
    trim_heap()
    assert before - resident_bytes() > 1000 * size // 2
    assert all(ctypes.string_at(block, 4) == b"\x07" * 4 for block in blocks[1::2])
    for block in blocks[1::2]:
        libc.free(block)
