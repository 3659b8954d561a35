"""Block bookkeeping for paged KV caches: sequences, block tables, copy-on-write forks, prefix
caching, and the explicit step one forward appends (:class:`PagedStep`).

Notation: N blocks, bs tokens per block, B batch rows, S new tokens per row this step. A *slot* is
``block * bs + offset``: the row of one token in a pool (N, bs, ...) viewed as (N * bs, ...).

A forward over paged caches is a transaction on the allocator: :meth:`BlockAllocator.begin_step`
validates the step and *reserves* the blocks it needs (nothing a sequence holds changes), every
layer writes its K/V into the step's slots (reserved blocks, or copies of shared blocks: never a
block another sequence reads), and :meth:`~BlockAllocator.commit` makes the step the sequences'
new state, or :meth:`~BlockAllocator.abort` forgets it. So a forward that raises in any layer
leaves every sequence, refcount and free count exactly as before.
"""

from __future__ import annotations

import heapq
import operator
import warnings
import weakref
from collections import OrderedDict
from typing import Iterable, Protocol

import torch
from torch import Tensor

from .protocol import CacheStep

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedPools", "PagedStep"]

#: How many freed sequence ids are remembered to report a double free (older ones read "unknown").
_FREED_MEMORY = 4096


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


class PagedPools(Protocol):
    """What the allocator asks of a layer's pools it holds (:meth:`BlockAllocator.attach`);
    :class:`~attnkit.caches.PagedKVCache` is one."""

    def copy_on_write(self, step: "PagedStep") -> None:
        """Copy the step's shared blocks (``step.cow`` pairs) into their private copies, once per step."""

    def erase(self, step: "PagedStep") -> None:
        """Zero the pool rows this layer wrote in ``step`` (an aborted step)."""


class _Seq:
    """One sequence: its blocks (in position order), its length, the token ids confirmed for its
    first positions (prefix caching) and the chain hashes of its leading full blocks."""

    __slots__ = ("blocks", "length", "tokens", "keys")

    def __init__(self):
        self.blocks: list[int] = []
        self.length = 0
        self.tokens: list[int] = []  # ids of positions 0 .. len(tokens) - 1 (len(tokens) <= length)
        self.keys: list[int] = []

    def copy(self) -> "_Seq":
        s = _Seq()
        s.blocks, s.length, s.tokens, s.keys = list(self.blocks), self.length, list(self.tokens), list(self.keys)
        return s


class PagedStep(CacheStep):
    """One forward's appends to the sequences of a :class:`BlockAllocator`, shared by every layer
    cache of that allocator. Built by :meth:`BlockAllocator.begin_step`; nothing a sequence holds
    changes until :meth:`BlockAllocator.commit`.

    Beyond :class:`~attnkit.caches.CacheStep` (``q_start``, ``num_new``, ``new`` lengths,
    ``tokens`` S): ``seq_ids`` (the rows' sequences; None for a fresh batch, created at commit),
    ``blocks`` (each row's block list after the step), ``cow`` ((shared block, private copy)
    pairs each layer copies before writing), ``slots`` (T,) and ``src`` (T,) (pool slot of each
    valid new token and its row in the step's B * S tokens; ``src`` None when all are valid).
    ``uncache``: prefix-cached blocks the step writes over (free cached blocks it reserved, a
    cropped sequence's cached partial block it appends into), still registered until commit so
    an abort leaves the prefix cache as it was.
    """

    def __init__(self, alloc: "BlockAllocator", seq_ids, q_start: list[int], n: list[int], S: int,
                 blocks: list[list[int]], cow: list[tuple[int, int]], taken: list[int], token_ids,
                 base: Tensor | None = None, first_changed: list[int] | None = None,
                 uncache: list[int] | None = None):
        bs, B = alloc.block_size, len(q_start)
        slots, src = [], []
        for b, (o, k, blks) in enumerate(zip(q_start, n, blocks)):
            for j in range(k):
                p = o + j
                slots.append(blks[p // bs] * bs + p % bs)
                src.append(b * S + j)
        dense = len(src) == B * S
        new = [o + k for o, k in zip(q_start, n)]
        # one host-to-tensor conversion and one split for the small vectors:
        # [q_start | num_new | new | slots | src]
        T = len(slots)
        src = [] if dense else src
        packed = torch.tensor(q_start + n + new + slots + src, dtype=torch.long)
        start_t, n_t, new_t, self.slots, src_t = packed.split_with_sizes((B, B, B, T, len(src)))
        super().__init__(start_t, n_t, S, q_start_host=q_start, num_new_host=n, new=new_t)
        self.alloc, self.seq_ids, self.blocks, self.cow, self.taken = alloc, seq_ids, blocks, cow, taken
        self.uncache = [] if uncache is None else uncache
        self.token_ids = token_ids
        self.copied: set[int] = set()  # ids of the layer caches that made their CoW copies
        self.src = None if dense else src_t
        width = max((len(x) for x in blocks), default=0)
        if base is None:  # (B, W); entries past a row's last block are 0 (never read)
            self.table = torch.tensor([x + [0] * (width - len(x)) for x in blocks],
                                      dtype=torch.long).view(len(blocks), width)
        else:  # the committed table of the same rows, with the entries this step changes
            at = [(b, i, x[i]) for b, (x, f) in enumerate(zip(blocks, first_changed)) for i in range(f, len(x))]
            if not at and width == base.shape[1]:
                self.table = base  # unchanged (most decode steps): shared, never written in place
            else:
                self.table = torch.zeros(len(blocks), width, dtype=torch.long)
                w = min(width, base.shape[1])
                self.table[:, :w] = base[:, :w]
                if at:
                    rows, cols, ids = torch.tensor(at, dtype=torch.long).unbind(1)
                    self.table[rows, cols] = ids
        self._on: dict = {}

    def on(self, device) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
        """(table, slots, src, q_start, new) on ``device`` (copied once per device)."""
        got = self._on.get(device)
        if got is None:
            host = (self.table, self.slots, self.src, self.q_start, self.new)
            # built on the CPU: a CPU cache takes them as they are (no five no-op copies per step)
            got = self._on[device] = host if device.type == "cpu" else tuple(
                None if t is None else t.to(device) for t in host)
        return got


class BlockAllocator:
    """Blocks of ``block_size`` token slots, ``num_blocks`` of them, shared by sequences.

    Args:
        num_blocks: N, the pool's capacity in blocks (each layer's pool has N blocks).
        block_size: bs, tokens per block.
        prefix_caching: reuse identical full blocks across sequences. A block's identity is its
            token ids and the hash of everything before it (vLLM's hash chain); sequences
            created with ``add_sequence(token_ids=...)`` start with the cached blocks of their
            longest cached prefix. A block is registered only under ids confirmed for what was
            written into it (the ``token_ids`` of the step that wrote it, or :meth:`confirm_tokens`),
            never under ids merely declared. Freed cached blocks are kept (and still reusable)
            until the pool needs them, least recently freed first.

    Sequences are named by int ids. Errors: unknown or freed ids raise KeyError (a double free
    says so), bad arguments ValueError / TypeError, a full pool :class:`OutOfBlocks`; none of
    them changes anything. While a step is open (:meth:`begin_step`) every other change raises.
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
        self._freed: OrderedDict[int, None] = OrderedDict()  # the last _FREED_MEMORY freed ids
        self._next_id = 0
        self._cached: dict[tuple, int] = {}  # (parent chain hash, token ids) -> block
        self._block_key: dict[int, tuple] = {}
        self._pools: weakref.WeakSet = weakref.WeakSet()  # attached layer pools (see attach())
        self._batch: tuple[int, ...] = ()
        self._open: PagedStep | None = None
        # The last committed step's block table, reused by the next step of the same batch when
        # nothing changed in between (_version counts every other change).
        self._version = 0
        self._table: tuple[tuple, Tensor] | None = None

    # ---------------------------------------------------------------- state

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached-but-free blocks included: they are reusable)."""
        return len(self._clean) + len(self._evictable) + (len(self._open.taken) if self._open else 0)

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
        """Sequence ids of the rows of the next forward (empty: the next step creates them)."""
        return self._batch

    @property
    def open_step(self) -> PagedStep | None:
        """The step begun and not yet committed or aborted, if any."""
        return self._open

    @property
    def num_attached(self) -> int:
        """How many live layer pools share this allocator (see :meth:`attach`)."""
        return len(self._pools)

    @property
    def attached(self) -> tuple["PagedPools", ...]:
        """The live layer pools sharing this allocator (see :meth:`attach`)."""
        return tuple(self._pools)

    def attach(self, pools: "PagedPools") -> None:
        """Register a layer's pools: at commit they make the step's copy-on-write copies even if
        they did not write this step, and at abort the ones that wrote erase what they wrote.
        Held weakly: a dropped cache detaches itself."""
        self._pools.add(pools)

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

    def lengths(self, seq_ids: Iterable[int] | None = None, *, device=None) -> Tensor:
        """(B,) long tensor of the sequences' lengths (default: the batch)."""
        return torch.tensor([self._get(s).length for s in (self._batch if seq_ids is None else seq_ids)],
                            dtype=torch.long, device=device)

    def context_lengths(self, seq_ids: Iterable[int] | None = None, *, device=None) -> Tensor:
        """Deprecated name of :meth:`lengths`."""
        warnings.warn("BlockAllocator.context_lengths() is deprecated; call .lengths()", DeprecationWarning,
                      stacklevel=2)
        return self.lengths(seq_ids, device=device)

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, used={self.num_used}, "
                f"sequences={len(self._seqs)}, prefix_caching={self.prefix_caching})")

    # ---------------------------------------------------------------- sequences

    def _closed(self, what: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"{what}: a step is open on this allocator (begun by a forward that has not "
                               f"finished); commit or abort it first")
        self._version += 1  # a change may follow: the committed table is no longer known to match

    def add_sequence(self, seq_id: int | None = None, *, token_ids=None) -> int:
        """A new empty sequence (id ``seq_id`` or the next free one); returns its id.

        ``token_ids``: the tokens it will hold (its prompt), for prefix caching. With
        ``prefix_caching``, the sequence starts with the cached full blocks of its longest cached
        prefix, at most ``len(token_ids) - 1`` tokens (the last token is always computed: its
        output gives the next token); ``length(id)`` says how many, and the caller feeds the
        tokens from there on. Never allocates (so never raises OutOfBlocks).
        """
        self._closed("add_sequence")
        if seq_id is None:
            while self._next_id in self._seqs:
                self._next_id += 1
            seq_id = self._next_id
        seq_id = _as_id(seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        seq = _Seq()
        tokens = [] if token_ids is None else _as_tokens(token_ids)
        if self.prefix_caching and tokens:
            bs, chain = self.block_size, None
            for i in range((len(tokens) - 1) // bs):
                key = (chain, tuple(tokens[i * bs:(i + 1) * bs]))
                blk = self._cached.get(key)
                if blk is None:
                    break
                if self._ref[blk] == 0:  # a freed cached block comes back
                    del self._evictable[blk]
                    self._used += 1
                self._ref[blk] += 1
                seq.blocks.append(blk)
                chain = hash(key)
                seq.keys.append(chain)
            seq.length = len(seq.blocks) * bs
            seq.tokens = tokens[:seq.length]  # confirmed: these blocks hold exactly these ids
        self._seqs[seq_id] = seq
        self._freed.pop(seq_id, None)
        self._next_id = max(self._next_id, seq_id + 1)
        return seq_id

    def append(self, seq_id: int, num_tokens: int | None = None, *, token_ids=None) -> Tensor:
        """Grow ``seq_id`` by ``num_tokens`` tokens (or ``len(token_ids)``, confirming their ids
        for prefix caching); new blocks on demand, copy-on-write of a shared partial last block
        (copied in every layer pool). Returns the new tokens' slots (num_tokens,) (long, CPU),
        where the caller writes them. Raises :class:`OutOfBlocks`, changing nothing."""
        ids = None if token_ids is None else _as_tokens(token_ids)
        if num_tokens is None:
            if ids is None:
                raise ValueError("append needs num_tokens or token_ids")
            num_tokens = len(ids)
        num_tokens = _as_count(num_tokens, "num_tokens", 0)
        if ids is not None and len(ids) != num_tokens:
            raise ValueError(f"token_ids has {len(ids)} ids but num_tokens is {num_tokens}")
        step = self.begin_step(1, num_tokens, seq_ids=[seq_id], token_ids=None if ids is None else [ids])
        self.commit(step)
        return step.slots

    def confirm_tokens(self, seq_id: int, token_ids) -> None:
        """Confirm the ids of tokens ``seq_id`` already holds, from the first unconfirmed position
        on (e.g. a prompt fed through a module call that carried no ids), so the full blocks
        they fill can be reused by prefix caching. The caller vouches that these are the tokens
        whose K/V were written at those positions."""
        self._closed("confirm_tokens")
        seq = self._get(seq_id)
        ids = _as_tokens(token_ids)
        if len(seq.tokens) + len(ids) > seq.length:
            raise ValueError(f"sequence {seq_id} holds {seq.length} tokens, {len(seq.tokens)} of them confirmed: "
                             f"{len(ids)} more ids would describe tokens it does not hold")
        seq.tokens.extend(ids)
        self._register(seq)

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
        self._closed("free")
        seq = self._get(seq_id)
        if seq_id in self._batch:
            raise ValueError(f"sequence {seq_id} is in the current batch {list(self._batch)}; set_batch() without it "
                             f"(or reorder/reset the caches) before freeing it")
        self._drop(seq_id, seq)

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` (no-op if it is shorter); whole blocks
        past them return to the pool. Token ids recorded past ``length`` are forgotten."""
        self._closed("crop")
        length = _as_count(length, "length", 0)
        self._crop(self._get(seq_id), length)

    def set_batch(self, seq_ids: Iterable[int]) -> None:
        """Make ``seq_ids`` (live, distinct) the rows of the next forward, in this order."""
        self._closed("set_batch")
        ids = tuple(_as_id(s, "seq_ids") for s in seq_ids)
        for s in ids:
            self._get(s)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {list(ids)}")
        self._batch = ids

    def reorder(self, indices: list[int]) -> None:
        """New batch row i continues old row ``indices[i]`` (beam search): repeated rows fork
        (blocks shared, copy-on-write later), rows not chosen are freed."""
        self._closed("reorder")
        B = len(self._batch)
        idx = [_as_id(i, "indices") for i in indices]
        if any(not 0 <= i < B for i in idx):
            raise ValueError(f"indices {idx} out of range for {B} sequences")
        old, kept, new = self._batch, set(), []
        for i in idx:
            sid = old[i]
            new.append(self.fork(sid) if sid in kept else sid)
            kept.add(sid)
        self._batch = tuple(new)
        for sid in old:
            if sid not in kept:
                self._drop(sid, self._seqs[sid])

    def reset_batch(self) -> None:
        """Free the batch's sequences and forget the batch (sequences outside it stay)."""
        self._closed("reset")
        batch, self._batch = self._batch, ()
        for sid in batch:
            self._drop(sid, self._seqs[sid])

    # ---------------------------------------------------------------- steps

    def begin_step(self, batch: int, tokens: int, num_new=None, *, seq_ids: Iterable[int] | None = None,
                   token_ids=None) -> PagedStep:
        """Plan one forward: row b of ``seq_ids`` (default: the batch; with no batch set, ``batch``
        new sequences created at commit) gains ``num_new[b]`` of the step's ``tokens`` tokens
        (default all). Reserves the blocks the step needs (copy-on-write included) or raises
        :class:`OutOfBlocks`; changes nothing a sequence holds. ``token_ids``: per row, the ids of
        its new tokens, confirmed for prefix caching at commit (rows without ids: None)."""
        known = self._table if self._table is not None and self._table[0] == (self._version, self._batch) else None
        self._closed("begin_step")
        batch, S = _as_count(batch, "batch", 0), _as_count(tokens, "tokens", 0)
        ids = self._batch if seq_ids is None else tuple(_as_id(s, "seq_ids") for s in seq_ids)
        if ids:
            if len(ids) != batch:
                raise ValueError(f"the step has a batch of {batch} but the allocator's batch holds {len(ids)} "
                                 f"sequences {list(ids)}; set_batch(), reorder() or reset() first")
            seqs = [self._get(s) for s in ids]
        else:
            ids, seqs = None, [_Seq() for _ in range(batch)]
        if num_new is None:
            n = [S] * batch
        else:
            t = torch.as_tensor(num_new)
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.shape not in ((batch,), ()):
                raise ValueError(f"num_new must be an int or a (B,) int tensor with B={batch}, got {t.dtype} of shape "
                                 f"{tuple(t.shape)}")
            n = t.expand(batch).tolist()
            if any(x < 0 or x > S for x in n):
                raise ValueError(f"num_new must be in [0, S={S}], got {n}")
        tok = None
        if token_ids is not None:
            if len(token_ids) != batch:
                raise ValueError(f"token_ids has {len(token_ids)} rows for a batch of {batch}")
            tok = [None if r is None else _as_tokens(r) for r in token_ids]
            for b, (r, k) in enumerate(zip(tok, n)):
                if r is not None and len(r) != k:
                    raise ValueError(f"token_ids row {b} has {len(r)} ids but the row gains {k} tokens")
        need = self._needed(list(zip(seqs, n)))
        if need > self.num_free:
            raise OutOfBlocks(need, self.num_free, self.num_blocks, f"writing {sum(n)} tokens for a batch of {batch}")
        bs, dropped, cow, taken, plans, first, uncache = self.block_size, {}, [], [], [], [], []
        for seq, k in zip(seqs, n):
            # The sequence's own list while the step changes nothing in it (most decode steps):
            # a copy of a long table per row per step is what this saves; commit assigns it back.
            blocks = seq.blocks
            first.append(len(blocks))  # the first table entry this step changes
            if k > 0 and seq.length % bs:
                last = blocks[-1]
                if self._ref[last] - dropped.get(last, 0) > 1:  # shared partial block: write a private copy
                    dropped[last] = dropped.get(last, 0) + 1
                    blocks = list(blocks)
                    blocks[-1] = self._reserve(taken, uncache)
                    cow.append((last, blocks[-1]))
                    first[-1] -= 1
                elif last in self._block_key:  # a cached block cropped into: its content will change
                    uncache.append(last)
            if len(blocks) * bs < seq.length + k:
                blocks = list(blocks) if blocks is seq.blocks else blocks
                while len(blocks) * bs < seq.length + k:
                    blocks.append(self._reserve(taken, uncache))
            plans.append(blocks)
        base = known[1] if known is not None and seq_ids is None and ids is not None else None
        step = PagedStep(self, ids, [s.length for s in seqs], n, S, plans, cow, taken, tok, base, first, uncache)
        self._open = step
        return step

    def commit(self, step: PagedStep) -> None:
        """Make ``step`` the sequences' state: blocks, lengths, confirmed token ids, refcounts."""
        self._check_open(step, "commit")
        if step.cow:
            for pools in list(self._pools):  # pools that did not write this step still need the copies
                pools.copy_on_write(step)
        for blk in step.uncache:  # written over: no longer the blocks their ids describe
            del self._cached[self._block_key.pop(blk)]
        for blk in step.taken:
            self._ref[blk] = 1
        self._used += len(step.taken)
        for src, _ in step.cow:
            self._ref[src] -= 1  # still >= 1: another sequence holds it
        ids = step.seq_ids
        if ids is None:  # a fresh batch: its sequences exist from now on
            self._open = None
            ids = tuple(self.add_sequence() for _ in step.blocks)
            self._batch = ids
        for b, sid in enumerate(ids):
            seq = self._seqs[sid]
            held = seq.length  # tokens before this step
            seq.blocks, seq.length = step.blocks[b], step.new_host[b]
            written = None if step.token_ids is None else step.token_ids[b]
            if written is not None and len(seq.tokens) == held:
                seq.tokens.extend(written)
            elif step.num_new_host[b]:
                del seq.tokens[min(len(seq.tokens), held):]  # unconfirmed positions: nothing to register
            self._register(seq)
        self._open = None
        self._table = ((self._version, self._batch), step.table) if ids == self._batch else None

    def abort(self, step: PagedStep) -> None:
        """Forget ``step``: its reserved blocks go back to the pool as they were (cached free
        blocks still cached, at their place in the eviction order), the pool rows the layers
        wrote are zeroed (never left holding K/V, NaN included, that a backend reading masked
        rows could multiply by 0); nothing else changed."""
        self._check_open(step, "abort")
        for pools in list(self._pools):
            if id(pools) in step.writers:
                pools.erase(step)
        reused = set(step.uncache)
        for blk in reversed(step.taken):  # reversed: the least recently freed goes back first in line
            if blk in reused:
                self._evictable[blk] = None
                self._evictable.move_to_end(blk, last=False)
            else:
                heapq.heappush(self._clean, blk)
        self._open = None

    def _check_open(self, step: PagedStep, what: str) -> None:
        if self._open is not step:
            raise RuntimeError(f"{what}: this step is not the allocator's open step (already committed or "
                               f"aborted, or begun on another allocator)")

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

    def _reserve(self, taken: list[int], uncache: list[int]) -> int:
        """A free block for an open step (fresh first; else the least recently freed cached one,
        which stops being cached when the step commits: the step writes over it)."""
        if self._clean:
            blk = heapq.heappop(self._clean)
        else:
            blk, _ = self._evictable.popitem(last=False)
            uncache.append(blk)
        taken.append(blk)
        return blk

    def _release(self, blk: int) -> None:
        self._ref[blk] -= 1
        if self._ref[blk] == 0:
            self._used -= 1
            if blk in self._block_key:
                self._evictable[blk] = None
            else:
                heapq.heappush(self._clean, blk)

    def _drop(self, seq_id: int, seq: _Seq) -> None:
        for blk in reversed(seq.blocks):  # tail first: a prefix's first blocks stay cached longest
            self._release(blk)
        del self._seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    def _needed(self, items: list[tuple[_Seq, int]]) -> int:
        """Blocks a step appending n tokens to each (seq, n) takes, copy-on-write included (exact:
        two rows appending to the same shared block copy it once each)."""
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

    def _crop(self, seq: _Seq, keep: int) -> None:
        if keep >= seq.length:
            return
        bs = self.block_size
        while len(seq.blocks) * bs >= keep + bs:
            self._release(seq.blocks.pop())
        seq.length = keep
        del seq.tokens[keep:]
        del seq.keys[keep // bs:]

    def _register(self, seq: _Seq) -> None:
        """Register the sequence's newly full blocks whose token ids are confirmed."""
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
