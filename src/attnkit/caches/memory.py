"""Where cache buffers live: zeroed tensors that, on a Linux CPU, sit on transparent huge pages.

A decode step reads the whole cache, and a paged pool is read in a scattered order: with 4 KiB
pages every few blocks cost a TLB miss and a page walk, which a 2 MiB page removes (the scattered
rows of ``benchmarks/bench_paged.py``). Linux gives huge pages to anonymous private memory that
asks for them (``madvise(MADV_HUGEPAGE)``) when ``/sys/kernel/mm/transparent_hugepage/enabled``
is ``always`` or ``madvise``; torch's CPU allocator only does so under the process-wide
``THP_MEM_ALLOC_ENABLE``, which a library must not set. So a cache buffer of at least one huge
page is its own private anonymous mapping, aligned to the huge page and advised, wrapped as a
tensor (the tensor keeps the mapping alive; it is unmapped with the last view). The tensor's
storage is exactly its bytes, from the aligned start: the mapping's slack before it (what finding
an aligned start takes) is never touched and never part of the storage, so ``torch.save``,
pickle and ``deepcopy`` copy the buffer and nothing more. Everything else, other devices and
other systems, gets ``torch.zeros``.
"""

from __future__ import annotations

import functools
import math
import mmap

import torch
from torch import Tensor

__all__ = ["zeros", "huge_page_size"]

_THP = "/sys/kernel/mm/transparent_hugepage"


@functools.lru_cache(maxsize=1)
def huge_page_size() -> int:
    """Bytes of a transparent huge page when this system hands them to advised memory, else 0
    (not Linux, THP ``never`` or absent, or no ``MADV_HUGEPAGE`` in this Python)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        with open(f"{_THP}/enabled") as f:
            mode = f.read()
        if "[never]" in mode:
            return 0
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device=None) -> Tensor:
    """A contiguous zero tensor of ``shape`` and ``dtype`` on ``device`` (default CPU), as
    ``torch.zeros``; on a CPU, at least one huge page large and where :func:`huge_page_size` is
    non-zero, backed by its own advised mapping whose pages are touched here (the memory is
    committed now, as ``torch.zeros`` commits it, not at a later write)."""
    shape = tuple(int(s) for s in shape)
    dev = torch.device("cpu") if device is None else torch.device(device)
    page = huge_page_size()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if dev.type != "cpu" or page == 0 or nbytes < page:
        return torch.zeros(shape, dtype=dtype, device=dev)
    # A mapping starts on a base page, so at most one huge page less one base page of slack puts
    # an aligned start inside it; the slack is never touched, so it costs address space only.
    try:
        mapping = mmap.mmap(-1, nbytes + page - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    except OSError:  # no mapping to spare (vm.max_map_count, a strict overcommit limit): torch's
        return torch.zeros(shape, dtype=dtype, device=dev)  # allocator, and its error if memory is short
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % page
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel that refuses the advice still gives plain pages
        pass
    # A storage of exactly these bytes, holding the mapping (not a copy) until the last view goes.
    out = torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=nbytes).view(dtype).view(shape)
    return out.zero_()  # fault the pages in now (anonymous memory already reads as zero)
