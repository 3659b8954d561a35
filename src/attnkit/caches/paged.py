"""Paged KV cache: fixed-size blocks in one preallocated pool per layer, block tables, fork with
copy-on-write, automatic prefix caching, and attention that reads the pages where they are.

Notation: N blocks in the pool, bs tokens per block, B batch rows, Hkv KV heads, S new tokens
this step, D / Dv key / value head dims. A *slot* is ``block * bs + offset``: the row of one
token in a pool (N, bs, Hkv, D) viewed as (N * bs, Hkv, D).

Two parts:

* :class:`BlockAllocator`: the bookkeeping, no tensors. A free list, per-block reference counts,
  sequences (block list + length), ``fork`` (blocks shared, copy-on-write when a shared partial
  block is appended to), ``crop``, ``free``, optional prefix caching (identical full blocks of
  token ids, hashed with their prefix as vLLM does, are reused across requests), block tables
  and context lengths as tensors, and the *batch*: which sequences the rows of the next forward
  are. Running out of blocks raises :class:`OutOfBlocks` and changes nothing.
* :class:`PagedKVCache`: one layer's pools ``k_pool`` (N, bs, Hkv, D) and ``v_pool``
  (N, bs, Hkv, Dv) (no ``v_pool`` with ``value_from_key``: MLA's latent cache), following the
  allocator's block tables. It is a :class:`~attnkit.caches.KVCache`, so modules take it like any
  other cache; ``attend`` runs attention over the pages without a (B, max_len) copy.

Usage, one layer (sequences are created implicitly, ids 0..B-1)::

    cache = PagedKVCache(kv_heads, head_dim, num_blocks=1024, block_size=16)
    out = mha(prompt, cache=cache)            # prefill
    out = mha(next_tokens, cache=cache)       # decode: each sequence at its own length

Several layers share one allocator (one block table for the whole model, vLLM style)::

    alloc = BlockAllocator(num_blocks=4096, block_size=16, prefix_caching=True)
    caches = [PagedKVCache(kv_heads, head_dim, allocator=alloc) for _ in layers]
    a = alloc.add_sequence(token_ids=prompt_a)   # reuses cached full blocks of its prefix
    alloc.set_batch([a, b])                      # rows of the next forward
    start = alloc.length(a)                      # tokens already cached: feed prompt_a[start:]

Layers sharing an allocator stay in step by themselves: the first layer to call ``update`` /
``attend`` in a forward *opens* the step (allocates the new tokens' slots, plans the attention
once), the other layers *join* it (write their own K/V into the same slots, reuse the plan).
``reorder`` and ``crop`` work the same way (call them on every layer, as for any cache; the first
call acts, the others follow). So every layer must see the same calls with the same arguments in
the same order; a layer that falls out of step raises RuntimeError. ``reset()`` always works and
brings every layer back in step.
"""

from __future__ import annotations

import heapq
import math
import operator
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from . import _paged_attention as _pa
from .base import KVCache

__all__ = ["BlockAllocator", "PagedKVCache", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than an operation needs. Nothing was changed.

    Attributes: ``needed`` (blocks the operation needs), ``free`` and ``capacity`` (of the pool).
    """

    def __init__(self, needed: int, free: int, capacity: int, what: str):
        self.needed, self.free, self.capacity = needed, free, capacity
        super().__init__(f"{what} needs {needed} free blocks but the pool has {free} of {capacity}; nothing "
                         f"was changed (free or crop sequences, or build a larger pool)")


def _as_id(seq_id, name: str = "seq_id") -> int:
    if isinstance(seq_id, bool):
        raise TypeError(f"{name} must be an int, got {seq_id!r}")
    try:
        return operator.index(seq_id)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(seq_id).__name__}") from None


def _as_count(val, name: str, lowest: int) -> int:
    """An int >= ``lowest`` (numpy and 0-d tensor ints accepted; bools and floats refused)."""
    try:
        n = None if isinstance(val, bool) else operator.index(val)
    except TypeError:
        n = None
    if n is None or n < lowest:
        what = "a positive" if lowest == 1 else "a non-negative"
        raise ValueError(f"{name} must be {what} int, got {val!r}")
    return n


def _as_tokens(token_ids, name: str = "token_ids") -> list[int]:
    if isinstance(token_ids, Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {token_ids.dtype} of "
                            f"shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    try:
        return [_as_id(t, name) for t in token_ids]
    except TypeError:
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints") from None


class _Seq:
    """One sequence: its blocks (in position order), their runs of consecutive ids, its length,
    the token ids known for it (prefix caching) and the chain hashes of its leading full blocks."""

    __slots__ = ("blocks", "runs", "length", "tokens", "keys")

    def __init__(self):
        self.blocks: list[int] = []
        self.runs: list[list[int]] = []  # [first block, count]: attention reads a run in place
        self.length = 0
        self.tokens: list[int] = []
        self.keys: list[int] = []

    def push(self, blk: int) -> None:
        self.blocks.append(blk)
        if self.runs and self.runs[-1][0] + self.runs[-1][1] == blk:
            self.runs[-1][1] += 1
        else:
            self.runs.append([blk, 1])

    def pop(self) -> int:
        blk = self.blocks.pop()
        self.runs[-1][1] -= 1
        if self.runs[-1][1] == 0:
            self.runs.pop()
        return blk

    def copy(self) -> "_Seq":
        s = _Seq()
        s.blocks, s.runs, s.length = list(self.blocks), [list(r) for r in self.runs], self.length
        s.tokens, s.keys = self.tokens[:self.length], list(self.keys)  # declared future tokens stay with the parent
        return s


@dataclass
class _Op:
    """The last batch operation a layer opened, for the other layers sharing the allocator to join."""

    key: tuple
    lengths_before: list[int]
    step: "_Step | None" = None


class BlockAllocator:
    """Blocks of ``block_size`` token slots, ``num_blocks`` of them, shared by sequences.

    Args:
        num_blocks: N, the pool's capacity in blocks (each layer's pool has N blocks).
        block_size: bs, tokens per block.
        prefix_caching: reuse identical full blocks across sequences. A block's identity is its
            token ids and the hash of everything before it (vLLM's hash chain); sequences
            created with ``add_sequence(token_ids=...)`` start with the cached blocks of their
            longest cached prefix. Freed cached blocks are kept (and still reusable) until the
            pool needs them, least recently freed first.

    Sequences are named by int ids. Errors: unknown or freed ids raise KeyError (a double free
    says so), bad arguments ValueError / TypeError, a full pool :class:`OutOfBlocks`; none of
    them changes anything.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, prefix_caching: bool = False):
        num_blocks, block_size = _as_count(num_blocks, "num_blocks", 1), _as_count(block_size, "block_size", 1)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = bool(prefix_caching)
        self._ref = [0] * num_blocks
        self._clean = list(range(num_blocks))  # min-heap of free blocks: fresh runs stay consecutive
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free blocks still cached, LRU first
        self._used = 0
        self._seqs: dict[int, _Seq] = {}
        self._freed: set[int] = set()
        self._next_id = 0
        self._cached: dict[tuple, int] = {}  # (parent chain hash, token ids) -> block
        self._block_key: dict[int, tuple] = {}
        self._caches: weakref.WeakSet = weakref.WeakSet()  # layer pools to copy blocks in (COW)
        self._batch: tuple[int, ...] = ()
        # Layer caches in step (see PagedKVCache): epoch of the last opened op, and a floor
        # below which every layer counts as in step (set by reset()).
        self._epoch = 0
        self._floor = 0
        self._last: _Op | None = None

    # ---------------------------------------------------------------- state

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached-but-free blocks included: they are reusable)."""
        return len(self._clean) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self._used

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks registered for prefix reuse (held or free)."""
        return len(self._cached)

    @property
    def sequences(self) -> tuple[int, ...]:
        """Ids of the live sequences."""
        return tuple(self._seqs)

    @property
    def batch(self) -> tuple[int, ...]:
        """Sequence ids of the rows of the next forward (empty: the next update creates them)."""
        return self._batch

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def refcount(self, block: int) -> int:
        """How many sequences hold ``block``."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range [0, {self.num_blocks})")
        return self._ref[block]

    def length(self, seq_id: int) -> int:
        """Tokens sequence ``seq_id`` holds."""
        return self._get(seq_id).length

    def blocks(self, seq_id: int) -> tuple[int, ...]:
        """Block ids of ``seq_id`` in position order (its block table row)."""
        return tuple(self._get(seq_id).blocks)

    def block_table(self, seq_ids: Iterable[int] | None = None, *, pad: int = -1, device=None) -> Tensor:
        """(B, max blocks) long tensor of the sequences' block ids (default: the batch), padded
        with ``pad``. Token p of row b is in slot ``table[b, p // bs] * bs + p % bs``."""
        seqs = [self._get(s) for s in (self._batch if seq_ids is None else seq_ids)]
        width = max((len(s.blocks) for s in seqs), default=0)
        return torch.tensor([s.blocks + [pad] * (width - len(s.blocks)) for s in seqs], dtype=torch.long,
                            device=device).view(len(seqs), width)

    def context_lengths(self, seq_ids: Iterable[int] | None = None, *, device=None) -> Tensor:
        """(B,) long tensor of the sequences' lengths (default: the batch)."""
        return torch.tensor([self._get(s).length for s in (self._batch if seq_ids is None else seq_ids)],
                            dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, used={self.num_used}, "
                f"sequences={len(self._seqs)}, prefix_caching={self.prefix_caching})")

    # ---------------------------------------------------------------- sequences

    def add_sequence(self, seq_id: int | None = None, *, token_ids=None) -> int:
        """A new empty sequence (id ``seq_id`` or the next free one); returns its id.

        ``token_ids``: the tokens it will hold (its prompt), for prefix caching. With
        ``prefix_caching``, the sequence starts with the cached full blocks of its longest cached
        prefix, at most ``len(token_ids) - 1`` tokens (the last token is always computed: its
        output gives the next token); ``length(id)`` says how many, and the caller feeds the
        tokens from there on. Never allocates (so never raises OutOfBlocks).
        """
        if seq_id is None:
            while self._next_id in self._seqs:
                self._next_id += 1
            seq_id = self._next_id
        seq_id = _as_id(seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        seq = _Seq()
        if token_ids is not None:
            seq.tokens = _as_tokens(token_ids)
        if self.prefix_caching and seq.tokens:
            bs, chain = self.block_size, None
            for i in range((len(seq.tokens) - 1) // bs):
                key = (chain, tuple(seq.tokens[i * bs:(i + 1) * bs]))
                blk = self._cached.get(key)
                if blk is None:
                    break
                if self._ref[blk] == 0:  # a freed cached block comes back
                    del self._evictable[blk]
                    self._used += 1
                self._ref[blk] += 1
                seq.push(blk)
                chain = hash(key)
                seq.keys.append(chain)
            seq.length = len(seq.blocks) * bs
        self._seqs[seq_id] = seq
        self._freed.discard(seq_id)
        self._next_id = max(self._next_id, seq_id + 1)
        self._last = None
        return seq_id

    def append(self, seq_id: int, num_tokens: int | None = None, *, token_ids=None) -> Tensor:
        """Grow ``seq_id`` by ``num_tokens`` tokens (or ``len(token_ids)``, recording their ids
        for prefix caching); new blocks on demand, copy-on-write of a shared partial last block.
        Returns the new tokens' slots (num_tokens,) (long, CPU): where each layer writes them.

        Layer caches do this themselves in ``update`` (slots appended here are attended as
        tokens: undo a trial append with ``crop``). Raises :class:`OutOfBlocks`, changing nothing.
        """
        seq = self._get(seq_id)
        ids = None if token_ids is None else _as_tokens(token_ids)
        if num_tokens is None:
            if ids is None:
                raise ValueError("append needs num_tokens or token_ids")
            num_tokens = len(ids)
        num_tokens = _as_count(num_tokens, "num_tokens", 0)
        if ids is not None and len(ids) != num_tokens:
            raise ValueError(f"token_ids has {len(ids)} ids but num_tokens is {num_tokens}")
        start = seq.length
        if ids is not None:
            self._check_ids_known(seq_id, seq)
        self._grow([(seq, num_tokens)], f"appending {num_tokens} tokens to sequence {seq_id}")
        if ids is not None:
            seq.tokens = seq.tokens[:start] + ids
            self._register(seq)
        self._last = None
        return self._slots(seq, start, num_tokens)

    def extend_tokens(self, seq_id: int, token_ids) -> None:
        """Record the ids of the next tokens of ``seq_id`` (e.g. generated ones, before feeding
        them), so the blocks they fill can be reused by prefix caching. Position-aligned: ids are
        appended after those already known."""
        seq = self._get(seq_id)
        seq.tokens.extend(_as_tokens(token_ids))
        self._register(seq)

    @staticmethod
    def _check_ids_known(seq_id: int, seq) -> None:
        """``append(token_ids=)`` gives the ids of positions ``length ..``: every earlier id must
        be known, or blocks would be registered for prefix caching under ids they do not hold
        (``extend_tokens`` records ids from the first unknown position instead)."""
        if len(seq.tokens) < seq.length:
            raise ValueError(f"sequence {seq_id} holds {seq.length} tokens but only {len(seq.tokens)} ids are "
                             f"known; record ids from position 0 (add_sequence(token_ids=...)) to use them")

    def fork(self, seq_id: int, new_id: int | None = None) -> int:
        """A new sequence sharing every block of ``seq_id`` (refcounts + 1; nothing is copied).
        Whichever appends to a shared partial block first gets its own copy. Returns the new id."""
        parent = self._get(seq_id)
        child_id = self.add_sequence(new_id)
        child = parent.copy()
        for blk in child.blocks:
            self._ref[blk] += 1
        self._seqs[child_id] = child
        return child_id

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``; blocks no other sequence holds return to the pool."""
        seq = self._get(seq_id)
        if seq_id in self._batch:
            raise ValueError(f"sequence {seq_id} is in the current batch {list(self._batch)}; set_batch() without it "
                             f"(or reorder/reset the caches) before freeing it")
        for blk in reversed(seq.blocks):  # tail first: a prefix's first blocks stay cached longest
            self._release(blk)
        del self._seqs[seq_id]
        self._freed.add(seq_id)
        self._last = None

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` (no-op if it is shorter); whole blocks
        past them return to the pool. Token ids recorded past ``length`` are forgotten."""
        length = _as_count(length, "length", 0)
        self._crop(self._get(seq_id), length)
        self._last = None

    def set_batch(self, seq_ids: Iterable[int]) -> None:
        """Make ``seq_ids`` (live, distinct) the rows of the next forward, in this order."""
        ids = tuple(_as_id(s, "seq_ids") for s in seq_ids)
        for s in ids:
            self._get(s)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {list(ids)}")
        self._batch = ids
        self._last = None

    # ---------------------------------------------------------------- internals

    def _get(self, seq_id) -> _Seq:
        seq_id = _as_id(seq_id)
        seq = self._seqs.get(seq_id)
        if seq is None:
            if seq_id in self._freed:
                raise KeyError(f"sequence {seq_id} was already freed (double free?)")
            raise KeyError(f"unknown sequence id {seq_id} (live: {sorted(self._seqs)[:16]}"
                           f"{' ...' if len(self._seqs) > 16 else ''})")
        return seq

    def _take(self) -> int:
        if self._clean:
            blk = heapq.heappop(self._clean)
        else:  # evict the least recently freed cached block
            blk, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_key.pop(blk)]
        self._ref[blk] = 1
        self._used += 1
        return blk

    def _release(self, blk: int) -> None:
        self._ref[blk] -= 1
        if self._ref[blk] == 0:
            self._used -= 1
            if blk in self._block_key:
                self._evictable[blk] = None
            else:
                heapq.heappush(self._clean, blk)

    def _needed(self, items: list[tuple[_Seq, int]]) -> int:
        """Blocks ``_grow(items)`` takes, copy-on-write included (exact: two rows appending to the
        same shared block copy it once between them)."""
        bs, need, dropped = self.block_size, 0, {}
        for seq, n in items:
            if n <= 0:
                continue
            if seq.length % bs:
                last = seq.blocks[-1]
                if self._ref[last] - dropped.get(last, 0) > 1:
                    need += 1
                    dropped[last] = dropped.get(last, 0) + 1
            need += -(-(seq.length + n) // bs) - len(seq.blocks)
        return need

    def _grow(self, items: list[tuple[_Seq, int]], what: str) -> None:
        """Append n tokens to each (seq, n), all or nothing."""
        need = self._needed(items)
        if need > self.num_free:
            raise OutOfBlocks(need, self.num_free, self.num_blocks, what)
        bs, src, dst = self.block_size, [], []
        for seq, n in items:
            if n <= 0:
                continue
            if seq.length % bs:  # the new tokens start in the partial last block
                last = seq.blocks[-1]
                if self._ref[last] > 1:  # copy-on-write: the others keep the original
                    seq.pop()
                    new = self._take()
                    self._ref[last] -= 1  # still >= 1
                    seq.push(new)
                    src.append(last)
                    dst.append(new)
                elif last in self._block_key:
                    # A cached full block that this sequence cropped into and now rewrites in
                    # place: it no longer holds what its key says.
                    del self._cached[self._block_key.pop(last)]
            while len(seq.blocks) * bs < seq.length + n:
                seq.push(self._take())
            seq.length += n
            self._register(seq)
        if src:
            for cache in list(self._caches):
                cache._copy_blocks(src, dst)

    def _crop(self, seq: _Seq, keep: int) -> None:
        if keep >= seq.length:
            return
        bs = self.block_size
        while len(seq.blocks) * bs >= keep + bs:
            self._release(seq.pop())
        seq.length = keep
        del seq.tokens[keep:]
        del seq.keys[keep // bs:]

    def _register(self, seq: _Seq) -> None:
        """Register the sequence's newly full blocks whose token ids are known (prefix caching)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.keys) < seq.length // bs and len(seq.tokens) >= (len(seq.keys) + 1) * bs:
            i = len(seq.keys)
            key = (seq.keys[-1] if i else None, tuple(seq.tokens[i * bs:(i + 1) * bs]))
            seq.keys.append(hash(key))
            blk = seq.blocks[i]
            if key not in self._cached and blk not in self._block_key:
                self._cached[key] = blk
                self._block_key[blk] = key

    def _slots(self, seq: _Seq, start: int, n: int) -> Tensor:
        bs = self.block_size
        pos = torch.arange(start, start + n)
        blocks = torch.tensor(seq.blocks[start // bs:], dtype=torch.long)
        return blocks[pos // bs - start // bs] * bs + pos % bs if n else pos

    def _reorder(self, idx: list[int]) -> None:
        """New batch row i = old row idx[i]: repeats fork, rows not chosen are freed."""
        old, kept, new = self._batch, set(), []
        for i in idx:
            sid = old[i]
            new.append(self.fork(sid) if sid in kept else sid)
            kept.add(sid)
        self._batch = tuple(new)
        for sid in old:
            if sid not in kept:
                self.free(sid)

    def _reset_batch(self) -> None:
        batch, self._batch = self._batch, ()
        for sid in batch:
            self.free(sid)


class _Step:
    """One forward step of the batch, shared by the layers: where the new tokens go and (built
    on first use) the attention plan and the contiguous block table."""

    def __init__(self, alloc: BlockAllocator, batch: tuple[int, ...], old: list[int], n: list[int], S: int):
        self.alloc, self.batch, self.old, self.n, self.S = alloc, batch, old, n, S
        self.new = [o + k for o, k in zip(old, n)]
        self._cache: dict = {}

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def write_index(self, device) -> tuple[Tensor, Tensor | None]:
        """(slots (T,), source rows (T,) into the step's (B * S) tokens, or None: all of them)."""
        def build():
            bs, S = self.alloc.block_size, self.S
            cover, base = [], []
            for sid, o, nw in zip(self.batch, self.old, self.new):
                base.append(len(cover) - o // bs)
                if nw > o:
                    cover.extend(self.alloc._seqs[sid].blocks[o // bs:-(-nw // bs)])
            B = len(self.batch)
            old = torch.tensor(self.old, dtype=torch.long, device=device)
            pos = old[:, None] + torch.arange(S, device=device)  # (B, S)
            valid = torch.arange(S, device=device)[None, :] < torch.tensor(self.n, device=device)[:, None]
            local = pos // bs + torch.tensor(base, dtype=torch.long, device=device)[:, None]
            cover_t = torch.tensor(cover, dtype=torch.long, device=device)
            if bool(valid.all()):
                return cover_t[local.reshape(-1)] * bs + pos.reshape(-1) % bs, None
            src = torch.arange(B * S, device=device).view(B, S)[valid]
            return cover_t[local[valid]] * bs + pos[valid] % bs, src
        return self._memo(("write", device), build)

    def plan(self, device, sizes: tuple[int, int, int]) -> _pa.Plan:
        def build():
            runs = [[tuple(r) for r in self.alloc._seqs[sid].runs] for sid in self.batch]
            return _pa.build_plan(runs, self.old, self.new, self.S, self.alloc.block_size, min_view_rows=sizes[0],
                                  max_piece_rows=sizes[1], group_rows=sizes[2], device=device)
        return self._memo(("plan", device, sizes), build)

    def table(self, device) -> Tensor:
        """(B, blocks of the longest sequence) block table padded with block 0 (masked anyway)."""
        return self._memo(("table", device), lambda: self.alloc.block_table(self.batch, pad=0, device=device))


class PagedKVCache(KVCache):
    """One layer's K/V pages, following a :class:`BlockAllocator`'s block tables.

    Args:
        kv_heads, head_dim, v_head_dim: Hkv, D, Dv (default D).
        num_blocks, block_size: the pool, when this cache makes its own allocator (block_size
            defaults to 16). With ``allocator=`` they may be left out (or must match it).
        allocator: a :class:`BlockAllocator` shared by the layers of a model.
        prefix_caching: for the allocator this cache makes.
        value_from_key: store K only; V is its first ``v_head_dim`` channels (MLA's latent
            cache: kv_heads=1, head_dim = kv_lora_rank + rope dim, v_head_dim = kv_lora_rank).
        dtype, device: of the pools.

    Batch rows are sequences of the allocator: ``set_batch(seq_ids)`` names them; a fresh cache
    creates them on its first ``update`` (ids 0..B-1 in a fresh allocator). ``lengths``,
    ``positions``, ``update`` and ``attend`` then work as in every cache: ragged batches
    (``num_new``), multi-token steps (speculative verification), chunked prefill.

    ``attend`` is the fast path: attention over the pages in place (no (B, max_len) copy), for
    MHA/GQA/MQA and V-from-K (MLA absorbed) alike; see :mod:`attnkit.caches._paged_attention`.
    On CUDA, steps of at most 16 tokens per sequence run in the fused Triton kernel
    (:mod:`attnkit.backends.triton.decode`; ``backend="triton"`` forces it, on CPU under
    ``TRITON_INTERPRET=1``). With an extra ``mask``, ``dropout_p > 0``, ``return_weights``, another
    forced ``backend`` or gradients required it falls back to ``update`` + :func:`attnkit.attention`. ``update``
    returns contiguous (B, Hkv, max_len, ·) copies gathered from the pages (the slow path, for
    callers that need plain tensors, e.g. MLA's naive prefill).

    ``reorder(indices)`` forks (beam search shares blocks, nothing is copied) and frees the
    rows not chosen; ``crop(n)`` returns whole blocks that fall off; ``reset()`` frees the
    batch's sequences (sequences outside the batch, e.g. a shared prompt kept for forking, stay).
    ``nbytes`` is the pools' capacity; ``nbytes_used`` the blocks in use. Eager only (shapes
    follow the batch's lengths).
    """

    def __init__(self, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                 num_blocks: int | None = None, block_size: int | None = None,
                 allocator: BlockAllocator | None = None, prefix_caching: bool = False,
                 value_from_key: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(kv_heads, head_dim, v_head_dim, value_from_key=value_from_key, dtype=dtype, device=device)
        # Lengths are the allocator's (shared by the layers); see the ``lengths`` property.
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
        N, bs = allocator.num_blocks, allocator.block_size
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("k_pool", torch.zeros(N, bs, kv_heads, head_dim, **kw), persistent=False)
        self.register_buffer("v_pool", torch.zeros(0 if value_from_key else N, bs, kv_heads, self.v_head_dim, **kw),
                             persistent=False)
        self._epoch = allocator._epoch
        allocator._caches.add(self)

    # ---------------------------------------------------------------- state

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens each batch row holds, as this layer sees them (before its own update of a
        step that an earlier layer opened)."""
        if "allocator" not in self.__dict__:
            raise AttributeError("lengths")  # during __init__ (nn.Module probes attribute names)
        a = self.allocator
        if max(self._epoch, a._floor) == a._epoch - 1 and a._last is not None:
            host = a._last.lengths_before
        else:
            host = [a._seqs[s].length for s in a._batch]
        return torch.tensor(host, dtype=torch.long, device=self.k_pool.device)

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
        return (f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"blocks={a.num_blocks}x{a.block_size}, used={a.num_used}, value_from_key={self.value_from_key}")

    def _flat(self) -> tuple[Tensor, Tensor | None]:
        """The pools by token slot: (N * bs, Hkv, D) and (N * bs, Hkv, Dv) (None: V from K)."""
        k = self.k_pool.flatten(0, 1)
        return k, (None if self.value_from_key else self.v_pool.flatten(0, 1))

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long, device=self.k_pool.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.k_pool.device)
        for pool in (self.k_pool, self.v_pool):
            if pool.numel():
                pool.index_copy_(0, d, pool.index_select(0, s))

    # ---------------------------------------------------------------- layers in step

    def _join(self, key: tuple) -> _Op | None:
        """The allocator's last op if this layer has not taken part in it and it is this same
        call (join it); None if this layer is in step (its call opens a new op)."""
        a = self.allocator
        mine = max(self._epoch, a._floor)
        if mine == a._epoch:
            return None
        if mine == a._epoch - 1 and a._last is not None and a._last.key == key:
            self._epoch = a._epoch
            return a._last
        self._out_of_step(key[0] + str(key[1:]))

    def _out_of_step(self, call: str):
        a = self.allocator
        behind = a._epoch - max(self._epoch, a._floor)
        last = "a direct allocator call" if a._last is None else a._last.key[0] + str(a._last.key[1:])
        raise RuntimeError(f"this layer's cache is out of step with the others sharing its allocator: it calls "
                           f"{call}, {behind} op(s) behind, and the last op was {last}. Layers sharing an "
                           f"allocator must see the same update/attend/reorder/crop calls in the same order; "
                           f"reset() every layer to start over")

    def _check_in_step(self, call: str) -> None:
        """Raise unless this layer is in step or exactly one op behind (so it can join)."""
        a = self.allocator
        mine = max(self._epoch, a._floor)
        if mine < a._epoch - 1 or (mine == a._epoch - 1 and a._last is None):
            self._out_of_step(call)

    def _opened(self, op: _Op) -> None:
        a = self.allocator
        a._epoch += 1
        a._last = op
        self._epoch = a._epoch

    # ---------------------------------------------------------------- update

    def _check_q(self, q: Tensor, k: Tensor) -> None:
        if not isinstance(q, Tensor) or q.dim() != 4:
            raise ValueError(f"q must be (B, Hq, S, D), got shape {tuple(getattr(q, 'shape', ()))}")
        if not isinstance(k, Tensor) or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(getattr(k, 'shape', ()))} must share the batch and "
                             f"the number of new tokens")
        if q.shape[3] != self.head_dim:
            raise ValueError(f"q has head dim {q.shape[3]} (shape {tuple(q.shape)}), the cache {self.head_dim}")
        if q.shape[1] % self.kv_heads:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of the cache's KV heads ({self.kv_heads})")
        if q.dtype != self.dtype:
            raise TypeError(f"q dtype {q.dtype} differs from the cache's {self.dtype}")
        if q.device != self.k_pool.device:
            raise ValueError(f"q is on {q.device} (shape {tuple(q.shape)}) but the cache's pools are on "
                             f"{self.k_pool.device}")

    def _step(self, k: Tensor, v: Tensor | None, num_new) -> _Step:
        """Write this layer's new K/V, opening the step (allocation) or joining it."""
        self._check_in_step("update")
        n = self._check_new(k, v, num_new)
        if k.device != self.k_pool.device:
            raise ValueError(f"k is on {k.device} but the cache's pools are on {self.k_pool.device}")
        B, _, S, _ = k.shape
        a = self.allocator
        if a._batch and len(a._batch) != B:
            raise ValueError(f"k has batch {B} but the cache's batch holds {len(a._batch)} sequences "
                             f"{list(a._batch)}; set_batch(), reorder() or reset() it first")
        n_host = n.tolist()
        key = ("update", B, S, tuple(n_host))
        op = self._join(key)
        if op is None:
            op = _Op(key, [a._seqs[s].length for s in a._batch], self._open_update(B, S, n_host))
            self._opened(op)
        step = op.step
        slots, src = step.write_index(k.device)
        for pool, t in ((self.k_pool, k), (self.v_pool, v)):
            if pool.numel() == 0:
                continue
            rows = t.transpose(1, 2).reshape(B * S, *t.shape[1:2], t.shape[3])  # (B * S, Hkv, ·)
            if src is not None:
                rows = rows.index_select(0, src)
            pool.flatten(0, 1).index_copy_(0, slots, rows)
        return step

    def _open_update(self, B: int, S: int, n: list[int]) -> _Step:
        a = self.allocator
        if a._batch:
            ids, seqs = a._batch, [a._seqs[s] for s in a._batch]
        else:  # a fresh batch: new sequences, registered only once their blocks are granted
            ids, seqs = None, [_Seq() for _ in range(B)]
        old = [s.length for s in seqs]
        a._grow(list(zip(seqs, n)), f"writing {sum(n)} tokens for a batch of {B}")
        if ids is None:
            ids = tuple(a.add_sequence() for _ in range(B))
            for sid, seq in zip(ids, seqs):
                a._seqs[sid] = seq
            a._batch = ids
        return _Step(a, ids, old, n, S)

    def update(self, k: Tensor, v: Tensor | None, *, num_new=None):
        """Append k (B, Hkv, S, D), v (B, Hkv, S, Dv) (None with ``value_from_key``) to the
        batch's sequences; returns contiguous copies (B, Hkv, L, D), (B, Hkv, L, Dv) gathered
        from the pages (L: the longest sequence) and the cache mask. Prefer ``attend``."""
        step = self._step(k, v, num_new)
        L = max(step.new, default=0)
        table = step.table(self.k_pool.device)  # (B, nblk)

        def gather(pool: Tensor) -> Tensor:  # (B, nblk, bs, Hkv, ·) -> (B, Hkv, L, ·)
            return pool[table].flatten(1, 2)[:, :L].transpose(1, 2)

        k_all = gather(self.k_pool)
        v_all = k_all[..., :self.v_head_dim] if self.value_from_key else gather(self.v_pool)
        dev = self.k_pool.device
        old = torch.tensor(step.old, dtype=torch.long, device=dev)
        new = torch.tensor(step.new, dtype=torch.long, device=dev)
        return k_all, v_all, self._mask(old, new)

    def attend(self, q: Tensor, k: Tensor, v: Tensor | None, mask=None, *, num_new=None, scale: float | None = None,
               dropout_p: float = 0.0, backend: str = "auto", return_weights: bool = False):
        """Append k, v and attend q (B, Hq, S, D) over each sequence's pages; (B, Hq, S, Dv)."""
        needs_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v))
        fused = self._fused_kernel(q, backend)
        if mask is not None or dropout_p or return_weights or backend not in ("auto", fused) or needs_grad:
            return super().attend(q, k, v, mask, num_new=num_new, scale=scale, dropout_p=dropout_p,
                                  backend=backend, return_weights=return_weights)
        self._check_q(q, k)
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"scale must be a finite float or None, got {scale!r}")
        step = self._step(k, v, num_new)
        if fused == "triton":
            from ..backends.triton.decode import paged_decode_attention

            dev = q.device
            return paged_decode_attention(
                q, self.k_pool, None if self.value_from_key else self.v_pool, step.table(dev),
                torch.tensor(step.new, device=dev), q_start=torch.tensor(step.old, device=dev), scale=float(scale),
                v_head_dim=self.v_head_dim, max_len=max(step.new, default=0), check=False)  # built on the host
        kf, vf = self._flat()
        G = q.shape[1] // self.kv_heads
        token_bytes = self.bytes_per_token
        convert = self.dtype not in (torch.float32, torch.float64)
        sizes = _pa.piece_sizes(token_bytes, self.kv_heads, self.head_dim, G * q.shape[2], convert)
        plan = step.plan(q.device, sizes)
        with torch.no_grad():
            return _pa.paged_attention(q, kf, vf, plan, float(scale), v_head_dim=self.v_head_dim)

    def _fused_kernel(self, q, backend: str) -> str | None:
        """"triton" when this step's attention runs in the fused Triton paged-decode kernel: on
        CUDA by default (the plain-torch path is tuned for CPUs), or forced with
        ``backend="triton"`` (on CPU under ``TRITON_INTERPRET=1``: how the tests reach it)."""
        from ..backends import get_backend
        from ..backends.triton import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, interpreting

        if backend not in ("auto", "triton") or not isinstance(q, Tensor) or q.dim() != 4 or q.shape[2] > MAX_Q_LEN:
            return None
        if backend == "auto" and q.device.type != "cuda":
            return None
        ok = (get_backend("triton").available() is None
              and (q.device.type == "cuda" or (q.device.type == "cpu" and interpreting()))
              and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
              and self.head_dim <= MAX_HEAD_DIM and self.v_head_dim <= MAX_V_HEAD_DIM)
        return "triton" if ok else None

    # ---------------------------------------------------------------- editing

    def reset(self) -> None:
        """Free the batch's sequences and forget the batch; every layer sharing the allocator
        is back in step."""
        a = self.allocator
        a._reset_batch()
        a._last = None
        a._floor = a._epoch
        self._epoch = a._epoch

    def crop(self, n) -> None:
        """Keep the first ``n`` tokens of each row (int or (B,) tensor); a negative int drops
        ``-n`` tokens from the end (rejected speculative tokens). Whole blocks past the kept
        tokens return to the pool."""
        t = torch.as_tensor(n)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 1:
            raise ValueError(f"n must be an int or a (B,) int tensor, got {t.dtype} of shape {tuple(t.shape)}")
        key = ("crop", t.tolist() if t.dim() else int(t))
        if self._join(key) is not None:
            return
        a = self.allocator
        lengths = [a._seqs[s].length for s in a._batch]
        if t.dim() == 0:
            keep = [x + int(t) for x in lengths] if int(t) < 0 else [int(t)] * len(lengths)
        else:
            if t.shape[0] != len(lengths):
                raise ValueError(f"n has {t.shape[0]} entries for a batch of {len(lengths)}")
            keep = t.tolist()
        if any(x < 0 for x in keep):
            raise ValueError(f"crop({key[1]}) would leave a negative length: lengths {lengths}")
        for sid, kp in zip(a._batch, keep):
            a._crop(a._seqs[sid], kp)
        self._opened(_Op(key, lengths))

    def reorder(self, indices) -> None:
        """New row i continues old row ``indices[i]`` (beam search). Repeated rows fork (blocks
        shared, copy-on-write later); rows not chosen are freed."""
        idx = torch.as_tensor(indices)
        a = self.allocator
        if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1:
            raise ValueError(f"indices must be a 1-D int tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
        key = ("reorder", tuple(idx.tolist()))
        if self._join(key) is not None:
            return
        B = len(a._batch)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= B):
            raise ValueError(f"indices {idx.tolist()} out of range for {B} sequences")
        lengths = [a._seqs[s].length for s in a._batch]
        a._reorder(list(key[1]))
        self._opened(_Op(key, lengths))

    def _reorder_buffers(self, idx: Tensor) -> None:  # reorder() is overridden; nothing to move
        raise NotImplementedError
