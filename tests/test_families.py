"""Decoder.from_pretrained on random small save_pretrained checkpoints of each family: the same fp32 logits as transformers and the same greedy tokens (every cache kind),
with sliding windows long enough to evict during generation. Families are parameters of the one
Decoder (norm kind and placement, MLP activation, embedding scale, soft-capping, QK-norm,
per-layer windows and RoPE), never classes of their own."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import Decoder, load_pretrained

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=128, max_position_embeddings=256)


def _randomise(model, seed=0):
    """Larger-than-HF weights: decisive logits, so greedy decoding has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if is_norm else 0.2) + (1.0 if is_norm else 0.0))


def _greedy_hf(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _check_family(tmp_path, hf, expect=None, caches=("dynamic", "static", "paged")):
    hf = hf.eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    m = load_pretrained(tmp_path)
    assert isinstance(m, Decoder) and not m.training
    for field, value in (expect or {}).items():
        assert getattr(m.config, field) == value, field
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)
    prompt = ids[:1, :9]
    want = _greedy_hf(hf, prompt, 24)
    for cache in caches:
        assert m.generate(prompt, 24, cache=cache).tokens[0] == want, cache
    # a ragged batch: each row as alone (sliding layers keep only their window with "dynamic")
    rows = [ids[0, :9].tolist(), ids[1, :4].tolist()]
    assert m.generate(rows, 12).tokens == [m.generate([r], 12).tokens[0] for r in rows]
    return m


def test_llama3(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    _check_family(tmp_path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, rope_parameters=rope)))


def test_mistral_with_sliding_window(tmp_path):
    m = _check_family(tmp_path, transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=4)),
                      expect={"sliding_window": 4, "layer_types": ("sliding_attention",) * 2})
    # "dynamic" is what it says in every layer; "sliding" keeps a ring of each layer's window
    assert type(m.new_caches("dynamic", max_batch=1)[0]).__name__ == "DynamicCache"
    assert type(m.new_caches("sliding", max_batch=1)[0]).__name__ == "SlidingWindowCache"


def test_qwen2(tmp_path):
    _check_family(tmp_path, transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)),
                  expect={"attention_bias": True, "attention_out_bias": False})


def test_qwen2_with_sliding_layers(tmp_path):
    cfg = transformers.Qwen2Config(**{**SIZES, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=1)
    _check_family(tmp_path, transformers.Qwen2ForCausalLM(cfg),
                  expect={"layer_types": ("full_attention", "sliding_attention", "sliding_attention")})


def test_qwen3(tmp_path):
    _check_family(tmp_path, transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=16)),
                  expect={"qk_norm": "head"})


def test_gemma3_text(tmp_path):
    cfg = transformers.Gemma3TextConfig(
        **SIZES, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})
    m = _check_family(tmp_path, transformers.Gemma3ForCausalLM(cfg),
                      expect={"qk_norm": "head", "norm_style": "gemma", "local_rope_theta": 10.0,
                              "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True})
    assert m.model.rope_local is not None and m.model.layers[0].rope is m.model.rope_local
    assert m.model.layers[1].rope is m.model.rope


def test_gemma2(tmp_path):
    cfg = transformers.Gemma2Config(**SIZES, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    _check_family(tmp_path, transformers.Gemma2ForCausalLM(cfg),
                  expect={"attn_softcap": 5.0, "final_softcap": 3.0, "norm_placement": "sandwich"})


def test_gemma2_without_soft_capping(tmp_path):
    """Gemma 2's layout (norms, GeGLU, embedding scale, query scalar, alternating windows) with
    soft-capping switched off in the config: runs today; the capped model needs the core's softcap."""
    cfg = transformers.Gemma2Config(**SIZES, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                    attn_logit_softcapping=None, final_logit_softcapping=None)
    _check_family(tmp_path, transformers.Gemma2ForCausalLM(cfg),
                  expect={"attn_softcap": None, "embedding_multiplier": 48 ** 0.5,
                          "layer_types": ("sliding_attention", "full_attention")})


def test_phi3_fused_names_and_partial_rotary(tmp_path):
    cfg = transformers.Phi3Config(**SIZES, pad_token_id=0, original_max_position_embeddings=256,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})
    m = _check_family(tmp_path, transformers.Phi3ForCausalLM(cfg))
    assert m.model.rope.rotary_dim == 6 and "model.layers.0.self_attn.qkv_proj.weight" in m.state_dict()


def test_olmo2(tmp_path):
    _check_family(tmp_path, transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SIZES, pad_token_id=0)),
                  expect={"qk_norm": "full", "norm_placement": "post"})


def test_deepseek_v3_dense(tmp_path):
    cfg = transformers.DeepseekV3Config(**{**SIZES, "num_key_value_heads": 4}, kv_lora_rank=24, qk_nope_head_dim=8,
                                        qk_rope_head_dim=6, v_head_dim=10, q_lora_rank=16, first_k_dense_replace=2,
                                        n_routed_experts=4, moe_intermediate_size=8)
    _check_family(tmp_path, transformers.DeepseekV3ForCausalLM(cfg), expect={"attention": "mla"})
