"""The user's typed, composable attention masks (and ALiBi, composition, normalisation).

A mask says which key each query may attend to (True = attend). Every mask can

* ``materialize(batch, q_len, kv_len)`` to a bool tensor of 4 dims broadcastable to
  ``(B, H, Sq, Sk)`` (size-1 dims where the mask does not depend on them),
* give an additive ``bias(...)`` (only :class:`Additive` carries one; others return ``None``),
* build a ``mask_mod(b, h, q_idx, kv_idx)`` for FlexAttention,
* ``check(batch, heads, q_len, kv_len)`` that it fits a call, raising ``ValueError`` otherwise.

Masks compose with ``&`` (both allow) and ``|`` (either allows).

Positions. A query's position in key coordinates is ``i + q_start``: the position of the
step's first query. ``align="bottom_right"`` uses ``q_start = Sk - Sq`` (the last query sits on
the last key: decode, chunked prefill, cached verification), ``align="top_left"`` uses
``q_start = 0`` (torch's ``is_causal``), and ``q_start=`` gives one per sequence (a ragged batch
where sequence ``b`` has ``q_start[b]`` cached tokens before this step's queries).

Selections (:class:`SelectedKeys`, :class:`SelectedBlocks`) list, per query, the keys or key
blocks it sees (a sparse model's top-k); they compose with every other mask.

Notation: B batch, H heads, Sq query length, Sk key length.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "Mask",
    "Causal",
    "SlidingWindow",
    "KeyPadding",
    "QueryPadding",
    "Document",
    "PrefixLM",
    "Dense",
    "Additive",
    "Selection",
    "SelectedKeys",
    "SelectedBlocks",
    "ALiBi",
    "alibi_slopes",
    "split_alibi",
    "And",
    "Or",
    "as_mask",
    "has_bias",
    "has_alibi",
    "has_selection",
    "has_structure",
    "shifted_bias",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_ALIGNS = ("bottom_right", "top_left")


class Mask:
    """Base class. Subclasses implement ``_materialize`` and ``mask_mod``."""

    #: True when the mask holds tensors (so FlexAttention block masks are cached per instance).
    has_tensors: bool = False

    def materialize(
        self, batch: int, q_len: int, kv_len: int, device: torch.device | str | None = None
    ) -> Tensor:
        """Bool tensor (B|1, H|1, Sq, Sk), True = attend."""
        out = self._materialize(batch, q_len, kv_len, torch.device(device or "cpu"))
        return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))

    def _materialize(self, batch: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        raise NotImplementedError

    def bias(
        self, batch: int, q_len: int, kv_len: int, device: torch.device | str | None = None
    ) -> Tensor | None:
        """Additive float bias (B|1, H|1, Sq, Sk) or None when the mask is purely boolean."""
        return None

    def mask_mod(self, q_len: int, kv_len: int, device: torch.device | str | None = None) -> MaskMod:
        """FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for a (Sq, Sk) call."""
        raise NotImplementedError

    def check(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Raise ValueError if this mask cannot describe a (B, H, Sq, Sk) call."""

    def is_top_left_causal(self, q_len: int, kv_len: int) -> bool:
        """True iff the mask equals ``j <= i`` exactly (what torch SDPA's ``is_causal`` does)."""
        return False

    def allows_all(self, q_len: int, kv_len: int) -> bool:
        """True when the mask allows every (query, key) pair of a (Sq, Sk) call, so callers may
        drop it (bottom-right causal with Sq = 1: every decode step)."""
        return False

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors this mask holds (lengths, query starts, dense masks)."""
        return ()

    def keys_by_position(self) -> bool:
        """True when what the mask says of (query i, key j) depends on their positions only, not
        on the number of keys Sk: over Sk' < Sk keys it is this mask's first Sk' columns. (A
        cache may then hand attention only the keys its rows hold.) Positional masks anchored
        at explicit query positions, key lengths and their combinations; not dense tensors or
        bottom-right alignment, which moves with Sk."""
        return False

    def key_range(self, batch: int, q_len: int, kv_len: int, device=None) -> tuple[Tensor, Tensor] | None:
        """The mask as one interval of keys per query row, or None when it is not one.

        Returns (lo, hi), int64 tensors broadcastable to (B, Sq): query i of sequence b sees key
        j iff ``lo[b, i] <= j < hi[b, i]`` (before clamping to [0, Sk)), the same for every
        head. Causal, windows, padding and prefix-LM masks are intervals (and so are ANDs of
        them); kernels that walk keys in order use this instead of a materialized mask."""
        return None

    def block_occupancy(self, batch: int, q_len: int, kv_len: int, q_block: int, kv_block: int,
                        device=None) -> Tensor | None:
        """Which (query block, key block) tiles may hold an allowed pair, without the (Sq, Sk) mask.

        Returns a bool tensor (B|1, H|1, ceil(Sq / q_block), ceil(Sk / kv_block)), False only
        for tiles where the mask allows no pair (a superset of the tiles that matter, for block
        sparse kernels: FlexAttention's block mask), or None when the mask cannot tell (any tile
        may). A selection's H dim is its lists (Hs), query head h reading list h // (H / Hs).
        Here: from :meth:`key_range`."""
        r = self.key_range(batch, q_len, kv_len, device)
        if r is None:
            return None
        return _interval_occupancy(r[0], r[1], q_len, kv_len, q_block, kv_block)

    def cache_key(self) -> tuple:
        """Hashable key of what this mask allows, for caches of derived structures (FlexAttention
        block masks). Tensor-free masks: their structure. Masks holding tensors: this object and
        its tensors' version counters, so editing a lengths tensor in place gives a new key."""
        return (type(self).__name__, id(self), tuple(t._version for t in self.tensors()))

    def __and__(self, other: "Mask") -> "Mask":
        return And(self, _coerce(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return Or(self, _coerce(other, "|"))


def _coerce(other, op: str) -> Mask:
    if not isinstance(other, Mask):
        raise TypeError(f"cannot combine a Mask with {type(other).__name__} using '{op}'; wrap tensors "
                        "in attnkit.masks.Dense or attnkit.masks.Additive")
    return other


# --------------------------------------------------------------------------- positions


def _as_index_tensor(x, name: str) -> Tensor:
    if isinstance(x, Tensor) and x.dtype == torch.long:
        return x  # what as_tensor(x).long() returns, without its two dispatches (every paged call)
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.long()


def _check_per_batch(t: Tensor | None, name: str, batch: int) -> None:
    if t is None or t.dim() == 0:
        return
    if t.dim() != 1 or t.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be an int or a (B,) tensor with B={batch}, got shape {tuple(t.shape)}")


def _per_batch(t: Tensor, device: torch.device) -> Tensor:
    """(B,) or scalar -> (B|1, 1, 1, 1)."""
    return t.to(device).reshape(-1, 1, 1, 1)


def _interval_occupancy(lo: Tensor, hi: Tensor, q_len: int, kv_len: int, q_block: int, kv_block: int) -> Tensor:
    """(B|1, 1, nqb, nkb) bool: the key blocks that meet some query's [lo, hi) in each query
    block, from per-query intervals broadcastable to (B, Sq)."""
    lo, hi = torch.broadcast_tensors(lo.long().reshape((1,) * (2 - lo.dim()) + tuple(lo.shape)),
                                     hi.long().reshape((1,) * (2 - hi.dim()) + tuple(hi.shape)))
    lo, hi = lo.clamp(0, kv_len), hi.clamp(0, kv_len)
    if lo.shape[1] != q_len:  # one interval for every query
        lo, hi = lo.expand(-1, q_len), hi.expand(-1, q_len)
    empty = hi <= lo  # a query that sees nothing widens no block's span
    lo, hi = lo.masked_fill(empty, kv_len), hi.masked_fill(empty, 0)
    nqb, nkb = -(-q_len // q_block), -(-kv_len // kv_block)
    pad = nqb * q_block - q_len
    lo = torch.nn.functional.pad(lo, (0, pad), value=kv_len).view(-1, nqb, q_block).amin(-1)
    hi = torch.nn.functional.pad(hi, (0, pad), value=0).view(-1, nqb, q_block).amax(-1)
    start = torch.arange(nkb, device=lo.device) * kv_block
    return ((start < hi[..., None]) & (start + kv_block > lo[..., None]))[:, None]


def _q_start_arg(q_start, offsets, owner: str):
    """The ``q_start=`` argument of a positional mask, taking the deprecated ``offsets=`` spelling
    too (with a DeprecationWarning); returns (value, the name the caller used)."""
    if offsets is None:
        return q_start, "q_start"
    if q_start is not None:
        raise TypeError(f"{owner} got both q_start= and offsets= (the old name of q_start); pass q_start= only")
    warnings.warn(f"{owner}(offsets=...) is deprecated; pass q_start=... (the position of each sequence's "
                  f"first query in key coordinates)", DeprecationWarning, stacklevel=3)
    return offsets, "offsets"


class _Positional(Mask):
    """Shared query-position logic for masks that compare a query's position with key indices."""

    def __init__(self, align: str, q_start, arg_name: str = "q_start"):
        if q_start is None and align not in _ALIGNS:
            raise ValueError(f"align must be one of {_ALIGNS}, got {align!r}")
        self.align = align
        self._arg_name = arg_name  # errors name the argument as the caller spelled it
        self.q_start = None if q_start is None else _as_index_tensor(q_start, arg_name)
        self.has_tensors = self.q_start is not None

    @property
    def offsets(self) -> Tensor | None:
        """Deprecated name of :attr:`q_start`."""
        warnings.warn(f"{type(self).__name__}.offsets is deprecated; read .q_start", DeprecationWarning,
                      stacklevel=2)
        return self.q_start

    def _start(self, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """(B|1, 1, 1, 1) position of each sequence's first query."""
        if self.q_start is not None:
            return _per_batch(self.q_start, device)
        start = kv_len - q_len if self.align == "bottom_right" else 0
        return torch.tensor(start, device=device).reshape(1, 1, 1, 1)

    def query_start(self, q_len: int, kv_len: int, device=None) -> Tensor:
        """(B|1,) int64: the position of each sequence's first query in key coordinates."""
        return self._start(q_len, kv_len, torch.device(device or "cpu")).reshape(-1)

    def _grid(self, q_len: int, kv_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Query positions (B|1, 1, Sq, 1) and key indices (1, 1, 1, Sk)."""
        qi = torch.arange(q_len, device=device).reshape(1, 1, -1, 1)
        kj = torch.arange(kv_len, device=device).reshape(1, 1, 1, -1)
        return qi + self._start(q_len, kv_len, device), kj

    def _positions(self, q_len: int, kv_len: int, device) -> Tensor:
        """(B|1, Sq) int64 position of each query in key coordinates."""
        return torch.arange(q_len, device=device)[None] + self._start(q_len, kv_len, device).reshape(-1, 1)

    def _start_fn(self, q_len: int, kv_len: int, device) -> Callable[[Tensor], Tensor]:
        if self.q_start is not None:
            q_start = self.q_start.to(device)
            return lambda b: q_start[b] if q_start.dim() else q_start
        start = kv_len - q_len if self.align == "bottom_right" else 0
        return lambda b: start

    def check(self, batch, heads, q_len, kv_len):
        _check_per_batch(self.q_start, self._arg_name, batch)

    def tensors(self):
        return () if self.q_start is None else (self.q_start,)

    def keys_by_position(self) -> bool:
        return self.q_start is not None or self.align == "top_left"

    def _describe_pos(self) -> str:
        return "q_start=<tensor>" if self.q_start is not None else f"align={self.align!r}"


class Causal(_Positional):
    """Query at position p sees key j iff j <= p.

    ``Causal()`` is bottom-right aligned (j <= i + Sk - Sq); ``Causal("top_left")`` is torch's
    ``is_causal`` (j <= i); ``Causal(q_start=cache_lens)`` is a ragged batch (j <= i + cache_lens[b]).
    ``offsets=`` is the deprecated name of ``q_start=``.
    """

    def __init__(self, align: str = "bottom_right", *, q_start=None, offsets=None):
        super().__init__(align, *_q_start_arg(q_start, offsets, "Causal"))

    def _materialize(self, batch, q_len, kv_len, device):
        qpos, kj = self._grid(q_len, kv_len, device)
        return kj <= qpos

    def mask_mod(self, q_len, kv_len, device=None):
        start = self._start_fn(q_len, kv_len, device)
        return lambda b, h, q, kv: kv <= q + start(b)

    def key_range(self, batch, q_len, kv_len, device=None):
        pos = self._positions(q_len, kv_len, torch.device(device or "cpu"))
        return torch.zeros_like(pos), pos + 1

    def is_top_left_causal(self, q_len, kv_len):
        return self.q_start is None and (self.align == "top_left" or q_len == kv_len)

    def allows_all(self, q_len, kv_len):
        if self.q_start is not None:
            return False
        return q_len <= 1 if self.align == "bottom_right" else kv_len <= 1

    def cache_key(self):
        return super().cache_key() if self.q_start is not None else ("causal", self.align)

    def __repr__(self):
        return f"Causal({self._describe_pos()})"


class SlidingWindow(_Positional):
    """Query at position p sees key j iff p - left <= j <= p + right.

    ``left``/``right`` are extents in tokens (None = unbounded), as flash-attention's
    ``window_size``. A Mistral-style window of W tokens including the current one is
    ``SlidingWindow(W - 1)``; ``right=0`` (the default) keeps it causal. ``q_start`` as in
    :class:`Causal` (``offsets=`` is its deprecated name).
    """

    def __init__(self, left: int | None, right: int | None = 0, *, align: str = "bottom_right", q_start=None,
                 offsets=None):
        for name, val in (("left", left), ("right", right)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {val!r}")
        super().__init__(align, *_q_start_arg(q_start, offsets, "SlidingWindow"))
        self.left, self.right = left, right

    def _materialize(self, batch, q_len, kv_len, device):
        qpos, kj = self._grid(q_len, kv_len, device)
        ok = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        if self.left is not None:
            ok = ok & (kj >= qpos - self.left)
        if self.right is not None:
            ok = ok & (kj <= qpos + self.right)
        return ok

    def mask_mod(self, q_len, kv_len, device=None):
        start = self._start_fn(q_len, kv_len, device)
        left, right = self.left, self.right

        def mod(b, h, q, kv):
            p = q + start(b)
            ok = kv >= kv  # all-True of the right shape
            if left is not None:
                ok = ok & (kv >= p - left)
            if right is not None:
                ok = ok & (kv <= p + right)
            return ok

        return mod

    def cache_key(self):
        if self.q_start is not None:
            return super().cache_key()
        return ("window", self.left, self.right, self.align)

    def key_range(self, batch, q_len, kv_len, device=None):
        pos = self._positions(q_len, kv_len, torch.device(device or "cpu"))
        lo = torch.zeros_like(pos) if self.left is None else pos - self.left
        hi = torch.full_like(pos, kv_len) if self.right is None else pos + self.right + 1
        return lo, hi

    def __repr__(self):
        return f"SlidingWindow(left={self.left}, right={self.right}, {self._describe_pos()})"


class PrefixLM(_Positional):
    """Bidirectional over each sequence's prefix, causal after it: j < prefix[b] or j <= p.
    ``q_start`` as in :class:`Causal` (``offsets=`` is its deprecated name)."""

    def __init__(self, prefix_lengths, *, align: str = "bottom_right", q_start=None, offsets=None):
        super().__init__(align, *_q_start_arg(q_start, offsets, "PrefixLM"))
        self.prefix = _as_index_tensor(prefix_lengths, "prefix_lengths")
        self.has_tensors = True

    def check(self, batch, heads, q_len, kv_len):
        super().check(batch, heads, q_len, kv_len)
        _check_per_batch(self.prefix, "prefix_lengths", batch)

    def tensors(self):
        return (self.prefix, *super().tensors())

    def _materialize(self, batch, q_len, kv_len, device):
        qpos, kj = self._grid(q_len, kv_len, device)
        return (kj <= qpos) | (kj < _per_batch(self.prefix, device))

    def mask_mod(self, q_len, kv_len, device=None):
        start = self._start_fn(q_len, kv_len, device)
        prefix = self.prefix.to(device)
        pre = (lambda b: prefix[b]) if prefix.dim() else (lambda b: prefix)
        return lambda b, h, q, kv: (kv <= q + start(b)) | (kv < pre(b))

    def key_range(self, batch, q_len, kv_len, device=None):
        pos = self._positions(q_len, kv_len, torch.device(device or "cpu"))
        prefix = self.prefix.to(pos.device).reshape(-1, 1)
        return torch.zeros_like(pos), torch.maximum(pos + 1, prefix)

    def __repr__(self):
        return f"PrefixLM({self._describe_pos()})"


# --------------------------------------------------------------------------- padding


class _Padding(Mask):
    """Valid positions along one axis, from lengths (B,) or a (B, S) bool tensor."""

    axis_name = "kv_len"
    has_tensors = True

    def __init__(self, lengths=None, *, valid: Tensor | None = None, side: str = "right"):
        if (lengths is None) == (valid is None):
            raise ValueError(f"{type(self).__name__} takes exactly one of lengths= or valid=")
        if side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left', got {side!r}")
        if valid is not None:
            if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
                raise TypeError(f"valid must be a (B, S) bool tensor, got "
                                f"{getattr(valid, 'dtype', type(valid).__name__)} of shape "
                                f"{tuple(getattr(valid, 'shape', ()))}")
        self.lengths = None if lengths is None else _as_index_tensor(lengths, "lengths")
        self.valid, self.side = valid, side

    def tensors(self):
        return (self.valid,) if self.valid is not None else (self.lengths,)

    def _axis_valid(self, length: int, device) -> Tensor:
        """(B|1, S) bool."""
        if self.valid is not None:
            return self.valid.to(device)
        idx = torch.arange(length, device=device).unsqueeze(0)
        lens = self.lengths.to(device).reshape(-1, 1)
        return idx < lens if self.side == "right" else idx >= length - lens

    def _axis_valid_fn(self, length: int, device) -> Callable[[Tensor, Tensor], Tensor]:
        valid = self._axis_valid(length, device)
        if valid.shape[0] == 1:
            return lambda b, i: valid[0, i]
        return lambda b, i: valid[b, i]

    def check(self, batch, heads, q_len, kv_len):
        length = q_len if self.axis_name == "q_len" else kv_len
        if self.valid is not None:
            if self.valid.shape[0] not in (1, batch) or self.valid.shape[1] != length:
                raise ValueError(f"{type(self).__name__}: valid has shape {tuple(self.valid.shape)}, "
                                 f"expected ({batch}, {length}) for B={batch}, {self.axis_name}={length}")
        else:
            _check_per_batch(self.lengths, "lengths", batch)


class KeyPadding(_Padding):
    """Keys at padded positions are never attended: ``lengths`` (B,) or ``valid`` (B, Sk) bool.

    ``side="left"`` means the valid keys are the last ``lengths[b]`` (left-padded prompts).
    """

    axis_name = "kv_len"

    def _materialize(self, batch, q_len, kv_len, device):
        return self._axis_valid(kv_len, device)[:, None, None, :]

    def mask_mod(self, q_len, kv_len, device=None):
        ok = self._axis_valid_fn(kv_len, device)
        return lambda b, h, q, kv: ok(b, kv)

    def keys_by_position(self) -> bool:
        return self.lengths is not None and self.side == "right"

    def key_range(self, batch, q_len, kv_len, device=None):
        if self.lengths is None:
            return None
        lens = self.lengths.to(torch.device(device or "cpu")).reshape(-1, 1)
        if self.side == "right":
            return torch.zeros_like(lens), lens
        return kv_len - lens, torch.full_like(lens, kv_len)

    def __repr__(self):
        return f"KeyPadding(side={self.side!r})"


class QueryPadding(_Padding):
    """Padded queries attend to nothing (their output is exactly 0): ``lengths`` or ``valid`` (B, Sq)."""

    axis_name = "q_len"

    def _materialize(self, batch, q_len, kv_len, device):
        return self._axis_valid(q_len, device)[:, None, :, None]

    def mask_mod(self, q_len, kv_len, device=None):
        ok = self._axis_valid_fn(q_len, device)
        return lambda b, h, q, kv: ok(b, q)

    def keys_by_position(self) -> bool:
        return True  # it speaks of queries only

    def key_range(self, batch, q_len, kv_len, device=None):
        valid = self._axis_valid(q_len, torch.device(device or "cpu")).long()  # (B|1, Sq)
        return torch.zeros_like(valid), valid * kv_len  # a padded query sees [0, 0): nothing

    def __repr__(self):
        return f"QueryPadding(side={self.side!r})"


class Document(Mask):
    """Block-diagonal mask for packed variable-length sequences.

    ``lengths``: (N,) shared by the batch or (B, N) per batch item (zero-padded) — the lengths of
    the documents packed one after another along the query axis. ``kv_lengths`` does the same for
    the key axis (default: the same as ``lengths``, i.e. self-attention). Query i sees key j iff
    both belong to the same document; positions past the packed total belong to none.
    Combine with ``Causal()`` for per-document causal attention.
    """

    has_tensors = True

    def __init__(self, lengths, kv_lengths=None):
        self.lengths = _as_index_tensor(lengths, "lengths")
        self.kv_lengths = self.lengths if kv_lengths is None else _as_index_tensor(kv_lengths, "kv_lengths")
        for name, t in (("lengths", self.lengths), ("kv_lengths", self.kv_lengths)):
            if t.dim() not in (1, 2):
                raise ValueError(f"{name} must be (N,) or (B, N), got shape {tuple(t.shape)}")
            if (t < 0).any():
                raise ValueError(f"{name} must be non-negative")

    def tensors(self):
        return (self.lengths, self.kv_lengths)

    @staticmethod
    def _doc_ids(lengths: Tensor, size: int, pad_id: int, device) -> Tensor:
        """(B|1, size) document index of each position; ``pad_id`` past the end."""
        lens = lengths.to(device)
        lens = lens.unsqueeze(0) if lens.dim() == 1 else lens
        ends = lens.cumsum(-1)  # (B|1, N)
        pos = torch.arange(size, device=device).expand(ends.shape[0], size).contiguous()
        ids = torch.searchsorted(ends.contiguous(), pos, right=True)
        return torch.where(ids < lens.shape[-1], ids, torch.full_like(ids, pad_id))

    def check(self, batch, heads, q_len, kv_len):
        for name, t, size in (("lengths", self.lengths, q_len), ("kv_lengths", self.kv_lengths, kv_len)):
            if t.dim() == 2 and t.shape[0] not in (1, batch):
                raise ValueError(f"Document {name} has shape {tuple(t.shape)}, expected (N,) or ({batch}, N)")
            total = int(t.sum(-1).max()) if t.numel() else 0
            if total > size:
                raise ValueError(f"Document {name} sum to {total}, more than the sequence length {size}")

    def _materialize(self, batch, q_len, kv_len, device):
        qd = self._doc_ids(self.lengths, q_len, -1, device)
        kd = self._doc_ids(self.kv_lengths, kv_len, -2, device)
        return (qd[:, None, :, None] == kd[:, None, None, :])

    def mask_mod(self, q_len, kv_len, device=None):
        qd = self._doc_ids(self.lengths, q_len, -1, device)
        kd = self._doc_ids(self.kv_lengths, kv_len, -2, device)
        qb = (lambda b: 0) if qd.shape[0] == 1 else (lambda b: b)
        kb = (lambda b: 0) if kd.shape[0] == 1 else (lambda b: b)
        return lambda b, h, q, kv: qd[qb(b), q] == kd[kb(b), kv]

    def __repr__(self):
        return f"Document(n={self.lengths.shape[-1]})"


# --------------------------------------------------------------------------- dense tensors


def _check_broadcast(t: Tensor, name: str, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    target = (batch, heads, q_len, kv_len)
    if t.dim() > 4:
        raise ValueError(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); it must broadcast to "
                         f"(B, H, Sq, Sk) = {target}")
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    for got, want in zip(shape, target):
        if got not in (1, want):
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, Sq, Sk) = {target}")


def _as_4d(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


class Dense(Mask):
    """A bool tensor (True = attend) broadcastable to (B, H, Sq, Sk)."""

    has_tensors = True

    def __init__(self, mask: Tensor):
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"Dense needs a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        self.tensor = mask

    def check(self, batch, heads, q_len, kv_len):
        _check_broadcast(self.tensor, "mask", batch, heads, q_len, kv_len)

    def tensors(self):
        return (self.tensor,)

    def _materialize(self, batch, q_len, kv_len, device):
        return _as_4d(self.tensor).to(device)

    def mask_mod(self, q_len, kv_len, device=None):
        t = _as_4d(self.tensor).to(device)
        pick = [(lambda i: 0) if n == 1 else (lambda i: i) for n in t.shape]
        return lambda b, h, q, kv: t[pick[0](b), pick[1](h), pick[2](q), pick[3](kv)]

    def __repr__(self):
        return f"Dense(shape={tuple(self.tensor.shape)})"


class Additive(Mask):
    """A float tensor added to the scores, broadcastable to (B, H, Sq, Sk); -inf means masked.

    The bias is kept in fp32 (fp64 for fp64 tensors), so stacking additive masks never
    overflows in the input dtype: a sum of masks reaching -inf means masked, anything else is
    added exactly as given.
    """

    has_tensors = True

    def __init__(self, bias: Tensor):
        if not isinstance(bias, Tensor) or not bias.dtype.is_floating_point:
            raise TypeError(f"Additive needs a floating tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
        # Reading the values is a data-dependent branch, which torch.compile(fullgraph=True)
        # cannot trace: the check runs in eager only (a compiled graph gets the same bias).
        if not torch.compiler.is_compiling() and (torch.isnan(bias).any() or torch.isposinf(bias).any()):
            raise ValueError("additive mask contains NaN or +inf (only finite values and -inf are meaningful)")
        self.tensor = bias if bias.dtype == torch.float64 else bias.float()

    def check(self, batch, heads, q_len, kv_len):
        _check_broadcast(self.tensor, "mask", batch, heads, q_len, kv_len)

    def tensors(self):
        return (self.tensor,)

    def _materialize(self, batch, q_len, kv_len, device):
        return ~torch.isneginf(_as_4d(self.tensor)).to(device)

    def bias(self, batch, q_len, kv_len, device=None):
        return _as_4d(self.tensor).to(device or "cpu")

    def mask_mod(self, q_len, kv_len, device=None):
        return Dense(~torch.isneginf(self.tensor)).mask_mod(q_len, kv_len, device)

    def __repr__(self):
        return f"Additive(shape={tuple(self.tensor.shape)})"


class ALiBi(_Positional):
    """ALiBi's per-head linear distance bias (Press et al.; BLOOM, MPT): ``slopes[h] * (j - p_i)``
    added to the scores, where ``p_i`` is query i's position in key coordinates, measured like
    :class:`Causal` (bottom-right ``i + Sk - Sq``, top-left ``i``, or ``i + q_start[b]``), so it
    stays right with a cache. It allows every pair (a bias, not a restriction) and composes with
    other masks by ``&`` (not ``|``). Fast kernels compute it on the fly from ``slopes`` and the
    query positions; :meth:`bias` materializes it for the others.

    ``slopes``: (H,) one slope per query head (H must equal the call's Hq); see :func:`alibi_slopes`.
    ``offsets=`` is the deprecated name of ``q_start=``.
    """

    def __init__(self, slopes, *, align: str = "bottom_right", q_start=None, offsets=None):
        super().__init__(align, *_q_start_arg(q_start, offsets, "ALiBi"))
        t = torch.as_tensor(slopes)
        if not t.dtype.is_floating_point or t.dim() != 1 or t.numel() == 0:
            raise TypeError(f"ALiBi slopes must be a non-empty 1-D float tensor (H,), got "
                            f"{t.dtype} of shape {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError("ALiBi slopes must be finite")
        self.slopes = t.detach().float()
        self.has_tensors = True

    def check(self, batch, heads, q_len, kv_len):
        super().check(batch, heads, q_len, kv_len)
        if self.slopes.numel() != heads:
            raise ValueError(f"ALiBi has {self.slopes.numel()} slopes (shape {tuple(self.slopes.shape)}) but the "
                             f"call has {heads} query heads")

    def tensors(self):
        return (self.slopes, *super().tensors())

    def positions(self, q_len: int, kv_len: int, device=None) -> Tensor:
        """(B|1, Sq) int64 query positions the distances are measured from."""
        return self._positions(q_len, kv_len, torch.device(device or "cpu"))

    def _materialize(self, batch, q_len, kv_len, device):
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def bias(self, batch, q_len, kv_len, device=None):
        dev = torch.device(device or "cpu")
        pos = self._positions(q_len, kv_len, dev)  # (B|1, Sq)
        dist = torch.arange(kv_len, device=dev)[None, None, :] - pos[:, :, None]  # (B|1, Sq, Sk)
        return self.slopes.to(dev)[None, :, None, None] * dist[:, None].float()

    def mask_mod(self, q_len, kv_len, device=None):
        return lambda b, h, q, kv: kv >= 0  # allows everything

    def key_range(self, batch, q_len, kv_len, device=None):
        z = torch.zeros(1, 1, dtype=torch.long, device=torch.device(device or "cpu"))
        return z, z + kv_len

    def __repr__(self):
        return f"ALiBi(heads={self.slopes.numel()}, {self._describe_pos()})"


def alibi_slopes(num_heads: int) -> Tensor:
    """The standard ALiBi slopes of ``num_heads`` heads, (H,) fp32: a geometric sequence from
    2^(-8/n) for a power of two n; otherwise those of the closest lower power of two followed by
    every other slope of the next one (exactly BLOOM's ``build_alibi_tensor``)."""
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    import math
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def split_alibi(mask: "Mask | None") -> tuple["Mask | None", "ALiBi | None"]:
    """(the mask without its ALiBi part, the ALiBi) for kernels that apply ALiBi on the fly; an
    ALiBi anywhere but at the top level of an AND stays in the mask (then materialized)."""
    if isinstance(mask, ALiBi):
        return None, mask
    if isinstance(mask, And):
        found = [m for m in mask.masks if isinstance(m, ALiBi)]
        if len(found) == 1:
            rest = [m for m in mask.masks if m is not found[0]]
            return (rest[0] if len(rest) == 1 else And(*rest)), found[0]
    return mask, None


# --------------------------------------------------------------------------- selections


class Selection(Mask):
    """Base of the per-query selections (:class:`SelectedKeys`, :class:`SelectedBlocks`): each
    query lists the key blocks it sees, key ``j`` being in block ``j // block_size`` (a block of
    one key for :class:`SelectedKeys`).

    ``ids``: integers of shape (B|1, Sq, n), one list per query shared by every head, or
    (B|1, Hs, Sq, n), one list per selection head, where query head ``h`` reads list
    ``h // (Hq // Hs)`` (with Hs = Hkv, the KV head's group, as K/V are grouped). Negative entries
    are unused slots (rows of different lengths are padded with -1, as FlashMLA and transformers
    pad them). A list is a set: an id listed twice selects its keys once, and the order within a
    list means nothing. An id past the last block is an error (``ValueError`` when the selection
    meets a call's Sk, in :meth:`check` and :meth:`materialize`), never read. A call's
    ``torch.compile`` graph cannot read values, so there the check is left to eager calls.

    ``num_heads``: the call's query heads Hq; needed (and checked) only when 1 < Hs < Hq, where
    the mask cannot tell each list's group of query heads from its own shape.
    """

    has_tensors = True
    #: The name of the ids argument, for error messages.
    arg_name = "ids"

    def __init__(self, ids, *, block_size: int = 1, num_heads: int | None = None):
        t = ids if isinstance(ids, Tensor) else torch.as_tensor(ids)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{self.arg_name} must be an integer tensor, got dtype {t.dtype} of shape "
                            f"{tuple(t.shape)}")
        if t.dim() not in (3, 4):
            raise ValueError(f"{self.arg_name} must be (B, Sq, n) or (B, Hkv, Sq, n), got shape {tuple(t.shape)}")
        for name, val in (("block_size", block_size), ("num_heads", num_heads)):
            if val is None and name == "num_heads":
                continue
            if not isinstance(val, int) or isinstance(val, bool):
                raise TypeError(f"{name} must be an int, got {type(val).__name__}")
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if num_heads is not None and t.dim() == 4 and num_heads % t.shape[1]:
            raise ValueError(f"num_heads={num_heads} is not a multiple of the {t.shape[1]} selection heads of "
                             f"{self.arg_name} (shape {tuple(t.shape)})")
        self.ids, self.block_size, self.num_heads = t, block_size, num_heads

    @property
    def heads(self) -> int:
        """Hs: the number of lists per query (1: shared by every head)."""
        return 1 if self.ids.dim() == 3 else self.ids.shape[1]

    def num_blocks(self, kv_len: int) -> int:
        """Blocks of ``block_size`` keys covering Sk keys (the last one may be partial)."""
        return -(-kv_len // self.block_size)

    def tensors(self):
        return (self.ids,)

    def _shape(self) -> tuple[int, ...]:
        return tuple(self.ids.shape)

    def _range_error(self, top: int, kv_len: int) -> str:
        raise NotImplementedError

    def check_range(self, kv_len: int) -> None:
        """Raise ValueError if an id is past the last block of Sk = ``kv_len`` keys (eager only)."""
        if self.ids.numel() == 0 or torch.compiler.is_compiling():
            return
        top = int(self.ids.max())
        if top >= self.num_blocks(kv_len):
            raise ValueError(self._range_error(top, kv_len))

    def check(self, batch, heads, q_len, kv_len):
        shape, name = self._shape(), self.arg_name
        if shape[0] not in (1, batch):
            raise ValueError(f"{name} has shape {shape}: its first dim must be 1 or the batch B={batch}")
        if shape[-2] != q_len:
            raise ValueError(f"{name} has shape {shape}: its dim -2 must be the query length Sq={q_len}")
        if self.num_heads is not None and self.num_heads != heads:
            raise ValueError(f"{type(self).__name__} was built with num_heads={self.num_heads}, but the call has "
                             f"{heads} query heads")
        hs = self.heads
        if heads % hs:
            raise ValueError(f"{name} has shape {shape}: its {hs} selection heads do not divide the call's "
                             f"{heads} query heads")
        if hs not in (1, heads) and self.num_heads is None:
            raise ValueError(f"{name} has shape {shape}: {hs} selection heads for {heads} query heads; pass "
                             f"num_heads={heads} so each list serves its group of {heads // hs} query heads")
        self.check_range(kv_len)

    def _group(self) -> int:
        """Query heads per list: query head h reads list h // group."""
        return 1 if self.num_heads is None else self.num_heads // self.heads

    def _blocks(self, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """(B|1, Hs, Sq, num_blocks) bool: the blocks each list selects."""
        ids = self._ids_4d(q_len, kv_len, device)  # no block: a spare column
        nb = self.num_blocks(kv_len)
        out = torch.zeros(*ids.shape[:-1], nb + 1, dtype=torch.bool, device=device)
        return out.scatter_(-1, ids, True)[..., :nb]

    def _table(self, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """(B|1, Hs, Sq, Sk) bool: the keys each list selects (one entry per list, not per head)."""
        blocks = self._blocks(q_len, kv_len, device)
        if self.block_size == 1:
            return blocks
        return blocks.repeat_interleave(self.block_size, -1)[..., :kv_len]

    def _materialize(self, batch, q_len, kv_len, device):
        out = self._table(q_len, kv_len, device)
        g = self._group()
        return out if g == 1 else out.repeat_interleave(g, 1)

    def _ids_4d(self, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """The ids (B|1, Hs, Sq, n) int64 on ``device``, ids of no block (unused slots, and in a
        compiled graph anything past the last block) set to the number of blocks."""
        shape = self._shape()
        if shape[-2] != q_len:
            raise ValueError(f"{self.arg_name} has shape {shape}: its dim -2 must be the query length Sq={q_len}")
        self.check_range(kv_len)
        ids = self.ids.to(device=device, dtype=torch.long)
        ids = ids.unsqueeze(1) if ids.dim() == 3 else ids
        nb = self.num_blocks(kv_len)
        return torch.where((ids < 0) | (ids >= nb), torch.full_like(ids, nb), ids)

    def _bitmap(self, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """(B|1, Hs, Sq, ceil(num_blocks / 32)) int32: bit i % 32 of word i // 32 is set when the
        list selects block i (a key, for :class:`SelectedKeys`): an eighth of a bool table's
        bytes, and a block selection's table is per block, not per key."""
        nb = self.num_blocks(kv_len)
        words = -(-nb // 32)
        ids, _ = torch.sort(self._ids_4d(q_len, kv_len, device), dim=-1)
        # each block once (a list is a set), and no block at all to a spare word past the end
        repeat = torch.zeros_like(ids, dtype=torch.bool)
        repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
        ids = torch.where(repeat | (ids >= nb), torch.full_like(ids, 32 * words), ids)
        out = torch.zeros(*ids.shape[:-1], words + 1, dtype=torch.long, device=device)
        out.scatter_add_(-1, ids // 32, torch.bitwise_left_shift(torch.ones_like(ids), ids % 32))
        return out[..., :words].to(torch.int32)  # distinct bits: their sum is their OR (bit 31 wraps)

    def block_occupancy(self, batch, q_len, kv_len, q_block, kv_block, device=None):
        # Every (query block, key block) some query of the block lists a key of: from the ids alone.
        dev = torch.device(device or "cpu")
        ids = self._ids_4d(q_len, kv_len, dev)
        nb, bs = self.num_blocks(kv_len), self.block_size
        nqb, nkb = -(-q_len // q_block), -(-kv_len // kv_block)
        first = ids * bs // kv_block  # a listed block's keys [id * bs, min((id + 1) * bs, Sk))
        last = (torch.clamp((ids + 1) * bs, max=kv_len) - 1) // kv_block
        span = torch.arange(-(-bs // kv_block) + 1, device=dev)
        kb = first[..., None] + span  # (..., n, span): the key blocks each entry meets
        kb = torch.where((kb <= last[..., None]) & (ids[..., None] < nb), kb, torch.full_like(kb, nkb))
        qb = (torch.arange(q_len, device=dev) // q_block).view(q_len, 1, 1)
        flat = (qb * (nkb + 1) + kb).flatten(-3)  # (B|1, Hs, Sq * n * span)
        out = torch.zeros(*ids.shape[:2], nqb * (nkb + 1), dtype=torch.bool, device=dev)
        return out.scatter_(-1, flat, True).view(*ids.shape[:2], nqb, nkb + 1)[..., :nkb]

    def mask_mod(self, q_len, kv_len, device=None):
        # A lookup in the bitmap of one list per selection head (not per query head), by block.
        t = self._bitmap(q_len, kv_len, torch.device(device or "cpu"))
        g, bs = self._group(), self.block_size
        pb = (lambda b: 0) if t.shape[0] == 1 else (lambda b: b)
        ph = (lambda h: 0) if t.shape[1] == 1 else (lambda h: h) if g == 1 else (lambda h: h // g)
        blk = (lambda kv: kv) if bs == 1 else (lambda kv: kv // bs)

        def mod(b, h, q, kv):
            i = blk(kv)
            return ((t[pb(b), ph(h), q, i >> 5] >> (i & 31)) & 1) == 1

        return mod


class SelectedKeys(Selection):
    """Each query sees only the keys it lists: a per-query top-k (DeepSeek-V3.2's and
    GLM-MoE-DSA's lightning indexer, transformers' ``indices=``).

    ``indices``: integer key positions, (B|1, Sq, k) shared by every head or (B|1, Hkv, Sq, k) per
    KV head (query head h reads list ``h // (Hq // Hkv)``); -1 (any negative) marks an unused
    slot. A position listed twice counts once; a position >= Sk raises ValueError when the mask
    meets the call. ``num_heads``: the call's query heads, needed only when 1 < Hkv < Hq. Query i
    of sequence b, head h, sees key j iff ``j in indices[b, h // G, i]``. Equivalent code::

        allowed = zeros(B, Hs, Sq, Sk + 1, dtype=bool)
        allowed.scatter_(-1, where(indices < 0, Sk, indices), True)[..., :Sk]

    Compose it like any mask: ``SelectedKeys(idx) & Causal()``, ``| SlidingWindow(63)``.
    """

    arg_name = "indices"

    def __init__(self, indices, *, num_heads: int | None = None):
        super().__init__(indices, block_size=1, num_heads=num_heads)

    @property
    def indices(self) -> Tensor:
        """The key positions as given."""
        return self.ids

    def _range_error(self, top, kv_len):
        return (f"indices holds key position {top}, but the call has Sk={kv_len} keys (indices of shape "
                f"{self._shape()}; positions must be < Sk, negative entries mark unused slots)")

    def __repr__(self):
        return f"SelectedKeys(shape={self._shape()})"


class SelectedBlocks(Selection):
    """Each query sees only the key blocks it lists: a per-query block selection (MiniMax-M3's and
    NSA's top blocks per KV group, transformers' ``block_indices=``).

    ``block_ids``: integer block ids, (B|1, Sq, n) shared by every head or (B|1, Hkv, Sq, n) per
    KV group (query head h reads list ``h // (Hq // Hkv)``); -1 (any negative) marks an unused
    slot. Query i sees key j iff ``j // block_size`` is among its ids. The last block may be
    partial (Sk need not be a multiple of ``block_size``); an id past it raises ValueError when
    the mask meets the call; an id listed twice counts once. ``num_heads`` as in
    :class:`SelectedKeys`. "The selected blocks and the local ones before the query" is
    ``(SelectedBlocks(ids, block_size=64) | SlidingWindow(63)) & Causal()``.
    """

    arg_name = "block_ids"

    def __init__(self, block_ids, block_size: int, *, num_heads: int | None = None):
        super().__init__(block_ids, block_size=block_size, num_heads=num_heads)

    @property
    def block_ids(self) -> Tensor:
        """The block ids as given."""
        return self.ids

    def _range_error(self, top, kv_len):
        n = self.num_blocks(kv_len)
        return (f"block_ids holds block {top}, but Sk={kv_len} keys in blocks of block_size={self.block_size} "
                f"make {n} blocks (ids 0..{n - 1}; block_ids of shape {self._shape()}; negative entries mark "
                f"unused slots)")

    def __repr__(self):
        return f"SelectedBlocks(shape={self._shape()}, block_size={self.block_size})"


# --------------------------------------------------------------------------- composition


class _Compose(Mask):
    op_name = ""

    def __init__(self, *masks: Mask):
        flat: list[Mask] = []
        for m in masks:
            _coerce(m, self.op_name)
            flat.extend(m.masks if type(m) is type(self) else [m])
        self.masks = tuple(flat)
        self.has_tensors = any(m.has_tensors for m in self.masks)

    def check(self, batch, heads, q_len, kv_len):
        for m in self.masks:
            m.check(batch, heads, q_len, kv_len)

    def tensors(self):
        return tuple(t for m in self.masks for t in m.tensors())

    def keys_by_position(self) -> bool:
        return all(m.keys_by_position() for m in self.masks)

    def cache_key(self):
        return (self.op_name, *(m.cache_key() for m in self.masks))

    def __repr__(self):
        return f" {self.op_name} ".join(map(repr, self.masks)).join("()")


class And(_Compose):
    """Allowed where every part allows; additive biases add up (in fp32)."""

    op_name = "&"

    def _materialize(self, batch, q_len, kv_len, device):
        out = self.masks[0].materialize(batch, q_len, kv_len, device)
        for m in self.masks[1:]:
            out = out & m.materialize(batch, q_len, kv_len, device)
        return out

    def bias(self, batch, q_len, kv_len, device=None):
        total = None
        for m in self.masks:
            b = m.bias(batch, q_len, kv_len, device)
            if b is not None:
                total = b if total is None else total + b
        return total

    def mask_mod(self, q_len, kv_len, device=None):
        mods = [m.mask_mod(q_len, kv_len, device) for m in self.masks]

        def mod(b, h, q, kv):
            ok = mods[0](b, h, q, kv)
            for f in mods[1:]:
                ok = ok & f(b, h, q, kv)
            return ok

        return mod

    def is_top_left_causal(self, q_len, kv_len):
        return all(m.is_top_left_causal(q_len, kv_len) for m in self.masks)

    def key_range(self, batch, q_len, kv_len, device=None):
        lo = hi = None
        # parts that allow every key (a decode step's bottom-right Causal) leave the range as it is
        parts = [m for m in self.masks if not m.allows_all(q_len, kv_len)] or self.masks[:1]
        for m in parts:
            r = m.key_range(batch, q_len, kv_len, device)
            if r is None:
                return None
            lo = r[0] if lo is None else torch.maximum(lo, r[0])
            hi = r[1] if hi is None else torch.minimum(hi, r[1])
        return lo, hi

    def allows_all(self, q_len, kv_len):
        return all(m.allows_all(q_len, kv_len) for m in self.masks)

    def block_occupancy(self, batch, q_len, kv_len, q_block, kv_block, device=None):
        # tiles every part may allow; a part that cannot tell restricts nothing
        parts = [m.block_occupancy(batch, q_len, kv_len, q_block, kv_block, device) for m in self.masks]
        parts = [p for p in parts if p is not None]
        return _combine(parts, torch.logical_and) if parts else None


class Or(_Compose):
    """Allowed where any part allows. Additive masks cannot take part (a sum has no 'or')."""

    op_name = "|"

    def __init__(self, *masks: Mask):
        super().__init__(*masks)
        if any(has_bias(m) for m in self.masks):
            raise TypeError("an Additive or ALiBi mask cannot be combined with '|' (a sum has no 'or'); use '&'")

    def _materialize(self, batch, q_len, kv_len, device):
        out = self.masks[0].materialize(batch, q_len, kv_len, device)
        for m in self.masks[1:]:
            out = out | m.materialize(batch, q_len, kv_len, device)
        return out

    def mask_mod(self, q_len, kv_len, device=None):
        mods = [m.mask_mod(q_len, kv_len, device) for m in self.masks]

        def mod(b, h, q, kv):
            ok = mods[0](b, h, q, kv)
            for f in mods[1:]:
                ok = ok | f(b, h, q, kv)
            return ok

        return mod

    def block_occupancy(self, batch, q_len, kv_len, q_block, kv_block, device=None):
        # tiles any part may allow; a part that cannot tell may allow every tile
        parts = [m.block_occupancy(batch, q_len, kv_len, q_block, kv_block, device) for m in self.masks]
        return None if any(p is None for p in parts) else _combine(parts, torch.logical_or)


def _combine(parts: list[Tensor], op) -> Tensor | None:
    """Block occupancies (B|1, H|1 or lists, nqb, nkb) combined by ``op``, head dims matched by
    repeating the fewer lists (query head h reads list h // (H / Hs)); None where they cannot be
    matched (lists that do not divide each other)."""
    heads = max(p.shape[1] for p in parts)
    if any(heads % p.shape[1] for p in parts):
        return None
    out = None
    for p in parts:
        if p.shape[1] not in (1, heads):
            p = p.repeat_interleave(heads // p.shape[1], dim=1)
        out = p if out is None else op(out, p)
    return out


def shifted_bias(mask: Mask, batch: int, q_len: int, kv_len: int, device=None,
                 allowed: Tensor | None = None) -> Tensor | None:
    """``mask.bias(...)`` minus, in each row, the largest value of the keys the mask allows, or
    None without a bias.

    Softmax is unchanged by a per-row constant, and after the shift the values that decide the
    result sit at or below 0, so adding them to fp32 scores (or handing them to a kernel in a
    half-precision dtype) loses nothing to a large common offset such as two stacked -6e4 masks.
    The maximum is taken over the allowed keys only: a bias can be largest where the mask
    forbids attending (ALiBi's ``slope * (j - i)`` grows toward the future keys a causal part
    removes), and shifting by such a value would push the allowed keys to large magnitudes,
    where a half-precision copy has no resolution left. Rows with no allowed key are not shifted.

    ``allowed``: the mask's materialization (B|1, H|1, Sq, Sk) when the caller has it already.
    """
    b = mask.bias(batch, q_len, kv_len, device)
    if b is None or b.shape[-1] == 0:
        return b
    if allowed is None:
        allowed = mask.materialize(batch, q_len, kv_len, b.device)
    row_max = b.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True)
    return b - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def has_alibi(m: Mask | None) -> bool:
    """True when ``m`` holds an :class:`ALiBi` anywhere inside."""
    if isinstance(m, ALiBi):
        return True
    return isinstance(m, _Compose) and any(has_alibi(x) for x in m.masks)


def has_selection(m: Mask | None) -> bool:
    """True when ``m`` holds a :class:`Selection` anywhere inside."""
    if isinstance(m, Selection):
        return True
    return isinstance(m, _Compose) and any(has_selection(x) for x in m.masks)


def has_structure(m: Mask | None) -> bool:
    """True when ``m`` holds a part whose allowed keys form a pattern (a window, packed documents,
    a prefix, per-sequence causal query starts, an OR) rather than plain causal, padding, dense or
    additive parts. Kernels that skip whole blocks of keys (FlexAttention) save work on these;
    SDPA computes every (query, key) pair of them through a materialized mask."""
    if m is None:
        return False
    if isinstance(m, (SlidingWindow, Document, PrefixLM, Or)):
        return True
    if isinstance(m, Causal):
        return m.q_start is not None
    return isinstance(m, And) and any(has_structure(x) for x in m.masks)


def has_bias(m: Mask) -> bool:
    """True when ``m`` carries an additive float bias (an :class:`Additive` anywhere inside)."""
    if isinstance(m, (Additive, ALiBi)):
        return True
    return isinstance(m, _Compose) and any(has_bias(x) for x in m.masks)


# --------------------------------------------------------------------------- normalisation


def as_mask(mask, causal: bool = False) -> Mask | None:
    """Normalise the ``mask``/``causal`` arguments of :func:`attnkit.attention` to one Mask or None.

    bool tensor -> :class:`Dense`; floating tensor -> :class:`Additive`; Mask -> itself;
    ``causal=True`` ANDs a bottom-right :class:`Causal`.
    """
    if mask is None:
        m = None
    elif isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        if mask.dtype == torch.bool:
            m = Dense(mask)
        elif mask.dtype.is_floating_point:
            m = Additive(mask)
        else:
            raise TypeError(f"mask must be a bool tensor (True = attend), a floating tensor (added to the "
                            f"scores) or an attnkit.masks.Mask; got a {mask.dtype} tensor of shape "
                            f"{tuple(mask.shape)}")
    else:
        raise TypeError(f"mask must be None, a tensor or an attnkit.masks.Mask, got {type(mask).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        m = _CAUSAL if m is None else _CAUSAL & m
    return m


#: The mask ``causal=True`` adds (masks hold no state to change, so one instance serves every call).
_CAUSAL = Causal()
