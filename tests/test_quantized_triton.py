"""The Triton decode kernel reading quantized K/V (int8, fp8 e4m3; :class:`attnkit.QuantizedKV`)
in place, against the fp64 oracle over the dequantized K/V (``QuantizedKV.gather(torch.float64)``)
under rule R, the base being the plain eager attention over K/V dequantized to q's dtype.

Without CUDA these run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1),
on small shapes; fp8 runs there too (the kernel decodes e4m3 bytes with integer ops, the same code
a GPU runs). With CUDA the same tests run the compiled kernels, plus the CUDA-only cases at the
end."""

from __future__ import annotations

import math
import random

import pytest
import torch

import attnkit
from attnkit import QuantizedKV
from attnkit import masks as M
from attnkit.backends import registry
from attnkit.masks import ALiBi, Causal, KeyPadding

from conftest import AOT_PREAMBLE, base_attention, compile_ahead, rule_r, scattered_table, stable_seed

triton_ops = pytest.importorskip("attnkit.backends.triton.ops")
if triton_ops.available() is not None:
    pytest.skip(f"Triton kernels unavailable: {triton_ops.available()}", allow_module_level=True)

import triton  # noqa: E402  (present: the kernel module imported it)
import triton.language as tl  # noqa: E402

from attnkit.backends.triton import kernel as triton_kernel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_CUDA = torch.cuda.is_available()
STORAGE = ["int8", "fp8_e4m3"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pools(B, Hkv, D, Dv, page, lens, storage, *, seed, v_from_k=False, v_mag=1.0):
    """Quantized pages on a scattered (shuffled) block table: a paged QuantizedKV holding
    ``lens[b]`` tokens per sequence (random float K/V, then quantized row by row). ``v_mag``
    scales the float V before quantizing (small V rows: small V scales)."""
    g = torch.Generator().manual_seed(seed)
    table, N = scattered_table(lens, page, random.Random(seed), fill=-1, spare=1)  # -1: padding past the pages
    k_pool = torch.randn(N, page, Hkv, D, generator=g)
    v_pool = None if v_from_k else torch.randn(N, page, Hkv, Dv, generator=g) * v_mag
    kv = QuantizedKV.quantize(k_pool.to(DEV), None if v_pool is None else v_pool.to(DEV), storage,
                              v_head_dim=Dv if v_from_k else None, block_table=table.to(DEV),
                              lengths=torch.tensor(lens).to(DEV))
    kv.validate()
    return kv


def _dense(B, Hkv, L, D, Dv, storage, *, seed, v_from_k=False, v_mag=1.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = None if v_from_k else torch.randn(B, Hkv, L, Dv, generator=g) * v_mag
    kv = QuantizedKV.quantize(k.to(DEV), None if v is None else v.to(DEV), storage,
                              v_head_dim=Dv if v_from_k else None)
    kv.validate()
    return kv


def _kv(layout, B, Hkv, D, Dv, lens, storage, *, seed, v_from_k=False, v_mag=1.0):
    """A dense or paged QuantizedKV and the mask its padding needs (dense: KeyPadding(lens))."""
    if layout == "paged":
        return _pools(B, Hkv, D, Dv, 16, lens, storage, seed=seed, v_from_k=v_from_k, v_mag=v_mag), None
    kv = _dense(B, Hkv, max(lens), D, Dv, storage, seed=seed, v_from_k=v_from_k, v_mag=v_mag)
    return kv, KeyPadding(torch.tensor(lens))


def _check(out, q, kv: QuantizedKV, mask, *, scale=None, softcap=None, sinks=None, rows=None):
    """Rule R: ``out`` against the fp64 oracle on the dequantized K/V, the base being the eager
    attention over K/V dequantized to q's dtype (what every non-quantized backend receives).
    A paged kv's lengths join the mask as attention() adds them. ``rows``: an index into the
    outputs (checks those rows only)."""
    if kv.paged:
        pad = KeyPadding(kv.lengths.cpu())
        mask = pad if mask is None else mask & pad
    kg, vg = (t.cpu() for t in kv.gather(torch.float64))
    kb, vb = (t.cpu() for t in kv.gather(q.dtype))
    q = q.cpu()
    sinks = None if sinks is None else sinks.cpu()
    gold = attnkit.attention_reference(q.double(), kg, vg, mask, scale=scale, softcap=softcap,
                                       sinks=None if sinks is None else sinks.double())
    base = base_attention(q, kb, vb, mask, scale=scale, softcap=softcap, sinks=sinks)
    out = out.cpu()
    if rows is not None:
        out, base, gold = out[rows], base[rows], gold[rows]
    rule_r(out, base, gold, n_terms=max(kg.shape[2], kg.shape[3]))


def _q(B, Hq, S, D, dtype, seed):
    return torch.randn(B, Hq, S, D, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("storage", STORAGE)
def test_kernel_matches_oracle(storage, layout, heads, dtype):
    """Ragged lengths (one sequence empty in the paged form), 1-3 query tokens (causal among
    them), MHA / GQA / MQA, every q dtype, several splits."""
    seed = stable_seed("qkernel", storage, layout, heads, str(dtype))
    rng = random.Random(seed)
    Hq, Hkv = heads
    S, D = rng.choice([1, 3]), 32
    lens = [0 if layout == "paged" else S, rng.randint(20, 70)]
    kv, pad = _kv(layout, 2, Hkv, D, D, lens, storage, seed=seed)
    q = _q(2, Hq, S, D, dtype, seed + 1)
    seq = torch.tensor(lens)
    num_splits = rng.choice([0, 1, 3])
    if layout == "paged":
        out = triton_ops.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.lengths, k_scale=kv.k_scale,
                                                v_scale=kv.v_scale, num_splits=num_splits)
        assert (out[0] == 0).all(), "a sequence with no keys gives exact zeros"
    else:
        out = triton_ops.decode_attention(q, kv.k, kv.v, lengths=seq.to(DEV), k_scale=kv.k_scale,
                                          v_scale=kv.v_scale, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == (2, Hq, S, D)
    _check(out, q, kv, Causal(q_start=seq - S) if pad is None else Causal(q_start=seq - S) & pad)


def _modifier(name, Hq, S, lens):
    """(mask, kwargs of attention()) for one modifier a cache's decode step carries."""
    g = torch.Generator().manual_seed(len(name))
    seq = torch.tensor(lens)
    causal = Causal(q_start=seq - S)
    slopes = M.alibi_slopes(Hq)
    return {
        "causal": (causal, {}),
        "non-causal": (None, {}),
        "softcap": (causal, {"softcap": 5.0}),
        "sinks": (causal, {"sinks": torch.randn(Hq, generator=g).to(DEV)}),
        "alibi": (ALiBi(slopes) & causal, {}),
        "all": (ALiBi(slopes) & causal, {"softcap": 8.0, "sinks": torch.randn(Hq, generator=g).to(DEV)}),
    }[name]


@pytest.mark.parametrize("modifier", ["causal", "non-causal", "softcap", "sinks", "alibi", "all"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("storage", STORAGE)
def test_modifiers_through_attention(storage, layout, modifier):
    """attnkit.attention(q, QuantizedKV, backend="triton"): the backend's quantized branches with
    every score modifier the kernel runs (soft-cap, sinks, ALiBi, causal q_start, padding), bf16,
    a 3-token verification step and GQA; the scale is not 1/sqrt(D)."""
    seed = stable_seed("qmod", storage, layout, modifier)
    Hq, Hkv, S, D = 4, 2, 3, 24
    lens = [29, 50]
    kv, pad = _kv(layout, 2, Hkv, D, D, lens, storage, seed=seed)
    q = _q(2, Hq, S, D, torch.bfloat16, seed + 1)
    mask, kw = _modifier(modifier, Hq, S, lens)
    if pad is not None:
        mask = pad if mask is None else mask & pad
    scale = 0.8 / math.sqrt(D)
    assert attnkit.describe_call(q, kv, None, mask, scale=scale, backend="triton", **kw) == "triton"
    out = attnkit.attention(q, kv, None, mask, scale=scale, backend="triton", **kw)
    _check(out, q, kv, mask, scale=scale, **kw)


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("rank,rope", [(16, 8), (24, 8)])
def test_v_read_from_k(rank, rope, storage, layout):
    """MLA's latent cache quantized: V = the first `rank` channels of K, scaled by K's scales;
    many query heads on one latent head; rank 24 is not a power of two."""
    seed = stable_seed("qmla", rank, rope, storage, layout)
    H, S, lens = 8, 2, [37, 21]
    D = rank + rope
    kv, pad = _kv(layout, 2, 1, D, rank, lens, storage, seed=seed, v_from_k=True)
    q = _q(2, H, S, D, torch.bfloat16, seed + 1)
    seq = torch.tensor(lens)
    mask = Causal(q_start=seq - S) if pad is None else Causal(q_start=seq - S) & pad
    scale = 0.7 / math.sqrt(D)
    out = attnkit.attention(q, kv, None, mask, scale=scale, backend="triton", softcap=10.0)
    assert out.shape == (2, H, S, rank)
    _check(out, q, kv, mask, scale=scale, softcap=10.0)


@pytest.mark.parametrize("D,Dv", [(1, 1), (7, 5), (80, 48)])
@pytest.mark.parametrize("storage", STORAGE)
def test_odd_head_dims(D, Dv, storage):
    """Head dims that pad the tiles (1, 7: below the 16-wide minimum; 80 = 64 + a 16-wide rest)
    and V narrower than K, paged, fp16."""
    seed = stable_seed("qodd", D, Dv, storage)
    lens = [19, 33]
    kv = _pools(2, 2, D, Dv, 16, lens, storage, seed=seed)
    q = _q(2, 4, 1, D, torch.float16, seed + 1)
    out = attnkit.attention(q, kv, None, causal=True, backend="triton")
    _check(out, q, kv, Causal())


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_small_value_scales_keep_their_digits(dtype, storage):
    """V scales 2**-12 times smaller give outputs exactly 2**-12 times smaller (up to fp16's
    subnormal spacing where the output lands there). A probability times a V scale near 1e-2 *
    2**-12 lies below fp16's normal range: P times the scales, rounded to fp16 as is, would lose
    its digits there (an error rule R's absolute floor cannot see on outputs this small), which
    is why the kernel divides each tile's scales by their largest first (module docstring)."""
    seed = stable_seed("qsmall", str(dtype), storage)
    lens = [60, 45]
    kv = _pools(2, 2, 32, 32, 16, lens, storage, seed=seed)
    q = _q(2, 4, 2, 32, dtype, seed + 1)
    tiny = QuantizedKV(kv.k, kv.k_scale, kv.v, kv.v_scale * 2.0 ** -12, block_table=kv.block_table,
                       lengths=kv.lengths)
    out, out_tiny = (attnkit.attention(q, x, None, causal=True, backend="triton") for x in (kv, tiny))
    _check(out, q, kv, Causal())
    _check(out_tiny, q, tiny, Causal())
    err = (out_tiny.double() * 2.0 ** 12 - out.double()).abs().max().item()
    assert err <= 2.0 ** -24 * 2.0 ** 12, f"V scales times 2**-12 moved the output by {err:.3e} (scaled back)"


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_a_nan_scale_reaches_only_the_rows_that_see_its_key(which):
    """A 3-token verification step whose last key has a NaN scale: the query that sees it gets
    NaN (NaN in, NaN out); the two earlier queries, which do not, equal the oracle without it."""
    lens = [20, 40]
    kv = _dense(2, 1, 40, 16, 16, "int8", seed=5)
    scales = getattr(kv, which).clone()
    scales[1, 0, 39] = float("nan")
    bad = QuantizedKV(kv.k, scales if which == "k_scale" else kv.k_scale, kv.v,
                      scales if which == "v_scale" else kv.v_scale)
    q = _q(2, 2, 3, 16, torch.float32, 6)
    mask = Causal(q_start=torch.tensor(lens) - 3) & KeyPadding(torch.tensor(lens))
    out = attnkit.attention(q, bad, None, mask, backend="triton").cpu()
    assert out[1, :, 2].isnan().all()
    assert not out[1, :, :2].isnan().any() and not out[0].isnan().any()
    _check(out[:, :, :2], q[:, :, :2], kv, Causal(q_start=torch.tensor(lens) - 3) & KeyPadding(torch.tensor(lens)))


def test_fp8_bytes_decode_exactly():
    """Every e4m3fn byte decodes to torch's value (subnormals, zeros of both signs, +-448, the two
    NaN codes to NaN), through the kernel's own decoder."""

    @triton.jit
    def widen(X, Y, FP8: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(Y + i, triton_kernel._widen(tl.load(X + i), FP8))

    raw = torch.arange(256, dtype=torch.uint8, device=DEV)
    got = torch.empty(256, device=DEV)
    widen[(1,)](raw, got, FP8=True)
    want = raw.view(torch.float8_e4m3fn).float()
    ok = ~want.isnan()
    assert ok.sum() == 254
    assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())
    assert got[~ok].isnan().all()
    widen[(1,)](raw.view(torch.int8), got, FP8=False)
    assert torch.equal(got, raw.view(torch.int8).float())


def test_strided_scales_and_an_empty_cache():
    """Scales given as non-contiguous views are read through their strides; a dense cache with no
    tokens gives exact zeros."""
    kv = _dense(2, 2, 30, 16, 16, "int8", seed=9)
    wide = torch.randn(2, 2, 30, 3, device=DEV)
    wide[..., 1] = kv.k_scale
    ks = wide[..., 1]  # stride 3
    vs = kv.v_scale.transpose(1, 2).contiguous().transpose(1, 2)  # heads innermost
    q = _q(2, 4, 1, 16, torch.float32, 10)
    out = triton_ops.decode_attention(q, kv.k, kv.v, k_scale=ks, v_scale=vs)
    _check(out, q, kv, Causal())
    empty = triton_ops.decode_attention(q, kv.k[:, :, :0], kv.v[:, :, :0], k_scale=kv.k_scale[:, :, :0],
                                        v_scale=kv.v_scale[:, :, :0])
    assert empty.shape == (2, 4, 1, 16) and (empty == 0).all()


def test_bad_quantized_input_names_the_argument():
    kv = _pools(1, 2, 16, 16, 16, [20], "int8", seed=1)
    q = _q(1, 4, 1, 16, torch.float32, 2)
    base = dict(q=q, k_pool=kv.k, v_pool=kv.v, block_table=kv.block_table, lengths=kv.lengths,
                k_scale=kv.k_scale, v_scale=kv.v_scale)
    cases = [
        (dict(k_scale=None), ValueError, "pass k_scale"),
        (dict(k_scale=kv.k_scale[:, :, :1]), ValueError, "k_scale must have shape"),
        (dict(v_scale=kv.v_scale.double()), TypeError, "v_scale must be an fp32"),
        (dict(v_scale=None), ValueError, "v_scale must be given"),
        (dict(v_pool=kv.v.view(torch.uint8)), TypeError, "v_pool is torch.uint8"),
        (dict(k_pool=kv.k.float(), v_pool=kv.v.float()), TypeError, "k_pool must be quantized"),
    ]
    for change, err, text in cases:
        kw = dict(base)
        kw.update(change)
        with pytest.raises(err, match=text):
            triton_ops.paged_decode_attention(**kw)
    dense = _dense(1, 2, 20, 16, 16, "int8", seed=1)
    with pytest.raises(ValueError, match="k_scale must have shape"):
        triton_ops.decode_attention(q, dense.k, dense.v, k_scale=dense.k_scale[:, :1], v_scale=dense.v_scale)


def test_registered_op_takes_the_scales():
    kv = _dense(1, 2, 24, 16, 16, "int8", seed=3)
    q = _q(1, 4, 1, 16, torch.float32, 4)
    args = (q, kv.k.transpose(1, 2), kv.v.transpose(1, 2), torch.zeros(1, 1, dtype=torch.int32, device=DEV),
            torch.tensor([23], dtype=torch.int32, device=DEV), torch.tensor([24], dtype=torch.int32, device=DEV),
            0.25, 16, 24, 2, 0.0, None, None, None, kv.k_scale.transpose(1, 2), kv.v_scale.transpose(1, 2))
    torch.library.opcheck(torch.ops.attnkit.decode_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------- the backend's decisions


def _call(layout, *, device="cuda", dtype=torch.bfloat16, q_len=1, Dv=128, mask=None, softcap=None):
    return registry.AttentionCall(2, 16, 4, q_len, 512, 128, Dv, dtype, torch.device(device), mask, 128 ** -0.5,
                                  0.0, False, False, kv_layout=layout, softcap=softcap)


@pytest.mark.parametrize("layout", ["quantized", "quantized_paged"])
def test_backend_reads_quantized_kv_in_place_and_auto_takes_it_on_cuda(layout):
    """Pure decisions, checked on CPU for the CUDA case: the backend reads both quantized layouts
    in place, refuses nothing for them (fp8 is decoded with integer ops: no capability needed),
    and ``auto`` passes plain quantized CUDA decode calls to it (any other backend would first
    dequantize the whole cache); CPU calls stay with the CPU engine."""
    triton_b = registry.get_backend("triton")
    assert layout in triton_b.layouts
    call = _call(layout)
    assert registry.reads_in_place(triton_b, call) and registry.as_read_by(triton_b, call) is call
    assert triton_b.not_supported_reasons(call) == []
    assert triton_b.auto_skip_reason(call) is None
    assert triton_b.auto_skip_reason(_call("dense")) is not None  # float dense of equal widths: SDPA's
    if registry.availability(triton_b) is None:
        assert registry.select(call).name == "triton"
    assert triton_b.auto_skip_reason(_call(layout, device="cpu")) is not None
    assert any("Sq=17" in r for r in triton_b.not_supported_reasons(_call(layout, q_len=17)))


def test_auto_on_cpu_never_picks_triton_for_quantized_kv():
    kv = _pools(2, 2, 16, 16, 16, [20, 9], "int8", seed=4)
    q = torch.randn(2, 4, 1, 16)
    if DEV == "cpu":
        assert attnkit.describe_call(q, kv, None, causal=True) != "triton"


# --------------------------------------------------------------------------- compiled for sm_80 / sm_90

_SMEM = {80: 166912, 90: 232448}  # shared memory per block (bytes) on A100 and H100/H200

_AOT = AOT_PREAMBLE + r"""
from attnkit.backends.triton import kernel as td
fn = td._split_kernel
ptrs = {"Q", "K", "V", "TABLE", "QSTART", "LENGTHS", "OP", "LSEP", "SLOPES", "ALIBI_QSTART", "KS", "VS", "WIN_QSTART",
        "OUT", "SINKS"}
consts, ints, attrs = kernel_params(fn, ptrs, ("scale_log2", "softcap"), ["DK", "DV", "KV_BLOCK_SIZE", "SPLIT_LEN"])
out = []
for dt, storage, D, Dv, vfk, cap in json.loads(sys.argv[1]):
    cfg = td._config(getattr(torch, dt), D, Dv, 128, vfk)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dt]
    data = {"int8": "*i8", "fp8": "*u8"}[storage]  # fp8 rows go in as bytes
    sig = dict(Q="*" + short, K=data, V=data, TABLE="*i32", QSTART="*i32", LENGTHS="*i32", OP="*fp32",
               LSEP="*fp32", SLOPES="*fp32", ALIBI_QSTART="*i32", KS="*fp32", VS="*fp32", WIN_QSTART="*i32",
               OUT="*" + short, SINKS="*fp32", scale_log2="fp32", softcap="fp32", **{n: "i32" for n in ints})
    # The heaviest variant: soft-capping, ALiBi and a window on, partials for the merge.
    cv = dict(V_FROM_K=vfk, HAS_ROPE=cfg["DR"] > 0, PRECISION="ieee" if short == "fp32" else "tf32",
              DOT_F32=False, HAS_SOFTCAP=True, HAS_ALIBI=True, QUANT=True, FP8=storage == "fp8", HAS_WINDOW=True,
              DIRECT=False, HAS_SINKS=False, PAGED=True, PAGE=16,
              **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_DK", "BLOCK_DR", "BLOCK_DV")})
    assert set(cv) == set(consts), sorted(set(consts) ^ set(cv))
    sig.update({k: "constexpr" for k in cv})
    k = triton.compile(triton.compiler.ASTSource(fn, sig, cv, attrs), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    out.append([dt, storage, D, Dv, vfk, cap, k.metadata.shared])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_quantized_configs_compile_within_shared_memory_for_sm80_and_sm90():
    """Compile the quantized variants ahead of time (no GPU needed: Triton's CUDA backend and its
    bundled ptxas) for sm_80 and sm_90: int8 and fp8 (decoded from bytes, so sm_80 too), at the
    largest head dims, and check shared memory fits an A100 and an H100 / H200. In a child
    process: the interpreter mode of this one cannot compile."""
    cases = [[dt, st, D, Dv, vfk, cap] for dt in ("bfloat16", "float16", "float32") for st in ("int8", "fp8")
             for D, Dv, vfk in ((128, 128, False), (576, 512, True), (1024, 512, False)) for cap in _SMEM
             if dt != "float16" or D == 128]
    for dt, st, D, Dv, vfk, cap, shared in compile_ahead(_AOT, cases):
        assert shared <= _SMEM[cap], f"{dt} {st} D={D} Dv={Dv} v_from_k={vfk}: {shared} B shared on sm_{cap}"


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_cuda_long_context_matches_oracle(layout, storage):
    """Realistic sizes on the GPU (the compiled kernel, many splits): 2k keys, D 128, GQA 32/8,
    bf16, every modifier at once; and the MLA latent layout (576 / 512) quantized."""
    seed = stable_seed("qcuda", layout, storage)
    lens = [2048, 1500]
    kv, pad = _kv(layout, 2, 8, 128, 128, lens, storage, seed=seed)
    q = _q(2, 32, 1, 128, torch.bfloat16, seed + 1)
    mask, kw = _modifier("all", 32, 1, lens)
    mask = mask if pad is None else mask & pad
    assert attnkit.describe_call(q, kv, None, mask, **kw) == "triton"  # auto reads it in place
    _check(attnkit.attention(q, kv, None, mask, **kw), q, kv, mask, **kw)
    kv, pad = _kv(layout, 2, 1, 576, 512, [900, 1300], storage, seed=seed, v_from_k=True)
    q = _q(2, 16, 1, 576, torch.bfloat16, seed + 2)
    mask = Causal() if pad is None else Causal() & pad
    _check(attnkit.attention(q, kv, None, mask, scale=576 ** -0.5), q, kv, mask, scale=576 ** -0.5)
