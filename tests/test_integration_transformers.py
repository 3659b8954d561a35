"""attn_implementation="attnkit" in Hugging Face transformers, on random tiny models of six
families: logits on a left-padded batch (rule R: attnkit vs "eager" against an fp64 eager copy),
greedy generate tokens with dynamic and static caches, training gradients, dropout, typed
masks, user 4-D masks, output_attentions, and the optional-dependency contract.

Then what models pass and read beyond the common path: every keyword argument is
implemented, known harmless, or refused by name; Inkling 2's per-query sinks and DeepSeek-V4's
compressed keys against eager; models that read the mask object themselves (DeepSeek sparse
attention, Doge, Qwen4-Exp) and models that drop ``output_attentions``; models attnkit cannot
serve are refused when built; fully masked rows of a float 4-D mask; and the
transformers version range of the ``hf`` extra.

Every test here turns transformers' FutureWarnings into errors: a deprecated argument these tests
(or the integration) still use fails the suite while transformers still accepts it, one
deprecation cycle before the removal would break users."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.integrations.transformers as hf  # noqa: E402
from attnkit.integrations.transformers import attention as hf_attention  # noqa: E402
from attnkit.integrations.transformers import masks as hf_masks  # noqa: E402
from attnkit import masks as M  # noqa: E402
from conftest import rule_r  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

W = 4  # sliding window (tokens, transformers' convention: the current one included)
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0,
               initializer_range=0.2)  # larger than the default 0.02, so attention is far from uniform


def _config(family: str, **over):
    T = transformers
    c = dict(_COMMON, **over)
    if family == "llama":
        return T.LlamaConfig(**c)
    if family == "qwen2":
        return T.Qwen2Config(**c, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                             layer_types=["full_attention", "sliding_attention"])
    if family == "mistral":
        return T.MistralConfig(**c, head_dim=8, sliding_window=W)
    if family == "qwen3":
        return T.Qwen3Config(**c, head_dim=8, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                             layer_types=["full_attention", "sliding_attention"])
    if family == "gemma2":
        return T.Gemma2Config(**c, head_dim=8, query_pre_attn_scalar=8, sliding_window=W,
                              attn_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"])
    if family == "gpt_oss":
        c["max_position_embeddings"] = 131072  # = its YaRN factor 32 x original 4096 (else transformers warns)
        return T.GptOssConfig(**c, head_dim=8, sliding_window=W, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


FAMILIES = [
    pytest.param("llama", id="llama"),
    pytest.param("qwen2", id="qwen2"),
    pytest.param("mistral", id="mistral"),
    pytest.param("qwen3", id="qwen3"),
    pytest.param("gemma2", id="gemma2"),
    pytest.param("gpt_oss", id="gpt_oss"),
]


def _model(family: str, impl: str = "attnkit", seed: int = 0, **over):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(family, **over), attn_implementation=impl).eval()


def _batch(seed=1, lengths=(9, 6), vocab=96):
    """A left-padded batch: (ids (B, P), attention_mask (B, P) with 0 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), P), generator=g)
    am = torch.zeros(len(lengths), P, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, P - n:] = 1
        ids[b, :P - n] = 0
    return ids, am


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         s_aux=None, sinks=None, position_bias=None, **kwargs):
    """The gold: attnkit's fp64 oracle over transformers' own materialized bool mask (the
    model's ``position_bias`` added to the scores, its sinks per head or per query; a call
    without a mask is causal as the layer says)."""
    extra = {k: v for k, v in (("softcap", softcap), ("sinks", s_aux if s_aux is not None else sinks)) if v is not None}
    mask = attention_mask
    if position_bias is not None:
        mask = M.Additive(position_bias) if mask is None else M.Dense(mask) & M.Additive(position_bias)
    causal = attention_mask is None and getattr(module, "is_causal", True)
    out = attnkit.attention_reference(query, key, value, mask, causal=causal, scale=scaling, **extra)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _reference_mask(*args, **kwargs):
    """transformers' SDPA mask, always materialized (True = attend)."""
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return transformers.masking_utils.sdpa_mask(*args, **kwargs)


transformers.AttentionInterface.register("reference64", _reference_attention)
transformers.masking_utils.AttentionMaskInterface.register("reference64", _reference_mask)


def _three(family, **over):
    """The same weights as attnkit (fp32), eager (fp32) and the gold: an fp64 copy whose masks are
    transformers' own (materialized) and whose attention is the fp64 oracle. (An fp64 "eager"
    copy cannot be the gold on a left-padded batch: eager softmaxes in fp32, where its fp64
    "masked" value -1.8e308 becomes -inf, so fully masked padding rows turn NaN and spread.)"""
    ours = _model(family, "attnkit", **over)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    gold = copy.deepcopy(eager).double()
    gold.set_attn_implementation("reference64")
    if family == "gpt_oss":  # torch's grouped_mm has no fp64: the gold's experts loop in plain matmuls
        gold.config._experts_implementation = "eager"
    return ours, eager, gold


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_left_padded_rule_r(family):
    ours, eager, gold = _three(family)
    ids, am = _batch()
    with torch.no_grad():
        lo, le, lg = (m(ids, attention_mask=am).logits for m in (ours, eager, gold))
    real = am.bool()
    # Rule R on the real positions (a padding position attends to nothing: attnkit gives it 0,
    # eager the mean of every value; the model's outputs there are not used).
    rule_r(lo[real], le[real], lg[real], n_terms=_COMMON["hidden_size"] * _COMMON["num_hidden_layers"], what="logits")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_same_tokens_as_eager(family, cache):
    ours, eager, _ = _three(family)
    ids, am = _batch(2)
    kw = dict(attention_mask=am, max_new_tokens=10, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        got = ours.generate(ids, **kw)
        want = eager.generate(ids, **kw)
    assert got.shape[1] == ids.shape[1] + 10  # past the window of 4: sliding caches roll over
    assert got.tolist() == want.tolist()


def _gradients_rule_r(ours, eager, gold, ids, am, hidden: int) -> list[str]:
    """Train-mode loss gradients of the three copies; rule R on every parameter the gold model
    has a gradient for. Returns their names."""
    labels = ids.masked_fill(am == 0, -100)
    for m in (ours, eager, gold):
        m.train()
        m(ids, attention_mask=am, labels=labels).loss.backward()
    checked = []
    for (name, po), pe, pg in zip(ours.named_parameters(), eager.parameters(), gold.parameters()):
        if pg.grad is None:
            continue
        rule_r(po.grad, pe.grad, pg.grad, factor=3.0, n_terms=ids.numel() * hidden, what=f"grad {name}")
        checked.append(name)
    return checked


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_rule_r(family):
    ids, am = _batch(3)
    assert _gradients_rule_r(*_three(family), ids, am, _COMMON["hidden_size"])


def _capture(monkeypatch):
    calls = []
    real = hf_attention.attention

    def spy(q, k, v, mask=None, **kw):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), mask=mask, **kw))
        return real(q, k, v, mask, **kw)
    monkeypatch.setattr(hf_attention, "attention", spy)
    return calls


def _parts(mask):
    return list(mask.masks) if isinstance(mask, M.And) else [mask]


def test_masks_stay_typed_and_gqa_is_not_repeated(monkeypatch):
    model = _model("mistral")
    ids, am = _batch()
    calls = _capture(monkeypatch)
    with torch.no_grad():
        model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    prefill, decode = calls[0], calls[-1]
    assert prefill["q"][1] == 4 and prefill["k"][1] == 2  # Hq = 4, Hkv = 2 reach attention as they are
    kinds = {type(p) for p in _parts(prefill["mask"])}
    assert kinds == {M.SlidingWindow, M.KeyPadding}  # window + left padding, nothing dense
    window = next(p for p in _parts(decode["mask"]) if isinstance(p, M.SlidingWindow))
    assert window.left == W - 1
    assert all(not isinstance(p, (M.Dense, M.Additive)) for c in calls for p in _parts(c["mask"]))
    pads = [p for c in calls for p in _parts(c["mask"]) if isinstance(p, M.KeyPadding)]
    assert pads and all(p.side == "left" and p.lengths is not None for p in pads)  # intervals, not bool masks


def test_static_cache_left_padding_is_an_interval(monkeypatch):
    """A static cache hands every layer its whole buffer: unfilled slots are masked by the causal
    q_start, so the padding mask stays one interval per row."""
    model = _model("llama")
    ids, am = _batch()
    calls = _capture(monkeypatch)
    with torch.no_grad():
        model.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    for c in calls:
        causal, pad = sorted(_parts(c["mask"]), key=lambda p: type(p).__name__)
        assert isinstance(causal, M.Causal) and causal.q_start is not None
        assert isinstance(pad, M.KeyPadding) and pad.side == "left" and pad.lengths.tolist()[1] == c["k"][2] - 3


def test_key_padding_translation():
    v = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    p = hf_masks._key_padding(v, 5)
    assert p.side == "left" and p.lengths.tolist() == [3, 5]
    p = hf_masks._key_padding(torch.tensor([[True, True, False, False]]), 4)
    assert p.side == "right" and p.lengths.tolist() == [2]
    p = hf_masks._key_padding(torch.tensor([[False, True, False, True]]), 4)  # a hole: no interval
    assert p.valid is not None
    p = hf_masks._key_padding(torch.tensor([[False, True, True, False]]), 3)  # the tail is out of reach
    assert p.side == "left" and p.lengths.tolist() == [3]


def test_llama_prefill_without_padding_is_plain_causal(monkeypatch):
    model = _model("llama")
    calls = _capture(monkeypatch)
    with torch.no_grad():
        model(torch.randint(3, 96, (2, 5)))
    m = calls[0]["mask"]
    assert isinstance(m, M.Causal) and m.q_start is None  # bottom-right: SDPA's is_causal path
    assert attnkit.describe_call(torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), m) == "sdpa"


def test_dropout_reaches_attention_in_training_only(monkeypatch):
    model = _model("llama", attention_dropout=0.25)
    calls = _capture(monkeypatch)
    ids = torch.randint(3, 96, (2, 5))
    with torch.no_grad():
        model(ids)
        model.train()
        a, b = model(ids).logits, model(ids).logits
    assert {c["dropout_p"] for c in calls[:2]} == {0.0}
    assert {c["dropout_p"] for c in calls[2:]} == {0.25}
    assert not torch.equal(a, b)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_user_4d_masks(kind):
    """A prepared 4-D mask goes to the layers as given: bool True = attend (compared with "sdpa",
    which reads bool masks that way; "eager" adds a bool mask as 0/1), float added (compared
    with "eager"; transformers' minimum-value sentinel means masked)."""
    ours, peer, _ = _three("llama")
    if kind == "bool":
        peer.set_attn_implementation("sdpa")
    ids = torch.randint(3, 96, (2, 6))
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[3, 1] = False  # not causal: a real custom pattern
    allowed = allowed.expand(2, 1, 6, 6)
    mask = allowed if kind == "bool" else torch.zeros(2, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, peer(ids, attention_mask=mask).logits)


def test_output_attentions_equal_eager():
    ours, eager, _ = _three("qwen2")
    ids, am = _batch()
    with torch.no_grad():
        a = ours(ids, attention_mask=am, output_attentions=True).attentions
        e = eager(ids, attention_mask=am, output_attentions=True).attentions
    real = am.bool()[:, None, :, None]  # real query rows
    for wa, we in zip(a, e):
        torch.testing.assert_close(wa * real, we * real)


def test_packed_sequences_fall_back_to_a_dense_mask(monkeypatch):
    """position_ids that restart mark packed documents: transformers' own pattern, materialized."""
    ours, eager, _ = _three("llama")
    ids = torch.randint(3, 96, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    calls = _capture(monkeypatch)
    with torch.no_grad():
        kw = dict(position_ids=pos, use_cache=False)  # packing is detected without a cache
        torch.testing.assert_close(ours(ids, **kw).logits, eager(ids, **kw).logits)
    assert isinstance(calls[0]["mask"], M.Dense)


def test_import_attnkit_does_not_import_transformers():
    code = "import sys, attnkit, attnkit.nn, attnkit.integrations; assert 'transformers' not in sys.modules, 'imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_integration_without_transformers_says_what_to_install(tmp_path):
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    code = "import attnkit.integrations.transformers"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{attnkit.__path__[0]}/.."})
    assert res.returncode != 0 and "pip install 'attnkit[hf]'" in res.stderr


# ---------------------------------------------------------------------------- beyond the common path
# Tiny random configs of any decoder in the installed transformers: each size field the config
# class has is shrunk (MLA models keep one KV head per query head, as their latent expands).

_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, ffn_hidden_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
             n_routed_experts=4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             index_topk=3, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
             swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
             d_rel=8, rel_extent=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, shared_expert_intermediate_size=16, hc_lowrank=8,
             unpadded_vocab_size=96, initializer_range=0.2, attention_dropout=0.0)
_TINY_EXTRA = {  # fields without a usable default at this size
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
}


def _has_model(model_type: str) -> bool:
    return model_type in transformers.CONFIG_MAPPING


def _tiny_config(model_type: str, **over):
    if not _has_model(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    cls = transformers.CONFIG_MAPPING[model_type]
    default = cls()
    c = {k: v for k, v in _TINY.items() if hasattr(default, k) and not isinstance(getattr(cls, k, None), property)}
    if hasattr(default, "kv_lora_rank"):
        c["num_key_value_heads"] = c["num_attention_heads"]
    for k, v in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if getattr(default, k, None) is not None:
            c[k] = v
    for k in ("layer_types", "mlp_layer_types"):  # two layers, of different kinds where the model has several
        kinds = list(dict.fromkeys(getattr(default, k, None) or []))
        if kinds:
            c[k] = (kinds * 2)[:2]
    return cls(**{**c, **_TINY_EXTRA.get(model_type, {}), **over})


def _tiny(model_type: str, impl: str = "attnkit", **over):
    torch.manual_seed(0)
    config = _tiny_config(model_type, **over)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def _qkv(B=2, Hq=4, Hkv=2, Sq=5, Sk=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Sq, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g),
            torch.randn(B, Hkv, Sk, D, generator=g))


class _Layer(torch.nn.Module):
    is_causal = True


# -- 1. keyword arguments: implemented, harmless, or refused by name


@pytest.mark.parametrize("name, value", [
    ("topk_indices", torch.zeros(2, 5, 3, dtype=torch.long)),
    ("some_new_argument", 1.5),
    ("a_flag", False),
], ids=["topk_indices", "unknown-float", "unknown-false"])
def test_unknown_keyword_argument_is_refused_naming_it(name, value):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=rf"{name}=.*_Layer.*attn_implementation='eager'"):
        hf.attention_forward(_Layer(), q, k, v, None, **{name: value})


def test_unknown_keyword_argument_that_is_none_is_ignored():
    q, k, v = _qkv()
    want, _ = hf.attention_forward(_Layer(), q, k, v, None)
    got, _ = hf.attention_forward(_Layer(), q, k, v, None, block_indices=None, some_new_argument=None)
    assert torch.equal(got, want)


def test_harmless_keyword_arguments_leave_the_output_unchanged():
    q, k, v = _qkv()
    given = {name: torch.arange(5)[None] if "seq" in name or "position" in name else 1
             for name in hf.HARMLESS_KWARGS}
    given.update(use_cache=True, cache=transformers.DynamicCache(), output_hidden_states=True)
    want, _ = hf.attention_forward(_Layer(), q, k, v, None)
    got, _ = hf.attention_forward(_Layer(), q, k, v, None, **given)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["sinks", "s_aux"])
def test_per_head_sinks_join_the_softmax(name):
    q, k, v = _qkv()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got, _ = hf.attention_forward(_Layer(), q, k, v, None, **{name: sinks})
    want = attnkit.attention_reference(q.double(), k.double(), v.double(), causal=True, sinks=sinks.double())
    torch.testing.assert_close(got, want.float().transpose(1, 2))
    assert not torch.allclose(got, hf.attention_forward(_Layer(), q, k, v, None)[0])  # the sinks did something


def test_per_query_sinks_join_the_softmax():
    """Inkling 2 passes one sink logit per query, (B, Hq, Sq, 1): each joins its own row's softmax."""
    q, k, v = _qkv()
    sinks = torch.randn(2, 4, 5, 1, generator=torch.Generator().manual_seed(3))
    got, _ = hf.attention_forward(_Layer(), q, k, v, None, sinks=sinks)
    want = attnkit.attention_reference(q.double(), k.double(), v.double(), causal=True, sinks=sinks.double())
    torch.testing.assert_close(got, want.float().transpose(1, 2))
    with pytest.raises(NotImplementedError, match=r"sinks=.*one per query.*\(2, 4, 3, 1\)"):
        hf.attention_forward(_Layer(), q, k, v, None, sinks=torch.zeros(2, 4, 3, 1))


def test_minimax_m3_without_sparse_layers_is_served():
    ours = _tiny("minimax_m3_vl_text", layer_types=["full_attention", "full_attention"])
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids, am = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=am).logits[am.bool()],
                                   eager(ids, attention_mask=am).logits[am.bool()])


def test_sparse_indices_keep_only_the_selected_keys():
    """DeepSeek sparse attention's (B, Sq, k) top-k indices: keys outside them are masked."""
    q, k, v = _qkv(Sq=4, Sk=6)
    idx = torch.tensor([[0, 2], [1, 5], [3, 3], [4, -1]]).expand(2, 4, 2)  # -1: an unused slot
    got, _ = hf.attention_forward(_Layer(), q, k, v, None, indices=idx, is_causal=False)
    keep = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    for i, row in enumerate(idx[0].tolist()):
        keep[:, :, i, [j for j in row if j >= 0]] = True
    want = attnkit.attention_reference(q.double(), k.double(), v.double(), keep)
    torch.testing.assert_close(got, want.float().transpose(1, 2))


def _mask_leaves(mask) -> list:
    """The leaf masks of an And / Or tree."""
    if isinstance(mask, (M.And, M.Or)):
        return [leaf for m in mask.masks for leaf in _mask_leaves(m)]
    return [mask]


def _record_masks(monkeypatch) -> list:
    """A list that collects the mask of every attnkit.attention call the integration makes."""
    seen, real = [], hf_attention.attention

    def recording(q, k, v, mask, **kw):
        seen.append(mask)
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(hf_attention, "attention", recording)
    return seen


def test_sparse_indices_reach_attention_as_a_selection_not_a_dense_mask(monkeypatch):
    """``indices=`` becomes a SelectedKeys ANDed with the translated mask: the integration builds
    no (Sq, Sk) tensor for it."""
    seen = _record_masks(monkeypatch)
    q, k, v = _qkv(Sq=4, Sk=6)
    idx = torch.tensor([[0, 2], [1, 5], [3, 3], [4, -1]]).expand(2, 4, 2)
    hf.attention_forward(_Layer(), q, k, v, None, indices=idx)
    leaves = _mask_leaves(seen[0])
    assert [type(m) for m in leaves] == [M.Causal, M.SelectedKeys] and leaves[1].indices.shape == (2, 4, 2)


class _BlockLayer(_Layer):
    class indexer:  # noqa: N801 - MiniMax-M3's attention layer holds its indexer here
        block_size = 2


def test_sparse_block_indices_keep_only_the_selected_blocks():
    """MiniMax-M3's (B, H_sel, Sq, n) block ids, one list per KV group, of the layer's
    ``indexer.block_size`` keys: keys outside the listed blocks are masked, as transformers'
    ``build_block_mask`` does, and the causal mask still applies."""
    q, k, v = _qkv(Sq=4, Sk=6)
    ids = torch.tensor([[[0, -1], [1, 0], [1, 1], [2, -1]], [[2, 0], [0, -1], [1, -1], [-1, -1]]])  # (Hkv, Sq, n)
    ids = ids.expand(2, 2, 4, 2)
    got, _ = hf.attention_forward(_BlockLayer(), q, k, v, None, block_indices=ids)
    keep = torch.zeros(2, 4, 4, 6, dtype=torch.bool)
    for h in range(4):
        for i, row in enumerate(ids[0, h // 2].tolist()):
            for blk in row:
                if blk >= 0:
                    keep[:, h, i, 2 * blk:2 * blk + 2] = True
    keep &= torch.ones(4, 6, dtype=torch.bool).tril(2)  # bottom-right causal: Sk - Sq = 2 keys before
    want = attnkit.attention_reference(q.double(), k.double(), v.double(), keep)
    torch.testing.assert_close(got, want.float().transpose(1, 2))
    with pytest.raises(NotImplementedError, match=r"block_indices=.*names no block size"):
        hf.attention_forward(_Layer(), q, k, v, None, block_indices=ids)


_MINIMAX_SPARSE = dict(layer_types=["minimax_m3_sparse", "full_attention"], index_block_size=2, index_topk_blocks=2,
                       index_local_blocks=1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_minimax_m3_sparse_layers_match_eager(cache, monkeypatch):
    """MiniMax-M3's sparse layers (blocks of 2 keys, the top 2 blocks per query and KV group, the
    local block among them): logits and greedy tokens equal eager's, and the layers hand
    attention() a SelectedBlocks, no dense mask. The batch is unpadded: the model's indexer
    anchors blocks to positions, so under left padding a query's blocks can all be padding, a
    row with no key (0 on attnkit, the mean of every value on eager; see the integration's
    docstring)."""
    ours = _tiny("minimax_m3_vl_text", **_MINIMAX_SPARSE)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids, am = _batch(lengths=(11, 11))
    seen = _record_masks(monkeypatch)
    with torch.no_grad():
        lo, le = ours(ids, attention_mask=am).logits, eager(ids, attention_mask=am).logits
        kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
        go, ge = ours.generate(ids, **kw), eager.generate(ids, **kw)
    real_pos = am.bool()
    torch.testing.assert_close(lo[real_pos], le[real_pos])
    assert go.tolist() == ge.tolist()
    kinds = [{type(m) for m in _mask_leaves(mask)} for mask in seen]
    assert any(M.SelectedBlocks in k for k in kinds) and not any(M.Dense in k for k in kinds)
    blocks = next(m for mask in seen for m in _mask_leaves(mask) if isinstance(m, M.SelectedBlocks))
    assert (blocks.block_ids >= 0).sum(-1).max() == 2 and blocks.block_ids.shape[-1] == 2  # a selection, not all


# Inkling 2: per-query sinks (B, Hq, Sq, 1) from each token's hidden state, a relative-position
# bias, sliding and full layers, and block-residual attention over the layers' outputs (no mask).
INKLING = ["inkling2_text", "inkling2_loop_text"]


def _three_tiny(model_type, **over):
    """attnkit, eager and the gold with the same weights, as :func:`_three`, except that the gold
    is an fp32 copy whose attention is the fp64 oracle over transformers' materialized masks:
    Inkling 2 casts its router, block residuals and logits to fp32 itself, so it cannot run in
    fp64; the three then share every other op bit for bit, and rule R measures attention alone."""
    ours = _tiny(model_type, **over)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    gold = copy.deepcopy(eager)
    gold.set_attn_implementation("reference64")
    return ours, eager, gold


@pytest.mark.parametrize("model_type", INKLING)
def test_inkling2_logits_rule_r(model_type, monkeypatch):
    ours, eager, gold = _three_tiny(model_type)
    seen = []
    real = hf_attention.attention
    monkeypatch.setattr(hf_attention, "attention", lambda *a, **kw: seen.append(kw.get("sinks")) or real(*a, **kw))
    ids, am = _batch()
    with torch.no_grad():
        lo, le, lg = (m(ids, attention_mask=am).logits for m in (ours, eager, gold))
    assert any(s is not None and s.shape == (2, 4, ids.shape[1], 1) for s in seen)  # the per-query sinks arrived
    real_pos = am.bool()
    rule_r(lo[real_pos], le[real_pos], lg[real_pos], n_terms=_TINY["hidden_size"] * _TINY["num_hidden_layers"],
           what="logits")


@pytest.mark.parametrize("cache, layer_types", [
    ("dynamic", None),
    ("static", ["hybrid", "hybrid"]),
    ("static", ["hybrid_sliding", "hybrid_sliding"]),
], ids=["dynamic", "static-full", "static-sliding"])
@pytest.mark.parametrize("model_type", INKLING)
def test_inkling2_generate_greedy_same_tokens_as_eager(model_type, cache, layer_types):
    """Static caches with one kind of layer: with sliding and full layers mixed, transformers'
    eager path itself fails on a static cache (its sliding layers get keys shorter than the mask)."""
    over = {} if layer_types is None else dict(layer_types=layer_types)
    ours = _tiny(model_type, **over)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids, am = _batch(2)
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), eager.generate(ids, **kw)
    assert got.shape[1] == ids.shape[1] + 8  # past the window of 4
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("model_type", INKLING)
def test_inkling2_training_gradients_rule_r(model_type):
    """Gradients of every parameter, the sink projections (through the per-query sinks) included."""
    ids, am = _batch(3)
    checked = _gradients_rule_r(*_three_tiny(model_type), ids, am, _TINY["hidden_size"])
    assert any("sink_proj" in name for name in checked)


def test_minimax_m3_sparse_training_gradients_rule_r():
    """Gradients of every parameter through MiniMax-M3's block selection (a SelectedBlocks on the
    backends that take gradients), under rule R against the fp64 oracle."""
    ids, am = _batch(lengths=(11, 11))
    checked = _gradients_rule_r(*_three_tiny("minimax_m3_vl_text", **_MINIMAX_SPARSE), ids, am, _TINY["hidden_size"])
    assert len(checked) > 10


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indices_reach_attention_as_a_selection(model_type, monkeypatch):
    """DeepSeek sparse attention models hand attention() their top-k as a SelectedKeys ANDed with
    the typed mask (no Dense part), and still match eager (see test_models_that_read_the_mask_match_eager)."""
    ours = _tiny(model_type)
    seen = _record_masks(monkeypatch)
    ids, am = _batch(lengths=(9, 6))
    with torch.no_grad():
        ours(ids, attention_mask=am)
    kinds = [{type(m) for m in _mask_leaves(mask)} for mask in seen]
    assert kinds and all(M.SelectedKeys in k and M.Dense not in k for k in kinds), kinds


# -- 2. models that read the mask object themselves; models attnkit cannot serve

MASK_READERS = ["deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "doge", "qwen4_exp_text"]


@pytest.mark.parametrize("model_type", MASK_READERS)
def test_models_that_read_the_mask_match_eager(model_type):
    """They slice the mask (DeepSeek sparse attention's indexer reads ``mask[:, 0]``), branch on
    its ``dtype`` or build their own mask from it: the AttnkitMask materializes for them."""
    ours = _tiny(model_type)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids, am = _batch(lengths=(9, 6))
    with torch.no_grad():
        lo, le = ours(ids, attention_mask=am).logits, eager(ids, attention_mask=am).logits
        kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
        go, ge = ours.generate(ids, **kw), eager.generate(ids, **kw)
    real = am.bool()
    torch.testing.assert_close(lo[real], le[real])
    assert go.tolist() == ge.tolist()


def _mask_args(case):
    """make_mask / sdpa_mask keyword arguments of a few situations (what create_causal_mask passes)."""
    am = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # made bool before the call
    if case == "prefill-left-padding":
        return dict(batch_size=2, q_length=7, kv_length=7, attention_mask=am)
    if case == "decode-static-cache":  # the whole buffer, unfilled slots past the 2-D mask
        return dict(batch_size=2, q_length=1, kv_length=12, q_offset=7, attention_mask=am)
    if case == "chunk-sliding-window":
        fn = transformers.masking_utils.sliding_window_causal_mask_function(3)
        return dict(batch_size=2, q_length=3, kv_length=7, q_offset=4, attention_mask=am, mask_function=fn,
                    local_size=3)
    if case == "bidirectional":
        return dict(batch_size=2, q_length=7, kv_length=7, attention_mask=am,
                    mask_function=transformers.masking_utils.bidirectional_mask_function)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["prefill-left-padding", "decode-static-cache", "chunk-sliding-window",
                                  "bidirectional"])
def test_attnkit_mask_materializes_to_transformers_sdpa_mask(case):
    args = _mask_args(case)
    m = hf.make_mask(**args)
    want = transformers.masking_utils.sdpa_mask(**args, allow_is_causal_skip=False)
    typed = m.mask
    assert want.dtype == m.dtype == torch.bool and m.shape == want.shape and m.device == want.device
    assert torch.equal(m.materialize(), want)
    # what models do with it, answered by the tensor SDPA would have handed them
    assert torch.equal(m[:, 0, :, :], want[:, 0])
    assert torch.equal(~m, ~want) and torch.equal(m & want.flip(-1), want & want.flip(-1))
    scores = torch.randn(want.shape)
    assert torch.equal(scores.masked_fill(~m, -1.0), scores.masked_fill(~want, -1.0))
    assert torch.equal(torch.where(m, 0.0, -1.0), torch.where(want, 0.0, -1.0))
    assert torch.equal(m.masked_fill(m, False), torch.zeros_like(want))
    assert m.mask is typed  # the layers still get the typed mask


def test_attnkit_mask_builds_nothing_for_models_that_pass_it_on(monkeypatch):
    model = _model("llama")
    built = []
    monkeypatch.setattr(hf.AttnkitMask, "materialize", lambda self: built.append(self))
    ids, am = _batch()
    with torch.no_grad():
        model.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert built == []


def test_deepseek_v4_matches_eager(monkeypatch):
    """Its compressed layers append keys after the cache update and extend the mask over them with
    their compressor's block bias, only when the mask is eager's float tensor: the mask function
    hands it that (EAGER_MASK_MODEL_TYPES). Logits (left-padded batch, the CSA layer's compressed
    keys included), greedy tokens with a dynamic cache and training gradients equal eager's. (With
    a static cache transformers' eager path itself fails: the cache has no compressed layer type.)"""
    ours = _tiny("deepseek_v4")
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    seen = _record_masks(monkeypatch)
    ids, am = _batch(lengths=(9, 6))
    with torch.no_grad():
        lo, le = ours(ids, attention_mask=am).logits, eager(ids, attention_mask=am).logits
        kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
        go, ge = ours.generate(ids, **kw), eager.generate(ids, **kw)
    real = am.bool()
    torch.testing.assert_close(lo[real], le[real])
    assert go.tolist() == ge.tolist()
    assert any(m.tensor.shape[-1] > ids.shape[1] for m in seen if isinstance(m, M.Dense))  # compressed keys masked too
    ids, am = _batch(3)
    labels = ids.masked_fill(am == 0, -100)
    for m in (ours, eager):
        m.train()
        m(ids, attention_mask=am, labels=labels).loss.backward()
    for (name, po), pe in zip(ours.named_parameters(), eager.parameters()):
        if pe.grad is not None:
            torch.testing.assert_close(po.grad, pe.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_model_types_on_the_unserved_list_are_refused_when_built(monkeypatch):
    """A model type listed in refusals._UNSERVED_MODEL_TYPES is refused when built and when an
    eager model is switched to attnkit, with an error naming the model and the reason."""
    from attnkit.integrations.transformers import refusals
    monkeypatch.setitem(refusals._UNSERVED_MODEL_TYPES, "llama", (lambda config: True, "needs what attnkit lacks"))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(llama\) needs what attnkit lacks"):
        _model("llama")
    model = _model("llama", "eager")
    with pytest.raises(ValueError, match=r"\(llama\) needs what.*attn_implementation='sdpa' or 'eager'"):
        model.set_attn_implementation("attnkit")


def test_empty_sliding_window_is_left_to_sdpa_mask():
    """Qwen2-MoE configs without windowed layers say sliding_window=0; transformers still builds
    that (unused) window mask, which attnkit hands to sdpa_mask rather than rejecting it."""
    ours = _tiny("qwen2_moe")
    assert ours.config.sliding_window == 0
    sdpa = copy.deepcopy(ours)
    sdpa.set_attn_implementation("sdpa")
    ids, am = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=am).logits[am.bool()],
                                   sdpa(ids, attention_mask=am).logits[am.bool()])


@pytest.mark.parametrize("model_type, cls", [("bloom", "BloomForCausalLM"), ("falcon", "FalconForCausalLM")])
def test_models_without_the_attention_interface_are_refused_when_built(model_type, cls):
    """BLOOM and Falcon compute attention in their own code: attnkit would only build their
    masks (Falcon then fails inside transformers, BLOOM adds the mask object to its scores)."""
    config = _tiny_config(model_type)
    with pytest.raises(ValueError, match=rf"{cls} \({model_type}\) computes attention in its own code"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert hf.unserved_reason(model) is not None
    assert hf.unserved_reason(_model("llama")) is None


def test_models_with_a_table_of_attention_classes_are_refused_when_built():
    """GIT picks its attention class from GIT_SELF_ATTENTION_CLASSES (eager only), which attnkit
    gets an entry in that raises, instead of transformers' bare KeyError: 'attnkit'."""
    config = _tiny_config("git")
    with pytest.raises(ValueError, match=r"GitForCausalLM \(git\) builds attention layers from "
                                         r"GIT_SELF_ATTENTION_CLASSES.*\('eager',\)"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    assert transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager") is not None


def test_registering_again_checks_every_name_without_stacking_wrappers():
    name = hf.register("attnkit-again")
    fn = transformers.PreTrainedModel.get_correct_attn_implementation
    assert not hasattr(fn.attnkit_original, "attnkit_original")  # one wrapper, around transformers' own
    with pytest.raises(ValueError, match="BloomForCausalLM"):
        transformers.AutoModelForCausalLM.from_config(_tiny_config("bloom"), attn_implementation=name)
    assert _tiny("llama", name).config._attn_implementation == name


# -- 3. output_attentions for models that do not pass the flag down


@pytest.mark.parametrize("model_type", ["gpt2", "stablelm", "gpt_bigcode", "nemotron", "opt", "persimmon"])
def test_output_attentions_for_models_that_drop_the_flag(model_type):
    ours = _tiny(model_type)
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids, am = _batch()
    with torch.no_grad():
        assert ours(ids, attention_mask=am).attentions is None  # not computed unless asked for
        a = ours(ids, attention_mask=am, output_attentions=True).attentions
        e = eager(ids, attention_mask=am, output_attentions=True).attentions
    assert a is not None and len(a) == len(e) == 2
    real = am.bool()[:, None, :, None]  # real query rows
    for wa, we in zip(a, e):
        torch.testing.assert_close(wa * real, we * real)


# -- 4. a float 4-D mask whose query row is all transformers' minimum


def test_float_mask_row_of_minimum_outputs_zero():
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 5, 5)
    mask[:, :, 2] = torch.finfo(torch.float32).min
    out, _ = hf.attention_forward(_Layer(), q, k, v, mask)
    assert (out[:, 2] == 0).all() and (out[:, :2] != 0).all()


def _row_masked(row, column_too):
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[row] = False
    if column_too:
        allowed[:, row] = False
    allowed = allowed.expand(2, 1, 6, 6)
    return allowed, torch.zeros(2, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_float_mask_minimum_means_masked_as_a_bool_mask():
    """The float mask gives what the bool mask of its finite entries gives, at every position,
    and that equals sdpa's with the bool mask (sdpa also outputs 0 for a row of False)."""
    ours, sdpa, _ = _three("llama")
    sdpa.set_attn_implementation("sdpa")
    allowed, floats = _row_masked(2, column_too=False)
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        by_float = ours(ids, attention_mask=floats).logits
        torch.testing.assert_close(by_float, ours(ids, attention_mask=allowed).logits, rtol=0, atol=0)
        torch.testing.assert_close(by_float, sdpa(ids, attention_mask=allowed).logits)


def test_fully_masked_query_reaches_only_positions_that_attend_to_it():
    """eager (and sdpa) with the float mask give the masked row the mean of every value, attnkit
    0. Later positions that may attend to that row's position see the difference in the next
    layer; with the position hidden from them as a key (as transformers' padding masks do),
    every other position equals eager's."""
    ours, eager, _ = _three("llama")
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        _, visible = _row_masked(2, column_too=False)
        lo, le = ours(ids, attention_mask=visible).logits, eager(ids, attention_mask=visible).logits
        torch.testing.assert_close(lo[:, :2], le[:, :2])  # before the row: unaffected
        assert not torch.allclose(lo[:, 3:], le[:, 3:], atol=1e-3)  # they attend to position 2
        _, hidden = _row_masked(2, column_too=True)
        lo, le = ours(ids, attention_mask=hidden).logits, eager(ids, attention_mask=hidden).logits
        others = [0, 1, 3, 4, 5]
        torch.testing.assert_close(lo[:, others], le[:, others])


# -- 5. the transformers versions the hf extra admits


def test_installed_transformers_is_in_the_extras():
    """The extras bound transformers to the versions this suite has run on (lower) and below the
    next major (upper; see docs/integrations.md). Running the suite on a version outside the
    range fails here first, so the range moves together with a test run, never ahead of one."""
    import re
    from pathlib import Path

    from packaging.requirements import Requirement

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    specs = {str(Requirement(r).specifier) for r in re.findall(r'"(transformers[^"]*)"', text)}
    assert len(specs) == 1, f"every extra should name the same transformers range, got {specs}"
    spec = Requirement(f"transformers{specs.pop()}").specifier
    assert any(s.operator == "<" for s in spec), f"no upper bound in {spec}"
    assert spec.contains(transformers.__version__), f"transformers {transformers.__version__} is outside {spec}"
