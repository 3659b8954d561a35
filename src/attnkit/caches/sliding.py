"""Sliding-window KV cache: a ring buffer of the last tokens, attention identical to the full
cache with ``SlidingWindow(window - 1)`` (each query sees itself and the ``window - 1`` keys
before it, Mistral's convention).

Shapes: B batch, Hkv heads, R = window + max_rollback ring slots (+1 scratch slot that absorbs
padded tokens), S new tokens, D / Dv head dims. The token at absolute position p lives in slot
``p % R``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks import Dense, Mask
from .base import KVCache

__all__ = ["SlidingWindowCache"]


class SlidingWindowCache(KVCache):
    """Keeps the last ``window + max_rollback`` tokens per sequence in fixed buffers.

    ``update`` with one token per step (decode) writes first and returns the ring itself (no
    copy); with several tokens (prefill, chunks, verification) it returns the ring followed by
    the new tokens, because the chunk's first queries still need keys its last tokens evict.
    ``crop`` can roll back up to ``max_rollback`` tokens (their window is still in the ring).
    """

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, window: int, max_batch: int,
                 max_rollback: int = 0, dtype=torch.float32, device=None):
        super().__init__(kv_heads, head_dim, v_head_dim, dtype=dtype, device=device)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if not isinstance(max_rollback, int) or max_rollback < 0:
            raise ValueError(f"max_rollback must be a non-negative int, got {max_rollback!r}")
        self.window, self.max_rollback, self.max_batch = window, max_rollback, max_batch
        self.slots = window + max_rollback
        self.register_buffer("k_ring", torch.zeros(max_batch, kv_heads, self.slots + 1, head_dim,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_ring", torch.zeros(max_batch, kv_heads, self.slots + 1, self.v_head_dim,
                                                   dtype=dtype, device=device), persistent=False)

    def _ring_positions(self, lengths: Tensor) -> Tensor:
        """(B, R) absolute position held by each slot (the latest p < length with p % R == slot);
        negative where the slot holds nothing yet."""
        slot = torch.arange(self.slots, device=lengths.device)
        last = lengths[:, None] - 1
        return last - torch.remainder(last - slot, self.slots)

    def _window_mask(self, qpos: Tensor, kpos: Tensor, kvalid: Tensor) -> Mask:
        """Dense (B, 1, S, L) mask: key visible iff valid, not after the query, inside the window."""
        q, kp = qpos[:, None, :, None], kpos[:, None, None, :]
        return Dense(kvalid[:, None, None, :] & (kp <= q) & (kp > q - self.window))

    def _write(self, k: Tensor, v: Tensor, old: Tensor, n: Tensor) -> None:
        """Scatter the valid new tokens that stay in the ring; the rest go to the scratch slot."""
        B, H, S, _ = k.shape
        j = torch.arange(S, device=k.device)
        keep = (j[None, :] < n[:, None]) & (j[None, :] >= n[:, None] - self.slots)  # (B, S)
        slot = torch.where(keep, torch.remainder(old[:, None] + j, self.slots), self.slots)
        for buf, t in ((self.k_ring, k), (self.v_ring, v)):
            buf[:B].scatter_(2, slot[:, None, :, None].expand(B, H, S, t.shape[-1]), t)

    def update(self, k, v, *, num_new=None):
        n = self._check_new(k, v, num_new)
        B, _, S, _ = k.shape
        if B != self.max_batch:
            raise ValueError(f"k has batch {B} but the sliding cache was built for max_batch={self.max_batch}")
        if self.lengths.numel() == 0:
            self.lengths = torch.zeros(B, dtype=torch.long, device=k.device)
        old = self.lengths.clone()
        qpos = old[:, None] + torch.arange(S, device=k.device)  # (B, S)
        if S == 1:  # decode: the evicted slot is outside every query's window
            self._write(k, v, old, n)
            self.lengths.add_(n)
            kpos = self._ring_positions(self.lengths)
            mask = self._window_mask(qpos, kpos, kpos >= 0)
            return self.k_ring[:B, :, :self.slots], self.v_ring[:B, :, :self.slots], mask
        kpos_ring = self._ring_positions(old)
        kpos = torch.cat([kpos_ring, qpos], dim=1)
        kvalid = torch.cat([kpos_ring >= 0, torch.arange(S, device=k.device)[None, :] < n[:, None]], dim=1)
        k_all = torch.cat([self.k_ring[:B, :, :self.slots], k], dim=2)
        v_all = torch.cat([self.v_ring[:B, :, :self.slots], v], dim=2)
        self._write(k, v, old, n)
        self.lengths.add_(n)
        return k_all, v_all, self._window_mask(qpos, kpos, kvalid)

    def crop(self, n) -> None:
        before = self.lengths.clone()
        super().crop(n)
        dropped = before - self.lengths
        if (dropped > self.max_rollback).any():
            self.lengths = before
            raise ValueError(f"rolling back {dropped.tolist()} tokens needs max_rollback >= "
                             f"{int(dropped.max())}; this cache keeps {self.max_rollback} (older keys were evicted)")

    def _reorder_buffers(self, idx: Tensor) -> None:
        if idx.numel() != self.max_batch:
            raise ValueError(f"a sliding cache keeps max_batch={self.max_batch} sequences; reorder got "
                             f"{idx.numel()} indices")
        self.k_ring.copy_(self.k_ring[idx])
        self.v_ring.copy_(self.v_ring[idx])
