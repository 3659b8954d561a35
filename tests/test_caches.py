"""KV caches: prefill + decode and chunked prefill equal one full forward; ragged batches equal
each sequence alone; crop, reorder, accounting and errors."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.caches import BlockAllocator, DynamicCache, PagedKVCache, SlidingWindowCache, StaticCache

from conftest import base_attention, make_qkv, rule_r, stable_seed

VARIANTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
KINDS = ["dynamic", "static"]


def make_cache(kind, B, Hkv, D, Dv, dtype, max_len=64):
    if kind == "dynamic":
        return DynamicCache(Hkv, D, Dv, dtype=dtype)
    return StaticCache(Hkv, D, Dv, max_batch=B, max_len=max_len, dtype=dtype)


def run_chunks(cache, q, k, v, chunks, backend="auto"):
    """Feed (q, k, v) through the cache in chunks of the given sizes; concatenate the outputs."""
    outs, s = [], 0
    for n in chunks:
        k_all, v_all, mask = cache.update(k[:, :, s:s + n], v[:, :, s:s + n])
        outs.append(attnkit.attention(q[:, :, s:s + n], k_all, v_all, mask, backend=backend))
        s += n
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("chunks", [[16, 1, 1, 1, 1], [5, 7, 3, 2, 3], [1] * 20], ids=["prefill+decode", "chunked", "token-by-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", KINDS)
def test_incremental_equals_full(kind, variant, dtype, chunks):
    Hq, Hkv = VARIANTS[variant]
    S = sum(chunks)
    q, k, v = make_qkv(2, Hq, Hkv, S, S, 16, Dv=12, dtype=dtype, seed=stable_seed(kind, variant, S))
    cache = make_cache(kind, 2, Hkv, 16, 12, dtype)
    out = run_chunks(cache, q, k, v, chunks)
    full = attnkit.attention(q, k, v, causal=True)
    if dtype == torch.float32:
        assert (out - full).abs().max() <= 1e-5
    else:
        rule_r(out, base_attention(q, k, v, causal=True), attnkit.attention_reference(q, k, v, causal=True))
    assert cache.lengths.tolist() == [S, S]


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_batch_equals_each_sequence_alone(kind):
    Hq, Hkv, D = 4, 2, 8
    lens = torch.tensor([3, 7, 5])
    P, steps = int(lens.max()), 4
    g = torch.Generator().manual_seed(1)
    seqs = [make_qkv(1, Hq, Hkv, int(n) + steps, int(n) + steps, D, seed=i) for i, n in enumerate(lens)]
    # Right-padded prompts; the padding holds garbage that must never be attended.
    pad = lambda t, n: torch.cat([t[:, :, :n], torch.randn(1, t.shape[1], P - n, t.shape[3], generator=g)], 2)
    cache = make_cache(kind, 3, Hkv, D, D, torch.float32)
    qp, kp, vp = (torch.cat([pad(s[j], int(n)) for s, n in zip(seqs, lens)]) for j in range(3))
    k_all, v_all, mask = cache.update(kp, vp, num_new=lens)
    out = attnkit.attention(qp, k_all, v_all, mask)
    got = [[out[b:b + 1, :, :int(n)]] for b, n in enumerate(lens)]
    for t in range(steps):  # decode: each sequence's next token at its own position
        step = [torch.cat([s[j][:, :, int(n) + t:int(n) + t + 1] for s, n in zip(seqs, lens)]) for j in range(3)]
        k_all, v_all, mask = cache.update(step[1], step[2])
        o = attnkit.attention(step[0], k_all, v_all, mask)
        for b in range(3):
            got[b].append(o[b:b + 1])
    for b, (s, n) in enumerate(zip(seqs, lens)):
        alone = attnkit.attention(*s, causal=True)
        assert (torch.cat(got[b], 2) - alone).abs().max() <= 1e-5
    assert cache.lengths.tolist() == (lens + steps).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_crop_rolls_back_rejected_tokens(kind):
    q, k, v = make_qkv(2, 4, 2, 12, 12, 8)
    cache = make_cache(kind, 2, 2, 8, 8, torch.float32)
    ref = run_chunks(cache, q, k, v, [8, 4])
    cache.crop(-4)  # reject the last 4 (speculative) tokens
    assert cache.lengths.tolist() == [8, 8]
    k2 = k.clone()
    k2[:, :, 8:] = 0  # a different draft, then the accepted one again
    run_chunks(cache, q[:, :, 8:], k2[:, :, 8:], v[:, :, 8:], [4])
    cache.crop(8)
    again = run_chunks(cache, q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], [4])
    torch.testing.assert_close(again, ref[:, :, 8:])


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_follows_beams(kind):
    q, k, v = make_qkv(2, 4, 2, 10, 10, 8)
    cache = make_cache(kind, 2, 2, 8, 8, torch.float32)
    run_chunks(cache, q, k, v, [9])
    cache.reorder(torch.tensor([1, 0]))
    swap = lambda t: t.flip(0)
    last = run_chunks(cache, swap(q)[:, :, 9:], swap(k)[:, :, 9:], swap(v)[:, :, 9:], [1])
    full = attnkit.attention(swap(q), swap(k), swap(v), causal=True)
    torch.testing.assert_close(last, full[:, :, 9:])


def test_dynamic_cache_reorder_can_grow_the_batch():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8)
    cache = DynamicCache(2, 8)
    run_chunks(cache, q, k, v, [5])
    cache.reorder(torch.tensor([0, 0, 0]))  # one prompt, three samples
    qq, kk, vv = (t.expand(3, -1, -1, -1) for t in (q, k, v))
    out = run_chunks(cache, qq[:, :, 5:], kk[:, :, 5:], vv[:, :, 5:], [1])
    torch.testing.assert_close(out, attnkit.attention(qq, kk, vv, causal=True)[:, :, 5:])


def test_accounting_and_amortised_growth():
    cache = DynamicCache(8, 128, dtype=torch.bfloat16)
    assert cache.bytes_per_token == 8 * 256 * 2
    k = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    caps = set()
    for _ in range(100):
        cache.update(k, k)
        caps.add(cache.k_buf.shape[2])
    assert len(caps) <= 4  # 16, 32, 64, 128: doubling, not a copy per step
    assert cache.nbytes == 2 * cache.k_buf.numel() * 2 + cache.lengths.numel() * 8  # K, V, lengths
    static = StaticCache(8, 128, max_batch=2, max_len=4096, dtype=torch.bfloat16)
    assert static.nbytes == 2 * 2 * 8 * 4096 * 128 * 2 + static.lengths.numel() * 8
    assert static.bytes_per_token == cache.bytes_per_token


@pytest.mark.parametrize("kind", KINDS)
def test_value_from_key_stores_k_once_and_attends_like_separate_kv(kind):
    # MLA's latent layout: K = [c_kv, k_rope] (576 wide at DeepSeek-V3 dims), V = c_kv = K[..., :512].
    q, k, _ = make_qkv(2, 8, 1, 9, 9, 24, seed=3)
    shared = DynamicCache(1, 24, 16, value_from_key=True) if kind == "dynamic" else \
        StaticCache(1, 24, 16, max_batch=2, max_len=16, value_from_key=True)
    separate = make_cache(kind, 2, 1, 24, 16, torch.float32, max_len=16)
    outs = []
    for cache in (shared, separate):
        out, s = [], 0
        for n in (5, 1, 3):
            v = None if cache is shared else k[:, :, s:s + n, :16]
            out.append(cache.attend(q[:, :, s:s + n], k[:, :, s:s + n], v))
            s += n
        outs.append(torch.cat(out, 2))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], attnkit.attention(q, k, k[..., :16], causal=True))
    assert shared.bytes_per_token == 24 * 4 and separate.bytes_per_token == (24 + 16) * 4
    assert shared.v_buf.numel() == 0
    shared.reorder(torch.tensor([1, 0]))
    shared.crop(-1)
    assert shared.lengths.tolist() == [8, 8]
    with pytest.raises(ValueError, match="v=None"):
        shared.update(k[:, :, :1], k[:, :, :1, :16])
    with pytest.raises(ValueError, match="value_from_key"):
        separate.update(k[:, :, :1], None)
    with pytest.raises(ValueError, match="v_head_dim <= head_dim"):
        DynamicCache(1, 8, 16, value_from_key=True)


def test_positions_follow_each_sequence():
    cache = DynamicCache(1, 4)
    k = torch.zeros(2, 1, 5, 4)
    cache.update(k, k, num_new=torch.tensor([2, 5]))
    assert cache.positions(3).tolist() == [[2, 3, 4], [5, 6, 7]]


def test_static_cache_keeps_shapes_and_buffer_identity():
    cache = StaticCache(2, 8, max_batch=2, max_len=32)
    kb = cache.k_buf
    shapes = set()
    for n in (5, 1, 1, 3):
        k = torch.randn(2, 2, n, 8)
        k_all, v_all, _ = cache.update(k, k)
        shapes.add(tuple(k_all.shape))
    assert shapes == {(2, 2, 32, 8)} and cache.k_buf is kb


def test_static_cache_one_token_step_with_idle_rows():
    """A static cache's one-token step is masked by the rows' lengths alone (KeyPadding(new)):
    a row that gains no token (num_new 0) sees its old keys and never the step's padding token,
    exactly as the full Causal(q_start=q_start) & KeyPadding(new) mask of longer steps says."""
    q, k, v = make_qkv(2, 4, 2, 6, 6, 8, seed=3)
    cache = StaticCache(2, 8, max_batch=2, max_len=16)
    cache.update(k[:, :, :5], v[:, :, :5], num_new=torch.tensor([5, 3]))
    k_all, v_all, mask = cache.update(k[:, :, 5:], v[:, :, 5:], num_new=torch.tensor([1, 0]))
    assert isinstance(mask, attnkit.masks.KeyPadding) and cache.lengths.tolist() == [6, 3]
    out = attnkit.attention(q[:, :, 5:], k_all, v_all, mask)
    want = attnkit.attention_reference(q[:, :, 5:], k_all, v_all,
                                       attnkit.masks.Causal(q_start=torch.tensor([5, 3]))
                                       & attnkit.masks.KeyPadding(torch.tensor([6, 3])))
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    alone = attnkit.attention_reference(q[1:, :, 5:], k[1:, :, :3], v[1:, :, :3])  # row 1: its 3 old keys
    torch.testing.assert_close(out[1:].double(), alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_static_cache_prefill_attends_over_the_held_keys_only(ragged, monkeypatch):
    """An eager multi-token step on a static cache, whose other masks speak of positions only,
    hands attention the keys the rows hold (max(lengths + num_new) of them, not max_len) with
    the plain causal mask when the rows are uniform; a width-bound mask (a key_padding tensor of
    max_len columns) keeps the whole view. The output is the same either way, and a one-token
    step keeps max_len columns."""
    from attnkit.caches import protocol
    from attnkit.modules.options import torch_key_padding

    q, k, v = make_qkv(2, 4, 2, 9, 9, 8, seed=4)
    num_new = torch.tensor([6, 4]) if ragged else None
    seen = []
    real = protocol.attention
    monkeypatch.setattr(protocol, "attention", lambda q_, k_, v_, m, **kw: seen.append((k_.shape[2], m)) or
                        real(q_, k_, v_, m, **kw))
    outs = {}
    for name, user in (("held", attnkit.masks.SlidingWindow(3, q_start=torch.tensor([0, 0]))),
                       ("width-bound", torch_key_padding(torch.zeros(2, 16, dtype=torch.bool), 2, None)),
                       ("none", None)):
        cache = StaticCache(2, 8, max_batch=2, max_len=16)
        with protocol.step([cache], batch=2, tokens=6, num_new=num_new) as (bound,):
            outs[name] = bound.attend(q[:, :, :6], k[:, :, :6], v[:, :, :6], user)
        with protocol.step([cache], batch=2, tokens=1) as (bound,):  # decode keeps the fixed shape
            bound.attend(q[:, :, 6:7], k[:, :, 6:7], v[:, :, 6:7], user)
    widths = [w for w, _ in seen]
    assert widths == [6, 16, 16, 16, 6, 16], widths
    if not ragged:
        assert type(seen[4][1]) is attnkit.masks.Causal and seen[4][1].q_start is None
    lens = [6, 4] if ragged else [6, 6]
    for b, n in enumerate(lens):  # row b alone over its own n keys
        want = attnkit.attention_reference(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=True)
        for name in ("none", "width-bound"):
            torch.testing.assert_close(outs[name][b:b + 1, :, :n].double(), want, atol=1e-6, rtol=1e-6)
        window = attnkit.attention_reference(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                             attnkit.masks.SlidingWindow(3) & attnkit.masks.Causal())
        torch.testing.assert_close(outs["held"][b:b + 1, :, :n].double(), window, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("make,call,exc,text", [
    (lambda: StaticCache(2, 8, max_batch=1, max_len=4), lambda c: c.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)), ValueError, "max_len 4"),
    (lambda: StaticCache(2, 8, max_batch=1, max_len=4), lambda c: c.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)), ValueError, "max_batch=1"),
    (lambda: DynamicCache(2, 8), lambda c: c.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8)), ValueError, r"\(1, 3, 1, 8\)"),
    (lambda: DynamicCache(2, 8), lambda c: c.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 2, 8)), ValueError, "do not fit"),
    (lambda: DynamicCache(2, 8), lambda c: c.update(torch.zeros(1, 2, 1, 8).half(), torch.zeros(1, 2, 1, 8).half()), TypeError, "dtype"),
    (lambda: DynamicCache(2, 8), lambda c: c.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), num_new=torch.tensor([4])), ValueError, "num_new"),
    (lambda: DynamicCache(2, 8), lambda c: c.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), num_new=torch.tensor([1.0])), ValueError, "num_new"),
    (lambda: DynamicCache(2, 0), None, ValueError, "head_dim"),
])
def test_bad_cache_input(make, call, exc, text):
    with pytest.raises(exc, match=text):
        c = make()
        call(c)


def test_batch_mismatch_after_prefill_is_an_error():
    c = DynamicCache(2, 8)
    c.update(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8))
    with pytest.raises(ValueError, match="holds 2 sequences"):
        c.update(torch.zeros(3, 2, 1, 8), torch.zeros(3, 2, 1, 8))
    with pytest.raises(ValueError, match="negative"):
        c.crop(-4)
    with pytest.raises(ValueError, match="out of range"):
        c.reorder(torch.tensor([2]))
    c.reset()
    c.update(torch.zeros(3, 2, 1, 8), torch.zeros(3, 2, 1, 8))
    assert c.lengths.tolist() == [1, 1, 1]


# --------------------------------------------------------------------------- sliding window

from attnkit import masks as M  # noqa: E402
from attnkit.caches import SlidingWindowCache  # noqa: E402


@pytest.mark.parametrize("window,rollback", [(1, 0), (4, 0), (6, 3), (40, 0)])
@pytest.mark.parametrize("chunks", [[9, 1, 1, 1, 1, 1], [3, 3, 3, 3, 1], [1] * 14, [14]], ids=["prefill+decode", "chunked", "token-by-token", "one-shot"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sliding_cache_equals_full_with_window_mask(variant, chunks, window, rollback):
    Hq, Hkv = VARIANTS[variant]
    S = sum(chunks)
    q, k, v = make_qkv(2, Hq, Hkv, S, S, 8, seed=stable_seed(variant, window, S))
    cache = SlidingWindowCache(Hkv, 8, window=window, max_rollback=rollback, max_batch=2)
    out = run_chunks(cache, q, k, v, chunks)
    full = attnkit.attention(q, k, v, M.SlidingWindow(window - 1))
    assert (out - full).abs().max() <= 1e-5
    assert cache.nbytes == 2 * 2 * Hkv * (window + rollback + 1) * 8 * 4 + 2 * 8


def test_sliding_cache_ragged_batch():
    W, Hq, Hkv, D = 3, 4, 2, 8
    lens = torch.tensor([2, 6])
    seqs = [make_qkv(1, Hq, Hkv, int(n) + 3, int(n) + 3, D, seed=10 + i) for i, n in enumerate(lens)]
    P = int(lens.max())
    padz = lambda t, n: torch.cat([t[:, :, :n], torch.full((1, t.shape[1], P - n, t.shape[3]), 1e4)], 2)
    cache = SlidingWindowCache(Hkv, D, window=W, max_batch=2)
    qp, kp, vp = (torch.cat([padz(s[j], int(n)) for s, n in zip(seqs, lens)]) for j in range(3))
    k_all, v_all, mask = cache.update(kp, vp, num_new=lens)
    out = attnkit.attention(qp, k_all, v_all, mask)
    got = [[out[b:b + 1, :, :int(n)]] for b, n in enumerate(lens)]
    for t in range(3):
        step = [torch.cat([s[j][:, :, int(n) + t:int(n) + t + 1] for s, n in zip(seqs, lens)]) for j in range(3)]
        k_all, v_all, mask = cache.update(step[1], step[2])
        o = attnkit.attention(step[0], k_all, v_all, mask)
        for b in range(2):
            got[b].append(o[b:b + 1])
    for b, s in enumerate(seqs):
        alone = attnkit.attention(*s, M.SlidingWindow(W - 1))
        assert (torch.cat(got[b], 2) - alone).abs().max() <= 1e-5


def test_sliding_cache_rollback_within_limit_and_refused_beyond():
    q, k, v = make_qkv(1, 2, 2, 12, 12, 8)
    cache = SlidingWindowCache(2, 8, window=4, max_rollback=2, max_batch=1)
    ref = run_chunks(cache, q, k, v, [8, 2])
    cache.crop(-2)
    again = run_chunks(cache, q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], [1, 1])
    torch.testing.assert_close(again, ref[:, :, 8:])
    with pytest.raises(ValueError, match="max_rollback"):
        cache.crop(-3)
    assert cache.lengths.tolist() == [10]  # refused crop changed nothing


def test_sliding_cache_reorder():
    q, k, v = make_qkv(2, 4, 2, 10, 10, 8)
    cache = SlidingWindowCache(2, 8, window=3, max_batch=2)
    run_chunks(cache, q, k, v, [9])
    cache.reorder(torch.tensor([1, 0]))
    swap = lambda t: t.flip(0)
    last = run_chunks(cache, swap(q)[:, :, 9:], swap(k)[:, :, 9:], swap(v)[:, :, 9:], [1])
    torch.testing.assert_close(last, attnkit.attention(swap(q), swap(k), swap(v), M.SlidingWindow(2))[:, :, 9:])


def _all_kinds(Hkv=2, D=8, B=2):
    return {
        "dynamic": lambda: DynamicCache(Hkv, D),
        "static": lambda: StaticCache(Hkv, D, max_batch=B, max_len=32),
        "sliding": lambda: SlidingWindowCache(Hkv, D, window=4, max_batch=B),
        "paged": lambda: PagedKVCache(Hkv, D, num_blocks=16, block_size=4),
    }


def _snapshot(cache):
    """Everything a later step can read: lengths and each row's committed K/V (the whole ring for
    a sliding cache, whose slots a step overwrites)."""
    lens = cache.lengths.tolist()
    if isinstance(cache, SlidingWindowCache):
        return lens, [cache.k_ring.clone(), cache.v_ring.clone()]
    if isinstance(cache, PagedKVCache):
        a = cache.allocator
        rows = [a.blocks(s) for s in a.batch]
        return lens, [torch.cat([cache.k_pool[list(r)].flatten(0, 1)[:n] for r, n in zip(rows, lens)]),
                      torch.cat([cache.v_pool[list(r)].flatten(0, 1)[:n] for r, n in zip(rows, lens)])]
    return lens, [torch.cat([cache.k_buf[b, :, :n] for b, n in enumerate(lens)], 1),
                  torch.cat([cache.v_buf[b, :, :n] for b, n in enumerate(lens)], 1)]


BAD_CALLS = {
    "mask shape": lambda c, q, k, v: c.attend(q, k, v, torch.ones(2, 1, 1, 99, dtype=torch.bool)),
    "unknown backend": lambda c, q, k, v: c.attend(q, k, v, backend="nope"),
    "refusing backend": lambda c, q, k, v: c.attend(q, k, v, backend="flex", return_weights=True),
    "nan scale": lambda c, q, k, v: c.attend(q, k, v, scale=float("nan")),
    "bad q": lambda c, q, k, v: c.attend(q[:, :, :, :5], k, v),
    "bad k": lambda c, q, k, v: c.attend(q, k[:, :1], v),
    "bad num_new": lambda c, q, k, v: c.attend(q, k, v, num_new=torch.tensor([3, 1])),
}


@pytest.mark.parametrize("call", list(BAD_CALLS))
@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged"])
def test_a_failing_call_leaves_the_cache_unchanged(kind, call):
    """Exception safety: a call that raises leaves lengths and contents exactly as before, and the
    next valid call equals an untouched twin's."""
    make = _all_kinds()[kind]
    cache, twin = make(), make()
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, seed=3)
    for c in (cache, twin):
        c.attend(q, k, v)
    before = _snapshot(cache)
    q1, k1, v1 = make_qkv(2, 4, 2, 1, 1, 8, seed=4)
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        BAD_CALLS[call](cache, q1, k1, v1)
    after = _snapshot(cache)
    assert after[0] == before[0]
    for x, y in zip(after[1], before[1]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(cache.attend(q1, k1, v1), twin.attend(q1, k1, v1), rtol=0, atol=0)
    if kind == "paged":
        assert cache.allocator.num_free == twin.allocator.num_free
        assert cache.allocator.open_step is None


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged"])
def test_a_step_over_several_layers_commits_in_all_or_none(kind):
    make = _all_kinds()[kind]
    if kind == "paged":
        alloc = BlockAllocator(32, 4)
        caches = [PagedKVCache(2, 8, allocator=alloc) for _ in range(3)]
    else:
        caches = [make() for _ in range(3)]
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, seed=1)
    with attnkit.caches.step(caches, batch=2, tokens=5) as bound:
        outs = [c.attend(q, k, v) for c in bound]
    assert all(c.lengths.tolist() == [5, 5] for c in caches)
    window = attnkit.masks.SlidingWindow(3) if kind == "sliding" else None  # the sliding cache's window is 4
    torch.testing.assert_close(outs[2], attnkit.attention(q, k, v, window, causal=True))
    q1, k1, v1 = make_qkv(2, 4, 2, 1, 1, 8, seed=2)
    with pytest.raises(ValueError, match="mask"):
        with attnkit.caches.step(caches, batch=2, tokens=1) as bound:
            bound[0].attend(q1, k1, v1)
            bound[1].attend(q1, k1, v1)
            bound[2].attend(q1, k1, v1, torch.ones(1, 1, 1, 3, dtype=torch.bool))  # the last layer fails
    assert all(c.lengths.tolist() == [5, 5] for c in caches)  # no layer kept the token
    with attnkit.caches.step(caches, batch=2, tokens=1) as bound:
        got = [c.attend(q1, k1, v1) for c in bound]
    want = attnkit.attention(torch.cat([q, q1], 2), torch.cat([k, k1], 2), torch.cat([v, v1], 2), window,
                             causal=True)[:, :, 5:]
    torch.testing.assert_close(got[0], want)
    assert all(c.lengths.tolist() == [6, 6] for c in caches)


def test_shared_paged_allocator_needs_an_explicit_step():
    alloc = BlockAllocator(16, 4)
    caches = [PagedKVCache(2, 8, allocator=alloc) for _ in range(2)]
    q, k, v = make_qkv(1, 4, 2, 3, 3, 8)
    with pytest.raises(RuntimeError, match="attnkit.caches.step"):
        caches[0].attend(q, k, v)
    with pytest.raises(RuntimeError, match="attnkit.caches.reorder"):
        caches[0].reorder(torch.tensor([0]))
    with attnkit.caches.step(caches, batch=1, tokens=3) as bound:
        for c in bound:
            c.attend(q, k, v)
    attnkit.caches.reorder(caches, torch.tensor([0, 0]))  # once for the allocator, not once per layer
    assert alloc.batch == (0, 1) and caches[1].lengths.tolist() == [3, 3]
    attnkit.caches.crop(caches, -1)
    assert caches[0].lengths.tolist() == [2, 2]


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_reorder_refuses_bool_and_float_indices(kind):
    cache = _all_kinds()[kind]()
    q, k, v = make_qkv(2, 4, 2, 3, 3, 8)
    cache.attend(q, k, v)
    for bad in (torch.tensor([True, False]), torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]])):
        with pytest.raises(ValueError, match="indices"):
            cache.reorder(bad)
    assert cache.lengths.tolist() == [3, 3]


def test_attend_takes_what_attention_takes():
    q, k, v = make_qkv(2, 4, 2, 6, 6, 8, seed=7)
    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    got = DynamicCache(2, 8).attend(q, k, v, keep)  # a bool tensor, ANDed with the cache's causal mask
    want = attnkit.attention(q, k, v, attnkit.masks.Dense(keep) & attnkit.masks.Causal())
    torch.testing.assert_close(got, want)
    assert attnkit.caches.new_cache("dynamic", (2, 8, 8)).bytes_per_token == 2 * 16 * 4  # fp32 by default


def _ragged_cache(kind):
    """A cache of ``kind`` (B=2, Hkv=2, D=8) after a ragged prefill (lengths [5, 2]), whose padding
    tokens hold NaN (they must never be read as K/V)."""
    cache = _all_kinds()[kind]()
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, seed=3)
    k[1, :, 2:] = float("nan")
    v[1, :, 2:] = float("nan")
    cache.attend(q, k, v, num_new=torch.tensor([5, 2]))
    return cache


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged"])
def test_an_aborted_step_leaves_no_rows_that_a_backend_could_read_as_nan(kind):
    """Rows an aborted step wrote are zeroed and a ragged step's padding tokens are stored as
    zeros, so no row past the committed lengths holds NaN that sdpa or math (which multiply
    masked V rows by probability 0) would turn into a NaN output: every backend agrees with an
    untouched twin."""
    cache, twin = _ragged_cache(kind), _ragged_cache(kind)
    q, k, v = make_qkv(2, 4, 2, 3, 3, 8, seed=4)
    k.fill_(float("nan"))
    v.fill_(float("inf"))
    with pytest.raises(ValueError, match="mask"):
        cache.attend(q, k, v, torch.ones(1, 1, 1, 99, dtype=torch.bool))
    q1, k1, v1 = make_qkv(2, 4, 2, 1, 1, 8, seed=5)
    outs = []
    for c in (cache, twin):
        with c.transaction(2, 1) as bound:
            k_all, v_all, mask = bound.update(k1, v1)
            outs.append({b: attnkit.attention(q1, k_all, v_all, mask, backend=b) for b in ("sdpa", "math", "decode")})
            if kind == "paged":  # the blocks as attention reads them in place
                kv, _, m = bound.cache.view(bound.step)
                outs[-1]["paged"] = attnkit.attention(q1, kv, None, m, backend="paged")
    for name, out in outs[0].items():
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out, outs[1][name], rtol=0, atol=0)
        torch.testing.assert_close(out, outs[0]["math"])


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged"])
def test_a_failed_first_step_leaves_the_cache_empty(kind):
    """A failed first step leaves an empty cache empty: a StaticCache's lengths stay [] (not
    [0, 0]) and a DynamicCache keeps 0 bytes (no first capacity)."""
    cache, twin = _all_kinds()[kind](), _all_kinds()[kind]()
    before = (cache.lengths.tolist(), cache.nbytes)
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, seed=6)
    with pytest.raises(ValueError, match="mask"):
        cache.attend(q, k, v, torch.ones(1, 1, 1, 99, dtype=torch.bool))
    assert (cache.lengths.tolist(), cache.nbytes) == before
    if kind == "paged":
        assert cache.allocator.num_free == cache.allocator.num_blocks and cache.allocator.sequences == ()
    torch.testing.assert_close(cache.attend(q, k, v), twin.attend(q, k, v), rtol=0, atol=0)


def test_a_transaction_commits_on_success_and_aborts_on_error():
    cache = DynamicCache(2, 8)
    q, k, v = make_qkv(2, 4, 2, 3, 3, 8, seed=7)
    with pytest.raises(RuntimeError, match="boom"):
        with cache.transaction(2, 3) as c:
            c.update(k, v)
            raise RuntimeError("boom")
    assert cache.lengths.tolist() == [] and cache.nbytes == 0
    with cache.transaction(2, 3) as c:
        k_all, v_all, mask = c.update(k, v)
    assert cache.lengths.tolist() == [3, 3]
    torch.testing.assert_close(attnkit.attention(q, k_all, v_all, mask), attnkit.attention(q, k, v, causal=True))


CROP_KINDS = {  # (cache maker(kv_dtype), backends that read this cache's view)
    "dynamic": lambda kvd: DynamicCache(2, 8, kv_dtype=kvd),
    "static": lambda kvd: StaticCache(2, 8, max_batch=2, max_len=16, kv_dtype=kvd),
    "sliding": lambda kvd: SlidingWindowCache(2, 8, window=4, max_batch=2, max_rollback=3, kv_dtype=kvd),
    "paged": lambda kvd: PagedKVCache(2, 8, num_blocks=8, block_size=4, kv_dtype=kvd),
    "latent-dynamic": lambda kvd: DynamicCache(1, 8, 6, value_from_key=True, kv_dtype=kvd),
    "latent-static": lambda kvd: StaticCache(1, 8, 6, value_from_key=True, max_batch=2, max_len=16, kv_dtype=kvd),
    "latent-paged": lambda kvd: PagedKVCache(1, 8, 6, value_from_key=True, num_blocks=8, block_size=4, kv_dtype=kvd),
}


def _spec_step(cache, prompt, draft, keep):
    """Prefill ``prompt`` (q, k, v), then append ``draft`` as one 3-token verification step and
    crop it back to ``keep`` (an int or per-row tensor, as ``crop`` takes it)."""
    for q, k, v in (prompt, draft):
        cache.attend(q, k, None if cache.value_from_key else v)
    cache.crop(keep)


@pytest.mark.parametrize("tokens", [1, 2], ids=["decode", "two-token step"])
@pytest.mark.parametrize("keep", ["int", "per-row"])
@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("kind", list(CROP_KINDS))
def test_a_cropped_cache_leaves_no_rows_that_a_backend_could_read_as_nan(kind, kv_dtype, keep, tokens):
    """``crop`` (rolling back rejected speculative tokens) zeroes the dropped rows, data and
    scales, as ``write`` and ``abort`` do: rejected K/V holding NaN / inf never reach a backend
    that multiplies masked rows by probability 0. Every backend over the cropped cache gives
    the oracle over the kept keys: a twin that never held the rejected tokens."""
    make = CROP_KINDS[kind]
    cache, twin = make(kv_dtype), make(kv_dtype)
    Hkv, D = cache.num_kv_heads, cache.head_dim
    Dv = cache.v_head_dim
    g = torch.Generator().manual_seed(stable_seed(kind, str(kv_dtype), keep, tokens))
    rnd = lambda S, H, d: torch.randn(2, H, S, d, generator=g)
    prompt = (rnd(5, 4, D), rnd(5, Hkv, D), rnd(5, Hkv, Dv))
    draft = [rnd(3, 4, D), rnd(3, Hkv, D), rnd(3, Hkv, Dv)]
    kept = torch.tensor([7, 6]) if keep == "per-row" else torch.tensor([6, 6])  # of the 8 tokens
    rejected = torch.arange(5, 8)[None] >= kept[:, None]  # (B, 3) draft tokens rolled back
    clean = [t.clone() for t in draft]
    for t, bad in zip(draft[1:], (float("nan"), float("inf"))):  # K NaN, V inf where rejected
        t[rejected[:, None, :, None].expand_as(t)] = bad
    if kind.startswith("latent"):  # V is read from K: put inf in K's V channels, NaN in the rest
        draft[1][..., :Dv] = torch.where(rejected[:, None, :, None], float("inf"), draft[1][..., :Dv])
    _spec_step(cache, prompt, draft, -2 if keep == "int" else kept)
    for q, k, v in (prompt, clean):
        twin.attend(q, k, None if twin.value_from_key else v, num_new=None if q is prompt[0] else kept - 5)
    assert cache.lengths.tolist() == twin.lengths.tolist() == kept.tolist()
    q1, k1, v1 = rnd(tokens, 4, D), rnd(tokens, Hkv, D), rnd(tokens, Hkv, Dv)
    v1 = None if cache.value_from_key else v1
    backends = ["auto", "sdpa", "math", "decode"] + (["paged"] if "paged" in kind else [])
    with twin.transaction(2, tokens) as bound:
        k_all, v_all, mask = bound.update(k1, v1)
        gold = attnkit.attention_reference(q1.double(), k_all.double(), v_all.double(), mask)
    with cache.transaction(2, tokens) as bound:
        bound.cache.write(bound.step, k1, v1)
        kv, v_view, mask = bound.cache.view(bound.step)
        k_dense, v_dense, dense_mask = bound.cache.view(bound.step, dense=True)
        for b in backends:
            out = attnkit.attention(q1, kv, v_view, mask, backend=b)
            assert torch.isfinite(out).all(), b
            torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5, msg=lambda m: f"{b}: {m}")
            if b != "paged":  # the dense view (what update() returns), on the same backend
                out = attnkit.attention(q1, k_dense, v_dense, dense_mask, backend=b)
                assert torch.isfinite(out).all(), f"{b} (dense view)"
                torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["float", "int8"])
@pytest.mark.parametrize("kind", list(CROP_KINDS))
def test_a_reset_cache_leaves_no_rows_of_the_last_sequences(kind, kv_dtype):
    """``reset`` zeroes the rows its sequences held (buffers are reused): a later, shorter ragged
    batch never has the last conversation's K/V (inf here) in a masked row, and every backend
    equals a fresh cache's result."""
    make = CROP_KINDS[kind]
    cache, fresh = make(kv_dtype), make(kv_dtype)
    Hkv, D, Dv = cache.num_kv_heads, cache.head_dim, cache.v_head_dim
    g = torch.Generator().manual_seed(stable_seed(kind, str(kv_dtype)))
    rnd = lambda S, H, d: torch.randn(2, H, S, d, generator=g)
    k_old, v_old = rnd(8, Hkv, D), rnd(8, Hkv, Dv)
    k_old[:, :, 2:, :Dv] = float("inf")  # V (or the V channels of a latent K): inf past position 2
    v_old[:, :, 2:] = float("inf")
    cache.attend(rnd(8, 4, D), k_old, None if cache.value_from_key else v_old)
    cache.reset()
    prompt = (rnd(3, 4, D), rnd(3, Hkv, D), rnd(3, Hkv, Dv))
    q1, k1, v1 = rnd(1, 4, D), rnd(1, Hkv, D), rnd(1, Hkv, Dv)
    outs = []
    for c in (cache, fresh):
        q, k, v = prompt
        c.attend(q, k, None if c.value_from_key else v, num_new=torch.tensor([3, 1]))
        with c.transaction(2, 1) as bound:
            bound.cache.write(bound.step, k1, None if c.value_from_key else v1)
            kv, v_view, mask = bound.cache.view(bound.step)
            outs.append({b: attnkit.attention(q1, kv, v_view, mask, backend=b) for b in ("auto", "sdpa", "math")})
    for b, out in outs[0].items():
        assert torch.isfinite(out).all(), b
        torch.testing.assert_close(out, outs[1][b], rtol=0, atol=0)


def test_a_sliding_step_holds_no_padding_tokens_in_its_own_view():
    """A ragged multi-token step over a sliding cache attends over the ring and the step's own
    tokens: its padding tokens (NaN / inf here) are stored as 0 there too, as the contiguous
    caches store them, so the valid queries of a short row stay finite on every backend."""
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, seed=8)
    k[1, :, 2:] = float("nan")
    v[1, :, 2:] = float("inf")
    for b in ("auto", "sdpa", "math", "decode"):
        cache = SlidingWindowCache(2, 8, window=4, max_batch=2)
        out = cache.attend(q, k, v, num_new=torch.tensor([5, 2]), backend=b)
        want = attnkit.attention_reference(q[1:, :, :2], k[1:, :, :2], v[1:, :, :2], causal=True)
        assert torch.isfinite(out[:, :, :2]).all(), b
        torch.testing.assert_close(out[1:, :, :2].double(), want.double(), atol=1e-5, rtol=1e-5)


def test_old_spellings_still_work_with_a_deprecation_warning():
    """Renamed arguments and attributes: ``kv_heads`` -> ``num_kv_heads`` (cache constructors and
    properties, PagedKV / QuantizedKV), ``context_lengths`` -> ``lengths`` (BlockAllocator),
    ``CacheStep.old`` -> ``q_start``, ``QuantizedKV.pages()`` -> ``paged_kv()``,
    ``cache_offsets`` -> ``cache_q_start`` (modules.options), the ``attnkit.caches.base`` import
    path."""
    import importlib

    for make in (lambda **kw: DynamicCache(head_dim=8, **kw), lambda **kw: StaticCache(head_dim=8, max_batch=1,
                 max_len=4, **kw), lambda **kw: SlidingWindowCache(head_dim=8, window=2, max_batch=1, **kw),
                 lambda **kw: PagedKVCache(head_dim=8, num_blocks=2, **kw)):
        with pytest.warns(DeprecationWarning, match="num_kv_heads"):
            cache = make(kv_heads=2)
        assert cache.num_kv_heads == 2
        with pytest.warns(DeprecationWarning, match="num_kv_heads"):
            assert cache.kv_heads == 2
        with pytest.raises(TypeError, match="both"):
            make(kv_heads=2, num_kv_heads=2)
    cache = PagedKVCache(2, 8, num_blocks=4, block_size=2)
    cache.attend(*make_qkv(1, 4, 2, 3, 3, 8))
    with pytest.warns(DeprecationWarning, match="lengths"):
        assert cache.allocator.context_lengths().tolist() == [3]
    kv = cache.view(cache.begin(1, 1))[0]
    cache.abort(cache.allocator.open_step)
    with pytest.warns(DeprecationWarning, match="num_kv_heads"):
        assert kv.kv_heads == 2
    qkv = attnkit.QuantizedKV.quantize(cache.k_pool, cache.v_pool, block_table=kv.block_table, lengths=kv.lengths)
    with pytest.warns(DeprecationWarning, match="paged_kv"):
        assert qkv.pages().num_kv_heads == 2
    step = DynamicCache(2, 8).begin(2, 1)
    with pytest.warns(DeprecationWarning, match="q_start"):
        assert step.old.tolist() == [0, 0]
    base = importlib.import_module("attnkit.caches.base")
    with pytest.warns(DeprecationWarning, match="attnkit.caches.contiguous"):
        assert base.StaticCache is StaticCache
    from attnkit.modules.options import cache_offsets, cache_q_start

    dyn = DynamicCache(2, 8)
    dyn.update(*make_qkv(2, 4, 2, 3, 3, 8)[1:])
    with pytest.warns(DeprecationWarning, match="cache_q_start"):
        assert cache_offsets(dyn, 2, "cpu").tolist() == cache_q_start(dyn, 2, "cpu").tolist() == [3, 3]
