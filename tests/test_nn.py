"""attnkit.nn.MultiheadAttention against torch.nn.MultiheadAttention over the whole option grid,
inside nn.TransformerEncoderLayer / nn.Transformer, and the swap helper.

Tolerance: rule R with gold = torch's own module in fp64 (same weights), base = torch's module
in fp32, ours = attnkit's in fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import attnkit
import attnkit.nn as ann
from conftest import rule_r

E, H = 8, 2


def _pair(seed=0, **kw):
    """(torch module, attnkit module, torch fp64 gold module) with identical weights, eval mode."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kw).eval()
    torch.manual_seed(seed)
    ours = ann.MultiheadAttention(E, H, **kw).eval()
    gold = copy.deepcopy(ref).double()
    return ref, ours, gold


def _torch_polarity_mask(kind: str, shape, g: torch.Generator) -> torch.Tensor:
    """A random torch-style mask: bool True = not allowed, float = added (-inf = not allowed).
    Key 0 always stays allowed, so no query row is fully masked (torch gives NaN there)."""
    blocked = torch.rand(shape, generator=g) < 0.35
    blocked[..., 0] = False
    if kind == "bool":
        return blocked
    vals = torch.randn(shape, generator=g, dtype=torch.float64)
    return vals.masked_fill(blocked, float("-inf"))


def _run_all(ref, ours, gold, args, kwargs):
    """Call the three modules; float masks follow each module's dtype."""
    def cast(x, dt):
        return x.to(dt) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x
    want = ref(*[cast(a, torch.float32) for a in args], **{k: cast(v, torch.float32) for k, v in kwargs.items()})
    got = ours(*[cast(a, torch.float32) for a in args], **{k: cast(v, torch.float32) for k, v in kwargs.items()})
    g64 = gold(*[cast(a, torch.float64) for a in args], **{k: cast(v, torch.float64) for k, v in kwargs.items()})
    return want, got, g64


@settings(max_examples=150, deadline=None)
@given(batch_first=st.booleans(), kvdim=st.sampled_from([None, (5, 7)]), bias=st.booleans(),
       add_bias_kv=st.booleans(), add_zero_attn=st.booleans(),
       attn_mask=st.sampled_from([None, "2d-bool", "2d-float", "3d-bool", "3d-float"]),
       kpm=st.sampled_from([None, "bool", "float"]), need_weights=st.booleans(), average=st.booleans(),
       is_causal=st.booleans(), unbatched=st.booleans(), self_attn=st.booleans(),
       sizes=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6)), seed=st.integers(0, 2**16))
def test_grid_matches_torch(batch_first, kvdim, bias, add_bias_kv, add_zero_attn, attn_mask, kpm, need_weights,
                            average, is_causal, unbatched, self_attn, sizes, seed):
    N, L, S = sizes
    kdim, vdim = kvdim or (None, None)
    if self_attn:
        kdim = vdim = None
    if self_attn or is_causal:  # the causal hint describes a square (L, L) attn_mask
        S = L
    ref, ours, gold = _pair(seed, batch_first=batch_first, bias=bias, add_bias_kv=add_bias_kv,
                            add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim)
    g = torch.Generator().manual_seed(seed)

    def seq(n, d):
        shape = (n, d) if unbatched else ((N, n, d) if batch_first else (n, N, d))
        return torch.randn(shape, generator=g, dtype=torch.float64)

    q = seq(L, E)
    args = (q, q, q) if self_attn else (q, seq(S, kdim or E), seq(S, vdim or E))
    kwargs = dict(need_weights=need_weights, average_attn_weights=average, is_causal=is_causal)
    if is_causal:  # torch needs the causal attn_mask along with the hint
        kind = (attn_mask or "2d-bool").split("-")[1]
        blocked = torch.ones(L, S, dtype=torch.bool).triu(1)
        kwargs["attn_mask"] = blocked if kind == "bool" else \
            torch.zeros(L, S, dtype=torch.float64).masked_fill(blocked, float("-inf"))
    elif attn_mask is not None:
        dims, kind = attn_mask.split("-")
        shape = (L, S) if dims == "2d" else ((H, L, S) if unbatched else (N * H, L, S))
        kwargs["attn_mask"] = _torch_polarity_mask(kind, shape, g)
    if kpm is not None:
        kwargs["key_padding_mask"] = _torch_polarity_mask(kpm, (S,) if unbatched else (N, S), g)
    with torch.no_grad():
        (w_out, w_w), (o_out, o_w), (g_out, g_w) = _run_all(ref, ours, gold, args, kwargs)
    rule_r(o_out, w_out, g_out, n_terms=max(S, E), what="out")
    if need_weights:
        assert o_w is not None and o_w.shape == w_w.shape and o_w.dtype == w_w.dtype
        rule_r(o_w, w_w, g_w, n_terms=max(S, E), what="weights")
    else:
        assert o_w is None and w_w is None


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kvdim", [None, (5, 7)], ids=["same_dim", "kdim_vdim"])
def test_gradients_match_torch(batch_first, kvdim):
    kdim, vdim = kvdim or (None, None)
    ref, ours, gold = _pair(3, batch_first=batch_first, kdim=kdim, vdim=vdim, add_bias_kv=True)
    for m in (ref, ours, gold):
        m.train()  # dropout 0: deterministic
    N, L, S = 2, 4, 5
    g = torch.Generator().manual_seed(1)
    shape = (lambda n, d: (N, n, d)) if batch_first else (lambda n, d: (n, N, d))
    q = torch.randn(shape(L, E), generator=g, dtype=torch.float64)
    k = torch.randn(shape(S, kdim or E), generator=g, dtype=torch.float64)
    v = torch.randn(shape(S, vdim or E), generator=g, dtype=torch.float64)
    kpm = torch.tensor([[False] * S, [False] * 3 + [True] * 2])
    dout = torch.randn(shape(L, E), generator=g, dtype=torch.float64)
    for m, dt in ((ref, torch.float32), (ours, torch.float32), (gold, torch.float64)):
        out, _ = m(q.to(dt), k.to(dt), v.to(dt), key_padding_mask=kpm, need_weights=False)
        out.backward(dout.to(dt))
    for (name, p_ours), p_ref, p_gold in zip(ours.named_parameters(), ref.parameters(), gold.parameters()):
        rule_r(p_ours.grad, p_ref.grad, p_gold.grad, factor=3.0, what=f"grad {name}", n_terms=N * max(L, S) * E)


def test_same_constructor_names_and_init_as_torch():
    for kw in (dict(), dict(bias=False), dict(kdim=5, vdim=7), dict(add_bias_kv=True, add_zero_attn=True)):
        torch.manual_seed(0)
        ref = nn.MultiheadAttention(E, H, **kw)
        torch.manual_seed(0)
        ours = ann.MultiheadAttention(E, H, **kw)
        assert isinstance(ours, nn.MultiheadAttention)
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
        ours.load_state_dict(nn.MultiheadAttention(E, H, **kw).state_dict(), strict=True)
    m = ann.MultiheadAttention(E, H, device="cpu", dtype=torch.float64)
    assert m.in_proj_weight.dtype == torch.float64 and m.out_proj.weight.dtype == torch.float64


def test_fully_masked_row_gives_zero_not_nan():
    ref, ours, _ = _pair(0, batch_first=True)
    x = torch.randn(2, 3, E)
    kpm = torch.tensor([[True, True, True], [False, False, True]])  # sequence 0: every key is padding
    with torch.no_grad():
        want, _ = ref(x, x, x, key_padding_mask=kpm)
        got, w = ours(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    assert torch.isnan(want[0]).all()  # torch's behaviour, the one deliberate difference
    expected_row = ours.out_proj.bias.expand(3, E)  # attention output 0, then the output projection's bias
    assert torch.equal(got[0], expected_row) and torch.equal(w[0], torch.zeros(H, 3, 3))
    torch.testing.assert_close(got[1], want[1])


def test_is_causal_is_a_hint_as_in_torch():
    """torch.nn.functional.multi_head_attention_forward's rule: with is_causal=True and neither a
    key padding mask nor weights, the top-left causal mask replaces attn_mask; otherwise attn_mask
    is used. (torch's fused inference fast path, taken under no_grad, ignores the hint and always
    uses attn_mask, so torch itself disagrees with itself on a wrong hint; the reference here runs
    with grad enabled, the path the functional form documents.)"""
    ref, ours, _ = _pair(0, batch_first=True)
    x = torch.randn(2, 4, E)
    not_causal = torch.zeros(4, 4, dtype=torch.bool)
    not_causal[0, 1] = True
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    for kw, used in ((dict(need_weights=False), causal), (dict(need_weights=True), not_causal),
                     (dict(need_weights=False, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), not_causal)):
        want, _ = ref(x, x, x, attn_mask=not_causal, is_causal=True, **kw)
        got, _ = ours(x, x, x, attn_mask=not_causal, is_causal=True, **kw)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, ours(x, x, x, attn_mask=used, **kw)[0])
    with pytest.raises(ValueError, match="is_causal=True needs attn_mask"):
        ours(x, x, x, is_causal=True)


def _count_attention_calls(monkeypatch):
    calls = []
    real = ann.attention

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(ann, "attention", counting)
    return calls


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_encoder_layer_by_assignment(train, monkeypatch):
    """Assigned into TransformerEncoderLayer, the module is called (torch's fused eval fast path
    is skipped) and the layer's outputs equal torch's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    layer.train(train)
    twin = copy.deepcopy(layer)
    twin.self_attn = ann.MultiheadAttention.from_torch(twin.self_attn)
    calls = _count_attention_calls(monkeypatch)
    x = torch.randn(2, 5, E)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        torch.testing.assert_close(twin(x, src_key_padding_mask=kpm), layer(x, src_key_padding_mask=kpm))
    assert len(calls) == 1


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_transformer_end_to_end_with_swap_helper(train, monkeypatch):
    torch.manual_seed(0)
    model = nn.Transformer(d_model=E, nhead=H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                           dropout=0.0, batch_first=True)
    model.train(train)
    ref = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}
    assert ann.replace_multihead_attention(model) is model
    swapped = [m for m in model.modules() if isinstance(m, ann.MultiheadAttention)]
    assert len(swapped) == 2 + 2 * 2 and not any(type(m) is nn.MultiheadAttention for m in model.modules())
    assert {id(p) for p in model.parameters()} == params_before  # the same Parameter objects
    calls = _count_attention_calls(monkeypatch)
    src, tgt = torch.randn(2, 6, E), torch.randn(2, 4, E)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(4)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    kw = dict(tgt_mask=tgt_mask, tgt_is_causal=True, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    out = model(src, tgt, **kw)
    want = ref(src, tgt, **kw)
    torch.testing.assert_close(out, want)
    assert len(calls) == 6
    if train:
        out.square().sum().backward()
        want.square().sum().backward()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    with torch.no_grad():  # eval + no grad + padding: TransformerEncoder's nested-tensor path
        model.eval(), ref.eval()
        torch.testing.assert_close(model(src, tgt, **kw), ref(src, tgt, **kw))


def test_nested_tensor_input_from_encoder_fast_path():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True), 2).eval()
    ours = ann.replace_multihead_attention(copy.deepcopy(enc))
    x = torch.randn(3, 5, E)
    kpm = torch.tensor([[False] * 5, [False] * 2 + [True] * 3, [False] * 4 + [True]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=kpm), enc(x, src_key_padding_mask=kpm))


def test_unbatched_and_dtypes():
    ref, ours, _ = _pair(0)
    x = torch.randn(4, E)
    with torch.no_grad():
        (a, wa), (b, wb) = ref(x, x, x), ours(x, x, x)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(wb, wa)
    ours64 = copy.deepcopy(ours).double()
    out, w = ours64(x.double(), x.double(), x.double())
    assert out.dtype == torch.float64 and w.dtype == torch.float64


@pytest.mark.parametrize("call,match", [
    (lambda m, x: m(x[0], x, x), r"query, key and value must all be 2-D: query \(3, 8\), key \(2, 3, 8\)"),
    (lambda m, x: m(torch.randn(2, 3, 2, E), x, x), r"query must be \(L, E\)"),
    (lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.bool)), r"2-D attn_mask must be \(L, S\) = \(3, 3\), got shape \(3, 4\)"),
    (lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3, 3, dtype=torch.bool)), r"3-D attn_mask .* = \(4, 3, 3\), got shape \(3, 3, 3\)"),
    (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(3, 2, dtype=torch.bool)), r"key_padding_mask must be \(N, S\) = \(2, 3\)"),
    (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.long)), r"key_padding_mask must be bool"),
    (lambda m, x: m(torch.randn(2, 3, E + 1), x, x), r"query has 9 channels but embed_dim is 8"),
    (lambda m, x: m(x, torch.randn(2, 5, E), x), r"disagree on source length or batch"),
], ids=["dims", "4d", "attn2d", "attn3d", "kpm_shape", "kpm_dtype", "embed", "source"])
def test_bad_input_names_argument_and_shapes(call, match):
    m = ann.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 3, E)
    with pytest.raises((ValueError, TypeError), match=match):
        call(m, x)


def test_replace_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ann.replace_multihead_attention("model")
    with pytest.raises(TypeError, match="from_torch"):
        ann.replace_multihead_attention(nn.MultiheadAttention(E, H))


def test_public_names():
    assert attnkit.nn.MultiheadAttention is ann.MultiheadAttention


def test_copies_and_clones_keep_routing_through_attnkit(monkeypatch):
    """nn.TransformerEncoder deep-copies its layer; the copies still call attnkit."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    layer.self_attn = ann.MultiheadAttention.from_torch(layer.self_attn)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    assert all(isinstance(lyr.self_attn, ann.MultiheadAttention) for lyr in enc.layers)
    calls = _count_attention_calls(monkeypatch)
    with torch.no_grad():
        enc(torch.randn(2, 3, E))
    assert len(calls) == 2
    again = copy.deepcopy(enc)
    assert isinstance(again.layers[0].self_attn, ann.MultiheadAttention)
    with torch.no_grad():
        again(torch.randn(2, 3, E))
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_rule_r(dtype):
    ref, ours, gold = _pair(5, batch_first=True)
    ref, ours = ref.to(dtype), ours.to(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, E, generator=g, dtype=torch.float64)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    am = torch.randn(9, 9, generator=g, dtype=torch.float64)
    with torch.no_grad():
        outs = [m(x.to(dt), x.to(dt), x.to(dt), key_padding_mask=kpm, attn_mask=am.to(dt), need_weights=False)[0]
                for m, dt in ((ours, dtype), (ref, dtype), (gold, torch.float64))]
    rule_r(*outs, n_terms=max(9, E))


# --------------------------------------------------------------------------- torch's bad-input contract


def test_compile_fullgraph_encoder_with_padding_mask():
    """torch.compile(fullgraph=True) of nn.TransformerEncoder with attnkit's module and a bool
    src_key_padding_mask (the encoder hands its layers a float one): no graph break (Additive's
    NaN check reads tensor values, so it runs in eager only), same output as torch's encoder. The
    case of PyTorch's test_fast_path_check_with_mask_does_not_break_in_compile."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True, dtype=torch.float64)
    enc = nn.TransformerEncoder(layer, 2).eval()
    ours = ann.replace_multihead_attention(copy.deepcopy(enc))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, 0], pad[1, 5:] = True, True  # not left-aligned, and a plain trailing pad
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask=None, src_key_padding_mask=pad), enc(x, src_key_padding_mask=pad))


def test_compile_fullgraph_float_masks_with_sentinel_and_nan_rows():
    """The float-mask path (torch's rounding of huge finite values, NaN rows) has no branch on
    values either: compiled equals eager, NaN rows included."""
    torch.manual_seed(0)
    ours = ann.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 4, E)
    am = torch.randn(4, 4)
    am[1], am[2, 0] = -1e30, float("nan")
    kpm = torch.zeros(2, 4)
    kpm[1, 3] = float("-inf")

    def f(x):
        return ours(x, x, x, attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)
    (o1, w1), (o2, w2) = f(x), torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(o2, o1, equal_nan=True)
    torch.testing.assert_close(w2, w1, equal_nan=True)


def test_additive_mask_still_rejects_nan_in_eager():
    with pytest.raises(ValueError, match="NaN"):
        attnkit.masks.Additive(torch.tensor([0.0, float("nan")]))


_BAD = {  # name: call on (module E=8, H=2, seq-first) -> what torch raises, checked against torch itself
    "query_4d": lambda m: m(torch.randn(1, 3, 2, E), torch.randn(3, 2, E), torch.randn(3, 2, E)),
    "key_2d": lambda m: m(torch.randn(3, 2, E), torch.randn(3, E), torch.randn(3, 2, E)),
    "value_3d_unbatched": lambda m: m(torch.randn(3, E), torch.randn(3, E), torch.randn(3, 2, E)),
    "kpm_1d_batched": lambda m: m(*[torch.randn(3, 2, E)] * 3, key_padding_mask=torch.zeros(3, dtype=torch.bool)),
    "kpm_2d_unbatched": lambda m: m(*[torch.randn(3, E)] * 3, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool)),
    "kpm_shape": lambda m: m(*[torch.randn(3, 2, E)] * 3, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
    "kpm_batch_shape": lambda m: m(*[torch.randn(3, 2, E)] * 3, key_padding_mask=torch.zeros(3, 3, dtype=torch.bool)),
    "kpm_shape_unbatched": lambda m: m(*[torch.randn(3, E)] * 3, key_padding_mask=torch.zeros(4, dtype=torch.bool)),
    "attn_mask_2d_shape_unbatched": lambda m: m(*[torch.randn(3, E)] * 3, attn_mask=torch.zeros(3, 4)),
    "kpm_dtype": lambda m: m(*[torch.randn(3, 2, E)] * 3, key_padding_mask=torch.zeros(2, 3, dtype=torch.long)),
    "attn_mask_dtype": lambda m: m(*[torch.randn(3, 2, E)] * 3, attn_mask=torch.zeros(3, 3, dtype=torch.uint8)),
    "attn_mask_1d": lambda m: m(*[torch.randn(3, 2, E)] * 3, attn_mask=torch.zeros(3, dtype=torch.bool)),
    "attn_mask_2d_shape": lambda m: m(*[torch.randn(3, 2, E)] * 3, attn_mask=torch.zeros(3, 4, dtype=torch.bool)),
    "attn_mask_3d_shape": lambda m: m(*[torch.randn(3, 2, E)] * 3, attn_mask=torch.zeros(3, 3, 3, dtype=torch.bool)),
    "attn_mask_3d_unbatched": lambda m: m(*[torch.randn(3, E)] * 3, attn_mask=torch.zeros(5, 3, 3, dtype=torch.bool)),
    "embed_dim": lambda m: m(torch.randn(3, 2, E + 1), torch.randn(3, 2, E), torch.randn(3, 2, E)),
    "key_value_length": lambda m: m(torch.randn(3, 2, E), torch.randn(4, 2, E), torch.randn(3, 2, E)),
    "query_key_batch": lambda m: m(torch.randn(3, 2, E), torch.randn(3, 1, E), torch.randn(3, 1, E)),
    "key_channels": lambda m: m(torch.randn(3, 2, E), torch.randn(3, 2, E + 1), torch.randn(3, 2, E + 1)),
    "is_causal_without_mask": lambda m: m(*[torch.randn(3, 2, E)] * 3, is_causal=True),
}


#: Where torch's error comes from inside its computation (a reshape, a matrix product) rather than
#: a check of its own, so its text describes that operation, not the argument: attnkit's message
#: names the argument instead.
_TORCH_MESSAGE_INCIDENTAL = {"query_key_batch", "key_channels"}


@pytest.mark.parametrize("name", list(_BAD))
def test_bad_input_raises_what_torch_raises(name):
    """Code written against torch catches AssertionError (or RuntimeError where torch raises that)
    and matches torch's message: attnkit's error is an instance of torch's exception type and of
    ValueError / TypeError, its message contains torch's, and it names the shapes."""
    with pytest.raises(Exception) as want:
        _BAD[name](nn.MultiheadAttention(E, H))
    with pytest.raises(type(want.value)) as got:
        _BAD[name](ann.MultiheadAttention(E, H))
    assert isinstance(got.value, (ValueError, TypeError)), type(got.value).__mro__
    assert type(want.value) in (AssertionError, RuntimeError)
    if name not in _TORCH_MESSAGE_INCIDENTAL:
        assert str(want.value) in str(got.value)
    if "shape" in name or name in ("embed_dim", "key_value_length", "query_key_batch"):
        assert "(" in str(got.value)  # names the shapes


_BAD_CONFIGURED = {  # name: (module options, call) for errors that depend on the module's configuration
    "kpm_shape_bias_kv": (dict(add_bias_kv=True), lambda m: m(*[torch.randn(3, 2, E)] * 3,
                                                             key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))),
    "kpm_shape_zero_attn": (dict(add_bias_kv=True, add_zero_attn=True),
                            lambda m: m(*[torch.randn(3, 2, E)] * 3, key_padding_mask=torch.zeros(2, 5))),
    "separate_key_value_length": (dict(kdim=5, vdim=7),
                                  lambda m: m(torch.randn(3, 2, E), torch.randn(4, 2, 5), torch.randn(3, 2, 7))),
    "nested_query_and_key_differ": (dict(batch_first=True), lambda m: m(*_nested(3))),
    "nested_1d": (dict(batch_first=True), lambda m: m(*[torch.nested.nested_tensor([])] * 3)),
}


def _nested(n):
    parts = [[torch.randn(4, E), torch.randn(6, E)] for _ in range(n)]
    return [torch.nested.nested_tensor(p, layout=torch.jagged) for p in parts]


@pytest.mark.parametrize("name", list(_BAD_CONFIGURED))
def test_bad_input_of_a_configured_module_matches_torchs_message(name):
    """Errors that depend on the module (extra keys from bias_k / zero attention counted in the
    key_padding_mask check, separate projections, NestedTensors) contain torch's message (for
    NestedTensors, torch's reason that its fast path was not taken)."""
    options, call = _BAD_CONFIGURED[name]
    with pytest.raises(AssertionError) as want:
        call(nn.MultiheadAttention(E, H, **options))
    with pytest.raises(AssertionError) as got:
        call(ann.MultiheadAttention(E, H, **options))
    assert isinstance(got.value, ValueError)
    assert str(want.value) in str(got.value)


def test_bad_input_separate_projections_raises_what_torch_raises():
    for k_ch, v_ch, S_k in ((6, 7, 3), (5, 6, 3), (5, 7, 4)):  # kdim, vdim, key vs value length
        args = (torch.randn(3, 2, E), torch.randn(S_k, 2, k_ch), torch.randn(3, 2, v_ch))
        with pytest.raises(AssertionError):
            nn.MultiheadAttention(E, H, kdim=5, vdim=7)(*args)
        with pytest.raises(ann.InputAssertionError, match=r"\(3, 2, \d\)"):
            ann.MultiheadAttention(E, H, kdim=5, vdim=7)(*args)
    assert issubclass(ann.InputAssertionError, ValueError) and issubclass(ann.InputAssertionError, AssertionError)
    assert issubclass(ann.InputRuntimeError, ValueError) and issubclass(ann.InputRuntimeError, RuntimeError)
    assert issubclass(ann.MaskDtypeError, TypeError) and issubclass(ann.MaskDtypeError, AssertionError)


def _torch_and_ours_with_grads(kw_module, args, kwargs):
    """Outputs, weights and input / parameter gradients of torch's and attnkit's module (same
    weights, float32, train mode with dropout 0) on the same inputs, loss = out.sum()."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kw_module)
    ours = ann.MultiheadAttention.from_torch(copy.deepcopy(ref))
    res = []
    for m in (ref, ours):
        xs = [a.clone().requires_grad_() for a in args]
        out, w = m(*xs, **kwargs)
        out.sum().backward()
        res.append((out, w, [x.grad for x in xs], {n: p.grad for n, p in m.named_parameters()}))
    return res


@pytest.mark.parametrize("value", [-1e30, torch.finfo(torch.float32).min, -1e12], ids=["-1e30", "finfo.min", "-1e12"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "sdpa"])
def test_finite_sentinel_row_gives_uniform_weights_like_torch(value, need_weights):
    """A float attn_mask row of a very negative finite value everywhere: torch adds it to the
    scores in fp32, the scores are rounded away and the weights come out uniform (softmax of equal
    values). A finite value is not "masked" (only -inf is), so attnkit gives the same; its
    forward equals torch's. In those rows torch's backward differentiates the sum its forward
    rounded away, and its two paths disagree there (need_weights=False, SDPA, gives another q
    gradient); attnkit's q gradient equals the baddbmm path's (need_weights=True), its k gradient
    gets nothing from those rows (see nn._as_torch_adds)."""
    g = torch.Generator().manual_seed(0)
    N, L, S = 2, 4, 5
    q, kv = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
    am = torch.randn(L, S, generator=g)
    am[1] = value  # the whole row
    am[2, 1:] = value  # a row with one ordinary key: that key takes all the weight, as in torch
    kpm = torch.zeros(N, S)
    kpm[1, 3:] = float("-inf")  # padding: the uniform row spreads over the other keys only
    kwargs = dict(attn_mask=am, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False)
    (o_ref, w_ref, g_ref, p_ref), (o, w, g_ours, p_ours) = _torch_and_ours_with_grads(
        dict(batch_first=True), (q, kv, kv), kwargs)
    torch.testing.assert_close(o, o_ref)
    if need_weights:
        torch.testing.assert_close(w, w_ref)
        torch.testing.assert_close(w[0, :, 1], torch.full((H, S), 1 / S))
        torch.testing.assert_close(w[1, :, 1], torch.tensor([1 / 3] * 3 + [0.0] * 2).expand(H, S))
        torch.testing.assert_close(g_ours[0], g_ref[0])  # dq
    for name in ("out_proj.weight", "out_proj.bias"):
        torch.testing.assert_close(p_ours[name], p_ref[name])
    # without rows whose every finite value is huge, every gradient matches
    am[1], am[2, 1:] = 0.0, 0.0
    (o_ref, _, g_ref, p_ref), (o, _, g_ours, p_ours) = _torch_and_ours_with_grads(
        dict(batch_first=True), (q, kv, kv), kwargs)
    torch.testing.assert_close(o, o_ref)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)
    for name in p_ref:
        torch.testing.assert_close(p_ours[name], p_ref[name], msg=name)


def test_finite_sentinel_key_padding_mask_like_torch():
    """finfo.min as the padding value of a float key_padding_mask (Hugging Face's convention): a
    sequence padded everywhere gets uniform weights, as in torch; the others are unchanged."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = ann.MultiheadAttention.from_torch(copy.deepcopy(ref))
    x = torch.randn(2, 3, E)
    kpm = torch.zeros(2, 3)
    kpm[0] = torch.finfo(torch.float32).min
    kpm[1, 2] = torch.finfo(torch.float32).min
    with torch.no_grad():
        (a, wa), (b, wb) = ref(x, x, x, key_padding_mask=kpm), ours(x, x, x, key_padding_mask=kpm)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(wb, wa)
    torch.testing.assert_close(wb[0], torch.full((3, 3), 1 / 3))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
@pytest.mark.parametrize("where", ["attn_mask", "key_padding_mask"])
def test_nan_or_posinf_in_float_mask_gives_nan_rows_like_torch(value, where):
    """NaN or +inf in a float mask: torch returns NaN in the rows it reaches (NaN in, NaN out,
    attnkit's contract too), not an error; the other rows are unchanged."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True)
    ours = ann.MultiheadAttention.from_torch(copy.deepcopy(ref))
    x = torch.randn(2, 4, E)
    am, kpm = torch.randn(4, 4), torch.zeros(2, 4)
    if where == "attn_mask":
        am[1, 2] = value  # query 1 of every sequence
    else:
        kpm[1, 0] = value  # every query of sequence 1
    for need_weights in (True, False):
        kw = dict(attn_mask=am, key_padding_mask=kpm, need_weights=need_weights)
        (a, wa), (b, wb) = ref(x, x, x, **kw), ours(x, x, x, **kw)
        assert torch.isnan(a).any() and torch.equal(torch.isnan(b), torch.isnan(a))
        torch.testing.assert_close(b, a, equal_nan=True)
        if need_weights:
            torch.testing.assert_close(wb, wa, equal_nan=True)
        b.nan_to_num().sum().backward()  # NaN rows give NaN gradients, not an error
