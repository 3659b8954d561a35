"""Score modifiers of today's open models: soft-capping (Gemma 2), sinks (gpt-oss), ALiBi (BLOOM).

Each is expressed once in the fp64 oracle; every backend that claims it is checked against the
oracle with rule R (forward, and backward where the backend trains, d(sinks) included), and the
oracle itself against transformers' own eager code with copied inputs."""

from __future__ import annotations

import types

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported, flex

from conftest import DTYPES, check_against_oracle, make_qkv, rule_r, stable_seed

VARIANTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
# (Sq, Sk): decode, speculative verification, prefill, Sq > Sk (rows with no key under causal)
SHAPES = [(1, 77), (4, 300), (33, 33), (9, 5)]


def _masks(B, Hq, Sq, Sk, g):
    lens = torch.randint(0, Sk + 1, (B,), generator=g)
    lens[0] = 0  # a sequence with no key at all
    return {
        "none": (None, False),
        "causal": (None, True),
        "window_padding": (M.SlidingWindow(3) & M.KeyPadding(lens), True),
        "alibi": (M.ALiBi(M.alibi_slopes(Hq)), False),
        "alibi_causal_padding": (M.ALiBi(M.alibi_slopes(Hq)) & M.KeyPadding(lens, side="left"), True),
        "dense": (torch.rand(B, 1, Sq, Sk, generator=g) > 0.3, False),
    }


MODS = {"softcap": dict(softcap=4.0), "sinks": "sinks", "both": "both", "plain": {}}


def _mods(name, Hq, g):
    if name == "sinks":
        return dict(sinks=torch.randn(Hq, generator=g))
    if name == "both":
        return dict(softcap=2.5, sinks=torch.randn(Hq, generator=g) + 2)
    return dict(MODS[name])


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("mask_name", ["none", "causal", "window_padding", "alibi", "alibi_causal_padding", "dense"])
@pytest.mark.parametrize("Sq,Sk", SHAPES, ids=[f"Sq{a}-Sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("backend", ["math", "decode", "sdpa"])
def test_modifiers_match_the_oracle(backend, Sq, Sk, mask_name, mod):
    variant = ["mha", "gqa", "mqa"][stable_seed(Sq, Sk, mask_name, mod) % 3]
    dtype = ["fp32", "bf16", "fp16"][stable_seed(mod, mask_name, Sk) % 3]
    Hq, Hkv = VARIANTS[variant]
    seed = stable_seed(backend, Sq, Sk, mask_name, mod)
    g = torch.Generator().manual_seed(seed)
    mask, causal = _masks(2, Hq, Sq, Sk, g)[mask_name]
    kw = _mods(mod, Hq, g)
    q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, 16, dtype=DTYPES[dtype], seed=seed)
    sdpa_takes_sinks = mask_name == "none" or (mask_name == "causal" and Sq in (1, Sk))
    if backend == "decode" and Sq > 16 and "softcap" not in kw and "alibi" not in mask_name and \
            ("sinks" not in kw or sdpa_takes_sinks):
        with pytest.raises(BackendNotSupported):  # soft-capped, ALiBi or masked-sinks calls: any length
            attnkit.attention(q, k, v, mask, causal=causal, backend=backend, **kw)
        return
    grad = True
    if backend == "sdpa" and ("softcap" in kw or "sinks" in kw):
        # Sinks ride on the CPU flash kernel's log-sum-exp: inference, unmasked or is_causal only.
        flash_sinks = "softcap" not in kw and sdpa_takes_sinks
        if flash_sinks:  # with gradients SDPA still refuses them
            leaf = q.detach().clone().requires_grad_()
            with pytest.raises(BackendNotSupported, match="SDPA cannot express"):
                attnkit.attention(leaf, k, v, mask, causal=causal, backend=backend, **kw)
            grad = False
        else:
            with pytest.raises(BackendNotSupported, match="SDPA cannot express"):
                attnkit.attention(q, k, v, mask, causal=causal, backend=backend, **kw)
            return
    out = check_against_oracle(q, k, v, mask, causal=causal, backend=backend, grad=grad, **kw)
    if mask_name in ("window_padding", "alibi_causal_padding"):
        assert (out[0] == 0).all()  # the sequence with no key outputs exactly 0, sinks or not


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_both_engines_and_paged_kv_apply_every_modifier(implementation, dtype):
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, Sk, D = 8, 2, 200, 24
    q, k, v = make_qkv(3, Hq, Hkv, 2, Sk, D, dtype=DTYPES[dtype], seed=4)
    lens = torch.tensor([200, 0, 57])
    mask = M.ALiBi(M.alibi_slopes(Hq)) & M.Causal(q_start=lens - 2) & M.KeyPadding(lens)
    kw = dict(softcap=3.0, sinks=torch.randn(Hq, generator=g))
    check_against_oracle(q, k, v, mask, backend="decode", **kw)
    bs = 16
    pool_k = torch.zeros(3 * 13 + 2, bs, Hkv, D, dtype=q.dtype)
    pool_v = torch.zeros_like(pool_k)
    table = torch.randperm(pool_k.shape[0], generator=g)[:3 * 13].view(3, 13)
    for b in range(3):  # the dense K/V, scattered over the pool
        rows = torch.arange(Sk)
        pool_k[table[b, rows // bs], rows % bs] = k[b].transpose(0, 1)
        pool_v[table[b, rows // bs], rows % bs] = v[b].transpose(0, 1)
    paged = attnkit.PagedKV(pool_k, pool_v, table, lens)
    mask_p = M.ALiBi(M.alibi_slopes(Hq)) & M.Causal(q_start=lens - 2)
    got = attnkit.attention(q, paged, None, mask_p, backend="paged", **kw)
    want = attnkit.attention(q, k, v, mask, backend="decode", **kw)
    # the same engine over another layout (its own slicing): rule R, with decode as the base
    gold = attnkit.attention(q.double(), k.double(), v.double(), mask, backend="math", softcap=3.0,
                             sinks=kw["sinks"].double())
    rule_r(got, want, gold, n_terms=Sk)
    assert attnkit.describe_call(q, paged, None, mask_p, detail=True, **kw) == f"paged[{implementation}]"


def test_sinks_on_sdpas_flash_kernel_keep_fp64_precision():
    """fp64 calls with sinks stay fp64 through the kernel's log-sum-exp and the sink's rescale."""
    q, k, v = make_qkv(2, 4, 2, 20, 20, 8, dtype=torch.float64, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out = attnkit.attention(q, k, v, causal=True, sinks=sinks, backend="sdpa")
    torch.testing.assert_close(out, attnkit.attention_reference(q, k, v, causal=True, sinks=sinks),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", ["causal", "window_alibi_padding", "cross_sinks", "paged"])
def test_soft_capped_prefill_runs_the_engine_a_chunk_of_queries_at_a_time(implementation, case):
    """Soft-capped calls longer than a decode step take the split-K engine (SDPA cannot cap) in
    chunks of queries; every chunk keeps its rows' intervals, bias and ALiBi positions."""
    from attnkit.backends.decode import splitk
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, D = 8, 2, 32
    Sq, Sk = (150, 150) if case != "cross_sinks" else (130, 400)
    assert Sq > splitk.Q_CHUNK
    q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, D, dtype=torch.bfloat16 if case == "paged" else torch.float32, seed=12)
    lens = torch.tensor([Sk, Sk // 3])
    kw = dict(softcap=3.0)
    mask, causal = None, True
    if case == "window_alibi_padding":  # with sinks, a row's ALiBi offset is not softmax-invariant
        mask = M.SlidingWindow(40) & M.ALiBi(M.alibi_slopes(Hq)) & M.KeyPadding(lens)
        kw["sinks"] = torch.randn(Hq, generator=g)
    if case == "cross_sinks":  # sequence 0 has no key: its rows stay exactly 0, sinks or not
        mask, causal = M.KeyPadding(torch.tensor([0, Sk // 3])), False
        kw["sinks"] = torch.randn(Hq, generator=g)
    if case == "paged":
        bs, W = 16, -(-Sk // 16)
        table = torch.randperm(2 * W + 3, generator=g)[:2 * W].view(2, W)
        pool_k = torch.zeros(2 * W + 3, bs, Hkv, D, dtype=q.dtype)
        pool_v = torch.zeros_like(pool_k)
        for b in range(2):
            rows = torch.arange(Sk)
            pool_k[table[b, rows // bs], rows % bs] = k[b].transpose(0, 1)
            pool_v[table[b, rows // bs], rows % bs] = v[b].transpose(0, 1)
        paged = attnkit.PagedKV(pool_k, pool_v, table, torch.tensor([Sk, Sk]))
        assert attnkit.describe_call(q, paged, None, causal=True, detail=True, **kw) == f"paged[{implementation}]"
        got = attnkit.attention(q, paged, None, causal=True, **kw)
        want = attnkit.attention(q, k, v, causal=True, backend="math", **kw)
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(), causal=True, softcap=3.0)
        rule_r(got, want, gold, n_terms=Sk)
        return
    assert attnkit.describe_call(q, k, v, mask, causal=causal, detail=True, **kw) == f"decode[{implementation}]"
    out = check_against_oracle(q, k, v, mask, causal=causal, backend="decode", **kw)
    if case == "cross_sinks":
        assert (out[0] == 0).all()


@pytest.mark.slow
@pytest.mark.skipif(flex.cpu_vector_isa() == "avx2", reason="flex refuses CPU calls without AVX-512 (flex.cpu_refusals)")
def test_flex_applies_modifiers_as_score_mods():
    Hq, Hkv = 4, 2
    q, k, v = make_qkv(1, Hq, Hkv, 16, 16, 16, seed=9)
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(1))
    mask = M.ALiBi(M.alibi_slopes(Hq))
    check_against_oracle(q, k, v, mask, causal=True, backend="flex", grad=False, softcap=3.0)
    with pytest.raises(BackendNotSupported, match="log-sum-exp"):  # on CUDA flex takes sinks too
        attnkit.attention(q, k, v, mask, backend="flex", sinks=sinks)


def test_sinks_gradient_and_rows_with_nothing_to_attend():
    Hq = 4
    q, k, v = make_qkv(2, Hq, 2, 3, 6, 8, seed=2)
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(5)).requires_grad_()
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    mask[1, :, 2] = False  # row (1, 2) sees no key
    out = attnkit.attention(q, k, v, mask, sinks=sinks)
    assert (out[1, :, 2] == 0).all()
    out.square().sum().backward()
    assert torch.isfinite(sinks.grad).all() and (sinks.grad != 0).all()
    # a huge sink takes all the mass: the output goes to 0, not NaN
    out = attnkit.attention(q, k, v, sinks=torch.full((Hq,), 80.0))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-20


# --------------------------------------------------------------------------- per-query sinks
# One sink logit per query, (B|1, Hq, Sq) or (B|1, Hq, Sq, 1) (Inkling 2 computes them from each
# token's hidden state): math runs them with gradients, SDPA's CPU flash kernel and the split-K
# engine at inference; the Triton kernel (one logit per query head) refuses them.

PER_QUERY = {"B-Hq-Sq-1": lambda B, Hq, Sq, g: torch.randn(B, Hq, Sq, 1, generator=g),
             "1-Hq-Sq": lambda B, Hq, Sq, g: torch.randn(1, Hq, Sq, generator=g) + 1.5}


@pytest.mark.parametrize("form", list(PER_QUERY))
@pytest.mark.parametrize("mask_name", ["none", "causal", "window_padding", "alibi_causal_padding", "dense"])
@pytest.mark.parametrize("Sq,Sk", SHAPES, ids=[f"Sq{a}-Sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
def test_per_query_sinks_match_the_oracle(backend, Sq, Sk, mask_name, form):
    variant = ["mha", "gqa", "mqa"][stable_seed(Sq, Sk, mask_name, form) % 3]
    dtype = ["fp32", "bf16", "fp16"][stable_seed(form, mask_name, Sk) % 3]
    Hq, Hkv = VARIANTS[variant]
    seed = stable_seed("per-query", backend, Sq, Sk, mask_name, form)
    g = torch.Generator().manual_seed(seed)
    mask, causal = _masks(2, Hq, Sq, Sk, g)[mask_name]
    kw = dict(sinks=PER_QUERY[form](2, Hq, Sq, g))
    if stable_seed(mask_name, form) % 2:
        kw["softcap"] = 3.0
    q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, 16, dtype=DTYPES[dtype], seed=seed)
    grad = True
    if backend == "sdpa":  # as for per-head sinks: inference, unmasked or is_causal, no cap
        if "softcap" in kw or not (mask_name == "none" or (mask_name == "causal" and Sq in (1, Sk))):
            with pytest.raises(BackendNotSupported, match="SDPA cannot express"):
                attnkit.attention(q, k, v, mask, causal=causal, backend=backend, **kw)
            return
        grad = False
    out = check_against_oracle(q, k, v, mask, causal=causal, backend=backend, grad=grad, **kw)
    if mask_name in ("window_padding", "alibi_causal_padding"):
        assert (out[0] == 0).all()  # the sequence with no key outputs exactly 0, sinks or not


def test_per_query_sinks_equal_to_per_head_sinks_give_the_same_output():
    """Each query of a head given its head's logit: the (Hq,) result, on every backend that runs both."""
    q, k, v = make_qkv(2, 8, 2, 9, 9, 16, seed=21)
    heads = torch.randn(8, generator=torch.Generator().manual_seed(22))
    for backend in ("math", "sdpa"):
        want = attnkit.attention(q, k, v, causal=True, sinks=heads, backend=backend)
        for rows in (heads.view(1, 8, 1).expand(2, 8, 9), heads.view(1, 8, 1, 1).expand(1, 8, 9, 1)):
            got = attnkit.attention(q, k, v, causal=True, sinks=rows, backend=backend)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_per_query_sinks_on_the_split_k_engine(implementation):
    """The split-K engine reads one sink logit per query row: rule R against the oracle for a
    decode step, speculative rows, a chunked soft-capped prefill, paged K/V and a selection (each
    query its own sequence), and each query given its head's logit equals the (Hq,) result. The
    Triton kernel takes them too (tests/test_triton_kernels.py checks its numbers)."""
    from attnkit.backends import get_backend
    from attnkit.functional import _validate

    g = torch.Generator().manual_seed(31)
    for Sq, Sk, kw in ((1, 300, {}), (5, 300, {}), (70, 90, {"softcap": 3.0})):
        q, k, v = make_qkv(2, 8, 2, Sq, Sk, 16, seed=Sq)
        sinks = torch.randn(2, 8, Sq, generator=g)
        check_against_oracle(q, k, v, M.KeyPadding(torch.tensor([Sk, Sk - 7])), causal=True, backend="decode",
                             sinks=sinks, **kw)
        sel = M.SelectedKeys(torch.randint(-1, Sk, (2, Sq, 9), generator=g)) & M.Causal()
        check_against_oracle(q, k, v, sel, backend="decode", sinks=sinks, **kw)
        heads = torch.randn(8, generator=g)
        torch.testing.assert_close(attnkit.attention(q, k, v, sel, sinks=heads.view(1, 8, 1).expand(2, 8, Sq),
                                                     backend="decode", **kw),
                                   attnkit.attention(q, k, v, sel, sinks=heads, backend="decode", **kw))
    B, Hq, Hkv, Sk, D, bs = 2, 8, 2, 40, 16, 8
    q, k, v = make_qkv(B, Hq, Hkv, 2, Sk, D, seed=5)
    pool = lambda t: t.permute(0, 2, 1, 3).reshape(B * Sk // bs, bs, Hkv, D)  # noqa: E731
    lens = torch.tensor([40, 23])
    kv = attnkit.PagedKV(pool(k), pool(v), torch.arange(B * Sk // bs).view(B, -1), lens)
    sinks = torch.randn(B, Hq, 2, generator=g)
    want = attnkit.attention_reference(q, k, v, M.KeyPadding(lens), causal=True, sinks=sinks).float()
    torch.testing.assert_close(attnkit.attention(q, kv, None, causal=True, sinks=sinks, backend="paged"), want,
                               atol=1e-5, rtol=0)
    call = _validate(q, k, v, None, True, None, 0.0, False, "auto", None, sinks)
    assert not any("sinks" in r for r in get_backend("triton").not_supported_reasons(call))
    assert not get_backend("decode").not_supported_reasons(call)


def test_per_query_sinks_on_cuda_go_to_flex_for_prefill_and_to_the_decode_kernel():
    """The CUDA decision, on CPU (a pure function of the call): FlexAttention joins per-query
    sinks through its log-sum-exp, so ``auto`` runs prefill there; the Triton kernel reads one
    logit per query row, so a decode step runs there (math where Triton cannot run); SDPA
    refuses them."""
    from attnkit.backends import AttentionCall, get_backend, select

    def call(Sq, sinks, grad=True):
        return AttentionCall(2, 8, 2, Sq, 300, 64, 64, torch.float16, torch.device("cuda"), None, 0.125, 0.0,
                             False, grad, sinks=sinks)

    prefill, step = call(64, torch.zeros(2, 8, 64)), call(1, torch.zeros(1, 8, 1), grad=False)
    assert get_backend("flex").not_supported_reasons(prefill) == [] and select(prefill, "auto").name == "flex"
    assert get_backend("triton").not_supported_reasons(step) == []
    want = "triton" if get_backend("triton").available() is None else "math"
    assert get_backend("sdpa").not_supported_reasons(step) and select(step, "auto").name == want
    trained = call(1, torch.zeros(1, 8, 1))  # with gradients: the forward-only kernel declines
    assert not any("sinks" in r for r in get_backend("triton").not_supported_reasons(trained))
    assert select(trained, "auto").name == "math"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Sq", [1, 5, 64])
def test_per_query_sinks_on_cuda_match_the_oracle(Sq):
    """On CUDA: flex (prefill), the Triton kernel (decode without gradients) and math (decode with
    them), forward and backward, d(sinks) included."""
    q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, Sq, 200, 64, dtype=torch.bfloat16, seed=31))
    sinks = torch.randn(2, 8, Sq, 1, generator=torch.Generator().manual_seed(32)).cuda()
    check_against_oracle(q, k, v, causal=True, sinks=sinks)
    check_against_oracle(q, k, v, M.SlidingWindow(16), causal=True, sinks=sinks[:1].squeeze(-1) + 1)


def test_per_query_sinks_gradient_reaches_the_given_tensor():
    """d(sinks) has the shape the caller gave, (B, Hq, Sq, 1), and equals the fp64 oracle's; a
    row with nothing to attend to outputs 0 with finite gradients."""
    Hq = 4
    q, k, v = make_qkv(2, Hq, 2, 3, 6, 8, seed=25)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    mask[1, :, 2] = False  # row (1, 2) sees no key
    sinks = torch.randn(2, Hq, 3, 1, generator=torch.Generator().manual_seed(26))
    got = sinks.clone().requires_grad_()
    gold = sinks.double().requires_grad_()
    out = attnkit.attention(q, k, v, mask, sinks=got)
    ref = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, sinks=gold)
    assert (out[1, :, 2] == 0).all()
    out.square().sum().backward()
    ref.square().sum().backward()
    assert got.grad.shape == (2, Hq, 3, 1) and torch.isfinite(got.grad).all()
    assert (got.grad[1, :, 2] == 0).all()  # an empty row's sink takes no gradient
    torch.testing.assert_close(got.grad.double(), gold.grad, atol=1e-5, rtol=1e-5)


def test_softcap_bounds_the_scores():
    q, k, v = make_qkv(1, 2, 2, 1, 5, 4, seed=1)
    out, w = attnkit.attention(q * 1e4, k, v, softcap=1.0, return_weights=True)
    # every score is in (-1, 1) after capping: the weights cannot be more peaked than e^2 : 1
    assert (w.max(-1).values / w.min(-1).values <= torch.e ** 2 + 1e-3).all()


# --------------------------------------------------------------------------- against transformers

def test_gemma2_softcap_equals_transformers_eager():
    gemma = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    q, k, v = make_qkv(2, 8, 2, 7, 7, 16, seed=6)
    mod = types.SimpleNamespace(num_key_value_groups=4, training=False, config=types.SimpleNamespace())
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    want, _ = gemma.eager_attention_forward(mod, q, k, v, causal, dropout=0.0, scaling=0.3, softcap=20.0)
    got = attnkit.attention(q, k, v, causal=True, scale=0.3, softcap=20.0)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_sinks_equal_transformers_eager():
    gpt = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v = make_qkv(2, 8, 2, 6, 6, 16, seed=7)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(8))
    mod = types.SimpleNamespace(num_key_value_groups=4, training=False, sinks=sinks)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    want, _ = gpt.eager_attention_forward(mod, q, k, v, causal, scaling=0.25)
    for backend in ("math", "decode"):
        got = attnkit.attention(q, k, v, causal=True, scale=0.25, sinks=sinks, backend=backend)
        torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [1, 6, 8, 12, 16, 30])
def test_alibi_slopes_and_bias_equal_bloom(heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    pad = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = bloom.build_alibi_tensor(pad, heads, torch.float32).view(2, heads, 1, 6)
    torch.testing.assert_close(M.alibi_slopes(heads), want[1, :, 0, 1])
    q, k, v = make_qkv(2, heads, heads, 6, 6, 8, seed=heads)
    # BLOOM adds slope * key index; ALiBi's slope * (key - query) differs per row by a constant
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + want
    scores = scores.masked_fill(~pad.bool()[:, None, None, :] | torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ v
    got = attnkit.attention(q, k, v, M.ALiBi(M.alibi_slopes(heads)) & M.KeyPadding(pad.sum(1), side="left"),
                            causal=True)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0, :, 1:], ref[0, :, 1:], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw,err,text", [
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=True), ValueError, "softcap"),
    (dict(sinks=[1.0, 2.0]), TypeError, "sinks"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks.*\(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(1, 4)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(1, 4, 3)), ValueError, r"sinks.*\(1\|1, 4, 2\[, 1\]\).*\(1, 4, 3\)"),
    (dict(sinks=torch.zeros(2, 4, 2, 1)), ValueError, r"sinks.*\(2, 4, 2, 1\).*q \(1, 4, 2, 8\)"),
    (dict(sinks=torch.zeros(1, 4, 2, 2)), ValueError, r"sinks.*\(1, 4, 2, 2\)"),
    (dict(sinks=torch.zeros(1, 2, 2)), ValueError, r"sinks.*\(1, 2, 2\)"),
    (dict(sinks=torch.zeros(1, 4, 2, dtype=torch.long)), ValueError, "sinks.*int64"),
])
def test_bad_modifiers_name_the_argument(kw, err, text):
    q, k, v = make_qkv(1, 4, 2, 2, 3, 8)
    with pytest.raises(err, match=text):
        attnkit.attention(q, k, v, **kw)


def test_bad_alibi_names_the_slopes_and_heads():
    q, k, v = make_qkv(1, 4, 2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"3 slopes.*4 query heads"):
        attnkit.attention(q, k, v, M.ALiBi(torch.ones(3)))
    with pytest.raises(TypeError, match="slopes"):
        M.ALiBi(torch.ones(2, 2))
    with pytest.raises(ValueError, match="finite"):
        M.ALiBi(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="'\\|'"):
        M.ALiBi(torch.ones(4)) | M.Causal()
    with pytest.raises(ValueError, match="num_heads"):
        M.alibi_slopes(0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_triton_kernel_applies_every_modifier(dtype, paged):
    """The Triton split-K kernel (compiled on CUDA, in Triton's interpreter on CPU): softcap on the
    scaled scores, ALiBi per score from the slopes and each sequence's query positions, sinks once
    in the merge. Every tensor lives where the kernel runs: on a CUDA machine (no interpreter
    there) the kernel refuses CPU tensors."""
    from attnkit.backends import get_backend
    from attnkit.backends.triton import interpreting
    if get_backend("triton").available() is not None:
        pytest.skip(get_backend("triton").available())
    dev = "cpu" if interpreting() else "cuda"
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, Sk, D = 8, 2, 70, 16
    q, k, v = (t.to(dev) for t in make_qkv(2, Hq, Hkv, 2, Sk, D, dtype=DTYPES[dtype], seed=12))
    lens = torch.tensor([70, 23], device=dev)
    kw = dict(softcap=2.0, sinks=torch.randn(Hq, generator=g).to(dev))
    alibi = M.ALiBi(M.alibi_slopes(Hq), q_start=lens - 2)
    mask = alibi & M.Causal(q_start=lens - 2) & M.KeyPadding(lens)
    if not paged:
        check_against_oracle(q, k, v, mask, backend="triton", **kw)
        return
    bs, W = 16, 5
    table = torch.randperm(12, generator=g)[:2 * W].view(2, W).to(dev)
    pool_k = torch.zeros(12, bs, Hkv, D, dtype=q.dtype, device=dev)
    pool_v = torch.zeros_like(pool_k)
    pos = torch.arange(Sk, device=dev)
    for b in range(2):
        pool_k[table[b, pos // bs], pos % bs] = k[b].transpose(0, 1)
        pool_v[table[b, pos // bs], pos % bs] = v[b].transpose(0, 1)
    got = attnkit.attention(q, attnkit.PagedKV(pool_k, pool_v, table, lens), None,
                            alibi & M.Causal(q_start=lens - 2), backend="triton", **kw)
    want = attnkit.attention(q, k, v, mask, backend="math", **kw)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == "fp32" else 2e-2, rtol=1e-3)
