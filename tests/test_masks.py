"""Mask semantics against brute-force definitions written element by element, composition,
mask_mod agreeing with materialize, and mask validation."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit import masks as M

B, SQ, SK = 3, 5, 9
SHAPES = [(1, 1), (1, 7), (5, 9), (6, 6), (9, 5)]  # (Sq, Sk): decode, cross, square, Sq > Sk


def brute(rule, Sq, Sk, batch=B):
    """(B, 1, Sq, Sk) bool from rule(b, i, j)."""
    out = torch.zeros(batch, 1, Sq, Sk, dtype=torch.bool)
    for b, i, j in itertools.product(range(batch), range(Sq), range(Sk)):
        out[b, 0, i, j] = bool(rule(b, i, j))
    return out


def same(mask: M.Mask, rule, Sq, Sk, batch=B):
    got = mask.materialize(batch, Sq, Sk).expand(batch, 1, Sq, Sk)
    want = brute(rule, Sq, Sk, batch)
    assert torch.equal(got, want), f"{mask!r} differs from its definition at Sq={Sq}, Sk={Sk}"
    # The FlexAttention mask_mod must say the same thing, element by element.
    mod = mask.mask_mod(Sq, Sk, "cpu")
    for b, i, j in itertools.product(range(batch), range(Sq), range(Sk)):
        val = mod(torch.tensor(b), torch.tensor(0), torch.tensor(i), torch.tensor(j))
        assert bool(val) == bool(want[b, 0, i, j]), f"{mask!r} mask_mod differs at b={b}, i={i}, j={j}"


LENS = torch.tensor([0, 3, 9])
OFFS = torch.tensor([0, 2, 4])


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_causal_kinds(Sq, Sk):
    same(M.Causal(), lambda b, i, j: j <= i + Sk - Sq, Sq, Sk)
    same(M.Causal("top_left"), lambda b, i, j: j <= i, Sq, Sk)
    same(M.Causal(q_start=OFFS), lambda b, i, j: j <= i + int(OFFS[b]), Sq, Sk)


@pytest.mark.parametrize("Sq,Sk", SHAPES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (None, 1), (3, None)])
def test_sliding_window(Sq, Sk, left, right):
    def rule(b, i, j, off=Sk - Sq):
        p = i + off
        return (left is None or j >= p - left) and (right is None or j <= p + right)

    same(M.SlidingWindow(left, right), rule, Sq, Sk)
    same(M.SlidingWindow(left, right, align="top_left"), lambda b, i, j: rule(b, i, j, 0), Sq, Sk)


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_padding(Sq, Sk):
    lens = LENS.clamp(max=Sk)
    same(M.KeyPadding(lens), lambda b, i, j: j < int(lens[b]), Sq, Sk)
    same(M.KeyPadding(lens, side="left"), lambda b, i, j: j >= Sk - int(lens[b]), Sq, Sk)
    valid = torch.rand(B, Sk) > 0.5
    same(M.KeyPadding(valid=valid), lambda b, i, j: bool(valid[b, j]), Sq, Sk)
    qlens = LENS.clamp(max=Sq)
    same(M.QueryPadding(qlens), lambda b, i, j: i < int(qlens[b]), Sq, Sk)


def test_document_and_cross_document():
    lens = torch.tensor([[2, 3, 0], [5, 0, 0], [1, 1, 1]])
    kv = torch.tensor([[4, 1, 1], [2, 2, 2], [3, 3, 3]])

    def doc(ls, pos):
        acc = 0
        for d, n in enumerate(ls):
            if acc <= pos < acc + n:
                return d
            acc += n
        return None

    def rule(b, i, j):
        di, dj = doc(lens[b].tolist(), i), doc(kv[b].tolist(), j)
        return di is not None and di == dj

    same(M.Document(lens, kv), rule, 6, 9)
    shared = torch.tensor([2, 2, 1])
    same(M.Document(shared), lambda b, i, j: doc([2, 2, 1], i) is not None and doc([2, 2, 1], i) == doc([2, 2, 1], j), 6, 6)


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_prefix_lm(Sq, Sk):
    pre = torch.tensor([0, 2, 7])
    same(M.PrefixLM(pre), lambda b, i, j: j <= i + Sk - Sq or j < int(pre[b]), Sq, Sk)


def test_dense_and_additive_wrappers():
    t = torch.rand(B, 1, SQ, SK) > 0.4
    same(M.Dense(t), lambda b, i, j: bool(t[b, 0, i, j]), SQ, SK)
    t2 = torch.rand(SQ, SK) > 0.4  # broadcast from the right, like SDPA
    same(M.Dense(t2), lambda b, i, j: bool(t2[i, j]), SQ, SK)
    bias = torch.randn(SQ, SK).masked_fill(~t2, float("-inf"))
    a = M.Additive(bias)
    same(a, lambda b, i, j: bool(t2[i, j]), SQ, SK)
    assert torch.equal(a.bias(B, SQ, SK)[0, 0], bias)


def test_composition():
    lens = LENS.clamp(max=SK)
    m = (M.Causal() & M.KeyPadding(lens)) | M.SlidingWindow(0, 1, align="top_left")
    same(m, lambda b, i, j: (j <= i + SK - SQ and j < int(lens[b])) or (i <= j <= i + 1), SQ, SK)
    assert isinstance(M.Causal() & M.Causal() & M.KeyPadding(lens), M.And)
    assert len((M.Causal() & M.Causal() & M.KeyPadding(lens)).masks) == 3  # flattened


def test_additive_masks_stack_without_overflow():
    a = torch.full((SQ, SK), torch.finfo(torch.float16).min, dtype=torch.float16)
    b = a.clone()
    b[:, 0] = float("-inf")
    m = M.Additive(a) & M.Additive(b)
    bias = m.bias(1, SQ, SK)
    assert bias.dtype == torch.float32
    assert torch.isfinite(bias[..., 1:]).all() and torch.isneginf(bias[..., 0]).all()
    assert torch.equal(bias[0, 0, :, 1], torch.full((SQ,), 2 * torch.finfo(torch.float16).min))


def test_top_left_causal_detection():
    assert M.Causal().is_top_left_causal(4, 4)
    assert not M.Causal().is_top_left_causal(3, 4)
    assert M.Causal("top_left").is_top_left_causal(3, 4)
    assert (M.Causal() & M.Causal()).is_top_left_causal(4, 4)
    assert not (M.Causal() & M.KeyPadding(LENS)).is_top_left_causal(4, 4)
    assert not M.Causal(q_start=OFFS).is_top_left_causal(4, 4)


@pytest.mark.parametrize("make,exc,text", [
    (lambda: M.Causal("middle"), ValueError, "align"),
    (lambda: M.SlidingWindow(-1), ValueError, "left"),
    (lambda: M.SlidingWindow(2, 1.5), ValueError, "right"),
    (lambda: M.KeyPadding(), ValueError, "exactly one"),
    (lambda: M.KeyPadding(torch.tensor([1.5])), TypeError, "integers"),
    (lambda: M.KeyPadding(valid=torch.ones(2, 3)), TypeError, "bool"),
    (lambda: M.KeyPadding([1], side="up"), ValueError, "side"),
    (lambda: M.Dense(torch.ones(3, 3)), TypeError, "bool"),
    (lambda: M.Additive(torch.ones(3, 3, dtype=torch.long)), TypeError, "floating"),
    (lambda: M.Additive(torch.tensor([float("nan")])), ValueError, "NaN"),
    (lambda: M.Additive(torch.zeros(2)) | M.Causal(), TypeError, "Additive"),
    (lambda: M.Causal() & torch.ones(2, dtype=torch.bool), TypeError, "Dense"),
    (lambda: M.Document(torch.tensor([[[1]]])), ValueError, "lengths"),
    (lambda: M.Document(torch.tensor([-1, 2])), ValueError, "non-negative"),
])
def test_bad_mask_arguments(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


@pytest.mark.parametrize("mask,text", [
    (M.KeyPadding(torch.tensor([1, 2])), "lengths"),
    (M.KeyPadding(valid=torch.ones(3, 4, dtype=torch.bool)), r"\(3, 4\)"),
    (M.QueryPadding(valid=torch.ones(3, 9, dtype=torch.bool)), r"\(3, 9\)"),
    (M.Causal(q_start=torch.tensor([1, 2])), "q_start"),
    (M.Document(torch.tensor([3, 3])), "more than the sequence length"),
    (M.Dense(torch.ones(2, SQ, SK, dtype=torch.bool)), r"\(2, 5, 9\)"),
    (M.PrefixLM(torch.tensor([1, 2, 3, 4])), "prefix_lengths"),
])
def test_check_rejects_mismatched_shapes(mask, text):
    with pytest.raises(ValueError, match=text):
        mask.check(B, 4, SQ, SK)


@pytest.mark.parametrize("make", [
    lambda **kw: M.Causal(**kw),
    lambda **kw: M.SlidingWindow(2, **kw),
    lambda **kw: M.PrefixLM(torch.tensor([1, 0, 2]), **kw),
    lambda **kw: M.ALiBi(M.alibi_slopes(4), **kw),
], ids=["Causal", "SlidingWindow", "PrefixLM", "ALiBi"])
def test_offsets_is_the_deprecated_spelling_of_q_start(make):
    """``offsets=`` and ``.offsets`` still work (with a DeprecationWarning) and mean ``q_start``;
    both at once is an error."""
    new = make(q_start=OFFS)
    with pytest.warns(DeprecationWarning, match="q_start"):
        old = make(offsets=OFFS)
    assert torch.equal(old.q_start, new.q_start)
    with pytest.warns(DeprecationWarning, match="q_start"):
        assert old.offsets is old.q_start
    torch.testing.assert_close(old.materialize(B, SQ, SK), new.materialize(B, SQ, SK), rtol=0, atol=0)
    with pytest.raises(TypeError, match="both"):
        make(q_start=OFFS, offsets=OFFS)


def test_the_reduced_mask_is_importable_but_not_a_public_mask_name():
    from attnkit.masks.reduced import ReducedMask

    assert M.ReducedMask is ReducedMask and "ReducedMask" not in M.__all__


def test_keys_by_position_says_which_masks_speak_of_positions_only():
    """keys_by_position: a mask that is True means the same over fewer keys (its first columns);
    checked against materialize for each kind, True and False."""
    qs = torch.tensor([2, 5])
    cases = {
        M.Causal(q_start=qs): True, M.Causal(align="top_left"): True, M.Causal(): False,
        M.SlidingWindow(3, q_start=qs): True, M.SlidingWindow(3): False,
        M.PrefixLM(torch.tensor([2, 3]), q_start=qs): True, M.KeyPadding(torch.tensor([4, 6])): True,
        M.KeyPadding(torch.tensor([4, 6]), side="left"): False, M.KeyPadding(valid=torch.ones(2, 9, dtype=torch.bool)): False,
        M.QueryPadding(torch.tensor([1, 3])): True, M.Dense(torch.ones(1, 1, 3, 9, dtype=torch.bool)): False,
        M.Causal(q_start=qs) & M.KeyPadding(torch.tensor([4, 6])): True, M.Causal(q_start=qs) & M.Causal(): False,
        M.SlidingWindow(1, q_start=qs) | M.Causal(q_start=qs): True,
    }
    for mask, expected in cases.items():
        assert mask.keys_by_position() is expected, mask
        if expected:  # over 7 keys: the first 7 columns of the mask over 9
            torch.testing.assert_close(mask.materialize(2, 3, 7), mask.materialize(2, 3, 9)[..., :7])
