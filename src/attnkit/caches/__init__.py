"""KV caches: one protocol (``begin`` / ``write`` / ``view`` / ``commit`` / ``abort`` steps,
``update``, ``attend``, ``transaction``, ``lengths``, ``positions``, ``nbytes``,
``bytes_per_token``, ``reset``, ``crop``, ``reorder``), several kinds, and :func:`step` to run
several layers' caches as one transaction.

Rooms: :mod:`~attnkit.caches.protocol` (the step protocol), :mod:`~attnkit.caches.contiguous`
(dynamic, static), :mod:`~attnkit.caches.sliding`, :mod:`~attnkit.caches.paged` with its
:mod:`~attnkit.caches.allocator`, :mod:`~attnkit.caches.quant_policy` (quantized storage) and
:mod:`~attnkit.caches.memory` (where buffers live)."""

from .allocator import BlockAllocator, OutOfBlocks, PagedStep
from .contiguous import DynamicCache, StaticCache
from .factory import new_cache
from .paged import PagedKVCache
from .protocol import BoundCache, CacheStep, KVCache, crop, reorder, reset, step
from .sliding import SlidingWindowCache

__all__ = ["KVCache", "CacheStep", "BoundCache", "DynamicCache", "StaticCache", "SlidingWindowCache", "PagedKVCache",
           "BlockAllocator", "OutOfBlocks", "PagedStep", "new_cache", "step", "reorder", "crop", "reset"]
