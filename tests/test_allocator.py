"""The block allocator of the paged caches: its bookkeeping as a hypothesis state machine and a
10,000-operation soak against a shadow model (free + used == capacity, refcounts match the
sharing, every live token readable where its block table says), block tables and lengths,
argument errors, and the committed table consecutive steps reuse."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import attnkit
from attnkit.caches import BlockAllocator, DynamicCache, OutOfBlocks, PagedKVCache


def test_freed_ids_are_remembered_for_a_while_not_forever():
    alloc = BlockAllocator(4, 2)
    for _ in range(10_000):
        alloc.free(alloc.add_sequence())
    assert len(alloc._freed) <= 4096  # bookkeeping does not grow with the requests ever served
    s = alloc.add_sequence()
    alloc.free(s)
    with pytest.raises(KeyError, match="already freed"):
        alloc.free(s)


# --------------------------------------------------------------------------- allocator errors and tensors


def test_block_table_and_lengths():
    alloc = BlockAllocator(10, 3)
    a, b = alloc.add_sequence(), alloc.add_sequence(7)
    assert alloc.append(a, 4).tolist() == [0, 1, 2, 3]
    assert alloc.append(b, 2).tolist() == [6, 7]
    assert alloc.append(a, 3).tolist() == [4, 5, 9]
    alloc.set_batch([b, a])
    assert alloc.block_table().tolist() == [[2, -1, -1], [0, 1, 3]]
    assert alloc.block_table([a], pad=0).tolist() == [[0, 1, 3]]
    assert alloc.lengths().tolist() == [2, 7]
    assert alloc.block_table([]).shape == (0, 0)


@pytest.mark.parametrize("call, exc, text", [
    (lambda a: a.free(99), KeyError, "unknown sequence id 99"),
    (lambda a: (a.free(0), a.free(0)), KeyError, "already freed"),
    (lambda a: a.append(5, 1), KeyError, "unknown sequence id 5"),
    (lambda a: a.fork(7), KeyError, "unknown"),
    (lambda a: a.add_sequence(0), ValueError, "already exists"),
    (lambda a: a.append(0, -1), ValueError, "num_tokens"),
    (lambda a: a.append(0), ValueError, "num_tokens or token_ids"),
    (lambda a: a.append(0, 2, token_ids=[1]), ValueError, "token_ids has 1"),
    (lambda a: a.crop(0, -1), ValueError, "length"),
    (lambda a: a.set_batch([0, 0]), ValueError, "distinct"),
    (lambda a: (a.set_batch([0]), a.free(0)), ValueError, "in the current batch"),
    (lambda a: a.free("0"), TypeError, "must be an int"),
    (lambda a: a.add_sequence(token_ids=[1.5]), TypeError, "token_ids"),
    (lambda a: a.refcount(8), ValueError, "out of range"),
    (lambda a: a.append(0, 100), OutOfBlocks, "needs 25 free blocks but the pool has 8 of 8"),
    (lambda a: BlockAllocator(0, 4), ValueError, "num_blocks"),
    (lambda a: BlockAllocator(4, 0), ValueError, "block_size"),
    (lambda a: PagedKVCache(1, 4), ValueError, "num_blocks"),
    (lambda a: PagedKVCache(1, 4, allocator=a, block_size=8), ValueError, "block_size=8"),
    (lambda a: PagedKVCache(1, 4, allocator=a, prefix_caching=True), ValueError, "prefix_caching"),
    (lambda a: PagedKVCache(1, 4, allocator="a"), TypeError, "BlockAllocator"),
])
def test_bad_allocator_calls(call, exc, text):
    alloc = BlockAllocator(8, 4)
    alloc.add_sequence()
    with pytest.raises(exc, match=text):
        call(alloc)


# --------------------------------------------------------------------------- state machine + soak


class Harness:
    """A BlockAllocator with one value-from-key layer (one float per token: its token id) and a
    shadow model: each live sequence's tokens as a list. Operations through the public API."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool, seed: int):
        self.alloc = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cache = PagedKVCache(1, 1, allocator=self.alloc, value_from_key=True, dtype=torch.float64)
        self.shadow: dict[int, list[int]] = {}
        self.pending: dict[int, list[int]] = {}
        self.events: collections.Counter = collections.Counter()  # what the run exercised
        self.rng = random.Random(seed)

    def needed(self, sids, ns) -> tuple[int, int]:
        """(blocks, copies-on-write) an append of ns[i] tokens to each sids[i] needs, from the
        public state."""
        bs, need, dropped, cows = self.alloc.block_size, 0, {}, 0
        for s, n in zip(sids, ns):
            if n == 0:
                continue
            length, blocks = self.alloc.length(s), self.alloc.blocks(s)
            if length % bs and self.alloc.refcount(blocks[-1]) - dropped.get(blocks[-1], 0) > 1:
                cows += 1
                need += 1
                dropped[blocks[-1]] = dropped.get(blocks[-1], 0) + 1
            need += math.ceil((length + n) / bs) - len(blocks)
        return need, cows

    def snapshot(self):
        a = self.alloc
        return (a.num_free, [a.refcount(b) for b in range(a.num_blocks)],
                {s: (a.length(s), a.blocks(s)) for s in a.sequences}, self.cache.k_pool.clone(), a.batch)

    def add(self, tokens: list[int] | None) -> int:
        sid = self.alloc.add_sequence(token_ids=tokens)
        n = self.alloc.length(sid)
        assert n == 0 or self.alloc.prefix_caching
        self.events["prefix hit"] += n > 0
        self.shadow[sid] = list(tokens[:n]) if tokens else []
        self.pending[sid] = list(tokens[n:]) if tokens else []  # declared, written next
        return sid

    def append(self, sids: list[int], ns: list[int]) -> bool:
        """Write the next ns[i] tokens of each sequence (declared ones first) in one batched
        update; False if the pool was (correctly) too small, and then nothing changed."""
        tokens = [self.pending[s][:n] + [self.rng.randrange(6) for _ in range(n - len(self.pending[s][:n]))]
                  for s, n in zip(sids, ns)]
        need, cows = self.needed(sids, ns)
        k = torch.zeros(len(sids), 1, max(ns), 1, dtype=torch.float64)
        for i, t in enumerate(tokens):
            k[i, 0, :len(t), 0] = torch.tensor(t, dtype=torch.float64)
        self.cache.set_batch(sids)
        before = self.snapshot()
        try:
            if need > self.alloc.num_free:
                with pytest.raises(OutOfBlocks):
                    self.cache.update(k, None, num_new=torch.tensor(ns))
                after = self.snapshot()
                assert after[:3] == before[:3] and after[4] == before[4] and torch.equal(after[3], before[3])
                self.events["out of blocks"] += 1
                return False
            cached = self.alloc.num_cached_blocks
            with attnkit.caches.step([self.cache], batch=len(sids), tokens=max(ns), num_new=torch.tensor(ns),
                                     token_ids=tokens) as (c,):  # the ids written, confirmed
                c.update(k, None, num_new=torch.tensor(ns))
            self.events["eviction"] += self.alloc.num_cached_blocks < cached
            self.events["copy-on-write"] += cows
        finally:
            self.alloc.set_batch([])
        for s, n, t in zip(sids, ns, tokens):
            self.shadow[s].extend(t)
            del self.pending[s][:n]
        return True

    def fork(self, sid: int) -> int:
        child = self.alloc.fork(sid)
        self.shadow[child] = list(self.shadow[sid])
        self.pending[child] = []  # declared future tokens stay with the parent
        return child

    def free(self, sid: int) -> None:
        self.alloc.free(sid)
        del self.shadow[sid], self.pending[sid]
        with pytest.raises(KeyError, match="already freed"):
            self.alloc.free(sid)

    def crop(self, sid: int, keep: int) -> None:
        self.alloc.crop(sid, keep)
        if keep < len(self.shadow[sid]):
            del self.shadow[sid][keep:]
            self.pending[sid] = []  # the allocator forgets ids past the kept tokens

    def check(self) -> None:
        a, bs = self.alloc, self.alloc.block_size
        assert a.num_free + a.num_used == a.num_blocks
        counts = [0] * a.num_blocks
        for s in a.sequences:
            for b in a.blocks(s):
                counts[b] += 1
        assert [a.refcount(b) for b in range(a.num_blocks)] == counts  # shared <=> refcount > 1
        assert a.num_used == sum(c > 0 for c in counts)
        assert set(a.sequences) == set(self.shadow)
        pool = self.cache.k_pool.flatten()
        for s, toks in self.shadow.items():
            blocks = a.blocks(s)
            assert a.length(s) == len(toks) and len(blocks) == math.ceil(len(toks) / bs)
            if toks:
                slots = torch.tensor(blocks)[torch.arange(len(toks)) // bs] * bs + torch.arange(len(toks)) % bs
                assert pool[slots].tolist() == [float(t) for t in toks]

    def random_op(self) -> None:
        rng, live = self.rng, sorted(self.shadow)
        op = rng.choice(["add"] * 3 + ["append"] * 6 + ["fork"] * 2 + ["free"] * 6 + ["crop"] * 2 + ["exhaust"])
        if op == "add" or not live:
            prompt = None
            if rng.random() < 0.7:  # a shared "system prompt" with its own tail: prefix hits
                prompt = PROMPTS[rng.randrange(len(PROMPTS))][:rng.randrange(2, 9)]
                prompt += [rng.randrange(6) for _ in range(rng.randrange(4))]
            self.add(prompt)
        elif op == "append":
            sids = rng.sample(live, rng.randint(1, min(3, len(live))))
            self.append(sids, [rng.randint(0, 7) for _ in sids])
        elif op == "fork":
            self.fork(rng.choice(live))
        elif op == "free":
            self.free(rng.choice(live))
        elif op == "crop":
            s = rng.choice(live)
            self.crop(s, rng.randint(0, len(self.shadow[s])))
        else:
            s = rng.choice(live)
            assert not self.append([s], [self.alloc.num_free * self.alloc.block_size + self.alloc.block_size + 1])


PROMPTS = [[1, 2, 3, 4, 5, 0, 1, 2], [1, 2, 3, 0, 0, 0, 4, 4], [5, 4, 3, 2, 1, 0, 5, 4]]


class AllocatorMachine(RuleBasedStateMachine):
    """allocate / append / fork / free / crop / exhaust; invariants after every step."""

    @initialize(block_size=st.sampled_from([1, 3, 4]), num_blocks=st.integers(4, 14),
                prefix=st.booleans(), seed=st.integers(0, 1000))
    def setup(self, block_size, num_blocks, prefix, seed):
        self.h = Harness(num_blocks, block_size, prefix, seed)

    @rule(tokens=st.none() | st.lists(st.integers(0, 2), max_size=10))
    def add(self, tokens):
        self.h.add(tokens)

    @precondition(lambda self: self.h.shadow)
    @rule(data=st.data())
    def append(self, data):
        live = sorted(self.h.shadow)
        sids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        self.h.append(sids, data.draw(st.lists(st.integers(0, 6), min_size=len(sids), max_size=len(sids))))

    @precondition(lambda self: self.h.shadow)
    @rule(data=st.data())
    def fork(self, data):
        self.h.fork(data.draw(st.sampled_from(sorted(self.h.shadow))))

    @precondition(lambda self: self.h.shadow)
    @rule(data=st.data())
    def free(self, data):
        self.h.free(data.draw(st.sampled_from(sorted(self.h.shadow))))

    @precondition(lambda self: self.h.shadow)
    @rule(data=st.data())
    def crop(self, data):
        s = data.draw(st.sampled_from(sorted(self.h.shadow)))
        self.h.crop(s, data.draw(st.integers(0, len(self.h.shadow[s]))))

    @precondition(lambda self: self.h.shadow)
    @rule(data=st.data())
    def exhaust(self, data):
        s = data.draw(st.sampled_from(sorted(self.h.shadow)))
        a = self.h.alloc
        assert not self.h.append([s], [(a.num_free + 1) * a.block_size])

    @rule(sid=st.integers(100, 120))
    def unknown_id(self, sid):
        before = self.h.snapshot()[:3]
        with pytest.raises(KeyError, match="unknown sequence id"):
            self.h.alloc.fork(sid)
        assert self.h.snapshot()[:3] == before

    @invariant()
    def consistent(self):
        if hasattr(self, "h"):
            self.h.check()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix-caching"])
def test_soak_10000_operations_end_with_every_block_free(prefix):
    h = Harness(32, 3, prefix, seed=7 + prefix)
    for i in range(10_000):
        h.random_op()
        if i % 50 == 0:
            h.check()
    h.check()
    for s in sorted(h.shadow):
        h.free(s)
    h.check()
    assert h.alloc.num_free == h.alloc.num_blocks and h.alloc.num_used == 0
    wanted = {"copy-on-write", "out of blocks"} | ({"prefix hit", "eviction"} if prefix else set())
    assert all(h.events[e] > 20 for e in wanted), h.events


def test_allocator_takes_numpy_and_tensor_ints():
    np = pytest.importorskip("numpy")
    alloc = BlockAllocator(np.int64(8), torch.tensor(4))
    sid = alloc.add_sequence()
    alloc.append(sid, np.int32(6))
    alloc.crop(sid, torch.tensor(3))
    assert (alloc.num_blocks, alloc.block_size, alloc.num_used) == (8, 4, 1)
    for bad in (2.0, True, np.float32(3), -1):
        with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
            alloc.append(sid, bad)


def test_consecutive_steps_reuse_the_committed_table_and_it_always_matches_the_blocks():
    """A step of the same batch copies the last committed block table and writes only what changed;
    any other change in between (fork, crop, reorder, set_batch, abort) makes it start afresh."""
    rng = random.Random(3)
    alloc = BlockAllocator(400, 3)
    cache = PagedKVCache(1, 1, allocator=alloc, dtype=torch.float64)
    dense = DynamicCache(1, 1, dtype=torch.float64)
    B = 3
    for i in range(60):
        S = rng.randrange(1, 5)
        n = torch.tensor([rng.randrange(0, S + 1) for _ in range(B)])
        k = torch.randn(B, 1, S, 1, dtype=torch.float64)
        if alloc.batch:
            step = alloc.begin_step(B, S, n)
            for b, blocks in enumerate(step.blocks):
                assert step.table[b, :len(blocks)].tolist() == blocks
            alloc.abort(step)
        with attnkit.caches.step([cache, dense], batch=B, tokens=S, num_new=n) as (c, d):
            c.update(k, k, num_new=n)
            d.update(k, k, num_new=n)
        kp, _ = cache.view(cache.begin(B, 0), dense=True)[:2]
        alloc.abort(alloc.open_step)
        kd = dense.k_buf
        for b, L in enumerate(dense.lengths.tolist()):
            assert torch.equal(kp[b, :, :L], kd[b, :, :L])
        if i % 7 == 3:  # a change between steps: the next step builds its table from the blocks
            other = alloc.fork(alloc.batch[0])
            alloc.crop(other, rng.randrange(0, alloc.length(other) + 1))
            alloc.free(other)
        if i % 11 == 5:
            perm = list(range(B))
            rng.shuffle(perm)
            attnkit.caches.reorder([cache, dense], torch.tensor(perm))
