"""attnkit.models: the decoder's config, forward and caches, and Hugging Face checkpoint loading
(Llama family and dense DeepSeek-V3): same logits and the same 64-token greedy continuations."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from attnkit.models import Decoder, DecoderConfig, config_from_hf, load_pretrained, read_checkpoint, read_safetensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
VARIANTS = {"mha": {}, "gqa": {"num_kv_heads": 2}, "mqa": {}, "mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 4}}


def tiny(attention="gqa", seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(**{**TINY, **VARIANTS[attention], **kw, "attention": attention}), init_std=0.2).eval()


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw,msg", [
    (dict(attention="gqa"), "needs num_kv_heads"),
    (dict(attention="gqa", num_kv_heads=4), "1 < num_kv_heads < num_heads"),
    (dict(attention="gqa", num_kv_heads=3), r"divisible by num_kv_heads \(3\)"),
    (dict(attention="gqa", num_kv_heads=2, num_heads=6, hidden_size=36, head_dim=6), None),
    (dict(attention="mha", num_kv_heads=2), "means num_kv_heads=4"),
    (dict(attention="mqa", num_kv_heads=2), "means num_kv_heads=1"),
    (dict(attention="sparse"), "attention must be one of"),
    (dict(attention="mha", kv_lora_rank=8), "only apply to attention='mla'"),
    (dict(attention="mla", num_kv_heads=2), "one latent"),
    (dict(attention="mla", qk_rope_head_dim=3), "must be even"),
    (dict(hidden_size=30), "divisible by num_heads"),
    (dict(head_dim=7), "must be even"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_theta=1.0), "rope_theta"),
    (dict(tie_word_embeddings=1), "must be a bool"),
    (dict(rope_scaling=[1]), "rope_scaling must be a dict"),
])
def test_config_validates_and_names_the_values(kw, msg):
    base = dict(vocab_size=16, hidden_size=32, num_heads=4)
    if msg is None:
        assert DecoderConfig(**{**base, **kw}).num_kv_heads == 2
        return
    with pytest.raises((ValueError, TypeError), match=msg):
        DecoderConfig(**{**base, **kw})


def test_config_derives_without_overwriting():
    assert DecoderConfig(attention="mqa", num_heads=4, hidden_size=32).num_kv_heads == 1
    assert DecoderConfig(attention="mha", num_heads=4, hidden_size=32).num_kv_heads == 4
    c = DecoderConfig(attention="mla", hidden_size=64, num_heads=4)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rope_interleave) == (64, 16, 8, 16, True)
    c = DecoderConfig(attention="mla", hidden_size=64, num_heads=4, head_dim=8, kv_lora_rank=5, rope_interleave=False)
    assert (c.head_dim, c.kv_lora_rank, c.v_head_dim, c.rope_interleave) == (8, 5, 8, False)
    assert DecoderConfig(hidden_size=48, num_heads=4).intermediate_size == 128  # 8/3 * 48
    with pytest.raises(Exception):
        c.hidden_size = 3  # frozen
    assert DecoderConfig(**c.to_dict()) == c


# ---------------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("attention", list(VARIANTS))
def test_forward_shapes_weights_and_logits_to_keep(attention):
    m = tiny(attention)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        logits, weights = m(ids, need_weights=True)
        last = m(ids, logits_to_keep=3)
    assert logits.shape == (2, 9, 96) and len(weights) == 2
    for w in weights:
        assert w.shape == (2, 4, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
        assert (w.triu(1) == 0).all()  # causal
    torch.testing.assert_close(last, logits[:, -3:])


def test_cache_kinds_say_what_each_layer_gets():
    """new_caches("dynamic") is a DynamicCache in every layer, windowed or not; "sliding" gives
    the windowed layers a ring of their window and the others a DynamicCache."""
    from attnkit.caches import DynamicCache, SlidingWindowCache
    from attnkit.models import DecoderConfig, layer_cache_kind
    cfg = DecoderConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, sliding_window=3,
                        layer_types=("sliding_attention", "full_attention"))
    m = Decoder(cfg)
    assert [type(c) for c in m.new_caches("dynamic", max_batch=1)] == [DynamicCache, DynamicCache]
    assert [type(c) for c in m.new_caches("sliding", max_batch=1)] == [SlidingWindowCache, DynamicCache]
    assert [layer_cache_kind(layer.self_attn, "sliding") for layer in m.model.layers] == ["sliding", "dynamic"]
    with pytest.raises(ValueError, match="max_batch"):
        m.new_caches("sliding")


@pytest.mark.parametrize("attention", list(VARIANTS))
@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static", "paged"])
def test_cached_prefill_then_decode_equals_one_forward(attention, kind):
    m = tiny(attention, seed=1)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = m(ids)
        caches = m.new_caches(kind, max_batch=2, max_len=12)
        parts = [m(ids[:, :5], caches=caches), m(ids[:, 5:8], caches=caches)]  # chunked prefill
        parts += [m(ids[:, t:t + 1], caches=caches) for t in range(8, 12)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5
    assert [int(x) for x in caches[0].lengths] == [12, 12]


@pytest.mark.parametrize("attention", list(VARIANTS))
def test_left_padding_does_not_leak(attention):
    """A left-padded row with its padding masked and positions counting real tokens only gives
    the logits of the unpadded sequence, whatever the padding tokens are."""
    m = tiny(attention, seed=2)
    seq = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        alone = m(seq)
        for pad_tok in (0, 17):
            ids = torch.cat([torch.full((1, 3), pad_tok), seq], 1)
            kpm = torch.tensor([[True] * 3 + [False] * 6])
            pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
            out = m(ids, positions=pos, key_padding_mask=kpm)[:, 3:]
            assert (out - alone).abs().max() <= 1e-5


def test_tied_head_and_parameter_count():
    m = tiny("gqa", tie_word_embeddings=True)
    untied = tiny("gqa")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert untied.num_parameters() - m.num_parameters() == 96 * 32
    assert m.num_parameters(exclude_embeddings=True) == untied.num_parameters(exclude_embeddings=True)
    assert len(m.state_dict()) == len(untied.state_dict())  # both names present, as in HF


@pytest.mark.parametrize("attention,per_layer", [("mha", 2 * 4 * 8 * 4), ("gqa", 2 * 2 * 8 * 4),
                                                 ("mqa", 2 * 1 * 8 * 4), ("mla", (16 + 4) * 4)])
def test_kv_bytes_per_token(attention, per_layer):
    m = tiny(attention)
    assert m.kv_bytes_per_token() == 2 * per_layer
    assert m.kv_bytes_per_token(torch.bfloat16) == per_layer  # two layers, half the bytes


def test_bf16_model_keeps_fp32_rope_table():
    m = tiny("gqa").to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        out = m(ids)
    assert out.dtype == torch.bfloat16 and m.model.rope.cos_table.dtype == torch.float32
    ref = tiny("gqa")
    with torch.no_grad():
        assert (out.float() - ref(ids)).abs().max() < 0.1


def test_forward_rejects_bad_inputs():
    m = tiny()
    with pytest.raises(ValueError, match="input_ids must be a"):
        m(torch.randn(1, 3))
    with pytest.raises(ValueError, match="caches has 1 entries"):
        m(torch.zeros(1, 3, dtype=torch.long), caches=m.new_caches()[:1])
    with pytest.raises(ValueError, match="cache must be one of"):
        m.new_caches("rolling")
    with pytest.raises(TypeError, match="DecoderConfig"):
        Decoder({"vocab_size": 3})


# ---------------------------------------------------------------------------- Hugging Face parity


def _randomise(model, std=0.2, seed=0):
    """Larger-than-HF weights: decisive logits, so greedy decoding has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name else 0.0))


def _save(hf_model, path, **kw):
    hf_model.save_pretrained(path, **kw)
    return path


def _greedy_hf(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


LLAMA = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128,
             max_position_embeddings=256)
LLAMA_CASES = [
    pytest.param(dict(num_key_value_heads=4), "mha", id="mha"),
    pytest.param(dict(num_key_value_heads=2), "gqa", id="gqa"),
    pytest.param(dict(num_key_value_heads=1, tie_word_embeddings=True), "mqa", id="mqa-tied"),
    pytest.param(dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, head_dim=16,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}), "gqa", id="llama3-bias-headdim"),
]


@pytest.mark.parametrize("extra,attention", LLAMA_CASES)
def test_llama_checkpoint_same_logits_and_greedy_continuation(tmp_path, extra, attention):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, **extra)).eval()
    _randomise(hf)
    m = load_pretrained(_save(hf, tmp_path))
    assert m.config.attention == attention and not m.training
    ids = torch.randint(0, 128, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)
    prompt = ids[:1, :9]
    want = _greedy_hf(hf, prompt, 64)
    for cache in ("dynamic", "static"):
        assert m.generate(prompt, 64, cache=cache).tokens[0] == want


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_mistral_and_qwen2_checkpoints(tmp_path, model_type):
    torch.manual_seed(0)
    if model_type == "mistral":
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA, num_key_value_heads=2,
                                                                        sliding_window=None))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA, num_key_value_heads=2))
    hf = hf.eval()
    _randomise(hf)
    m = load_pretrained(_save(hf, tmp_path))
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)


DSV3 = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
            vocab_size=128, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
            first_k_dense_replace=2, n_routed_experts=4, moe_intermediate_size=8, max_position_embeddings=256)


@pytest.mark.parametrize("q_lora,rope", [
    pytest.param(16, None, id="q_lora-rope"),
    pytest.param(None, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}, id="no_q_lora-yarn"),
])
def test_deepseek_v3_dense_checkpoint_same_logits_and_greedy_continuation(tmp_path, q_lora, rope):
    torch.manual_seed(0)
    kw = {} if rope is None else {"rope_parameters": rope}
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DSV3, q_lora_rank=q_lora, **kw)).eval()
    _randomise(hf)
    m = load_pretrained(_save(hf, tmp_path))
    assert m.config.attention == "mla" and m.config.kv_lora_rank == 24
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)
    prompt = ids[:1, :7]
    want = _greedy_hf(hf, prompt, 64)
    for cache in ("dynamic", "static"):
        assert m.generate(prompt, 64, cache=cache).tokens[0] == want


def test_deepseek_v3_with_moe_layers_is_refused():
    cfg = transformers.DeepseekV3Config(**{**DSV3, "first_k_dense_replace": 1})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        config_from_hf(cfg)


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "relu2"}, "hidden_act 'relu2' is not supported"),
    ({"model_type": "gemma3"}, "gemma3_text"),
    ({"model_type": "gpt_oss"}, "model_type 'gpt_oss' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"unsupported RoPE.*'longrope'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "no sliding_window"),
    ({"layer_types": ["full_attention"]}, "field 'layer_types' must list"),
])
def test_unsupported_configs_are_named(change, msg):
    c = transformers.LlamaConfig(**LLAMA).to_dict()
    c.update(change)
    with pytest.raises(ValueError, match=msg):
        config_from_hf(c)


# ---------------------------------------------------------------------------- checkpoint files


def test_strict_name_matching_reports_extra_and_missing(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, num_key_value_heads=2))
    _save(hf, tmp_path)
    sd = read_safetensors(tmp_path / "model.safetensors")
    sd = {k: v.clone() for k, v in sd.items()}
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(4)
    del sd["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?s)strict.*(q_norm.*up_proj|up_proj.*q_norm)"):
        load_pretrained(tmp_path)


def test_sharded_safetensors_and_bin_checkpoints_load_without_network(tmp_path, monkeypatch):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, num_key_value_heads=2)).eval()
    _save(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")

    def no_network(*a, **k):
        raise AssertionError("loading tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        want = hf(ids).logits
        for d in ("sharded", "bin"):
            torch.testing.assert_close(load_pretrained(tmp_path / d)(ids), want)


def test_bin_checkpoints_load_with_weights_only(tmp_path):
    """A pickle that would run code is refused (torch.load(weights_only=True))."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, num_key_value_heads=2))
    _save(hf, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(1), "evil": _Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        read_checkpoint(tmp_path)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_load_dtype_from_config_and_override(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, num_key_value_heads=2)).to(torch.bfloat16)
    _save(hf, tmp_path)
    assert load_pretrained(tmp_path).dtype == torch.bfloat16
    assert load_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="dtype"):
        load_pretrained(tmp_path, dtype="fp32")


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def test_read_safetensors_matches_the_reference_reader(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i, dt in enumerate(DTYPES):
        shape = (3, 5) if i % 2 else (7,)  # odd sizes: later tensors start at unaligned offsets
        x = torch.randn(shape, generator=g) * 4
        sd[f"t{i}"] = x.to(dt) if dt.is_floating_point else (x > 0) if dt == torch.bool else x.abs().to(dt)
    sd["empty"] = torch.zeros(0, 4)
    sd["scalar"] = torch.tensor(2.5)
    safetensors_torch.save_file(sd, tmp_path / "x.safetensors", metadata={"format": "pt"})
    got = read_safetensors(tmp_path / "x.safetensors")
    want = safetensors_torch.load_file(tmp_path / "x.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    got["t1"].add_(1)  # copy-on-write: the file is untouched
    assert torch.equal(read_safetensors(tmp_path / "x.safetensors")["t1"], want["t1"])


@pytest.mark.parametrize("corrupt,msg", [
    (lambda b: b[:5], "shorter than"),
    (lambda b: (10 ** 9).to_bytes(8, "little") + b[8:], "header length"),
    (lambda b: b[:8] + b"!" + b[9:], "not valid JSON"),
    (lambda b: b[:-3], "do not fit"),
])
def test_read_safetensors_rejects_corrupt_files(tmp_path, corrupt, msg):
    safetensors_torch.save_file({"a": torch.arange(6.0), "b": torch.ones(2, 2)}, tmp_path / "x.safetensors")
    p = tmp_path / "x.safetensors"
    p.write_bytes(corrupt(p.read_bytes()))
    with pytest.raises(ValueError, match=msg):
        read_safetensors(p)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(transformers.LlamaConfig(**LLAMA).to_dict()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(tmp_path)


def test_forward_names_bad_input_ids_and_positions():
    from attnkit.models import Decoder, DecoderConfig
    lm = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4)).eval()
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, vocab_size=50\), got values from 0 to 50"):
        lm(torch.tensor([[0, 50]]))
    with pytest.raises(ValueError, match=r"positions must be \(B, S\) = \(1, 2\)"):
        lm(torch.tensor([[0, 1]]), positions=torch.tensor([[0, 1, 2]]))


def test_a_config_json_without_a_required_key_is_a_clear_error():
    from attnkit.models.loading import config_from_hf
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "intermediate_size": 16}
    with pytest.raises(ValueError, match="model_type 'llama'.*has no 'num_attention_heads'"):
        config_from_hf(cfg)


# ---------------------------------------------------------------------------- explicit fusion


def test_fused_and_separate_decoders_agree_and_load_each_others_state_dicts():
    """fused_projections (qkv_proj, gate_up_proj) is a layout, not a different model: either
    decoder loads the other's state dict with strict=True, and they compute the same logits."""
    fused = tiny("gqa", seed=3, attention_bias=True, mlp_bias=True)
    sep = Decoder(DecoderConfig(**{**TINY, **VARIANTS["gqa"], "attention": "gqa", "attention_bias": True,
                                   "mlp_bias": True, "fused_projections": False}), init_std=None).eval()
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused.state_dict()
    assert "model.layers.0.mlp.gate_up_proj.bias" in fused.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in sep.state_dict()
    sep.load_state_dict(fused.state_dict(), strict=True)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(sep(ids), fused(ids))
    again = tiny("gqa", seed=4, attention_bias=True, mlp_bias=True)
    again.load_state_dict(sep.state_dict(), strict=True)
    assert all(torch.equal(v, fused.state_dict()[k]) for k, v in again.state_dict().items())


# ---------------------------------------------------------------------------- reliability


@pytest.mark.parametrize("change,msg", [
    ({"tie_word_embeddings": "false"}, r"field 'tie_word_embeddings' must be true or false, got 'false' \(str\)"),
    ({"hidden_size": "32"}, r"field 'hidden_size' must be an int >= 1, got '32' \(str\)"),
    ({"num_hidden_layers": 2.0}, r"field 'num_hidden_layers' must be an int >= 1, got 2.0 \(float\)"),
    ({"rms_norm_eps": "1e-6"}, r"field 'rms_norm_eps' must be a finite number > 0"),
    ({"rope_theta": -1}, r"field 'rope_theta' must be a finite number > 0, got -1"),
    ({"attention_bias": 1}, r"field 'attention_bias' must be true or false, got 1 \(int\)"),
    ({"num_key_value_heads": True}, r"field 'num_key_value_heads' must be an int"),
    ({"rope_scaling": "linear"}, r"field 'rope_scaling' must be an object"),
])
def test_config_json_values_are_type_checked(change, msg):
    c = transformers.LlamaConfig(**LLAMA).to_dict()
    c.update(change)
    with pytest.raises(ValueError, match=msg):
        config_from_hf(c)


def test_broken_files_are_value_errors_naming_the_file(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, num_key_value_heads=2))
    _save(hf, tmp_path)
    cfg = tmp_path / "config.json"
    good = cfg.read_text()
    cfg.write_text(good[:-10])
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_pretrained(tmp_path)
    cfg.write_text(good)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])  # truncated mid-data
    with pytest.raises(ValueError, match=r"model.safetensors.*do not fit"):
        load_pretrained(tmp_path)
    st.unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    b = tmp_path / "pytorch_model.bin"
    b.write_bytes(b.read_bytes()[: b.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"pytorch_model.bin: not a readable PyTorch checkpoint"):
        load_pretrained(tmp_path)


def _lengths(caches):
    return [c.lengths.tolist() for c in caches]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_a_failing_forward_leaves_every_layers_cache_unchanged(attention, kind):
    """A bad key_padding_mask / positions / ids / num_new / logits_to_keep raises before
    any layer touches a cache, and an error inside a later layer aborts the step in every layer:
    all layers keep their lengths, and the next valid call equals an untouched twin's."""
    m = tiny(attention, seed=5)
    ids = torch.randint(0, 96, (2, 3))
    with torch.no_grad():
        caches, twin = m.new_caches(kind, max_batch=2, max_len=16), m.new_caches(kind, max_batch=2, max_len=16)
        m(ids, caches=caches)
        m(ids, caches=twin)
        before = _lengths(caches)
        tok = torch.tensor([[4], [5]])
        bad_calls = [
            dict(key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)),  # wrong key length
            dict(key_padding_mask=torch.zeros(3, 16, dtype=torch.bool)),  # wrong batch
            dict(key_padding_mask=torch.zeros(2, 16, dtype=torch.long)),  # wrong dtype
            dict(positions=torch.tensor([[-1], [3]])),
            dict(positions=torch.tensor([[3, 4]])),
            dict(num_new=torch.tensor([2, 0])),
            dict(logits_to_keep=-1),
            dict(input_ids=torch.tensor([[4], [96]])),
        ]
        for kw in bad_calls:
            with pytest.raises((ValueError, TypeError)):
                m(kw.pop("input_ids", tok), caches=caches, **kw)
            assert _lengths(caches) == before, kw
        boom = m.model.layers[1].mlp  # a failure after layer 0 has attended

        def fail(*a):
            raise RuntimeError("boom")
        handle = boom.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            m(tok, caches=caches)
        handle.remove()
        assert _lengths(caches) == before
        torch.testing.assert_close(m(tok, caches=caches), m(tok, caches=twin), rtol=0, atol=0)


_INDEXED = {"q_lora_rank": 16, "index_topk": 3}


_RAGGED_CASES = [(a, k) for a in ("gqa", "mla", "dsa") for k in ("dynamic", "static", "paged")]


@pytest.mark.parametrize("attention,kind", _RAGGED_CASES)
def test_key_padding_mask_width_with_ragged_num_new(attention, kind):
    """Rows of different lengths (2 and 4) gaining different numbers of tokens in one step
    (num_new = [S, S - 2], S = 3): the views reach max(lengths + num_new) = 5 keys (a static
    cache: max_len), not longest row + S = 7. A mask of the views' width runs and equals each
    row run alone; the width of longest row + S raises naming both widths and changes nothing.
    "dsa": DeepSeek-V3.2's indexed latent attention (an IndexedLatentCache per layer)."""
    extra = _INDEXED if attention == "dsa" else {}
    attention = "mla" if attention == "dsa" else attention
    m = tiny(attention, seed=7, **extra)
    max_len = 16
    width = max_len if kind == "static" else 5
    g = torch.Generator().manual_seed(7)
    prompt, step = torch.randint(0, 96, (2, 4), generator=g), torch.randint(0, 96, (2, 3), generator=g)
    kpm = torch.zeros(2, width, dtype=torch.bool)
    kpm[0, 1] = kpm[1, 0] = True  # a padding key in each row, seen by every query of the step
    lengths, gain = [2, 4], [3, 1]
    with torch.no_grad():
        caches = m.new_caches(kind, max_batch=2, max_len=max_len)
        m(prompt, caches=caches, num_new=torch.tensor(lengths))
        before = _lengths(caches)
        wrong = torch.zeros(2, 7, dtype=torch.bool)
        if kind != "static":
            with pytest.raises(ValueError, match=r"key_padding_mask has 7 columns, but this call attends over 5 keys"):
                m(step, caches=caches, num_new=torch.tensor(gain), key_padding_mask=wrong)
            assert _lengths(caches) == before
        out = m(step, caches=caches, num_new=torch.tensor(gain), key_padding_mask=kpm)
        assert _lengths(caches)[0] == [5, 5]
        for b in range(2):
            solo = m.new_caches(kind, max_batch=1, max_len=max_len)
            m(prompt[b:b + 1, :lengths[b]], caches=solo)
            ref = m(step[b:b + 1, :gain[b]], caches=solo, key_padding_mask=kpm[b:b + 1])
            torch.testing.assert_close(out[b:b + 1, :gain[b]], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["dynamic", "paged"])
def test_key_padding_mask_check_counts_num_new_for_the_indexed_cache(kind):
    """The decoder's own check asks an IndexedLatentCache for its latent's view width,
    max(lengths + num_new), like any dynamic or paged cache (the layer's module checks it again
    against the step's view)."""
    from attnkit.models.decoder import _key_length
    m = tiny("mla", seed=7, **_INDEXED)
    with torch.no_grad():
        caches = m.new_caches(kind, max_batch=2, max_len=16)
        m(torch.randint(0, 96, (2, 4)), caches=caches, num_new=torch.tensor([2, 4]))
    assert [_key_length(c, 3, torch.tensor([3, 1])) for c in caches] == [5, 5]
    assert [_key_length(c, 3) for c in caches] == [7, 7]
    assert [_key_length(c, 3, 1) for c in caches] == [5, 5]
