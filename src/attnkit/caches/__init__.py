"""KV caches: one protocol (``update(k, v) -> (k_all, v_all, mask)``, ``lengths``, ``positions``,
``nbytes``, ``bytes_per_token``, ``reset``, ``crop``, ``reorder``), several kinds."""

from .base import DynamicCache, KVCache, StaticCache
from .factory import new_cache
from .paged import BlockAllocator, OutOfBlocks, PagedKVCache
from .sliding import SlidingWindowCache

__all__ = ["KVCache", "DynamicCache", "StaticCache", "SlidingWindowCache", "PagedKVCache", "BlockAllocator", "OutOfBlocks",
           "new_cache"]

