"""Parity of MultiHeadLatentAttention with Hugging Face transformers' DeepseekV3Attention and
DeepseekV2Attention, weights copied, fp32: prefill with left padding and prefill + cached decode,
YaRN on and off, q_lora_rank set and None, interleaved and rotate-half RoPE, both paths."""

from __future__ import annotations

import pytest
import torch

from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (  # noqa: E402
    DeepseekV2Attention, DeepseekV2RotaryEmbedding)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3RotaryEmbedding, yarn_apply_mscale)

# YaRN as DeepSeek-V3 ships it, shrunk: factor 4 over 16 original positions, mscale != mscale_all_dim
# so cos/sin get a factor (attention_factor != 1) and the softmax scale its mscale**2.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
DIMS = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=6, v_head_dim=10, max_position_embeddings=64)

CASES = [pytest.param(q_lora, yarn, inter, id=f"q_lora={q_lora}-{'yarn' if yarn else 'rope'}-"
                      f"{'interleave' if inter else 'half'}")
         for q_lora in (16, None) for yarn in (True, False) for inter in (True, False)]


def _init(module, seed=0):
    """Weights of std 0.2 (not HF's 0.02 or ones): attention that is far from uniform, norm weights
    that are not all 1, so a swapped or missing factor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _v3_pair(q_lora, yarn, interleave, *, bias=False, mode="auto"):
    cfg = transformers.DeepseekV3Config(**DIMS, q_lora_rank=q_lora, rope_parameters=YARN if yarn else DEFAULT,
                                        rope_interleave=interleave, attention_bias=bias)
    cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(cfg, layer_idx=0).eval()
    _init(hf)
    ours = MultiHeadLatentAttention(MLAConfig.from_hf_config(cfg), mode=mode).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, DeepseekV3RotaryEmbedding(cfg), ours


def _hf_mask(valid_k, q_pos_abs, k_pos_abs):
    """(B, 1, Sq, Sk) additive mask as Hugging Face builds it: causal over slots and key validity."""
    allowed = valid_k[:, None, None, :] & (k_pos_abs[None, None, None, :] <= q_pos_abs[None, None, :, None])
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _left_padding(B_pad, total):
    valid = torch.arange(total)[None, :] >= torch.tensor(B_pad)[:, None]
    return valid, (valid.cumsum(-1) - 1).clamp(min=0)  # HF's position_ids for left padding


@pytest.mark.parametrize("mode", ["naive", "absorb"])
@pytest.mark.parametrize("q_lora,yarn,interleave", CASES)
def test_prefill_with_left_padding_matches_deepseek_v3(q_lora, yarn, interleave, mode):
    cfg, hf, hf_rope, ours = _v3_pair(q_lora, yarn, interleave, mode=mode)
    B, S = 2, 70  # past max_position_embeddings: YaRN's long-range frequencies matter
    valid, pos = _left_padding([0, 9], S)
    x = torch.randn(B, S, 48)
    with torch.no_grad():
        want = hf(x, position_embeddings=hf_rope(x, pos), attention_mask=_hf_mask(valid, torch.arange(S),
                                                                                   torch.arange(S)))[0]
        got = ours(x, key_padding_mask=~valid, positions=pos)
    torch.testing.assert_close(got[valid], want[valid])
    assert (got[~valid] == 0).all()  # padded queries see nothing (no o_proj bias here)


@pytest.mark.parametrize("q_lora,yarn,interleave", CASES)
def test_prefill_then_cached_decode_matches_deepseek_v3(q_lora, yarn, interleave):
    cfg, hf, hf_rope, ours = _v3_pair(q_lora, yarn, interleave)
    B, P, steps = 2, 20, 8
    total = P + steps
    assert (ours.resolve_mode(P, True), ours.resolve_mode(1, True)) == ("naive", "absorb")  # auto: both paths
    valid, pos = _left_padding([4, 0], total)
    x = torch.randn(B, total, 48)
    hf_cache = transformers.DynamicCache(config=cfg)
    cache = ours.new_cache()
    with torch.no_grad():
        got = [ours(x[:, :P], key_padding_mask=~valid[:, :P], positions=pos[:, :P], cache=cache)]
        want = [hf(x[:, :P], position_embeddings=hf_rope(x, pos[:, :P]), cache=hf_cache,
                   attention_mask=_hf_mask(valid[:, :P], torch.arange(P), torch.arange(P)))[0]]
        for t in range(P, total):
            sl = slice(t, t + 1)
            got.append(ours(x[:, sl], key_padding_mask=~valid[:, :t + 1], positions=pos[:, sl], cache=cache))
            want.append(hf(x[:, sl], position_embeddings=hf_rope(x, pos[:, sl]), cache=hf_cache,
                           attention_mask=_hf_mask(valid[:, :t + 1], torch.tensor([t]), torch.arange(t + 1)))[0])
    got, want = torch.cat(got, 1), torch.cat(want, 1)
    torch.testing.assert_close(got[valid], want[valid])
    assert cache.lengths.tolist() == [total, total]


@pytest.mark.parametrize("mode", ["naive", "absorb"])
def test_cached_decode_matches_deepseek_v3_in_each_forced_mode_with_bias(mode):
    cfg, hf, hf_rope, ours = _v3_pair(16, True, True, bias=True, mode=mode)
    x = torch.randn(1, 20, 48)
    hf_cache, cache = transformers.DynamicCache(config=cfg), ours.new_cache("static", max_batch=1, max_len=24)
    with torch.no_grad():
        got = [ours(x[:, :7], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(7, 20)]
        pos = torch.arange(20)[None]
        m = _hf_mask(torch.ones(1, 7, dtype=torch.bool), torch.arange(7), torch.arange(7))
        want = [hf(x[:, :7], position_embeddings=hf_rope(x, pos[:, :7]), cache=hf_cache, attention_mask=m)[0]]
        want += [hf(x[:, t:t + 1], position_embeddings=hf_rope(x, pos[:, t:t + 1]), cache=hf_cache,
                    attention_mask=None)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1))


@pytest.mark.parametrize("mode", ["naive", "absorb"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_deepseek_v2_lite_attention_with_complex_rope_matches(yarn, mode):
    """DeepseekV2Attention rotates interleaved pairs by complex multiplication (DeepSeek's official
    code); V2-Lite has no query compression (q_lora_rank None)."""
    cfg = transformers.DeepseekV2Config(**DIMS, q_lora_rank=None, rope_parameters=YARN if yarn else DEFAULT)
    cfg._attn_implementation = "eager"
    hf = DeepseekV2Attention(cfg, layer_idx=0).eval()
    _init(hf, seed=1)
    mc = MLAConfig.from_hf_config(cfg)
    assert mc.rope_interleave and mc.q_lora_rank is None
    ours = MultiHeadLatentAttention(mc, mode=mode).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    rope = DeepseekV2RotaryEmbedding(cfg)
    x = torch.randn(2, 30, 48)
    pos = torch.arange(30)[None].expand(2, 30)
    hf_cache, cache = transformers.DynamicCache(config=cfg), ours.new_cache()
    m = _hf_mask(torch.ones(2, 22, dtype=torch.bool), torch.arange(22), torch.arange(22))
    with torch.no_grad():
        want = [hf(x[:, :22], attention_mask=m, cache=hf_cache, position_embeddings=rope(x, pos[:, :22]))[0]]
        want += [hf(x[:, t:t + 1], attention_mask=None, cache=hf_cache,
                    position_embeddings=rope(x, pos[:, t:t + 1]))[0] for t in range(22, 30)]
        got = [ours(x[:, :22], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(22, 30)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1))


@pytest.mark.parametrize("name,make_cfg", [
    ("deepseek-v3", lambda: transformers.DeepseekV3Config()),
    ("deepseek-v2-lite", lambda: transformers.DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)),
])
def test_real_dimension_state_dicts_load_strict(name, make_cfg):
    """Full-size layers built on the meta device (no memory): same parameter names and shapes, and
    ``load_state_dict(strict=True)`` accepts Hugging Face's."""
    cfg = make_cfg()
    with torch.device("meta"):
        hf = DeepseekV3Attention(cfg, layer_idx=0) if name == "deepseek-v3" else DeepseekV2Attention(cfg, layer_idx=0)
    ours = MultiHeadLatentAttention(MLAConfig.from_hf_config(cfg), device="meta")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)
    cache = ours.new_cache(dtype=torch.bfloat16, device="cpu")
    assert cache.bytes_per_token == 576 * 2  # c_kv (512) + k_pe (64), bf16


def test_from_hf_config_reads_deepseek_v3_defaults():
    cfg = transformers.DeepseekV3Config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, max_position_embeddings=163840)
    mc = MLAConfig.from_hf_config(cfg)
    assert (mc.hidden_size, mc.num_heads, mc.q_lora_rank, mc.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim, mc.latent_dim) == (128, 64, 128, 576)
    assert mc.rope_interleave and mc.max_position_embeddings == 163840
    assert mc.rope.rope_type == "yarn" and mc.rope.params["factor"] == 40.0
    assert mc.rope.attention_scaling == 1.0  # mscale == mscale_all_dim: cos/sin unscaled
    assert mc.softmax_scale == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 192 ** -0.5), rel=1e-15)
