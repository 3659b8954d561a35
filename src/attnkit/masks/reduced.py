"""The one reduction of a call's mask that backends read (:class:`ReducedMask`).

:func:`attnkit.attention` reduces the user's mask (:mod:`attnkit.masks`) once per call; backends
read key intervals per row, per-sequence limits, the residual dense mask and bias, the ALiBi
part and a per-query selection (:class:`ReducedSelection`) from here and never walk the mask tree
themselves. Not part of the public mask API.

Notation: B batch, Sq query length, Sk key length, Hs a selection's lists per query (1, or one per
KV head), n ids per list.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .typed import (ALiBi, Additive, And, Causal, Dense, KeyPadding, Mask, Or, PrefixLM, QueryPadding, Selection,
                    SlidingWindow, has_alibi, has_bias, has_selection, has_structure, shifted_bias, split_alibi)

__all__ = ["ReducedMask", "ReducedSelection"]


def _varies_by_head(m: Mask | None) -> bool:
    """True when the keys ``m`` allows can differ between heads (see ``ReducedMask.varies_by_head``)."""
    if isinstance(m, (Dense, Additive)):
        return m.tensor.dim() >= 3 and m.tensor.shape[-3] > 1
    if isinstance(m, Selection):
        return m.heads > 1
    return isinstance(m, (And, Or)) and any(_varies_by_head(x) for x in m.masks)


class ReducedMask:
    """A call's mask reduced once, by :func:`attnkit.attention`, into what backends read.

    Backends never walk the mask tree themselves; they read this. The structure is read when the
    reduction is made (no tensor is touched, so it costs a few attribute reads per call); tensors
    are built on first use and kept, per device, for the call's lifetime.

    * ``alibi``: the :class:`ALiBi` at the top level of an AND (kernels compute it per score from
      its slopes and query positions), and ``rest``: the mask without it (None when what is left
      allows every pair, such as decode's causal part).
    * ``has_alibi`` / ``has_bias`` / ``has_structure``: see :func:`has_alibi`, :func:`has_bias`,
      :func:`has_structure`, of the whole mask; ``rest_has_bias``: of ``rest``. A selection counts
      as structure too: whole blocks of keys that no query of a tile selects can be skipped.
    * ``varies_by_head``: the allowed keys can differ between heads (a dense or additive mask with
      a head dim > 1, a selection with a list per KV head), so a per-block summary of the mask
      (FlexAttention's block mask) must be built per head, not from head 0.
    * ``is_top_left_causal`` (exactly ``j <= i``: torch's ``is_causal``) and
      ``is_bottom_right_causal`` (``Causal()`` alone, or ANDs of it: no per-sequence ``q_start``).
    * :meth:`intervals`: ``rest`` as one key interval per query row, or None.
    * :meth:`limits`: ``rest`` as per-sequence limits (first query position, keys), or None.
    * ``parts``: the parts the mask is an AND of (kernels with their own mask arguments, such as
      flash-attn's window, read them).
    * ``padding_lengths``: the (B,) lengths when ``rest`` is exactly right key padding (a paged
      call's own mask), else None.
    * :meth:`dense`: the materialized allowed mask and its bias, shifted per row.
    * ``has_selection``: the mask holds a per-query selection (:class:`~attnkit.masks.SelectedKeys`,
      :class:`~attnkit.masks.SelectedBlocks`). Such a mask is never one interval per row
      (:meth:`intervals` and :meth:`limit_parts` are None), so a backend that reads only those
      takes the dense path, which is exact.
    * ``selection``: ``rest`` as a selection a kernel reads in place (:class:`ReducedSelection`),
      or None: no selection, or one in a tree no kernel reads (two selections, a selection under
      an OR with more than one interval mask, beside a document mask...), where only
      :meth:`dense` is exact.
    """

    def __init__(self, mask: Mask | None, batch: int, q_len: int, kv_len: int):
        # Every property is worked out on first read (a decode step reads two or three of them)
        # and kept in _made: functools.cached_property takes a lock, which torch.compile cannot
        # trace.
        self.mask, self.batch, self.q_len, self.kv_len = mask, batch, q_len, kv_len
        self._made: dict = {}

    @property
    def parts(self) -> tuple[Mask, ...]:
        """The parts the whole mask is an AND of (itself when it is not an AND; () for None)."""
        m = self.mask
        return self._once("parts", lambda: () if m is None else m.masks if isinstance(m, And) else (m,))

    @property
    def rest(self) -> Mask | None:
        return self._split()[0]

    @property
    def alibi(self) -> ALiBi | None:
        return self._split()[1]

    @property
    def has_alibi(self) -> bool:
        return self._once("has_alibi", lambda: has_alibi(self.mask))

    @property
    def has_bias(self) -> bool:
        return self._once("has_bias", lambda: self.mask is not None and has_bias(self.mask))

    @property
    def rest_has_bias(self) -> bool:
        return self._once("rest_has_bias", lambda: self.rest is not None and has_bias(self.rest))

    @property
    def has_structure(self) -> bool:
        return self._once("has_structure", lambda: has_structure(self.mask) or has_selection(self.mask))

    @property
    def varies_by_head(self) -> bool:
        return self._once("varies_by_head", lambda: _varies_by_head(self.mask))

    @property
    def is_top_left_causal(self) -> bool:
        m = self.mask
        return self._once("top_left", lambda: m is not None and m.is_top_left_causal(self.q_len, self.kv_len))

    @property
    def is_bottom_right_causal(self) -> bool:
        return self._once("bottom_right", lambda: self.mask is not None and _is_bottom_right_causal(self.mask))

    @property
    def padding_lengths(self) -> Tensor | None:
        rest = self.rest
        ok = (type(rest) is KeyPadding and rest.side == "right" and rest.lengths is not None
              and rest.lengths.numel() == self.batch)
        return rest.lengths if ok else None

    @property
    def has_selection(self) -> bool:
        return self._once("has_selection", lambda: has_selection(self.mask))

    @property
    def selection(self) -> "ReducedSelection | None":
        return self._once("selection", lambda: ReducedSelection.of(self.rest, self.batch, self.q_len, self.kv_len)
                          if self.has_selection else None)

    def _split(self) -> tuple[Mask | None, ALiBi | None]:
        def make():
            rest, alibi = split_alibi(self.mask)
            if rest is not None and alibi is not None and rest.allows_all(self.q_len, self.kv_len):
                rest = None
            return rest, alibi
        return self._once("split", make)

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def intervals(self, device) -> tuple[Tensor, Tensor] | None:
        """``rest`` as (lo, hi) int64 broadcastable to (B, Sq), query i of sequence b seeing keys
        ``lo <= j < hi`` (not clamped); (0, Sk) everywhere when ``rest`` is None; None when it is
        not one interval per row (see :meth:`Mask.key_range`)."""
        device = torch.device(device)

        def make():
            if self.rest is None:
                z = torch.zeros(1, 1, dtype=torch.long, device=device)
                return z, z + self.kv_len
            return self.rest.key_range(self.batch, self.q_len, self.kv_len, device)
        return self._once(("intervals", device), make)

    def limit_parts(self) -> tuple[Causal | None, list[KeyPadding], SlidingWindow | None] | None:
        """(the Causal, the right KeyPaddings with lengths, the SlidingWindow) ``rest`` is an AND
        of (at most one Causal and one SlidingWindow; any number of paddings, e.g. a paged
        layout's lengths and a cache step's), or None when it is anything else. Structure only."""
        m = self.rest
        parts = [] if m is None else list(m.masks) if isinstance(m, And) else [m]
        causal = [p for p in parts if type(p) is Causal]
        pads = [p for p in parts if type(p) is KeyPadding and p.lengths is not None and p.side == "right"]
        windows = [p for p in parts if type(p) is SlidingWindow]
        if len(causal) + len(pads) + len(windows) != len(parts) or max(len(causal), len(windows)) > 1:
            return None
        return (causal[0] if causal else None), pads, (windows[0] if windows else None)

    def limits(self, device, no_causal: int) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """(q_start (B,), lengths (B,), window_start (B,) | None) int64: query j of sequence b
        sees keys ``< min(q_start[b] + j + 1, lengths[b])``, and with a window part also only
        keys within ``[w - left, w + right]`` of its position ``w = window_start[b] + j`` (the
        window's own anchor, which may differ from the causal part's). ``q_start`` is
        ``no_causal`` without a causal part. None when :meth:`limit_parts` is None."""
        parts = self.limit_parts()
        if parts is None:
            return None
        device = torch.device(device)

        def make():
            causal, pads, window = parts
            B = self.batch
            if causal is not None:
                q_start = causal.query_start(self.q_len, self.kv_len, device).expand(B)
            else:
                q_start = torch.full((B,), no_causal, device=device)
            lengths = torch.full((B,), self.kv_len, device=device)
            for pad in pads:  # keys past the shortest length are masked
                lengths = torch.minimum(lengths, pad.lengths.to(device).reshape(-1).expand(B))
            lengths = lengths.clamp(0, self.kv_len)
            w_start = None if window is None else window.query_start(self.q_len, self.kv_len, device).expand(B).long()
            return q_start.long(), lengths.long(), w_start
        return self._once(("limits", device, no_causal), make)

    def dense(self, device, *, alibi: bool = True, shift: bool = True) -> tuple[Tensor, Tensor | None]:
        """(allowed (B|1, H|1, Sq, Sk) bool, bias or None): the mask materialized, with
        ``alibi`` the whole mask, else ``rest``; the bias shifted per row over the allowed keys
        (:func:`shifted_bias`), or as given with ``shift=False`` (a shift changes a row's ratio
        to a sink logit)."""
        device = torch.device(device)

        def make():
            m = self.mask if alibi else self.rest
            if m is None:
                return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device), None
            allowed = m.materialize(self.batch, self.q_len, self.kv_len, device)
            bias = (shifted_bias(m, self.batch, self.q_len, self.kv_len, device, allowed=allowed) if shift
                    else m.bias(self.batch, self.q_len, self.kv_len, device))
            return allowed, bias
        return self._once(("dense", device, alibi, shift), make)


def _is_bottom_right_causal(m: Mask) -> bool:
    """True iff ``m`` is ``Causal()`` (bottom-right, no per-sequence ``q_start``), or an AND of such."""
    if isinstance(m, And):
        return all(_is_bottom_right_causal(p) for p in m.masks)
    return isinstance(m, Causal) and m.q_start is None and m.align == "bottom_right"


#: Unused slots and duplicates sort last.
_TOP = torch.iinfo(torch.long).max


def _distinct_ascending(ids: Tensor) -> Tensor:
    """int64 ids (..., n) as each list's distinct non-negative ids ascending, then :data:`_TOP`."""
    x = torch.where(ids < 0, _TOP, ids).sort(-1).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    return torch.where(dup, _TOP, x).sort(-1).values


def _is_interval(m: Mask) -> bool:
    """True when ``m`` is one key interval per row by its structure (no tensor read): causal,
    windows, prefix-LM, padding given by lengths, and ANDs of them. A bias (ALiBi nested where
    :func:`split_alibi` leaves it) is not: its values matter beyond the interval."""
    if isinstance(m, And):
        return all(_is_interval(p) for p in m.masks)
    if type(m) is KeyPadding:
        return m.lengths is not None
    return type(m) in (Causal, SlidingWindow, PrefixLM, QueryPadding)


class ReducedSelection:
    """A mask with a per-query selection, in the form a kernel reads in place.

    The mask (without ALiBi) is ``S & R`` or ``(S | W) & R``: ``S`` the selection, ``W`` an
    interval mask the selection is joined with (a local window: "the blocks before the query"),
    ``R`` what the selection is cut by (causal, padding, windows), possibly nothing. Query i of
    sequence b, head h, sees key j iff::

        (j // block_size in ids[b, h // (Hq // Hs), i]  or  union_lo[b, i] <= j < union_hi[b, i])
        and  lo[b, i] <= j < hi[b, i]

    * ``mask``: ``S`` (a :class:`~attnkit.masks.SelectedKeys` or
      :class:`~attnkit.masks.SelectedBlocks`); ``block_size`` (1 for keys); ``heads`` Hs (1:
      one list per query shared by every head; else one per group of Hq // Hs query heads).
    * :meth:`ids`: (B|1, Hs, Sq, n) int32, each list's distinct ids ascending, then -1 (so a
      kernel stops at the first -1, or after :meth:`counts` entries); :meth:`counts`: (B|1, Hs,
      Sq) int32 distinct ids per list. For :class:`~attnkit.masks.SelectedBlocks` these are
      block ids: :meth:`keys` expands them to key positions on request (the last, partial
      block's positions past Sk dropped), never on its own.
    * :meth:`union`: W as (lo, hi) int64 broadcastable to (B, Sq), or None without W.
    * :meth:`within`: R as (lo, hi) int64 broadcastable to (B, Sq) (``(0, Sk)`` without R).
      Neither is clamped to [0, Sk).

    Tensors are built on first use and kept per device. The ids were checked against Sk when the
    mask met the call (eager), so a kernel may index with them.
    """

    def __init__(self, mask: Selection, union: Mask | None, within: Mask | None, batch: int, q_len: int,
                 kv_len: int):
        self.mask, self.union_part, self.within_part = mask, union, within
        self.batch, self.q_len, self.kv_len = batch, q_len, kv_len
        self.block_size, self.heads = mask.block_size, mask.heads
        self._made: dict = {}

    @classmethod
    def of(cls, rest: Mask | None, batch: int, q_len: int, kv_len: int) -> "ReducedSelection | None":
        """``rest`` (a mask without ALiBi) as a selection a kernel reads, or None. Structure only."""
        parts = () if rest is None else rest.masks if isinstance(rest, And) else (rest,)
        picked = [p for p in parts if has_selection(p)]
        if len(picked) != 1:
            return None
        others = [p for p in parts if p is not picked[0]]
        if not all(_is_interval(p) for p in others):
            return None
        s, union = picked[0], None
        if isinstance(s, Or):
            sels = [p for p in s.masks if isinstance(p, Selection)]
            joined = [p for p in s.masks if not isinstance(p, Selection)]
            if len(sels) != 1 or len(joined) != 1 or not _is_interval(joined[0]):
                return None
            s, union = sels[0], joined[0]
        if not isinstance(s, Selection):
            return None
        within = None if not others else others[0] if len(others) == 1 else And(*others)
        return cls(s, union, within, batch, q_len, kv_len)

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def _raw_ids(self, device, start: int = 0, stop: int | None = None) -> Tensor:
        """(B|1, Hs, m, n) int64: the ids of queries ``start .. stop - 1`` as given."""
        ids = self.mask.ids
        ids = ids.unsqueeze(1) if ids.dim() == 3 else ids
        if start != 0 or (stop is not None and stop != self.q_len):
            ids = ids[:, :, start:stop]
        return ids.to(device=device, dtype=torch.long)

    def _normalized(self, device) -> tuple[Tensor, Tensor]:
        def make():
            x = _distinct_ascending(self._raw_ids(device))
            used = x != _TOP
            return torch.where(used, x, torch.full_like(x, -1)).to(torch.int32), used.sum(-1, dtype=torch.int32)
        return self._once(("ids", torch.device(device)), make)

    def lists(self, device, start: int = 0, stop: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The keys queries ``start .. stop - 1`` (m of them) see, as lists a kernel walks:
        (keys (B, m, Hs, L) int32, lo (B, m, Hs) int64, hi (B, m, Hs) int64). Entries
        ``lo <= t < hi`` of each list are exactly the key positions its heads see, ascending and
        distinct: the selected keys inside R, and W's keys inside R (each key once). Entries
        outside ``[lo, hi)`` are not keys to read (-1, or keys R cuts). Built per call of this
        method (a kernel takes a long call's queries in chunks), not kept: its size is the
        chunk's selection, L = n * block_size (+ W's longest interval)."""
        device = torch.device(device)
        stop = self.q_len if stop is None else stop
        B, m, Sk, bs = self.batch, stop - start, self.kv_len, self.block_size
        x = _distinct_ascending(self._raw_ids(device, start, stop))  # (B|1, Hs, m, n), unused: _TOP
        if bs > 1:  # blocks to their keys, still ascending; the last block's keys past Sk dropped
            pos = x[..., None] * bs + torch.arange(bs, device=device)
            x = torch.where((x[..., None] != _TOP) & (pos < Sk), pos, _TOP).flatten(-2)
        x = x.expand(B, -1, m, -1)
        lo, hi = (t.expand(B, self.q_len)[:, start:stop].clamp(0, Sk) for t in self.within(device))
        lo4, hi4 = lo[:, None, :, None], hi[:, None, :, None]  # (B, 1, m, 1)
        union = self.union(device)
        if union is None:  # an ascending list cut by one interval: the kept entries are one run
            x = x.contiguous()
            hs = x.shape[1]
            first = torch.searchsorted(x, lo4.expand(B, hs, m, 1).contiguous()).squeeze(-1)
            last = torch.searchsorted(x, hi4.expand(B, hs, m, 1).contiguous()).squeeze(-1)
        else:  # W's keys inside R joined in, the selected ones already there dropped, then sorted
            u0, u1 = (t.expand(B, self.q_len)[:, start:stop] for t in union)
            u0, u1 = torch.maximum(u0, lo), torch.minimum(u1, hi)
            span = (u1 - u0).clamp(min=0)
            w = int(span.max()) if span.numel() else 0
            keep = (x >= lo4) & (x < hi4) & ~((x >= u0[:, None, :, None]) & (x < u1[:, None, :, None]))
            x = torch.where(keep, x, _TOP)
            steps = torch.arange(w, device=device)
            joined = torch.where(steps < span[..., None], u0[..., None] + steps, _TOP)  # (B, m, w)
            x = torch.cat([x, joined[:, None].expand(B, x.shape[1], m, w)], -1).sort(-1).values
            last = (x != _TOP).sum(-1)
            first = torch.zeros_like(last)
        keys = torch.where(x == _TOP, -1, x).to(torch.int32).transpose(1, 2).contiguous()
        return keys, first.transpose(1, 2).contiguous(), last.transpose(1, 2).contiguous()

    def ids(self, device) -> Tensor:
        """(B|1, Hs, Sq, n) int32: each list's distinct ids, ascending, then -1."""
        return self._normalized(device)[0]

    def counts(self, device) -> Tensor:
        """(B|1, Hs, Sq) int32: the number of distinct ids in each list."""
        return self._normalized(device)[1]

    def keys(self, device) -> Tensor:
        """(B|1, Hs, Sq, n * block_size) int32: the selected key positions of each list,
        ascending, then -1 (:meth:`ids` itself for a key selection)."""
        def make():
            ids = self.ids(device)
            if self.block_size == 1:
                return ids
            bs = self.block_size
            pos = ids.long()[..., None] * bs + torch.arange(bs, device=ids.device)
            ok = (ids[..., None] >= 0) & (pos < self.kv_len)
            return torch.where(ok, pos, torch.full_like(pos, -1)).flatten(-2).to(torch.int32)
        return self._once(("keys", torch.device(device)), make)

    def union(self, device) -> tuple[Tensor, Tensor] | None:
        """W as (lo, hi) int64 broadcastable to (B, Sq), or None when the selection stands alone."""
        if self.union_part is None:
            return None
        return self._once(("union", torch.device(device)),
                          lambda: self.union_part.key_range(self.batch, self.q_len, self.kv_len, device))

    def within(self, device) -> tuple[Tensor, Tensor]:
        """R as (lo, hi) int64 broadcastable to (B, Sq); (0, Sk) without R."""
        def make():
            # no R, or a decode step's bottom-right causal (its one query sees every key): no positions to work out
            if self.within_part is None or (self.q_len == 1 and _is_bottom_right_causal(self.within_part)):
                z = torch.zeros(1, 1, dtype=torch.long, device=device)
                return z, z + self.kv_len
            return self.within_part.key_range(self.batch, self.q_len, self.kv_len, device)
        return self._once(("within", torch.device(device)), make)
