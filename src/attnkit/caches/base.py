"""The KV-cache protocol and the contiguous caches (dynamic and static).

Notation: B batch, Hkv key/value heads (a cache never stores K/V repeated to Hq heads), S new
tokens this step, L cache length (or capacity), D key head dim, Dv value head dim.

Every cache keeps ``lengths`` (B,): how many tokens each sequence holds. ``update(k, v)`` writes
this step's S tokens of sequence b at positions ``lengths[b] .. lengths[b] + S - 1`` and returns
what to attend to plus the mask that makes it right::

    k_all, v_all, mask = cache.update(k, v)         # k: (B, Hkv, S, D)
    out = attnkit.attention(q, k_all, v_all, mask)  # q: (B, Hq, S, D), no causal flag needed

``mask`` is ``Causal(offsets=old_lengths) & KeyPadding(new_lengths)``: query i of sequence b sits
at position ``old_lengths[b] + i`` and sees the keys at or before it. (``DynamicCache`` returns
the equivalent plain ``Causal()`` when every sequence is equally long.) Prefill, decode of one or
several tokens (speculative verification) and chunked prefill all go through the same call.
Ragged batches: ``update(k, v, num_new=n)`` with right-padded new tokens advances sequence b by
``n[b]`` only (its padding is overwritten by the next step).

Modules call ``cache.attend(q, k, v, mask)``: update, then :func:`attnkit.attention` over what
the cache returns. A cache whose memory is not one tensor per sequence (paged) overrides
``attend`` to run its own attention over its layout, with the same result.

``value_from_key=True`` stores K only and reads V as its first ``v_head_dim`` channels
(``v_head_dim <= head_dim``): MLA's latent cache keeps ``[c_kv, k_rope]`` per token and attends
with V = ``c_kv``, so nothing is stored twice. ``update(k, None)`` then.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional import attention
from ..masks import Causal, KeyPadding, Mask, as_mask

__all__ = ["KVCache", "DynamicCache", "StaticCache"]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


class KVCache(nn.Module):
    """Base of the caches: per-sequence ``lengths``, size accounting, the update contract.

    Buffers are non-persistent (``.to()`` moves them; state dicts stay weight-only).
    """

    def __init__(self, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                 value_from_key: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, val in (("kv_heads", kv_heads), ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if value_from_key and v_head_dim > head_dim:
            raise ValueError(f"value_from_key needs v_head_dim <= head_dim, got {v_head_dim} > {head_dim}")
        self.kv_heads, self.head_dim, self.v_head_dim = kv_heads, head_dim, v_head_dim
        self.value_from_key = bool(value_from_key)
        self.dtype = dtype
        self.register_buffer("lengths", torch.zeros(0, dtype=torch.long, device=device), persistent=False)

    # ---------------------------------------------------------------- accounting

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies in this layer's cache (K and V, Hkv heads)."""
        values = self.head_dim + (0 if self.value_from_key else self.v_head_dim)
        return self.kv_heads * values * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds allocated now (capacity, not just the filled part)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---------------------------------------------------------------- protocol

    def positions(self, num_new: int) -> Tensor:
        """(B, S) positions of the next ``num_new`` tokens of each sequence (for RoPE); (1, S)
        shared by the batch while the cache is still empty."""
        step = torch.arange(num_new, device=self.lengths.device)
        return step[None] if self.lengths.numel() == 0 else self.lengths[:, None] + step

    def update(self, k: Tensor, v: Tensor | None, *, num_new: Tensor | None = None) -> tuple[Tensor, Tensor, Mask]:
        """Append this step's k (B, Hkv, S, D) and v (B, Hkv, S, Dv) (None with
        ``value_from_key``); returns (k_all (B, Hkv, L, D), v_all (B, Hkv, L, Dv), mask)."""
        raise NotImplementedError

    def attend(self, q: Tensor, k: Tensor, v: Tensor | None, mask=None, *,
               num_new: Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0,
               backend: str = "auto", return_weights: bool = False):
        """Append k (B, Hkv, S, D), v (B, Hkv, S, Dv) and attend q (B, Hq, S, D) over everything
        cached. ``mask`` (anything :func:`attnkit.attention` takes, over (B, Hq, S, L)) is ANDed
        with the cache's own. Returns what :func:`attnkit.attention` returns: (B, Hq, S, Dv)."""
        user_mask = as_mask(mask)
        k_all, v_all, cache_mask = self.update(k, v, num_new=num_new)
        full = cache_mask if user_mask is None else cache_mask & user_mask
        return attention(q, k_all, v_all, full, scale=scale, dropout_p=dropout_p, backend=backend,
                         return_weights=return_weights)

    def _check_new(self, k: Tensor, v: Tensor | None, num_new) -> Tensor:
        """Validate this step's K/V; returns num_new as a (B,) long tensor."""
        if self.value_from_key:
            if v is not None:
                raise ValueError("this cache reads V from K (value_from_key=True); pass v=None")
            v = k[..., :self.v_head_dim]
        elif v is None:
            raise ValueError("v is None but this cache stores values (value_from_key=False)")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {self.dtype}")
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"k and v must be (B, Hkv, S, D), got k {_shape(k)}, v {_shape(v)}")
        B, H, S, D = k.shape
        if v.shape[:3] != k.shape[:3] or H != self.kv_heads or D != self.head_dim or v.shape[3] != self.v_head_dim:
            raise ValueError(f"k {_shape(k)} and v {_shape(v)} do not fit this cache "
                             f"(Hkv={self.kv_heads}, D={self.head_dim}, Dv={self.v_head_dim})")
        if self.lengths.numel() and B != self.lengths.shape[0]:
            raise ValueError(f"k has batch {B} but the cache holds {self.lengths.shape[0]} sequences; "
                             f"reset() or reorder() it first")
        if num_new is None:
            return torch.full((B,), S, dtype=torch.long, device=k.device)
        n = torch.as_tensor(num_new, device=k.device)
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.shape not in ((B,), ()):
            raise ValueError(f"num_new must be an int or a (B,) int tensor with B={B}, got "
                             f"{n.dtype} of shape {tuple(n.shape)}")
        n = n.long().expand(B)
        if not torch.compiler.is_compiling() and ((n < 0) | (n > S)).any():
            raise ValueError(f"num_new must be in [0, S={S}], got {n.tolist()}")
        return n

    @staticmethod
    def _mask(old: Tensor, new: Tensor) -> Mask:
        return Causal(offsets=old) & KeyPadding(new)

    # ---------------------------------------------------------------- editing

    def reset(self) -> None:
        """Forget every sequence (buffers are kept for reuse)."""
        self.lengths = self.lengths.new_zeros(0)

    def crop(self, n) -> None:
        """Keep the first ``n`` tokens of each sequence (int or (B,) tensor); a negative int drops
        ``-n`` tokens from the end (rolling back rejected speculative tokens)."""
        n = torch.as_tensor(n, device=self.lengths.device).long()
        keep = self.lengths + n if (n.dim() == 0 and int(n) < 0) else n.expand_as(self.lengths)
        if (keep < 0).any():
            raise ValueError(f"crop({n.tolist()}) would leave a negative length: lengths {self.lengths.tolist()}")
        self.lengths = torch.minimum(self.lengths, keep)

    def reorder(self, indices: Tensor) -> None:
        """Select / repeat sequences along the batch (beam search): new sequence i = old indices[i]."""
        idx = torch.as_tensor(indices, device=self.lengths.device)
        if idx.dtype.is_floating_point or idx.dim() != 1:
            raise ValueError(f"indices must be a 1-D int tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.lengths.shape[0]):
            raise ValueError(f"indices {idx.tolist()} out of range for {self.lengths.shape[0]} sequences")
        self._reorder_buffers(idx.long())
        self.lengths = self.lengths[idx]

    def _reorder_buffers(self, idx: Tensor) -> None:
        raise NotImplementedError


class _ContiguousCache(KVCache):
    """K/V in (B, Hkv, capacity, D) buffers; tokens written in place by scatter (no cat per step).
    With ``value_from_key`` there is no V buffer (``v_buf`` stays empty)."""

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, value_from_key=False, dtype=torch.float32,
                 device=None):
        super().__init__(kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype, device=device)
        self.register_buffer("k_buf", torch.zeros(0, kv_heads, 0, head_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_buf", torch.zeros(0, kv_heads, 0, self.v_head_dim, dtype=dtype, device=device),
                             persistent=False)

    def _stored(self) -> list[tuple[str, int]]:
        """(buffer name, channels) of what this cache keeps."""
        return [("k_buf", self.head_dim)] + ([] if self.value_from_key else [("v_buf", self.v_head_dim)])

    def _alloc(self, batch: int, length: int) -> None:
        """Fresh zero buffers of (batch, Hkv, length, ·), keeping what fits of the old ones."""
        for name, dim in self._stored():
            old = getattr(self, name)
            buf = old.new_zeros(batch, self.kv_heads, length, dim)
            rows, cols = min(batch, old.shape[0]), min(length, old.shape[2])
            buf[:rows, :, :cols] = old[:rows, :, :cols]
            setattr(self, name, buf)

    def _write(self, k: Tensor, v: Tensor | None, start: Tensor | int) -> None:
        """Write the step's S tokens of sequence b at ``start[b] ..`` (an int: one slice copy)."""
        B, H, S, _ = k.shape
        for (name, dim), t in zip(self._stored(), (k, v)):
            buf = getattr(self, name)
            if isinstance(start, int):
                buf[:B, :, start:start + S].copy_(t)
            else:
                pos = start[:, None] + torch.arange(S, device=k.device)  # (B, S)
                buf[:B].scatter_(2, pos[:, None, :, None].expand(B, H, S, dim), t)

    def _views(self, batch: int, length: int) -> tuple[Tensor, Tensor]:
        k = self.k_buf[:batch, :, :length]
        return k, (k[..., :self.v_head_dim] if self.value_from_key else self.v_buf[:batch, :, :length])

    def _reserve(self, batch: int, needed: int) -> None:
        """Make room for ``needed`` tokens per sequence for a batch of ``batch``."""
        raise NotImplementedError

    def _view_len(self) -> int:
        """How many positions of the buffers ``update`` returns."""
        raise NotImplementedError

    def update(self, k, v, *, num_new=None):
        n = self._check_new(k, v, num_new)
        B, _, S, _ = k.shape
        if self.lengths.numel() == 0:
            self.lengths = torch.zeros(B, dtype=torch.long, device=k.device)
        self._reserve(B, S)
        old = self.lengths.clone()
        self._write(k, v, old)
        self.lengths.add_(n)  # in place: a static cache's buffers keep their identity under compile
        return (*self._views(B, self._view_len()), self._mask(old, self.lengths))

    def _reorder_buffers(self, idx):
        for name, _ in self._stored():
            setattr(self, name, getattr(self, name)[: self.lengths.shape[0]][idx])

    def append_uniform(self, k: Tensor, v: Tensor | None, start: int) -> tuple[Tensor, Tensor]:
        """``update`` for a batch whose sequences all hold ``start`` tokens (a decode loop over
        left-padded prompts keeps them so), without its checks and mask: one slice copy per
        buffer and an in-place length bump. k (B, Hkv, S, D) -> (k_all, v_all) over
        ``start + S`` positions, every key before each query (no mask needed)."""
        if (k.dim() != 4 or k.shape[1] != self.kv_heads or k.shape[3] != self.head_dim or k.dtype != self.dtype
                or (v is None) != self.value_from_key or start < 0):
            raise ValueError(f"append_uniform: k {tuple(k.shape)} {k.dtype}, v "
                             f"{None if v is None else tuple(v.shape)}, start={start} do not fit this cache "
                             f"(Hkv={self.kv_heads}, D={self.head_dim}, {self.dtype}, value_from_key="
                             f"{self.value_from_key})")
        B, _, S, _ = k.shape
        if self.lengths.numel() == 0:
            self.lengths = torch.zeros(B, dtype=torch.long, device=k.device)
        self._room_for(B, start + S)
        self._write(k, v, start)
        self.lengths.add_(S)
        return self._views(B, start + S)

    def _room_for(self, batch: int, end: int) -> None:
        """Make room for ``end`` tokens in every sequence of a batch of ``batch`` (Python ints:
        no device sync)."""
        raise NotImplementedError


class DynamicCache(_ContiguousCache):
    """Grows with the sequences: capacity doubles when full (amortised O(1) per token; one copy
    per doubling, not a ``torch.cat`` per step). ``update`` returns views up to the longest
    sequence's end.

    Eager-only by design (its shapes change every step), so it mirrors ``lengths`` as Python
    ints: sizes need no device sync, and a batch whose sequences are all equally long (the
    common case) is written with one slice copy and gets the plain bottom-right ``Causal()``
    mask, which the backends run without materializing (and drop for one-token steps).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host: list[int] = []

    def _sync_host(self) -> None:
        self._host = self.lengths.tolist()

    def update(self, k, v, *, num_new=None):
        n = self._check_new(k, v, num_new)
        B, _, S, _ = k.shape
        if not self._host:
            self.lengths = torch.zeros(B, dtype=torch.long, device=k.device)
            self._host = [0] * B
        old_host = self._host
        self._reserve(B, S)
        new_host = [o + S for o in old_host] if num_new is None else [o + m for o, m in zip(old_host, n.tolist())]
        if num_new is None and min(old_host) == max(old_host):  # uniform: one slice copy each
            self._write(k, v, old_host[0])
            mask = Causal()
        else:
            old = self.lengths.clone()
            self._write(k, v, old)
            mask = self._mask(old, self.lengths + n)
        self.lengths.add_(n)
        self._host = new_host
        return (*self._views(B, max(new_host)), mask)

    def _reserve(self, batch, needed):
        self._room_for(batch, max(self._host) + needed)

    def _room_for(self, batch, end):
        cap = self.k_buf.shape[2]
        if self.k_buf.shape[0] != batch or end > cap:
            self._alloc(batch, max(end, 2 * cap, 16))

    def append_uniform(self, k, v, start):
        views = super().append_uniform(k, v, start)
        self._host = [start + k.shape[2]] * k.shape[0]
        return views

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
    """Preallocated (max_batch, Hkv, max_len, D) buffers: every ``update`` returns the same shapes
    and the positions are tensors, so a decode step compiles once (``torch.compile``) and never
    recompiles per step. Writing past ``max_len`` raises a ValueError."""

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, max_batch: int, max_len: int,
                 value_from_key=False, dtype=torch.float32, device=None):
        super().__init__(kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype, device=device)
        if max_batch < 1 or max_len < 1:
            raise ValueError(f"max_batch and max_len must be >= 1, got {max_batch}, {max_len}")
        self.max_batch, self.max_len = max_batch, max_len
        self._alloc(max_batch, max_len)

    def _reserve(self, batch, needed):
        self._room_for(batch, None)
        if not torch.compiler.is_compiling():
            end = int((self.lengths + needed).max())
            if end > self.max_len:
                raise ValueError(f"writing {needed} tokens after lengths {self.lengths.tolist()} overflows "
                                 f"the static cache's max_len {self.max_len}")

    def _room_for(self, batch, end):
        if batch != self.max_batch:
            raise ValueError(f"k has batch {batch} but the static cache was built for max_batch="
                             f"{self.max_batch}; build it for the batch you run")
        if end is not None and end > self.max_len:
            raise ValueError(f"writing up to position {end} overflows the static cache's max_len {self.max_len}")

    def _view_len(self):
        return self.max_len

    def _reorder_buffers(self, idx):
        if idx.numel() != self.max_batch:
            raise ValueError(f"a static cache keeps max_batch={self.max_batch} sequences; reorder got "
                             f"{idx.numel()} indices")
        for name, _ in self._stored():
            buf = getattr(self, name)
            buf.copy_(buf[idx])
