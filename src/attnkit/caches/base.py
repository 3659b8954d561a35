"""The KV-cache protocol, the explicit step, and the contiguous caches (dynamic and static).

Notation: B batch, Hkv key/value heads (a cache never stores K/V repeated to Hq heads), S new
tokens this step, L cache length (or capacity), D key head dim, Dv value head dim.

Every cache keeps ``lengths`` (B,): how many tokens each sequence holds. A forward appends one
*step*: row b gains ``num_new[b]`` of the step's S tokens (default all), written at positions
``lengths[b] .. lengths[b] + num_new[b] - 1``; query i of row b sits at ``lengths[b] + i`` and sees
the keys at or before it. Prefill, decode of one or several tokens (speculative verification) and
chunked prefill are all steps.

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

``kv_dtype="int8"`` / ``"fp8_e4m3"`` stores K and V quantized (:mod:`attnkit.kvquant`: symmetric
absmax per row, one fp32 scale per token per KV head, kept in a scale buffer beside each data
buffer; the latent cache has one scale per token since V is read from K). A step quantizes its
own tokens when it writes them (nothing already cached is rescaled); ``view`` returns an
:class:`attnkit.QuantizedKV` (``dense=True``: the dequantized K/V in the cache's ``dtype``).
``dtype`` stays the compute dtype: what ``write`` takes and what a dense view returns.

``k_channel_scale`` (quantized caches) divides K by a fixed scale per (KV head, channel) before it
is quantized (:func:`attnkit.kvquant.channel_scale`: keys have outlier channels, which per-row
int8 otherwise pays for in every other channel). None (default): on for int8, off for fp8 (its
per-element exponent gains nothing from it); True / False force it; an (Hkv, D) tensor (e.g.
calibrated offline) is used as given. When on and not given, it is computed from the K rows of
the cache's first write (every batch row and token of it, before quantizing) and then fixed, so
every stored row shares it; an aborted first step unsets it again, and ``reset()`` unsets it so
the next first write measures it afresh (a paged cache: once its pool holds nothing a later
sequence could reuse). Views hand attention ``QuantizedKV(..., k_channel_scale=scale)``; dense
views multiply it back. It is one (Hkv, D) fp32 tensor per layer, not per token:
``bytes_per_token`` does not count it, ``nbytes`` does once it is set.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from .._checks import positive_int, shape_of
from ..functional import attention
from ..kvlayout import QuantizedKV
from ..kvquant import channel_scale, dtype_name, kv_storage_dtype, quantize
from ..masks import Causal, KeyPadding, Mask, as_mask
from . import memory

__all__ = ["KVCache", "DynamicCache", "StaticCache", "CacheStep", "BoundCache", "step", "reorder", "crop", "reset"]



class CacheStep:
    """What one forward appends: ``old`` (B,) lengths before, ``num_new`` (B,) tokens each row
    gains, ``new`` (B,) lengths after, ``tokens`` S per row (rows with num_new < S carry padding),
    and the same as host lists when known (``*_host``; None in a traced, compiled step)."""

    def __init__(self, old: Tensor, num_new: Tensor, tokens: int, *, old_host: list[int] | None = None,
                 num_new_host: list[int] | None = None, new: Tensor | None = None):
        self.old, self.num_new, self.tokens = old, num_new, tokens
        self.new = old + num_new if new is None else new  # ``new``: the caller has the sum already
        self.batch = old.shape[0]
        self.old_host, self.num_new_host = old_host, num_new_host
        self.new_host = None if old_host is None else [o + n for o, n in zip(old_host, num_new_host)]
        self.writers: set[int] = set()  # caches that wrote this step (each writes once)
        self.channel_scale_set: set[int] = set()  # caches whose K channel scale this step set (abort unsets it)

    @property
    def uniform(self) -> bool:
        """Every row holds the same number of tokens and gains all S (the plain causal case)."""
        h = self.old_host
        return h is not None and min(h, default=0) == max(h, default=0) and all(
            n == self.tokens for n in self.num_new_host)

    def positions(self) -> Tensor:
        """(B, S) position of each new token (for RoPE)."""
        return self.old[:, None] + torch.arange(self.tokens, device=self.old.device)

    def mask(self) -> Mask:
        """Over the rows' keys 0 .. L-1: query i of row b sees keys ``<= old[b] + i`` that exist."""
        if self.uniform:
            return Causal()
        return Causal(offsets=self.old) & KeyPadding(self.new)


class KVCache(nn.Module):
    """Base of the caches: per-sequence ``lengths``, size accounting, the step protocol.

    Buffers are non-persistent (``.to()`` moves them; state dicts stay weight-only). Subclasses
    implement ``begin``, ``write``, ``view`` and ``_commit``, and ``_abort`` to undo whatever
    ``begin`` and ``write`` changed (overwritten data, grown buffers, rows written past the
    committed lengths).

    ``dtype`` is the compute dtype (of the K/V written and of dense views); ``kv_dtype`` (None,
    "int8", "fp8_e4m3") the storage: None keeps K/V in ``dtype``, else quantized rows plus fp32
    scales (``storage_dtype`` is the torch dtype then). ``k_channel_scale`` (None: on for int8,
    off for fp8; True / False; or an (Hkv, D) tensor) divides quantized K by a fixed scale per
    (KV head, channel), set at the first write unless given (the module docstring says when it
    is set and unset). ``channel_scaled`` says whether it is on; the ``k_channel_scale`` buffer
    holds it ((Hkv, D) fp32, or None before the first write or when off).
    """

    def __init__(self, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                 value_from_key: bool = False, dtype: torch.dtype = torch.float32, device=None, kv_dtype=None,
                 k_channel_scale=None):
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, val in (("kv_heads", kv_heads), ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            positive_int(name, val)
        if value_from_key and v_head_dim > head_dim:
            raise ValueError(f"value_from_key needs v_head_dim <= head_dim, got {v_head_dim} > {head_dim}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.kv_heads, self.head_dim, self.v_head_dim = kv_heads, head_dim, v_head_dim
        self.value_from_key = bool(value_from_key)
        self.dtype = dtype
        #: The quantized storage dtype (torch.int8 / torch.float8_e4m3fn), or None: K/V kept in ``dtype``.
        self.kv_dtype = kv_storage_dtype(kv_dtype)
        self.register_buffer("lengths", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        self._init_channel_scale(k_channel_scale, self.lengths.device)

    def _init_channel_scale(self, c, device: torch.device) -> None:
        """Resolve the ``k_channel_scale`` argument: ``channel_scaled``, whether it was given, and
        the ``k_channel_scale`` buffer (the given tensor, validated, in fp32 on ``device``)."""
        given = None
        if self.kv_dtype is None:
            if c is not None and c is not False:
                what = f"a tensor of shape {shape_of(c)}" if isinstance(c, Tensor) else repr(c)
                raise ValueError(f"k_channel_scale ({what}) divides quantized keys by channel scales; it needs "
                                 f"kv_dtype='int8' or 'fp8_e4m3', got kv_dtype=None")
            on = False
        elif c is None:
            on = self.kv_dtype == torch.int8  # fp8 keeps an exponent per element: no measured gain
        elif isinstance(c, bool):
            on = c
        elif isinstance(c, Tensor):
            want = (self.kv_heads, self.head_dim)
            if not c.is_floating_point() or tuple(c.shape) != want:
                raise ValueError(f"k_channel_scale must be a floating (Hkv, D) = {want} tensor, got {c.dtype} of "
                                 f"shape {shape_of(c)}")
            given = c.detach().to(device=device, dtype=torch.float32).clone()
            bad = ~(torch.isfinite(given) & (given > 0))
            if bool(bad.any()):
                raise ValueError(f"k_channel_scale (Hkv, D) = {want} must be finite and > 0 (in fp32) everywhere, "
                                 f"got {given[bad].tolist()[:8]} at {bad.nonzero().tolist()[:8]}")
            on = True
        else:
            raise TypeError(f"k_channel_scale must be None, a bool or an (Hkv, D) = {(self.kv_heads, self.head_dim)} "
                            f"tensor, got {type(c).__name__}")
        #: Whether K is divided by a channel scale before it is quantized.
        self.channel_scaled = on
        self._channel_scale_given = given is not None
        self.register_buffer("k_channel_scale", given, persistent=False)

    # ---------------------------------------------------------------- accounting

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the K/V data buffers hold: ``kv_dtype``, or ``dtype`` when not quantized."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies in this layer's cache (K and V, Hkv heads;
        quantized: the data plus an fp32 scale per row of K and of V, one with value_from_key).
        A K channel scale is per layer ((Hkv, D) fp32), not per token: not counted here."""
        values = self.head_dim + (0 if self.value_from_key else self.v_head_dim)
        data = self.kv_heads * values * torch.empty((), dtype=self.storage_dtype).element_size()
        if self.kv_dtype is None:
            return data
        return data + self.kv_heads * (1 if self.value_from_key else 2) * 4

    def _quantize(self, step: CacheStep, rows: Sequence[Tensor]) -> list[Tensor]:
        """Quantized storage of a step's K/V rows (K first, (B, Hkv, S, ·)): ``[data of each...,
        scale of each...]``, the order of the buffers ``_stored`` / ``_pools`` list; K divided by
        the channel scale first (:meth:`_channel_scale_for`). Unquantized caches store them as given."""
        if self.kv_dtype is None:
            return list(rows)
        c = self._channel_scale_for(step, rows[0])
        if c is not None:
            rows = [rows[0].float() / c[:, None, :], *rows[1:]]
        pairs = [quantize(t, self.kv_dtype) for t in rows]
        return [d for d, _ in pairs] + [s for _, s in pairs]

    def _channel_scale_for(self, step: CacheStep, k: Tensor) -> Tensor | None:
        """The K channel scale (Hkv, D) this step writes with, None when off. Unset (the cache's
        first write): :func:`~attnkit.kvquant.channel_scale` of the step's K, the padding tokens of
        rows with ``num_new < S`` left out; kept from now on, and recorded in ``step`` so that an
        abort unsets it (:meth:`_unset_channel_scale`). A step holding no token sets nothing."""
        if not self.channel_scaled or self.k_channel_scale is not None:
            return self.k_channel_scale
        n_host, S = step.num_new_host, k.shape[2]
        if n_host is not None and not any(n_host):
            return None  # nothing stored (padding only): the first real write measures it
        if n_host is None or any(n != S for n in n_host):
            n = step.num_new if n_host is None else torch.tensor(n_host, device=k.device)
            pad = torch.arange(S, device=k.device)[None] >= n.to(k.device)[:, None]  # (B, S)
            k = k.masked_fill(pad[:, None, :, None], 0)  # |0| never sets a channel's absmax
        self.k_channel_scale = channel_scale(k)
        step.channel_scale_set.add(id(self))
        return self.k_channel_scale

    def _unset_channel_scale(self, step: CacheStep) -> None:
        """Unset the channel scale if ``step`` (being aborted) set it."""
        if id(self) in step.channel_scale_set:
            step.channel_scale_set.discard(id(self))
            self.k_channel_scale = None

    def forget_channel_scale(self) -> None:
        """Unset a computed K channel scale, so that the next write measures it again (what
        ``reset()`` does; a given scale stays). Only while the cache holds no row written with it:
        a RuntimeError otherwise (those rows would be read with another scale)."""
        if self._holds_rows():
            raise RuntimeError("forget_channel_scale() on a cache that still holds tokens written with its channel "
                               "scale; reset() it first")
        if not self._channel_scale_given:
            self.k_channel_scale = None

    def _holds_rows(self) -> bool:
        """Whether some sequence holds tokens (rows written with the channel scale)."""
        return bool((self.lengths > 0).any())

    def _kv_repr(self) -> str:
        if self.kv_dtype is None:
            return ""
        if not self.channel_scaled:
            c = "off"
        elif self.k_channel_scale is None:
            c = "first write"
        else:
            c = (f"{'given' if self._channel_scale_given else 'set'} {shape_of(self.k_channel_scale)}, "
                 f"max {float(self.k_channel_scale.max()):.3g}")
        return f", kv_dtype={dtype_name(self.kv_dtype)!r}, k_channel_scale={c}"

    def extra_repr(self) -> str:
        return (f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}"
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

    def view(self, step: CacheStep, *, dense: bool = False):
        """(k_all, v_all, mask) to attend to after ``write``: tensors (B, Hkv, L, ·) (or, unless
        ``dense``, a :class:`attnkit.PagedKV` for a paged cache, a :class:`attnkit.QuantizedKV`
        for a quantized one, and None) and the step's mask (None: nothing beyond the paged
        lengths, which attention applies itself). ``dense``: tensors in ``dtype`` always."""
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
        if v.shape[:3] != k.shape[:3] or H != self.kv_heads or D != self.head_dim or v.shape[3] != self.v_head_dim:
            raise ValueError(f"k {shape_of(k)} and v {shape_of(v)} do not fit this cache "
                             f"(Hkv={self.kv_heads}, D={self.head_dim}, Dv={self.v_head_dim})")
        if (B, S) != (step.batch, step.tokens):
            raise ValueError(f"k {shape_of(k)} does not fit the step (B={step.batch}, S={step.tokens})")
        if k.device != self._cache_device():
            raise ValueError(f"k is on {k.device} but the cache is on {self._cache_device()}")
        if id(self) in step.writers:
            raise RuntimeError("this cache already wrote this step (each layer writes a step once)")
        return v

    # ---------------------------------------------------------------- editing

    def reset(self) -> None:
        """Forget every sequence (buffers are kept for reuse) and a computed K channel scale."""
        self.lengths = self.lengths.new_zeros(0)
        self.forget_channel_scale()

    def crop(self, n) -> None:
        """Keep the first ``n`` tokens of each sequence (int or (B,) tensor); a negative int drops
        ``-n`` tokens from the end (rolling back rejected speculative tokens)."""
        n = torch.as_tensor(n, device=self.lengths.device)
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.dim() > 1:
            raise ValueError(f"n must be an int or a (B,) int tensor, got {n.dtype} of shape {tuple(n.shape)}")
        n = n.long()
        keep = self.lengths + n if (n.dim() == 0 and int(n) < 0) else n.expand_as(self.lengths)
        if (keep < 0).any():
            raise ValueError(f"crop({n.tolist()}) would leave a negative length: lengths {self.lengths.tolist()}")
        self.lengths = torch.minimum(self.lengths, keep)

    def reorder(self, indices: Tensor) -> None:
        """Select / repeat sequences along the batch (beam search): new sequence i = old indices[i]."""
        idx = _check_indices(indices, self.lengths.shape[0], self.lengths.device)
        self._reorder_buffers(idx)
        self.lengths = self.lengths[idx]

    def _reorder_buffers(self, idx: Tensor) -> None:
        raise NotImplementedError


def as_bytes(t: Tensor) -> Tensor:
    """An fp8 tensor as a uint8 view of its bytes (writes go through to it), other tensors as
    they are. Workaround: torch's CPU scatter_, gather, index_copy_, index_fill_ and masked_fill
    have no fp8 kernels (torch 2.x: "not implemented for 'Float8_e4m3fn'"); moving bytes is the
    same operation, so the caches move fp8 rows as bytes on every device."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


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
    layer at once. Other attributes (``kv_heads``, ``head_dim``, ``dtype``, ...) are the cache's."""

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
        return self.step.old

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


class _ContiguousCache(KVCache):
    """K/V in (B, Hkv, capacity, D) buffers; a step's tokens are written past the committed
    lengths, and an aborted step zeroes them (and gives back any growth), so it leaves nothing
    behind. With ``value_from_key`` there is no V buffer (``v_buf`` stays empty). Quantized
    (``kv_dtype``): ``k_buf`` / ``v_buf`` hold int8 / fp8 rows and ``k_scale`` / ``v_scale``
    (B, Hkv, capacity) their fp32 scales, moved, grown and zeroed with them; every row shares the
    (Hkv, D) K channel scale ``k_channel_scale`` (:class:`KVCache`)."""

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, value_from_key=False, dtype=torch.float32,
                 device=None, kv_dtype=None, k_channel_scale=None):
        super().__init__(kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype, device=device,
                         kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        kw = dict(dtype=self.storage_dtype, device=device)
        self.register_buffer("k_buf", torch.zeros(0, kv_heads, 0, head_dim, **kw), persistent=False)
        self.register_buffer("v_buf", torch.zeros(0, kv_heads, 0, self.v_head_dim, **kw), persistent=False)
        if self.kv_dtype is not None:
            for name in ("k_scale", "v_scale"):
                self.register_buffer(name, torch.zeros(0, kv_heads, 0, dtype=torch.float32, device=device),
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
            buf = memory.zeros((batch, self.kv_heads, length, *(() if dim is None else (dim,))),
                               dtype=old.dtype, device=old.device)
            rows, cols = min(batch, old.shape[0]), min(length, old.shape[2])
            buf[:rows, :, :cols] = old[:rows, :, :cols]
            setattr(self, name, buf)

    def _old(self, batch: int) -> Tensor:
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
        """Write the step's rows ``t`` (B, Hkv, S, ·) of one buffer at positions old .. old + S - 1
        (a scale buffer (B, Hkv, L) and its rows (B, Hkv, S) go through as one channel)."""
        if t.dim() == 3:
            buf, t = buf.unsqueeze(-1), t.unsqueeze(-1)
        buf, t = as_bytes(buf), as_bytes(t)
        B, H, S, dim = t.shape
        uniform = step.old_host is not None and min(step.old_host, default=0) == max(step.old_host, default=0)
        if uniform:  # one slice copy
            start = step.old_host[0] if step.old_host else 0
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
                self._put(step, buf, buf.new_zeros(step.batch, self.kv_heads, step.tokens,
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host: list[int] = []

    def _sync_host(self) -> None:
        self._host = self.lengths.tolist()

    def begin(self, batch, tokens, num_new=None, *, token_ids=None):
        B, S, n, n_host = self._check_step_args(batch, tokens, num_new)
        old_host = self._host if self._host else [0] * B
        need = max(old_host, default=0) + S
        rows, cap = self.k_buf.shape[0], self.k_buf.shape[2]
        grown_from = None
        if rows != B or need > cap:
            self._alloc(B, max(need, 2 * cap, 16))  # keeps every committed token
            grown_from = (rows, cap)  # an abort shrinks the buffers back
        step = CacheStep(self._old(B), n, S, old_host=list(old_host), num_new_host=n_host)
        step.grown_from = grown_from
        return step

    def view(self, step, *, dense=False):
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

    def __init__(self, kv_heads, head_dim, v_head_dim=None, *, max_batch: int, max_len: int,
                 value_from_key=False, dtype=torch.float32, device=None, kv_dtype=None, k_channel_scale=None):
        super().__init__(kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype, device=device,
                         kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        for name, val in (("max_batch", max_batch), ("max_len", max_len)):
            positive_int(name, val)
        self.max_batch, self.max_len = max_batch, max_len
        self._alloc(max_batch, max_len)

    def begin(self, batch, tokens, num_new=None, *, token_ids=None):
        B, S, n, n_host = self._check_step_args(batch, tokens, num_new)
        if B != self.max_batch:
            raise ValueError(f"a step of batch {B} but the static cache was built for max_batch={self.max_batch}; "
                             f"build it for the batch you run")
        old = self._old(B).clone()  # lengths stay as they are until commit (empty before the first)
        old_host = None
        if not torch.compiler.is_compiling():
            old_host = old.tolist()
            end = max(old_host, default=0) + S
            if end > self.max_len:
                raise ValueError(f"writing {S} tokens after lengths {old_host} overflows the static cache's "
                                 f"max_len {self.max_len}")
        return CacheStep(old, n, S, old_host=old_host, num_new_host=n_host)

    def view(self, step, *, dense=False):
        # One token per row (decode): its query at position old sees keys j <= old, and j < new
        # with new <= old + 1, so KeyPadding(new) alone is the whole mask: per-row lengths,
        # which kernels take as they are (no key intervals built per step under compile).
        mask = KeyPadding(step.new) if step.tokens == 1 else Causal(offsets=step.old) & KeyPadding(step.new)
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
