"""``PagedKV``: keys and values that live in fixed-size pages of a pool, as ``attention()`` takes them.

Notation: N blocks in the pool, bs tokens per block, B sequences, W blocks per block-table row,
Hkv KV heads, D / Dv key / value head dims, L = max(lengths).

A paged call is ``attnkit.attention(q, PagedKV(...), None, mask, ...)``: logically the same as
attending to dense ``k (B, Hkv, L, D)`` / ``v (B, Hkv, L, Dv)`` where token p of sequence b is row
``p % bs`` of block ``block_table[b, p // bs]``, with the keys past ``lengths[b]`` masked. Backends
that read pages in place (the CPU split-K engine, the Triton kernel) take it as is; the others
receive the gathered dense tensors (:meth:`PagedKV.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PagedKV"]


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))


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
            whose allocator hands them out); otherwise :meth:`validate` checks them.
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
    def kv_heads(self) -> int:
        return self.k_pool.shape[2]

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
        """Check shapes, dtypes and devices (and, unless ``checked``, that every table entry in
        use is a block of the pool); errors name the argument and the shapes."""
        k, v, t, n = self.k_pool, self.v_pool, self.block_table, self.lengths
        if not isinstance(k, Tensor) or k.dim() != 4:
            raise ValueError(f"PagedKV.k_pool must be (N, bs, Hkv, D), got shape {_shape(k)}")
        if v is not None:
            if not isinstance(v, Tensor) or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"PagedKV.v_pool must be (N, bs, Hkv, Dv) matching k_pool {_shape(k)}, got "
                                 f"{_shape(v)}")
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
                                f"{getattr(x, 'dtype', type(x).__name__)} of shape {_shape(x)}")
            if x.device != k.device:
                raise ValueError(f"PagedKV.{name} is on {x.device} but k_pool is on {k.device}")
        if n.shape[0] != t.shape[0]:
            raise ValueError(f"PagedKV.lengths {_shape(n)} and block_table {_shape(t)} must have one row per sequence")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 0):
            raise ValueError(f"PagedKV.max_len must be a non-negative int, got {self.max_len!r}")
        if self.checked or n.numel() == 0:
            return
        bs, W = k.shape[1], t.shape[1]
        if bool((n < 0).any()) or bool((n > W * bs).any()):
            raise ValueError(f"PagedKV.lengths {n.tolist()} must be in [0, {W} blocks x {bs} tokens] "
                             f"(block_table {_shape(t)})")
        used = torch.arange(W, device=t.device)[None] < (-(-n // bs))[:, None]  # (B, W)
        bad = used & ((t < 0) | (t >= k.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"PagedKV.block_table has entries outside the pool of {k.shape[0]} blocks where "
                             f"sequences hold tokens: {t[bad].tolist()[:8]}")
        if self.max_len is not None and self.max_len != int(n.max()):
            raise ValueError(f"PagedKV.max_len={self.max_len} but max(lengths)={int(n.max())}")

    # ------------------------------------------------------------------ dense view

    def gather(self) -> tuple[Tensor, Tensor]:
        """Dense copies (B, Hkv, L, D) and (B, Hkv, L, Dv) of the pages (positions past a
        sequence's length hold whatever the table's padding points at: mask them)."""
        L, bs = self.kv_len(), self.block_size
        nblk = -(-L // bs)
        table = self.block_table[:, :nblk].long().clamp(0, self.k_pool.shape[0] - 1)

        def dense(pool: Tensor) -> Tensor:  # (B, nblk, bs, Hkv, .) -> (B, Hkv, L, .)
            return pool[table].flatten(1, 2)[:, :L].transpose(1, 2)

        k = dense(self.k_pool)
        v = k[..., :self.value_dim] if self.v_pool is None else dense(self.v_pool)
        return k, v
