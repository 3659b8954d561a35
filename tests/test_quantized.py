"""Quantized K/V (:mod:`attnkit.kvquant`, :class:`attnkit.QuantizedKV`): the quantizer's error
bound, the layout's checks, and attention over it on the CPU split-K engine (native kernel and
torch fallback) against the fp64 oracle run on the dequantized K/V, with rule R; every mask kind,
modifier, paged pools, MLA's V-from-K; NaN / inf / zero scales; what ``auto`` does with it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnkit
from attnkit import QuantizedKV
from attnkit import masks as M
from attnkit.kvquant import QUANTIZED_DTYPES, dequantize, kv_storage_dtype, quantize

from conftest import DTYPES, base_attention, make_qkv, rule_r, stable_seed
from test_splitk import CASES, MASKS, _masks

KV_DTYPES = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}
KV_DTYPES = {k: v for k, v in KV_DTYPES.items() if v in QUANTIZED_DTYPES}


def _oracle(q, qkv: QuantizedKV, mask=None, *, causal=False, **mods):
    """(gold fp64, base in q's dtype) of attention over the dequantized K/V."""
    k64, v64 = qkv.gather(torch.float64)
    kb, vb = qkv.gather(q.dtype)
    gold = attnkit.attention_reference(q.double(), k64, v64, mask, causal=causal, **mods)
    base = base_attention(q, kb, vb, mask, causal=causal, **mods)
    return gold, base


# ----------------------------------------------------------------------------- the quantizer


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_quantize_round_trip_error_is_within_the_format(kv):
    x = torch.randn(3, 4, 50, 40, dtype=torch.float64) * torch.logspace(-3, 3, 40, dtype=torch.float64)
    data, scale = quantize(x, kv)
    assert data.dtype == KV_DTYPES[kv] and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    err = (dequantize(data, scale, torch.float64) - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)
    if kv == "int8":  # half a step of absmax / 127, plus fp32 rounding of the scale
        assert (err <= absmax / 254 * (1 + 1e-5) + 1e-30).all()
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 of the scale
        assert (err <= x.abs() * 2 ** -4 * (1 + 1e-5) + absmax / 448 * 2 ** -9 * 1.01).all()


def test_quantize_zero_nan_and_inf_rows():
    x = torch.randn(4, 8)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    data, scale = quantize(x, "int8")
    assert scale[0] == 0 and (data[0] == 0).all()
    deq = dequantize(data, scale)
    assert deq[1].isnan().all() and deq[2].isnan().all()  # the bad value poisons its row only
    assert torch.isfinite(deq[3]).all()


def _special_rows(dtype):
    """Rows (..., 48) that exercise every branch of the quantizer: random scales, zero rows, NaN,
    +-inf, subnormal and huge values, exact halves (round-half-even ties), signed zeros."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 7, 48, generator=g) * torch.logspace(-4, 4, 7)[:, None]
    x[0, 0] = 0
    x[0, 1] = -0.0
    x[0, 2, 5] = float("nan")
    x[0, 3, 7] = float("inf")
    x[0, 4, 9] = -float("inf")
    x[0, 5] = torch.arange(48) - 23.5  # absmax 24.5 -> steps of 24.5 / 127: no ties
    x[0, 6] = torch.arange(-24, 24) + 0.5  # with absmax 127 (int8's scale 1): exact halves, ties
    x[0, 6, 0] = 127
    x[1, 0] = torch.finfo(torch.float32).tiny * torch.arange(48)  # subnormal scale and values
    x[1, 1] = torch.finfo(dtype).max * torch.linspace(-1, 1, 48)
    x[1, 2, 0] = torch.finfo(dtype).max
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_native_quantizer_writes_the_torch_paths_bits(kv, dtype, monkeypatch):
    """Caches quantize each step's K/V through the compiled one-pass quantizer
    (``native/kvquant.cpp``) where it is built: the same data and scales, bit for bit, as the
    torch ops, for every branch (zero, NaN, inf, subnormal, huge rows, ties), any layout, at 1 and
    2 threads (rows split over threads)."""
    from attnkit import kvquant, native

    if KV_DTYPES[kv] is None:
        pytest.skip("this torch has no float8_e4m3fn")
    if native.status() != "native":
        pytest.skip(f"no native kernel here: {native.status()}")
    x = _special_rows(dtype)
    big = torch.randn(64, 8, 130, dtype=dtype) * 3  # 512 rows: past NATIVE_MAX_ROWS, the torch ops
    with monkeypatch.context() as m:
        m.setattr(kvquant, "_native_applies", lambda x: False)
        want = quantize(big, kv)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # the op itself on them: several threads' share of rows
            torch.set_num_threads(n)
            got = native.load().quantize_kv_rows(big, 0 if kv == "int8" else 1)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    finally:
        torch.set_num_threads(threads)
    assert not kvquant._native_applies(big) and kvquant._native_applies(big[:32])
    for t in (x, x.transpose(0, 1), x[:1, :1, :1]):
        calls = []
        monkeypatch.setattr(native.load(), "quantize_kv_rows",
                            lambda *a, f=native.load().quantize_kv_rows: calls.append(1) or f(*a), raising=False)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                data, scale = quantize(t, kv)
                with monkeypatch.context() as m:
                    m.setattr(kvquant, "_native_applies", lambda x: False)
                    want_data, want_scale = quantize(t, kv)
                assert data.dtype == want_data.dtype and data.shape == want_data.shape
                assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)), (data, want_data)
                # every bit but a NaN's payload (bf16's NaN widened keeps its own)
                torch.testing.assert_close(scale, want_scale, rtol=0, atol=0, equal_nan=True)
        finally:
            torch.set_num_threads(threads)
            monkeypatch.undo()
        assert calls, "the native quantizer did not run"


def test_kv_dtype_spellings():
    assert kv_storage_dtype(None) is None
    assert kv_storage_dtype("int8") == torch.int8 == kv_storage_dtype(torch.int8)
    if "fp8" in KV_DTYPES:
        assert kv_storage_dtype("fp8_e4m3") == torch.float8_e4m3fn == kv_storage_dtype("FP8")
    for bad in ("int4", "bf16", torch.bfloat16, 8):
        with pytest.raises(ValueError, match="kv_dtype"):
            kv_storage_dtype(bad)


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_on_quantized_kv_matches_the_oracle(implementation, dtype, kv, case, mask_name):
    (B, Hkv, G), Sq, (D, Dv) = CASES[case]
    seed = stable_seed("quantized", dtype, kv, case, mask_name)
    Sk = 93 if D < 576 else 60
    g = torch.Generator().manual_seed(seed)
    mask, causal = _masks(B, Sq, Sk, g)[mask_name]
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, Sk, D, Dv=Dv, dtype=torch.float32, seed=seed)
    q = q.to(DTYPES[dtype])
    qkv = QuantizedKV.quantize(k, None, kv, v_head_dim=Dv) if D == 576 else QuantizedKV.quantize(k, v, kv)
    out = attnkit.attention(q, qkv, None, mask, causal=causal, backend="decode")
    gold, base = _oracle(q, qkv, mask, causal=causal)
    rule_r(out, base, gold, n_terms=max(Sk, D))


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("mods", ["softcap", "sinks", "alibi", "alibi+softcap+sinks"])
def test_engine_applies_modifiers_to_the_dequantized_scores(implementation, kv, mods):
    B, Hq, Hkv, Sq, Sk, D = 2, 8, 2, 3, 70, 32
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=stable_seed(kv, mods))
    k = k * 3  # scores large enough for the cap to bite
    qkv = QuantizedKV.quantize(k, v, kv)
    kw = {}
    mask = M.KeyPadding(torch.tensor([70, 41]))
    if "softcap" in mods:
        kw["softcap"] = 5.0
    if "sinks" in mods:
        kw["sinks"] = torch.randn(Hq)
    if "alibi" in mods:
        mask = mask & M.ALiBi(torch.rand(Hq))
    out = attnkit.attention(q, qkv, None, mask, causal=True, backend="decode", **kw)
    gold, base = _oracle(q, qkv, mask, causal=True, **kw)
    rule_r(out, base, gold, n_terms=Sk)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_paged_quantized_pools_match_the_oracle(implementation, dtype, kv, block_size):
    g = torch.Generator().manual_seed(block_size)
    B, Hkv, G, Sq, D, L = 3, 2, 4, 2, 32, 50
    lens = torch.tensor([L, 0, 33])
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, L, D, seed=block_size)
    q = q.to(DTYPES[dtype])
    W = -(-L // block_size)
    N = B * W + 5
    table = torch.randperm(N, generator=g)[:B * W].view(B, W)
    pk = torch.randn(N, block_size, Hkv, D) * 100  # blocks nobody uses: large values must not leak
    pv = torch.randn(N, block_size, Hkv, D) * 100
    pos = torch.arange(L)
    for b in range(B):
        pk[table[b, pos // block_size], pos % block_size] = k[b].transpose(0, 1)
        pv[table[b, pos // block_size], pos % block_size] = v[b].transpose(0, 1)
    mask = M.Causal(q_start=(lens - Sq).clamp(min=0))
    full = mask & M.KeyPadding(lens)
    for latent in (False, True):
        qkv = QuantizedKV.quantize(pk, None if latent else pv, kv, v_head_dim=16 if latent else None,
                                   block_table=table, lengths=lens)
        out = attnkit.attention(q, qkv, None, mask, backend="paged")
        gold, base = _oracle(q, qkv, full)
        rule_r(out, base, gold, n_terms=L)
        assert (out[1] == 0).all()


def test_scales_with_any_strides_are_read_as_given(implementation):
    """Scales that are a view (a transposed buffer), as a cache may hold them."""
    q, k, v = make_qkv(2, 4, 2, 1, 40, 16, seed=3)
    kq, ks = quantize(k, "int8")
    vq, vs = quantize(v, "int8")
    ks_t = ks.transpose(0, 2).contiguous().transpose(0, 2)
    qkv = QuantizedKV(kq, ks_t, vq, vs)
    out = attnkit.attention(q, qkv, None, backend="decode")
    gold, base = _oracle(q, QuantizedKV(kq, ks, vq, vs))
    rule_r(out, base, gold, n_terms=40)


# ----------------------------------------------------------------------------- bad values


def test_nan_rows_poison_the_queries_that_see_them_only(implementation):
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 4, 16, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=7)
    k[0, 0, 13] = float("nan")  # visible to the causal rows 1.. of KV head 0 (key 13 = i + 12 for i >= 1)
    qkv = QuantizedKV.quantize(k, v, "int8")
    assert qkv.k_scale[0, 0, 13].isnan()
    out = attnkit.attention(q, qkv, None, causal=True, backend="decode")
    assert out[0, :2, 1:].isnan().all()  # query heads 0, 1 share KV head 0
    assert torch.isfinite(out[0, :2, 0]).all() and torch.isfinite(out[0, 2:]).all()


def test_hand_built_scales_nan_inf_zero_and_fp8_nan_codes(implementation):
    q, k, v = make_qkv(1, 2, 1, 1, 12, 16, seed=9)
    kq, ks = quantize(k, "int8")
    vq, vs = quantize(v, "int8")
    for bad in (float("nan"), float("inf")):
        ks2 = ks.clone()
        ks2[0, 0, 4] = bad
        out = attnkit.attention(q, QuantizedKV(kq, ks2, vq, vs), None, backend="decode")
        assert out.isnan().all()
    ks0, vs0 = ks.clone(), vs.clone()
    ks0[0, 0, 4] = 0
    vs0[0, 0, 4] = 0  # a zero key row (score 0) with a zero value row: the oracle's answer
    qkv = QuantizedKV(kq, ks0, vq, vs0)
    gold, base = _oracle(q, qkv)
    rule_r(attnkit.attention(q, qkv, None, backend="decode"), base, gold, n_terms=12)
    if "fp8" in KV_DTYPES:
        kf, ksf = quantize(k, "fp8")
        vf, vsf = quantize(v, "fp8")
        raw = kf.view(torch.uint8).clone()
        raw[0, 0, 5, 3] = 0x7F  # e4m3's NaN code
        out = attnkit.attention(q, QuantizedKV(raw.view(kf.dtype), ksf, vf, vsf), None, backend="decode")
        assert out.isnan().all()


@pytest.mark.skipif(KV_DTYPES["fp8"] is None, reason="this torch has no float8_e4m3fn")
def test_every_fp8_code_reads_as_torchs_e4m3_value(implementation):
    """The kernel decodes e4m3 bytes itself (sign, exponent and mantissa moved by integer
    operations; subnormals; the two NaN codes): one key whose V row holds all 256 codes, scale
    1, so each output channel is one code's value (exactly, p = 1), against torch's decoding."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn)
    for G, row in ((1, codes), (4, codes.flip(0))):  # one row and the four-row path, codes in both orders
        q = torch.randn(1, 2 * G, 1, 256)
        v = row.view(torch.float8_e4m3fn).reshape(1, 1, 1, 256).expand(1, 2, 1, 256).contiguous()
        k = torch.zeros(1, 2, 1, 256, dtype=torch.float8_e4m3fn)
        ones = torch.ones(1, 2, 1)
        out = attnkit.attention(q, QuantizedKV(k, ones, v, ones), None, backend="decode")
        want = row.view(torch.float8_e4m3fn).float().expand_as(out)
        assert torch.equal(out.isnan(), want.isnan()) and want.isnan().sum() == 2 * 2 * G
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), (out - want).abs().max()
    assert e4m3.float().isnan().sum() == 2  # 0x7F and 0xFF, as the kernel assumes


def test_layout_errors_name_the_argument_and_shapes():
    q, k, v = make_qkv(2, 4, 2, 1, 10, 16)
    kq, ks = quantize(k, "int8")
    vq, vs = quantize(v, "int8")
    cases = [
        (QuantizedKV(k, ks, vq, vs), TypeError, "QuantizedKV.k must be one of"),
        (QuantizedKV(kq, ks[..., :5], vq, vs), ValueError, r"k_scale must have shape \(2, 2, 10\)"),
        (QuantizedKV(kq, ks.double(), vq, vs), TypeError, "k_scale must be an fp32"),
        (QuantizedKV(kq, ks, vq, None), ValueError, "v and v_scale"),
        (QuantizedKV(kq, ks, vq[:, :, :9], vs[:, :, :9]), ValueError, "QuantizedKV.v must match k"),
        (QuantizedKV(kq, ks, None, None), ValueError, "v_head_dim must be an int"),
        (QuantizedKV(kq, ks, vq, vs, lengths=torch.tensor([3, 4])), ValueError, "paged form"),
        (QuantizedKV(kq, ks, vq, vs, block_table=torch.zeros(2, 1, dtype=torch.long)), ValueError, "needs lengths"),
    ]
    for qkv, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            attnkit.attention(q, qkv, None)
    with pytest.raises(ValueError, match="v must be None"):
        attnkit.attention(q, QuantizedKV(kq, ks, vq, vs), v)
    with pytest.raises(TypeError, match="float64"):
        attnkit.attention(q.double(), QuantizedKV(kq, ks, vq, vs), None)
    with pytest.raises(ValueError, match="batch sizes differ"):
        attnkit.attention(q[:1], QuantizedKV(kq, ks, vq, vs), None)


# ----------------------------------------------------------------------------- routing


def test_auto_reads_quantized_kv_in_place_and_other_backends_get_dequantized_tensors(implementation):
    q, k, v = make_qkv(2, 8, 2, 1, 64, 32, seed=4)
    qkv = QuantizedKV.quantize(k, v, "int8")
    want = "decode" if implementation == "native" else "sdpa"  # the torch implementation loses to SDPA (auto_skip)
    assert attnkit.describe_call(q, qkv, None) == want
    gold, base = _oracle(q, qkv)
    for backend in ("auto", "sdpa", "math", "decode"):
        rule_r(attnkit.attention(q, qkv, None, backend=backend), base, gold, n_terms=64)
    # a prefill over a quantized cache (Sq > 16): another backend, on the dequantized K/V
    q2 = torch.randn(2, 8, 40, 32)
    assert attnkit.describe_call(q2, qkv, None, causal=True) != "decode"
    gold, base = _oracle(q2, qkv, causal=True)
    rule_r(attnkit.attention(q2, qkv, None, causal=True), base, gold, n_terms=64)
    paged = QuantizedKV.quantize(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), "int8",
                                 block_table=torch.tensor([[0], [1]]), lengths=torch.tensor([64, 30]))
    assert attnkit.describe_call(q, paged, None) == ("paged" if implementation == "native" else "sdpa")


# ----------------------------------------------------------------------------- channel scales


@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_channel_scales_fold_into_the_query_and_match_the_oracle(implementation, paged, latent):
    B, Hq, Hkv, Sq, S, D = 2, 8, 2, 2, 48, 32
    q, k, v = make_qkv(B, Hq, Hkv, Sq, S, D, seed=11)
    q = q.bfloat16()
    k[..., [3, 17]] *= 20  # outlier channels
    kw = dict(v_head_dim=16) if latent else {}
    if paged:
        pk, pv = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # blocks of S tokens
        kw.update(block_table=torch.tensor([[0], [1]]), lengths=torch.tensor([48, 30]))
        k_in, v_in = pk, pv
    else:
        k_in, v_in = k, v
    qkv = QuantizedKV.quantize(k_in, None if latent else v_in, "int8", k_channel_scale=True, **kw)
    assert qkv.k_channel_scale.shape == (Hkv, D) and (qkv.k_channel_scale[:, 3] > 5).all()
    mask = M.KeyPadding(torch.tensor([48, 30])) if paged else None
    out = attnkit.attention(q, qkv, None, mask, causal=True, backend="paged" if paged else "decode")
    gold, base = _oracle(q, qkv, mask, causal=True)
    rule_r(out, base, gold, n_terms=S)
    assert out.dtype == q.dtype
    # the dequantized K (what other backends get) is the channel-scaled one
    sdpa = attnkit.attention(q, qkv, None, mask, causal=True, backend="sdpa")
    rule_r(sdpa, base, gold, n_terms=S)
    # and the channel scales are what make int8 keys with outlier channels accurate
    plain = QuantizedKV.quantize(k_in, None if latent else v_in, "int8", **kw)
    exact = attnkit.attention_reference(q.double(), *(x.double() for x in (k, k[..., :16] if latent else v)),
                                        mask, causal=True)
    err = lambda x: (x.double() - exact).abs().max().item()  # noqa: E731
    assert err(out) < err(attnkit.attention(q, plain, None, mask, causal=True))


def test_channel_scale_errors():
    q, k, v = make_qkv(1, 4, 2, 1, 10, 16)
    qkv = QuantizedKV.quantize(k, v, "int8")
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"k_channel_scale must have shape \(Hkv, D\) = \(2, 16\)"):
        attnkit.attention(q, replace(qkv, k_channel_scale=torch.ones(16)), None)
    with pytest.raises(TypeError, match="k_channel_scale must be an fp32"):
        attnkit.attention(q, replace(qkv, k_channel_scale=torch.ones(2, 16, dtype=torch.float64)), None)


@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [32, 128, 256, 288, 80])
def test_int8_keys_scored_by_integer_dot_products_match_the_oracle(implementation, qdtype, D):
    """With AVX-512-VNNI (VPDPWSSD) or AVX2 (VPMADDWD) the native kernel scores int8 keys
    against bf16 / fp16 queries held as int16 (to 2^-16 of each row's largest element) for
    D <= 256 in whole 32-lane steps; the other widths (288, 80) take the fp32 path. Either way rule R holds, also for a query row
    whose elements span 6 orders of magnitude and an all-zero row; a NaN in one query row
    poisons that row only (its unit falls back to fp32 products)."""
    g = torch.Generator().manual_seed(D)
    B, Hkv, G, Sq, Sk = 2, 2, 4, 3, 150
    q = torch.randn(B, Hkv * G, Sq, D, generator=g)
    q[0, 0, 0] *= torch.logspace(-3, 3, D)  # wide dynamic range in one row
    q[1, 3, 2] = 0.0
    q = q.to(qdtype)
    k, v = torch.randn(B, Hkv, Sk, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g)
    qkv = QuantizedKV.quantize(k, v, "int8")
    out = attnkit.attention(q, qkv, None, causal=True, backend="decode")
    gold, base = _oracle(q, qkv, causal=True)
    rule_r(out, base, gold, n_terms=max(Sk, D))
    q[1, 5, 1, D // 2] = float("nan")
    out = attnkit.attention(q, qkv, None, causal=True, backend="decode")
    assert out[1, 5, 1].isnan().all()
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[1, 5, 1] = True
    assert torch.isfinite(out[~bad]).all()
    rule_r(out[~bad], base[~bad], gold[~bad], n_terms=max(Sk, D))


@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G", [1, 3, 4, 5])
def test_int8_values_summed_by_integer_multiply_adds_match_the_oracle(implementation, qdtype, G):
    """AVX2 builds sum P @ V over int8 V with integer multiply-adds (each row's probabilities, times
    the values' scales, as int16 to 2^-16 of the row's largest, two keys per lane): groups of 4
    query rows and single rows (G 1, 3, 5), odd and ragged numbers of visible keys per tile (a
    sliding window), value scales spanning 6 orders of magnitude, values near fp32's subnormals
    (the fp32 path). Rule R holds; a NaN value row
    makes exactly the rows that see it NaN (their group falls back to fp32 products)."""
    g = torch.Generator().manual_seed(G)
    B, Hkv, Sq, Sk, D = 1, 2, 3, 301, 64
    q = torch.randn(B, Hkv * G, Sq, D, generator=g).to(qdtype)
    k, v = torch.randn(B, Hkv, Sk, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g)
    v[0, 0] *= torch.logspace(-3, 3, Sk).view(Sk, 1)
    qkv = QuantizedKV.quantize(k, v, "int8")
    window = M.SlidingWindow(57)
    for mask, causal in ((None, True), (window, False)):
        out = attnkit.attention(q, qkv, None, mask, causal=causal, backend="decode")
        gold, base = _oracle(q, qkv, mask, causal=causal)
        rule_r(out, base, gold, n_terms=Sk)
    # values so small that int16 probabilities times their scales would need subnormal steps:
    # those rows take fp32 products (compared at unit scale: rule R's floor is absolute)
    tiny = QuantizedKV.quantize(k, v * 1e-36, "int8")
    out = attnkit.attention(q, tiny, None, causal=True, backend="decode")
    gold, base = _oracle(q, tiny, causal=True)
    rule_r((out.float() * 1e36).to(qdtype), (base.float() * 1e36).to(qdtype), gold * 1e36, n_terms=Sk)
    vs = qkv.v_scale.clone()
    vs[0, 1, Sk - 2] = float("nan")  # seen by KV head 1's rows 1 and 2 (causal: key i + Sk - 3)
    out = attnkit.attention(q, replace(qkv, v_scale=vs), None, causal=True, backend="decode")
    assert out[0, G:, 1:].isnan().all()
    assert torch.isfinite(out[0, G:, 0]).all() and torch.isfinite(out[0, :G]).all()


@pytest.mark.slow
def test_avx2_build_scores_int8_keys_like_the_oracle():
    """The AVX2 build (ATTNKIT_NATIVE_MARCH=haswell: what AMD Zen 3 runs) has its own integer dot
    product for int8 keys: the tests above, in a process of their own with that build."""
    import os
    import subprocess
    import sys

    from attnkit import native
    from attnkit._sysinfo import cpu_flags

    if native.load() is None or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("no native kernel, or this CPU cannot run the AVX2 build")
    if "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 here: the native build is the AVX2 code path, which the tests above ran")
    here = os.path.dirname(__file__)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          os.path.join(here, "test_quantized.py"), "-k",
                          "integer_dot_products or integer_multiply_adds or paged_quantized_pools or engine_on_quantized"],
                         capture_output=True, text=True, timeout=900, cwd=os.path.dirname(here),
                         env=dict(os.environ, ATTNKIT_NATIVE_MARCH="haswell"))
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
