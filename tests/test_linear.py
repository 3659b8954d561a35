"""Linear: the native weight-streaming kernel (``torch.ops.attnkit_cpu.linear_rows``) against the
fp64 oracle, when ``Linear`` gives a call to it and when to ``F.linear``, under torch.compile, at
several thread counts, its bad-input table, and the decoder's projections running it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import native
from attnkit.modules import linear as L
from attnkit.modules.linear import (MAX_ROWS, Linear, LinearInputError, half_gemm_unit, native_applies, native_max_rows,
                                    upcast_applies, upcast_linear, upcast_min_rows)

from conftest import rule_r

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (N, K): N = 1 and odd; K 1, below one vector, not a multiple of 8 or 16, whole vectors, long.
SHAPES = [(1, 1), (1, 37), (7, 8), (33, 100), (16, 64), (5, 127), (3, 2053)]


def _native_needed():
    if native.load() is None:
        pytest.skip("no native kernel on this machine (no C++ compiler)")


def _inputs(M, N, K, dtype, bias, seed, rand=False):
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if rand else torch.randn
    x = draw(M, K, generator=g).to(dtype)
    w = (draw(N, K, generator=g) / math.sqrt(K)).to(dtype)
    b = draw(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(got, x, w, b, what):
    """Rule R against F.linear in the same dtype, and the fp32 dot product's own bound: every
    output within K * eps32 * (|x| @ |w|.T + |b|) of the fp64 oracle, plus one rounding to the
    output dtype."""
    gold = x.double() @ w.double().T + (0 if b is None else b.double())
    base = F.linear(x, w, b)
    assert got.dtype == x.dtype and got.shape == gold.shape
    rule_r(got, base, gold, what=what, n_terms=x.shape[-1])
    K = x.shape[-1]
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = K * torch.finfo(torch.float32).eps * scale + torch.finfo(x.dtype).eps * gold.abs() + 1e-30
    err = (got.double() - gold).abs()
    assert (err <= bound).all(), f"{what}: max error / bound {(err / bound).max().item():.2f}"


# ------------------------------------------------------------------------------ the kernel


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("M", range(1, MAX_ROWS + 1), ids=[f"M{m}" for m in range(1, MAX_ROWS + 1)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_native_linear_matches_the_oracle(dtype, M, shape, bias):
    _native_needed()
    N, K = shape
    for rand in (False, True):
        x, w, b = _inputs(M, N, K, dtype, bias, seed=M * 1000 + N * 10 + K, rand=rand)
        with torch.inference_mode():
            got = native.load().linear_rows(x, w, b)
        _check(got, x, w, b, f"{dtype} M{M} N{N} K{K} bias={bias} rand={rand}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_native_linear_is_the_same_bits_at_every_thread_count(dtype):
    """Each output is summed by one thread in one order: 1, 2 and 16 threads give the same bits
    (a layer large enough to be split), and torch's thread count is left as it was."""
    _native_needed()
    before = torch.get_num_threads()
    outs = []
    try:
        for M in (1, 3, 8):
            x, w, b = _inputs(M, 1031, 333, dtype, True, seed=M)
            per_count = []
            for threads in (1, 2, 16):
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    per_count.append(native.load().linear_rows(x, w, b))
            outs.append(per_count)
            _check(per_count[0], x, w, b, f"{dtype} M{M}")
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    for per_count in outs:
        assert all(torch.equal(per_count[0], o) for o in per_count[1:])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_native_linear_reads_strided_x(dtype):
    _native_needed()
    x, w, b = _inputs(3, 9, 70, dtype, True, seed=3)
    ops = native.load()
    with torch.inference_mode():
        want = ops.linear_rows(x, w, b)
        x_t = x.t().contiguous().t()  # column-major rows
        x_s = torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]  # stride 2 along K
        assert not x_t.is_contiguous() and x_s.stride(-1) == 2
        assert torch.equal(ops.linear_rows(x_t, w, b), want)
        assert torch.equal(ops.linear_rows(x_s, w, b), want)
        b_s = torch.stack([b, b], dim=-1)[:, 0]  # a strided bias
        assert torch.equal(ops.linear_rows(x, w, b_s), want)


def test_native_linear_keeps_nan_in_its_row():
    _native_needed()
    for dtype in DTYPES.values():
        x, w, b = _inputs(3, 21, 40, dtype, True, seed=5)
        x[1, 17] = float("nan")
        with torch.inference_mode():
            y = native.load().linear_rows(x, w, b)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_native_linear_of_empty_sizes():
    _native_needed()
    ops = native.load()
    w, b = torch.randn(5, 8), torch.randn(5)
    assert ops.linear_rows(torch.randn(0, 8), w, b).shape == (0, 5)
    assert ops.linear_rows(torch.randn(2, 8), torch.randn(0, 8), None).shape == (2, 0)
    torch.testing.assert_close(ops.linear_rows(torch.randn(2, 0), torch.randn(5, 0), b), b.expand(2, 5))


_BAD = {
    "x 1-D": (lambda: (torch.randn(8), torch.randn(4, 8), None), ValueError,
              r"x must be 2-D \(M, K\), got shape \[8\]"),
    "weight 1-D": (lambda: (torch.randn(1, 8), torch.randn(8), None), ValueError, r"weight must be 2-D \(N, K\)"),
    "K differs": (lambda: (torch.randn(2, 8), torch.randn(4, 9), None), ValueError,
                  r"x \(2, 8\) and weight \[4, 9\] disagree on K"),
    "too many rows": (lambda: (torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8), None), ValueError,
                      rf"x has {MAX_ROWS + 1} rows \(shape \[{MAX_ROWS + 1}, 8\]\), at most {MAX_ROWS}"),
    "fp16": (lambda: (torch.randn(1, 8).half(), torch.randn(4, 8).half(), None), TypeError,
             r"x must be float32 or bfloat16, got Half"),
    "dtypes differ": (lambda: (torch.randn(1, 8), torch.randn(4, 8).bfloat16(), None), TypeError,
                      r"weight \(BFloat16\) must have x's dtype \(Float\)"),
    "weight strided": (lambda: (torch.randn(1, 8), torch.randn(8, 4).t(), None), ValueError,
                       r"weight \[4, 8\] must be contiguous, got strides \[1, 4\]"),
    "bias shape": (lambda: (torch.randn(1, 8), torch.randn(4, 8), torch.randn(5)), ValueError,
                   r"bias must be \(N,\) = \(4,\), got shape \[5\]"),
    "bias dtype": (lambda: (torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).double()), TypeError,
                   r"bias \(Double\) must have x's dtype \(Float\)"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_native_linear_bad_input_names_the_argument_and_shapes(case):
    _native_needed()
    make, error, message = _BAD[case]
    with pytest.raises(error, match=message):
        native.load().linear_rows(*make())


# ----------------------------------------------------------------- when Linear runs it


def test_native_max_rows_is_a_rule_of_dtype_and_cpu_flags():
    """fp32: always up to MAX_ROWS; bf16: up to 4 rows where the CPU has AMX-BF16 (torch's GEMM
    runs bf16 on AMX tiles and wins past a few rows), else MAX_ROWS; other dtypes: never."""
    zen3 = {"avx2", "fma", "f16c"}
    spr = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    zen4 = {"avx2", "avx512f", "avx512_bf16"}
    assert native_max_rows(torch.float32, zen3) == native_max_rows(torch.float32, spr) == MAX_ROWS
    assert native_max_rows(torch.bfloat16, zen3) == native_max_rows(torch.bfloat16, zen4) == MAX_ROWS
    assert native_max_rows(torch.bfloat16, spr) == 4
    assert native_max_rows(torch.float16, zen3) == native_max_rows(torch.float64, spr) == 0


def test_native_applies_only_to_what_the_kernel_takes():
    w = torch.randn(4, 8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert native_applies(x, w, None) and native_applies(x, w, torch.randn(4))
        assert native_applies(torch.randn(2, 4, 8), w, None)  # rows of the flattened leading dims
        assert not native_applies(torch.randn(3, 3, 8), w, None)  # 9 rows
        assert not native_applies(x.double(), w.double(), None)
        assert not native_applies(x.half(), w.half(), None)
        assert not native_applies(x.bfloat16(), w, None)  # dtypes differ: F.linear's error
        assert not native_applies(x, w, torch.randn(4).double())
        assert not native_applies(x, torch.randn(8, 4).t(), None)  # a strided weight
        assert not native_applies(x.to("meta"), w.to("meta"), None)  # not CPU
        assert not native_applies(torch.randn(2, 0), torch.randn(4, 0), None)  # K = 0
    assert not native_applies(x, w.requires_grad_(), None)  # autograd wants the weight's gradient
    with torch.no_grad():
        assert native_applies(x, w, None)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls ``Linear`` gives to the native kernel."""
    n = [0]
    real = L._linear_rows

    def counting(*args):
        n[0] += 1
        return real(*args)

    monkeypatch.setattr(L, "_linear_rows", counting)
    return n


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lead", [(), (1,), (2, 3), (1, 1, 8), (0,)], ids=str)
def test_linear_runs_the_kernel_for_few_rows(dtype, lead, calls):
    _native_needed()
    torch.manual_seed(0)
    m = Linear(70, 13, dtype=dtype)
    x = torch.randn(*lead, 70, dtype=dtype)
    rows = x.numel() // 70
    with torch.inference_mode():
        y = m(x)
    assert y.shape == (*lead, 13) and y.dtype == dtype
    assert calls[0] == (1 if rows <= L._MAX_ROWS_HERE[dtype] else 0)
    if rows:
        _check(y.reshape(-1, 13), x.reshape(-1, 70), m.weight.detach(), m.bias.detach(), f"{dtype} {lead}")


def test_linear_gives_more_rows_than_the_bound_to_torch(calls):
    _native_needed()
    m = Linear(32, 8)
    for dtype in DTYPES.values():
        m = m.to(dtype)
        bound = L._MAX_ROWS_HERE[dtype]
        x = torch.randn(bound + 1, 32, dtype=dtype)
        with torch.no_grad():  # torch's GEMM, or (16-bit, where this CPU's rule says) the upcast one
            want = upcast_linear if upcast_applies(x, m.weight, m.bias) else F.linear
            assert torch.equal(m(x), want(x, m.weight, m.bias))
            assert calls[0] == 0
            m(x[:bound])
            assert calls[0] == 1
        calls[0] = 0


def test_linear_under_autograd_is_torch_and_its_gradients(calls):
    _native_needed()
    torch.manual_seed(0)
    m = Linear(24, 6)
    ref = nn.Linear(24, 6)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 24, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = m(x), ref(x_ref)
    assert calls[0] == 0 and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(m.weight.grad, ref.weight.grad)
    assert torch.equal(m.bias.grad, ref.bias.grad)
    # Frozen weights but an input that wants its gradient: still torch's op.
    m.requires_grad_(False)
    m(torch.randn(1, 24, requires_grad=True)).sum().backward()
    assert calls[0] == 0


def test_linear_is_an_nn_linear_with_its_checkpoint_names():
    m = Linear(8, 4, bias=True)
    assert isinstance(m, nn.Linear)
    ref = nn.Linear(8, 4)
    assert list(m.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    m.load_state_dict(ref.state_dict())
    assert torch.equal(m.weight, ref.weight) and repr(m) == repr(ref)
    assert list(Linear(8, 4, bias=False).state_dict()) == ["weight"]


@pytest.mark.parametrize("x", [torch.randn(3, 7), torch.tensor(1.0), torch.randn(2, 5, 9)], ids=["K7", "0-d", "K9"])
def test_linear_names_the_width_it_expects(x):
    with pytest.raises(LinearInputError, match=r"x must be a \(\.\.\., 8\) tensor for Linear\(8, 4\), got shape"):
        with torch.inference_mode():
            Linear(8, 4)(x)
    assert issubclass(LinearInputError, ValueError) and issubclass(LinearInputError, RuntimeError)
    with pytest.raises(TypeError, match="x must be a Tensor for Linear"):
        Linear(8, 4)([1.0] * 8)


# ------------------------------------------------------------ many 16-bit rows: upcast GEMM


def test_upcast_min_rows_is_a_rule_of_dtype_and_cpu_flags():
    """16-bit prompts run as fp32 GEMM over upcast weights where the CPU has no 16-bit GEMM unit:
    bf16 from 9 rows (past the native kernel) on AVX2 and plain AVX-512, from 128 with
    AVX-512-BF16, never with AMX-BF16; fp16 from 9 rows unless AVX-512-FP16 or AMX-FP16; fp32 and
    fp64 never."""
    zen3 = {"avx2", "fma", "f16c"}
    icl = {"avx2", "avx512f", "avx512_vnni"}
    zen4 = {"avx2", "avx512f", "avx512_bf16"}
    spr = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
    gnr = spr | {"amx_fp16"}
    assert upcast_min_rows(torch.bfloat16, zen3) == upcast_min_rows(torch.bfloat16, icl) == MAX_ROWS + 1
    assert upcast_min_rows(torch.bfloat16, zen4) == 128
    assert upcast_min_rows(torch.bfloat16, spr) is None
    assert upcast_min_rows(torch.float16, zen3) == upcast_min_rows(torch.float16, zen4) == MAX_ROWS + 1
    assert upcast_min_rows(torch.float16, spr) is upcast_min_rows(torch.float16, gnr) is None
    assert upcast_min_rows(torch.float16, {"avx2", "amx_fp16"}) is None
    for flags in (zen3, zen4, spr):
        assert upcast_min_rows(torch.float32, flags) is upcast_min_rows(torch.float64, flags) is None
    assert not half_gemm_unit(torch.bfloat16, zen3) and not half_gemm_unit(torch.bfloat16, icl)
    assert half_gemm_unit(torch.bfloat16, zen4) and half_gemm_unit(torch.bfloat16, {"amx_bf16"})
    assert not half_gemm_unit(torch.float16, zen4) and half_gemm_unit(torch.float16, spr)
    assert not half_gemm_unit(torch.float32, spr)


UPCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M, N, K", [(1, 1, 1), (9, 7, 37), (130, 200, 64), (300, 65, 2053), (0, 5, 8), (4, 0, 8)],
                         ids=str)
@pytest.mark.parametrize("dtype", UPCAST_DTYPES.values(), ids=UPCAST_DTYPES.keys())
def test_upcast_linear_matches_the_oracle(dtype, M, N, K, bias):
    """Rule R and the fp32 dot product's bound against the fp64 oracle, the weights one slab
    (here as small as 64 rows) at a time or whole."""
    for slab in (1, L.UPCAST_SLAB_BYTES):
        for rand in (False, True):
            x, w, b = _inputs(M, N, K, dtype, bias, seed=M * 1000 + N * 10 + K, rand=rand)
            with torch.inference_mode():
                got = upcast_linear(x, w, b, slab_bytes=slab)
            if M and N:
                _check(got, x, w, b, f"{dtype} M{M} N{N} K{K} bias={bias} slab={slab} rand={rand}")
            assert got.shape == (M, N) and got.dtype == dtype


def test_upcast_linear_keeps_leading_dims_and_nan_in_its_row():
    x = torch.randn(2, 70, 16, dtype=torch.bfloat16)
    w = torch.randn(100, 16, dtype=torch.bfloat16)
    x[1, 3, 5] = float("nan")
    w[70, 2] = float("inf")
    got = upcast_linear(x, w, None, slab_bytes=1)  # slabs of 64 rows: 0..63, 64..99
    assert got.shape == (2, 70, 100)
    nan = torch.isnan(got)
    assert nan[1, 3].all() and not nan[1, 4].any() and not nan[0, :, :70].any()
    assert not torch.isfinite(got[..., 70]).any() and torch.isfinite(got[0, :, 71:]).all()


def test_upcast_linear_bad_input_names_the_shapes():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(2, 12\), weight \(4, 8\)"):
        upcast_linear(torch.randn(2, 12, dtype=torch.bfloat16), w, None)  # 24 elements: 3 rows of 8 if reshaped
    with pytest.raises(ValueError, match="bias must be"):
        upcast_linear(x, w, torch.randn(5, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="share a dtype"):
        upcast_linear(x, w.half(), None)


def test_upcast_applies_only_on_cpu(monkeypatch):
    """The CUDA branch's decision, on CPU: tensors on another device (meta standing in) keep
    F.linear whatever the rule says."""
    monkeypatch.setitem(L._UPCAST_ROWS_HERE, torch.bfloat16, 1)
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert upcast_applies(x, w, None)
        assert not upcast_applies(x.to("meta"), w.to("meta"), None)
        assert not upcast_applies(x, w.float(), None)


@pytest.fixture
def upcasts(monkeypatch):
    """Counts the calls ``Linear`` gives to the upcast GEMM."""
    n = [0]
    real = L.upcast_linear

    def counting(*args, **kwargs):
        n[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(L, "upcast_linear", counting)
    return n


@pytest.mark.parametrize("dtype", UPCAST_DTYPES.values(), ids=UPCAST_DTYPES.keys())
def test_linear_upcasts_from_the_rows_the_rule_names(dtype, monkeypatch, upcasts):
    """Where this CPU's rule says (forced here: 12 rows), 16-bit calls of that many rows run the
    upcast GEMM; fewer rows, another dtype or autograd keep their path."""
    monkeypatch.setitem(L._UPCAST_ROWS_HERE, dtype, 12)
    torch.manual_seed(0)
    m = Linear(40, 24, dtype=dtype)
    x = torch.randn(3, 4, 40, dtype=dtype)  # 12 rows
    with torch.no_grad():
        y = m(x)
        assert upcasts[0] == 1
        _check(y.reshape(-1, 24), x.reshape(-1, 40), m.weight, m.bias, f"{dtype} Linear upcast")
        m(x[:, :2])  # 6 rows
    assert upcasts[0] == 1
    y = m(x)  # the weights want gradients: F.linear, which autograd differentiates
    assert upcasts[0] == 1 and y.requires_grad
    monkeypatch.setitem(L._UPCAST_ROWS_HERE, dtype, None)
    with torch.no_grad():
        assert torch.equal(m(x), F.linear(x, m.weight, m.bias)) and upcasts[0] == 1


def test_linear_doctest_runs():
    import doctest

    assert doctest.testmod(L).failed == 0


def test_linear_nan_row_stays_nan():
    _native_needed()
    m = Linear(16, 5)
    x = torch.randn(2, 16)
    x[0, 3] = float("nan")
    with torch.no_grad():
        y = m(x)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


# ---------------------------------------------------------------------- torch.compile


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = Linear(40, 24), Linear(24, 40, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _traced_targets(fn, *args, dynamic=False):
    """(result, call targets of the FX graphs) of ``fn`` compiled with ``fullgraph=True``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)(*args)
    return out, [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_compiled_linear_calls_the_native_op(dtype):
    _native_needed()
    torch.manual_seed(0)
    m = _Block().to(dtype)
    x = torch.randn(2, 40, dtype=dtype)
    with torch.no_grad():
        want = m(x)
        got, targets = _traced_targets(m, x)
    assert targets.count("attnkit_cpu.linear_rows") == 2, targets
    assert torch.equal(got, want)  # the same kernel, the same bits
    with torch.no_grad():  # more rows than the kernel takes: torch's op, in the same fullgraph trace
        x9 = torch.randn(MAX_ROWS + 1, 40, dtype=dtype)
        got, targets = _traced_targets(m, x9)
    assert "attnkit_cpu.linear_rows" not in targets
    torch.testing.assert_close(got, m(x9).detach(), rtol=0, atol=0)


def test_compiled_linear_with_dynamic_rows():
    _native_needed()
    m = _Block()
    with torch.no_grad():
        for rows in (2, 5):
            x = torch.randn(rows, 40)
            got, targets = _traced_targets(m, x, dynamic=True)
            assert "attnkit_cpu.linear_rows" in targets
            assert torch.equal(got, m(x))


def test_compiled_before_the_library_loads_defers_the_load_to_run_time():
    """A graph traced before anything loaded the library calls ``attnkit::linear_rows``, which
    loads it when the compiled code runs (never while tracing); nothing is built inside the trace."""
    _native_needed()
    code = textwrap.dedent("""
        import torch
        from attnkit import native
        from attnkit.modules.linear import Linear
        graphs = []
        def backend(gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm.forward
        m = Linear(16, 3)
        x = torch.randn(1, 16)
        with torch.no_grad():
            f = torch.compile(m, fullgraph=True, backend=backend)
            y = f(x)
            assert native.library_path() is not None
            torch.testing.assert_close(y, torch.nn.functional.linear(x, m.weight, m.bias))
            f(x)
        print(graphs)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert res.returncode == 0, res.stderr[-3000:]
    graphs = eval(res.stdout.strip().splitlines()[-1])
    assert graphs[0] == ["attnkit.linear_rows"]  # traced before the load: the deferred op
    assert graphs[-1] == ["attnkit_cpu.linear_rows"]  # retraced once after it: the kernel's op


def test_deferred_op_runs_torch_where_the_library_cannot_be_built(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    x, w, b = torch.randn(2, 8), torch.randn(3, 8), torch.randn(3)
    assert torch.equal(torch.ops.attnkit.linear_rows(x, w, b), F.linear(x, w, b))


# ---------------------------------------------------------------------- the decoder


def test_decoder_projections_run_the_native_kernel_at_decode(calls):
    _native_needed()
    from attnkit.models import Decoder, DecoderConfig, generate

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, attention="gqa",
                        intermediate_size=64)
    model = Decoder(cfg, init_std=0.2).eval()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)
    out = generate(model, [[5, 9, 3, 7, 1, 2, 8, 4, 4]], max_new_tokens=4)
    assert calls[0] >= 3 * len(linears)  # every projection of each decode step (prefill: 9 rows, torch)
    with pytest.MonkeyPatch.context() as p:
        p.setattr(L, "native_applies", lambda *a: False)
        assert generate(model, [[5, 9, 3, 7, 1, 2, 8, 4, 4]], max_new_tokens=4).tokens == out.tokens


@pytest.mark.slow
def test_avx2_build_matches_the_oracle():
    """The AVX2 code path (8-lane vectors, widened bf16: what AMD Zen 3 runs), built on an AVX-512
    CPU with ATTNKIT_NATIVE_MARCH=haswell, in its own process (on an AVX2-only CPU the native
    build already takes that path, and the suite runs it there)."""
    _native_needed()
    from attnkit._sysinfo import cpu_flags

    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 build")
    if "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 here: the native build is the AVX2 code path, which the suite ran")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        from attnkit import native
        import test_linear as T
        assert native.load() is not None, native.status()
        for dtype in T.DTYPES.values():
            for M in range(1, T.MAX_ROWS + 1):
                for N, K in T.SHAPES:
                    for bias in (False, True):
                        x, w, b = T._inputs(M, N, K, dtype, bias, seed=M + N + K)
                        T._check(native.load().linear_rows(x, w, b), x, w, b, f"{{dtype}} M{{M}} N{{N}} K{{K}}")
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, ATTNKIT_NATIVE_MARCH="haswell", PYTHONPATH=os.pathsep.join(sys.path)))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
