"""The KV-cache step protocol: :class:`CacheStep`, the :class:`KVCache` base every cache
implements, a cache bound to an open step (:class:`BoundCache`), and :func:`step` to run several
layers' caches as one transaction.

Notation: B batch, Hkv key/value heads (a cache never stores K/V repeated to Hq heads), S new
tokens this step, L cache length (or capacity), D key head dim, Dv value head dim.

Every cache keeps ``lengths`` (B,): how many tokens each sequence holds. A forward appends one
*step*: row b gains ``num_new[b]`` of the step's S tokens (default all), written at positions
``lengths[b] .. lengths[b] + num_new[b] - 1``; query i of row b sits at ``q_start[b] + i``
(``q_start = lengths`` before the step) and sees the keys at or before it. Prefill, decode of one
or several tokens (speculative verification) and chunked prefill are all steps.

A step is a transaction: ``step = cache.begin(B, S, num_new)`` validates it and makes room,
``cache.write(step, k, v)`` stores this step's K/V where nothing committed is overwritten (or
keeps what it overwrites), ``cache.view(step)`` is what attention reads, and ``commit(step)``
makes it the cache's state, or ``abort(step)`` forgets it. One layer::

    out = cache.attend(q, k, v)          # begin, write, attention(), commit; a raise aborts
    k_all, v_all, mask = cache.update(k, v)   # the same without the attention (committed at once)
    with cache.transaction(B, S) as c:   # attention of one's own before the commit; a raise aborts
        k_all, v_all, mask = c.update(k, v)

Several layers (a model): one step for every cache, committed only when every layer succeeded::

    with attnkit.caches.step(caches, batch=B, tokens=S) as bound:   # bound[i]: caches[i] in the step
        for layer, c in zip(layers, bound):
            x = layer(x, cache=c)        # c.attend / c.update write into the step, no commit

``value_from_key=True`` stores K only and reads V as its first ``v_head_dim`` channels
(``v_head_dim <= head_dim``): MLA's latent cache keeps ``[c_kv, k_rope]`` per token and attends
with V = ``c_kv``, so nothing is stored twice. ``update(k, None)`` then.

Quantized storage (``kv_dtype``, ``k_channel_scale``): :mod:`attnkit.caches.quant_policy`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from .._checks import positive_int, shape_of
from ..functional import attention
from ..kvquant import kv_storage_dtype
from ..masks import Causal, KeyPadding, Mask, as_mask
from .quant_policy import QuantizedStorage
from .._deprecation import renamed_kwargs, renamed_property

__all__ = ["KVCache", "CacheStep", "BoundCache", "step", "reorder", "crop", "reset"]


class CacheStep:
    """What one forward appends: ``q_start`` (B,) lengths before (the position of each row's
    first new token), ``num_new`` (B,) tokens each row gains, ``new`` (B,) lengths after,
    ``tokens`` S per row (rows with num_new < S carry padding), and the same as host lists when
    known (``*_host``; None in a traced, compiled step). ``old`` / ``old_host`` are the
    deprecated names of ``q_start`` / ``q_start_host``."""

    @renamed_kwargs(old_host="q_start_host")
    def __init__(self, q_start: Tensor, num_new: Tensor, tokens: int, *, q_start_host: list[int] | None = None,
                 num_new_host: list[int] | None = None, new: Tensor | None = None):
        self.q_start, self.num_new, self.tokens = q_start, num_new, tokens
        self.new = q_start + num_new if new is None else new  # ``new``: the caller has the sum already
        self.batch = q_start.shape[0]
        self.q_start_host, self.num_new_host = q_start_host, num_new_host
        self.new_host = None if q_start_host is None else [o + n for o, n in zip(q_start_host, num_new_host)]
        self.writers: set[int] = set()  # caches that wrote this step (each writes once)
        self.channel_scale_set: set[int] = set()  # caches whose K channel scale this step set (abort unsets it)

    old = renamed_property("q_start")

    old_host = renamed_property("q_start_host")

    @property
    def uniform(self) -> bool:
        """Every row holds the same number of tokens and gains all S (the plain causal case)."""
        h = self.q_start_host
        return h is not None and min(h, default=0) == max(h, default=0) and all(
            n == self.tokens for n in self.num_new_host)

    def positions(self) -> Tensor:
        """(B, S) position of each new token (for RoPE)."""
        return self.q_start[:, None] + torch.arange(self.tokens, device=self.q_start.device)

    def mask(self) -> Mask:
        """Over the rows' keys 0 .. L-1: query i of row b sees keys ``<= q_start[b] + i`` that exist."""
        if self.uniform:
            return Causal()
        return Causal(q_start=self.q_start) & KeyPadding(self.new)


class KVCache(QuantizedStorage, nn.Module):
    """Base of the caches: per-sequence ``lengths``, size accounting, the step protocol.

    Buffers are non-persistent (``.to()`` moves them; state dicts stay weight-only). Subclasses
    implement ``begin``, ``write``, ``view`` and ``_commit``, and ``_abort`` to undo whatever
    ``begin`` and ``write`` changed (overwritten data, grown buffers, rows written past the
    committed lengths).

    ``dtype`` is the compute dtype (of the K/V written and of dense views); ``kv_dtype`` (None,
    "int8", "fp8_e4m3") the storage: None keeps K/V in ``dtype``, else quantized rows plus fp32
    scales (``storage_dtype`` is the torch dtype then). ``k_channel_scale`` (None: on for int8,
    off for fp8; True / False; or an (Hkv, D) tensor) divides quantized K by a fixed scale per
    (KV head, channel), set at the first write unless given (:mod:`attnkit.caches.quant_policy`
    says when it is set and unset). ``channel_scaled`` says whether it is on; the
    ``k_channel_scale`` buffer holds it ((Hkv, D) fp32, or None before the first write or when off).

    Every position past a row's length holds zeros in every buffer (data and scales): ``write``
    stores a ragged step's padding tokens as 0, ``abort`` zeroes what the step wrote, and
    ``crop`` / ``reset`` zero the rows they drop, so no view ever hands a backend a masked row
    holding a rejected token's K/V (NaN or inf times probability 0 is NaN).

    ``kv_heads=`` is the deprecated name of ``num_kv_heads``.
    """

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                 value_from_key: bool = False, dtype: torch.dtype = torch.float32, device=None, kv_dtype=None,
                 k_channel_scale=None):
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, val in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            positive_int(name, val)
        if value_from_key and v_head_dim > head_dim:
            raise ValueError(f"value_from_key needs v_head_dim <= head_dim, got {v_head_dim} > {head_dim}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.num_kv_heads, self.head_dim, self.v_head_dim = num_kv_heads, head_dim, v_head_dim
        self.value_from_key = bool(value_from_key)
        self.dtype = dtype
        #: The quantized storage dtype (torch.int8 / torch.float8_e4m3fn), or None: K/V kept in ``dtype``.
        self.kv_dtype = kv_storage_dtype(kv_dtype)
        self.register_buffer("lengths", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        self._init_channel_scale(k_channel_scale, self.lengths.device)

    kv_heads = renamed_property("num_kv_heads")

    # ---------------------------------------------------------------- accounting

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies in this layer's cache (K and V, Hkv heads;
        quantized: the data plus an fp32 scale per row of K and of V, one with value_from_key).
        A K channel scale is per layer ((Hkv, D) fp32), not per token: not counted here."""
        values = self.head_dim + (0 if self.value_from_key else self.v_head_dim)
        data = self.num_kv_heads * values * torch.empty((), dtype=self.storage_dtype).element_size()
        if self.kv_dtype is None:
            return data
        return data + self.num_kv_heads * (1 if self.value_from_key else 2) * 4

    def extra_repr(self) -> str:
        return (f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}"
                f"{', value_from_key=True' if self.value_from_key else ''}{self._kv_repr()}")

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds allocated now (capacity, not just the filled part)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---------------------------------------------------------------- the step protocol

    def positions(self, num_new: int) -> Tensor:
        """(B, S) positions of the next ``num_new`` tokens of each sequence (for RoPE); (1, S)
        shared by the batch while the cache is still empty."""
        step = torch.arange(num_new, device=self.lengths.device)
        return step[None] if self.lengths.numel() == 0 else self.lengths[:, None] + step

    def begin(self, batch: int, tokens: int, num_new=None, *, token_ids=None) -> CacheStep:
        """Validate a step of ``tokens`` new tokens for ``batch`` rows (row b keeps ``num_new[b]``
        of them) and make room; changes nothing a reader of the cache sees."""
        raise NotImplementedError

    def write(self, step: CacheStep, k: Tensor, v: Tensor | None) -> None:
        """Store this step's k (B, Hkv, S, D) and v (B, Hkv, S, Dv) (None with value_from_key)."""
        raise NotImplementedError

    def view(self, step: CacheStep, *, dense: bool = False, held_only: bool = False):
        """(k_all, v_all, mask) to attend to after ``write``: tensors (B, Hkv, L, ·) (or, unless
        ``dense``, a :class:`attnkit.PagedKV` for a paged cache, a :class:`attnkit.QuantizedKV`
        for a quantized one, and None) and the step's mask (None: nothing beyond the paged
        lengths, which attention applies itself). ``dense``: tensors in ``dtype`` always.
        ``held_only``: the caller's other masks do not depend on L, so the view may end where
        the rows' keys end after this step, ``max(lengths + num_new)``, rather than at the
        cache's capacity (a static cache's prefill then reads no empty columns, and its causal
        mask is the plain one). Views that end there anyway ignore it."""
        raise NotImplementedError

    def commit(self, step: CacheStep) -> None:
        """Make ``step`` the cache's state (lengths advance)."""
        self._commit(step)

    def abort(self, step: CacheStep) -> None:
        """Forget ``step``: the cache is as before :meth:`begin` (lengths, contents and the K
        channel scale)."""
        self._abort(step)
        self._unset_channel_scale(step)

    def _commit(self, step: CacheStep) -> None:
        raise NotImplementedError

    def _abort(self, step: CacheStep) -> None:
        pass  # subclasses undo what their begin / write changed

    def bind(self, step: CacheStep) -> "BoundCache":
        """This cache inside ``step`` (what a layer of a multi-layer forward receives)."""
        return BoundCache(self, step)

    def transaction(self, batch: int, tokens: int, num_new=None) -> contextlib.AbstractContextManager["BoundCache"]:
        """One step of this cache alone, as a context: yields the cache bound to it, commits when
        the block finishes, aborts (the cache exactly as before) if it raises. For callers that
        attend themselves (``update`` + :func:`attnkit.attention`)::

            with cache.transaction(B, S) as c:
                k_all, v_all, mask = c.update(k, v)
                out = attention(q, k_all, v_all, mask)   # a raise here leaves the cache unchanged
        """
        return self._transaction(batch, tokens, num_new)

    @contextlib.contextmanager
    def _transaction(self, batch: int, tokens: int, num_new) -> Iterator["BoundCache"]:
        st = self.begin(batch, tokens, num_new)
        try:
            yield self.bind(st)
        except BaseException:
            self.abort(st)
            raise
        self.commit(st)

    def update(self, k: Tensor, v: Tensor | None, *, num_new=None):
        """Append k (B, Hkv, S, D) and v (B, Hkv, S, Dv) (None with ``value_from_key``) as one
        committed step; returns (k_all (B, Hkv, L, D), v_all (B, Hkv, L, Dv), mask)."""
        B, S = self._batch_tokens(k)
        with self._transaction(B, S, num_new) as c:
            return c.update(k, v, num_new=num_new)

    def attend(self, q: Tensor, k: Tensor, v: Tensor | None, mask=None, *, num_new=None, **kwargs):
        """Append k (B, Hkv, S, D), v (B, Hkv, S, Dv) and attend q (B, Hq, S, D) over everything
        cached, as one step: committed if :func:`attnkit.attention` returns, aborted (the cache
        unchanged) if anything raises. ``mask`` (anything attention takes, over (B, Hq, S, L))
        is ANDed with the cache's own; ``kwargs`` are attention's (scale, dropout_p, backend,
        return_weights, ...). Returns what :func:`attnkit.attention` returns: (B, Hq, S, Dv)."""
        B, S = self._batch_tokens(k)
        with self._transaction(B, S, num_new) as c:
            return c.attend(q, k, v, mask, num_new=num_new, **kwargs)

    @staticmethod
    def _batch_tokens(k) -> tuple[int, int]:
        if not isinstance(k, Tensor) or k.dim() != 4:
            raise ValueError(f"k must be a (B, Hkv, S, D) tensor, got shape {shape_of(k)}")
        return k.shape[0], k.shape[2]

    # ---------------------------------------------------------------- validation helpers

    def _check_step_args(self, batch, tokens, num_new) -> tuple[int, int, Tensor, list[int] | None]:
        """(B, S, num_new (B,) long, its host list or None under compile), validated."""
        for name, val in (("batch", batch), ("tokens", tokens)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be a non-negative int, got {val!r}")
        if self.lengths.numel() and batch != self.lengths.shape[0]:
            raise ValueError(f"this step has batch {batch} but the cache holds {self.lengths.shape[0]} sequences; "
                             f"reset() or reorder() it first")
        dev = self.lengths.device
        if num_new is None:
            return batch, tokens, torch.full((batch,), tokens, dtype=torch.long, device=dev), [tokens] * batch
        n = torch.as_tensor(num_new, device=dev)
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.shape not in ((batch,), ()):
            raise ValueError(f"num_new must be an int or a (B,) int tensor with B={batch}, got "
                             f"{n.dtype} of shape {tuple(n.shape)}")
        n = n.long().expand(batch)
        if torch.compiler.is_compiling():
            return batch, tokens, n, None
        host = n.tolist()
        if any(x < 0 or x > tokens for x in host):
            raise ValueError(f"num_new must be in [0, S={tokens}], got {host}")
        return batch, tokens, n, host

    def _cache_device(self) -> torch.device:
        return self.lengths.device

    def _check_kv(self, step: CacheStep, k: Tensor, v: Tensor | None) -> Tensor:
        """Validate this step's K/V against the cache and the step; returns v (a view of k with
        value_from_key)."""
        if self.value_from_key:
            if v is not None:
                raise ValueError("this cache reads V from K (value_from_key=True); pass v=None")
            if isinstance(k, Tensor):
                v = k[..., :self.v_head_dim]
        elif v is None:
            raise ValueError("v is None but this cache stores values (value_from_key=False)")
        if not isinstance(k, Tensor) or not isinstance(v, Tensor) or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"k and v must be (B, Hkv, S, D) tensors, got k {shape_of(k)}, v {shape_of(v)}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {self.dtype}")
        B, H, S, D = k.shape
        if (v.shape[:3] != k.shape[:3] or H != self.num_kv_heads or D != self.head_dim
                or v.shape[3] != self.v_head_dim):
            raise ValueError(f"k {shape_of(k)} and v {shape_of(v)} do not fit this cache "
                             f"(Hkv={self.num_kv_heads}, D={self.head_dim}, Dv={self.v_head_dim})")
        if (B, S) != (step.batch, step.tokens):
            raise ValueError(f"k {shape_of(k)} does not fit the step (B={step.batch}, S={step.tokens})")
        if k.device != self._cache_device():
            raise ValueError(f"k is on {k.device} but the cache is on {self._cache_device()}")
        if id(self) in step.writers:
            raise RuntimeError("this cache already wrote this step (each layer writes a step once)")
        return v

    # ---------------------------------------------------------------- editing

    def reset(self) -> None:
        """Forget every sequence and a computed K channel scale. Buffers are kept for reuse, with
        the rows the sequences held zeroed (a later, shorter sequence's view never holds them)."""
        if self.lengths.numel():
            self._zero_rows(torch.zeros_like(self.lengths), self.lengths)
        self.lengths = self.lengths.new_zeros(0)
        self.forget_channel_scale()

    def crop(self, n) -> None:
        """Keep the first ``n`` tokens of each sequence (int or (B,) tensor); a negative int drops
        ``-n`` tokens from the end (rolling back rejected speculative tokens). The dropped rows
        are zeroed (data and scales), as an aborted step's are."""
        keep = self._kept_lengths(n)
        self._zero_rows(keep, self.lengths)
        self.lengths = keep

    def _kept_lengths(self, n) -> Tensor:
        """The (B,) lengths ``crop(n)`` leaves, validated (nothing changed yet)."""
        n = torch.as_tensor(n, device=self.lengths.device)
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.dim() > 1:
            raise ValueError(f"n must be an int or a (B,) int tensor, got {n.dtype} of shape {tuple(n.shape)}")
        n = n.long()
        keep = self.lengths + n if (n.dim() == 0 and int(n) < 0) else n.expand_as(self.lengths)
        if (keep < 0).any():
            raise ValueError(f"crop({n.tolist()}) would leave a negative length: lengths {self.lengths.tolist()}")
        return torch.minimum(self.lengths, keep)

    def _zero_rows(self, start: Tensor, end: Tensor) -> None:
        """Zero positions ``start[b] .. end[b] - 1`` of each row b in every buffer (the rows a
        crop or reset drops). Caches whose views can reach those rows implement it; the base
        keeps nothing to zero."""

    def reorder(self, indices: Tensor) -> None:
        """Select / repeat sequences along the batch (beam search): new sequence i = old indices[i]."""
        idx = _check_indices(indices, self.lengths.shape[0], self.lengths.device)
        self._reorder_buffers(idx)
        self.lengths = self.lengths[idx]

    def _reorder_buffers(self, idx: Tensor) -> None:
        raise NotImplementedError


def _check_indices(indices, batch: int, device) -> Tensor:
    idx = torch.as_tensor(indices, device=device)
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex() or idx.dim() != 1:
        raise ValueError(f"indices must be a 1-D integer tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= batch):
        raise ValueError(f"indices {idx.tolist()} out of range for {batch} sequences")
    return idx.long()


class BoundCache:
    """A cache inside one open step (see :func:`step`): ``attend`` / ``update`` write this
    layer's K/V into the step and read the step's view; the step commits (or aborts) for every
    layer at once. Other attributes (``num_kv_heads``, ``head_dim``, ``dtype``, ...) are the cache's."""

    def __init__(self, cache: KVCache, step: CacheStep):
        self.cache, self.step = cache, step

    def __getattr__(self, name):
        return getattr(self.__dict__["cache"], name)

    def __repr__(self) -> str:
        return f"BoundCache({self.cache!r}, B={self.step.batch}, S={self.step.tokens})"

    @contextlib.contextmanager
    def transaction(self, batch: int, tokens: int, num_new=None) -> Iterator["BoundCache"]:
        """Already inside a step (which commits or aborts for every layer): yields this bound
        cache, after checking that ``batch`` and ``tokens`` are the step's."""
        if (batch, tokens) != (self.step.batch, self.step.tokens):
            raise ValueError(f"a transaction of batch {batch}, {tokens} tokens inside a step of batch "
                             f"{self.step.batch}, {self.step.tokens} tokens")
        self._check_num_new(num_new)
        yield self

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens each row held before this step."""
        return self.step.q_start

    def positions(self, num_new: int) -> Tensor:
        """(B, S) positions of this step's tokens."""
        if num_new != self.step.tokens:
            raise ValueError(f"positions({num_new}) but the step has S={self.step.tokens} tokens per row")
        return self.step.positions()

    def _check_num_new(self, num_new) -> None:
        if num_new is not None and not torch.compiler.is_compiling():
            n = torch.as_tensor(num_new).expand(self.step.batch).tolist()
            if n != self.step.num_new_host:
                raise ValueError(f"num_new {n} differs from the step's {self.step.num_new_host}")

    def update(self, k: Tensor, v: Tensor | None, *, num_new=None):
        """Write k, v into the step; (k_all, v_all, mask) dense tensors to attend to."""
        self._check_num_new(num_new)
        self.cache.write(self.step, k, v)
        return self.cache.view(self.step, dense=True)

    def attend(self, q: Tensor, k: Tensor, v: Tensor | None, mask=None, *, num_new=None, **kwargs):
        """Write k, v into the step and attend q (B, Hq, S, D) over the step's view, ANDed with
        ``mask``; ``kwargs`` are :func:`attnkit.attention`'s."""
        self._check_num_new(num_new)
        user_mask = as_mask(mask)
        if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != self.step.batch or q.shape[2] != self.step.tokens:
            raise ValueError(f"q must be (B, Hq, S, D) with B={self.step.batch}, S={self.step.tokens}, got shape "
                             f"{shape_of(q)}")
        self.cache.write(self.step, k, v)
        # The view may end at the held keys unless a mask or the weights returned speak of all
        # the cache's columns.
        if (user_mask is None or user_mask.keys_by_position()) and not kwargs.get("return_weights"):
            k_all, v_all, cache_mask = self.cache.view(self.step, held_only=True)
        else:
            k_all, v_all, cache_mask = self.cache.view(self.step)
        full = cache_mask if user_mask is None else user_mask if cache_mask is None else cache_mask & user_mask
        return attention(q, k_all, v_all, full, **kwargs)


@contextlib.contextmanager
def step(caches: Sequence[KVCache], *, batch: int, tokens: int, num_new=None,
         token_ids=None) -> Iterator[list[BoundCache]]:
    """One step for several caches (the layers of a model): yields the caches bound to it, and
    commits every cache when the block finishes, or aborts every one if it raises. Paged caches
    of one allocator share its step. ``token_ids``: per row, the ids of the new tokens (confirmed
    for prefix caching by paged caches)."""
    caches = list(caches)
    steps: list[CacheStep] = []
    shared: dict[int, CacheStep] = {}
    try:
        for c in caches:
            key = getattr(c, "step_group", None)
            if key is not None and key in shared:
                steps.append(shared[key])
                continue
            st = c.begin(batch, tokens, num_new, token_ids=token_ids)
            steps.append(st)
            if key is not None:
                shared[key] = st
    except BaseException:
        for c, st in _unique(caches, steps):
            c.abort(st)
        raise
    try:
        yield [c.bind(st) for c, st in zip(caches, steps)]
    except BaseException:
        for c, st in _unique(caches, steps):
            c.abort(st)
        raise
    for c, st in _unique(caches, steps):
        c.commit(st)


def _unique(caches, steps):
    """(cache, step) with each step once (paged caches of one allocator share theirs)."""
    seen = set()
    for c, st in zip(caches, steps):
        if id(st) not in seen:
            seen.add(id(st))
            yield c, st


def reorder(caches: Sequence[KVCache], indices) -> None:
    """``reorder(indices)`` on every cache (paged caches of one allocator reorder it once)."""
    for c in _one_per_group(caches):
        getattr(c, "reorder_group", c.reorder)(indices)


def crop(caches: Sequence[KVCache], n) -> None:
    """``crop(n)`` on every cache (paged caches of one allocator crop it once)."""
    for c in _one_per_group(caches):
        getattr(c, "crop_group", c.crop)(n)


def reset(caches: Sequence[KVCache]) -> None:
    """``reset()`` on every cache."""
    for c in _one_per_group(caches):
        c.reset()


def _one_per_group(caches):
    seen = set()
    for c in caches:
        key = getattr(c, "step_group", None)
        if key is None or key not in seen:
            if key is not None:
                seen.add(key)
            yield c
