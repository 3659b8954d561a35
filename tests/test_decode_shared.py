"""The decode kernel's one-pass path for V = K[..., :Dv] (MLA's latent cache, where V is a prefix
view of K): each K chunk is read once with an online softmax across chunks. Checked against the
fp64 oracle (rule R) and against the same call on a contiguous copy of V (the two-pass path)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import DynamicCache
from attnkit import masks as M
from attnkit.backends import _decode_kernel as kern

from conftest import base_attention, make_qkv, rule_r, stable_seed

D, DV = 24, 16  # K = [latent (16) | rope (8)], V = K[..., :16]


@pytest.fixture
def one_pass_calls(monkeypatch):
    """Fast path for any size, 64-row chunks (so every call streams several chunks, the last
    one partial), threads for any size (so the context split and the merge run). Yields the
    list of unit lists the one-pass function was called with."""
    monkeypatch.setattr(kern, "_MIN_UNIT_ELEMS_HALF", 0)
    monkeypatch.setattr(kern, "_MIN_UNIT_ELEMS_FP32", 0)
    monkeypatch.setattr(kern, "_MIN_ELEMS_PER_THREAD", 1)
    monkeypatch.setattr(kern, "_CHUNK_BYTES", 64 * 4 * D)
    monkeypatch.setattr(kern, "_CHUNK_BYTES_ONE_PASS", 64 * 4 * D)
    calls = []
    real = kern._one_pass_units

    def spy(units, *args):
        calls.append(list(units))
        return real(units, *args)

    monkeypatch.setattr(kern, "_one_pass_units", spy)
    return calls


def _threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return saved


def _check_shared(q, k, mask=None, causal=False, dv=DV):
    """attention(q, k, k[..., :dv]) on the decode backend: vs the oracle, and equal to the call
    with a contiguous V (the two-pass path) within assert_close's per-dtype defaults."""
    v = k[..., :dv]
    assert kern._v_is_prefix_of_k(k, v)
    out = attnkit.attention(q, k, v, mask, causal=causal, backend="decode")
    gold = attnkit.attention_reference(q, k, v, mask, causal=causal)
    rule_r(out, base_attention(q, k, v, mask, causal=causal), gold)
    two_pass = attnkit.attention(q, k, v.clone(), mask, causal=causal, backend="decode")
    torch.testing.assert_close(out, two_pass)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,Hkv,G,Sq", [(1, 1, 16, 1), (3, 1, 4, 3), (2, 2, 2, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_matches_oracle_and_two_pass(one_pass_calls, dtype, B, Hkv, G, Sq, threads):
    seed = stable_seed("shared", str(dtype), B, Hkv, G, Sq, threads)
    Sk = 64 * 7 + 23  # not a multiple of the 64-row chunk
    q, k, _ = make_qkv(B, Hkv * G, Hkv, Sq, Sk, D, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, Sk + 1, (B,), generator=g)
    lens[0] = 0  # a sequence with no keys at all: its rows must be exactly 0
    offsets = torch.randint(0, Sk - Sq + 1, (B,), generator=g)
    saved = _threads(threads)
    try:
        with torch.inference_mode():
            out = _check_shared(q, k, M.KeyPadding(lens), causal=True)
            assert (out[0] == 0).all()
            _check_shared(q, k, M.Causal(offsets=offsets))
            _check_shared(q, k, torch.randn(1, 1, Sq, Sk, generator=g))
            _check_shared(q, k)
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved
    assert one_pass_calls, "the one-pass path was not taken"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_masked_in_early_chunks_or_everywhere(one_pass_calls, dtype, threads):
    """Row 0 sees only keys of the last chunk, row 1 none of the first chunk, row 2 nothing at
    all (exactly 0), row 3 only the first key; the running max starts at the clamped -inf."""
    Sk, Sq = 64 * 5 + 9, 4
    q, k, _ = make_qkv(2, 4, 1, Sq, Sk, D, dtype=dtype, seed=stable_seed("masked rows", str(dtype)))
    allowed = torch.ones(2, 1, Sq, Sk, dtype=torch.bool)
    allowed[:, :, 0, : Sk - 5] = False
    allowed[:, :, 1, :64] = False
    allowed[:, :, 2] = False
    allowed[:, :, 3, 1:] = False
    saved = _threads(threads)
    try:
        with torch.inference_mode():
            out = _check_shared(q, k, allowed)
            bias = torch.zeros(2, 1, Sq, Sk).masked_fill(~allowed, float("-inf"))
            out_bias = _check_shared(q, k, bias)  # the same mask as an additive float bias
    finally:
        torch.set_num_threads(saved)
    for o in (out, out_bias):
        assert (o[:, :, 2] == 0).all()
        torch.testing.assert_close(o[:, :, 3], k[:, 0, 0, :DV].unsqueeze(1).expand(2, 4, DV))  # softmax of one key
    assert one_pass_calls


@pytest.mark.parametrize("threads", [1, 2])
def test_max_growing_across_chunks_rescales_the_running_sums(one_pass_calls, threads):
    """Scores grow by ~40 per chunk, so exp(s - m) without the rescaling of l and acc would
    overflow or weight early chunks ~e^40 too much; and the largest score sits in the last,
    partial chunk."""
    Sk = 64 * 6 + 10
    q, k, _ = make_qkv(2, 8, 1, 2, Sk, D, seed=stable_seed("growing max"))
    k = k + torch.linspace(0, 6, Sk).view(1, 1, Sk, 1)  # pushes q . k up along the context
    q = q.abs() + 1
    saved = _threads(threads)
    try:
        with torch.inference_mode():
            _check_shared(q, k)
            _check_shared(q, k.flip(2))  # and the largest score in the first chunk
    finally:
        torch.set_num_threads(saved)
    assert one_pass_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_decode_directly_with_dv_equal_to_d_and_a_prefix_of_one(one_pass_calls, dtype):
    q, k, _ = make_qkv(1, 4, 1, 1, 300, D, dtype=dtype, seed=stable_seed("direct", str(dtype)))
    with torch.inference_mode():
        for dv in (D, 1):
            v = k[..., :dv]
            out = kern.grouped_decode(q, k, v, D ** -0.5)
            gold = attnkit.attention_reference(q, k, v)
            rule_r(out, base_attention(q, k, v), gold)
            assert one_pass_calls
            one_pass_calls.clear()
            torch.testing.assert_close(out, kern.grouped_decode(q, k, v.clone(), D ** -0.5))
            assert not one_pass_calls


def test_only_true_prefix_views_take_the_one_pass_path(one_pass_calls):
    """V sharing K's storage but not at its start, or a copy, or a slice of K's rows (other
    strides or start), is ordinary K/V: the two-pass path, still right."""
    q, k, _ = make_qkv(2, 4, 2, 1, 200, D, seed=stable_seed("not a prefix"))
    big = torch.randn(2, 2, 400, D)
    cases = [
        (k, k[..., 4 : 4 + DV]),  # same storage, offset start
        (k, k.clone()[..., :DV]),  # same values, other storage
        (k, k.transpose(-1, -2).contiguous().transpose(-1, -2)[..., :DV]),  # other strides
        (big[:, :, :200], big[:, :, 200:, :DV]),  # same storage, other rows
    ]
    with torch.inference_mode():
        for kk, v in cases:
            assert not kern._v_is_prefix_of_k(kk, v)
            out = attnkit.attention(q, kk, v, backend="decode")
            rule_r(out, base_attention(q, kk, v), attnkit.attention_reference(q, kk, v))
        assert not one_pass_calls
        # A prefix view of a slice of a preallocated cache is one (MLA's StaticCache).
        kk = big[:, :, :300]
        assert kern._v_is_prefix_of_k(kk, kk[..., :DV])
        _check_shared(q, kk)
    assert one_pass_calls


def test_latent_cache_attend_on_the_decode_backend(one_pass_calls):
    """A value_from_key cache hands the backend V = K[..., :Dv]; decode steps take one pass."""
    cache = DynamicCache(1, D, DV, value_from_key=True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(stable_seed("latent cache"))
    lat = torch.randn(2, 1, 333, D, generator=g).to(torch.bfloat16)
    cache.update(lat, None)
    q = torch.randn(2, 8, 1, D, generator=g).to(torch.bfloat16)
    new = torch.randn(2, 1, 1, D, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        out = cache.attend(q, new, None, backend="decode")
    k_all = torch.cat((lat, new), 2)
    gold = attnkit.attention_reference(q, k_all, k_all[..., :DV])
    rule_r(out, base_attention(q, k_all, k_all[..., :DV]), gold)
    assert one_pass_calls


@pytest.mark.parametrize("dtype,Sk", [(torch.bfloat16, 1500), (torch.float32, 1000)], ids=str)
def test_deepseek_dims_at_default_thresholds(dtype, Sk):
    """D = 576, Dv = 512, 16 query heads over one latent head, default chunk size (the context
    is not a multiple of it), whatever thread count torch has."""
    q, k, _ = make_qkv(1, 16, 1, 1, Sk, 576, dtype=dtype, seed=stable_seed("deepseek", str(dtype)))
    with torch.inference_mode():
        _check_shared(q, k, M.KeyPadding(torch.tensor([Sk - 3])), dv=512)


def test_empty_context_gives_zeros(one_pass_calls):
    k = torch.randn(2, 1, 0, D)
    q = torch.randn(2, 4, 1, D)
    with torch.inference_mode():
        out = kern.grouped_decode(q, k, k[..., :DV], D ** -0.5)
    assert out.shape == (2, 4, 1, DV) and (out == 0).all()
    assert one_pass_calls


def test_a_low_rank_bias_broadcasts_like_a_5d_one():
    from attnkit.backends._decode_kernel import grouped_decode
    q, k, v = torch.randn(2, 2, 2, 8), torch.randn(2, 1, 40, 8), torch.randn(2, 1, 40, 8)
    bias = torch.zeros(2, 40)
    bias[1, 1:] = float("-inf")  # query row 1 sees key 0 only
    got = grouped_decode(q, k, v, 0.3, bias)
    torch.testing.assert_close(got, grouped_decode(q, k, v, 0.3, bias[None, None, None]))
    torch.testing.assert_close(got[:, :, 1], v[:, :, 0].expand(2, 2, 8))
