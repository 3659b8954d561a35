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
from .base import CacheStep, KVCache

__all__ = ["SlidingWindowCache"]


class SlidingWindowCache(KVCache):
    """Keeps the last ``window + max_rollback`` tokens per sequence in fixed buffers.

    A one-token step (decode) is attended over the ring itself (no copy); a longer step
    (prefill, chunks, verification) over the ring as it was followed by the new tokens, because
    the chunk's first queries still need keys its last tokens evict. Writing a step overwrites
    ring slots, so the step keeps what it overwrote and :meth:`abort` puts it back.
    ``crop`` can roll back up to ``max_rollback`` tokens (their window is still in the ring).
    """

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, window: int, max_batch: int,
                 max_rollback: int = 0, dtype=torch.float32, device=None):
        super().__init__(kv_heads, head_dim, v_head_dim, dtype=dtype, device=device)
        for name, val, low in (("window", window, 1), ("max_batch", max_batch, 1), ("max_rollback", max_rollback, 0)):
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
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

    def begin(self, batch, tokens, num_new=None, *, token_ids=None) -> CacheStep:
        B, S, n, n_host = self._check_step_args(batch, tokens, num_new)
        if B != self.max_batch:
            raise ValueError(f"a step of batch {B} but the sliding cache was built for max_batch={self.max_batch}")
        old = self.lengths if self.lengths.numel() else torch.zeros(B, dtype=torch.long, device=self.lengths.device)
        return CacheStep(old.clone(), n, S, old_host=old.tolist(), num_new_host=n_host)

    def write(self, step, k, v):
        self._check_kv(step, k, v)
        B, H, S, _ = k.shape
        j = torch.arange(S, device=k.device)
        old, n = step.old, step.num_new
        keep = (j[None, :] < n[:, None]) & (j[None, :] >= n[:, None] - self.slots)  # (B, S)
        slot = torch.where(keep, torch.remainder(old[:, None] + j, self.slots), self.slots)
        if S > 1:  # the step attends over the ring as it was, then the new tokens
            step.sliding_kv = (torch.cat([self.k_ring[:B, :, :self.slots], k], 2),
                               torch.cat([self.v_ring[:B, :, :self.slots], v], 2))
        idx = [slot[:, None, :, None].expand(B, H, S, t.shape[-1]) for t in (k, v)]
        step.sliding_undo = [buf[:B].gather(2, i) for buf, i in zip((self.k_ring, self.v_ring), idx)]
        step.sliding_index = idx
        for buf, t, i in zip((self.k_ring, self.v_ring), (k, v), idx):
            buf[:B].scatter_(2, i, t)
        step.writers.add(id(self))

    def view(self, step, *, dense=False):
        B, S = step.batch, step.tokens
        qpos = step.positions()  # (B, S)
        if S == 1:  # decode: the evicted slot is outside every query's window
            kpos = self._ring_positions(step.new)
            return (self.k_ring[:B, :, :self.slots], self.v_ring[:B, :, :self.slots],
                    self._window_mask(qpos, kpos, kpos >= 0))
        kpos_ring = self._ring_positions(step.old)
        kpos = torch.cat([kpos_ring, qpos], dim=1)
        kvalid = torch.cat([kpos_ring >= 0, torch.arange(S, device=qpos.device)[None, :] < step.num_new[:, None]], 1)
        k_all, v_all = step.sliding_kv
        return k_all, v_all, self._window_mask(qpos, kpos, kvalid)

    def _commit(self, step):
        self.lengths = step.new

    def _abort(self, step):
        undo = getattr(step, "sliding_undo", None)
        if undo is not None:  # put back, in reverse order, what the write overwrote
            B = step.batch
            for buf, i, saved in zip((self.k_ring, self.v_ring), step.sliding_index, undo):
                buf[:B].scatter_(2, i, saved)

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
