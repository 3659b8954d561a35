"""The oracle grid: every CPU backend x dtype x MHA/GQA/MQA x odd sizes x mask kind, forward and
backward, under rule R (tests/conftest.py). FlexAttention compiles per shape, so it has its own
small file (test_flex.py)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported, explain, get_backend
from attnkit.functional import _validate

from conftest import DTYPES, INFERENCE_ONLY, check_against_oracle, make_qkv, stable_seed

VARIANTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# (D, Sq, Sk): odd head dims and lengths, Sq != Sk both ways, decode-sized Sq.
SIZES = [(1, 17, 17), (7, 1, 333), (80, 17, 128), (128, 128, 17), (256, 3, 40), (7, 333, 333), (16, 4, 1)]
BACKENDS = ["math", "sdpa", "decode"]


def mask_kinds(B, Sq, Sk, g: torch.Generator):
    """name -> (mask, causal) for a (B, Sq, Sk) call; random parts drawn from ``g``."""
    lens = torch.randint(0, Sk + 1, (B,), generator=g)
    qlens = torch.randint(0, Sq + 1, (B,), generator=g)
    offs = torch.randint(0, Sk + 1, (B,), generator=g) - Sq // 2
    dense = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    dense[:, :, 0] = False  # a fully masked row
    add = torch.randn(1, 1, Sq, Sk, generator=g, dtype=torch.float32)
    add = add.masked_fill(torch.rand(Sq, Sk, generator=g) > 0.8, float("-inf"))
    docs = torch.tensor([Sq // 3, Sq // 3, Sq - 2 * (Sq // 3)])
    kdocs = torch.tensor([Sk // 3, Sk // 3, Sk - 2 * (Sk // 3)])
    return {
        "none": (None, False),
        "causal": (None, True),
        "causal_top_left": (M.Causal("top_left"), False),
        "window": (M.SlidingWindow(3), False),
        "window_two_sided": (M.SlidingWindow(2, 5, align="top_left"), False),
        "key_padding": (M.KeyPadding(lens), False),
        "key_padding_left_causal": (M.KeyPadding(lens, side="left"), True),
        "query_padding": (M.QueryPadding(qlens), False),
        "document_causal": (M.Document(docs, kdocs), True),
        "prefix_lm": (M.PrefixLM(torch.randint(0, Sk + 1, (B,), generator=g)), False),
        "ragged_offsets": (M.Causal(q_start=offs), False),
        "dense_bool": (dense, False),
        "additive": (add, True),
        "composed_or": ((M.SlidingWindow(1) | M.PrefixLM(2)) & M.KeyPadding(lens), False),
    }


MASK_NAMES = list(mask_kinds(1, 4, 4, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("D,Sq,Sk", SIZES, ids=[f"D{d}-Sq{a}-Sk{b}" for d, a, b in SIZES])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_grid(backend, dtype, variant, D, Sq, Sk, mask_name):
    Hq, Hkv = VARIANTS[variant]
    B = 2
    seed = stable_seed(D, Sq, Sk, mask_name, variant)
    g = torch.Generator().manual_seed(seed)
    mask, causal = mask_kinds(B, Sq, Sk, g)[mask_name]
    dist = "rand" if seed % 2 else "randn"
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], dist=dist, seed=seed)
    call = _validate(q, k, v, mask, causal, None, 0.0, False)
    why = get_backend(backend).not_supported_reasons(call)
    if why:
        with pytest.raises(BackendNotSupported, match=backend):
            attnkit.attention(q, k, v, mask, causal=causal, backend=backend)
        return
    check_against_oracle(q, k, v, mask, causal=causal, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fully_masked_rows_are_zero_with_zero_grads(backend, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 9, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype])
    mask = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    mask[0, :, 1] = False
    mask[1, :, 4] = False
    trains = backend not in INFERENCE_ONLY
    q.requires_grad_(trains), k.requires_grad_(trains), v.requires_grad_(trains)
    out = attnkit.attention(q, k, v, mask, backend=backend)
    assert (out[0, :, 1] == 0).all() and (out[1, :, 4] == 0).all()
    ref = attnkit.attention(q, k, v, backend="math")  # unmasked rows equal the unmasked call
    keep = mask.any(-1, keepdim=True).expand_as(out)
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-2 if dtype != "fp32" else 1e-5, rtol=1e-2)
    if not trains:
        return
    out.square().sum().backward()  # non-trivial upstream gradient
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0, :, 1] == 0).all() and (q.grad[1, :, 4] == 0).all()


def test_fully_masked_weights_row_is_zero():
    q, k, v = make_qkv(1, 2, 2, 3, 4, 8)
    mask = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    out, w = attnkit.attention(q, k, v, mask, return_weights=True)
    assert w.dtype == torch.float32 and w.shape == (1, 2, 3, 4)
    assert (w[:, :, 1] == 0).all() and (out[:, :, 1] == 0).all()
    torch.testing.assert_close(w[:, :, [0, 2]].sum(-1), torch.ones(1, 2, 2))
    assert (w[:, :, 0, 2:] == 0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_return_weights_match_oracle(dtype):
    q, k, v = make_qkv(2, 6, 2, 7, 11, 16, dtype=DTYPES[dtype])
    out, w = attnkit.attention(q, k, v, causal=True, return_weights=True)
    gold, gw = attnkit.attention_reference(q, k, v, causal=True, return_weights=True)
    assert w.dtype == torch.float32 and w.shape == (2, 6, 7, 11)
    tol = 1e-5 if dtype == "fp32" else 1e-2
    torch.testing.assert_close(w.double(), gw, atol=tol, rtol=tol)


@pytest.mark.parametrize("scale", [0.5, -0.7, 3.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale_honoured(backend, scale):
    q, k, v = make_qkv(2, 4, 2, 3, 19, 8)
    check_against_oracle(q, k, v, causal=True, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_head_dim_differs(backend):
    q, k, v = make_qkv(2, 4, 1, 3, 21, 24, Dv=40)
    out = check_against_oracle(q, k, v, causal=True, backend=backend)
    assert out.shape == (2, 4, 3, 40)


def test_fp64_math_matches_oracle_exactly_enough():
    q, k, v = make_qkv(2, 4, 2, 9, 13, 8, dtype=torch.float64)
    out = attnkit.attention(q, k, v, causal=True, backend="math")
    torch.testing.assert_close(out, attnkit.attention_reference(q, k, v, causal=True), atol=1e-12, rtol=1e-12)


def test_auto_never_copies_kv_per_head_and_picks_expected_backend():
    from attnkit import native

    q, k, v = make_qkv(1, 8, 2, 1, 20000, 16, dtype=torch.bfloat16)  # above the engine's size floor
    # Without the compiled kernel, auto leaves every call SDPA can run to SDPA.
    want = "sdpa" if native.implementation(build=False) == "torch" else "decode"
    assert attnkit.describe_call(q, k, v, causal=True) == want
    assert attnkit.describe_call(q.float(), k.float(), v.float(), causal=True) == want
    tiny = make_qkv(1, 8, 2, 1, 17, 16)  # a tiny cache: SDPA's one fused call costs less
    assert attnkit.describe_call(*tiny, causal=True) == "sdpa"
    q2, k, v = make_qkv(1, 8, 2, 64, 64, 16)
    assert attnkit.describe_call(q2, k, v, causal=True) == "sdpa"
    assert attnkit.describe_call(q2, k, v, causal=True, return_weights=True) == "math"
    assert attnkit.describe_call(q2, k, v, dropout_p=0.1) == "sdpa"


def test_forced_unsupported_backend_lists_every_reason():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 8)
    with pytest.raises(BackendNotSupported) as ei:
        attnkit.attention(q, k, v, backend="decode", return_weights=True)
    msg = str(ei.value)
    for name in attnkit.backend_names():
        assert f"  {name}:" in msg
    assert "Sq=64" in msg and "return_weights" in msg


def test_explain_reports_reasons():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 8)
    call = _validate(q, k, v, None, False, None, 0.0, True)
    reasons = explain(call)
    assert reasons["math"] == [] and reasons["sdpa"]


@pytest.mark.parametrize("B,Sq,Sk", [(0, 3, 4), (2, 0, 4), (2, 3, 0), (0, 0, 0)])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "decode", "math"])
def test_empty_inputs(B, Sq, Sk, backend):
    q, k, v = make_qkv(B, 4, 2, Sq, Sk, 8, Dv=5)
    for t in (q, k, v):
        t.requires_grad_(backend != "decode")
    out, w = attnkit.attention(q, k, v, causal=True, backend=backend, return_weights=True) \
        if backend in ("auto", "math") else (attnkit.attention(q, k, v, causal=True, backend=backend), None)
    assert out.shape == (B, 4, Sq, 5)
    assert (out == 0).all()
    if w is not None:
        assert w.shape == (B, 4, Sq, Sk)
    if backend == "decode":
        return
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()


def test_non_contiguous_inputs():
    base = torch.randn(2, 8, 40, 4, 16)
    q = base[:, :, :5, 0].transpose(1, 2)[:, :, :, :].transpose(1, 2)  # strided view
    cache_k = torch.randn(2, 2, 64, 16)
    cache_v = torch.randn(2, 2, 64, 16)
    k, v = cache_k[:, :, :33], cache_v[:, :, :33]  # slice of a preallocated cache
    for backend in BACKENDS:
        check_against_oracle(q, k, v, causal=True, backend=backend)


@pytest.mark.parametrize("D,Dv", [(192, 128), (48, 80)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_unequal_widths_reach_sdpas_fused_kernel(D, Dv, dtype):
    """K wider than V (MLA's prefill) or narrower: padded to equal widths so SDPA runs its fused
    (flash) kernel instead of its math kernel; outputs and gradients unchanged (rule R)."""
    q, k, v = make_qkv(1, 4, 2, 37, 37, D, Dv=Dv, dtype=DTYPES[dtype], seed=D)
    assert attnkit.describe_call(q, k, v, causal=True, detail=True) == "sdpa[flash]"
    check_against_oracle(q, k, v, causal=True, backend="sdpa")
