"""``PagedKV``: keys and values that live in fixed-size blocks of a pool, as ``attention()`` takes them.

Notation: N blocks in the pool, bs tokens per block, B sequences, W blocks per block-table row,
Hkv KV heads, D / Dv key / value head dims, L = max(lengths).

A paged call is ``attnkit.attention(q, PagedKV(...), None, mask, ...)``: logically the same as
attending to dense ``k (B, Hkv, L, D)`` / ``v (B, Hkv, L, Dv)`` where token p of sequence b is row
``p % bs`` of block ``block_table[b, p // bs]``, with the keys past ``lengths[b]`` masked. Backends
that read blocks in place (the split-K engine, the Triton kernel) take it as is; the others
receive the gathered dense tensors (:meth:`PagedKV.gather`).

``QuantizedKV``: int8 / fp8 keys and values with one fp32 scale per (token, KV head)
(:mod:`attnkit.kvquant`), dense ``(B, Hkv, Sk, D)`` or paged pools ``(N, bs, Hkv, D)`` with a block
table. ``attnkit.attention(q, QuantizedKV(...), None, mask, ...)`` attends to the dequantized K/V
(``data * scale``): the split-K engine and the Triton kernel read the quantized rows in place,
the other backends receive dequantized dense tensors in q's dtype (:meth:`QuantizedKV.gather`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ._checks import shape_of
from .kvquant import QUANTIZED_DTYPES, dequantize
from ._deprecation import renamed_property

__all__ = ["PagedKV", "QuantizedKV"]


@dataclass(frozen=True, eq=False)
class PagedKV:
    """Paged keys and values.

    Args:
        k_pool: (N, bs, Hkv, D) keys of every block.
        v_pool: (N, bs, Hkv, Dv) values, or None: V is the first ``v_head_dim`` channels of K
            (MLA's latent cache, ``[c_kv | k_rope]``, attended with V = ``c_kv``).
        block_table: (B, W) integer block ids; entries past a sequence's last block are ignored.
        lengths: (B,) integer keys held by each sequence.
        v_head_dim: Dv when ``v_pool`` is None.
        max_len: max(lengths) if the caller knows it on the host (saves a device sync).
        checked: the caller guarantees the table entries in use are valid block ids (a cache
            whose allocator hands them out), so :meth:`validate` skips reading them; lengths and
            ``max_len`` are checked either way. A lying table still raises, on every path: the
            kernels and :meth:`gather` refuse entries outside the pool, they never clamp them.
    """

    k_pool: Tensor
    v_pool: Tensor | None
    block_table: Tensor
    lengths: Tensor
    v_head_dim: int | None = None
    max_len: int | None = None
    checked: bool = False

    # ------------------------------------------------------------------ shapes

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[2]

    kv_heads = renamed_property("num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.k_pool.shape[3]

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[1]

    @property
    def value_dim(self) -> int:
        return self.v_pool.shape[3] if self.v_pool is not None else int(self.v_head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pool.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pool.device

    def kv_len(self) -> int:
        """L = max(lengths) (from ``max_len`` when given)."""
        if self.max_len is not None:
            return int(self.max_len)
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def validate(self) -> None:
        """Check shapes, dtypes, devices, the block size, ``lengths`` and ``max_len`` (and, unless
        ``checked``, that every table entry in use is a block of the pool); errors name the
        argument and the shapes."""
        k, v, t, n = self.k_pool, self.v_pool, self.block_table, self.lengths
        if not isinstance(k, Tensor) or k.dim() != 4:
            raise ValueError(f"PagedKV.k_pool must be (N, bs, Hkv, D), got shape {shape_of(k)}")
        if k.shape[1] < 1:
            raise ValueError(f"PagedKV.k_pool must be (N, bs, Hkv, D) with a block size bs >= 1, got shape {shape_of(k)}")
        if v is not None:
            if not isinstance(v, Tensor) or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"PagedKV.v_pool must be (N, bs, Hkv, Dv) matching k_pool {shape_of(k)}, got "
                                 f"{shape_of(v)}")
            if v.dtype != k.dtype or v.device != k.device:
                raise TypeError(f"PagedKV.v_pool ({v.dtype}, {v.device}) must match k_pool ({k.dtype}, {k.device})")
            if self.v_head_dim is not None and self.v_head_dim != v.shape[3]:
                raise ValueError(f"PagedKV.v_head_dim={self.v_head_dim} but v_pool has Dv={v.shape[3]}")
        elif (not isinstance(self.v_head_dim, int) or isinstance(self.v_head_dim, bool)
              or not 1 <= self.v_head_dim <= k.shape[3]):
            raise ValueError(f"PagedKV without v_pool reads V from K: v_head_dim must be an int in [1, D={k.shape[3]}], "
                             f"got {self.v_head_dim!r}")
        for name, x, dims in (("block_table", t, 2), ("lengths", n, 1)):
            if not isinstance(x, Tensor) or x.dim() != dims or x.dtype.is_floating_point or x.dtype == torch.bool:
                raise TypeError(f"PagedKV.{name} must be a {dims}-D integer tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)} of shape {shape_of(x)}")
            if x.device != k.device:
                raise ValueError(f"PagedKV.{name} is on {x.device} but k_pool is on {k.device}")
        if n.shape[0] != t.shape[0]:
            raise ValueError(f"PagedKV.lengths {shape_of(n)} and block_table {shape_of(t)} must have one row per sequence")
        if self.max_len is not None and (not isinstance(self.max_len, int) or isinstance(self.max_len, bool)
                                         or self.max_len < 0):
            raise ValueError(f"PagedKV.max_len must be a non-negative int, got {self.max_len!r}")
        # lengths and max_len are the call's shape (Sk), not table entries: checked even when the
        # caller vouches for the table. One reduction, one host read.
        bs, W = k.shape[1], t.shape[1]
        lo, hi = (0, 0) if n.numel() == 0 else (int(x) for x in torch.aminmax(n))
        if lo < 0 or hi > W * bs:
            raise ValueError(f"PagedKV.lengths {n.tolist()[:8]} must be in [0, {W} blocks x {bs} tokens = {W * bs}] "
                             f"(block_table {shape_of(t)}, k_pool {shape_of(k)})")
        if self.max_len is not None and self.max_len != hi:
            raise ValueError(f"PagedKV.max_len={self.max_len} but max(lengths)={hi}")
        if self.checked or n.numel() == 0:
            return
        bad = self._used(W) & ((t < 0) | (t >= k.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"PagedKV.block_table has entries outside the pool of {k.shape[0]} blocks where "
                             f"sequences hold tokens: {t[bad].tolist()[:8]}")

    def _used(self, width: int) -> Tensor:
        """(B, width) bool: table entries that hold some of their sequence's tokens."""
        t = self.block_table
        return torch.arange(width, device=t.device)[None] < (-(-self.lengths.long() // self.block_size))[:, None]

    # ------------------------------------------------------------------ dense view

    def gather(self) -> tuple[Tensor, Tensor]:
        """Dense copies (B, Hkv, L, D) and (B, Hkv, L, Dv) of the blocks. Only the table entries
        holding a sequence's tokens are read (the rest may be padding, such as
        :meth:`BlockAllocator.block_table`'s -1); positions past a sequence's length are 0, so
        a masked key can never turn into NaN (0 * NaN) in a backend that multiplies it by its
        zero probability. An entry in use outside the pool raises a ValueError naming it, even
        for a ``checked`` table (one host read, beside a copy of every block: a device assert in
        the index op, or a negative id wrapping around, would be worse)."""
        L, bs, N = self.kv_len(), self.block_size, self.k_pool.shape[0]
        nblk = -(-L // bs)
        table = self.block_table[:, :nblk].long()
        used = self._used(nblk)
        bad = used & ((table < 0) | (table >= N))
        if bool(bad.any()):
            raise ValueError(f"PagedKV.block_table has entries outside the pool of {N} blocks where sequences "
                             f"hold tokens: {table[bad].tolist()[:8]} (block_table {shape_of(self.block_table)})")
        ids = table.masked_fill(~used, 0)
        past = torch.arange(L, device=table.device)[None] >= self.lengths.to(table.device)[:, None]  # (B, L)

        def dense(pool: Tensor) -> Tensor:  # (B, nblk, bs, Hkv, .) -> (B, Hkv, L, .)
            x = pool[ids].flatten(1, 2)[:, :L]
            return x.masked_fill_(past[:, :, None, None], 0).transpose(1, 2)

        k = dense(self.k_pool)
        v = k[..., :self.value_dim] if self.v_pool is None else dense(self.v_pool)
        return k, v


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """Quantized keys and values, dense or paged.

    Args:
        k: int8 or fp8 (e4m3) keys: dense (B, Hkv, Sk, D), or pools (N, bs, Hkv, D) with
            ``block_table`` and ``lengths``.
        k_scale: fp32 scales of the key rows, ``k.shape[:3]``: (B, Hkv, Sk) or (N, bs, Hkv).
        v: values of k's dtype, (B, Hkv, Sk, Dv) or (N, bs, Hkv, Dv); or None: V is the first
            ``v_head_dim`` channels of K, scaled by ``k_scale`` (MLA's latent cache).
        v_scale: fp32 scales of the value rows, ``v.shape[:3]`` (None with ``v`` None).
        v_head_dim: Dv when ``v`` is None.
        block_table, lengths, max_len, checked: the paged form, as in :class:`PagedKV`.
        k_channel_scale: (Hkv, D) fp32, or None: a fixed scale per KV head and channel of K
            (:func:`attnkit.kvquant.channel_scale`), so a key row is ``k * k_scale *
            k_channel_scale``; when V is read from K it scales V's channels too.

    The scales are used as given (:mod:`attnkit.kvquant` says what NaN, inf and 0 do).
    """

    k: Tensor
    k_scale: Tensor
    v: Tensor | None
    v_scale: Tensor | None
    v_head_dim: int | None = None
    block_table: Tensor | None = None
    lengths: Tensor | None = None
    max_len: int | None = None
    checked: bool = False
    k_channel_scale: Tensor | None = None

    @classmethod
    def quantize(cls, k: Tensor, v: Tensor | None, dtype="int8", *, v_head_dim: int | None = None,
                 block_table: Tensor | None = None, lengths: Tensor | None = None,
                 max_len: int | None = None, k_channel_scale: Tensor | bool | None = None) -> "QuantizedKV":
        """Quantize float K/V (dense, or pools with ``block_table`` / ``lengths``) row by row;
        ``k_channel_scale``: (Hkv, D) channel scales to divide K by first, or True to compute
        them from ``k`` (:func:`attnkit.kvquant.channel_scale`)."""
        from .kvquant import channel_scale, quantize

        if k_channel_scale is True:
            k_channel_scale = channel_scale(k.transpose(1, 2) if block_table is not None else k)
        elif k_channel_scale is False:
            k_channel_scale = None
        if k_channel_scale is not None:
            c = k_channel_scale.to(device=k.device, dtype=torch.float32)
            kq, ks = quantize(k.float() / (c[None] if block_table is not None else c[None, :, None]), dtype)
        else:
            kq, ks = quantize(k, dtype)
        vq, vs = (None, None) if v is None else quantize(v, dtype)
        return cls(kq, ks, vq, vs, v_head_dim=v_head_dim, block_table=block_table, lengths=lengths, max_len=max_len,
                   k_channel_scale=None if k_channel_scale is None else c)

    # ------------------------------------------------------------------ shapes

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def layout(self) -> str:
        """The call's ``kv_layout``: "quantized" (dense) or "quantized_paged"."""
        return "quantized_paged" if self.paged else "quantized"

    @property
    def batch(self) -> int:
        return self.block_table.shape[0] if self.paged else self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2] if self.paged else self.k.shape[1]

    kv_heads = renamed_property("num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def value_dim(self) -> int:
        return self.v.shape[3] if self.v is not None else int(self.v_head_dim)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (int8 or fp8)."""
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def kv_len(self) -> int:
        """Sk: the dense length, or max(lengths) of the paged form."""
        return self.paged_kv().kv_len() if self.paged else self.k.shape[2]

    def paged_kv(self) -> PagedKV:
        """The paged form's data pools and table as a :class:`PagedKV` (its checks and walks)."""
        return PagedKV(self.k, self.v, self.block_table, self.lengths, v_head_dim=self.v_head_dim,
                       max_len=self.max_len, checked=self.checked)

    def pages(self) -> PagedKV:
        """Deprecated name of :meth:`paged_kv`."""
        warnings.warn("QuantizedKV.pages() is deprecated; call .paged_kv()", DeprecationWarning, stacklevel=2)
        return self.paged_kv()

    def validate(self) -> None:
        """Check dtypes, shapes and devices of the data, the scales and (paged) the table; errors
        name the argument and the shapes."""
        k, v, ks, vs = self.k, self.v, self.k_scale, self.v_scale
        if not isinstance(k, Tensor) or k.dim() != 4:
            raise ValueError(f"QuantizedKV.k must be 4-D (B, Hkv, Sk, D) or pools (N, bs, Hkv, D), got shape "
                             f"{shape_of(k)}")
        if k.dtype not in QUANTIZED_DTYPES:
            raise TypeError(f"QuantizedKV.k must be one of {', '.join(map(str, QUANTIZED_DTYPES))}, got {k.dtype} "
                            f"(float K/V go to attention() as tensors or a PagedKV)")
        if (v is None) != (vs is None):
            raise ValueError("QuantizedKV.v and v_scale must both be given or both be None (V read from K)")
        if v is not None:
            if not isinstance(v, Tensor) or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"QuantizedKV.v must match k {shape_of(k)} in its first 3 dims, got {shape_of(v)}")
            if v.dtype != k.dtype or v.device != k.device:
                raise TypeError(f"QuantizedKV.v ({v.dtype}, {v.device}) must match k ({k.dtype}, {k.device})")
        for name, s, x in (("k_scale", ks, k), ("v_scale", vs, v)):
            if x is None:
                continue
            if not isinstance(s, Tensor) or s.dtype != torch.float32:
                raise TypeError(f"QuantizedKV.{name} must be an fp32 tensor, got "
                                f"{getattr(s, 'dtype', type(s).__name__)}")
            if s.shape != x.shape[:3]:
                raise ValueError(f"QuantizedKV.{name} must have shape {tuple(x.shape[:3])} (one scale per row of "
                                 f"{'k' if x is k else 'v'} {shape_of(x)}), got {shape_of(s)}")
            if s.device != k.device:
                raise ValueError(f"QuantizedKV.{name} is on {s.device} but k is on {k.device}")
        c = self.k_channel_scale
        if c is not None:
            if not isinstance(c, Tensor) or c.dtype != torch.float32:
                raise TypeError(f"QuantizedKV.k_channel_scale must be an fp32 tensor, got "
                                f"{getattr(c, 'dtype', type(c).__name__)}")
            if c.shape != (self.num_kv_heads, k.shape[3]):
                raise ValueError(f"QuantizedKV.k_channel_scale must have shape (Hkv, D) = "
                                 f"{(self.num_kv_heads, k.shape[3])}, got {shape_of(c)}")
            if c.device != k.device:
                raise ValueError(f"QuantizedKV.k_channel_scale is on {c.device} but k is on {k.device}")
        if self.paged:
            if self.lengths is None:
                raise ValueError("QuantizedKV with a block_table needs lengths (the keys each sequence holds)")
            self.paged_kv().validate()
        else:
            if self.lengths is not None or self.max_len is not None:
                raise ValueError("QuantizedKV.lengths / max_len belong to the paged form (give a block_table); "
                                 "mask a dense one's padding with the mask")
            if v is None and (not isinstance(self.v_head_dim, int) or isinstance(self.v_head_dim, bool)
                              or not 1 <= self.v_head_dim <= k.shape[3]):
                raise ValueError(f"QuantizedKV without v reads V from K: v_head_dim must be an int in "
                                 f"[1, D={k.shape[3]}], got {self.v_head_dim!r}")
            if v is not None and self.v_head_dim is not None and self.v_head_dim != v.shape[3]:
                raise ValueError(f"QuantizedKV.v_head_dim={self.v_head_dim} but v has Dv={v.shape[3]}")

    # ------------------------------------------------------------------ dense view

    def without_channel_scale(self, q: Tensor) -> tuple[Tensor, "QuantizedKV", Tensor | None]:
        """(q', kv', out_scale) for kernels that read rows in place: q' = q * k_channel_scale
        in fp32, each query head by its KV head's scales (``q . (k * c) = (q * c) . k``); kv'
        the same K/V without the channel scale; out_scale (1, Hq, 1, Dv) the factor of the output
        when V is read from K (its channels carry the scale too), else None. Without a channel
        scale: (q, self, None)."""
        c = self.k_channel_scale
        if c is None:
            return q, self, None
        G = q.shape[1] // self.num_kv_heads
        cq = c.repeat_interleave(G, 0)[None, :, None, :]  # (1, Hq, 1, D)
        post = cq[..., :self.value_dim] if self.v is None else None
        return q.float() * cq, replace(self, k_channel_scale=None), post

    def gather(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Dense dequantized K (B, Hkv, L, D) and V (B, Hkv, L, Dv) in ``dtype`` (the paged form
        gathered first, as :meth:`PagedKV.gather`: positions past a sequence's length are 0)."""
        if self.k_channel_scale is not None:
            k, v = replace(self, k_channel_scale=None).gather(torch.float32)
            k = k * self.k_channel_scale[:, None, :]
            v = k[..., :self.value_dim] if self.v is None else v
            return k.to(dtype), v.to(dtype)
        if not self.paged:
            k = dequantize(self.k, self.k_scale, dtype)
            v = k[..., :self.value_dim] if self.v is None else dequantize(self.v, self.v_scale, dtype)
            return k, v
        # Gathered as raw bytes: fp8 has no masked_fill; a zero byte is 0 in int8 and fp8 alike.
        raw = PagedKV(self.k.view(torch.uint8), None if self.v is None else self.v.view(torch.uint8),
                      self.block_table, self.lengths, v_head_dim=self.v_head_dim, max_len=self.max_len,
                      checked=self.checked)
        kq, vq = (x.view(self.k.dtype) for x in raw.gather())
        scales = PagedKV(self.k_scale.unsqueeze(-1), None if self.v is None else self.v_scale.unsqueeze(-1),
                         self.block_table, self.lengths, v_head_dim=1, max_len=self.max_len, checked=True)
        ks, vs = scales.gather()
        k = dequantize(kq, ks[..., 0], dtype)
        v = k[..., :self.value_dim] if self.v is None else dequantize(vq, vs[..., 0], dtype)
        return k, v
