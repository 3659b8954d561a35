"""Backends on CUDA: which SDPA kernel runs (and how attnkit reports it), SDPA's bottom-right
causal bias, FlexAttention forward and backward on the GPU.

The CPU part checks the reporting (``sdpa_kernel_name``, the debug log, ``describe_call(detail=
True)``, ``attnkit info``) and the decisions that pick CUDA paths, with call descriptions that
say "cuda" but allocate nothing there. The GPU part (``-m gpu``, skipped without CUDA) runs the
auto path, flex and the kernels themselves against the fp64 oracle under rule R.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

import attnkit
from attnkit import masks as M
from attnkit.backends import flex, get_backend, sdpa
from attnkit.backends.registry import AttentionCall
from attnkit.cli import main
from attnkit.functional import _validate

from conftest import check_against_oracle, make_qkv, stable_seed

KERNELS = {"flash", "efficient", "cudnn", "math", "overrideable"}
HAS_CUDA = torch.cuda.is_available()


def _call(mask=None, *, B=2, Hq=4, Hkv=4, Sq=8, Sk=12, D=64, Dv=None, dtype=torch.float16, device="cuda",
          needs_grad=False) -> AttentionCall:
    return AttentionCall(B, Hq, Hkv, Sq, Sk, D, D if Dv is None else Dv, dtype, torch.device(device), mask,
                         D ** -0.5, 0.0, False, needs_grad)


# ---------------------------------------------------------------------------- sdpa_kernel_name


def test_sdpa_kernel_name_on_cpu():
    q, k, v = make_qkv(2, 4, 2, 16, 16, 32, seed=1)
    assert sdpa.sdpa_kernel_name(q, k, v, None, 0.0, True, None, True) == "flash"  # torch's CPU flash kernel
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa.sdpa_kernel_name(q, k, v, None, 0.0, True, None, True) == "math"
    bool_mask = torch.rand(16, 16) > 0.5
    assert sdpa.sdpa_kernel_name(q, k, v, bool_mask, 0.1, False, 0.3, True) in KERNELS
    chunk = q[:, :, :5]
    assert sdpa.sdpa_kernel_name(chunk, k, v, causal_lower_right(5, 16), enable_gqa=True) in {"flash", "math"}


def test_sdpa_kernel_name_is_unknown_without_torch_support(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8, seed=2)
    monkeypatch.setattr(sdpa, "_FUSED_SDP_CHOICE", None)
    assert sdpa.sdpa_kernel_name(q, k, v) == "unknown"

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(sdpa, "_FUSED_SDP_CHOICE", broken)
    assert sdpa.sdpa_kernel_name(q, k, v) == "unknown"
    monkeypatch.setattr(sdpa, "_FUSED_SDP_CHOICE", lambda *a, **kw: -1)  # SDPBackend.ERROR
    assert sdpa.sdpa_kernel_name(q, k, v) == "unknown"


# ---------------------------------------------------------------------------- describe_call(detail=True)


def test_describe_call_detail_names_the_sdpa_kernel():
    q, k, v = make_qkv(2, 4, 2, 16, 16, 32, seed=3)
    assert attnkit.describe_call(q, k, v, causal=True) == "sdpa"
    assert attnkit.describe_call(q, k, v, causal=True, detail=True) == "sdpa[flash]"
    # fp16 with gradients on CPU: attnkit pins SDPA's math kernel (see sdpa._kernel_choice)
    qh, kh, vh = (t.half().requires_grad_() for t in (q, k, v))
    assert attnkit.describe_call(qh, kh, vh, causal=True, detail=True) == "sdpa[math]"
    with torch.no_grad():
        assert attnkit.describe_call(qh, kh, vh, causal=True, detail=True) == "sdpa[flash]"
    assert attnkit.describe_call(q, k, v, backend="math", detail=True) == "math"
    assert attnkit.describe_call(q[:, :, :0], k, v, detail=True) == "math"
    assert attnkit.describe_call(q, k, v, return_weights=True, detail=True) == "math"


# ---------------------------------------------------------------------------- debug log


@pytest.fixture
def debug_on():
    logger = logging.getLogger("attnkit")
    level = logger.level
    attnkit.set_debug(True)
    yield
    attnkit.set_debug(False)
    logger.setLevel(level)


def _records(caplog):
    return [r for r in caplog.records if r.name == "attnkit"]


def test_debug_logs_one_line_per_call(debug_on, caplog):
    caplog.set_level(logging.DEBUG, logger="attnkit")
    q, k, v = make_qkv(2, 4, 2, 8, 12, 16, seed=4)
    attnkit.attention(q, k, v, causal=True)
    attnkit.attention(q, k, v, M.KeyPadding(torch.tensor([3, 12])), backend="math")
    attnkit.attention(q[:, :, :0], k, v)
    lines = [r.getMessage() for r in _records(caplog)]
    assert len(lines) == 3 and all(r.levelno == logging.DEBUG for r in _records(caplog))
    assert lines[0] == ("attnkit.attention: backend=sdpa[flash] q=(2, 4, 8, 16) k=(2, 2, 12, 16) v=(2, 2, 12, 16) "
                        "dtype=float32 device=cpu mask=Causal(align='bottom_right') dropout_p=0.0")
    assert "backend=math " in lines[1] and "mask=KeyPadding(side='right')" in lines[1]
    assert "backend=math[empty]" in lines[2] and "q=(2, 4, 0, 16)" in lines[2]


def test_debug_off_is_silent_and_never_asks_for_the_kernel(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="attnkit")

    def fail(*args):
        raise AssertionError("kernel_name called with debug off")

    monkeypatch.setattr(sdpa.SdpaBackend, "kernel_name", fail)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, seed=5)
    attnkit.set_debug(False)
    out = attnkit.attention(q, k, v, causal=True)
    assert _records(caplog) == [] and torch.isfinite(out).all()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        attnkit.set_debug("yes")


def test_attnkit_debug_env_var_logs_to_stderr():
    code = ("import torch, attnkit; q = torch.zeros(1, 2, 3, 8); "
            "attnkit.attention(q, q, q, causal=True)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ATTNKIT_DEBUG": "1"})
    assert res.returncode == 0, res.stderr
    assert "attnkit DEBUG: attnkit.attention: backend=sdpa[" in res.stderr and "q=(1, 2, 3, 8)" in res.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "ATTNKIT_DEBUG": "0"})
    assert quiet.returncode == 0 and "attnkit.attention" not in quiet.stderr


# ---------------------------------------------------------------------------- attnkit info


def test_info_prints_the_sdpa_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "sdpa kernels (torch's choice for attnkit's calls" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  cpu ")]
    assert [r[2] for r in rows] == ["causal", "causal", "padded"]
    for r in rows:
        assert r[1] == "float32" and r[-1].startswith("sdpa[") and r[-1][5:-1] in KERNELS
    assert ("  cuda sdp enabled: flash=" in out) == HAS_CUDA
    if get_backend("flash").available() is not None:
        assert "  flash   unavailable: " in out and "(forced only)" in out


# ---------------------------------------------------------------------------- sdpa's CUDA decisions


@pytest.mark.parametrize("mask,Sq,Sk,device,Hkv,expect", [
    (M.Causal(), 8, 12, "cuda", 4, True),
    (M.Causal() & M.Causal(), 8, 12, "cuda", 4, True),
    (M.Causal(), 12, 8, "cuda", 4, False),  # Sq > Sk: rows without keys keep the zero fix-up
    (M.Causal(), 8, 12, "cpu", 4, False),  # CPU unchanged
    (M.Causal() & M.KeyPadding(torch.tensor([5, 12])), 8, 12, "cuda", 4, False),
    (M.Causal(q_start=torch.tensor([4, 4])), 8, 12, "cuda", 4, False),
    (M.SlidingWindow(3), 8, 12, "cuda", 4, False),
    (M.Causal(), 8, 12, "cuda", 2, False),  # grouped: only when SDPA's flash takes it (CPU tensors: no)
], ids=["causal", "causal&causal", "sq>sk", "cpu", "padding", "offsets", "window", "gqa-no-flash"])
def test_lower_right_bias_only_where_it_is_the_whole_mask(mask, Sq, Sk, device, Hkv, expect):
    call = _call(mask, Sq=Sq, Sk=Sk, Hkv=Hkv, device=device)
    q, k, v = make_qkv(2, 4, Hkv, Sq, Sk, 64, dtype=torch.float16, seed=6)
    assert sdpa._lower_right_bias(q, k, v, call) is expect


def test_cpu_keeps_the_materialized_mask():
    q, k, v = make_qkv(2, 4, 4, 5, 11, 16, seed=7)
    call = _validate(q, k, v, None, True, None, 0.0, False)
    attn_mask, row_ok, is_causal = get_backend("sdpa").sdpa_args(q, k, v, call)
    assert isinstance(attn_mask, torch.Tensor) and not isinstance(attn_mask, CausalBias)
    assert attn_mask.dtype == torch.bool and row_ok is None and not is_causal


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("Sq,Sk", [(5, 11), (1, 9), (16, 17)])
def test_causal_lower_right_bias_matches_oracle(monkeypatch, heads, Sq, Sk):
    """The CausalBias path (CUDA-only in attnkit) run on CPU, where torch resolves it to a
    materialized mask: forward and gradients agree with the fp64 oracle."""
    monkeypatch.setattr(sdpa, "_lower_right_bias",
                        lambda q, k, v, call: call.q_len < call.kv_len and call.reduced.is_bottom_right_causal)
    q, k, v = make_qkv(2, *heads, Sq, Sk, 16, seed=stable_seed("lower-right", heads, Sq, Sk))
    call = _validate(q, k, v, None, True, None, 0.0, False)
    if call.mask is not None:
        assert isinstance(get_backend("sdpa").sdpa_args(q, k, v, call)[0], CausalBias)
    check_against_oracle(q, k, v, causal=True, backend="sdpa")


# ---------------------------------------------------------------------------- flex on CUDA (decisions, cache)


def test_flex_accepts_cuda_backward_and_refuses_small_head_dims():
    fb = get_backend("flex")
    assert fb.not_supported_reasons(_call(M.SlidingWindow(4), needs_grad=True)) == []
    assert any("backward on CPU" in r for r in fb.not_supported_reasons(_call(device="cpu", needs_grad=True)))
    why = fb.not_supported_reasons(_call(D=8))
    assert len(why) == 1 and "D=8, Dv=8 on cuda" in why[0]
    assert fb.not_supported_reasons(_call(D=8, device="cpu", dtype=torch.float32)) == []


@pytest.mark.skipif(get_backend("flex").available() is not None, reason="torch without FlexAttention")
def test_block_masks_are_cached_per_mask_shape_and_device():
    flex._BLOCK_MASKS.clear()
    q, k, v = make_qkv(2, 2, 2, 40, 40, 16, seed=8)
    call = _validate(q, k, v, M.SlidingWindow(5), True, None, 0.0, False)
    bm = flex.block_mask_for(call, q.device)
    again = _validate(q, k, v, M.SlidingWindow(5), True, None, 0.0, False)  # a new, equal mask object
    assert flex.block_mask_for(again, q.device) is bm
    other_shape = _validate(q[:, :, :33], k, v, M.SlidingWindow(5), True, None, 0.0, False)
    assert flex.block_mask_for(other_shape, q.device) is not bm
    keys = list(flex._BLOCK_MASKS)
    assert len(keys) == 2 and all(key[-1] == "cpu" for key in keys)
    assert {(key[1], *key[-3:-1]) for key in keys} == {(2, 40, 40), (2, 33, 40)}  # batch, Sq, Sk


# ---------------------------------------------------------------------------- GPU


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


SDPA_GPU_CASES = {
    "causal_sq<sk": (lambda B, g: None, True, 77, 300),
    "causal_square": (lambda B, g: None, True, 128, 128),
    "key_padding": (lambda B, g: M.KeyPadding(torch.randint(1, 257, (B,), generator=g)), False, 96, 256),
    "key_padding_empty_seq_causal": (lambda B, g: M.KeyPadding(torch.tensor([0, 200, 256])), True, 96, 256),
    "query_and_key_padding": (lambda B, g: M.KeyPadding(torch.tensor([256, 30, 1]))
                              & M.QueryPadding(torch.tensor([96, 0, 50])), False, 96, 256),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", list(SDPA_GPU_CASES))
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 80])
def test_sdpa_auto_on_cuda_uses_fused_kernels_and_matches_oracle(case, heads, dtype, D):
    make_mask, causal, Sq, Sk = SDPA_GPU_CASES[case]
    g = torch.Generator().manual_seed(stable_seed("sdpa-gpu", case, heads, D))
    mask = make_mask(3, g)
    q, k, v = _cuda(*make_qkv(3, *heads, Sq, Sk, D, dtype=dtype, seed=stable_seed(case, heads, D)))
    detail = attnkit.describe_call(q, k, v, mask, causal=causal, detail=True)
    assert detail in ("sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]"), detail
    if case == "causal_sq<sk":
        call = _validate(q, k, v, mask, causal, None, 0.0, False)
        uses_bias = isinstance(get_backend("sdpa").sdpa_args(q, k, v, call)[0], CausalBias)
        assert uses_bias == (heads[0] == heads[1] or detail == "sdpa[flash]")
    out = check_against_oracle(q, k, v, mask, causal=causal)
    gold = attnkit.attention_reference(*(t.double() for t in (q, k, v)), mask, causal=causal)
    assert (out[(gold == 0).all(-1)] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sdpa_causal_sq_gt_sk_on_cuda_keeps_zero_rows(dtype):
    q, k, v = _cuda(*make_qkv(2, 8, 2, 100, 40, 64, dtype=dtype, seed=9))
    out = check_against_oracle(q, k, v, causal=True)
    assert (out[:, :, :60] == 0).all() and (out[:, :, 60:] != 0).any()


FLEX_GPU_CASES = {
    "window_gqa": (lambda: M.SlidingWindow(17), False, (8, 2), 200, 200),
    "window_padding_chunk": (lambda: M.SlidingWindow(9, 3) & M.KeyPadding(torch.tensor([300, 40])), False, (4, 4),
                             64, 300),
    "document_causal_mqa": (lambda: M.Document(torch.tensor([50, 100, 30])), True, (8, 1), 200, 200),
    "document_cross": (lambda: M.Document(torch.tensor([[20, 60], [80, 0]]), torch.tensor([[100, 28], [10, 118]])),
                       False, (4, 2), 80, 128),
}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(get_backend("flex").available() is not None, reason="torch without FlexAttention")
@pytest.mark.parametrize("case", list(FLEX_GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_forward_and_backward_on_cuda(case, dtype):
    make_mask, causal, heads, Sq, Sk = FLEX_GPU_CASES[case]
    mask = make_mask()
    q, k, v = _cuda(*make_qkv(2, *heads, Sq, Sk, 32, dtype=dtype, seed=stable_seed("flex-gpu", case)))
    out = check_against_oracle(q, k, v, mask, causal=causal, backend="flex", grad=True)
    gold = attnkit.attention_reference(*(t.double() for t in (q, k, v)), mask, causal=causal)
    assert (out[(gold == 0).all(-1)] == 0).all()
    n = len(flex._BLOCK_MASKS)
    attnkit.attention(q, k, v, mask, causal=causal, backend="flex")
    assert len(flex._BLOCK_MASKS) == n  # same mask, shape and device: cached
    assert any(key[-1] == str(q.device) for key in flex._BLOCK_MASKS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_info_on_cuda_lists_cuda_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  cuda ") and "enabled" not in line]
    assert len(rows) == 3 and all(r[-1] in ("sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]") for r in rows), out


def test_set_debug_false_restores_the_logger():
    """set_debug(False) undoes set_debug(True): the attnkit logger gets back its level and loses
    the stderr handler attnkit attached (it does not stay at DEBUG)."""
    logger = logging.getLogger("attnkit")
    before_level, before_handlers = logger.level, list(logger.handlers)
    attnkit.set_debug(True)
    assert logger.level == logging.DEBUG
    attnkit.set_debug(False)
    assert logger.level == before_level and logger.handlers == before_handlers
    attnkit.set_debug(False)  # twice: still nothing changed
    assert logger.level == before_level
