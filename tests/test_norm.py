"""RMSNorm: the compiled one-pass path of inference calls against the torch ops and the fp64
oracle (rule R), every family's weight order, and when the torch ops still run."""

from __future__ import annotations

import pytest
import torch

from attnkit import native
from attnkit.modules import norm as N
from attnkit.modules.norm import RMSNorm

from conftest import rule_r

FAMILIES = {"llama": {}, "olmo2": {"scale_in_fp32": True}, "gemma": {"unit_offset": True}}


def _oracle(x: torch.Tensor, w: torch.Tensor, eps: float, family: str) -> torch.Tensor:
    x64, w64 = x.double(), w.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1 + w64) if family == "gemma" else y * w64


def _native_needed():
    if native.load() is None:
        pytest.skip("no native kernel on this machine (no C++ compiler)")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (3, 7, 33), (5, 1), (2, 4, 6, 80), (0, 64)])
def test_native_rms_norm_matches_the_torch_ops_and_the_oracle(family, dtype, shape, monkeypatch):
    _native_needed()
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    m = RMSNorm(shape[-1], eps=1e-5, **FAMILIES[family]).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(shape[-1], generator=g) * 0.5 + (0.0 if family == "gemma" else 1.0))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        assert N._native_ok(x, m.weight)
        got = m(x)
        with monkeypatch.context() as p:
            p.setattr(N, "_native_ok", lambda *a: False)
            want = m(x)
    assert got.dtype == want.dtype == dtype and got.shape == x.shape
    gold = _oracle(x, m.weight.detach(), m.eps, family)
    rule_r(got, want, gold, what=f"{family} {dtype} {shape}", n_terms=shape[-1])
    if dtype != torch.float32:  # one rounding to x's dtype after fp32 math: torch's floats but for rare ties
        assert (got != want).sum().item() <= 0.01 * got.numel()


def test_native_rms_norm_keeps_nan_in_its_row():
    _native_needed()
    m = RMSNorm(16)
    x = torch.randn(3, 16)
    x[1, 5] = float("nan")
    with torch.inference_mode():
        y = m(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_torch_ops_run_where_the_native_norm_does_not_apply():
    _native_needed()
    m = RMSNorm(8)
    x = torch.randn(4, 8)
    assert N._native_ok(x, m.weight) is False  # autograd on: the weight wants a gradient
    with torch.no_grad():
        assert N._native_ok(x, m.weight)
        assert not N._native_ok(x.t().contiguous().t(), m.weight)  # not contiguous
        assert not N._native_ok(x.double(), m.weight.double())
        assert not N._native_ok(x.bfloat16(), m.weight)  # weight of another dtype: torch's promotion
    y = m(x)
    y.sum().backward()  # the torch path, differentiable
    assert m.weight.grad is not None and torch.isfinite(m.weight.grad).all()


@pytest.mark.parametrize("x", [torch.randn(3, 7), torch.tensor(1.0), [1.0] * 8])
def test_rms_norm_names_the_width_it_expects(x):
    with pytest.raises(ValueError, match=r"x must be a \(\.\.\., 8\) tensor for RMSNorm\(8\)"):
        with torch.inference_mode():
            RMSNorm(8)(x)


def test_native_rms_norm_skips_a_strided_weight():
    _native_needed()
    m = RMSNorm(8)
    with torch.no_grad():
        m.weight = torch.nn.Parameter(torch.randn(16)[::2])
        x = torch.randn(2, 8)
        assert not N._native_ok(x, m.weight)
        torch.testing.assert_close(m(x), torch.nn.functional.rms_norm(x, (8,), eps=m.eps) * m.weight)
