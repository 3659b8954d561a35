"""``new_cache(kind, dims, ...)``: one place that turns a cache kind name into an empty cache."""

from __future__ import annotations

import torch

from .allocator import BlockAllocator
from .contiguous import DynamicCache, StaticCache
from .paged import PagedKVCache
from .protocol import KVCache
from .sliding import SlidingWindowCache

__all__ = ["new_cache"]


def new_cache(kind: str, dims: tuple[int, int, int], *, value_from_key: bool = False, max_batch: int | None = None,
              max_len: int | None = None, window: int | None = None, allocator: BlockAllocator | None = None,
              dtype=torch.float32, device=None, kv_dtype=None, k_channel_scale=None) -> KVCache:
    """An empty cache of ``kind`` storing (B, Hkv, L, D) keys and (B, Hkv, L, Dv) values,
    (Hkv, D, Dv) = ``dims``: "dynamic", "static" (needs
    max_batch, max_len), "sliding" (needs window, max_batch; not with value_from_key) or "paged"
    (needs the allocator the model's layers share). Modules' ``new_cache`` methods call this.
    ``kv_dtype``: None (K/V stored in ``dtype``), "int8" or "fp8_e4m3" (quantized rows with fp32
    scales; :class:`~attnkit.caches.KVCache`); ``k_channel_scale``: None (on for int8, off for
    fp8), True / False, or an (Hkv, D) tensor: K's fixed per-channel scale (the same class)."""
    need = {"dynamic": (), "static": ("max_batch", "max_len"), "sliding": ("window", "max_batch"),
            "paged": ("allocator",)}
    if kind not in need:
        raise ValueError(f"kind must be one of {sorted(need)}, got {kind!r}")
    given = {"max_batch": max_batch, "max_len": max_len, "window": window, "allocator": allocator}
    missing = [n for n in need[kind] if given[n] is None]
    if missing:
        raise ValueError(f"a {kind} cache needs {', '.join(missing)}")
    kw = dict(dtype=dtype, device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
    if kind == "sliding":
        if value_from_key:
            raise ValueError("a sliding cache stores K and V separately (value_from_key is not supported)")
        return SlidingWindowCache(*dims, window=window, max_batch=max_batch, **kw)
    kw["value_from_key"] = value_from_key
    if kind == "dynamic":
        return DynamicCache(*dims, **kw)
    if kind == "static":
        return StaticCache(*dims, max_batch=max_batch, max_len=max_len, **kw)
    return PagedKVCache(*dims, allocator=allocator, **kw)
