"""The attention of today's open models as MultiHeadAttention parameters: sliding windows with
every cache, QK-norm per head and over the whole width, the query scale, and parity with
transformers' attention layers (weights loaded with strict=True): Mistral, Qwen3, Gemma 3 (local
and global layers), OLMo 2, Phi-3 (fused qkv_proj)."""

from __future__ import annotations

import pytest
import torch

from attnkit import RotaryEmbedding, masks
from attnkit.caches import BlockAllocator, DynamicCache, PagedKVCache, SlidingWindowCache, StaticCache
from attnkit.modules import MultiHeadAttention

transformers = pytest.importorskip("transformers")


def _chunks(total: int):
    return [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, total)]


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("kind", ["none", "dynamic", "static", "paged", "sliding"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_window_is_honoured_with_every_cache(window, kind, fused):
    """window=w equals the no-cache forward with SlidingWindow(w - 1) for chunked prefill and
    token-by-token decode through every cache; a sliding cache keeps only the window."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=RotaryEmbedding(8), window=window,
                           fused_qkv=fused).eval()
    ref = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=RotaryEmbedding(8), fused_qkv=fused).eval()
    ref.load_state_dict(m.state_dict())
    B, T = 2, 14
    x = torch.randn(B, T, 32)
    with torch.no_grad():
        want = ref(x, mask=masks.SlidingWindow(window - 1))
        assert torch.equal(m(x), want) or torch.allclose(m(x), want, atol=1e-6)
        if kind == "none":
            return
        cache = {"dynamic": lambda: m.new_cache("dynamic"),
                 "static": lambda: m.new_cache("static", max_batch=B, max_len=T),
                 "paged": lambda: PagedKVCache(2, 8, num_blocks=8, block_size=4),
                 "sliding": lambda: m.new_cache("sliding", max_batch=B)}[kind]()
        got = torch.cat([m(x[:, a:b], cache=cache) for a, b in _chunks(T)], 1)
    assert (got - want).abs().max() <= 1e-5
    if kind == "sliding":
        assert cache.window == window and cache.k_ring.shape[2] <= window + 1


def test_window_errors_are_named():
    m = MultiHeadAttention(32, 4, causal=True, window=4)
    with pytest.raises(ValueError, match=r"window of 4 tokens but the sliding cache keeps window=2"):
        m(torch.randn(1, 3, 32), cache=SlidingWindowCache(4, 8, window=2, max_batch=1))
    with pytest.raises(ValueError, match="window must be a positive int"):
        MultiHeadAttention(32, 4, causal=True, window=0)
    with pytest.raises(ValueError, match="needs causal=True"):
        MultiHeadAttention(32, 4, window=3)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        MultiHeadAttention(32, 4, scale=float("nan"))
    with pytest.raises(ValueError, match="qk_norm must be"):
        MultiHeadAttention(32, 4, qk_norm="rms")


@pytest.mark.parametrize("mode", ["head", "full"])
def test_qk_norm_normalises_before_rope(mode):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, qk_norm=mode, scale=0.3).eval()
    names = {n for n, _ in m.named_parameters()}
    assert {"q_norm.weight", "k_norm.weight"} <= names
    assert m.q_norm.weight.shape == ((8,) if mode == "head" else (32,)) and m.k_norm.weight.shape == (
        (8,) if mode == "head" else (16,))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        m.q_norm.weight.normal_()
        q = m.q_proj(x)
        q = (torch.nn.functional.rms_norm(q.unflatten(-1, (4, 8)), (8,), eps=1e-6) if mode == "head" else
             torch.nn.functional.rms_norm(q, (32,), eps=1e-6).unflatten(-1, (4, 8))) * \
            (m.q_norm.weight if mode == "head" else m.q_norm.weight.unflatten(-1, (4, 8)))
        k = m.k_proj(x)
        k = (torch.nn.functional.rms_norm(k.unflatten(-1, (2, 8)), (8,), eps=1e-6) if mode == "head" else
             torch.nn.functional.rms_norm(k, (16,), eps=1e-6).unflatten(-1, (2, 8))) * \
            (m.k_norm.weight if mode == "head" else m.k_norm.weight.unflatten(-1, (2, 8)))
        v = m.v_proj(x).unflatten(-1, (2, 8))
        k, v = (t.transpose(1, 2).repeat_interleave(2, 1) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=0.3)
        want = m.o_proj(o.transpose(1, 2).flatten(2))
        torch.testing.assert_close(m(x), want)
        fused = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, qk_norm=mode, scale=0.3, fused_qkv=True)
        fused.load_state_dict(m.state_dict(), strict=True)
        torch.testing.assert_close(fused(x), want)


# ---------------------------------------------------------------------------- transformers' layers


def _hf_run(hf, hf_rope, cfg, x, window, chunks=None):
    """HF attention over x, whole (chunks None) or chunk by chunk through its DynamicCache."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    make = create_sliding_window_causal_mask if window else create_causal_mask
    B, T, _ = x.shape
    cache = transformers.DynamicCache(config=cfg) if chunks else None
    outs = []
    for a, b in chunks or [(0, T)]:
        xs, ps = x[:, a:b], torch.arange(a, b)[None].expand(B, -1)
        m = make(config=cfg, inputs_embeds=xs, attention_mask=torch.ones(B, b, dtype=torch.long),
                 cache=cache, position_ids=ps)
        outs.append(hf(xs, position_embeddings=hf_rope(xs, ps), attention_mask=m, cache=cache)[0])
    return torch.cat(outs, 1)


def _check(hf, hf_rope, cfg, ours, window, caches):
    torch.manual_seed(1)
    x = torch.randn(2, 13, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), _hf_run(hf, hf_rope, cfg, x, window))
        want = _hf_run(hf, hf_rope, cfg, x, window, _chunks(13))
        for make in caches:
            cache = make(ours)
            got = torch.cat([ours(x[:, a:b], cache=cache) for a, b in _chunks(13)], 1)
            torch.testing.assert_close(got, want)


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.2) + ("norm" in name) * 1.0)


CACHES = [lambda m: m.new_cache("dynamic"), lambda m: m.new_cache("static", max_batch=2, max_len=16)]


@pytest.mark.parametrize("window", [None, 4])
def test_mistral_attention_with_window(window):
    from transformers.models.mistral.modeling_mistral import MistralAttention, MistralRotaryEmbedding
    cfg = transformers.MistralConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                     sliding_window=window, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    hf = MistralAttention(cfg, layer_idx=0).eval()
    _randomise(hf)
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, causal=True, rope=RotaryEmbedding.from_hf_config(cfg),
                              window=window, fused_qkv=True).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    extra = [lambda m: m.new_cache("sliding", max_batch=2)] if window else []
    _check(hf, MistralRotaryEmbedding(cfg), cfg, ours, window, CACHES + extra)


def test_qwen3_attention_per_head_qk_norm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
    cfg = transformers.Qwen3Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    hf = Qwen3Attention(cfg, layer_idx=0).eval()
    _randomise(hf)
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, head_dim=16, causal=True, rope=RotaryEmbedding.from_hf_config(cfg),
                              qk_norm=True, qk_norm_kw={"eps": 1e-6}).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    _check(hf, Qwen3RotaryEmbedding(cfg), cfg, ours, None, CACHES)


@pytest.mark.parametrize("layer", [0, 1], ids=["local-sliding", "global-full"])
def test_gemma3_attention_local_and_global(layer):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding
    cfg = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1000.0}})
    cfg._attn_implementation = "eager"
    hf = Gemma3Attention(cfg, layer_idx=layer).eval()
    _randomise(hf)
    kind = cfg.layer_types[layer]
    window = cfg.sliding_window if kind == "sliding_attention" else None
    ours = MultiHeadAttention(64, 4, num_kv_heads=2, head_dim=16, causal=True, fused_qkv=True,
                              rope=RotaryEmbedding.from_hf_config(cfg, layer_type=kind), scale=24 ** -0.5,
                              qk_norm=True, qk_norm_kw={"eps": cfg.rms_norm_eps, "unit_offset": True},
                              window=window).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    rope = Gemma3RotaryEmbedding(cfg)
    extra = [lambda m: m.new_cache("sliding", max_batch=2)] if window else []
    _check(hf, lambda x, p: rope(x, p, kind), cfg, ours, window, CACHES + extra)


def test_olmo2_attention_full_width_qk_norm():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RotaryEmbedding
    cfg = transformers.Olmo2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    hf = Olmo2Attention(cfg, layer_idx=0).eval()
    _randomise(hf)
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, causal=True, rope=RotaryEmbedding.from_hf_config(cfg),
                              qk_norm="full", qk_norm_kw={"eps": 1e-5, "scale_in_fp32": True}, fused_qkv=True).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    _check(hf, Olmo2RotaryEmbedding(cfg), cfg, ours, None, CACHES)


def test_phi3_attention_fused_qkv_partial_rotary():
    from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding
    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=64, original_max_position_embeddings=64,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})
    cfg._attn_implementation = "eager"
    hf = Phi3Attention(cfg, layer_idx=0).eval()
    _randomise(hf)
    rope = RotaryEmbedding.from_hf_config(cfg)
    assert rope.rotary_dim == 4
    for fused in (True, False):  # Phi-3's qkv_proj loads into either layout
        ours = MultiHeadAttention(64, 8, num_kv_heads=4, causal=True, rope=rope, fused_qkv=fused).eval()
        ours.load_state_dict(hf.state_dict(), strict=True)
        _check(hf, Phi3RotaryEmbedding(cfg), cfg, ours, None, CACHES)


def test_gemma2_attention_softcap():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
    cfg = transformers.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, num_hidden_layers=2)
    cfg._attn_implementation = "eager"
    for layer in (0, 1):
        hf = Gemma2Attention(cfg, layer_idx=layer).eval()
        _randomise(hf)
        window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
        ours = MultiHeadAttention(64, 4, num_kv_heads=2, head_dim=16, causal=True, fused_qkv=True,
                                  rope=RotaryEmbedding.from_hf_config(cfg), scale=24 ** -0.5, softcap=5.0,
                                  window=window).eval()
        ours.load_state_dict(hf.state_dict(), strict=True)
        _check(hf, Gemma2RotaryEmbedding(cfg), cfg, ours, window, CACHES)


@pytest.mark.parametrize("kind", ["none", "dynamic", "static"])
@pytest.mark.parametrize("mode", ["naive", "absorb"])
def test_mla_window_and_scale(mode, kind):
    """MultiHeadLatentAttention(window=, scale=) equals the windowed mask given by hand, through
    each latent cache and both paths."""
    from attnkit.modules import MLAConfig, MultiHeadLatentAttention
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    m = MultiHeadLatentAttention(cfg, mode=mode, window=3, scale=0.2).eval()
    ref = MultiHeadLatentAttention(cfg, mode=mode, scale=0.2).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = ref(x, mask=masks.SlidingWindow(2))
        torch.testing.assert_close(m(x), want)
        if kind != "none":
            cache = m.new_cache(kind, max_batch=2, max_len=12)
            got = torch.cat([m(x[:, a:b], cache=cache) for a, b in _chunks(12)], 1)
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------- sinks and ALiBi


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding-banded", "full"])
def test_gpt_oss_attention_sinks_and_banded_window(layer):
    """gpt-oss: learned per-head sinks (HF's name ``sinks``), biases, YaRN, a 4-token window on
    alternating layers; strict load, prefill and cached decode (the window evicts)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
    cfg = transformers.GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                    sliding_window=4, max_position_embeddings=64, num_hidden_layers=2,
                                    layer_types=["sliding_attention", "full_attention"],
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 16, "rope_theta": 1000.0})
    cfg._attn_implementation = "eager"
    hf = GptOssAttention(cfg, layer_idx=layer).eval()
    _randomise(hf)
    with torch.no_grad():
        hf.sinks.copy_(torch.linspace(-2.0, 3.0, 8))
    window = 4 if layer == 0 else None
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, head_dim=16, bias=True, causal=True, fused_qkv=True,
                              rope=RotaryEmbedding.from_hf_config(cfg), sinks=True, window=window).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert torch.equal(ours.sinks, hf.sinks)
    extra = [lambda m: m.new_cache("sliding", max_batch=2)] if window else []
    _check(hf, GptOssRotaryEmbedding(cfg), cfg, ours, window, CACHES + extra)


@pytest.mark.parametrize("heads", [8, 6], ids=["pow2-heads", "other-heads"])
def test_bloom_attention_alibi(heads):
    """BLOOM: ALiBi instead of RoPE, biases, its per-head fused query_key_value and dense names
    (strict load into either layout); prefill, and chunked prefill + cached decode through dynamic
    and static caches (ALiBi anchored at each row's offset) against transformers' full forward."""
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor
    cfg = transformers.BloomConfig(hidden_size=8 * heads, n_head=heads)
    cfg._attn_implementation = "eager"
    hf = BloomAttention(cfg, layer_idx=0).eval()
    _randomise(hf)
    E = cfg.hidden_size

    def hf_run(x, cache=None, past=0):
        B, S, _ = x.shape
        total = past + S
        alibi = build_alibi_tensor(torch.ones(B, total), heads, torch.float32)
        allowed = torch.arange(total)[None] <= (past + torch.arange(S))[:, None]
        mask = torch.zeros(S, total).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        return hf(x, torch.zeros_like(x), alibi, mask, layer_past=cache, use_cache=cache is not None)[0]

    torch.manual_seed(1)
    x = torch.randn(2, 11, E)
    for fused in (True, False):
        ours = MultiHeadAttention(E, heads, bias=True, causal=True, alibi=True, fused_qkv=fused).eval()
        ours.load_state_dict(hf.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), hf_run(x))
            for cache in (ours.new_cache("dynamic"), ours.new_cache("static", max_batch=2, max_len=11)):
                got = torch.cat([ours(x[:, a:b], cache=cache) for a, b in [(0, 5)] + [(t, t + 1) for t in range(5, 11)]], 1)
                torch.testing.assert_close(got, hf_run(x))


def test_mla_softcap_and_sinks_same_on_both_paths_and_through_caches():
    from attnkit.modules import MLAConfig, MultiHeadLatentAttention
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    naive = MultiHeadLatentAttention(cfg, mode="naive", softcap=2.0, sinks=True, window=5).eval()
    with torch.no_grad():
        naive.sinks.copy_(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    absorb = MultiHeadLatentAttention(cfg, mode="absorb", softcap=2.0, sinks=True, window=5).eval()
    absorb.load_state_dict(naive.state_dict(), strict=True)
    plain = MultiHeadLatentAttention(cfg, mode="naive").eval()
    plain.load_state_dict({k: v for k, v in naive.state_dict().items() if k != "sinks"}, strict=True)
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = naive(x)
        assert (want - plain(x)).abs().max() > 1e-3  # the options change the result
        torch.testing.assert_close(absorb(x), want)
        for m in (naive, absorb):
            cache = m.new_cache("dynamic")
            torch.testing.assert_close(torch.cat([m(x[:, a:b], cache=cache) for a, b in _chunks(12)], 1), want)
