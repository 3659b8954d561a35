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
        want = [hf(x[:, :P], position_embeddings=hf_rope(x, pos[:, :P]), cache=hf_cache,
                   attention_mask=_hf_mask(valid[:, :P], torch.arange(P), torch.arange(P)))[0]]
        for t in range(P, total):
            sl = slice(t, t + 1)
            got.append(ours(x[:, sl], key_padding_mask=~valid[:, :t + 1], positions=pos[:, sl], cache=ours_cache))
            want.append(hf(x[:, sl], position_embeddings=hf_rope(x, pos[:, sl]), cache=hf_cache,
                           attention_mask=_hf_mask(valid[:, :t + 1], torch.tensor([t]), torch.arange(t + 1)))[0])
    got, want = torch.cat(got, 1), torch.cat(want, 1)
    torch.testing.assert_close(got[valid], want[valid])


def _mistral_pair(window):
    from transformers.models.mistral.modeling_mistral import MistralAttention, MistralRotaryEmbedding
    cfg = transformers.MistralConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                     sliding_window=window, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = MistralAttention(cfg, layer_idx=0).eval()
    ours = MultiHeadAttention(64, 8, num_kv_heads=2, causal=True, rope=RotaryEmbedding.from_hf_config(cfg)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, MistralRotaryEmbedding(cfg), ours


# window=1 is left out: there HF's DynamicSlidingWindowLayer is wrong during decode (each query
# should see only itself; attnkit gives o_proj(v_proj(x_t)) exactly, HF does not, and a 3-token
# chunk raises a shape error inside MistralAttention), checked with transformers 5.23.
@pytest.mark.parametrize("window", [2, 5, 16])
def test_sliding_window_matches_mistral_attention(window):
    """Mistral's sliding window (HF's own mask builder decides who sees whom): padded prefill with
    ``SlidingWindow(W - 1)``, then chunked + token-by-token decode through a ``SlidingWindowCache``
    against HF's sliding-window cache layer, past the point where the window evicts."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    from attnkit import SlidingWindowCache, masks
    cfg, hf, hf_rope, ours = _mistral_pair(window)
    B, S = 2, 12
    valid = torch.arange(S)[None, :] >= torch.tensor([0, 3])[:, None]  # left padding
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    x = torch.randn(B, S, 64)
    hf_mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=valid.long(),
                                                cache=None, position_ids=pos)
    with torch.no_grad():
        want, _ = hf(x, position_embeddings=hf_rope(x, pos), attention_mask=hf_mask)
        got = ours(x, mask=masks.SlidingWindow(window - 1), key_padding_mask=~valid, positions=pos)
    torch.testing.assert_close(got[valid], want[valid])

    total = 20
    x = torch.randn(B, total, 64)
    positions = torch.arange(total)[None].expand(B, -1)
    hf_cache, cache = transformers.DynamicCache(config=cfg), SlidingWindowCache(2, 8, window=window, max_batch=B)
    got, want = [], []
    with torch.no_grad():
        for s0, s1 in [(0, 8), (8, 11)] + [(t, t + 1) for t in range(11, total)]:
            xs, ps = x[:, s0:s1], positions[:, s0:s1]
            m = create_sliding_window_causal_mask(config=cfg, inputs_embeds=xs, attention_mask=torch.ones(B, s1, dtype=torch.long),
                                                  cache=hf_cache, position_ids=ps)
            want.append(hf(xs, position_embeddings=hf_rope(xs, ps), attention_mask=m, cache=hf_cache)[0])
            got.append(ours(xs, cache=cache))
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1))
