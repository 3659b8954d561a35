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

from ..kvlayout import QuantizedKV
from ..masks import Dense, Mask
from . import memory
from .._deprecation import renamed_kwargs
from .protocol import CacheStep, KVCache
from .quant_policy import as_bytes

__all__ = ["SlidingWindowCache"]


class SlidingWindowCache(KVCache):
    """Keeps the last ``window + max_rollback`` tokens per sequence in fixed buffers.

    A one-token step (decode) is attended over the ring itself (no copy); a longer step
    (prefill, chunks, verification) over the ring as it was followed by the new tokens, because
    the chunk's first queries still need keys its last tokens evict. Writing a step overwrites
    ring slots, so the step keeps what it overwrote and :meth:`abort` puts it back.
    ``crop`` can roll back up to ``max_rollback`` tokens (their window is still in the ring); the
    slots of the dropped tokens are zeroed, and a ragged step's padding tokens are stored as 0,
    so no view holds rejected K/V in a masked slot.
    Quantized (``kv_dtype``): the rings hold int8 / fp8 rows and ``k_scale`` / ``v_scale``
    (max_batch, Hkv, R + 1) their fp32 scales, written, saved and put back with them; every row
    shares the (Hkv, D) K channel scale ``k_channel_scale`` (:class:`~attnkit.caches.KVCache`).
    """

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, num_kv_heads, head_dim, v_head_dim=None, *, window: int, max_batch: int,
                 max_rollback: int = 0, dtype=torch.float32, device=None, kv_dtype=None, k_channel_scale=None):
        super().__init__(num_kv_heads, head_dim, v_head_dim, dtype=dtype, device=device, kv_dtype=kv_dtype,
                         k_channel_scale=k_channel_scale)
        for name, val, low in (("window", window, 1), ("max_batch", max_batch, 1), ("max_rollback", max_rollback, 0)):
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
        self.window, self.max_rollback, self.max_batch = window, max_rollback, max_batch
        self.slots = window + max_rollback
        kw = dict(dtype=self.storage_dtype, device=device)
        H = num_kv_heads
        self.register_buffer("k_ring", memory.zeros((max_batch, H, self.slots + 1, head_dim), **kw), persistent=False)
        self.register_buffer("v_ring", memory.zeros((max_batch, H, self.slots + 1, self.v_head_dim), **kw),
                             persistent=False)
        if self.kv_dtype is not None:
            for name in ("k_scale", "v_scale"):
                self.register_buffer(name, memory.zeros((max_batch, H, self.slots + 1), dtype=torch.float32,
                                                        device=device), persistent=False)

    def _rings(self) -> list[Tensor]:
        """The ring buffers, in :meth:`_quantize`'s order: K, V (and quantized: their scales)."""
        rings = [self.k_ring, self.v_ring]
        return rings if self.kv_dtype is None else rings + [self.k_scale, self.v_scale]

    @staticmethod
    def _indexable(parts: list[Tensor]) -> list[Tensor]:
        """Ring-shaped parts as 4-D tensors scatter / gather take: a scale (B, Hkv, ·) as one
        channel (B, Hkv, ·, 1), fp8 data as its bytes (:func:`~attnkit.caches.quant_policy.as_bytes`)."""
        return [as_bytes(t if t.dim() == 4 else t.unsqueeze(-1)) for t in parts]

    def _kv(self, parts: list[Tensor]):
        """(k, v) of ring-shaped parts in :meth:`_rings`' order: tensors, or a QuantizedKV and None."""
        if self.kv_dtype is None:
            return parts[0], parts[1]
        k, v, k_scale, v_scale = parts
        return QuantizedKV(k, k_scale, v, v_scale, k_channel_scale=self.k_channel_scale), None

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
        start = self.lengths if self.lengths.numel() else torch.zeros(B, dtype=torch.long, device=self.lengths.device)
        return CacheStep(start.clone(), n, S, q_start_host=start.tolist(), num_new_host=n_host)

    def write(self, step, k, v):
        self._check_kv(step, k, v)
        B, H, S, _ = k.shape
        j = torch.arange(S, device=k.device)
        start, n = step.q_start, step.num_new
        valid = j[None, :] < n[:, None]  # (B, S): not a padding token
        keep = valid & (j[None, :] >= n[:, None] - self.slots)
        slot = torch.where(keep, torch.remainder(start[:, None] + j, self.slots), self.slots)
        if step.num_new_host is None or any(x != S for x in step.num_new_host):
            # padding tokens stored as 0 (the scratch slot, and this step's own view below): no view
            # holds their K/V (NaN included) where a backend multiplies masked rows by 0
            pad = ~valid[:, None, :, None]
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
        new = self._quantize(step, (k, v))  # [k, v] (quantized: [k data, v data, k scale, v scale])
        rings = self._rings()
        if S > 1:  # the step attends over the ring as it was, then the new tokens
            step.sliding_kv = self._kv([torch.cat([r[:B, :, :self.slots], t], 2) for r, t in zip(rings, new)])
        rings, new = self._indexable(rings), self._indexable(new)
        idx = [slot[:, None, :, None].expand(B, H, S, t.shape[-1]) for t in new]
        step.sliding_undo = [buf[:B].gather(2, i) for buf, i in zip(rings, idx)]
        step.sliding_index = idx
        for buf, t, i in zip(rings, new, idx):
            buf[:B].scatter_(2, i, t)
        step.writers.add(id(self))

    def view(self, step, *, dense=False, held_only=False):
        B, S = step.batch, step.tokens
        qpos = step.positions()  # (B, S)
        if S == 1:  # decode: the evicted slot is outside every query's window
            kpos = self._ring_positions(step.new)
            k_all, v_all = self._kv([r[:B, :, :self.slots] for r in self._rings()])
            mask = self._window_mask(qpos, kpos, kpos >= 0)
        else:
            kpos_ring = self._ring_positions(step.q_start)
            kpos = torch.cat([kpos_ring, qpos], dim=1)
            new_ok = torch.arange(S, device=qpos.device)[None, :] < step.num_new[:, None]
            kvalid = torch.cat([kpos_ring >= 0, new_ok], 1)
            k_all, v_all = step.sliding_kv
            mask = self._window_mask(qpos, kpos, kvalid)
        if dense and v_all is None:  # quantized
            k_all, v_all = k_all.gather(self.dtype)
        return k_all, v_all, mask

    def _commit(self, step):
        self.lengths = step.new

    def _abort(self, step):
        undo = getattr(step, "sliding_undo", None)
        if undo is not None:  # put back, in reverse order, what the write overwrote
            B = step.batch
            rings = self._indexable(self._rings())
            for buf, i, saved in zip(rings, step.sliding_index, undo):
                buf[:B].scatter_(2, i, saved)

    def crop(self, n) -> None:
        keep = self._kept_lengths(n)
        dropped = self.lengths - keep
        if (dropped > self.max_rollback).any():
            raise ValueError(f"rolling back {dropped.tolist()} tokens needs max_rollback >= "
                             f"{int(dropped.max())}; this cache keeps {self.max_rollback} (older keys were evicted)")
        self._zero_rows(keep, self.lengths)
        self.lengths = keep

    def _zero_rows(self, start, end):
        # The slots of positions max(start, end - R) .. end - 1 (older positions' slots were
        # overwritten already); a dropped token's slot held a token outside every later window.
        R = self.slots
        B = end.shape[0]
        start = torch.maximum(start, end - R)
        n = int((end - start).max()) if B else 0
        if n <= 0:
            return
        j = torch.arange(n, device=end.device)[None]
        drop = start[:, None] + j < end[:, None]  # (B, n)
        slot = torch.where(drop, torch.remainder(start[:, None] + j, R), R)  # R: the scratch slot
        rings = self._indexable(self._rings())
        for buf in rings:
            idx = slot[:, None, :, None].expand(B, buf.shape[1], n, buf.shape[3])
            buf[:B].scatter_(2, idx, torch.zeros_like(idx, dtype=buf.dtype))

    def _reorder_buffers(self, idx: Tensor) -> None:
        if idx.numel() != self.max_batch:
            raise ValueError(f"a sliding cache keeps max_batch={self.max_batch} sequences; reorder got "
                             f"{idx.numel()} indices")
        for buf in self._rings():
            buf.copy_(buf[idx])
