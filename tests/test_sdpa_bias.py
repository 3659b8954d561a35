"""The bias SDPA receives, held to rule R in the precision its kernel sees, on every device policy.

On CUDA the bias goes to SDPA's fused kernels in the input dtype (fp16/bf16); on CPU it stays
fp32. Each row is shifted by its largest bias over the keys the mask allows, not over all keys:
a shift over all keys (ALiBi grows toward the future keys a causal part removes) would leave an
early row's allowed keys near ``-slope * (Sk - 1)``, where bf16 has a spacing of 2-4, far outside
rule R. Here the CUDA decision (:func:`sdpa_bias_dtype`) runs on CPU: the bias is cast as it
would be for the GPU and SDPA's CPU kernel adds it to fp32 scores, as the CUDA kernels do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks as M
from attnkit.backends.sdpa import sdpa_bias_dtype, sdpa_mask
from attnkit.functional import _validate

from conftest import DTYPES, base_attention, make_qkv, rule_r

CASES = {
    "alibi-causal": lambda B, H, Sq, Sk: M.ALiBi(M.alibi_slopes(H)) & M.Causal(),
    "alibi-topleft-causal": lambda B, H, Sq, Sk: M.ALiBi(M.alibi_slopes(H), align="top_left") & M.Causal("top_left"),
    "alibi-window": lambda B, H, Sq, Sk: M.ALiBi(M.alibi_slopes(H)) & M.SlidingWindow(40),
    "alibi-padding-causal": lambda B, H, Sq, Sk: (M.ALiBi(M.alibi_slopes(H)) & M.Causal()
                                                  & M.KeyPadding(torch.tensor([Sk, Sk // 3]))),
    "alibi-documents": lambda B, H, Sq, Sk: (M.ALiBi(M.alibi_slopes(H)) & M.Causal()
                                             & M.Document(torch.tensor([Sq // 4, Sq // 2, Sq - Sq // 4 - Sq // 2]))),
    "alibi-offsets": lambda B, H, Sq, Sk: (M.ALiBi(M.alibi_slopes(H), q_start=torch.tensor([Sk - Sq, 5]))
                                           & M.Causal(q_start=torch.tensor([Sk - Sq, 5]))),
    "additive-causal": lambda B, H, Sq, Sk: M.Additive(3 * torch.randn(B, 1, Sq, Sk)) & M.Causal(),
    "additive-large-offset": lambda B, H, Sq, Sk: M.Additive(torch.randn(Sq, Sk) - 5e4) & M.Causal(),
    "additive-window-padding": lambda B, H, Sq, Sk: (M.Additive(torch.randn(1, H, Sq, Sk)) & M.SlidingWindow(30)
                                                     & M.KeyPadding(torch.tensor([Sk, 50]))),
    "alibi-additive-stacked": lambda B, H, Sq, Sk: (M.ALiBi(M.alibi_slopes(H)) & M.Additive(torch.randn(Sq, Sk))
                                                    & M.Causal()),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_bias_sdpa_gets_on_cuda_holds_rule_r(case, dtype):
    B, H, Sq, Sk, D = 2, 8, 256, 320, 64
    dt = DTYPES[dtype]
    torch.manual_seed(1)
    mask = CASES[case](B, H, Sq, Sk)
    q, k, v = make_qkv(B, H, H, Sq, Sk, D, dtype=dt, seed=2)
    call = _validate(q, k, v, mask, False, None, 0.0, False)
    bias_dtype = sdpa_bias_dtype("cuda", dt)
    assert bias_dtype == dt  # what the fused CUDA kernels take
    attn_mask, row_ok = sdpa_mask(call, dt, torch.device("cpu"), bias_dtype=bias_dtype)
    assert attn_mask.dtype == dt
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=call.scale)
    if row_ok is not None:
        out = out.masked_fill(~row_ok, 0.0)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    base = base_attention(q, k, v, mask)
    # n_terms=1: the rounding floor alone (the accumulation allowance would hide a bias error)
    rule_r(out, base, gold, n_terms=1)


@pytest.mark.parametrize("case", list(CASES))
def test_shifted_bias_puts_each_rows_allowed_maximum_at_zero(case):
    B, H, Sq, Sk = 2, 8, 64, 96
    torch.manual_seed(1)
    mask = CASES[case](B, H, Sq, Sk)
    allowed = mask.materialize(B, Sq, Sk).expand(B, H, Sq, Sk)
    bias = M.shifted_bias(mask, B, Sq, Sk).expand(B, H, Sq, Sk)
    on_allowed = bias.masked_fill(~allowed, float("-inf")).amax(-1)
    rows = allowed.any(-1)
    assert (on_allowed[rows] == 0).all()


def test_alibi_on_cuda_policy_holds_rule_r_on_a_long_causal_call():
    """(1, 16, 1024, 128) bf16 ALiBi + causal, with the bias cast to bf16 as for CUDA: within rule
    R of the fp64 oracle (a shift over every key, the causal part's removed ones included, puts it
    far outside)."""
    q, k, v = make_qkv(1, 16, 16, 1024, 1024, 128, dtype=torch.bfloat16, seed=7)
    mask = M.ALiBi(M.alibi_slopes(16)) & M.Causal()
    call = _validate(q, k, v, mask, False, None, 0.0, False)
    attn_mask, _ = sdpa_mask(call, q.dtype, torch.device("cpu"), bias_dtype=sdpa_bias_dtype("cuda", q.dtype))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    rel = ((out.double() - gold).norm() / gold.norm()).item()
    assert rel < 0.02, rel
    rule_r(out, base_attention(q, k, v, mask), gold, n_terms=1024)


def test_bias_dtype_policy():
    assert sdpa_bias_dtype("cpu", torch.bfloat16) == torch.float32
    assert sdpa_bias_dtype("cpu", torch.float16) == torch.float32
    assert sdpa_bias_dtype("cuda", torch.bfloat16) == torch.bfloat16
    assert sdpa_bias_dtype("cuda", torch.float16) == torch.float16
    assert sdpa_bias_dtype("cuda", torch.float32) == torch.float32
    assert sdpa_bias_dtype("cuda", torch.float64) == torch.float64
    assert sdpa_bias_dtype("cpu", torch.float64) == torch.float64


# ------------------------------------------------- bf16 SDPA in fp32 on AVX-512 CPUs without AMX


def _call(dtype=torch.bfloat16, device="cpu", grad=False, dropout=0.0):
    q = torch.zeros(1, 4, 3, 8, dtype=dtype, device=device, requires_grad=grad)
    k = torch.zeros(1, 2, 5, 8, dtype=dtype, device=device)
    with torch.set_grad_enabled(grad):
        return _validate(q, k, k, None, False, None, dropout, False)


def test_sdpa_upcasts_is_a_rule_of_the_call_and_cpu_flags():
    """bf16 CPU inference runs in fp32 on AVX-512 CPUs without AMX-BF16 (Skylake-X to Emerald
    Rapids without AMX, Zen 4 / 5); AVX2 and AMX CPUs, other dtypes, CUDA, gradients and dropout
    keep the call as it is."""
    import attnkit.backends.sdpa as S
    from attnkit.backends.sdpa import sdpa_upcasts

    zen3 = {"avx2", "fma"}
    icl = {"avx2", "avx512f", "avx512_vnni"}
    zen4 = icl | {"avx512_bf16"}
    spr = zen4 | {"avx512_fp16", "amx_bf16", "amx_tile"}
    call = _call()
    assert sdpa_upcasts(call, icl) and sdpa_upcasts(call, zen4)
    assert not sdpa_upcasts(call, zen3) and not sdpa_upcasts(call, spr)
    cuda = dataclasses.replace(call, device=torch.device("cuda", 0))  # the CUDA branch, decided on CPU
    assert cuda.device_type == "cuda"
    for other in (_call(torch.float16), _call(torch.float32), _call(grad=True), _call(dropout=0.1),
                  _call(device="meta"), cuda):
        assert not sdpa_upcasts(other, zen4)
    # the fp32 copies: q (4 heads x Sq x 8) and k, v (2 heads x Sk x 8 each), up to UPCAST_MAX_BYTES
    rows = S.UPCAST_MAX_BYTES // (4 * 8 * 8)  # Sq = Sk = rows: 4 + 2 * 2 rows of 8 fp32 per position
    assert sdpa_upcasts(dataclasses.replace(call, q_len=rows, kv_len=rows), zen4)
    assert not sdpa_upcasts(dataclasses.replace(call, q_len=rows + 1, kv_len=rows), zen4)


@pytest.mark.parametrize("case", ["causal", "gqa-padding-empty-rows", "mla-widths", "sinks"])
def test_sdpa_in_fp32_for_bf16_holds_rule_r(case, monkeypatch):
    """With the upcast forced on (this CPU's flags as an AVX-512 CPU without AMX), bf16 calls
    through ``sdpa`` against the fp64 oracle and the eager base, and the output's dtype."""
    import attnkit.backends.sdpa as S
    from conftest import check_against_oracle

    monkeypatch.setattr(S, "_FLAGS_HERE", frozenset({"avx512f"}))
    seen = []
    real = S.sdpa_upcasts
    monkeypatch.setattr(S, "sdpa_upcasts", lambda call, flags: seen.append(real(call, flags)) or seen[-1])
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, Sq, Sk, D, Dv = 2, 4, 2, 33, 47, 24, 24
    sinks, mask, causal = None, None, False
    if case == "causal":
        causal = True
    elif case == "gqa-padding-empty-rows":
        mask = M.KeyPadding(torch.tensor([Sk, 0])) & M.Causal()
    elif case == "mla-widths":
        Dv = 16
        causal = True
    else:
        Hkv, Sk, sinks = Hq, Sq, torch.randn(Hq, generator=g)  # SDPA takes sinks with a plain causal mask
        causal = True
    q = torch.randn(B, Hq, Sq, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, Sk, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, Sk, Dv, generator=g).bfloat16()
    with torch.inference_mode():
        out = check_against_oracle(q, k, v, mask, causal=causal, backend="sdpa", grad=False, sinks=sinks)
    assert seen == [True] and out.dtype == torch.bfloat16 and out.shape == (B, Hq, Sq, Dv)
    if case == "gqa-padding-empty-rows":
        assert (out[1] == 0).all()
