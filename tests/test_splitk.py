"""The CPU split-K engine (the decode and paged backends), on both implementations: the native
kernel and the pure-torch fallback. Rule R against the fp64 oracle over dtypes, head groupings,
query lengths, head dims (odd ones and MLA's V-from-K prefix) and every mask kind; rows with
nothing to attend to; NaN propagation; the log-sum-exp; long contexts, strided caches, ragged
lengths; and the process-state contract (torch's thread count, in this and other threads)."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends.decode import splitk

from conftest import DTYPES, base_attention, make_qkv, rule_r, stable_seed


def _masks(B, Sq, Sk, g):
    lens = torch.randint(0, Sk + 1, (B,), generator=g)
    lens[0] = 0  # a row with no key at all
    offs = torch.randint(0, Sk, (B,), generator=g)
    dense = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    add = torch.randn(1, 1, Sq, Sk, generator=g).masked_fill(torch.rand(Sq, Sk, generator=g) > 0.8, float("-inf"))
    return {
        "none": (None, False),
        "causal": (None, True),
        "padding_right": (M.KeyPadding(lens), False),
        "padding_left_causal": (M.KeyPadding(lens, side="left"), True),
        "window": (M.SlidingWindow(5), False),
        "offsets_padding": (M.Causal(q_start=offs) & M.KeyPadding(lens), False),
        "query_padding": (M.QueryPadding(torch.randint(0, Sq + 1, (B,), generator=g)), False),
        "dense": (dense, False),
        "additive": (add, True),
    }


MASKS = list(_masks(2, 3, 5, torch.Generator().manual_seed(0)))
# (B, Hkv, G), Sq, (D, Dv): a pairwise-ish sample of the product, large cases included.
CASES = [((1, 1, 1), 1, (16, 16)), ((1, 2, 4), 4, (7, 7)), ((3, 1, 8), 16, (80, 80)), ((2, 3, 2), 1, (64, 48)),
         ((2, 1, 16), 1, (576, 512)), ((1, 2, 4), 16, (16, 16)), ((3, 1, 8), 4, (7, 7)), ((2, 3, 2), 4, (80, 80))]


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_matches_the_oracle(implementation, dtype, case, mask_name):
    (B, Hkv, G), Sq, (D, Dv) = CASES[case]
    seed = stable_seed(dtype, case, mask_name)
    Sk = 93 if D < 576 else 60
    g = torch.Generator().manual_seed(seed)
    mask, causal = _masks(B, Sq, Sk, g)[mask_name]
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, Sk, D, Dv=Dv, dtype=DTYPES[dtype], seed=seed)
    if D == 576:  # MLA's latent: V is the first 512 channels of K (the same memory)
        v = k[..., :Dv]
    out = attnkit.attention(q, k, v, mask, causal=causal, backend="decode")
    gold = attnkit.attention_reference(q, k, v, mask, causal=causal)
    rule_r(out, base_attention(q, k, v, mask, causal=causal), gold, n_terms=max(Sk, D))
    empty = ~attnkit.masks.as_mask(mask, causal).materialize(B, Sq, Sk).any(-1) if (mask is not None or causal) \
        else torch.zeros(1, 1, Sq, dtype=torch.bool)
    assert (out.masked_select(empty.unsqueeze(-1).expand_as(out)) == 0).all()  # nothing visible -> exactly 0


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_decode_step_reads_right_padding_lengths_as_they_are(implementation, dtype):
    """One query per row over dense K/V with a right KeyPadding (a static cache's decode step):
    the engine hands the lengths to the kernel as its key bounds. A length past Sk allows every key
    (never a read past the buffer), 0 none (an exact zero row); the caller's lengths stay as given."""
    Sk = 70
    lens = torch.tensor([Sk + 5, 0, 33, Sk])
    given = lens.clone()
    q, k, v = make_qkv(4, 8, 2, 1, Sk, 32, dtype=DTYPES[dtype], seed=stable_seed(dtype, "decode-lengths"))
    mask = M.KeyPadding(lens)
    out = attnkit.attention(q, k, v, mask, backend="decode")
    rule_r(out, base_attention(q, k, v, mask), attnkit.attention_reference(q, k, v, mask), n_terms=Sk)
    assert (out[1] == 0).all() and torch.equal(lens, given)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_paged_pages_match_the_oracle(implementation, dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    B, Hkv, G, Sq, D = 3, 2, 4, 3, 24
    lens = torch.tensor([50, 0, 33])
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, 50, D, dtype=DTYPES[dtype], seed=block_size)
    W = -(-50 // block_size)
    N = B * W + 5
    table = torch.randperm(N, generator=g)[:B * W].view(B, W)
    pk = torch.zeros(N, block_size, Hkv, D, dtype=q.dtype)
    pv = torch.zeros_like(pk)
    pos = torch.arange(50)
    for b in range(B):
        pk[table[b, pos // block_size], pos % block_size] = k[b].transpose(0, 1)
        pv[table[b, pos // block_size], pos % block_size] = v[b].transpose(0, 1)
    mask = M.Causal(q_start=(lens - Sq).clamp(min=0))
    out = attnkit.attention(q, attnkit.PagedKV(pk, pv, table, lens), None, mask, backend="paged")
    full = mask & M.KeyPadding(lens)
    rule_r(out, base_attention(q, k, v, full), attnkit.attention_reference(q, k, v, full), n_terms=50)
    assert (out[1] == 0).all()
    latent = attnkit.attention(q, attnkit.PagedKV(pk, None, table, lens, v_head_dim=16), None, mask, backend="paged")
    want = attnkit.attention_reference(q, k, k[..., :16], full)
    rule_r(latent, base_attention(q, k, k[..., :16], full), want, n_terms=50)


def test_nan_in_a_visible_row_gives_nan_there_only(implementation):
    q, k, v = make_qkv(2, 4, 2, 2, 40, 16, seed=1)
    q[0, 1, 0, 3] = float("nan")  # one query row
    k[1, 0, 7, 0] = float("nan")  # a key every query of sequence 1, KV head 0 sees
    out = attnkit.attention(q, k, v, M.KeyPadding(torch.tensor([40, 40])), backend="decode")
    assert torch.isnan(out[0, 1, 0]).all()
    assert torch.isnan(out[1, :2]).all()  # query heads 0, 1 use KV head 0
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 2:]).all() and torch.isfinite(out[1, 2:]).all()
    v2 = v.clone()
    v2[0, 1, 5] = float("nan")  # a value row seen by KV head 1's queries
    out = attnkit.attention(q, k, v2, backend="decode")
    assert torch.isnan(out[0, 2:]).all() and torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("Sk", [1, 5, 13, 17, 31])
def test_a_short_call_after_a_long_one_reads_only_its_own_keys(implementation, Sk):
    """A tile's softmax reads its n keys rounded up to whole vectors, not the tile's capacity: the
    scratch a long call left (probabilities past n) must not reach a short call, and a NaN in its
    last key still poisons the heads that see it."""
    q, k, v = make_qkv(1, 8, 2, 1, 3000, 16, seed=5)
    attnkit.attention(q, k, v, backend="decode")  # fills the thread's scratch with whole tiles
    q, k, v = make_qkv(1, 8, 2, 1, Sk, 16, seed=6 + Sk)
    out = attnkit.attention(q, k, v, backend="decode")
    rule_r(out, base_attention(q, k, v), attnkit.attention_reference(q, k, v), n_terms=16)
    k[0, 1, Sk - 1, 0] = float("nan")  # KV head 1's last key: query heads 4-7
    out = attnkit.attention(q, k, v, backend="decode")
    assert torch.isnan(out[0, 4:]).all() and torch.isfinite(out[0, :4]).all()


def test_softcap_sinks_and_lse_against_an_fp64_reference(implementation):
    g = torch.Generator().manual_seed(2)
    B, Hkv, G, Sq, Sk, D = 2, 2, 3, 2, 70, 16
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, Sk, D, seed=3)
    sinks = torch.randn(Hkv * G, generator=g)
    lens = torch.tensor([70, 0])
    mask = M.KeyPadding(lens)
    out, lse = splitk.splitk_attention(q, k, v, scale=0.3, mask=mask, softcap=4.0, sinks=sinks, return_lse=True)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(G, 1)) * 0.3
    s = torch.tanh(s / 4.0) * 4.0
    s[1] = float("-inf")
    want_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - want_lse[0].max())
    den = p.sum(-1, keepdim=True) + torch.exp(sinks.double().view(1, -1, 1, 1) - want_lse[0].max())
    want = (p / den) @ v.double().repeat_interleave(G, 1)
    torch.testing.assert_close(out[0].double(), want[0], atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    torch.testing.assert_close(lse[0].double(), want_lse[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_long_contexts_strided_caches_and_ragged_lengths(implementation, dtype):
    """Several threads' worth of slices of unequal length, read through a preallocated buffer's
    strides (a slice of a cache), at the engine's default settings."""
    buf_k = torch.randn(3, 2, 6000, 64).to(DTYPES[dtype])
    buf_v = torch.randn(3, 2, 6000, 64).to(DTYPES[dtype])
    k, v = buf_k[:, :, :5000], buf_v[:, :, :5000]
    q = torch.randn(3, 8, 2, 64).to(DTYPES[dtype])
    mask = M.Causal(q_start=torch.tensor([4998, 10, 2000])) & M.KeyPadding(torch.tensor([5000, 12, 2002]))
    out = attnkit.attention(q, k, v, mask, backend="decode")
    rule_r(out, base_attention(q, k, v, mask), attnkit.attention_reference(q, k, v, mask), n_terms=5000)


def test_never_changes_torch_threads_in_this_or_other_threads(implementation):
    """The engine never changes torch's thread count, not even while it runs: a thread whose first
    torch op overlapped a change would keep the changed count for life. Whoever looks, whenever,
    sees the count unchanged."""
    before = torch.get_num_threads()
    q, k, v = make_qkv(2, 8, 2, 1, 20000, 64, seed=5)
    seen, errors = [], []
    stop = threading.Event()

    def engine_calls():
        try:
            for _ in range(5):
                attnkit.attention(q, k, v, backend="decode")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    def newcomer():  # a fresh thread doing torch work while engine calls run
        while not stop.is_set():
            torch.ones(64, 64) @ torch.ones(64, 64)
            seen.append(torch.get_num_threads())

    workers = [threading.Thread(target=engine_calls), threading.Thread(target=newcomer)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors and seen and set(seen) == {before}
    assert torch.get_num_threads() == before
    late = []
    t = threading.Thread(target=lambda: late.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert late == [before]


def test_calls_from_several_threads_at_once_are_correct(implementation):
    cases = [make_qkv(2, 8, 2, 1, 3000, 32, seed=s) for s in range(4)]
    want = [attnkit.attention_reference(*c) for c in cases]
    got = [None] * 4

    def run(i):
        got[i] = attnkit.attention(*cases[i], backend="decode")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_describe_call_names_the_implementation(implementation):
    """A forced backend names the engine it runs on; ``auto`` takes the engine only where it is
    native (without it, the calls SDPA can run go to SDPA)."""
    q, k, v = make_qkv(1, 8, 2, 1, 5000, 64)
    assert splitk.implementation() == implementation
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.to(dtype) for t in (q, k, v))
        assert attnkit.describe_call(q, k, v, backend="decode", detail=True) == f"decode[{implementation}]"
        got = attnkit.describe_call(q, k, v, detail=True)
        assert got == "decode[native]" if implementation == "native" else got.startswith("sdpa"), got


def test_bad_paged_tables_are_refused(implementation):
    """A table entry in use outside the pool raises a ValueError naming the block table, also when
    the caller vouched for it (``checked=True``): the engine never reads outside the pool."""
    pk = torch.zeros(4, 2, 1, 8)
    q = torch.randn(1, 2, 1, 8)
    bad = attnkit.PagedKV(pk, pk, torch.tensor([[0, 9]]), torch.tensor([4]))
    with pytest.raises(ValueError, match="block_table"):
        attnkit.attention(q, bad, None)
    for entry in (9, -1):
        trusted = attnkit.PagedKV(pk, pk, torch.tensor([[0, entry]]), torch.tensor([4]), checked=True)
        with pytest.raises(ValueError, match=r"block_table.*outside the pool"):
            attnkit.attention(q, trusted, None, backend="paged")


def test_head_dim_one_keys_with_any_last_stride_are_accepted(implementation):
    """A size-1 last dim has no meaningful stride (torch calls k contiguous whatever it is): the
    engine reads it as it is instead of refusing "k must be 4-D with unit stride"."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 8, 1, 8192, generator=g).transpose(2, 3)  # (1, 8, 8192, 1), last stride 8192
    v = torch.randn(1, 8, 1, 8192, generator=g).transpose(2, 3)
    q = torch.randn(1, 8, 1, 1, generator=g)
    assert k.is_contiguous() and k.stride(-1) == 8192
    out = attnkit.attention(q, k, v, backend="decode")
    rule_r(out, base_attention(q, k, v), attnkit.attention_reference(q, k, v), n_terms=8192)


@pytest.mark.parametrize("Sk", [300, 8000])
def test_a_long_single_threaded_walk_stays_within_twice_the_math_error(Sk):
    """At one thread a unit walks thousands of keys. Each tile's P @ V terms are summed on their
    own and then added to the running total, so the error does not grow with the key count (as
    adding every key's term to one running total would): rule R's 2x against the math backend
    (with its rounding floor only, no accumulation allowance), at 300 and 8000 identical keys."""
    if splitk.implementation() != "native":
        pytest.skip("the native kernel's summation order")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for D, G, seed in ((16, 1, 0), (16, 8, 1), (64, 1, 2), (64, 8, 3)):
            g = torch.Generator().manual_seed(seed)
            q = torch.rand(1, 2 * G, 16, D, generator=g, dtype=torch.float64).float()
            k = torch.rand(1, 2, 1, D, generator=g, dtype=torch.float64).float().expand(1, 2, Sk, D).contiguous()
            v = torch.rand(1, 2, Sk, D, generator=g, dtype=torch.float64).float()  # positive: the sum grows
            gold = attnkit.attention_reference(q, k, v)
            err = {b: (attnkit.attention(q, k, v, backend=b).double() - gold).abs().max().item()
                   for b in ("decode", "math")}
            floor = 2 * ((gold.float() + 0.3) - 0.3 - gold).abs().max().item()
            assert err["decode"] <= 2 * err["math"] + floor, (D, G, err, floor)
    finally:
        torch.set_num_threads(before)


def test_queries_that_do_not_fit_the_pages_name_both():
    """Paged K/V: q is checked against the pools and the table, with errors naming both."""
    pk = torch.zeros(4, 2, 2, 8)
    kv = attnkit.PagedKV(pk, pk, torch.tensor([[0, 1], [2, 3]]), torch.tensor([4, 3]))
    cases = [
        (torch.randn(2, 4, 1, 8, dtype=torch.float64), TypeError, r"q and the paged K/V must share a dtype.*float64"),
        (torch.randn(3, 4, 1, 8), ValueError, r"batch sizes differ: q \(3, 4, 1, 8\), block_table \(2, 2\)"),
        (torch.randn(2, 4, 1, 16), ValueError, r"same head dim: q \(2, 4, 1, 16\), k paged"),
        (torch.randn(2, 3, 1, 8), ValueError, r"multiple of key/value heads"),
        (torch.randn(2, 4, 8), ValueError, r"q must have 4 dims"),
        ("q", TypeError, r"q must be a torch.Tensor"),
        (torch.zeros(2, 4, 1, 8, dtype=torch.long), TypeError, r"q must be fp16, bf16, fp32 or fp64"),
    ]
    for q, err, msg in cases:
        with pytest.raises(err, match=msg):
            attnkit.attention(q, kv, None)
    assert attnkit.attention(torch.randn(2, 4, 1, 8), kv, None).shape == (2, 4, 1, 8)


def test_native_build_targets_the_running_cpu_unless_told(monkeypatch, tmp_path):
    """-march=native by default; ATTNKIT_NATIVE_MARCH builds another target (the AVX2 code path
    on an AVX-512 machine, say), under its own cache key."""
    from pathlib import Path

    from attnkit import native

    monkeypatch.delenv("ATTNKIT_NATIVE_MARCH", raising=False)
    cmd = native._command("c++", [Path("src.cpp")], Path("out.so"), True)
    assert "-march=native" in cmd
    assert not any(c.startswith("-march") for c in native._command("c++", [Path("src.cpp")], Path("out.so"), False))
    monkeypatch.setenv("ATTNKIT_NATIVE_MARCH", "haswell")
    assert "-march=haswell" in native._command("c++", [Path("src.cpp")], Path("out.so"), True)
