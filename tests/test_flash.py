"""The ``flash`` backend (optional flash-attn package).

On CPU: refusals and reasons, the mask translation (:func:`flash_window` against flash-attn's
documented window rule written out independently here), :func:`unpad` / :func:`pad`, and the
whole ``run`` path through a stand-in module that implements flash-attn's documented semantics
(bottom-right causal/window per packed sequence, GQA, zero rows) in fp64, against the oracle.
On a GPU with flash-attn installed: the real package against the oracle under rule R.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported, auto_order, explain, flash, get_backend
from attnkit.backends.registry import AttentionCall
from attnkit.functional import _validate

from conftest import check_against_oracle, make_qkv, stable_seed

HAS_CUDA = torch.cuda.is_available()


def _call(mask=None, *, B=2, Hq=4, Hkv=2, Sq=8, Sk=12, D=64, Dv=None, dtype=torch.float16, device="cuda",
          return_weights=False) -> AttentionCall:
    """A call description for the refusal logic; nothing is allocated on ``device``."""
    return AttentionCall(B, Hq, Hkv, Sq, Sk, D, D if Dv is None else Dv, dtype, torch.device(device), mask,
                         D ** -0.5, 0.0, return_weights, False)


# ---------------------------------------------------------------------------- availability


@pytest.mark.skipif(flash._installed(), reason="flash_attn is installed here")
def test_available_says_flash_attn_is_missing():
    why = get_backend("flash").available()
    assert why is not None and "flash_attn is not installed" in why and "attnkit[flash]" in why
    assert explain(_call())["flash"] == [why]


def test_available_names_the_missing_cuda(monkeypatch):
    monkeypatch.setattr(flash, "_INSTALLED", True)  # found at import (a package that then fails)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = flash.FlashBackend().available()
    assert why is not None and "no CUDA device" in why


@pytest.mark.parametrize("module,expect", [(None, "flash_attn failed to import (ModuleNotFoundError"),
                                           ("old", "flash_attn 2.0.4 is older than 2.4.1")])
def test_available_names_import_failures_and_old_versions(monkeypatch, module, expect):
    fake = None if module is None else type(sys)("flash_attn")
    if fake is not None:
        fake.__version__ = "2.0.4"
    monkeypatch.setattr(flash, "_INSTALLED", True)  # found at import (a package that then fails)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash, "_IMPORTED", None)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)  # None makes `import flash_attn` raise
    why = flash.FlashBackend().available()
    assert why is not None and expect in why


def test_forcing_flash_without_it_raises_naming_flash():
    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, seed=1)
    if get_backend("flash").available() is None:
        pytest.skip("flash is usable here")
    with pytest.raises(BackendNotSupported, match=r"backend 'flash' cannot run") as e:
        attnkit.attention(q, k, v, causal=True, backend="flash")
    assert "\n  flash: " in str(e.value)
    assert attnkit.describe_call(q, k, v, causal=True) != "flash"


def test_flash_is_not_in_auto_order():
    assert "flash" not in auto_order() and "flash" in attnkit.backend_names()


def test_attnkit_import_does_not_import_flash_attn(tmp_path):
    """A flash_attn on the path that records being imported: importing attnkit, listing the
    backends and asking flash for its availability on a CPU-only call never import it."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('flash_attn imported')\n")
    code = textwrap.dedent("""
        import sys, torch, attnkit
        from attnkit.backends import get_backend
        attnkit.explain  # noqa
        q = torch.randn(1, 2, 4, 8)
        print(attnkit.describe_call(q, q, q), 'flash_attn' in sys.modules,
              torch.cuda.is_available() or get_backend('flash').available())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    backend, imported, why = res.stdout.split(" ", 2)
    assert imported == "False"
    if not HAS_CUDA:
        assert "no CUDA device" in why


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kwargs,expect", [
    (dict(device="cpu"), "device cpu"),
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(dtype=torch.float64), "dtype torch.float64"),
    (dict(D=264), "head_dim D=264"),
    (dict(D=60), "head_dim D=60"),
    (dict(D=64, Dv=32), "D=64 != Dv=32"),
    (dict(return_weights=True), "return_weights"),
], ids=["cpu", "fp32", "fp64", "D264", "D60", "D!=Dv", "weights"])
def test_not_supported_reasons(kwargs, expect):
    why = flash.FlashBackend().not_supported_reasons(_call(**{"device": "cuda", **kwargs, "mask": None}))
    assert len(why) == 1 and expect in why[0], why


def test_supported_call_has_no_reasons():
    assert flash.FlashBackend().not_supported_reasons(_call(device="cpu")) == ["device cpu (flash_attn runs on CUDA only)"]
    for D in (8, 64, 128, 256):
        assert flash.FlashBackend().not_supported_reasons(_call(D=D)) == []


@pytest.mark.parametrize("name,mask,Sq,Sk", [
    ("document", M.Document(torch.tensor([4, 4])), 8, 8),
    ("prefix_lm", M.PrefixLM(torch.tensor([2, 3])), 8, 8),
    ("offsets", M.Causal(q_start=torch.tensor([1, 2])), 8, 12),
    ("window_offsets", M.SlidingWindow(2, q_start=torch.tensor([0, 4])), 8, 12),
    ("top_left_non_square", M.Causal("top_left"), 8, 12),
    ("dense", M.Dense(torch.ones(8, 12, dtype=torch.bool)), 8, 12),
    ("additive", M.Additive(torch.zeros(8, 12)), 8, 12),
    ("or", M.SlidingWindow(1) | M.Causal(), 8, 12),
    ("right_pad_causal", M.Causal() & M.KeyPadding(torch.tensor([12, 7])), 8, 12),
    ("holey_valid_window", M.SlidingWindow(3) & M.KeyPadding(valid=torch.tensor([[True, False] * 6] * 2)), 8, 12),
])
def test_masks_flash_cannot_express_are_refused(name, mask, Sq, Sk):
    call = _call(mask, Sq=Sq, Sk=Sk, device="cpu")  # device only decides where lengths go
    plan = flash.plan_call(call)
    assert isinstance(plan, str) and "mask" in plan
    why = flash.FlashBackend().not_supported_reasons(call)
    assert plan in why


# ---------------------------------------------------------------------------- flash_window


def flash_rule(causal: bool, window: tuple[int, int], Sq: int, Sk: int) -> np.ndarray:
    """flash-attn's documented mask, written out on its own: query i sees key j iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded); causal means right = 0."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    ok = np.ones((Sq, Sk), dtype=bool)
    if left >= 0:
        ok &= j >= i + Sk - Sq - left
    if right >= 0:
        ok &= j <= i + Sk - Sq + right
    return ok


EXTENTS = [None, 0, 1, 3, 17]
LENGTHS = [(1, 1), (1, 9), (5, 5), (4, 11), (11, 4), (9, 1), (16, 33)]


@pytest.mark.parametrize("Sq,Sk", LENGTHS, ids=[f"Sq{a}-Sk{b}" for a, b in LENGTHS])
def test_flash_window_matches_materialize(Sq, Sk):
    masks = [M.Causal()] + [M.SlidingWindow(left, right) for left, right in itertools.product(EXTENTS, EXTENTS)]
    masks += [M.Causal() & M.SlidingWindow(left, right) for left, right in [(2, None), (None, 3), (0, 0), (4, 1)]]
    masks += [M.SlidingWindow(5, 2) & M.SlidingWindow(1, 4)]
    if Sq == Sk:
        masks += [M.Causal("top_left"), M.SlidingWindow(2, 1, align="top_left") & M.Causal()]
    for m in masks:
        win = flash.flash_window(m, Sq, Sk)
        assert win is not None, m
        causal, (left, right) = win
        assert causal == (right == 0) and left >= -1 and right >= -1
        want = m.materialize(1, Sq, Sk).expand(1, 1, Sq, Sk)[0, 0].numpy()
        np.testing.assert_array_equal(flash_rule(causal, (left, right), Sq, Sk), want, err_msg=repr(m))


def test_module_doctests_run():
    import doctest
    assert doctest.testmod(flash).failed == 0


def test_flash_window_of_no_mask_and_of_masks_it_cannot_express():
    assert flash.flash_window(None, 3, 7) == (False, (-1, -1))
    assert flash.flash_window(M.SlidingWindow(None, None), 3, 7) == (False, (-1, -1))
    assert flash.flash_window(M.Causal(), 5, 5) == (True, (-1, 0))
    for m in (M.KeyPadding(torch.tensor([3])), M.Causal(q_start=torch.tensor([2])), M.Causal("top_left"),
              M.Causal() & M.KeyPadding(torch.tensor([3]))):
        assert flash.flash_window(m, 3, 7) is None, m


# ---------------------------------------------------------------------------- unpad / pad


@pytest.mark.parametrize("B,S", [(1, 1), (3, 7), (4, 33)])
def test_unpad_pad_round_trip(B, S):
    g = torch.Generator().manual_seed(stable_seed("unpad", B, S))
    x = torch.randn(B, S, 3, 8, generator=g, dtype=torch.float64)
    valid = torch.rand(B, S, generator=g) > 0.4
    valid[0] = False  # an empty sequence
    packed, idx, cu, max_len = flash.unpad(x.transpose(1, 2).transpose(1, 2), valid)  # strided view in
    lens = valid.sum(1)
    assert cu.dtype == torch.int32 and cu.tolist() == [0] + lens.cumsum(0).tolist()
    assert max_len == int(lens.max())
    assert torch.equal(packed, torch.cat([x[b][valid[b]] for b in range(B)]))
    back = flash.pad(packed, idx, B, S)
    assert torch.equal(back, x * valid[:, :, None, None])


def test_unpad_from_lengths_is_right_padding_and_pad_is_differentiable():
    x = torch.randn(3, 6, 2, 4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6, 0, 2])
    packed, idx, cu, max_len = flash.unpad(x, lengths)
    assert cu.tolist() == [0, 6, 6, 8] and max_len == 6 and packed.shape == (8, 2, 4)
    assert idx.tolist() == [0, 1, 2, 3, 4, 5, 12, 13]
    w = torch.randn(3, 6, 2, 4, dtype=torch.float64)
    (flash.pad(packed, idx, 3, 6) * w).sum().backward()
    keep = (torch.arange(6) < lengths[:, None])[:, :, None, None]
    assert torch.equal(x.grad, w * keep)


# ---------------------------------------------------------------------------- run, against a stand-in


class DocumentedFlash:
    """flash-attn's documented forward semantics in fp64 torch ops (for CPU tests): bottom-right
    causal / window per (packed) sequence, all-masked rows give 0, K/V heads shared by groups."""

    __version__ = "2.6.3"

    def __init__(self):
        self.calls = []

    @staticmethod
    def _attend(q, k, v, scale, causal, window):  # q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv)
        ok = torch.from_numpy(flash_rule(causal, window, q.shape[0], k.shape[0]))
        G = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(G, 1)) * scale
        row_ok = ok.any(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(~ok, float("-inf")).masked_fill(~row_ok, 0.0), -1) * row_ok
        return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(G, 1))

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False):
        assert q.dim() == 4 and q.shape[0] == k.shape[0] and q.stride(-1) == 1 and dropout_p == 0.0
        self.calls.append(("dense", causal, window_size))
        return torch.stack([self._attend(q[b], k[b], v[b], softmax_scale, causal, window_size)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False):
        assert q.dim() == 3 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0] and len(cq) == len(ck)
        assert max_seqlen_q == max(np.diff(cq)) and max_seqlen_k == max(np.diff(ck))
        self.calls.append(("varlen", causal, window_size))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        for b in range(len(cq) - 1):
            if cq[b + 1] > cq[b]:
                out[cq[b]:cq[b + 1]] = self._attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                                                    softmax_scale, causal, window_size)
        return out


def _lens(g, B, S, low=0):
    return torch.randint(low, S + 1, (B,), generator=g)


def _stand_in_cases(B, Sq, Sk, g):
    """name -> (mask, causal, expected entry point) for masks flash runs."""
    kl, ql = _lens(g, B, Sk), _lens(g, B, Sq)
    kl[0] = 0  # a sequence with no keys: all its queries give 0
    same = _lens(g, B, min(Sq, Sk), low=1)
    cases = {
        "none": (None, False, "dense"),
        "causal": (None, True, "dense"),
        "window": (M.SlidingWindow(3), False, "dense"),
        "window_two_sided": (M.SlidingWindow(2, 4), False, "dense"),
        "window_right_unbounded": (M.SlidingWindow(1, None), False, "dense"),
        "window_causal_and": (M.SlidingWindow(4, 2) & M.SlidingWindow(None, 0), True, "dense"),
        "key_padding": (M.KeyPadding(kl), False, "varlen"),
        "key_padding_left_causal": (M.KeyPadding(kl, side="left"), True, "varlen"),
        "key_and_query_padding": (M.KeyPadding(kl) & M.QueryPadding(ql), False, "varlen"),
        "left_padding_window": (M.KeyPadding(kl, side="left") & M.QueryPadding(ql, side="left")
                                & M.SlidingWindow(2, 1), False, "varlen"),
        "valid_tensors_holes": (M.KeyPadding(valid=torch.rand(B, Sk, generator=g) > 0.5)
                                & M.QueryPadding(valid=torch.rand(B, Sq, generator=g) > 0.3), False, "varlen"),
    }
    if Sq == Sk:  # right-padded self-attention: Lk - Lq = 0 = Sk - Sq, aligned
        cases["right_padding_causal"] = (M.KeyPadding(same) & M.QueryPadding(same), True, "varlen")
    return cases


def _flash_clamped(lq: int, lk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(lq, lk) bool: what flash-attn 2's C++ actually applies to one sequence (mha_fwd /
    mha_varlen_fwd clamp a window side >= seqlen_k to -1, then set_params_fprop gives a one-sided
    window's open side seqlen_k), bottom-right aligned."""
    left, right = window
    if causal:
        right = 0
    left = -1 if left >= lk else left
    right = -1 if right >= lk else right
    if left < 0 <= right:
        left = lk
    elif right < 0 <= left:
        right = lk
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _clamping_changes_the_mask(mask, causal, B, Sq, Sk) -> bool:
    """True when, for some sequence, flash-attn's clamped window differs from attnkit's mask."""
    m = M.as_mask(mask, causal)
    parts = list(m.masks) if isinstance(m, M.And) else [m]
    pos = [p for p in parts if isinstance(p, (M.Causal, M.SlidingWindow))]
    if not pos:
        return False
    pos_mask = pos[0] if len(pos) == 1 else M.And(*pos)
    is_causal, window = flash.flash_window(pos_mask, Sq, Sk)
    kv = flash._axis_valid([p for p in parts if isinstance(p, M.KeyPadding)], B, Sq, Sk, "cpu", -1)
    qv = flash._axis_valid([p for p in parts if isinstance(p, M.QueryPadding)], B, Sq, Sk, "cpu", -2)
    kv = torch.ones(B, Sk, dtype=torch.bool) if kv is None else kv
    qv = torch.ones(B, Sq, dtype=torch.bool) if qv is None else qv
    for b in range(B):
        lq, lk = int(qv[b].sum()), int(kv[b].sum())
        if lq and lk:
            want = pos_mask.materialize(1, lq, lk)[0, 0]  # the rule on the packed sequence
            if not torch.equal(_flash_clamped(lq, lk, is_causal, window), want):
                return True
    return False


SHAPES = [(2, 4, 2, 9, 9, 16), (3, 6, 2, 5, 17, 8), (2, 4, 1, 13, 6, 24), (1, 2, 2, 1, 7, 8)]
CASE_NAMES = list(_stand_in_cases(2, 5, 5, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", SHAPES, ids=[f"B{s[0]}-H{s[1]}x{s[2]}-Sq{s[3]}-Sk{s[4]}-D{s[5]}"
                                                          for s in SHAPES])
def test_run_through_documented_flash_matches_oracle(monkeypatch, case, B, Hq, Hkv, Sq, Sk, D):
    """The backend's own translation (window, unpad, pad, zero rows), with flash-attn replaced by
    its documented semantics in fp64: forward and gradients equal the fp64 oracle."""
    g = torch.Generator().manual_seed(stable_seed("flash-run", case, B, Hq, Hkv, Sq, Sk, D))
    cases = _stand_in_cases(B, Sq, Sk, g)
    if case not in cases:
        pytest.skip("case needs Sq == Sk")
    mask, causal, entry = cases[case]
    fake = DocumentedFlash()
    monkeypatch.setattr(flash, "_IMPORTED", (fake, None))
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float64, seed=stable_seed(case, Sq, Sk))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gold_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    call = _validate(*leaves, mask, causal, None, 0.0, False)
    plan = flash.plan_call(call)
    if isinstance(plan, str):  # refused: only where flash-attn's clamping would really differ
        assert "clamps" in plan, plan
        assert _clamping_changes_the_mask(mask, causal, B, Sq, Sk), plan
        return
    assert not _clamping_changes_the_mask(mask, causal, B, Sq, Sk)  # real flash-attn agrees with the stand-in
    out, weights = flash.FlashBackend().run(*leaves, call)
    gold = attnkit.attention_reference(*gold_leaves, mask, causal=causal)
    assert weights is None
    if fake.calls:  # (none when every query is masked: then the contract's zeros come from math)
        assert fake.calls[-1][0] == entry
    torch.testing.assert_close(out, gold, rtol=1e-10, atol=1e-12)
    dout = torch.randn(gold.shape, generator=g, dtype=torch.float64)
    out.backward(dout)
    gold.backward(dout)
    for name, a, b in zip("qkv", leaves, gold_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_padded_and_keyless_queries_are_exactly_zero(monkeypatch):
    monkeypatch.setattr(flash, "_IMPORTED", (DocumentedFlash(), None))
    q, k, v = make_qkv(3, 4, 2, 6, 6, 8, dtype=torch.float64, seed=5)
    mask = M.KeyPadding(torch.tensor([6, 0, 3])) & M.QueryPadding(torch.tensor([2, 6, 6]))
    call = _validate(q, k, v, mask, False, None, 0.0, False)
    out, _ = flash.FlashBackend().run(q, k, v, call)
    assert (out[0, :, 2:] == 0).all() and (out[1] == 0).all()
    assert (out[0, :, :2] != 0).any() and (out[2] != 0).any()
    everything_masked = M.KeyPadding(torch.tensor([0, 0, 0]))
    call = _validate(q, k, v, everything_masked, False, None, 0.0, False)
    assert (flash.FlashBackend().run(q, k, v, call)[0] == 0).all()


# ---------------------------------------------------------------------------- the real package on a GPU

def _needs_flash():
    why = get_backend("flash").available()
    if why is not None:
        pytest.skip(why)


GPU_CASES = {
    "causal_sq<sk": (lambda B, g: None, True, 77, 200),
    "causal_sq>sk": (lambda B, g: None, True, 130, 64),
    "window": (lambda B, g: M.SlidingWindow(31), False, 200, 200),
    "window_two_sided_causal_chunk": (lambda B, g: M.SlidingWindow(40, 7), False, 64, 300),
    "key_padding": (lambda B, g: M.KeyPadding(torch.randint(0, 257, (B,), generator=g)), False, 97, 256),
    "left_padding_causal": (lambda B, g: M.KeyPadding(torch.randint(1, 257, (B,), generator=g), side="left"), True,
                            97, 256),
    "self_attention_right_padding_causal": (
        lambda B, g: (lambda L: M.KeyPadding(L) & M.QueryPadding(L))(torch.randint(1, 181, (B,), generator=g)),
        True, 180, 180),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attn_matches_oracle_on_gpu(case, heads, dtype, D):
    _needs_flash()
    make_mask, causal, Sq, Sk = GPU_CASES[case]
    g = torch.Generator().manual_seed(stable_seed("flash-gpu", case, heads, D))
    B = 3
    mask = make_mask(B, g)
    q, k, v = (t.cuda() for t in make_qkv(B, *heads, Sq, Sk, D, dtype=dtype, seed=stable_seed(case, D)))
    kernel = attnkit.describe_call(q, k, v, mask, causal=causal, backend="flash", detail=True)
    assert kernel in ("flash[dense]", "flash[varlen]")
    assert kernel.endswith("varlen]") == (mask is not None and not isinstance(mask, M.SlidingWindow))
    out = check_against_oracle(q, k, v, mask, causal=causal, backend="flash")
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, causal=causal)
    empty_rows = (gold == 0).all(-1)
    assert (out[empty_rows] == 0).all()  # rows with nothing to attend to are exactly zero


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_flash_attn_dropout_runs_and_zero_dropout_is_deterministic():
    _needs_flash()
    q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, 128, 128, 64, dtype=torch.bfloat16, seed=3))
    a = attnkit.attention(q, k, v, causal=True, backend="flash")
    b = attnkit.attention(q, k, v, causal=True, backend="flash")
    assert torch.equal(a, b)
    torch.manual_seed(0)
    d1 = attnkit.attention(q, k, v, causal=True, dropout_p=0.3, backend="flash")
    torch.manual_seed(0)
    d2 = attnkit.attention(q, k, v, causal=True, dropout_p=0.3, backend="flash")
    assert torch.isfinite(d1).all() and torch.equal(d1, d2) and not torch.equal(d1, a)


def test_clamp_changes_window_matches_brute_force():
    """flash.clamp_changes_window (closed form) against flash-attn's clamping applied literally."""
    for lq, lk, left, right in itertools.product(range(1, 9), range(1, 7), range(-1, 8), range(-1, 8)):
        if (left, right) in ((-1, -1), (-1, 0)):
            continue  # no window / plain causal: never clamped into something else
        want = M.SlidingWindow(None if left < 0 else left, None if right < 0 else right).materialize(1, lq, lk)[0, 0]
        differs = not torch.equal(_flash_clamped(lq, lk, False, (left, right)), want)
        got = bool(flash.clamp_changes_window(torch.tensor([lq]), torch.tensor([lk]), left, right)[0])
        assert got == differs, (lq, lk, left, right)
