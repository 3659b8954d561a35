"""MultiHeadAttention: parity with torch.nn.MultiheadAttention (weights copied), caches through
the module, dropout in training only, Hugging Face parameter names, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit
from attnkit.caches import DynamicCache, StaticCache
from attnkit.modules import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention


def _torch_mha(batch_first, bias=True, kdim=None, vdim=None):
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim).eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_self_attention_with_masks_and_weights(batch_first, bias):
    ref = _torch_mha(batch_first, bias)
    ours = MultiHeadAttention.from_torch(ref).eval()
    B, S = 3, 7
    x = torch.randn(B, S, 16) if batch_first else torch.randn(S, B, 16)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 5:] = True  # padding
    attn_mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)  # torch: True = not allowed
    want, want_w = ref(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True,
                       average_attn_weights=False)
    got, got_w = ours(x, mask=~attn_mask, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)
    # The xformers-style call mha(x, x, x) is self-attention too.
    torch.testing.assert_close(ours(x, x, x, mask=~attn_mask, key_padding_mask=kpm), want)
    # A float attn_mask means the same thing in both.
    fmask = torch.randn(S, S)
    torch.testing.assert_close(ours(x, mask=fmask), ref(x, x, x, attn_mask=fmask, need_weights=False)[0])


def test_from_torch_cross_attention_with_own_widths():
    ref = _torch_mha(True, kdim=10, vdim=6)
    ours = MultiHeadAttention.from_torch(ref).eval()
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 9, 10), torch.randn(2, 9, 6)
    torch.testing.assert_close(ours(q, k, v), ref(q, k, v, need_weights=False)[0])


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_module_with_cache_equals_full_forward(cache_kind, kv_heads):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, causal=True).eval()
    x = torch.randn(2, 12, 32)
    full = m(x)
    cache = DynamicCache(kv_heads, 8) if cache_kind == "dynamic" else StaticCache(kv_heads, 8, max_batch=2, max_len=16)
    outs = [m(x[:, :5], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(5, 9)] + [m(x[:, 9:], cache=cache)]
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5


def test_presets_are_parameters_not_copies():
    g = GroupedQueryAttention(32, 8, 2)
    q = MultiQueryAttention(32, 8)
    assert type(g).forward is MultiHeadAttention.forward and type(q).forward is MultiHeadAttention.forward
    assert g.k_proj.out_features == 2 * 4 and q.k_proj.out_features == 4


def test_dropout_in_training_only():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    m.eval()
    a, b = m(x), m(x)
    assert torch.equal(a, b)
    m.train()
    torch.manual_seed(1)
    c = m(x)
    assert not torch.allclose(c, a)


def test_need_weights_rows_sum_to_one_and_padding_gets_none():
    m = MultiHeadAttention(16, 4, causal=True).eval()
    x = torch.randn(2, 5, 16)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    _, w = m(x, key_padding_mask=kpm, need_weights=True)
    assert w.shape == (2, 4, 5, 5) and w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5))
    assert (w[1, :, :, 3:] == 0).all()


def test_hf_llama_attention_state_dict_loads_strict():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                   attention_bias=False)
    hf = LlamaAttention(cfg, layer_idx=0)
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, causal=True)
    ours.load_state_dict(hf.state_dict(), strict=True)
    qwen = MultiHeadAttention(64, 8, num_kv_heads=2, bias=True, out_bias=False)
    assert set(qwen.state_dict()) == {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                      "v_proj.weight", "v_proj.bias", "o_proj.weight"}


@pytest.mark.parametrize("make,exc,text", [
    (lambda: MultiHeadAttention(30, 4), ValueError, r"embed_dim \(30\) must be divisible by num_heads \(4\)"),
    (lambda: MultiHeadAttention(32, 8, num_kv_heads=3), ValueError, r"num_heads \(8\) must be divisible by num_kv_heads \(3\)"),
    (lambda: MultiHeadAttention(32, 0), ValueError, "num_heads"),
    (lambda: MultiHeadAttention(32, 4, dropout=1.0), ValueError, "dropout"),
])
def test_bad_construction(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


@pytest.mark.parametrize("call,exc,text", [
    (lambda m: m(torch.randn(2, 5, 31)), ValueError, r"width 31 .*expected 32"),
    (lambda m: m(torch.randn(5, 32)), ValueError, "3-D"),
    (lambda m: m(torch.randn(2, 5, 32), torch.randn(2, 5, 32)), ValueError, "both key and value"),
    (lambda m: m(torch.randn(2, 5, 32), torch.randn(3, 4, 32), torch.randn(3, 4, 32)), ValueError, "batch"),
    (lambda m: m(torch.randn(2, 5, 32), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError, r"\(2, 5\)"),
    (lambda m: m(torch.randn(2, 5, 32), key_padding_mask=torch.zeros(2, 5, dtype=torch.long)), TypeError, "bool"),
    (lambda m: MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), cache=DynamicCache(4, 8)), ValueError, "causal"),
    (lambda m: m(torch.randn(3, 5, 32), cache=StaticCache(4, 8, max_batch=2, max_len=8)), ValueError, "max_batch=2"),
    (lambda m: m(torch.randn(2, 9, 32), cache=StaticCache(4, 8, max_batch=2, max_len=8)), ValueError, "max_len 8"),
])
def test_bad_forward_input(call, exc, text):
    m = MultiHeadAttention(32, 4, causal=True)
    with pytest.raises(exc, match=text):
        call(m)


@pytest.mark.slow
def test_static_cache_decode_step_compiles_once_fullgraph():
    import torch._dynamo
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=attnkit.RotaryEmbedding(8)).eval()
    cache = StaticCache(2, 8, max_batch=2, max_len=32)
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        full = m(x)
        outs = [m(x[:, :8], cache=cache)]  # eager prefill
        torch._dynamo.reset()
        step = torch.compile(lambda t: m(t, cache=cache), fullgraph=True)
        outs.append(step(x[:, 8:9]))
        with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile would raise
            outs += [step(x[:, i:i + 1]) for i in range(9, 16)]
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5
    assert cache.lengths.tolist() == [16, 16]


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_rope_positions_come_from_the_cache(cache_kind):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=attnkit.RotaryEmbedding(8)).eval()
    x = torch.randn(2, 10, 32)
    full = m(x)  # positions 0..9
    cache = DynamicCache(2, 8) if cache_kind == "dynamic" else StaticCache(2, 8, max_batch=2, max_len=10)
    outs = [m(x[:, :6], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(6, 10)]
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5


def test_left_padded_batch_with_cache_equals_each_sequence_alone():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=attnkit.RotaryEmbedding(8)).eval()
    lens, P, steps = [3, 6], 6, 3
    seqs = [torch.randn(1, n + steps, 32) for n in lens]
    # Left-padded prompts (Hugging Face style): padding first, positions count real tokens only.
    prompt = torch.cat([torch.cat([torch.full((1, P - n, 32), 1e3), s[:, :n]], 1) for s, n in zip(seqs, lens)])
    valid = torch.tensor([[j >= P - n for j in range(P)] for n in lens])
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(2, 8)
    with torch.no_grad():
        out = m(prompt, key_padding_mask=~valid, positions=pos, cache=cache)
        got = [[out[b:b + 1, P - n:]] for b, n in enumerate(lens)]
        for t in range(steps):
            x = torch.cat([s[:, n + t:n + t + 1] for s, n in zip(seqs, lens)])
            kpm = torch.cat([~valid, torch.zeros(2, t + 1, dtype=torch.bool)], 1)
            step_pos = torch.tensor([[n + t] for n in lens])
            o = m(x, key_padding_mask=kpm, positions=step_pos, cache=cache)
            for b in range(2):
                got[b].append(o[b:b + 1])
        for b, s in enumerate(seqs):
            assert (torch.cat(got[b], 1) - m(s)).abs().max() <= 1e-5


@pytest.mark.parametrize("kind,kw", [("dynamic", {}), ("static", {"max_batch": 2, "max_len": 12}),
                                     ("sliding", {"window": 64, "max_batch": 2}),
                                     ("paged", {"allocator": attnkit.BlockAllocator(8, 4)})])
def test_new_cache_fits_the_module(kind, kw):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 12, 32)
    cache = m.new_cache(kind, **kw)
    assert (cache.num_kv_heads, cache.head_dim, cache.dtype) == (2, 8, torch.float32)
    with torch.no_grad():
        out = torch.cat([m(x[:, :7], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(7, 12)], 1)
        assert (out - m(x)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="max_len"):
        m.new_cache("static", max_batch=2)
    with pytest.raises(ValueError, match="kind must be"):
        m.new_cache("paged-ish")
    with pytest.raises(ValueError, match="allocator"):
        m.new_cache("paged")


def test_key_padding_mask_of_the_wrong_length_with_a_cache_is_a_clear_error():
    m = MultiHeadAttention(32, 4, causal=True).eval()
    cache = DynamicCache(4, 8)
    m(torch.randn(2, 5, 32), cache=cache)
    with pytest.raises(ValueError, match=r"valid has shape \(2, 3\), expected \(2, 6\)"):
        m(torch.randn(2, 1, 32), cache=cache, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------- explicit fusion


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_fused_qkv_equals_separate_projections_and_loads_both_ways(kv_heads, bias):
    """fused_qkv=True holds one qkv_proj (Phi-3's name); state dicts convert both ways on load
    (strict=True), and the fused module computes what the separate one does."""
    torch.manual_seed(0)
    rope = attnkit.RotaryEmbedding(8, scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    sep = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, bias=bias, causal=True, rope=rope).eval()
    fused = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, bias=bias, causal=True, rope=rope, fused_qkv=True).eval()
    assert {n for n, _ in fused.named_parameters()} == {"qkv_proj.weight", "o_proj.weight"} | (
        {"qkv_proj.bias", "o_proj.bias"} if bias else set())
    fused.load_state_dict(sep.state_dict(), strict=True)  # q_proj / k_proj / v_proj -> qkv_proj
    assert set(fused.state_dict()) == {n for n, _ in fused.named_parameters()}  # its own names
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(fused(x), sep(x))
    torch.testing.assert_close(fused(x, x, x), sep(x))  # the xformers-style self-attention call
    back = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, bias=bias, causal=True, rope=rope).eval()
    back.load_state_dict(fused.state_dict(), strict=True)  # qkv_proj -> q_proj / k_proj / v_proj
    assert all(torch.equal(v, sep.state_dict()[k]) for k, v in back.state_dict().items())
    c1, c2 = DynamicCache(kv_heads, 8), DynamicCache(kv_heads, 8)
    for sl in (slice(0, 5), slice(5, 6), slice(6, 9)):
        torch.testing.assert_close(fused(x[:, sl], cache=c1), sep(x[:, sl], cache=c2))


def test_fused_qkv_bad_loads_and_arguments_are_named():
    sep = MultiHeadAttention(32, 4, num_kv_heads=2)
    fused = MultiHeadAttention(32, 4, num_kv_heads=2, fused_qkv=True)
    sd = sep.state_dict()
    sd["k_proj.weight"] = torch.zeros(8, 32)
    with pytest.raises(RuntimeError, match=r"fusing into qkv_proj.weight: k_proj.weight has 8 rows, expected 16"):
        fused.load_state_dict(sd)
    partial = {k: v for k, v in sep.state_dict().items() if not k.startswith("v_proj")}
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*qkv_proj.weight.*Unexpected key.*q_proj.weight"):
        fused.load_state_dict(partial)
    with pytest.raises(ValueError, match=r"kdim \(10\) and vdim \(32\) must equal embed_dim \(32\)"):
        MultiHeadAttention(32, 4, kdim=10, fused_qkv=True)
    with pytest.raises(ValueError, match="self-attention only"):
        fused(torch.randn(1, 3, 32), torch.randn(1, 4, 32), torch.randn(1, 4, 32))
    with pytest.raises(TypeError, match="rope must be an attnkit.RotaryEmbedding"):
        MultiHeadAttention(32, 4, rope=nn.Identity())
