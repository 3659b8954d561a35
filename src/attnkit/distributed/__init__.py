"""Context parallelism on ``torch.distributed``: ring attention over a sequence sharded across ranks.

* :func:`ring_attention` — exact attention (forward and backward) over q, k, v shards
  (B, H, S/P, D), K/V passed around the ring with NCCL (GPUs) or gloo (CPU) point-to-point ops.
* :class:`ContextParallel` — runs an :class:`attnkit.MultiHeadAttention` on a sharded sequence.
* :func:`shard_sequence`, :func:`unshard_sequence`, :func:`gather_sequence`,
  :func:`shard_positions`, :func:`padded_length` — zigzag (load-balanced) and contiguous layouts.
* :mod:`attnkit.distributed.blocks` — per-block attention with log-sum-exp, the exact merge and
  the per-block flash-attention backward, reusable by any split-KV attention.

See ``docs/context_parallel.md`` for launching with ``torchrun``.
"""

from .blocks import block_backward, block_forward, mask_at, merge_partials, softmax_delta
from .parallel import ContextParallel
from .ring import ring_attention
from .sharding import SHARDINGS, gather_sequence, padded_length, shard_positions, shard_ranges, shard_sequence, \
    unshard_sequence

__all__ = ["ring_attention", "ContextParallel", "SHARDINGS", "shard_sequence", "unshard_sequence",
           "gather_sequence", "shard_positions", "shard_ranges", "padded_length", "block_forward",
           "block_backward", "merge_partials", "softmax_delta", "mask_at"]
