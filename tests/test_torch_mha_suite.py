"""PyTorch's own tests of ``nn.MultiheadAttention``, run against ``attnkit.nn.MultiheadAttention``.

The installed torch wheel does not ship its test suite, so this file re-creates the substance of
the MHA cases of PyTorch's ``test/nn/test_multihead_attention.py`` and ``test/test_transformers.py``
(each test below is named after the PyTorch test it follows), with ``torch.nn.MultiheadAttention``
replaced by attnkit's. Where PyTorch compares against a numpy reference or hard-coded numbers
taken from torch, the oracle here is torch's own module with the same weights: rule R
(``conftest.rule_r``) with gold = torch's module in fp64 and base = torch's module in
fp32, forward (outputs and weights) and backward (input and parameter gradients). Encoders swap
their attention through :func:`attnkit.nn.replace_multihead_attention`.

Covered: the helper variants of ``test_multihead_attention`` (add_bias_kv, add_zero_attn,
no_masking, key_padding_mask, their combinations, same_embed_dim, average_attn_weights),
``test_multihead_attn_3d_attn_mask``, ``_no_bias``, ``_invalid_shape``,
``_fast_path_invalid_shape`` (torch's exact messages), ``_nested_tensor_outside_fast_path``,
``test_multihead_self_attn_two_masks_fast_path``, ``test_multihead_attention_dtype(_batch_first)``,
``_fast_path_query_and_bias_have_different_dtypes``, ``_fast_path_small_test``,
``test_fast_path_check_with_mask_does_not_break_in_compile``, ``_in_proj_bias_none``,
``_in_proj_weight_none``; from test_transformers.py ``test_train_with_pad_and_catch_error``,
``test_multiheadattention_fastpath_attn_mask``, ``test_transformerencoderlayer_src_mask``,
``_no_fastpath_with_hooks``, ``test_transformerencoder_fastpath``, ``_square_input``,
``test_transformerencoder``, ``test_encoder_padding_and_src_mask_bool``,
``test_decoder_padding_and_src_mask_bool``, ``test_encoder_is_causal``, ``test_mha_native_args``,
``test_kpm_mask_trailing_column_with_nested_tensor``, ``test_with_nested_tensor_input``,
``test_bias_is_none``, ``test_transformer_bias_is_none``, ``test_train_with_is_causal`` (with
``is_causal_kernels``); and the combinations the two files spread over many tests, in one grid
(key_padding_mask x attn_mask 2-D / 3-D per head, bool / float, need_weights x
average_attn_weights, seq-first / batch_first / unbatched, kdim / vdim), plus torchtext's
``in_proj_container`` test (separate q / k / v projections packed into ``in_proj_weight``).

Excluded, and why:

* the ``saved_kv`` variants of ``test_multihead_attention`` (``_saved_kv``, ``_all_arguments1``
  and ``2`` with their "bias cannot be added to static key" assertion): ``static_k`` /
  ``static_v`` exist only in ``F.multi_head_attention_forward``, not in the module this file
  tests; ``_all_arguments1`` runs here without them.
* ``test_multihead_self_attn_two_masks_fast_path_mock``, ``test_mask_check_fastpath``,
  ``test_disable_fastpath``: they assert that torch's fused kernels
  (``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``) are called.
  attnkit's module never takes them, by design (the attention goes through
  ``attnkit.attention``); ``test_fused_fast_paths_route_through_attnkit`` checks that instead.
* ``test_script_encoder_subclass``, ``test_transformerencoderlayer_subclass``,
  ``test_transformerencoderlayer_subclass_model``, ``test_script_mha_in_proj_weight_none``:
  ``torch.jit.script`` (deprecated in torch) cannot compile attnkit's Python forward.
* ``test_multihead_attn_nested_tensor_outside_fast_path`` as written: it fails with torch 2.13
  itself (5 heads: torch asserts that NestedTensors need its fast path). Re-created as what
  torch does assert (an empty NestedTensor; q, k, v that differ), and jagged self-attention,
  which attnkit computes.
* ``test_self_attn_TxT_attn_mask`` (skipped upstream: 4-D masks), ``test_incompatible_mask``
  (defined inside another test upstream, so never run), the CUDA-only autocast parameter of
  ``test_transformerencoder_fastpath``, the ``MagicMock`` part of ``test_train_with_is_causal``
  (it tests TransformerEncoder's causal-mask detection with a mocked torch MHA, no attention),
  ``test_decoder_only_layer`` (CUDA + fairseq), and the SDPA-only tests of test_transformers.py.

Sizes follow PyTorch's where they are small; its 100 random trials per variant and 100 training
iterations (a slowTest) are cut to a few.
"""

from __future__ import annotations

import copy
import logging
import random
import re
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.nn import Parameter

import attnkit.nn as ann
from conftest import rule_r


# --------------------------------------------------------------------------- helpers


def _twins(*args, seed=0, **kw):
    """torch's and attnkit's module built from the same seed (so the same weights: attnkit's
    constructor and initialisation are torch's)."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(*args, **kw)
    torch.manual_seed(seed)
    ours = ann.MultiheadAttention(*args, **kw)
    return ref, ours


def _swapped(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every MultiheadAttention is attnkit's (same weights)."""
    return ann.replace_multihead_attention(copy.deepcopy(model))


def _cast(args, dtype, requires_grad):
    """Float tensors cast to ``dtype`` as new leaves, keeping which arguments are the same tensor
    (``query is key is value`` picks torch's packed projection and fast path). Returns the
    arguments and the leaves."""
    seen: dict[int, Tensor] = {}
    out = []
    for a in args:
        if isinstance(a, Tensor) and a.dtype.is_floating_point:
            if id(a) not in seen:
                seen[id(a)] = a.detach().to(dtype).requires_grad_(requires_grad)
            a = seen[id(a)]
        out.append(a)
    return out, list(seen.values())


def _cast_kwargs(kwargs, dtype):
    return {k: v.to(dtype) if isinstance(v, Tensor) and v.dtype.is_floating_point else v for k, v in kwargs.items()}


def _match_torch(ref, ours, args, kwargs=None, *, backward=True, rows=None):
    """Rule R for attnkit's module against torch's on the same inputs: output and weights, and
    with ``backward`` the gradients of every floating input and parameter for loss <out, dout>.
    gold = torch's module in fp64, base = torch's in fp32, ours in fp32. ``rows`` (a bool tensor
    over the output's leading dims) restricts the forward comparison (torch's fully masked rows
    are NaN, attnkit's 0). Returns ours' (output, weights)."""
    kwargs = kwargs or {}
    gold = copy.deepcopy(ref).double()
    results = []
    for m, dt in ((ours, torch.float32), (ref, torch.float32), (gold, torch.float64)):
        a, leaves = _cast(args, dt, backward)
        m.zero_grad()
        out, w = m(*a, **_cast_kwargs(kwargs, dt))
        grads = []
        if backward:
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            (out * dout.to(dt)).sum().backward()
            grads = [t.grad for t in leaves] + [p.grad for p in m.parameters()]
        results.append((out, w, grads))
    (o, w, g), (o_ref, w_ref, g_ref), (o_gold, w_gold, g_gold) = results
    E = o.shape[-1]
    S = max(a.shape[-2] if a.dim() > 1 else 1 for a in args if isinstance(a, Tensor))
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    rule_r(pick(o), pick(o_ref), pick(o_gold), n_terms=max(S, E), what="out")
    assert (w is None) == (w_ref is None)
    if w is not None:
        assert w.dtype == w_ref.dtype and w.shape == w_ref.shape
        keep = ~torch.isnan(w_gold)  # with ``rows``: torch's weights rows are NaN where its output is
        rule_r(w[keep], w_ref[keep], w_gold[keep], n_terms=max(S, E), what="weights")
    for i, (a, b, c) in enumerate(zip(g, g_ref, g_gold)):
        assert (a is None) == (b is None), f"gradient {i}"
        if a is not None:
            rule_r(a, b, c, factor=3.0, n_terms=o.numel() * S, what=f"gradient {i}")
    return o, w


def _not_fully_masked(attn_mask, key_padding_mask, N, H, L, S):
    """(N, H, L) True where a query row keeps a key (torch polarity: True = not allowed)."""
    blocked = torch.zeros(N, H, L, S, dtype=torch.bool)
    if attn_mask is not None:
        am = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        blocked = blocked | (am.view(1, 1, L, S) if am.dim() == 2 else am.view(N, H, L, S))
    if key_padding_mask is not None:
        kpm = key_padding_mask if key_padding_mask.dtype == torch.bool else torch.isneginf(key_padding_mask)
        blocked = blocked | kpm.view(N, 1, 1, S)
    return ~blocked.all(-1)


# --------------------------------------------------------------------------- test_multihead_attention.py


_VARIANTS = {  # test_multihead_attention's helper calls (without static_k / static_v, see the docstring)
    "no_masking": dict(),
    "key_padding_mask": dict(add_key_padding_mask=True),
    "add_bias_kv": dict(add_bias_kv=True),
    "add_zero_attn": dict(add_zero_attn=True),
    "add_bias_kv_zero_attn": dict(add_key_padding_mask=True, add_bias_kv=True, add_zero_attn=True),
    "all_arguments1": dict(add_key_padding_mask=True, add_zero_attn=True),
    "all_arguments3": dict(add_key_padding_mask=True, add_zero_attn=True, same_embed_dim=True),
}


@pytest.mark.parametrize("average_attn_weights", [True, False], ids=["average", "per_head"])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_multihead_attention(variant, average_attn_weights):
    """One decoder query (L = 1) against S source states, kdim = vdim random (or embed_dim),
    a float (1, S) attn_mask of 0 / -inf and a key padding mask shared by the batch, as in
    PyTorch's _multihead_attn_test_helper; one key always allowed (torch gives NaN otherwise)."""
    opts = _VARIANTS[variant]
    rng = random.Random(f"{variant}-{average_attn_weights}")
    for _ in range(3):
        N, S = rng.randint(2, 10), rng.randint(2, 10)
        d_head, H = rng.randint(3, 10), rng.randint(2, 5) * 2
        d_model = d_head * H
        kv_dim = d_model if opts.get("same_embed_dim") else rng.randint(5, 20)
        keep = rng.randrange(S)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        attn_mask = torch.zeros(1, S).masked_fill(torch.rand(1, S, generator=g) < 0.5, float("-inf"))
        attn_mask[0, keep] = 0.0
        kpm = None
        if opts.get("add_key_padding_mask"):
            kpm = (torch.rand(1, S, generator=g) < 0.5).expand(N, S).clone()
            kpm[:, keep] = False
        ref, ours = _twins(d_model, H, add_bias_kv=opts.get("add_bias_kv", False),
                           add_zero_attn=opts.get("add_zero_attn", False), kdim=kv_dim, vdim=kv_dim,
                           seed=rng.randrange(2**31))
        q = torch.rand(1, N, d_model, generator=g)
        k = torch.rand(S, N, kv_dim, generator=g)
        _, w = _match_torch(ref, ours, (q, k, k), dict(key_padding_mask=kpm, attn_mask=attn_mask,
                                                       average_attn_weights=average_attn_weights))
        extra = int(opts.get("add_bias_kv", False)) + int(opts.get("add_zero_attn", False))
        assert w.shape == ((N, 1, S + extra) if average_attn_weights else (N, H, 1, S + extra))


def test_multihead_attn_3d_attn_mask():
    """A 3-D (N * H, L, S) attn_mask equals calling each batch entry with its 2-D mask, and torch."""
    E, H, N, S, L = 8, 4, 8, 3, 2
    g = torch.Generator().manual_seed(0)
    query, key = torch.rand(N, L, E, generator=g), torch.rand(N, S, E, generator=g)
    attn_mask = torch.zeros(N, L, S).masked_fill(torch.randint(0, 2, (N, L, S), generator=g) == 0, float("-inf"))
    ref, ours = _twins(E, H)
    mask_3d = torch.repeat_interleave(attn_mask, H, dim=0)  # (N * H, L, S)
    out_3d = ours(query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1), attn_mask=mask_3d)[0]
    for i in range(N):
        out_2d = ours(query[i, None].transpose(0, 1), key[i, None].transpose(0, 1), key[i, None].transpose(0, 1),
                      attn_mask=attn_mask[i])[0]
        torch.testing.assert_close(out_3d[:, i:i + 1], out_2d)
    rows = _not_fully_masked(mask_3d, None, N, H, L, S).all(1).T  # (L, N): rows torch does not make NaN
    _match_torch(ref, ours, (query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1)),
                 dict(attn_mask=mask_3d), backward=False, rows=rows)


def test_multihead_attn_no_bias():
    ref, ours = _twins(8, 4, bias=False)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    x = torch.randn(3, 2, 8)
    _match_torch(ref, ours, (x, x, x))


# PyTorch's invalid-shape cases: (call on query, key, value, torch's exact message). ``key`` and
# ``value`` are 3-D for the batched cases and 2-D for the unbatched ones.
_BATCHED_MSG = "For batched (3-D) `query`, "
_INVALID_BATCHED = [
    (lambda m, q, k, v: m(q, torch.randn(4, 4), v),
     "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively"),
    (lambda m, q, k, v: m(q, k, torch.randn(4, 4)),
     "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively"),
    (lambda m, q, k, v: m(q, k, v, key_padding_mask=torch.tensor([False, False, True, True])),
     "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead"),
    (lambda m, q, k, v: m(q, k, v, attn_mask=torch.tensor([False, False, True, True])),
     "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
]
_INVALID_UNBATCHED = [
    (lambda m, q, k, v: m(q, torch.randn(4, 4, 4), v),
     "expected `key` and `value` to be 2-D but found 3-D and 2-D tensors respectively"),
    (lambda m, q, k, v: m(q, k, torch.randn(4, 4, 4)),
     "expected `key` and `value` to be 2-D but found 2-D and 3-D tensors respectively"),
    (lambda m, q, k, v: m(q, k, v, key_padding_mask=torch.tensor([[False, False, True, True] * 2])),
     "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead"),
    (lambda m, q, k, v: m(q, k, v, attn_mask=torch.tensor([False, False, True, True])),
     "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
    (lambda m, q, k, v: m(q, k, v, attn_mask=torch.randn(5, 4, 4).bernoulli_().bool()),
     "Expected `attn_mask` shape to be (4, 4, 4)"),
]


def _assert_invalid_shapes_raise(ref, ours, **kw):
    """Each invalid call raises torch's AssertionError with torch's message in both modules (so
    the expected text is torch's own), and attnkit's error is also a ValueError."""
    for batched, cases in ((True, _INVALID_BATCHED), (False, _INVALID_UNBATCHED)):
        shape = (4, 4, 4) if batched else (4, 4)
        q, k, v = torch.randn(shape), torch.randn(shape), torch.randn(shape)
        for call, msg in cases:
            for m in (ref, ours):
                with pytest.raises(AssertionError, match=re.escape(msg)) as err:
                    call(lambda *a, **k: m(*a, **k, **kw), q, k, v)
            assert isinstance(err.value, ValueError)


def test_multihead_attn_invalid_shape():
    ref, ours = _twins(4, 4)
    _assert_invalid_shapes_raise(ref, ours)
    with torch.no_grad():  # where torch could take its fast path
        _assert_invalid_shapes_raise(ref.eval(), ours.eval())


def test_multihead_attn_fast_path_invalid_shape():
    ref, ours = _twins(4, 4, batch_first=True)
    with torch.no_grad():
        _assert_invalid_shapes_raise(ref.eval(), ours.eval(), need_weights=False)
        q, k, v = torch.randn(4, 4, 4), torch.randn(4, 4, 4), torch.randn(4, 4, 4)
        for m in (ref, ours):  # the fast-path test's own shapes: a 2-D key or value of another size
            with pytest.raises(AssertionError, match=re.escape(
                    _BATCHED_MSG + "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively")):
                m(q, torch.randn(3, 3), v, need_weights=False)
            with pytest.raises(AssertionError, match=re.escape(
                    _BATCHED_MSG + "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively")):
                m(q, k, torch.randn(3, 3), need_weights=False)
            with pytest.raises(AssertionError, match=re.escape(
                    _BATCHED_MSG + "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead")):
                m(q, k, v, key_padding_mask=torch.tensor([False, True, True]), need_weights=False)


def test_multihead_attn_nested_tensor_outside_fast_path():
    """What torch asserts, attnkit asserts (an empty NestedTensor; NestedTensor q, k, v that
    differ); jagged self-attention, which torch refuses outside its fast path (odd heads, grad),
    attnkit computes: it equals torch's module on the padded batch, and keeps the layout."""
    ref, ours = _twins(10, 5, batch_first=True)
    ref.eval(), ours.eval()
    parts = [torch.randn(4, 10), torch.randn(6, 10)]
    nt1 = torch.nested.nested_tensor(parts, layout=torch.jagged)
    empty = torch.nested.nested_tensor([])
    for m in (ref, ours):
        with pytest.raises(AssertionError):
            m(empty, empty, empty)
        nt2 = torch.nested.nested_tensor([torch.randn(7, 10), torch.randn(16, 10)], layout=torch.jagged)
        nt3 = torch.nested.nested_tensor([torch.randn(7, 10), torch.randn(16, 10)], layout=torch.jagged)
        with pytest.raises(AssertionError):
            m(nt1, nt2, nt3)
    for kw in (dict(), dict(add_bias_kv=True), dict(add_zero_attn=True), dict(add_bias_kv=True, add_zero_attn=True)):
        ref, ours = _twins(10, 5, batch_first=True, **kw)
        out, _ = ours(nt1, nt1, nt1)
        assert out.is_nested and out.layout == torch.jagged
        padded = torch.nested.to_padded_tensor(torch.nested.nested_tensor(parts), 0.0)
        pad = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
        want, _ = ref(padded, padded, padded, key_padding_mask=pad)
        for got, w, n in zip(out.unbind(), want.unbind(), (4, 6)):
            torch.testing.assert_close(got, w[:n])
        with torch.inference_mode():
            ours(nt1, nt1, nt1)


def test_multihead_self_attn_two_masks_fast_path():
    """eval + no_grad self-attention with a bool attn_mask and a bool key_padding_mask (torch's
    fast path merges them): equal to torch's slow functional path and to its module, fully masked
    rows aside (torch NaN, attnkit 0 attention: the output projection's bias)."""
    E, H, N, S = 14, 7, 8, 5
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, S, E, generator=g)
    attn_mask = torch.randint(0, 2, (S, S), generator=g).bool()
    kpm = torch.randint(0, 2, (N, S), generator=g).bool()
    ref, ours = _twins(E, H, batch_first=True)
    ref.eval(), ours.eval()
    with torch.no_grad():
        got, _ = ours(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)
        slow, _ = nn.functional.multi_head_attention_forward(
            x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), E, H, ref.in_proj_weight, ref.in_proj_bias,
            None, None, False, 0.0, ref.out_proj.weight, ref.out_proj.bias, training=False,
            key_padding_mask=kpm, need_weights=False, attn_mask=attn_mask)
    rows = _not_fully_masked(attn_mask, kpm, N, 1, S, S)[:, 0]  # (N, L)
    torch.testing.assert_close(got[rows], slow.transpose(0, 1)[rows])
    torch.testing.assert_close(got[~rows], ours.out_proj.bias.expand(int((~rows).sum()), E))
    with torch.no_grad():
        _match_torch(ref, ours, (x, x, x), dict(attn_mask=attn_mask, key_padding_mask=kpm), backward=False, rows=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_multihead_attention_dtype(dtype):
    """(CUDA-only upstream, with half; here on CPU, where test_nn.py covers half precision) the
    output keeps the input's shape and dtype, seq-first and batch_first, training and eval +
    no_grad; fp64 equals torch."""
    E, H, sl, bs = 128, 8, 10, 8
    ours = ann.MultiheadAttention(E, H).to(dtype)
    q, k, v = (torch.randn(sl, bs, E, dtype=dtype) for _ in range(3))
    out = ours(q, k, v)[0]
    assert out.shape == q.shape and out.dtype == dtype
    for training in (True, False):  # test_multihead_attention_dtype_batch_first
        m = ann.MultiheadAttention(E, H, batch_first=True).to(dtype).train(training)
        with torch.set_grad_enabled(training):
            q, k, v = (torch.randn(bs, sl, E, dtype=dtype) for _ in range(3))
            out = m(q, k, v, need_weights=False)[0]
        assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float64:
        ref, ours = _twins(E, H, dtype=dtype)
        torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v)[0])


def test_multihead_attn_fast_path_query_and_bias_have_different_dtypes():
    ref, ours = _twins(4, 4, batch_first=True, dtype=torch.double)
    for m in (ref, ours):
        m.eval()
        m.in_proj_bias = Parameter(m.in_proj_bias.to(torch.half))
    query = torch.randn(4, 4, 4, dtype=torch.double)
    with torch.no_grad():
        torch.testing.assert_close(ours(query, query, query)[0], ref(query, query, query)[0])


def test_multihead_attn_fast_path_small_test():
    ref, ours = _twins(4, 4, batch_first=True, dtype=torch.double)
    ref.eval(), ours.eval()
    query = torch.randn(4, 4, 4, dtype=torch.double)
    with torch.no_grad():
        (a, wa), (b, wb) = ref(query, query, query), ours(query, query, query)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(wb, wa)


def test_fast_path_check_with_mask_does_not_break_in_compile():
    """torch.compile(fullgraph=True) of TransformerEncoder with a src_key_padding_mask (the
    encoder turns the bool mask into a float one for its layers): no graph break, same output as
    torch's encoder."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True, dropout=0.1, dtype=torch.double)
    encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
    ours = torch.compile(_swapped(encoder), fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 41, 512, dtype=torch.double)
    pad_mask = torch.rand(1, 41, generator=torch.Generator().manual_seed(0)) > 0.5
    pad_mask[..., 0] = True
    torch.testing.assert_close(ours(x, mask=None, src_key_padding_mask=pad_mask),
                               encoder(x, mask=None, src_key_padding_mask=pad_mask))


def test_multihead_attn_in_proj_bias_none():
    ref, ours = _twins(2, 2, bias=False, dtype=torch.double)
    query = torch.rand(2, 2, 2, dtype=torch.double)
    with torch.no_grad():
        torch.testing.assert_close(ours(query, query, query)[0], ref(query, query, query)[0])


def test_multihead_attn_in_proj_weight_none():
    """kdim = vdim = 2 != embed_dim: separate q / k / v projection weights, in_proj_weight None."""
    ref, ours = _twins(4, 4, kdim=2, vdim=2)
    assert ours.in_proj_weight is None and ours.q_proj_weight is not None
    query, key = torch.rand(4, 4, 4), torch.rand(4, 4, 2)
    _match_torch(ref, ours, (query, key, key))


# --------------------------------------------------------------------------- the option grid


_MASKS = ["none", "kpm_bool", "kpm_float", "am2d_bool", "am2d_float", "am3d_bool", "am3d_float", "both_bool",
          "both_float", "am_bool_kpm_float"]


def _torch_mask(kind, shape, g):
    """torch polarity (True / -inf = not allowed), key 0 always allowed (no NaN rows in torch)."""
    blocked = torch.rand(shape, generator=g) < 0.4
    blocked[..., 0] = False
    if kind == "bool":
        return blocked
    return torch.randn(shape, generator=g).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "unbatched"])
@pytest.mark.parametrize("weights", ["average", "per_head", "none"])
@pytest.mark.parametrize("masks", _MASKS)
def test_mask_combinations_need_weights_and_layouts(masks, weights, layout):
    """key_padding_mask and attn_mask (2-D, 3-D per head), bool and float, alone and together,
    x need_weights / average_attn_weights x seq-first / batch_first / unbatched, with cross
    attention through kdim / vdim on every other layout: forward and backward equal torch's."""
    E, H, N, L, S = 8, 2, 2, 3, 5
    kvdim = dict(kdim=5, vdim=7) if layout != "batch_first" else {}
    ref, ours = _twins(E, H, batch_first=layout == "batch_first", **kvdim)
    g = torch.Generator().manual_seed(len(masks) * 7 + len(weights) + len(layout))

    def seq(n, d):
        shape = (n, d) if layout == "unbatched" else ((N, n, d) if layout == "batch_first" else (n, N, d))
        return torch.randn(shape, generator=g)

    q, k, v = seq(L, E), seq(S, kvdim.get("kdim", E)), seq(S, kvdim.get("vdim", E))
    kwargs = dict(need_weights=weights != "none", average_attn_weights=weights == "average")
    if masks.startswith("kpm") or masks.startswith("both") or masks.endswith("kpm_float"):
        kwargs["key_padding_mask"] = _torch_mask(masks.rsplit("_", 1)[1], (S,) if layout == "unbatched" else (N, S), g)
    if masks.startswith("am") or masks.startswith("both"):
        three_d = masks.startswith("am3d")
        shape = ((H, L, S) if layout == "unbatched" else (N * H, L, S)) if three_d else (L, S)
        kwargs["attn_mask"] = _torch_mask("bool" if "am_bool" in masks else masks.split("_")[1], shape, g)
    _match_torch(ref, ours, (q, k, v), kwargs)


def test_in_proj_container():
    """torchtext's in_proj_container test: three separate projections (query, key, value Linear
    layers) packed into in_proj_weight / in_proj_bias, with bias_k / bias_v and a 2-D bool
    attn_mask, give what the projections and a per-head softmax give by hand (fp64)."""
    E, H, L, S, N = 12, 3, 4, 5, 2
    torch.manual_seed(0)
    proj = [nn.Linear(E, E, dtype=torch.double) for _ in range(3)]
    ours = ann.MultiheadAttention(E, H, add_bias_kv=True, dtype=torch.double)
    with torch.no_grad():
        ours.in_proj_weight.copy_(torch.cat([p.weight for p in proj]))
        ours.in_proj_bias.copy_(torch.cat([p.bias for p in proj]))
    q, k, v = torch.randn(L, N, E, dtype=torch.double), torch.randn(S, N, E, dtype=torch.double), \
        torch.randn(S, N, E, dtype=torch.double)
    blocked = torch.randint(0, 2, (L, S), generator=torch.Generator().manual_seed(1)).bool()
    out, w = ours(q, k, v, attn_mask=blocked, average_attn_weights=False)

    def heads(x):  # (T, N, E) -> (N, H, T, D)
        return x.reshape(x.shape[0], N, H, E // H).permute(1, 2, 0, 3)
    qh = heads(proj[0](q))
    kh = heads(torch.cat([proj[1](k), ours.bias_k.expand(1, N, E)]))
    vh = heads(torch.cat([proj[2](v), ours.bias_v.expand(1, N, E)]))
    scores = qh @ kh.transpose(-1, -2) / (E // H) ** 0.5
    scores = scores.masked_fill(nn.functional.pad(blocked, (0, 1)), float("-inf"))  # bias_k always allowed
    p = scores.softmax(-1)
    want = ours.out_proj((p @ vh).permute(2, 0, 1, 3).reshape(L, N, E))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w, p)


# --------------------------------------------------------------------------- test_transformers.py


def test_train_with_pad_and_catch_error():
    """Training an encoder with a bool padding mask; uint8 / int64 masks raise AssertionError;
    train and eval (fast path) agree on the unpadded positions. 3 iterations (upstream: 100, slow)."""
    torch.manual_seed(0)
    pad_mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    layer = nn.TransformerEncoderLayer(d_model=2, dim_feedforward=4, nhead=2, batch_first=True, activation="gelu",
                                       dropout=0)
    encoder = _swapped(nn.TransformerEncoder(layer, 2))
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        encoder.train()
        optimizer.zero_grad()
        inputs = torch.cat([torch.randn(1, 2, 2), torch.zeros(1, 2, 2)], dim=1)
        outputs = encoder(inputs, src_key_padding_mask=pad_mask)
        nn.MSELoss()(outputs[:, 0:2, :], inputs[:, 0:2, :]).backward()
        optimizer.step()
        with torch.no_grad():
            test = torch.cat([torch.randn(1, 2, 2), torch.zeros(1, 2, 2)], dim=1)
            with pytest.raises(AssertionError):
                encoder(test, src_key_padding_mask=pad_mask.to(torch.uint8))
            train_out = encoder(test, src_key_padding_mask=pad_mask)
            encoder.eval()
            with pytest.raises(AssertionError):
                encoder(test, src_key_padding_mask=pad_mask.to(torch.int64))
            eval_out = encoder(test, src_key_padding_mask=pad_mask)
            assert nn.L1Loss()(train_out[:, 0:2, :], eval_out[:, 0:2, :]).item() < 1e-4


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("key_padding_mask_dim", [2, None], ids=["kpm", "no_kpm"])
@pytest.mark.parametrize("attn_mask_dim", [2, 3, None], ids=["am2d", "am3d", "no_am"])
def test_multiheadattention_fastpath_attn_mask(attn_mask_dim, key_padding_mask_dim, mask_dtype):
    """train (slow path) and eval + no_grad (torch's fast path) give the same output, and the
    same as torch (its fully masked rows, NaN, aside: make_tensor's random masks have some)."""
    B, L, D, H = 2, 4, 8, 4
    torch.manual_seed(attn_mask_dim or 0)
    attn_mask = {2: lambda: torch.testing.make_tensor((L, L), dtype=mask_dtype, device="cpu"),
                 3: lambda: torch.testing.make_tensor((B * H, L, L), dtype=mask_dtype, device="cpu"),
                 None: lambda: None}[attn_mask_dim]()
    kpm = torch.testing.make_tensor((B, L), dtype=mask_dtype, device="cpu") if key_padding_mask_dim else None
    ref, ours = _twins(D, H, batch_first=True)
    X = torch.randn(B, L, D)
    with torch.no_grad():
        ours.train()
        out = ours(X, X, X, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)[0]
        ours.eval()
        out_fp = ours(X, X, X, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)[0]
        torch.testing.assert_close(out, out_fp)
        ref.eval()
        want = ref(X, X, X, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)[0]
    rows = ~torch.isnan(want).any(-1)
    torch.testing.assert_close(out[rows], want[rows])


@pytest.mark.parametrize("nhead", [1, 4, 8])
def test_transformerencoderlayer_src_mask(nhead):
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(d_model=8, nhead=nhead, dim_feedforward=32, batch_first=True, dropout=0.0)
    ours = _swapped(model)
    src = torch.rand(2, 4, 8)
    src_mask = torch.zeros(4, 4).to(torch.bool)
    torch.testing.assert_close(ours(src, src_mask=src_mask), model(src, src_mask=src_mask))
    model.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(src, src_mask=src_mask), model(src, src_mask=src_mask))


@pytest.mark.parametrize("nhead", [3, 4])
def test_transformerencoderlayer_no_fastpath_with_hooks(nhead):
    model = _swapped(nn.TransformerEncoderLayer(d_model=12, nhead=nhead, dim_feedforward=12, batch_first=True)).eval()
    cache = []
    handle = model.self_attn.register_forward_hook(lambda module, inputs, output: cache.append(output[0].detach()))
    with torch.inference_mode():
        model(torch.rand(2, 4, 12))
    assert len(cache) == 1
    handle.remove()


def _encoder_fastpath_pairs(d_model):
    """PyTorch's (input, padding) pairs, the long ones (softmax.cu's 1024 switch) cut for 2 CPU cores."""
    pairs = [((3, 2), [[0, 1], [0, 1], [1, 1]]), ((2, 100), [[0] * 98 + [1] * 2, [0] * 90 + [1] * 10])]
    if d_model == 12:
        pairs += [((2, 1024), [[0] * 1020 + [1] * 4, [0] * 1024]), ((1, 1026), [[0] * 1024 + [1] * 2])]
    return [(torch.rand(*shape, d_model), torch.tensor(mask, dtype=torch.bool)) for shape, mask in pairs]


@pytest.mark.parametrize("d_model", [12, 256])
@pytest.mark.parametrize("enable_nested_tensor", [True, False], ids=["nested", "dense"])
def test_transformerencoder_fastpath(enable_nested_tensor, d_model):
    """eval + no_grad (torch's fast path: nested tensors when enabled) equals eval with grad, and
    torch's encoder, on the unpadded positions."""
    torch.manual_seed(1234)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=d_model, nhead=4, dim_feedforward=d_model, batch_first=True),
        num_layers=2, enable_nested_tensor=enable_nested_tensor).eval()
    ours = _swapped(model)
    for x, pad in _encoder_fastpath_pairs(d_model):
        with torch.no_grad():
            fast = ours(x, src_key_padding_mask=pad)
            want = model(x, src_key_padding_mask=pad)
        slow = ours(x, src_key_padding_mask=pad)
        padded = pad.unsqueeze(-1)  # no guarantee on padded positions (torch: NaN when all are)

        def expand(out):  # nested outputs may be shorter than the input
            full = torch.zeros_like(x)
            full[:, :out.shape[1]] = out
            return full.masked_fill(padded, 0)
        torch.testing.assert_close(expand(fast), slow.detach().masked_fill(padded, 0))
        torch.testing.assert_close(expand(fast), expand(want))


def _cos_weights(model):
    """PyTorch's deterministic weights: cos(0, 1, 2, ...) in each parameter's shape."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.cos(torch.arange(p.numel(), dtype=p.dtype).view(p.shape)))
    return model


@pytest.mark.parametrize("with_no_grad", [True, False], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_transformerencoder_square_input(with_no_grad, training):
    """batch size == sequence length (2 x 2) with a bool src_mask (upstream compares with numbers
    from torch; here with torch itself)."""
    model = _cos_weights(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True),
        num_layers=2, enable_nested_tensor=False)).train(training)
    ours = _swapped(model)
    x = torch.arange(0, 16).reshape(2, 2, 4).float()
    src_mask = torch.tensor([[0, 1], [0, 0]]).bool()
    with torch.set_grad_enabled(not with_no_grad):
        torch.testing.assert_close(ours(x, mask=src_mask), model(x, mask=src_mask))


@pytest.mark.parametrize("enable_nested_tensor", [True, False], ids=["nested", "dense"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformerencoder(batch_first, training, enable_nested_tensor):
    """Deterministic encoders (cos weights; 1 layer, 2 with a final norm; no mask, an all-False
    src_mask, padding masks) in fp64, as upstream (which also runs 6 layers); the oracle is
    torch's model."""
    layer = _cos_weights(nn.TransformerEncoderLayer(4, 2, dim_feedforward=16, dropout=0.0, batch_first=batch_first,
                                                    dtype=torch.double))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 2, 4, generator=g, dtype=torch.double)
    x = x.transpose(0, 1) if batch_first else x
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = mask[1, 4] = True
    cm = torch.enable_grad() if training else torch.no_grad()  # the fast path needs no grad
    with cm:
        for layers, norm in ((1, None), (2, nn.LayerNorm(4, dtype=torch.double))):
            model = nn.TransformerEncoder(layer, layers, norm=norm, enable_nested_tensor=enable_nested_tensor)
            model.train(training)
            ours = _swapped(model)
            for kw in (dict(), dict(mask=torch.zeros(5, 5, dtype=torch.bool)),
                       dict(src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), dict(src_key_padding_mask=mask)):
                got, want = ours(x, **kw), model(x, **kw)
                if got.shape != want.shape:  # a nested fast path may drop trailing padding
                    assert kw.get("src_key_padding_mask") is not None
                torch.testing.assert_close(got[..., :want.shape[-2], :] if batch_first else got, want)


def test_encoder_padding_and_src_mask_bool(caplog):
    torch.manual_seed(0)
    encoder = _swapped(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True),
        2, nn.LayerNorm(16)))
    src_mask = torch.ones(3, 3, dtype=torch.bool).triu_(diagonal=1)
    padding_mask = torch.arange(3)[None, :] >= torch.tensor([3, 2])[:, None]
    with caplog.at_level(logging.DEBUG):
        encoder(torch.randn(2, 3, 16), mask=src_mask, src_key_padding_mask=padding_mask)
    assert not caplog.records


def test_decoder_padding_and_src_mask_bool(caplog):
    torch.manual_seed(0)
    decoder = _swapped(nn.TransformerDecoder(
        nn.TransformerDecoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True),
        2, nn.LayerNorm(16)))
    inputs, memory = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    src_mask = torch.ones(3, 3, dtype=torch.bool).triu_(diagonal=1)
    padding_mask = torch.arange(3)[None, :] >= torch.tensor([3, 2])[:, None]
    with caplog.at_level(logging.DEBUG):
        decoder(inputs, memory, tgt_mask=src_mask, tgt_key_padding_mask=padding_mask,
                memory_key_padding_mask=padding_mask)
    assert not caplog.records


def test_encoder_is_causal():
    torch.manual_seed(0)
    layer = _swapped(nn.TransformerEncoderLayer(3, 1, 6, batch_first=True)).eval()
    x = torch.randn(1, 5, 3)
    mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
    torch.testing.assert_close(layer(x, src_mask=mask, is_causal=True), layer(x, src_mask=mask))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("nb_heads", [1, 8])
def test_mha_native_args(nb_heads, bias):
    """(CUDA-only upstream) eval + no_grad self-attention, with a padding mask when bias=True."""
    ref, ours = _twins(128, nb_heads, batch_first=True, bias=bias)
    ref.eval(), ours.eval()
    x = torch.randn(8, 100, 128)
    pad_mask = torch.zeros(8, 100, dtype=torch.bool) if bias else None
    with torch.no_grad():
        torch.testing.assert_close(ours(x, x, x, key_padding_mask=pad_mask)[0],
                                   ref(x, x, x, key_padding_mask=pad_mask)[0])


def test_kpm_mask_trailing_column_with_nested_tensor():
    torch.manual_seed(0)
    encoder = _swapped(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=512, activation="gelu"),
        num_layers=3, enable_nested_tensor=True))
    mask = torch.ones(6, 10)
    mask[0, :] = 0
    out = encoder(src=torch.randn(10, 6, 256), src_key_padding_mask=mask.bool())
    assert out.shape[1] == 6


def test_with_nested_tensor_input():
    """(CUDA-only upstream) a NestedTensor input through the encoder stays nested; equal to torch's."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, activation="gelu", batch_first=True),
        num_layers=3, enable_nested_tensor=True).eval()
    ours = _swapped(model)
    mask = torch.ones(6, 10)
    mask[0, 0:] = 0
    mask[2, 2:] = 0
    mask[4, 4:] = 0
    mask[5, 8:] = 0
    with torch.no_grad():
        x = torch._nested_tensor_from_mask(torch.randn(6, 10, 32), mask.bool(), mask_check=False)
        out, want = ours(src=x, src_key_padding_mask=None), model(src=x, src_key_padding_mask=None)
    assert out.is_nested
    for a, b in zip(out.unbind(), want.unbind()):
        torch.testing.assert_close(a, b)


def test_bias_is_none():
    _, ours = _twins(10, 1, bias=False, batch_first=True)
    x = torch.rand(1, 5, 10)
    ours.eval()(x, x, x)


def test_transformer_bias_is_none():
    encoder_layer = _swapped(nn.TransformerEncoderLayer(8, 4, bias=False, batch_first=True)).eval()
    x = torch.randn(2, 3, 8)
    encoder_layer(x)
    with pytest.warns(UserWarning, match="encoder_layer.self_attn was passed bias=False"):
        nn.TransformerEncoder(encoder_layer, num_layers=1).eval()(x)
    with pytest.warns(UserWarning, match="self_attn was passed bias=False"):
        transformer = nn.Transformer(d_model=8, nhead=4, bias=False, batch_first=True)
        _swapped(transformer).eval()(x, x)


def test_train_with_is_causal():
    """Training an encoder with a causal mask and is_causal=True; is_causal without attn_mask
    raises RuntimeError; and is_causal_kernels: all-ones weights give exactly 16."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=2, dim_feedforward=4, nhead=1, batch_first=True, activation="gelu",
                                       dropout=0)
    encoder = _swapped(nn.TransformerEncoder(layer, 2)).train()
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1, momentum=0.9)
    inputs = torch.randn(1, 2, 2)
    mask = nn.Transformer.generate_square_subsequent_mask(inputs.size(1))
    outputs = encoder(inputs, mask=mask, is_causal=True)
    nn.MSELoss()(outputs[:, 0:2, :], inputs[:, 0:2, :]).backward()
    optimizer.step()

    S, L, E, H = 1, 2, 2, 1
    t_qvk = torch.randn(S, L, E)
    mha = ann.MultiheadAttention(E, H)
    mha(t_qvk, t_qvk, t_qvk, attn_mask=nn.Transformer.generate_square_subsequent_mask(S), is_causal=True)
    with pytest.raises(RuntimeError):
        mha(t_qvk, t_qvk, t_qvk, is_causal=True)

    E = 4  # is_causal_kernels([SDPBackend.MATH])
    qkv = torch.ones(S, L, E)
    mha = ann.MultiheadAttention(E, H)
    mha.in_proj_weight = Parameter(torch.ones(E * 3, E))
    mha.out_proj.weight = Parameter(torch.ones(E, E))
    # (S, L, E) seq-first is L = 1 query of a batch of 2: torch drops the (2, 2) mask for the hint
    mask = nn.Transformer.generate_square_subsequent_mask(qkv.size(1))
    actual, _ = mha(qkv, qkv, qkv, attn_mask=mask, need_weights=False, is_causal=True)
    assert torch.equal(actual, torch.ones(S, L, E) * 16)


def test_fused_fast_paths_route_through_attnkit(monkeypatch):
    """In place of test_disable_fastpath / test_mask_check_fastpath /
    test_multihead_self_attn_two_masks_fast_path_mock (which assert that torch's fused kernels run):
    where torch would take them (eval, no grad, batch_first, masks), attnkit's module never does,
    whatever torch.backends.mha says; every attention goes through attnkit.attention."""
    calls = []
    real = ann.attention
    monkeypatch.setattr(ann, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    inp = torch.tensor([[[1.0, 2], [3, 4], [5, 6]]])
    kpm = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    attn_mask = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    te = _swapped(nn.TransformerEncoder(nn.TransformerEncoderLayer(2, 2, 8, batch_first=True), 2,
                                        enable_nested_tensor=True, mask_check=True)).eval()
    _, mha = _twins(2, 2, batch_first=True)
    mha.eval()
    with mock.patch("torch._transformer_encoder_layer_fwd") as layer_fwd, \
            mock.patch("torch._native_multi_head_attention") as native_mha, torch.no_grad():
        for enabled in (True, False):
            torch.backends.mha.set_fastpath_enabled(enabled)
            try:
                te(inp, src_key_padding_mask=torch.tensor([[0, 0, 1]], dtype=torch.bool))
                te(inp, src_key_padding_mask=kpm, mask=attn_mask)
                mha(inp, inp, inp)
                mha(inp, inp, inp, attn_mask=attn_mask, key_padding_mask=kpm)
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
    assert not layer_fwd.called and not native_mha.called
    assert len(calls) == 2 * (2 * 2 + 2)
