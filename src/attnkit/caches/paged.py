"""Paged KV cache: one layer's K/V in fixed-size blocks of a preallocated pool, following the block
tables of a :class:`~attnkit.caches.BlockAllocator` (fork with copy-on-write, prefix caching).

Notation: N blocks in the pool, bs tokens per block, B batch rows, Hkv KV heads, S new tokens
this step, D / Dv key / value head dims. A *slot* is ``block * bs + offset``: the row of one
token in a pool (N, bs, Hkv, D) viewed as (N * bs, Hkv, D).

The cache stores; it never computes attention: ``attend`` hands ``attnkit.attention`` a
:class:`attnkit.PagedKV` (pools, block table, lengths) and the registry picks a kernel that reads
the blocks in place (the ``paged`` backend's split-K engine, the ``triton`` kernel on CUDA) or
gathers them.

One layer (its own allocator; sequences are created by the first step, ids 0..B-1)::

    cache = PagedKVCache(num_kv_heads, head_dim, num_blocks=1024, block_size=16)
    out = mha(prompt, cache=cache)            # prefill
    out = mha(next_tokens, cache=cache)       # decode: each sequence at its own length

Several layers share one allocator (one block table for the whole model, vLLM style) and run a
forward as one explicit step (:func:`attnkit.caches.step`), committed in every layer or none::

    alloc = BlockAllocator(num_blocks=4096, block_size=16, prefix_caching=True)
    caches = [PagedKVCache(num_kv_heads, head_dim, allocator=alloc) for _ in layers]
    a = alloc.add_sequence(token_ids=prompt_a)   # reuses cached full blocks of its prefix
    alloc.set_batch([a])                         # rows of the next forward
    start = alloc.length(a)                      # tokens already cached: feed prompt_a[start:]
    with attnkit.caches.step(caches, batch=1, tokens=len(prompt_a) - start,
                             token_ids=[prompt_a[start:]]) as bound:
        for layer, c in zip(layers, bound):
            x = layer(x, cache=c)
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from ..kvlayout import PagedKV, QuantizedKV
from ..masks import Causal, KeyPadding
from .allocator import BlockAllocator, OutOfBlocks, PagedStep
from . import memory
from .._deprecation import renamed_kwargs
from .protocol import KVCache
from .quant_policy import as_bytes

__all__ = ["BlockAllocator", "PagedKVCache", "OutOfBlocks", "PagedStep"]


class PagedKVCache(KVCache):
    """One layer's K/V blocks, following a :class:`BlockAllocator`'s block tables.

    Args:
        num_kv_heads, head_dim, v_head_dim: Hkv, D, Dv (default D). ``kv_heads=`` is the
            deprecated name of ``num_kv_heads``.
        num_blocks, block_size: the pool, when this cache makes its own allocator (block_size
            defaults to 16). With ``allocator=`` they may be left out (or must match it).
        allocator: a :class:`BlockAllocator` shared by the layers of a model.
        prefix_caching: for the allocator this cache makes.
        value_from_key: store K only; V is its first ``v_head_dim`` channels (MLA's latent
            cache: num_kv_heads=1, head_dim = kv_lora_rank + rope dim, v_head_dim = kv_lora_rank).
        dtype, device: the compute dtype (of the K/V written and of dense views) and the device.
        kv_dtype: None (pools in ``dtype``), "int8" or "fp8_e4m3": pools of quantized rows and
            fp32 scale pools ``k_scale`` / ``v_scale`` (N, bs, Hkv) beside them (one scale pool
            with ``value_from_key``), copied on write, erased and shared with the blocks;
            ``attend`` hands attention a paged :class:`attnkit.QuantizedKV`.
        k_channel_scale: None (on for int8, off for fp8), True / False, or an (Hkv, D) tensor:
            K divided by a fixed scale per (KV head, channel) before it is quantized
            (:class:`~attnkit.caches.KVCache`). One scale for this layer's pool, set at its first
            write unless given, so forks, copy-on-write copies and reused prefix blocks all read
            with it; ``reset()`` unsets it only once the allocator holds no sequence and no
            cached block (nothing left that was written with it).

    Batch rows are sequences of the allocator: ``set_batch(seq_ids)`` names them; a fresh cache
    creates them on its first step. ``lengths``, ``positions``, ``update`` and ``attend`` then
    work as in every cache: ragged batches (``num_new``), multi-token steps (speculative
    verification), chunked prefill. ``update`` returns contiguous (B, Hkv, max_len, ·) copies
    gathered from the blocks (for callers that need plain tensors, e.g. MLA's naive prefill);
    ``attend`` reads the blocks in place.

    A cache whose allocator other caches share takes steps only through
    :func:`attnkit.caches.step` (one step appends for every layer), and ``reorder`` / ``crop``
    through :func:`attnkit.caches.reorder` / :func:`~attnkit.caches.crop` (once per allocator).
    ``reorder(indices)`` forks (beam search shares blocks, nothing is copied) and frees the rows
    not chosen; ``crop(n)`` returns whole blocks that fall off; ``reset()`` frees the batch's
    sequences (sequences outside the batch, e.g. a shared prompt kept for forking, stay).
    ``nbytes`` is the pools' capacity; ``nbytes_used`` the blocks in use. Eager only.
    """

    @renamed_kwargs(kv_heads="num_kv_heads")
    def __init__(self, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                 num_blocks: int | None = None, block_size: int | None = None,
                 allocator: BlockAllocator | None = None, prefix_caching: bool = False,
                 value_from_key: bool = False, dtype: torch.dtype = torch.float32, device=None, kv_dtype=None,
                 k_channel_scale=None):
        super().__init__(num_kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype,
                         device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        # Lengths are the allocator's (shared by the layers); see the ``lengths`` property.
        self._device = self.lengths.device
        del self._buffers["lengths"]
        if allocator is None:
            if num_blocks is None:
                raise ValueError("PagedKVCache needs num_blocks (or a shared allocator=)")
            allocator = BlockAllocator(num_blocks, 16 if block_size is None else block_size,
                                       prefix_caching=prefix_caching)
        elif not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        else:
            for name, given, has in (("num_blocks", num_blocks, allocator.num_blocks),
                                     ("block_size", block_size, allocator.block_size)):
                if given is not None and given != has:
                    raise ValueError(f"{name}={given} differs from the allocator's {name}={has}")
            if prefix_caching and not allocator.prefix_caching:
                raise ValueError("prefix_caching=True but the given allocator was built without it")
        self.allocator = allocator
        N, bs, H = allocator.num_blocks, allocator.block_size, num_kv_heads
        kw = dict(dtype=self.storage_dtype, device=device)
        self.register_buffer("k_pool", memory.zeros((N, bs, H, head_dim), **kw), persistent=False)
        self.register_buffer("v_pool", memory.zeros((0 if value_from_key else N, bs, H, self.v_head_dim), **kw),
                             persistent=False)
        if self.kv_dtype is not None:
            f32 = dict(dtype=torch.float32, device=device)
            self.register_buffer("k_scale", memory.zeros((N, bs, H), **f32), persistent=False)
            self.register_buffer("v_scale", memory.zeros((0 if value_from_key else N, bs, H), **f32),
                                 persistent=False)
        allocator.attach(self)

    # ---------------------------------------------------------------- state

    def _cache_device(self) -> torch.device:
        return self.k_pool.device  # without building the lengths from the allocator

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens each batch row holds (committed)."""
        if "allocator" not in self.__dict__:
            raise AttributeError("lengths")  # during __init__ (nn.Module probes attribute names)
        return self.allocator.lengths(device=self.k_pool.device)

    @property
    def step_group(self) -> int:
        """Caches with the same group share one step (the allocator's)."""
        return id(self.allocator)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """Sequence ids of the batch rows."""
        return self.allocator.batch

    def set_batch(self, seq_ids: Iterable[int]) -> None:
        """Name the sequences (allocator ids) that the rows of the next forward continue."""
        self.allocator.set_batch(seq_ids)

    @property
    def nbytes_used(self) -> int:
        """Bytes of this layer's pools in blocks held by some sequence."""
        return self.allocator.num_used * self.allocator.block_size * self.bytes_per_token

    def extra_repr(self) -> str:
        a = self.allocator
        return (f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"blocks={a.num_blocks}x{a.block_size}, used={a.num_used}, value_from_key={self.value_from_key}"
                f"{self._kv_repr()}")

    def _shared(self) -> bool:
        return self.allocator.num_attached > 1

    def _pools(self) -> tuple[Tensor, ...]:
        """Every pool a block's tokens live in, in :meth:`_quantize`'s order: K (and V), then
        (quantized) their scale pools (N, bs, Hkv)."""
        pools = (self.k_pool,) if self.value_from_key else (self.k_pool, self.v_pool)
        if self.kv_dtype is None:
            return pools
        return pools + ((self.k_scale,) if self.value_from_key else (self.k_scale, self.v_scale))

    # ---------------------------------------------------------------- the step protocol

    def positions(self, num_new: int) -> Tensor:
        step = torch.arange(num_new, device=self.k_pool.device)
        lengths = self.lengths
        return step[None] if lengths.numel() == 0 else lengths[:, None] + step

    def begin(self, batch, tokens, num_new=None, *, token_ids=None) -> PagedStep:
        """The allocator's step for every cache that shares it (see :meth:`BlockAllocator.begin_step`)."""
        return self.allocator.begin_step(batch, tokens, num_new, token_ids=token_ids)

    def copy_on_write(self, step: PagedStep) -> None:
        """Copy the step's shared blocks into their private copies in this layer's pools (once per
        step; the allocator calls it at commit for layers that did not write)."""
        if id(self) in step.copied:
            return
        step.copied.add(id(self))
        if step.cow:
            dev = self.k_pool.device
            src = torch.tensor([s for s, _ in step.cow], dtype=torch.long, device=dev)
            dst = torch.tensor([d for _, d in step.cow], dtype=torch.long, device=dev)
            for pool in map(as_bytes, self._pools()):
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def write(self, step, k, v):
        v = self._check_kv(step, k, v)
        if step.alloc is not self.allocator:
            raise ValueError("the step was begun on another allocator")
        if step.cow:
            self.copy_on_write(step)
        B, H, S, _ = k.shape
        pools = self._pools()
        _, slots, src, _, _ = step.on(pools[0].device)
        # A writer from here on: an abort erases the step's rows (and unsets a channel scale this
        # write set) even if the write below raises half-way.
        step.writers.add(id(self))
        for pool, t in zip(pools, self._quantize(step, (k,) if self.value_from_key else (k, v))):
            # (B * S, Hkv, ·) token rows (scales: (B * S, Hkv)); a decode step's (B, Hkv, 1, ·) is
            # one select away
            rows = t.select(2, 0) if S == 1 else t.transpose(1, 2).reshape(B * S, H, *t.shape[3:])
            if src is not None:
                rows = rows.index_select(0, src)
            as_bytes(pool).flatten(0, 1).index_copy_(0, slots, as_bytes(rows))

    def erase(self, step: PagedStep) -> None:
        """Zero the pool rows this layer wrote in ``step`` and unset the channel scale if the step
        set it (an aborted step: see :meth:`BlockAllocator.abort`)."""
        _, slots, _, _, _ = step.on(self.k_pool.device)
        for pool in self._pools():
            as_bytes(pool).flatten(0, 1).index_fill_(0, slots, 0)
        self._unset_channel_scale(step)

    def view(self, step, *, dense=False, held_only=False):
        table, _, _, q_start, new = step.on(self.k_pool.device)
        max_len = max(step.new_host, default=0)
        if self.kv_dtype is None:
            kv = PagedKV(self.k_pool, None if self.value_from_key else self.v_pool, table, new,
                         v_head_dim=self.v_head_dim, max_len=max_len, checked=True)
        else:
            vfk = self.value_from_key
            kv = QuantizedKV(self.k_pool, self.k_scale, None if vfk else self.v_pool, None if vfk else self.v_scale,
                             v_head_dim=self.v_head_dim, block_table=table, lengths=new, max_len=max_len,
                             checked=True, k_channel_scale=self.k_channel_scale)
        if dense:
            k_all, v_all = kv.gather(self.dtype) if self.kv_dtype is not None else kv.gather()
            return k_all, v_all, Causal(q_start=q_start) & KeyPadding(new)
        # attention() adds KeyPadding(lengths); a step of one new token per row needs nothing more
        one = step.tokens == 1 and step.num_new_host is not None and all(x == 1 for x in step.num_new_host)
        return kv, None, None if one else Causal(q_start=q_start)

    def commit(self, step):
        self.allocator.commit(step)

    def abort(self, step):
        self.allocator.abort(step)

    def _transaction(self, batch, tokens, num_new):
        if self._shared():
            raise RuntimeError(f"this cache's allocator is shared by {self.allocator.num_attached} caches: a forward "
                               f"appends to all of them at once; run it inside attnkit.caches.step(caches, ...)")
        return super()._transaction(batch, tokens, num_new)

    # ---------------------------------------------------------------- editing

    def reset(self) -> None:
        """Free the batch's sequences and forget the batch (idempotent: every layer may call it).
        Once the allocator holds no sequence and no cached block, every attached layer forgets
        its computed K channel scale (rows written with it could otherwise still be read)."""
        a = self.allocator
        a.reset_batch()
        if not self._holds_rows():
            for pools in a.attached:
                if isinstance(pools, KVCache):
                    pools.forget_channel_scale()

    def _holds_rows(self) -> bool:
        """Whether the pool holds rows a sequence may read: a live sequence or a cached block."""
        return bool(self.allocator.sequences) or self.allocator.num_cached_blocks > 0

    def crop(self, n) -> None:
        """Keep the first ``n`` tokens of each row (int or (B,) tensor); a negative int drops
        ``-n`` tokens from the end (rejected speculative tokens). Whole blocks past the kept
        tokens return to the pool.

        Unlike the contiguous caches, the dropped rows are left as they are: no view reads a
        row past its sequence's length (:class:`attnkit.PagedKV` gathers zeros there, and the
        kernels stop at the length), and the blocks may still be another sequence's (a fork) or
        the prefix cache's, whose rows must not change."""
        self._not_shared("crop", "crop")
        self.crop_group(n)

    def crop_group(self, n) -> None:
        """:meth:`crop` for every cache sharing the allocator (what :func:`attnkit.caches.crop` calls)."""
        t = torch.as_tensor(n)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 1:
            raise ValueError(f"n must be an int or a (B,) int tensor, got {t.dtype} of shape {tuple(t.shape)}")
        a = self.allocator
        lengths = [a.length(s) for s in a.batch]
        if t.dim() == 0:
            keep = [x + int(t) for x in lengths] if int(t) < 0 else [int(t)] * len(lengths)
        else:
            if t.shape[0] != len(lengths):
                raise ValueError(f"n has {t.shape[0]} entries for a batch of {len(lengths)}")
            keep = t.tolist()
        if any(x < 0 for x in keep):
            raise ValueError(f"crop({t.tolist()}) would leave a negative length: lengths {lengths}")
        for sid, kp in zip(a.batch, keep):
            a.crop(sid, kp)

    def reorder(self, indices) -> None:
        """New row i continues old row ``indices[i]`` (beam search). Repeated rows fork (blocks
        shared, copy-on-write later); rows not chosen are freed."""
        self._not_shared("reorder", "reorder")
        self.reorder_group(indices)

    def reorder_group(self, indices) -> None:
        """:meth:`reorder` for every cache sharing the allocator (what :func:`attnkit.caches.reorder` calls)."""
        idx = torch.as_tensor(indices)
        if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1:
            raise ValueError(f"indices must be a 1-D integer tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
        self.allocator.reorder(idx.tolist())

    def _not_shared(self, what: str, fn: str) -> None:
        """``crop`` / ``reorder`` act on the allocator: with shared layers, once for all of them."""
        if self._shared():
            raise RuntimeError(f"{what}() on a cache whose allocator is shared by {self.allocator.num_attached} caches "
                               f"would act once per layer; call attnkit.caches.{fn}(caches, ...) (once per allocator)")

    def _reorder_buffers(self, idx: Tensor) -> None:  # reorder() is overridden; nothing to move
        raise NotImplementedError
