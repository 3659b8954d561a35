"""attn_implementation="attnkit" in Hugging Face transformers, on random tiny models of six
families: logits on a left-padded batch (rule R: attnkit vs "eager" against an fp64 eager copy),
greedy generate tokens with dynamic and static caches, training gradients, dropout, typed
masks, user 4-D masks, output_attentions, and the optional-dependency contract."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.integrations.transformers as hf  # noqa: E402
from attnkit import masks as M  # noqa: E402
from conftest import rule_r  # noqa: E402

_PARAMS = inspect.signature(attnkit.attention).parameters
NEEDS_SOFTCAP = pytest.mark.skipif("softcap" not in _PARAMS,
                                   reason="attnkit.attention has no softcap= yet (Gemma 2's attn_logit_softcapping)")
NEEDS_SINKS = pytest.mark.skipif("sinks" not in _PARAMS,
                                 reason="attnkit.attention has no sinks= yet (gpt-oss' per-head sink logits)")

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
    pytest.param("gemma2", id="gemma2", marks=NEEDS_SOFTCAP),
    pytest.param("gpt_oss", id="gpt_oss", marks=NEEDS_SINKS),
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
                         s_aux=None, **kwargs):
    """The gold: attnkit's fp64 oracle over transformers' own materialized bool mask."""
    extra = {k: v for k, v in (("softcap", softcap), ("sinks", s_aux)) if v is not None}
    out = attnkit.attention_reference(query, key, value, attention_mask, scale=scaling, **extra)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_rule_r(family):
    ours, eager, gold = _three(family)
    ids, am = _batch(3)
    labels = ids.masked_fill(am == 0, -100)
    for m in (ours, eager, gold):
        m.train()
        m(ids, attention_mask=am, labels=labels).loss.backward()
    n = ids.numel() * _COMMON["hidden_size"]
    for (name, po), pe, pg in zip(ours.named_parameters(), eager.parameters(), gold.parameters()):
        if pg.grad is None:
            continue
        rule_r(po.grad, pe.grad, pg.grad, factor=3.0, n_terms=n, what=f"grad {name}")


def _capture(monkeypatch):
    calls = []
    real = hf.attention

    def spy(q, k, v, mask=None, **kw):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), mask=mask, **kw))
        return real(q, k, v, mask, **kw)
    monkeypatch.setattr(hf, "attention", spy)
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
    offsets, so the padding mask stays one interval per row."""
    model = _model("llama")
    ids, am = _batch()
    calls = _capture(monkeypatch)
    with torch.no_grad():
        model.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    for c in calls:
        causal, pad = sorted(_parts(c["mask"]), key=lambda p: type(p).__name__)
        assert isinstance(causal, M.Causal) and causal.offsets is not None
        assert isinstance(pad, M.KeyPadding) and pad.side == "left" and pad.lengths.tolist()[1] == c["k"][2] - 3


def test_key_padding_translation():
    v = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    p = hf._key_padding(v, 5)
    assert p.side == "left" and p.lengths.tolist() == [3, 5]
    p = hf._key_padding(torch.tensor([[True, True, False, False]]), 4)
    assert p.side == "right" and p.lengths.tolist() == [2]
    p = hf._key_padding(torch.tensor([[False, True, False, True]]), 4)  # a hole: no interval
    assert p.valid is not None
    p = hf._key_padding(torch.tensor([[False, True, True, False]]), 3)  # the tail is out of reach
    assert p.side == "left" and p.lengths.tolist() == [3]


def test_llama_prefill_without_padding_is_plain_causal(monkeypatch):
    model = _model("llama")
    calls = _capture(monkeypatch)
    with torch.no_grad():
        model(torch.randint(3, 96, (2, 5)))
    m = calls[0]["mask"]
    assert isinstance(m, M.Causal) and m.offsets is None  # bottom-right: SDPA's is_causal path
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


def test_missing_softcap_or_sinks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(hf, "_ATTENTION_PARAMS", frozenset({"q", "k", "v"}))
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="softcap="):
        hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="sinks="):
        hf.attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


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
