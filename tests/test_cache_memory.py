"""Cache buffers on transparent huge pages (``attnkit.caches.memory``): the same zeros as
``torch.zeros``, aligned and advised where the system gives huge pages, alive as long as any view,
and what every cache kind allocates its K/V from."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from attnkit.caches import PagedKVCache, SlidingWindowCache, StaticCache, memory

PAGE = memory.huge_page_size()
needs_thp = pytest.mark.skipif(PAGE == 0, reason="this system gives no transparent huge pages to advised memory")


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=str)
@pytest.mark.parametrize("shape", [(0, 4, 0, 8), (3, 5), (2, 4, 9000, 64), (4097, 16, 8, 32)], ids=str)
def test_zeros_equal_torch_zeros(shape, dtype):
    x = memory.zeros(shape, dtype=dtype)
    assert x.shape == shape and x.dtype == dtype and x.device.type == "cpu" and x.is_contiguous()
    assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x.float(),
                       torch.zeros(shape, dtype=torch.uint8 if x.element_size() == 1 else torch.float32))
    if x.numel():
        x.view(-1)[-1] = 1  # writable to its last element
        assert x.view(-1)[-1].item() == 1 and x.view(-1)[0].item() == 0


def test_other_devices_get_torch_zeros():
    x = memory.zeros((1024, 1024, 4), dtype=torch.float32, device="meta")
    assert x.device.type == "meta" and x.shape == (1024, 1024, 4)


@needs_thp
def test_large_buffer_is_aligned_and_advised():
    x = memory.zeros((PAGE // 4 * 3 + 5,), dtype=torch.float32)  # three pages and a bit
    assert x.data_ptr() % PAGE == 0
    assert "hg" in vm_flags(x.data_ptr()), "the buffer's mapping was not advised MADV_HUGEPAGE"
    small = memory.zeros((PAGE // 8,), dtype=torch.float32)  # below one page: torch's allocator
    assert small.untyped_storage().nbytes() == PAGE // 2


@needs_thp
def test_a_view_keeps_the_mapping_alive():
    x = memory.zeros((4, PAGE // 4), dtype=torch.float32)
    x[3].fill_(7.0)
    tail = x[3, -16:]
    del x
    gc.collect()
    assert torch.equal(tail, torch.full((16,), 7.0))  # a use-after-unmap would fault here
    tail += 1
    assert torch.equal(tail, torch.full((16,), 8.0))


def test_a_refused_mapping_falls_back_to_torch_zeros(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    x = memory.zeros((4, 1 << 20), dtype=torch.float32)
    assert x.shape == (4, 1 << 20) and x.untyped_storage().nbytes() == 16 << 20 and torch.count_nonzero(x) == 0


def test_without_the_advice_it_is_torch_zeros(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    memory.huge_page_size.cache_clear()
    try:
        assert memory.huge_page_size() == 0
        x = memory.zeros((1 << 20,), dtype=torch.float32)
        assert x.untyped_storage().nbytes() == 4 << 20 and torch.count_nonzero(x) == 0
    finally:
        monkeypatch.undo()
        memory.huge_page_size.cache_clear()


@needs_thp
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_every_cache_kind_allocates_from_it(kv_dtype):
    H, D, n = 8, 128, 2048  # 8 x 128 x 2048 rows: a few MiB in any storage dtype
    caches = {
        "static": StaticCache(H, D, max_batch=2, max_len=n, kv_dtype=kv_dtype),
        "paged": PagedKVCache(H, D, num_blocks=2 * n // 16, block_size=16, kv_dtype=kv_dtype),
        "sliding": SlidingWindowCache(H, D, window=n, max_batch=2, kv_dtype=kv_dtype),
    }
    for name, cache in caches.items():
        data = [b for b in cache.buffers() if b.dim() >= 3 and b.numel() * b.element_size() >= PAGE]
        assert len(data) >= 2, name
        for b in data:
            assert b.data_ptr() % PAGE == 0 and "hg" in vm_flags(b.data_ptr()), (name, b.shape)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, H, 5, D, generator=g), torch.randn(2, H, 5, D, generator=g)
    q = torch.randn(2, H, 1, D, generator=g)
    outs = {}
    for name, cache in caches.items():  # and they work as caches: the same prefix, the same step
        cache.update(k[:, :, :4], v[:, :, :4])
        outs[name] = cache.attend(q, k[:, :, 4:], v[:, :, 4:])
    torch.testing.assert_close(outs["paged"], outs["static"])
    torch.testing.assert_close(outs["sliding"], outs["static"])


@needs_thp
@pytest.mark.parametrize("nbytes", [PAGE, 4 * PAGE, 3 * PAGE + 4096 + 12], ids=["one page", "four pages", "odd"])
def test_a_buffer_storage_is_its_tensor_bytes(nbytes, tmp_path):
    """A huge-page buffer's storage is exactly the tensor's bytes (alignment kept inside the
    mapping), so torch.save, pickle and deepcopy of a cache write and copy the buffer, not an
    extra huge page per buffer."""
    import copy
    import pickle

    x = memory.zeros((nbytes,), dtype=torch.int8)
    assert x.data_ptr() % PAGE == 0 and "hg" in vm_flags(x.data_ptr())
    assert x.untyped_storage().nbytes() == x.nbytes == nbytes
    assert x.untyped_storage().data_ptr() == x.data_ptr()
    torch.save(x, tmp_path / "x.pt")
    assert (tmp_path / "x.pt").stat().st_size < nbytes + 64 * 1024
    assert len(pickle.dumps(x)) < nbytes + 64 * 1024
    assert copy.deepcopy(x).untyped_storage().nbytes() == nbytes
    cache = StaticCache(8, 128, max_batch=2, max_len=2048, kv_dtype="int8")  # 4 MiB int8 buffers
    bufs = [b for b in cache.buffers() if b.numel() * b.element_size() >= PAGE]
    assert bufs and all(b.untyped_storage().nbytes() == b.nbytes for b in bufs)
    twin = copy.deepcopy(cache)
    assert sum(b.untyped_storage().nbytes() for b in twin.buffers()) == cache.nbytes
