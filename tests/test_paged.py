"""Paged KV cache: attention over blocks equals the contiguous cache (random ragged batches, block
sizes 1/3/16/64, scattered block tables, MHA/GQA/MQA and MLA's V-from-K layout, decode,
verification and chunked prefill), the fp64 oracle under rule R, the modules with a DynamicCache;
fork / copy-on-write, prefix caching, exhaustion and errors. The allocator's own bookkeeping
(state machine, soak): tests/test_allocator.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

import attnkit
from attnkit.backends.decode import MAX_DECODE_Q_LEN
from attnkit.caches import DynamicCache
from attnkit.caches.paged import BlockAllocator, OutOfBlocks, PagedKVCache
from attnkit.masks import KeyPadding
from attnkit.modules import MultiHeadAttention
from attnkit.rope import RotaryEmbedding

from conftest import base_attention, rule_r, stable_seed

VARIANTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def scattered_allocator(num_blocks: int, block_size: int, seed: int) -> BlockAllocator:
    """An allocator whose free blocks come out in a random order: every block is filled as a
    cached prefix block and freed in a shuffled order, so later allocations evict them in that
    (least recently freed first) order and block tables are permutations, not runs."""
    alloc = BlockAllocator(num_blocks, block_size, prefix_caching=True)
    sids = [alloc.add_sequence() for _ in range(num_blocks)]
    for i, s in enumerate(sids):  # confirmed ids: the blocks are registered, so they stay cached once freed
        alloc.append(s, token_ids=list(range(i * block_size, (i + 1) * block_size)))
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for i in order:
        alloc.free(sids[i])
    assert alloc.num_free == num_blocks
    return alloc


def random_steps(seed: int, B: int, n_steps: int):
    """[(S, num_new)] of a ragged run: prefills, decode, verification and chunked-prefill steps,
    some rows idle (num_new 0)."""
    rng = random.Random(seed)
    steps = []
    for t in range(n_steps):
        S = rng.choice([1, 1, 2, 4, 7, 20]) if t else rng.choice([5, 19])
        steps.append((S, [rng.randint(0, S) for _ in range(B)]))
    return steps


def run_both(paged: PagedKVCache, Hq: int, steps, *, dtype=torch.float32, seed=0, Dv=None, backend="auto"):
    """Feed the same random q/k/v steps to the paged cache (``attend`` on ``backend``; steps
    longer than the decode backends take on ``auto``) and a DynamicCache; yield (paged out,
    dynamic out, q, k_all, v_all, mask) per step."""
    g = torch.Generator().manual_seed(seed)
    Hkv, D = paged.num_kv_heads, paged.head_dim
    Dv = paged.v_head_dim if Dv is None else Dv
    vfk = paged.value_from_key
    dyn = DynamicCache(Hkv, D, Dv, value_from_key=vfk, dtype=dtype)
    B = len(steps[0][1])
    for S, n in steps:
        q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
        v = None if vfk else torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64).to(dtype)
        nn_ = torch.tensor(n)
        got = paged.attend(q, k, v, num_new=nn_, backend=backend if S <= MAX_DECODE_Q_LEN else "auto")
        k_all, v_all, mask = dyn.update(k, v, num_new=nn_)
        want = attnkit.attention(q, k_all, v_all, mask)
        assert paged.lengths.tolist() == dyn.lengths.tolist()
        yield got, want, q, k_all, v_all, mask


def one_row_empty(steps):
    """Make row 0 idle until the last step, so its queries see nothing (exact zeros) for a while."""
    return [(S, [0] + n[1:]) for S, n in steps[:-1]] + [steps[-1]]


# --------------------------------------------------------------------------- attention equivalence


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attend_equals_contiguous_cache_on_ragged_steps(variant, block_size, scattered):
    Hq, Hkv = VARIANTS[variant]
    seed = stable_seed(variant, block_size, scattered)
    B, D = 3, 16
    steps = one_row_empty(random_steps(seed, B, 9))
    need = sum(-(-sum(n[b] for _, n in steps) // block_size) + 1 for b in range(B))
    alloc = scattered_allocator(need + 7, block_size, seed) if scattered else BlockAllocator(need + 7, block_size)
    paged = PagedKVCache(Hkv, D, 12, allocator=alloc)
    for t, (got, want, q, k_all, v_all, mask) in enumerate(run_both(paged, Hq, steps, seed=seed)):
        torch.testing.assert_close(got, want)
        if t < len(steps) - 1:  # row 0 has no key yet: its output is exactly 0
            assert (got[0] == 0).all()
        gold = attnkit.attention_reference(q, k_all, v_all, mask)
        rule_r(got, base_attention(q, k_all, v_all, mask), gold)
    if scattered:  # the tables really are scattered, not one ascending run
        flat = [blk for sid in alloc.batch for blk in alloc.blocks(sid)]
        assert flat != sorted(flat)


@pytest.mark.parametrize("implementation", ["native", "torch"])
def test_both_engine_implementations_read_scattered_pages(monkeypatch, implementation):
    """The paged backend on the native kernel and on the torch fallback, over scattered tables."""
    from attnkit import native
    if implementation == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.status() != "native":
        pytest.skip(native.status())
    Hq, Hkv = VARIANTS["gqa"]
    steps = one_row_empty(random_steps(11, 3, 8))
    paged = PagedKVCache(Hkv, 8, allocator=scattered_allocator(200, 3, 5))
    for got, want, q, *_ in run_both(paged, Hq, steps, seed=3, backend="paged"):
        torch.testing.assert_close(got, want)
    kv = paged.view(paged.begin(3, 0))[:2]
    assert attnkit.describe_call(q[:, :, :1], *kv, backend="paged", detail=True) == f"paged[{implementation}]"
    paged.abort(paged.allocator.open_step)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [3, 16])
def test_half_precision_follows_rule_r(dtype, block_size):
    Hq, Hkv = VARIANTS["gqa"]
    steps = random_steps(stable_seed("half", block_size), 3, 7)
    paged = PagedKVCache(Hkv, 16, num_blocks=200, block_size=block_size, dtype=dtype)
    for got, want, q, k_all, v_all, mask in run_both(paged, Hq, steps, dtype=dtype):
        assert got.dtype == dtype
        rule_r(got, base_attention(q, k_all, v_all, mask), attnkit.attention_reference(q, k_all, v_all, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_value_from_key_latent_layout(dtype, block_size):
    """MLA's latent cache: one KV head of [c_kv, k_rope] (D = 40 here, 576 in DeepSeek), V its
    first 32 channels; 8 query heads over it, as the absorbed path runs."""
    steps = random_steps(stable_seed("mla", block_size), 2, 7)
    paged = PagedKVCache(1, 40, 32, num_blocks=120, block_size=block_size, value_from_key=True, dtype=dtype)
    assert paged.v_pool.numel() == 0 and paged.bytes_per_token == 40 * dtype.itemsize
    for got, want, q, k_all, v_all, mask in run_both(paged, 8, steps, dtype=dtype):
        assert got.shape[-1] == 32
        if dtype == torch.float32:
            torch.testing.assert_close(got, want)
        rule_r(got, base_attention(q, k_all, v_all, mask), attnkit.attention_reference(q, k_all, v_all, mask))


def test_update_gathers_what_the_contiguous_cache_holds():
    """``update`` (the slow path) returns the same tensors and mask as a DynamicCache."""
    g = torch.Generator().manual_seed(0)
    paged = PagedKVCache(2, 8, 6, allocator=scattered_allocator(40, 3, 1))
    dyn = DynamicCache(2, 8, 6)
    for S, n in random_steps(2, 3, 6):
        k, v = torch.randn(3, 2, S, 8, generator=g), torch.randn(3, 2, S, 6, generator=g)
        kp, vp, mp = paged.update(k, v, num_new=torch.tensor(n))
        kd, vd, md = dyn.update(k, v, num_new=torch.tensor(n))
        lens = dyn.lengths
        L = int(lens.max())
        assert kp.shape[2] == L
        valid = torch.arange(L)[None, :] < lens[:, None]  # past a row's length both hold filler
        for a, b in ((kp, kd[:, :, :L]), (vp, vd[:, :, :L])):
            torch.testing.assert_close(a.transpose(1, 2)[valid], b.transpose(1, 2)[valid], rtol=0, atol=0)
        q = torch.randn(3, 4, S, 8, generator=g)
        torch.testing.assert_close(attnkit.attention(q, kp, vp, mp), attnkit.attention(q, kd, vd, md))


def test_extra_mask_weights_and_grad_fall_back_to_update_plus_attention():
    g = torch.Generator().manual_seed(1)
    paged, dyn = PagedKVCache(2, 8, num_blocks=20, block_size=4), DynamicCache(2, 8)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    extra = KeyPadding(torch.tensor([3, 5]))
    out_p, w_p = paged.attend(q, k, v, extra, return_weights=True)
    out_d, w_d = dyn.attend(q, k, v, extra, return_weights=True)
    torch.testing.assert_close(out_p, out_d)
    torch.testing.assert_close(w_p, w_d)
    q2, k2, v2 = (torch.randn(2, h, 1, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    out_p = paged.attend(q2, k2, v2)
    out_d = dyn.attend(q2, k2, v2)
    torch.testing.assert_close(out_p, out_d)
    (gq,) = torch.autograd.grad(out_p.sum(), q2)
    (gq_d,) = torch.autograd.grad(out_d.sum(), q2)
    torch.testing.assert_close(gq, gq_d)


def test_attend_hands_the_blocks_to_the_paged_backend(monkeypatch):
    """``attend`` never gathers a (B, max_len) copy: attention() receives the PagedKV and the
    paged backend reads the blocks in place."""
    paged = PagedKVCache(2, 8, num_blocks=140, block_size=16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 1100, 8, generator=g), torch.randn(2, 2, 1100, 8, generator=g)
    paged.attend(torch.randn(2, 4, 1100, 8, generator=g), k, v, num_new=torch.tensor([1100, 1050]))
    monkeypatch.setattr(attnkit.PagedKV, "gather", lambda self: pytest.fail("attend gathered the blocks"))
    seen = []
    real = attnkit.functional.select
    monkeypatch.setattr(attnkit.functional, "select", lambda call, be="auto": seen.append(call) or real(call, be))
    paged.attend(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert seen[0].kv_layout == "paged" and real(seen[0]).name == "paged"


def test_empty_rows_and_empty_steps_give_zeros():
    paged = PagedKVCache(1, 4, num_blocks=4, block_size=2)
    q, k, v = torch.randn(3, 2, 2, 4), torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 4)
    out = paged.attend(q, k, v, num_new=torch.tensor([0, 2, 0]))
    assert (out[0] == 0).all() and (out[2] == 0).all() and (out[1] != 0).any()
    out = paged.attend(q[:, :, :0], k[:, :, :0], v[:, :, :0])
    assert out.shape == (3, 2, 0, 4)
    assert paged.lengths.tolist() == [0, 2, 0] and paged.allocator.num_used == 1


# --------------------------------------------------------------------------- modules


def _mha(num_kv_heads, rope=True):
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, causal=True,
                              rope=RotaryEmbedding(8) if rope else None).eval()


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_module_with_paged_cache_equals_dynamic_cache(num_kv_heads, block_size):
    """Chunked prefill, verification of 3 tokens and token-by-token decode through the module."""
    m = _mha(num_kv_heads)
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        full = m(x)
        paged = PagedKVCache(num_kv_heads, 8, num_blocks=2 * math.ceil(40 / block_size), block_size=block_size)
        dyn = DynamicCache(num_kv_heads, 8)
        for a, b in ((0, 20), (20, 30), (30, 33)) + tuple((i, i + 1) for i in range(33, 40)):
            got, want = m(x[:, a:b], cache=paged), m(x[:, a:b], cache=dyn)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got, full[:, a:b], atol=1e-5, rtol=1e-5)
    assert paged.lengths.tolist() == [40, 40]


def test_module_ragged_batch_prefilled_per_request_then_decoded_together():
    """vLLM-style: each request is prefilled alone (its own length), then the ragged batch
    decodes together, RoPE positions per sequence from the cache; equals each request run alone
    with a DynamicCache."""
    m = _mha(2)
    lens, steps = [3, 17, 9], 6
    xs = [torch.randn(1, n + steps, 32) for n in lens]
    with torch.no_grad():
        want = []
        for x, n in zip(xs, lens):
            dyn = DynamicCache(2, 8)
            want.append(torch.cat([m(x[:, :n], cache=dyn)] + [m(x[:, t:t + 1], cache=dyn)
                                                              for t in range(n, n + steps)], 1))
        alloc = BlockAllocator(30, 4)
        paged = PagedKVCache(2, 8, allocator=alloc)
        sids, got = [], []
        for x, n in zip(xs, lens):
            sids.append(alloc.add_sequence())
            paged.set_batch([sids[-1]])
            got.append([m(x[:, :n], cache=paged)])
        paged.set_batch(sids)
        for t in range(steps):
            step = torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lens)])
            out = m(step, cache=paged)
            for b in range(3):
                got[b].append(out[b:b + 1])
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.cat(g, 1), w)
    assert paged.lengths.tolist() == [n + steps for n in lens]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("mode", ["naive", "absorb", "auto"])
def test_mla_module_with_paged_latent_cache_equals_dynamic_cache(mode, block_size):
    """MultiHeadLatentAttention with a paged latent cache (one head of [c_kv | k_pe], V read from
    K) equals it with a DynamicCache: chunked prefill (naive: update; absorbed: attend over the
    blocks), per-request prefill then ragged batched decode, speculative rollback and beams."""
    from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention

    cfg = MLAConfig(hidden_size=40, num_heads=4, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
                    v_head_dim=10, q_lora_rank=12, max_position_embeddings=64)
    m = MultiHeadLatentAttention(cfg, mode=mode)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    m.eval()
    lens, steps = [5, 21, 12], 4
    xs = [torch.randn(1, n + steps + 3, 40, generator=g) for n in lens]
    alloc = BlockAllocator(3 * math.ceil(40 / block_size) + 6, block_size)
    paged = PagedKVCache(1, cfg.latent_dim, cfg.kv_lora_rank, allocator=alloc, value_from_key=True)
    dyns = [m.new_cache() for _ in lens]
    with torch.no_grad():
        sids = []
        for x, n, dyn in zip(xs, lens, dyns):  # prefill in two chunks, each request alone
            sids.append(alloc.add_sequence())
            paged.set_batch([sids[-1]])
            for a, b in ((0, n - 3), (n - 3, n)):
                torch.testing.assert_close(m(x[:, a:b], cache=paged), m(x[:, a:b], cache=dyn))
        paged.set_batch(sids)

        def step(t0, S):
            xb = torch.cat([x[:, n + t0:n + t0 + S] for x, n in zip(xs, lens)])
            got = m(xb, cache=paged)
            for b, dyn in enumerate(dyns):
                torch.testing.assert_close(got[b:b + 1], m(xb[b:b + 1], cache=dyn))

        for t in range(steps - 1):
            step(t, 1)
        step(steps - 1, 3)  # verify 3 draft tokens, then reject 2 of them
        paged.crop(-2)
        for dyn in dyns:
            dyn.crop(-2)
        step(steps, 1)
    assert paged.lengths.tolist() == [n + steps + 1 for n in lens] == [d.lengths.item() for d in dyns]


# --------------------------------------------------------------------------- several layers


def test_layers_sharing_an_allocator_run_explicit_steps():
    """Two layers, one block table, every forward one ``caches.step``: equal to two DynamicCaches
    through prefill, beam reorder (forked, blocks shared), decode (copy-on-write in both layers'
    pools), crop and reset."""
    g = torch.Generator().manual_seed(4)
    alloc = BlockAllocator(40, 4)
    layers = [PagedKVCache(2, 8, allocator=alloc), PagedKVCache(2, 8, 6, allocator=alloc)]
    dyns = [DynamicCache(2, 8), DynamicCache(2, 8, 6)]

    def step(S, n=None):
        B = len(alloc.batch) or 2
        with attnkit.caches.step(layers, batch=B, tokens=S, num_new=n) as bound:
            for pc, dc in zip(bound, dyns):
                assert pc.positions(S).expand(B, S).tolist() == dc.positions(S).expand(B, S).tolist()
                q = torch.randn(B, 4, S, 8, generator=g)
                k = torch.randn(B, 2, S, 8, generator=g)
                v = torch.randn(B, 2, S, pc.v_head_dim, generator=g)
                torch.testing.assert_close(pc.attend(q, k, v, num_new=n), dc.attend(q, k, v, num_new=n))

    step(6, torch.tensor([6, 3]))
    used = alloc.num_used
    attnkit.caches.reorder(layers + dyns, torch.tensor([1, 1, 0]))
    assert alloc.num_used == used and len(alloc.batch) == 3  # forked, not copied
    shared = alloc.blocks(alloc.batch[0])[-1]
    assert alloc.refcount(shared) == 2
    step(1)  # both rows 0 and 1 append to the shared partial block: one copies it
    assert alloc.refcount(shared) == 1
    step(3)
    attnkit.caches.crop(layers + dyns, -2)
    step(1)
    attnkit.caches.reset(layers)
    assert alloc.num_free == alloc.num_blocks and alloc.sequences == ()


def test_a_failing_layer_leaves_every_shared_block_and_count_as_before():
    """A forward that fails in its last layer, after copy-on-write of a shared block and with
    reused evictable blocks, changes no sequence, refcount or free count; the retry equals an
    untouched twin's."""
    def build():
        alloc = scattered_allocator(12, 4, 3)  # every free block is a cached (evictable) one
        layers = [PagedKVCache(2, 8, allocator=alloc) for _ in range(2)]
        x = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
        with attnkit.caches.step(layers, batch=1, tokens=6) as bound:
            for c in bound:
                c.attend(torch.randn(1, 4, 6, 8), x, x)
        attnkit.caches.reorder(layers, torch.tensor([0, 0]))  # two beams share the partial block
        return alloc, layers

    (alloc, layers), (alloc2, layers2) = build(), build()
    state = lambda a: (a.num_free, a.num_used, [a.refcount(b) for b in range(a.num_blocks)],
                       {s: (a.length(s), a.blocks(s)) for s in a.sequences})
    before = state(alloc)
    pools = [c.k_pool.clone() for c in layers]
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match="mask"):
        with attnkit.caches.step(layers, batch=2, tokens=3) as bound:
            bound[0].attend(q, k, k)
            bound[1].attend(q, k, k, torch.ones(1, 1, 1, 99, dtype=torch.bool))
    assert state(alloc) == before and alloc.open_step is None
    for c, p in zip(layers, pools):  # committed tokens untouched (slots past a length may be scratch)
        for s in alloc.sequences:
            rows, n = list(alloc.blocks(s)), alloc.length(s)
            torch.testing.assert_close(c.k_pool[rows].flatten(0, 1)[:n], p[rows].flatten(0, 1)[:n], rtol=0, atol=0)
    outs = []
    for ls in (layers, layers2):
        with attnkit.caches.step(ls, batch=2, tokens=3) as bound:
            outs.append([c.attend(q, k, k) for c in bound])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The aborted step handed the evictable blocks it reserved back as they were (cached, in their
    # eviction order): the retry took the very blocks the twin's step took.
    assert state(alloc) == state(alloc2) and alloc.num_cached_blocks == alloc2.num_cached_blocks


def _allocator_blocks(lengths, block_size, Hkv, D, seed):
    """Sequences of ``lengths`` written through a BlockAllocator (ragged, so its block_table() is
    padded with -1), their pools and the same K/V dense (B, Hkv, L, D)."""
    g = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(16, block_size)
    B, L = len(lengths), max(lengths)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    pk, pv = torch.zeros(16, block_size, Hkv, D), torch.zeros(16, block_size, Hkv, D)
    sids = [alloc.add_sequence() for _ in lengths]
    for b, (sid, n) in enumerate(zip(sids, lengths)):
        slots = alloc.append(sid, n)
        pk.flatten(0, 1)[slots] = k[b, :, :n].transpose(0, 1)
        pv.flatten(0, 1)[slots] = v[b, :, :n].transpose(0, 1)
    alloc.set_batch(sids)
    return alloc, pk, pv, k, v


@pytest.mark.parametrize("implementation", ["native", "torch"])
def test_table_padding_past_a_sequences_last_block_is_never_read(monkeypatch, implementation):
    """BlockAllocator.block_table() pads rows with -1, which PagedKV documents as ignored: with
    a ragged batch and a Dense or additive mask (where every row spans max(lengths) keys), only
    the blocks below each sequence's own length are read, on every backend."""
    from attnkit import native
    if implementation == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.status() != "native":
        pytest.skip(native.status())
    lengths, Sq = [11, 3, 0, 6], 2
    alloc, pk, pv, k, v = _allocator_blocks(lengths, 4, 2, 8, seed=1)
    table, n = alloc.block_table(), alloc.lengths()
    assert (table == -1).any()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 4, Sq, 8, generator=g)
    L = max(lengths)
    masks = {
        "dense": attnkit.masks.Dense(torch.rand(4, 1, Sq, L, generator=g) > 0.3),
        "additive": torch.randn(1, 1, Sq, L, generator=g),
        "causal": attnkit.masks.Causal(q_start=(n - Sq).clamp(min=0)),
        "none": None,
    }
    for name, mask in masks.items():
        pad = attnkit.masks.KeyPadding(n)
        full = pad if mask is None else attnkit.masks.as_mask(mask) & pad
        gold = attnkit.attention_reference(q, k, v, full)
        for checked in (True, False):
            kv = attnkit.PagedKV(pk, pv, table, n, checked=checked)
            for backend in ("paged", "sdpa", "math"):
                out = attnkit.attention(q, kv, None, mask, backend=backend)
                rule_r(out, base_attention(q, k, v, full), gold, n_terms=L, what=f"{name} {backend}")


def test_checked_tables_still_have_their_lengths_and_max_len_checked():
    """``checked=True`` vouches for the table entries only; lengths and max_len are the call's
    shape and are checked either way (negative lengths, or a max_len below max(lengths), raise
    instead of giving zeros or dropping keys)."""
    pk = torch.zeros(4, 2, 1, 8)
    q = torch.randn(1, 2, 1, 8)
    table = torch.tensor([[0, 1]])
    cases = [
        (dict(lengths=torch.tensor([-1])), r"lengths \[-1\] must be in \[0, 2 blocks x 2 tokens = 4\]"),
        (dict(lengths=torch.tensor([5])), r"lengths \[5\] must be in"),
        (dict(lengths=torch.tensor([2 ** 62])), r"lengths .* must be in"),
        (dict(lengths=torch.tensor([4]), max_len=2), r"max_len=2 but max\(lengths\)=4"),
        (dict(lengths=torch.tensor([4]), max_len=True), r"max_len must be a non-negative int"),
    ]
    for kw, text in cases:
        for checked in (True, False):
            kv = attnkit.PagedKV(pk, pk, table, checked=checked, **kw)
            with pytest.raises(ValueError, match=text):
                attnkit.attention(q, kv, None)


@pytest.mark.parametrize("implementation", ["native", "torch"])
def test_a_lying_checked_table_raises_on_every_path(monkeypatch, implementation):
    """A ``checked=True`` table entry outside the pool raises on every path (the native kernel,
    the gather for SDPA / math / gradients, the torch implementation): none clamps it to the
    last block and returns a plausible wrong result."""
    from attnkit import native
    if implementation == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.status() != "native":
        pytest.skip(native.status())
    g = torch.Generator().manual_seed(0)
    pk, pv = torch.randn(4, 2, 2, 8, generator=g), torch.randn(4, 2, 2, 8, generator=g)
    q = torch.randn(2, 4, 3, 8, generator=g)
    for entry in (4, 17, -1, -4):
        kv = attnkit.PagedKV(pk, pv, torch.tensor([[0, 1, 2], [3, entry, 0]]), torch.tensor([5, 4]), checked=True)
        for backend in ("paged", "sdpa", "math", "auto"):
            with pytest.raises(ValueError, match="block_table"):
                attnkit.attention(q, kv, None, attnkit.masks.Causal(), backend=backend)
        grad_kv = attnkit.PagedKV(pk.clone().requires_grad_(), pv.clone().requires_grad_(), kv.block_table,
                                  kv.lengths, checked=True)
        with pytest.raises(ValueError, match="block_table"):  # gradients: the gathered path
            attnkit.attention(q, grad_kv, None)
        with pytest.raises(ValueError, match="block_table"):
            attnkit.attention(q[:, :, :1], kv, None, backend="paged")  # the decode step's path


def test_an_aborted_step_keeps_the_prefix_cache_as_it_was():
    """An aborted step leaves the prefix cache as it was: a cached free block it reserved goes
    back still registered (later prompts keep their 8-token hit), and so does a cropped cached
    block it appended into. Registrations end only when a step commits."""
    def prompt_blocks():
        alloc = BlockAllocator(4, 4, prefix_caching=True)
        cache = PagedKVCache(1, 2, allocator=alloc)
        a = alloc.add_sequence()
        cache.set_batch([a])
        x = torch.randn(1, 1, 8, 2)
        with attnkit.caches.step([cache], batch=1, tokens=8, token_ids=[list(range(8))]) as (c,):
            c.update(x, x)
        alloc.set_batch([])
        alloc.free(a)  # both full blocks stay cached (free, evictable)
        return alloc, cache

    alloc, cache = prompt_blocks()
    b = alloc.add_sequence()
    cache.set_batch([b])
    y = torch.randn(1, 1, 12, 2)
    with pytest.raises(ValueError, match="mask"):  # reserves 3 blocks: the 2 fresh, then a cached one
        cache.attend(torch.randn(1, 1, 12, 2), y, y, torch.ones(1, 1, 1, 99, dtype=torch.bool))
    assert alloc.num_cached_blocks == 2 and alloc.num_free == 4
    cache.set_batch([])
    alloc.free(b)
    assert alloc.length(alloc.add_sequence(token_ids=list(range(9)))) == 8  # both blocks still hit

    # appending into a cropped cached block: still cached after an abort
    alloc, cache = prompt_blocks()
    c_id = alloc.add_sequence(token_ids=list(range(9)))
    assert alloc.length(c_id) == 8
    alloc.crop(c_id, 6)  # its second block (tokens 4..7, cached) is now partial
    cache.set_batch([c_id])
    z = torch.randn(1, 1, 1, 2)
    with pytest.raises(ValueError, match="mask"):
        cache.attend(torch.randn(1, 1, 1, 2), z, z, torch.ones(1, 1, 1, 99, dtype=torch.bool))
    assert alloc.num_cached_blocks == 2
    cache.attend(torch.randn(1, 1, 1, 2), z, z)  # committed: the block's content changed, unregistered
    assert alloc.num_cached_blocks == 1


# --------------------------------------------------------------------------- editing


def test_crop_returns_whole_blocks_and_matches_dynamic_cache():
    g = torch.Generator().manual_seed(2)
    paged, dyn = PagedKVCache(2, 8, num_blocks=20, block_size=4), DynamicCache(2, 8)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    paged.update(k, v)
    dyn.update(k, v)
    assert paged.allocator.num_used == 6
    for c in (paged, dyn):
        c.crop(-3)  # 7 tokens: the third block goes
    assert paged.allocator.num_used == 4 and paged.lengths.tolist() == [7, 7]
    for c in (paged, dyn):
        c.crop(torch.tensor([7, 2]))
    assert paged.allocator.num_used == 3
    q, k, v = (torch.randn(2, h, 2, 8, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(paged.attend(q, k, v), dyn.attend(q, k, v))
    with pytest.raises(ValueError, match="negative length"):
        paged.crop(-10)


def test_reorder_beam_search_shares_blocks():
    g = torch.Generator().manual_seed(3)
    paged, dyn = PagedKVCache(1, 4, num_blocks=12, block_size=4), DynamicCache(1, 4)
    x = torch.randn(2, 1, 6, 4, generator=g)
    paged.update(x, x)
    dyn.update(x, x)
    used = paged.allocator.num_used
    for c in (paged, dyn):
        c.reorder(torch.tensor([0, 0, 0, 1]))  # 4 beams from 2 sequences
    assert paged.allocator.num_used == used
    for _ in range(3):
        q, k = torch.randn(4, 2, 1, 4, generator=g), torch.randn(4, 1, 1, 4, generator=g)
        torch.testing.assert_close(paged.attend(q, k, k), dyn.attend(q, k, k))
    for c in (paged, dyn):
        c.reorder(torch.tensor([2]))  # the other beams are freed
    assert paged.allocator.num_used == 3 and len(paged.allocator.sequences) == 1
    q, k = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
    torch.testing.assert_close(paged.attend(q, k, k), dyn.attend(q, k, k))
    with pytest.raises(ValueError, match="out of range"):
        paged.reorder(torch.tensor([1]))


def test_out_of_blocks_changes_nothing():
    paged = PagedKVCache(1, 2, num_blocks=5, block_size=4)
    x = torch.randn(2, 1, 8, 2)
    paged.update(x, x)  # 4 of 5 blocks
    before = (paged.k_pool.clone(), paged.lengths.clone(), paged.allocator.num_free)
    with pytest.raises(OutOfBlocks) as err:
        paged.attend(torch.randn(2, 1, 1, 2), x[:, :, :1], x[:, :, :1])  # needs 2 new blocks, 1 free
    assert (err.value.needed, err.value.free, err.value.capacity) == (2, 1, 5)
    assert torch.equal(paged.k_pool, before[0]) and torch.equal(paged.lengths, before[1])
    assert paged.allocator.num_free == before[2]
    out = paged.attend(torch.randn(2, 1, 1, 2), x[:, :, :1], x[:, :, :1], num_new=torch.tensor([1, 0]))
    assert out.shape == (2, 1, 1, 2) and paged.lengths.tolist() == [9, 8]
    fresh = PagedKVCache(1, 2, num_blocks=1, block_size=4)
    with pytest.raises(OutOfBlocks):
        fresh.update(x, x)
    assert fresh.allocator.sequences == () and fresh.lengths.numel() == 0


def test_nbytes_and_bytes_used():
    paged = PagedKVCache(2, 8, 4, num_blocks=10, block_size=4, dtype=torch.bfloat16)
    assert paged.bytes_per_token == 2 * (8 + 4) * 2
    assert paged.nbytes == 10 * 4 * paged.bytes_per_token
    paged.update(torch.zeros(3, 2, 5, 8, dtype=torch.bfloat16), torch.zeros(3, 2, 5, 4, dtype=torch.bfloat16))
    assert paged.nbytes_used == 6 * 4 * paged.bytes_per_token


# --------------------------------------------------------------------------- prefix caching


def test_shared_prefix_computed_once_gives_the_same_outputs():
    """Request B shares 13 tokens with request A; with prefix caching its first 3 full blocks
    (12 tokens) come from A's blocks and only the rest is computed. Outputs equal recomputing B
    from scratch, through a RoPE module."""
    m = _mha(2)
    torch.manual_seed(1)
    emb = torch.randn(100, 32)
    toks_a = torch.randint(0, 100, (22,))
    toks_b = torch.cat([toks_a[:13], torch.randint(0, 100, (6,))])
    with torch.no_grad():
        scratch = PagedKVCache(2, 8, num_blocks=10, block_size=4)
        want = m(emb[toks_b][None], cache=scratch)
        alloc = BlockAllocator(20, 4, prefix_caching=True)
        cache = PagedKVCache(2, 8, allocator=alloc)
        a = alloc.add_sequence(token_ids=toks_a)
        assert alloc.length(a) == 0
        cache.set_batch([a])
        m(emb[toks_a][None], cache=cache)
        assert alloc.num_cached_blocks == 0  # no ids came with the write: nothing is trusted yet
        alloc.confirm_tokens(a, toks_a)  # the caller vouches for what it fed
        assert alloc.num_cached_blocks == 5
        b = alloc.add_sequence(token_ids=toks_b)
        start = alloc.length(b)
        assert start == 12 and alloc.blocks(b) == alloc.blocks(a)[:3]
        used = alloc.num_used
        cache.set_batch([b])
        with attnkit.caches.step([cache], batch=1, tokens=len(toks_b) - start,
                                 token_ids=[toks_b[start:]]) as (c,):  # ids confirmed by the step
            got = m(emb[toks_b[start:]][None], cache=c)
        assert alloc.num_used == used + 2  # only the 7 new tokens took blocks
        torch.testing.assert_close(got, want[:, start:])
        assert alloc.num_cached_blocks == 5 + 1  # b's 4th block (positions 12..15) is b's own
        # A freed: its blocks stay cached; a third request still reuses them.
        cache.set_batch([b])
        alloc.free(a)
        c = alloc.add_sequence(token_ids=toks_a)
        assert alloc.length(c) == 20 and [alloc.refcount(x) for x in alloc.blocks(c)] == [2, 2, 2, 1, 1]


def test_prefix_cache_keeps_the_last_token_and_evicts_least_recently_freed():
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    a = alloc.add_sequence(token_ids=[1, 2, 3, 4])
    alloc.append(a, 4)
    assert alloc.num_cached_blocks == 0  # declared ids are not trusted for what was written
    alloc.confirm_tokens(a, [1, 2, 3, 4])
    assert alloc.num_cached_blocks == 2
    b = alloc.add_sequence(token_ids=[1, 2, 3, 4])
    assert alloc.length(b) == 2  # the last token is always computed
    c = alloc.add_sequence(token_ids=[1, 2, 3, 4, 5])
    assert alloc.length(c) == 4 and alloc.refcount(alloc.blocks(a)[1]) == 2
    for s in (b, c, a):
        alloc.free(s)
    assert alloc.num_free == 4 and alloc.num_cached_blocks == 2
    d = alloc.add_sequence()
    alloc.append(d, 8)  # takes the 2 clean blocks, then evicts both cached ones
    assert alloc.num_cached_blocks == 0
    alloc.crop(d, 3)
    e = alloc.add_sequence(token_ids=[9, 9, 9])
    alloc.append(e, token_ids=[9, 9, 9])
    f = alloc.fork(e)
    alloc.crop(e, 1)  # e's block 0 is shared with f: stays cached
    assert alloc.num_cached_blocks == 1
    alloc.free(f)
    alloc.append(e, token_ids=[7])  # e alone rewrites its partial block: no longer cached ...
    g = alloc.add_sequence(token_ids=[9, 9, 9])
    assert alloc.length(g) == 0  # ... so [9, 9] is not served from it
    assert alloc.length(e) == 2 and alloc.num_cached_blocks == 1  # [9, 7] registered
    h = alloc.add_sequence(token_ids=[9, 7, 1])
    assert alloc.length(h) == 2 and alloc.blocks(h) == alloc.blocks(e)


def test_prefix_caching_trusts_only_confirmed_ids():
    """A sequence declared with ids [1, 2, 3, 4, 5] but fed other tokens (no ids with the write)
    registers nothing, so a later request with prefix [1, 2, 3, 4] reuses no foreign K/V; the
    same written with its ids confirmed is reused."""
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    cache = PagedKVCache(1, 4, allocator=alloc)
    a = alloc.add_sequence(token_ids=[1, 2, 3, 4, 5])
    cache.set_batch([a])
    x = torch.randn(1, 1, 5, 4)
    cache.update(x, x)  # other tokens than declared: nothing confirmed
    assert alloc.num_cached_blocks == 0
    b = alloc.add_sequence(token_ids=[1, 2, 3, 4, 9])
    assert alloc.length(b) == 0  # nothing foreign reused
    cache.set_batch([b])
    with attnkit.caches.step([cache], batch=1, tokens=5, token_ids=[[1, 2, 3, 4, 9]]) as (c,):
        c.update(x, x)
    assert alloc.num_cached_blocks == 2
    c_id = alloc.add_sequence(token_ids=[1, 2, 3, 4, 7])
    assert alloc.length(c_id) == 4 and alloc.blocks(c_id) == alloc.blocks(b)[:2]


def test_bad_cache_calls():
    paged = PagedKVCache(2, 8, num_blocks=8, block_size=4)
    x = torch.randn(2, 2, 3, 8)
    paged.update(x, x)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        paged.update(x[:1], x[:1])
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        paged.attend(torch.randn(2, 3, 3, 8), x, x)
    with pytest.raises(ValueError, match=r"q must be \(B, Hq, S, D\) with B=2, S=3"):
        paged.attend(torch.randn(2, 4, 2, 8), x, x)
    with pytest.raises(TypeError, match="dtype"):
        paged.attend(torch.randn(2, 4, 3, 8, dtype=torch.float64), x, x)
    with pytest.raises(ValueError, match="v is None"):
        paged.update(x, None)
    latent = PagedKVCache(1, 8, 4, num_blocks=4, value_from_key=True)
    with pytest.raises(ValueError, match="pass v=None"):
        latent.update(x[:, :1], x[:, :1, :, :4])
    assert paged.lengths.tolist() == [3, 3] and paged.allocator.num_used == 2  # nothing changed


def test_ids_after_an_unconfirmed_prefill_register_nothing_and_q_on_another_device_is_refused_unchanged():
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    cache = PagedKVCache(1, 1, allocator=alloc)
    a = alloc.add_sequence()
    cache.set_batch([a])
    k = torch.tensor([10.0, 11.0]).view(1, 1, 2, 1)
    cache.update(k, k)  # written without ids: these blocks must never be shared by id
    alloc.set_batch([])
    alloc.append(a, token_ids=[7, 8])  # ids of positions 2, 3 while those of 0, 1 are unknown
    assert alloc.length(a) == 4 and alloc.num_cached_blocks == 0  # no chain to hang them on
    with pytest.raises(ValueError, match="does not hold"):
        alloc.confirm_tokens(a, [1, 2, 3, 4, 5])
    fresh = PagedKVCache(1, 4, num_blocks=4, block_size=2)
    x = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="one device"):
        fresh.attend(torch.randn(1, 2, 2, 4, device="meta"), x, x)
    assert fresh.lengths.numel() == 0


def _decode_reads_no_row_past_a_length(cache, rnd):
    """One decode step over ``cache``: every backend, over the blocks in place and over the dense
    view, equals the fp64 oracle of the dense view, finite."""
    B = cache.lengths.shape[0]
    q1, k1, v1 = rnd(B, 4, 1), rnd(B, 2, 1), rnd(B, 2, 1)
    with cache.transaction(B, 1) as bound:
        bound.cache.write(bound.step, k1, v1)
        kv, _, mask = bound.cache.view(bound.step)
        k_all, v_all, dense_mask = bound.cache.view(bound.step, dense=True)
        gold = attnkit.attention_reference(q1.double(), k_all.double(), v_all.double(), dense_mask)
        assert torch.isfinite(gold).all()
        for b in ("auto", "paged", "sdpa", "math", "decode"):
            out = attnkit.attention(q1, kv, None, mask, backend=b)
            torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5, msg=lambda m: f"{b}: {m}")
            if b != "paged":
                out = attnkit.attention(q1, k_all, v_all, dense_mask, backend=b)
                torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5, msg=lambda m: f"{b}: {m}")


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["float", "int8"])
def test_rows_past_a_length_in_shared_copied_or_reused_blocks_are_never_read(kv_dtype):
    """A paged crop leaves the dropped rows as they are (the block may be a fork's or the prefix
    cache's): a fork cropped inside a shared block, its copy-on-write copy, and a freed block
    reused by a new sequence all hold rejected K/V (NaN / inf) past a length, and no backend,
    in place or through the dense view, reads them."""
    g = torch.Generator().manual_seed(11)
    rnd = lambda B, H, S: torch.randn(B, H, S, 8, generator=g)  # noqa: E731

    def rejected_tail():  # 8 tokens whose last 2 (rows 2, 3 of the second block) are cropped off
        cache = PagedKVCache(2, 8, num_blocks=6, block_size=4, kv_dtype=kv_dtype)
        cache.attend(rnd(1, 4, 5), rnd(1, 2, 5), rnd(1, 2, 5))
        k, v = rnd(1, 2, 3), rnd(1, 2, 3)
        k[:, :, 1:], v[:, :, 1:] = float("nan"), float("inf")
        cache.attend(rnd(1, 4, 3), k, v)
        return cache

    def stale(cache):  # the pools (quantized: the scales) still hold the rejected rows
        pools = (cache.k_pool, cache.v_pool) if kv_dtype is None else (cache.k_scale, cache.v_scale)
        return not all(bool(torch.isfinite(p).all()) for p in pools)

    cache = rejected_tail()
    cache.reorder(torch.tensor([0, 0]))  # a fork: both rows share both blocks
    cache.crop(-2)
    assert stale(cache)
    _decode_reads_no_row_past_a_length(cache, rnd)  # copies the shared block; row 7 stays past both lengths
    cache = rejected_tail()
    cache.crop(-2)
    cache.reset()  # the blocks go back to the pool as they are
    cache.attend(rnd(2, 4, 2), rnd(2, 2, 2), rnd(2, 2, 2))  # row 1 reuses the second block: rows 2, 3 stale
    assert cache.allocator.blocks(cache.seq_ids[1]) == (1,) and stale(cache)
    _decode_reads_no_row_past_a_length(cache, rnd)
