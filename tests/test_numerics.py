"""Numerics at the edges (docs/testing.md): extreme logits, stacked additive masks, determinism and
dropout. Every backend that can run the call is checked against the fp64 oracle with the same
mask under rule R (tests/conftest.py), and must produce no NaN/Inf.

(a) fp16 scores near the fp16 maximum (~3e4), with scale=1.0 and scale=None, and raw q.k^T past
    the fp16 maximum that only the scale brings back into range;
(b) bf16 inputs around 1e5;
(c) stacked additive masks: Additive(a) & Additive(b) with -6e4 in fp16 each (the sum leaves the
    fp16 range), -inf mixed in, and fp16 masks holding finfo(fp16).min ANDed with causal;
(d) determinism: the same inputs twice give the same bits (outputs and gradients);
(e) dropout: seeded reproducibility, p=0 a bitwise no-op that leaves torch's RNG alone,
    kept weights exactly p/(1-p)-scaled, the dropped mass ~p, the mean over seeds -> no dropout.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported
from attnkit.backends.decode import MAX_DECODE_Q_LEN

from conftest import DTYPES, INFERENCE_ONLY, base_attention, check_against_oracle, make_qkv, rule_r, stable_seed

BACKENDS = ["math", "sdpa", "decode"]
FP16_MAX = torch.finfo(torch.float16).max
FP16_MIN = torch.finfo(torch.float16).min


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


def _finite(out):
    assert torch.isfinite(out).all(), "NaN or Inf in the output"


# --------------------------------------------------------------------------- (a) fp16 near max


def aligned_qk(B, Hq, Hkv, Sq, Sk, D, magnitude, g, dtype):
    """q rows along one random +-1 direction u, k rows along +-u: every raw score is about
    +-magnitude**2 * D (so near fp16's max for magnitude 21, D 64), with a few % noise so the
    softmax still has to pick among keys. v is randn."""
    u = torch.randint(0, 2, (D,), generator=g).double() * 2 - 1
    q = magnitude * u * (1 + 0.02 * torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64))
    sign = torch.randint(0, 2, (B, Hkv, Sk, 1), generator=g).double() * 2 - 1
    sign[:, :, 0] = 1  # at least one key with a large positive score per head
    k = magnitude * u * sign * (1 + 0.02 * torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64))
    v = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(5, 11), (9, 9), (1, 13)])
@pytest.mark.parametrize("scale", [1.0, None])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_scores_near_fp16_max(backend, scale, Sq, Sk, causal):
    B, Hq, Hkv, D = 2, 4, 2, 64
    q, k, v = aligned_qk(B, Hq, Hkv, Sq, Sk, D, 21.0, _gen("fp16max", Sq, Sk, causal), torch.float16)
    raw = q.double() @ k.double().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)
    assert 2.5e4 < raw.abs().max() < FP16_MAX  # the premise: near the top of fp16, still finite
    assert torch.isfinite(q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)).all()
    out = check_against_oracle(q, k, v, causal=causal, scale=scale, backend=backend)
    _finite(out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_raw_scores_past_fp16_max_scaled_back_into_range(backend):
    """q.k^T ~ 1e5 overflows fp16, q.k^T * scale (1/8) ~ 1.3e4 does not: a backend must not form
    the unscaled product in fp16. The eager base does, so its stand-in here scales q first."""
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 4, 9, 64
    q, k, v = aligned_qk(B, Hq, Hkv, Sq, Sk, D, 40.0, _gen("fp16past"), torch.float16)
    G = Hq // Hkv
    raw = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)
    assert raw.abs().max() > FP16_MAX and (raw / 8).abs().max() < FP16_MAX
    out = attnkit.attention(q, k, v, backend=backend)  # scale None = 1/sqrt(64) = 1/8
    _finite(out)
    gold = attnkit.attention_reference(q, k, v)
    base = base_attention((q.double() / 8).half(), k, v, scale=1.0)
    rule_r(out, base, gold)


# --------------------------------------------------------------------------- (b) bf16 around 1e5


@pytest.mark.parametrize("which", ["qkv", "qk", "q"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_around_1e5(backend, causal, which):
    B, Hq, Hkv, Sq, Sk, D = 2, 6, 2, 5, 12, 16
    seed = stable_seed("bf16big", which, causal)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float64, seed=seed)
    big = {"q": q, "k": k, "v": v}
    q, k, v = ((t * 1e5 if name in which else t).to(torch.bfloat16) for name, t in big.items())
    out = check_against_oracle(q, k, v, causal=causal, backend=backend)
    _finite(out)


# --------------------------------------------------------------------------- (c) stacked additive masks


def _additive_parts(B, Sq, Sk, g):
    """Two fp16 biases with entries in {0, -6e4, -inf}; their fp32 sum reaches -1.2e5 (past fp16),
    with rows that are all -6e4 + -6e4 (every key equally penalised), rows mixing -6e4 and
    -1.2e5 only, and one row -inf everywhere (fully masked)."""
    vals = torch.tensor([0.0, -6e4, float("-inf")])
    a = vals[torch.randint(0, 3, (B, 1, Sq, Sk), generator=g)]
    b = vals[torch.multinomial(torch.tensor([0.5, 0.4, 0.1]), Sq * Sk, replacement=True, generator=g)]
    b = b.reshape(1, 1, Sq, Sk)
    a[:, :, 1], b[:, :, 1] = -6e4, -6e4  # sum -1.2e5 on every key: plain softmax of the scores
    a[:, :, 2] = -6e4
    b[:, :, 2] = torch.where(torch.arange(Sk) % 2 == 0, -6e4, 0.0)  # -1.2e5 / -6e4 alternating
    a[0, :, 3] = float("-inf")  # fully masked row in batch item 0
    a, b = a.half(), b.half()
    assert torch.isneginf(a.float() + b.float()).any() and (a.float() + b.float()).min() < FP16_MIN
    assert ((a.float() + b.float()) == -1.2e5).any()
    return a, b


def _stacked_params():
    for backend in BACKENDS:
        for dtype in ("fp16", "bf16", "fp32"):
            for causal in (False, True):
                for grad in (False, True):
                    name = f"{backend}-{dtype}-{'causal' if causal else 'full'}-{'grad' if grad else 'fwd'}"
                    yield pytest.param(backend, dtype, causal, grad, id=name)


@pytest.mark.parametrize("backend,dtype,causal,grad", list(_stacked_params()))
def test_stacked_additive_masks(backend, dtype, causal, grad):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 6, 10, 16
    seed = stable_seed("stacked", dtype, causal)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], seed=seed)
    a, b = _additive_parts(B, Sq, Sk, torch.Generator().manual_seed(seed))
    mask = M.Additive(a) & M.Additive(b)
    out = check_against_oracle(q, k, v, mask, causal=causal, backend=backend, grad=grad)
    _finite(out)
    assert (out[0, :, 3] == 0).all()  # the -inf row attends to nothing


@pytest.mark.parametrize("how", ["tensor_and_causal_flag", "stacked_with_causal_mask", "top_left_causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_min_additive_mask_with_causal(backend, dtype, how):
    """An fp16 mask tensor holding finfo(fp16).min (the usual "masked" value of fp16 models) passed
    directly, summed with causal; twice stacked the sum is past fp16's range."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 1, 7, 7, 8
    seed = stable_seed("fp16min", dtype, how)
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], seed=seed)
    fm = torch.where(torch.rand(B, 1, Sq, Sk, generator=g) < 0.5, FP16_MIN, 0.0).half()
    fm[:, :, 2] = FP16_MIN  # every key at fp16 min: only the causal -inf decides
    fm[1, :, 4, :3] = 0.0
    if how == "tensor_and_causal_flag":
        mask, causal = fm, True
    elif how == "stacked_with_causal_mask":
        mask, causal = M.Additive(fm) & M.Additive(fm) & M.Causal(), False
    else:  # Sq == Sk: sdpa may take its is_causal path for the causal part only if no bias
        mask, causal = M.Causal("top_left") & M.Additive(fm), False
    out = check_against_oracle(q, k, v, mask, causal=causal, backend=backend)
    _finite(out)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("backend", [
    "math", "decode",
    "sdpa",
])
def test_stacked_bias_with_large_offset_keeps_small_differences(backend, dtype):
    """Additive(-6e4 everywhere) & Additive(randn): softmax is shift invariant, so the result is
    softmax(scores + randn bias); the eager base (bias added in fp32) gets this right."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 4, 8, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], seed=11)
    soft = torch.full((1, 1, Sq, Sk), -6e4, dtype=torch.float16)
    rel = torch.randn(1, 1, Sq, Sk, generator=torch.Generator().manual_seed(12))
    check_against_oracle(q, k, v, M.Additive(soft) & M.Additive(rel), backend=backend, grad=False)


# --------------------------------------------------------------------------- (d) determinism


def _run_with_grads(q, k, v, mask, causal, backend, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*leaves, mask, causal=causal, backend=backend)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


DET_MASKS = {
    "none": lambda B, Sq, Sk, g: (None, False),
    "causal": lambda B, Sq, Sk, g: (None, True),
    "key_padding": lambda B, Sq, Sk, g: (M.KeyPadding(torch.randint(0, Sk + 1, (B,), generator=g)), False),
    "dense_bool": lambda B, Sq, Sk, g: (torch.rand(B, 1, Sq, Sk, generator=g) > 0.4, False),
    "additive": lambda B, Sq, Sk, g: (torch.randn(1, 1, Sq, Sk, generator=g), True),
}


@pytest.mark.parametrize("mask_name", list(DET_MASKS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("Sq", [3, 37])
def test_same_inputs_same_bits(backend, dtype, mask_name, Sq):
    if backend == "decode" and Sq > MAX_DECODE_Q_LEN:
        pytest.skip("decode takes Sq <= 16")
    B, Hq, Hkv, Sk, D = 2, 6, 2, 41, 24
    seed = stable_seed("det", dtype, mask_name, Sq)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], seed=seed)
    mask, causal = DET_MASKS[mask_name](B, Sq, Sk, torch.Generator().manual_seed(seed))
    out1 = attnkit.attention(q, k, v, mask, causal=causal, backend=backend)
    torch.manual_seed(1234)  # a different RNG state must not matter without dropout
    out2 = attnkit.attention(q.clone(), k.clone(), v.clone(), mask, causal=causal, backend=backend)
    assert torch.equal(out1, out2)
    _finite(out1)
    if backend in INFERENCE_ONLY:
        return
    dout = torch.randn(out1.shape, generator=torch.Generator().manual_seed(seed)).to(out1.dtype)
    first = _run_with_grads(q, k, v, mask, causal, backend, dout)
    second = _run_with_grads(q, k, v, mask, causal, backend, dout)
    for name, x, y in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(x, y), f"{name} differs between two identical runs"


# --------------------------------------------------------------------------- (e) dropout


DROPOUT_BACKENDS = ["math", "sdpa", "auto"]


def identity_v(B, Hkv, Sk, dtype=torch.float32):
    """v[b, h] = I (Sk == Dv), so out == the probabilities actually applied (the effective weights)."""
    return torch.eye(Sk, dtype=dtype).expand(B, Hkv, Sk, Sk).contiguous()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_same_seed_same_bits_other_seed_differs(backend, dtype):
    q, k, v = make_qkv(2, 4, 2, 6, 24, 16, dtype=DTYPES[dtype], seed=21)
    mask = M.KeyPadding(torch.tensor([24, 17]))

    def run(seed):
        torch.manual_seed(seed)
        return attnkit.attention(q, k, v, mask, causal=True, dropout_p=0.3, backend=backend)

    a, b, c = run(5), run(5), run(6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    for x in (a, c):
        _finite(x)
    assert not torch.equal(a, attnkit.attention(q, k, v, mask, causal=True, backend=backend))


@pytest.mark.parametrize("p", [0.0, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_dropout_zero_is_a_bitwise_noop_and_leaves_rng_alone(backend, dtype, p):
    q, k, v = make_qkv(2, 4, 2, 5, 19, 8, dtype=DTYPES[dtype], seed=22)
    mask = torch.rand(2, 1, 5, 19, generator=torch.Generator().manual_seed(23)) > 0.3
    assert attnkit.describe_call(q, k, v, mask, dropout_p=p, backend=backend) == \
        attnkit.describe_call(q, k, v, mask, backend=backend)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    with_p = attnkit.attention(q, k, v, mask, dropout_p=p, backend=backend)
    assert torch.equal(torch.get_rng_state(), state), "dropout_p=0 advanced torch's RNG"
    without = attnkit.attention(q, k, v, mask, backend=backend)
    assert torch.equal(with_p, without)
    # and with gradients (sdpa may pick another kernel then): the same bits, still no RNG use
    if backend in INFERENCE_ONLY:
        return
    runs = []
    for kw in ({"dropout_p": p}, {}):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        state = torch.get_rng_state()
        out = attnkit.attention(*leaves, mask, backend=backend, **kw)
        out.square().sum().backward()
        assert torch.equal(torch.get_rng_state(), state)
        runs.append([out.detach()] + [t.grad for t in leaves])
    for name, x, y in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(x, y), f"{name}: dropout_p={p!r} is not a bitwise no-op"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("p", [0.5, 0.75, 0.2, 0.9])
def test_math_dropout_weights_are_zero_or_rescaled(p, dtype):
    """Every returned weight is 0 or the no-dropout weight times 1/(1-p) (exactly when 1/(1-p) is
    a power of two), masked weights stay 0, and the returned weights are the ones applied to V."""
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 6, 32
    q, k, _ = make_qkv(B, Hq, Hkv, Sq, Sk, 16, dtype=DTYPES[dtype], seed=24)
    v = identity_v(B, Hkv, Sk, DTYPES[dtype])
    mask = torch.rand(B, 1, Sq, Sk, generator=torch.Generator().manual_seed(25)) > 0.25
    mask[1, :, 2] = False
    out0, w0 = attnkit.attention(q, k, v, mask, return_weights=True, backend="math")
    torch.manual_seed(7)
    out, w = attnkit.attention(q, k, v, mask, dropout_p=p, return_weights=True, backend="math")
    assert w.dtype == torch.float32 and w.shape == w0.shape
    _finite(w)
    kept = w != 0
    assert not (kept & (w0 == 0)).any(), "a masked (zero) weight came back non-zero"
    expected = w0 * (1.0 / (1.0 - p))
    if (1.0 / (1.0 - p)).is_integer() and math.log2(1.0 / (1.0 - p)).is_integer():
        assert torch.equal(w[kept], expected[kept])
    else:
        torch.testing.assert_close(w[kept], expected[kept], rtol=3e-7, atol=0)
    dropped = (~kept) & (w0 > 0)
    assert dropped.any() and kept.any()
    assert (w[1, :, 2] == 0).all() and (out[1, :, 2] == 0).all()
    if dtype == "fp32":
        assert torch.equal(out, w)  # v = I: the output is exactly the weights it applied
    else:
        torch.testing.assert_close(out.float(), w, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_math_dropout_drops_p_of_the_mass_and_averages_to_no_dropout(p):
    B, Hq, Hkv, Sq, Sk = 1, 2, 1, 4, 64
    q, k, _ = make_qkv(B, Hq, Hkv, Sq, Sk, 16, seed=26)
    q = q * 0.3  # near-uniform weights: many keys carry mass
    v = identity_v(B, Hkv, Sk)
    ref = attnkit.attention(q, k, v, backend="math")
    n = 400
    total = torch.zeros_like(ref)
    dropped_mass = dropped_count = 0.0
    for s in range(n):
        torch.manual_seed(1000 + s)
        out = attnkit.attention(q, k, v, dropout_p=p, backend="math")
        total += out
        dropped = out == 0
        dropped_mass += ref[dropped].sum().item() / ref.sum().item()
        dropped_count += dropped.float().mean().item()
    assert abs(dropped_mass / n - p) < 0.01, f"dropped mass fraction {dropped_mass / n:.4f}, p={p}"
    assert abs(dropped_count / n - p) < 0.01
    mean = total / n
    # Per entry the mean of n draws of w * Bernoulli(1-p) / (1-p) has relative sd sqrt(p/((1-p) n)).
    rel_sd = math.sqrt(p / ((1 - p) * n))
    rel = (mean - ref).abs() / ref
    assert rel.max() < 6 * rel_sd, f"max relative deviation {rel.max():.3f} > 6 sd ({6 * rel_sd:.3f})"
    assert rel.mean() < 1.5 * rel_sd
    torch.testing.assert_close(mean.sum(-1), torch.ones(B, Hq, Sq), atol=0.02, rtol=0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sdpa_dropout_half_the_weights(dtype):
    """sdpa with p=0.5 and v = I: the output is the effective weights; about half of the
    positive ones are zeroed, the kept ones are doubled, masked rows stay exactly 0."""
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 8, 48
    dt = DTYPES[dtype]
    q, k, _ = make_qkv(B, Hq, Hkv, Sq, Sk, 16, dtype=dt, seed=27)
    v = identity_v(B, Hkv, Sk, dt)
    mask = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    mask[0, :, 3] = False
    w0 = attnkit.attention(q, k, v, mask, backend="math", return_weights=True)[1]
    torch.manual_seed(8)
    out = attnkit.attention(q, k, v, mask, dropout_p=0.5, backend="sdpa")
    _finite(out)
    assert (out[0, :, 3] == 0).all()
    live = w0 > 0
    zero_frac = (out == 0)[live].float().mean().item()
    assert abs(zero_frac - 0.5) < 0.05, f"fraction of dropped weights {zero_frac:.3f}, p=0.5"
    kept = (out != 0) & live
    tol = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 1e-3), "fp16": (3e-3, 1e-4)}[dtype]
    torch.testing.assert_close(out.float()[kept], 2 * w0[kept], rtol=tol[0], atol=tol[1])
    # gradients flow through sdpa's dropout without NaN
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(8)
    attnkit.attention(*leaves, mask, dropout_p=0.5, backend="sdpa").square().sum().backward()
    for t in leaves:
        _finite(t.grad)


def test_decode_refuses_dropout_and_auto_does_not_pick_it():
    q, k, v = make_qkv(1, 4, 2, 1, 40000, 8)  # fp32, above both implementations' size floor for auto
    with pytest.raises(BackendNotSupported, match="dropout"):
        attnkit.attention(q, k, v, dropout_p=0.1, backend="decode")
    assert attnkit.describe_call(q, k, v) == "decode"
    assert attnkit.describe_call(q, k, v, dropout_p=0.1) != "decode"
