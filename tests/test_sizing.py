"""KV-cache sizing: DeepSeek's published figures (576 vs 40,960 values, 71x; "GQA with 2.25
groups"), MHA/GQA/MQA arithmetic, agreement with what real caches allocate, the table and the
command-line parsing."""

from __future__ import annotations

import argparse

import pytest
import torch

from attnkit import DynamicCache, MultiHeadAttention, StaticCache
from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention
from attnkit.sizing import (PRESETS, AttentionDims, IndexedLatentDims, SelectionSpec, add_kv_arguments,
                            bytes_per_token, cache_spec, decode_read_bytes, expanded_dims, gqa_equivalent_groups,
                            kv_cache_bytes, kv_cache_table, parse_context, parse_dtype, parse_select, parse_spec, run_kv,
                            values_per_token)

V3 = MLAConfig(hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, q_lora_rank=1536)


def test_deepseek_v3_latent_is_576_values_against_40960_expanded():
    assert values_per_token(V3) == 576
    assert values_per_token(expanded_dims(V3)) == 128 * (192 + 128) == 40960
    assert round(40960 / 576, 1) == 71.1
    assert bytes_per_token(V3, torch.bfloat16) == 1152 and bytes_per_token(expanded_dims(V3), torch.bfloat16) == 81920
    assert PRESETS["deepseek-v3"].spec == V3 and PRESETS["deepseek-v3"].layers == 61


def test_mla_cache_equals_gqa_with_2_25_groups():
    """DeepSeek-V2 paper, section 2.1.4: (d_c + d_h^R) l = 9/2 d_h l, 'equal to GQA with only 2.25
    groups', d_c = 4 d_h, d_h^R = d_h / 2, d_h = 128."""
    assert gqa_equivalent_groups(V3) == 2.25
    gqa = AttentionDims(num_kv_heads=1, head_dim=128)
    assert values_per_token(V3) == 2.25 * values_per_token(gqa) == 2.25 * 2 * 128
    assert gqa_equivalent_groups(PRESETS["deepseek-v2-lite"].spec) == 2.25
    assert gqa_equivalent_groups(AttentionDims(8, 128, num_heads=32)) == 8  # a GQA layer is its own count
    assert gqa_equivalent_groups(V3, head_dim=64) == 4.5


@pytest.mark.parametrize("dims,values,kind", [
    (AttentionDims(32, 128, num_heads=32), 8192, "MHA"),       # Llama-2-7B
    (AttentionDims(8, 128, num_heads=32), 2048, "GQA"),        # Llama-3-8B
    (AttentionDims(1, 64, num_heads=71), 128, "MQA"),          # Falcon-7B
    (AttentionDims(2, 96, v_head_dim=64), 320, "2 KV heads"),  # different K and V widths
])
def test_mha_gqa_mqa_values_per_token(dims, values, kind):
    assert values_per_token(dims) == values and dims.kind == kind


def test_whole_model_bytes_at_context_and_dtype():
    # Llama-3-8B, bf16: 128 KiB per token, 16 GiB at 128k tokens (the commonly quoted figures).
    llama = PRESETS["llama-3-8b"]
    assert kv_cache_bytes(llama.spec, context=1, layers=llama.layers) == 128 * 1024
    assert kv_cache_bytes(llama.spec, context=131072, layers=32, dtype=torch.bfloat16) == 16 * 2 ** 30
    assert kv_cache_bytes(V3, context=1000, layers=61, batch=3, dtype=torch.float32) == 576 * 4 * 1000 * 61 * 3
    assert kv_cache_bytes(V3, context=0) == 0
    assert kv_cache_bytes(V3, dtype=torch.float8_e4m3fn) == 576 + 4  # quantized: one fp32 scale per latent row


def test_figures_match_what_the_caches_allocate():
    mla = MultiHeadLatentAttention(MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                                             qk_rope_head_dim=8, v_head_dim=12))
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, head_dim=16, v_head_dim=12, causal=True)
    for module in (mla, mha):
        for dtype in (torch.float32, torch.bfloat16):
            static = module.new_cache("static", max_batch=3, max_len=50, dtype=dtype)
            assert static.bytes_per_token == bytes_per_token(module, dtype)
            held = static.nbytes - static.lengths.numel() * 8
            assert held == kv_cache_bytes(module, context=50, batch=3, dtype=dtype)
    assert cache_spec(mha) == AttentionDims(2, 16, 12, num_heads=8)
    assert DynamicCache(2, 16, 12).bytes_per_token == bytes_per_token(mha, torch.float32)
    assert StaticCache(1, 40, 32, max_batch=1, max_len=1, value_from_key=True).bytes_per_token == \
        bytes_per_token(mla, torch.float32)


def test_cache_spec_accepts_hf_configs():
    transformers = pytest.importorskip("transformers")
    assert cache_spec(transformers.DeepseekV3Config()) == V3
    llama = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert cache_spec(llama) == AttentionDims(8, 128, num_heads=32)
    assert cache_spec({"num_kv_heads": 4, "head_dim": 64}) == AttentionDims(4, 64)


def test_table_lists_every_preset_with_expanded_mla_rows():
    t = kv_cache_table(context=131072)
    assert "KV cache at 131072 tokens x batch 1, bf16" in t
    row = next(line for line in t.splitlines() if line.startswith("| deepseek-v3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:] == ["61", "576", "1,152", "68.62 KiB", "8.58 GiB", "71.1x", "2.25"]
    exp = next(line for line in t.splitlines() if line.startswith("| deepseek-v3 (expanded per head) |"))
    assert "40,960" in exp and "610.00 GiB" in exp
    for name in PRESETS:
        assert f"| {name} |" in t
    custom = kv_cache_table({"tiny": (AttentionDims(2, 8), 3)}, context=10, dtype=torch.float32, layers=4)
    assert "| tiny | 2 KV heads (2x8) | 4 | 32 | 128 | 512 B | 5.00 KiB | 1.0x | 2 |" in custom


def test_parse_spec_dtype_context():
    name, spec, layers = parse_spec("mla:heads=128,rank=512,rope=64,nope=128,v=128,layers=61")
    assert values_per_token(spec) == 576 and values_per_token(expanded_dims(spec)) == 40960 and layers == 61
    assert parse_spec("gqa:heads=32,num_kv_heads=8,head_dim=128")[1] == AttentionDims(8, 128, num_heads=32)
    assert parse_spec("gqa:heads=32,kv_heads=8,head_dim=128")[1] == AttentionDims(8, 128, num_heads=32)  # short key
    assert parse_spec("mha:heads=32,head_dim=128")[1] == AttentionDims(32, 128, num_heads=32)
    assert parse_spec("mqa:heads=71,head_dim=64")[1] == AttentionDims(1, 64, num_heads=71)
    assert parse_spec("DeepSeek-V3") == ("deepseek-v3", V3, 61)
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("float32") == torch.float32
    assert parse_context("128k") == 131072 and parse_context("4096") == 4096 and parse_context("1m") == 2 ** 20


def test_run_kv_prints_the_table(capsys):
    p = add_kv_arguments(argparse.ArgumentParser())
    args = p.parse_args(["deepseek-v3", "gqa:heads=32,num_kv_heads=8,head_dim=128,layers=32", "--context", "4k",
                         "--dtype", "fp32"])
    assert run_kv(args) == 0
    out = capsys.readouterr().out
    assert "4096 tokens" in out and "fp32" in out and "| deepseek-v3 |" in out and "2,304" in out  # 576 * 4


def test_kv_option_errors_say_what_is_wrong(capsys):
    """argparse turns a type's ValueError into "invalid parse_dtype value"; the options keep ours."""
    p = add_kv_arguments(argparse.ArgumentParser())
    for argv, text in ((["--dtype", "int4"], "unknown dtype 'int4'; use one of"),
                       (["--context", "12q"], "context must be a token count")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        err = capsys.readouterr().err
        assert text in err and "invalid" not in err, err


@pytest.mark.parametrize("call,exc,text", [
    (lambda: parse_spec("mla:heads=128,rank=512"), ValueError, "missing"),
    (lambda: parse_spec("mla:heads=128,rank=512,rope=63,nope=128,v=128"), ValueError, r"qk_rope_head_dim \(63\)"),
    (lambda: parse_spec("gqa:heads=32,num_kv_heads=5,head_dim=128"), ValueError, r"num_heads \(32\) must be divisible"),
    (lambda: parse_spec("gqa:heads=x"), ValueError, "bad item 'heads=x'"),
    (lambda: parse_spec("rnn:h=1"), ValueError, "spec kind must be"),
    (lambda: parse_spec("llama-9"), ValueError, "unknown preset 'llama-9'"),
    (lambda: parse_dtype("fp64x"), ValueError, "unknown dtype"),
    (lambda: parse_context("12 tokens"), ValueError, "context must be"),
    (lambda: kv_cache_bytes(V3, context=-1), ValueError, "context must be a non-negative int"),
    (lambda: kv_cache_bytes(V3, dtype="bf16"), TypeError, "dtype must be a torch.dtype"),
    (lambda: cache_spec(3.5), TypeError, "cannot size the KV cache of a float"),
    (lambda: cache_spec({"heads": 3}), TypeError, "AttentionDims fields"),
    (lambda: AttentionDims(0, 128), ValueError, "num_kv_heads must be a positive int"),
    (lambda: expanded_dims(AttentionDims(1, 8)), TypeError, "MLAConfig"),
])
def test_bad_input(call, exc, text):
    with pytest.raises(exc, match=text):
        call()


@pytest.mark.parametrize("text,match", [("mha:head_dim=128", "num_heads"),
                                        ("mqa:heads=8,kv_heads=2,head_dim=64", "MQA has one")])
def test_spec_errors_name_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(text)


def test_an_explicit_zero_layer_count_is_an_error_not_the_preset():
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        kv_cache_table({"x": ("llama-3-8b", 0)})


# --------------------------------------------------------------------------- sparse selections


def test_decode_read_bytes_of_a_sparse_selection_from_first_principles():
    """One decode step reads, per layer and sequence, one cache row per key it attends to: every
    cached key (dense) or the selected ones. A row: MLA's latent + rope key, 512 + 64 = 576
    values; GQA's K and V of each KV head, 8 * (128 + 128) = 2048 values."""
    ctx = 131072
    v3, llama = PRESETS["deepseek-v3"].spec, PRESETS["llama-3-8b"].spec
    dsa = SelectionSpec(top_k=2048)
    assert decode_read_bytes(v3, context=ctx) == ctx * 576 * 2 == 150_994_944
    assert decode_read_bytes(v3, context=ctx, select=dsa) == 2048 * 576 * 2 == 2_359_296  # 64x less
    # int8: a byte per value and one fp32 scale per latent row
    assert decode_read_bytes(v3, context=ctx, select=dsa, dtype=torch.int8) == 2048 * (576 + 4)
    # 16 blocks of 64 keys and a local window of 512: 1536 keys of 8 KV heads x (128 + 128) bf16
    blocks = SelectionSpec(blocks=16, block_size=64, window=512)
    assert blocks.keys == 1536
    assert decode_read_bytes(llama, context=ctx, select=blocks, batch=3) == 3 * 1536 * 8 * 256 * 2
    assert decode_read_bytes(llama, context=4096, batch=3) == 3 * 4096 * 8 * 256 * 2
    # a context shorter than the selection: every cached row, no more
    assert decode_read_bytes(v3, context=1000, select=dsa) == decode_read_bytes(v3, context=1000) == 1000 * 1152
    # int8 GQA: fp32 scales per row of K and of V for each KV head
    assert decode_read_bytes(llama, context=ctx, select=dsa, dtype=torch.int8) == 2048 * (8 * 256 + 4 * 2 * 8)


def test_parse_select_and_the_table_columns(capsys):
    assert parse_select("2048") == parse_select("2k") == SelectionSpec(top_k=2048)
    assert parse_select("16x64") == SelectionSpec(blocks=16, block_size=64)
    assert parse_select("16x64+512") == SelectionSpec(blocks=16, block_size=64, window=512)
    assert parse_select("+512") == SelectionSpec(window=512)
    assert str(parse_select("16x64+512")) == "16 blocks x 64 + window 512 = 1,536 keys"
    table = kv_cache_table(["deepseek-v3", "llama-3-8b"], context=131072, select=SelectionSpec(top_k=2048))
    assert "read dense | read selected (2,048 keys) |" in table
    row = next(line for line in table.splitlines() if line.startswith("| deepseek-v3 |"))
    assert row.endswith("| 144.00 MiB | 2.25 MiB |")  # 131072 * 1152 bytes, 2048 * 1152 bytes
    row = next(line for line in table.splitlines() if line.startswith("| llama-3-8b |"))
    assert row.endswith("| 512.00 MiB | 8.00 MiB |")  # 131072 * 4096 bytes, 2048 * 4096 bytes
    assert "read dense" not in kv_cache_table(["llama-3-8b"])  # no selection, no read columns
    p = add_kv_arguments(argparse.ArgumentParser())
    assert run_kv(p.parse_args(["deepseek-v3", "--context", "128k", "--select", "2048"])) == 0
    assert "| 144.00 MiB | 2.25 MiB |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        p.parse_args(["--select", "16x"])
    assert "select: bad count in '16x'" in capsys.readouterr().err


@pytest.mark.parametrize("kw,text", [
    (dict(blocks=16), r"blocks \(16\) and block_size \(0\) go together"),
    (dict(top_k=-1), "top_k must be a non-negative int"),
    (dict(), "keeps no key"),
])
def test_bad_selection_says_what_is_wrong(kw, text):
    with pytest.raises(ValueError, match=text):
        SelectionSpec(**kw)


# --------------------------------------------------------------------------- DeepSeek-V3.2 (DSA)


def _tiny_dsa(dtype=torch.float32):
    from attnkit.models.indexer import IndexedLatentAttention, IndexerConfig
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=12, q_lora_rank=24)
    return IndexedLatentAttention(cfg, IndexerConfig(num_heads=2, head_dim=20, topk=4), dtype=dtype)


def test_deepseek_v32_counts_the_indexers_keys_from_first_principles():
    """A DSA layer caches MLA's 576-value latent row and the indexer's 128-value key per token.
    The key is never quantized: an int8 latent (576 bytes + one fp32 scale) sits beside bf16 keys
    (256 bytes). A decode step reads the selected latent rows and every indexer key."""
    v32 = PRESETS["deepseek-v3.2"]
    assert v32.spec == IndexedLatentDims(V3, 128) and v32.layers == 61
    assert values_per_token(v32.spec) == 576 + 128 == 704
    assert bytes_per_token(v32.spec, torch.bfloat16) == 704 * 2
    assert bytes_per_token(v32.spec, torch.float32) == 704 * 4
    assert bytes_per_token(v32.spec, torch.int8) == 576 + 4 + 128 * 2 == 836
    assert bytes_per_token(v32.spec, torch.float8_e4m3fn) == 836
    assert bytes_per_token(v32.spec, torch.int8, index_dtype=torch.float32) == 576 + 4 + 128 * 4
    assert kv_cache_bytes("deepseek-v3.2", context=131072, layers=61, batch=2) == 2 * 61 * 131072 * 1408
    ctx, dsa = 131072, SelectionSpec(top_k=2048)
    assert decode_read_bytes(v32.spec, context=ctx) == ctx * 1408
    assert decode_read_bytes(v32.spec, context=ctx, select=dsa) == 2048 * 1152 + ctx * 256 == 35_913_728
    assert decode_read_bytes(v32.spec, context=ctx, select=dsa, batch=3, dtype=torch.int8) == \
        3 * (2048 * (576 + 4) + ctx * 256)
    assert decode_read_bytes(v32.spec, context=1000, select=dsa) == 1000 * 1408  # fewer keys than top-k
    assert gqa_equivalent_groups(v32.spec) == 704 / 256


def test_dsa_spec_from_a_module_a_decoder_config_and_a_hf_config():
    from attnkit.models import DecoderConfig
    m = _tiny_dsa()
    assert cache_spec(m) == IndexedLatentDims(m.config, 20)
    base = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, attention="mla", kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24)
    dsa = cache_spec(DecoderConfig(**base, index_topk=4, index_head_dim=20))
    assert isinstance(dsa, IndexedLatentDims) and dsa.index_head_dim == 20 and values_per_token(dsa) == 40 + 20
    assert isinstance(cache_spec(DecoderConfig(**base)), MLAConfig)  # dense MLA: no indexer
    gqa = DecoderConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, attention="gqa", num_kv_heads=2)
    assert cache_spec(gqa) == AttentionDims(2, 16, num_heads=4)
    transformers = pytest.importorskip("transformers")
    hf = cache_spec(transformers.DeepseekV32Config())
    assert isinstance(hf, IndexedLatentDims) and hf.index_head_dim == 128
    assert values_per_token(hf) == values_per_token("deepseek-v3.2") == 704
    assert cache_spec(transformers.DeepseekV3Config()) == V3  # no indexer there


@pytest.mark.parametrize("module_dtype,kv_dtype", [(torch.bfloat16, None), (torch.bfloat16, "int8"),
                                                   (torch.float32, None), (torch.float32, "int8")])
def test_dsa_sizing_equals_what_the_indexed_cache_reports(module_dtype, kv_dtype):
    """bytes_per_token of a DSA module is IndexedLatentCache.bytes_per_token: the latent in the
    cache's dtype (int8 + scale when quantized) and the indexer's keys in the compute dtype."""
    m = _tiny_dsa(module_dtype)
    cache = m.new_cache("dynamic", kv_dtype=kv_dtype)
    dtype = torch.int8 if kv_dtype else module_dtype
    assert bytes_per_token(m, dtype, index_dtype=module_dtype) == cache.bytes_per_token
    assert cache.bytes_per_token == cache.latent.bytes_per_token + 20 * module_dtype.itemsize
    if module_dtype == torch.bfloat16:  # the default for a quantized cache's keys
        assert bytes_per_token(m, dtype) == cache.bytes_per_token


def test_decoder_kv_bytes_per_token_of_a_dsa_model_equals_the_sizing():
    from attnkit.models import Decoder, DecoderConfig
    cfg = DecoderConfig(vocab_size=64, hidden_size=64, num_layers=3, num_heads=4, attention="mla", kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24, index_topk=4,
                        index_head_dim=20)
    model = Decoder(cfg, dtype=torch.bfloat16)
    assert model.kv_bytes_per_token() == kv_cache_bytes(cfg, layers=3, dtype=torch.bfloat16) == 3 * 60 * 2
    assert model.kv_bytes_per_token(kv_dtype="int8") == kv_cache_bytes(cfg, layers=3, dtype=torch.int8) == \
        3 * (40 + 4 + 20 * 2)


def test_dsa_in_the_table_and_on_the_command_line(capsys):
    name, spec, layers = parse_spec("mla:heads=128,rank=512,rope=64,nope=128,v=128,index=128,layers=61")
    assert values_per_token(spec) == 704 and spec.index_head_dim == 128 and layers == 61
    assert parse_spec("deepseek-v3.2") == ("deepseek-v3.2", PRESETS["deepseek-v3.2"].spec, 61)
    table = kv_cache_table(["deepseek-v3.2"], context=131072, select=SelectionSpec(top_k=2048))
    row = next(line for line in table.splitlines() if line.startswith("| deepseek-v3.2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 704 values, 1,408 bytes; 61 layers; (40,960 + 128) / 704 = 58.4x; reads 131072 * 1408 and
    # 2048 * 1152 + 131072 * 256 bytes
    assert cells[1] == "DSA: MLA (r=512, rope=64, 128 heads) + indexer key 128"
    assert cells[2:] == ["61", "704", "1,408", "83.88 KiB", "10.48 GiB", "58.4x", "2.75", "176.00 MiB",
                         "34.25 MiB"]
    p = add_kv_arguments(argparse.ArgumentParser())
    assert run_kv(p.parse_args(["deepseek-v3.2", "--context", "128k", "--dtype", "int8"])) == 0
    out = capsys.readouterr().out
    assert "| deepseek-v3.2 |" in out and "| 836 |" in out and "DSA indexer keys bf16" in out


@pytest.mark.parametrize("call,exc,text", [
    (lambda: IndexedLatentDims(V3, 0), ValueError, "index_head_dim must be a positive int"),
    (lambda: IndexedLatentDims(AttentionDims(1, 8), 128), TypeError, "must be an MLAConfig"),
    (lambda: bytes_per_token("deepseek-v3.2", torch.int8, index_dtype=torch.int8), ValueError, "never quantized"),
    (lambda: parse_spec("mla:heads=128,rank=512,rope=64,nope=128,v=128,index=0"), ValueError, "index_head_dim"),
])
def test_bad_dsa_input(call, exc, text):
    with pytest.raises(exc, match=text):
        call()
