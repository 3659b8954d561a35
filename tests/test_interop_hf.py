"""Parity with Hugging Face transformers' LlamaAttention (weights copied, GQA, every RoPE scaling):
prefill with left padding, and prefill followed by cached decode, fp32 assert_close defaults."""

from __future__ import annotations

import pytest
import torch

from attnkit import DynamicCache, MultiHeadAttention, RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding  # noqa: E402

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


def _pair(scaling, bias=False):
    params = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else {"rope_theta": 10000.0, **scaling}
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                   max_position_embeddings=24, attention_bias=bias, rope_parameters=params)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = LlamaAttention(cfg, layer_idx=0).eval()
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, bias=bias, causal=True,
                              rope=RotaryEmbedding.from_hf_config(cfg)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, LlamaRotaryEmbedding(cfg), ours


def _hf_mask(valid_k, q_pos_abs, k_pos_abs):
    """(B, 1, Sq, Sk) additive mask: causal over absolute slots and key validity, finfo.min."""
    allowed = valid_k[:, None, None, :] & (k_pos_abs[None, None, None, :] <= q_pos_abs[None, None, :, None])
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_prefill_with_left_padding_matches_llama_attention(name, bias):
    cfg, hf, hf_rope, ours = _pair(SCALINGS[name], bias)
    B, S = 2, 30  # past max_position_embeddings, so dynamic / yarn / llama3 scalings matter
    pad = torch.tensor([0, 7])
    valid = torch.arange(S)[None, :] >= pad[:, None]  # (B, S) left padding
    pos = (valid.cumsum(-1) - 1).clamp(min=0)  # HF's position_ids for left padding
    x = torch.randn(B, S, 64)
    with torch.no_grad():
        want, _ = hf(x, position_embeddings=hf_rope(x, pos), attention_mask=_hf_mask(valid, torch.arange(S), torch.arange(S)))
        got = ours(x, key_padding_mask=~valid, positions=pos)
    torch.testing.assert_close(got[valid], want[valid])
    assert (got[~valid] == 0).all() or bias  # padded queries see nothing (o_proj bias aside)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_prefill_then_cached_decode_matches_llama_attention(name):
    cfg, hf, hf_rope, ours = _pair(SCALINGS[name])
    B, P, steps = 2, 10, 16  # decode runs past max_position_embeddings
    pad = torch.tensor([3, 0])
    total = P + steps
    x = torch.randn(B, total, 64)
    valid = torch.arange(total)[None, :] >= pad[:, None]
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    hf_cache = transformers.DynamicCache(config=cfg)
    ours_cache = DynamicCache(2, 8)
    with torch.no_grad():
        got = [ours(x[:, :P], key_padding_mask=~valid[:, :P], positions=pos[:, :P], cache=ours_cache)]
        want = [hf(x[:, :P], position_embeddings=hf_rope(x, pos[:, :P]), past_key_values=hf_cache,
                   attention_mask=_hf_mask(valid[:, :P], torch.arange(P), torch.arange(P)))[0]]
        for t in range(P, total):
            sl = slice(t, t + 1)
            got.append(ours(x[:, sl], key_padding_mask=~valid[:, :t + 1], positions=pos[:, sl], cache=ours_cache))
            want.append(hf(x[:, sl], position_embeddings=hf_rope(x, pos[:, sl]), past_key_values=hf_cache,
                           attention_mask=_hf_mask(valid[:, :t + 1], torch.tensor([t]), torch.arange(t + 1)))[0])
    got, want = torch.cat(got, 1), torch.cat(want, 1)
    torch.testing.assert_close(got[valid], want[valid])
