"""The contiguous caches: :class:`DynamicCache` (grows) and :class:`StaticCache` (fixed
shapes, for ``torch.compile``), K/V in (B, Hkv, capacity, D) buffers.

Notation: B batch, Hkv key/value heads, S new tokens this step, L capacity, D key head dim,
Dv value head dim. The step protocol: :mod:`attnkit.caches.protocol`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import positive_int
from ..kvlayout import QuantizedKV
from ..masks import Causal, KeyPadding
from . import memory
from .._deprecation import renamed_kwargs
from .protocol import CacheStep, KVCache
from .quant_policy import as_bytes

__all__ = ["DynamicCache", "StaticCache"]


class _ContiguousCache(KVCache):
    """K/V in (B, Hkv, capacity, D) buffers; a step's tokens are written past the committed
    lengths, and an aborted step zeroes them (and gives back any growth), so it leaves nothing
    behind; ``crop`` and ``reset`` zero the rows they drop. With ``value_from_key`` there is no V buffer (``v_buf`` stays empty). Quantized
    (``kv_dtype``): ``k_buf`` / ``v_buf`` hold int8 / fp8 rows and ``k_scale`` / ``v_scale``
    (B, Hkv, capacity) their fp32 scales, moved, grown and zeroed with them; every row shares the
    (Hkv, D) K channel scale ``k_channel_scale`` (:class:`KVCache`)."""

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, num_kv_heads, head_dim, v_head_dim=None, *, value_from_key=False, dtype=torch.float32,
                 device=None, kv_dtype=None, k_channel_scale=None):
        super().__init__(num_kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype,
                         device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        kw = dict(dtype=self.storage_dtype, device=device)
        self.register_buffer("k_buf", torch.zeros(0, num_kv_heads, 0, head_dim, **kw), persistent=False)
        self.register_buffer("v_buf", torch.zeros(0, num_kv_heads, 0, self.v_head_dim, **kw), persistent=False)
        if self.kv_dtype is not None:
            for name in ("k_scale", "v_scale"):
                self.register_buffer(name, torch.zeros(0, num_kv_heads, 0, dtype=torch.float32, device=device),
                                     persistent=False)

    def _stored(self) -> list[tuple[str, int | None]]:
        """(buffer name, channels) of what this cache keeps, in :meth:`_quantize`'s order: the
        data buffers, then (quantized) their scale buffers, channels None (no last dim)."""
        data = [("k_buf", self.head_dim)] + ([] if self.value_from_key else [("v_buf", self.v_head_dim)])
        if self.kv_dtype is None:
            return data
        return data + [("k_scale", None)] + ([] if self.value_from_key else [("v_scale", None)])

    def _alloc(self, batch: int, length: int) -> None:
        """Fresh zero buffers of (batch, Hkv, length, ·), keeping what fits of the old ones."""
        for name, dim in self._stored():
            old = getattr(self, name)
            buf = memory.zeros((batch, self.num_kv_heads, length, *(() if dim is None else (dim,))),
                               dtype=old.dtype, device=old.device)
            rows, cols = min(batch, old.shape[0]), min(length, old.shape[2])
            buf[:rows, :, :cols] = old[:rows, :, :cols]
            setattr(self, name, buf)

    def _q_start(self, batch: int) -> Tensor:
        return self.lengths if self.lengths.numel() else torch.zeros(batch, dtype=torch.long,
                                                                      device=self.lengths.device)

    def write(self, step, k, v):
        v = self._check_kv(step, k, v)
        B, H, S, _ = k.shape
        # Padding tokens (rows with num_new < S) land past their row's new length: written as 0,
        # so no later view holds their K/V (NaN included) where a backend multiplies masked rows by 0.
        pad = None
        if step.num_new_host is None or any(n != S for n in step.num_new_host):
            pad = (torch.arange(S, device=k.device)[None] >= step.num_new[:, None])[:, None, :, None]  # (B, 1, S, 1)
        rows = (k,) if self.value_from_key else (k, v)
        if pad is not None:
            rows = [t.masked_fill(pad, 0) for t in rows]  # quantized: data 0 and scale 0
        for (name, dim), t in zip(self._stored(), self._quantize(step, rows)):
            self._put(step, getattr(self, name), t)
        step.writers.add(id(self))

    def _put(self, step: CacheStep, buf: Tensor, t: Tensor) -> None:
        """Write the step's rows ``t`` (B, Hkv, S, ·) of one buffer at positions q_start .. q_start + S - 1
        (a scale buffer (B, Hkv, L) and its rows (B, Hkv, S) go through as one channel)."""
        if t.dim() == 3:
            buf, t = buf.unsqueeze(-1), t.unsqueeze(-1)
        buf, t = as_bytes(buf), as_bytes(t)
        B, H, S, dim = t.shape
        starts = step.q_start_host
        uniform = starts is not None and min(starts, default=0) == max(starts, default=0)
        if uniform:  # one slice copy
            start = starts[0] if starts else 0
            buf[:B, :, start:start + S].copy_(t)
        else:
            # (B, S) positions; rows' padding tokens land past their new length. An index_put_
            # (row b's tokens to positions pos[b]), not a scatter_: under torch.compile inductor
            # writes it into the buffer in place, where a scatter_ became a copy of the whole
            # buffer per step (and a copy back).
            pos = step.positions()
            rows = torch.arange(B, device=pos.device)[:, None]
            buf[rows, :, pos] = t.transpose(1, 2)

    def _abort(self, step):
        # Rows past the committed lengths are zeroed where this step wrote them (never left
        # holding its K/V), and a buffer the step grew goes back to its size.
        if id(self) in step.writers:
            for name, dim in self._stored():
                buf = getattr(self, name)
                self._put(step, buf, buf.new_zeros(step.batch, self.num_kv_heads, step.tokens,
                                                   *(() if dim is None else (dim,))))
        grown_from = getattr(step, "grown_from", None)
        if grown_from is not None:
            self._alloc(*grown_from)

    def _views(self, batch: int, length: int, dense: bool = False) -> tuple:
        """(k_all, v_all) of the first ``batch`` rows and ``length`` positions: tensors, or a
        :class:`attnkit.QuantizedKV` and None (``dense``: its dequantized tensors in ``dtype``)."""
        k = self.k_buf[:batch, :, :length]
        if self.kv_dtype is None:
            return k, (k[..., :self.v_head_dim] if self.value_from_key else self.v_buf[:batch, :, :length])
        ks, c = self.k_scale[:batch, :, :length], self.k_channel_scale
        if self.value_from_key:
            kv = QuantizedKV(k, ks, None, None, v_head_dim=self.v_head_dim, k_channel_scale=c)
        else:
            kv = QuantizedKV(k, ks, self.v_buf[:batch, :, :length], self.v_scale[:batch, :, :length],
                             k_channel_scale=c)
        return kv.gather(self.dtype) if dense else (kv, None)

    def _zero_rows(self, start, end):
        # Only the columns some row drops are touched (a rollback's few tokens, not the cache).
        B = end.shape[0]
        if B == 0:
            return
        lo, hi = int(start.min()), int(end.max())
        if hi <= lo:
            return
        pos = torch.arange(lo, hi, device=end.device)[None]
        drop = (pos >= start[:, None]) & (pos < end[:, None])  # (B, hi - lo)
        for name, _ in self._stored():
            buf = getattr(self, name)
            buf = as_bytes(buf if buf.dim() == 4 else buf.unsqueeze(-1))
            buf[:B, :, lo:hi].masked_fill_(drop[:, None, :, None], 0)

    def _reorder_buffers(self, idx):
        for name, _ in self._stored():
            setattr(self, name, getattr(self, name)[: self.lengths.shape[0]][idx])


class DynamicCache(_ContiguousCache):
    """Grows with the sequences: capacity doubles when full (amortised O(1) per token; one copy
    per doubling, not a ``torch.cat`` per step). Views reach the longest sequence's end.

    Eager-only by design (its shapes change every step), so it mirrors ``lengths`` as Python
    ints: sizes need no device sync, and a batch whose sequences are all equally long (the
    common case) is written with one slice copy and gets the plain bottom-right ``Causal()``
    mask, which the backends run without materializing (and drop for one-token steps).
    """

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host: list[int] = []

    def _sync_host(self) -> None:
        self._host = self.lengths.tolist()

    def begin(self, batch, tokens, num_new=None, *, token_ids=None):
        B, S, n, n_host = self._check_step_args(batch, tokens, num_new)
        start_host = self._host if self._host else [0] * B
        need = max(start_host, default=0) + S
        rows, cap = self.k_buf.shape[0], self.k_buf.shape[2]
        grown_from = None
        if rows != B or need > cap:
            self._alloc(B, max(need, 2 * cap, 16))  # keeps every committed token
            grown_from = (rows, cap)  # an abort shrinks the buffers back
        step = CacheStep(self._q_start(B), n, S, q_start_host=list(start_host), num_new_host=n_host)
        step.grown_from = grown_from
        return step

    def view(self, step, *, dense=False, held_only=False):
        return (*self._views(step.batch, max(step.new_host, default=0), dense), step.mask())

    def _commit(self, step):
        self.lengths = step.new
        self._host = list(step.new_host)

    def reset(self) -> None:
        super().reset()
        self._sync_host()

    def crop(self, n) -> None:
        super().crop(n)
        self._sync_host()

    def reorder(self, indices) -> None:
        super().reorder(indices)
        self._sync_host()


class StaticCache(_ContiguousCache):
    """Preallocated (max_batch, Hkv, max_len, D) buffers: every view has the same shapes and the
    positions are tensors, so a decode step compiles once (``torch.compile``) and never
    recompiles per step. Writing past ``max_len`` raises a ValueError."""

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, num_kv_heads, head_dim, v_head_dim=None, *, max_batch: int, max_len: int,
                 value_from_key=False, dtype=torch.float32, device=None, kv_dtype=None, k_channel_scale=None):
        super().__init__(num_kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype,
                         device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        for name, val in (("max_batch", max_batch), ("max_len", max_len)):
            positive_int(name, val)
        self.max_batch, self.max_len = max_batch, max_len
        self._alloc(max_batch, max_len)

    def begin(self, batch, tokens, num_new=None, *, token_ids=None):
        B, S, n, n_host = self._check_step_args(batch, tokens, num_new)
        if B != self.max_batch:
            raise ValueError(f"a step of batch {B} but the static cache was built for max_batch={self.max_batch}; "
                             f"build it for the batch you run")
        q_start = self._q_start(B).clone()  # lengths stay as they are until commit (empty before the first)
        q_start_host = None
        if not torch.compiler.is_compiling():
            q_start_host = q_start.tolist()
            end = max(q_start_host, default=0) + S
            if end > self.max_len:
                raise ValueError(f"writing {S} tokens after lengths {q_start_host} overflows the static cache's "
                                 f"max_len {self.max_len}")
        return CacheStep(q_start, n, S, q_start_host=q_start_host, num_new_host=n_host)

    def view(self, step, *, dense=False, held_only=False):
        if held_only and step.tokens > 1 and step.new_host is not None:
            # An eager prefill or chunk: the keys the rows hold (a DynamicCache's view), with the
            # plain causal mask when the rows are uniform, instead of max_len columns and an
            # anchored one (which the fast prefill kernels cannot take). Compiled steps (no host
            # lengths) and decode keep the fixed shapes.
            return (*self._views(step.batch, max(step.new_host, default=0), dense), step.mask())
        # One token per row (decode): its query at position q_start sees keys j <= q_start, and
        # j < new with new <= q_start + 1, so KeyPadding(new) alone is the whole mask: per-row
        # lengths, which kernels take as they are (no key intervals built per step under compile).
        mask = KeyPadding(step.new) if step.tokens == 1 else Causal(q_start=step.q_start) & KeyPadding(step.new)
        return (*self._views(step.batch, self.max_len, dense), mask)

    def _commit(self, step):
        if self.lengths.numel() == 0:  # the first step: the (B,) buffer every later step updates in place
            self.lengths = step.new.clone()
        else:
            self.lengths.copy_(step.new)  # in place: the buffer keeps its identity under compile

    def _reorder_buffers(self, idx):
        if idx.numel() != self.max_batch:
            raise ValueError(f"a static cache keeps max_batch={self.max_batch} sequences; reorder got "
                             f"{idx.numel()} indices")
        for name, _ in self._stored():
            buf = getattr(self, name)
            buf.copy_(buf[idx])
