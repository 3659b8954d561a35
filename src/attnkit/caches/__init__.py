"""KV caches: one protocol (``begin`` / ``write`` / ``view`` / ``commit`` / ``abort`` steps,
``update``, ``attend``, ``transaction``, ``lengths``, ``positions``, ``nbytes``,
``bytes_per_token``, ``reset``, ``crop``, ``reorder``), several kinds, and :func:`step` to run
several layers' caches as one transaction."""

from .allocator import BlockAllocator, OutOfBlocks, PagedStep
from .base import BoundCache, CacheStep, DynamicCache, KVCache, StaticCache, crop, reorder, reset, step
from .factory import new_cache
from .paged import PagedKVCache
from .sliding import SlidingWindowCache

__all__ = ["KVCache", "CacheStep", "BoundCache", "DynamicCache", "StaticCache", "SlidingWindowCache", "PagedKVCache",
           "BlockAllocator", "OutOfBlocks", "PagedStep", "new_cache", "step", "reorder", "crop", "reset"]
