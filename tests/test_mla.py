"""Multi-head latent attention: naive and absorbed paths agree (fp64 1e-10, bf16 rule R, forward
and backward); the latent cache gives what one full forward gives (prefill + decode, chunked
prefill, ragged batches, static and dynamic, crop and reorder); bad configs and caches fail
clearly. Hugging Face parity lives in tests/test_interop_deepseek.py."""

from __future__ import annotations

import copy
import math
import pickle
from dataclasses import FrozenInstanceError

import pytest
import torch

import attnkit
from attnkit import DynamicCache, StaticCache
from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention
from conftest import rule_r

# Odd sizes on purpose: v != nope, a rope dim that is not a power of two, rank != hidden.
DIMS = dict(hidden_size=40, num_heads=4, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
        "mscale_all_dim": 0.7}


def _config(q_lora=12, yarn=False, **kw):
    return MLAConfig(**DIMS, q_lora_rank=q_lora, rope_scaling=YARN if yarn else None, max_position_embeddings=32, **kw)


def _module(q_lora=12, yarn=False, mode="auto", dtype=torch.float32, seed=0, **kw):
    m = MultiHeadLatentAttention(_config(q_lora, yarn, **kw), mode=mode)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # std 0.3: peaked attention, norms that are not all ones
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return m.to(dtype).eval()


def _with_mode(m, mode):
    m2 = copy.deepcopy(m)
    m2.mode = mode
    return m2


def _grads(m, x):
    return {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw,exc,text", [
    (dict(qk_rope_head_dim=7), ValueError, r"qk_rope_head_dim \(7\) must be even"),
    (dict(kv_lora_rank=0), ValueError, "kv_lora_rank must be a positive int, got 0"),
    (dict(num_heads=0), ValueError, "num_heads must be a positive int"),
    (dict(v_head_dim=2.0), ValueError, "v_head_dim must be a positive int, got 2.0"),
    (dict(q_lora_rank=0), ValueError, "q_lora_rank must be a positive int or None"),
    (dict(attention_dropout=1.0), ValueError, "attention_dropout"),
    (dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps"),
    (dict(rope_interleave=1), TypeError, "rope_interleave must be a bool"),
    (dict(rope_scaling=[("rope_type", "yarn")]), TypeError, "rope_scaling must be a dict"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "betta_fast": 3}), ValueError, "invalid RoPE.*betta_fast"),
    (dict(rope_scaling={"rope_type": "ntk"}), ValueError, "invalid RoPE.*'ntk'"),
    (dict(rope_theta=1.0), ValueError, r"invalid RoPE.*rope_theta"),
])
def test_bad_config(kw, exc, text):
    args = {**DIMS, **kw}
    with pytest.raises(exc, match=text):
        MLAConfig(**args)


def test_config_is_frozen_derived_and_picklable():
    c = _config(yarn=True)
    assert (c.qk_head_dim, c.latent_dim) == (14, 26)
    m = 0.1 * 0.7 * math.log(4.0) + 1.0  # YaRN mscale(factor, mscale_all_dim), squared into the scale
    assert c.softmax_scale == pytest.approx(14 ** -0.5 * m * m, rel=1e-14)
    assert _config().softmax_scale == 14 ** -0.5
    assert c.rope.attention_scaling == pytest.approx((0.1 * math.log(4.0) + 1) / m)  # cos/sin factor
    with pytest.raises(FrozenInstanceError):
        c.num_heads = 8
    with pytest.raises(TypeError):
        c.rope_scaling["factor"] = 2.0  # read-only view: the config cannot change under a module
    assert pickle.loads(pickle.dumps(c)) == c and hash(_config(yarn=True)) == hash(c)
    m2 = copy.deepcopy(_module(yarn=True))  # deepcopy / torch.save(model) need picklable configs
    assert m2.config == c


def test_parameter_names_follow_hugging_face():
    assert set(_module(q_lora=12).state_dict()) == {
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert set(_module(q_lora=None, attention_bias=True).state_dict()) == {
        "q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
        "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"}


# --------------------------------------------------------------------------- naive vs absorbed


def _mask_case(kind, B, S):
    g = torch.Generator().manual_seed(3)
    if kind == "none":
        return {}
    if kind == "key_padding":
        kpm = torch.zeros(B, S, dtype=torch.bool)
        kpm[1, :4] = True  # left padding of sequence 1
        return {"key_padding_mask": kpm}
    if kind == "bool":
        return {"mask": torch.rand(B, 1, S, S, generator=g) > 0.3}
    if kind == "additive":
        return {"mask": torch.randn(B, DIMS["num_heads"], S, S, generator=g, dtype=torch.float64)}
    raise AssertionError(kind)


@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "bool", "additive"])
@pytest.mark.parametrize("q_lora,yarn", [(12, False), (None, True)], ids=["q_lora-rope", "no_q_lora-yarn"])
def test_naive_equals_absorbed_fp64_forward_and_backward(q_lora, yarn, mask_kind):
    naive = _module(q_lora, yarn, "naive", torch.float64)
    absorb = _with_mode(naive, "absorb")
    B, S = 2, 19
    x = torch.randn(B, S, 40, dtype=torch.float64)
    kw = _mask_case(mask_kind, B, S)
    outs, grads = [], []
    for m in (naive, absorb):
        xx = x.clone().requires_grad_(True)
        out = m(xx, **kw)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view_as(out))
        outs.append(out)
        grads.append(_grads(m, xx))
    assert (outs[0] - outs[1]).abs().max() <= 1e-10
    for name in grads[0]:
        assert grads[0][name] is not None and grads[0][name].abs().max() > 0, name  # every weight is used
        assert (grads[0][name] - grads[1][name]).abs().max() <= 1e-10, name


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_naive_equals_absorbed_fp64_with_cache_and_weights(kind):
    naive = _module(None, True, "naive", torch.float64)
    absorb = _with_mode(naive, "absorb")
    x = torch.randn(2, 14, 40, dtype=torch.float64)
    res = []
    for m in (naive, absorb):
        cache = m.new_cache(kind, max_batch=2, max_len=16)
        o1, w1 = m(x[:, :9], cache=cache, need_weights=True)
        o2, w2 = m(x[:, 9:], cache=cache, need_weights=True)
        res.append((o1, w1, o2, w2))
    for a, b in zip(*res):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-10
    w = res[0][3]
    assert w.shape == (2, 4, 5, 14 if kind == "dynamic" else 16) and w.dtype == torch.float64
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))


class _Eager(torch.nn.Module):
    """The plain eager MLA everyone writes (Hugging Face's eager path): per-head K/V expanded in
    the input dtype, scores by a matmul in that dtype, softmax in fp32, probabilities cast back."""

    def forward(self, m, x):
        c = m.config
        B, S, _ = x.shape
        q = m.q_proj(x) if c.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
        q_nope, q_pe = q.view(B, S, c.num_heads, -1).transpose(1, 2).split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        c_kv, k_pe = m.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        q_pe, k_pe = m.rope(q_pe, k_pe[:, None], torch.arange(S)[None])
        kv = m.kv_b_proj(m.kv_a_layernorm(c_kv)).view(B, S, c.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe.expand(-1, c.num_heads, -1, -1)], -1)
        s = (q @ k.transpose(-1, -2)).float() * c.softmax_scale
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        return m.o_proj((s.softmax(-1).to(x.dtype) @ v).transpose(1, 2).flatten(2))


@pytest.mark.parametrize("dist", ["randn", "rand"])
@pytest.mark.parametrize("q_lora,yarn", [(12, True), (None, False)], ids=["q_lora-yarn", "no_q_lora-rope"])
def test_naive_and_absorbed_bf16_pass_rule_r(q_lora, yarn, dist):
    """Against the fp64 module (gold) and the eager bf16 MLA (base): rule R (``conftest.rule_r``) for the
    output (2x) and for the gradients of the input and of every weight (3x, like dq)."""
    gold_m = _module(q_lora, yarn, "naive", torch.float64, seed=5)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 23, 40, generator=g, dtype=torch.float64) if dist == "randn" else \
        torch.rand(2, 23, 40, generator=g, dtype=torch.float64) * 2
    dout = torch.randn(2, 23, 40, generator=g, dtype=torch.float64)
    res = {}
    for name in ("gold", "base", "naive", "absorb"):
        m = gold_m if name == "gold" else _with_mode(gold_m, "naive" if name == "base" else name).to(torch.bfloat16)
        xx = (x if name == "gold" else x.to(torch.bfloat16)).clone().requires_grad_(True)
        out = _Eager()(m, xx) if name == "base" else m(xx)
        out.backward(dout.to(out.dtype))
        res[name] = {"out": out, **_grads(m, xx)}
    for name in ("naive", "absorb"):
        for what, gold in res["gold"].items():
            rule_r(res[name][what], res["base"][what], gold, factor=2.0 if what == "out" else 3.0,
                   what=f"{name} {what}")


def test_dropout_in_training_only_and_identical_in_both_paths():
    naive = _module(12, False, "naive", torch.float64, attention_dropout=0.3)
    absorb = _with_mode(naive, "absorb")
    x = torch.randn(2, 11, 40, dtype=torch.float64)
    assert torch.equal(naive(x), naive(x))  # eval: no dropout
    outs = []
    for m in (naive, absorb):
        m.train()
        m.backend = "math"  # same RNG draws over the same (B, H, S, S) probabilities in both paths
        torch.manual_seed(11)
        outs.append(m(x))
    assert (outs[0] - outs[1]).abs().max() <= 1e-10
    assert (outs[0] - naive.eval()(x)).abs().max() > 1e-3  # dropout did something


@pytest.mark.parametrize("mode", ["naive", "absorb"])
def test_fully_masked_sequence_outputs_zero_with_finite_grads(mode):
    m = _module(12, False, mode)
    x = torch.randn(2, 6, 40, requires_grad=True)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True  # sequence 1 may attend to nothing
    out = m(x, key_padding_mask=kpm)
    assert (out[1] == 0).all() and (out[0] != 0).any()
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())


# --------------------------------------------------------------------------- latent cache


@pytest.mark.parametrize("mode", ["auto", "naive", "absorb"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_prefill_then_decode_and_chunked_prefill_equal_full_forward(kind, mode):
    m = _module(None, True, mode)
    x = torch.randn(2, 25, 40)
    with torch.no_grad():
        full = m(x)
        for splits in ([17] + [1] * 8, [6, 6, 6, 7], [1, 9, 2, 13]):  # prefill + decode; chunked prefill
            cache = m.new_cache(kind, max_batch=2, max_len=28)
            outs, t = [], 0
            for n in splits:
                outs.append(m(x[:, t:t + n], cache=cache))
                t += n
            assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5, splits
            assert cache.lengths.tolist() == [25, 25]


@pytest.mark.parametrize("mode", ["auto", "naive", "absorb"])
def test_ragged_left_padded_batch_equals_each_sequence_alone(mode):
    m = _module(12, True, mode)
    lens, P, steps = [4, 9], 9, 4
    seqs = [torch.randn(1, n + steps, 40) for n in lens]
    # Left-padded prompts (Hugging Face style): padding first, positions count real tokens only.
    prompt = torch.cat([torch.cat([torch.full((1, P - n, 40), 1e3), s[:, :n]], 1) for s, n in zip(seqs, lens)])
    valid = torch.tensor([[j >= P - n for j in range(P)] for n in lens])
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    cache = m.new_cache()
    with torch.no_grad():
        out = m(prompt, key_padding_mask=~valid, positions=pos, cache=cache)
        got = [[out[b:b + 1, P - n:]] for b, n in enumerate(lens)]
        for t in range(steps):
            x = torch.cat([s[:, n + t:n + t + 1] for s, n in zip(seqs, lens)])
            kpm = torch.cat([~valid, torch.zeros(2, t + 1, dtype=torch.bool)], 1)
            o = m(x, key_padding_mask=kpm, positions=torch.tensor([[n + t] for n in lens]), cache=cache)
            for b in range(2):
                got[b].append(o[b:b + 1])
        for b, s in enumerate(seqs):
            assert (torch.cat(got[b], 1) - m(s)).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_crop_rolls_back_and_reorder_follows_beams(kind):
    m = _module(None, False, "auto")
    x, alt = torch.randn(2, 12, 40), torch.randn(2, 3, 40)
    with torch.no_grad():
        cache = m.new_cache(kind, max_batch=2, max_len=16)
        m(x[:, :9], cache=cache)
        m(alt, cache=cache)  # three speculative tokens, all rejected
        cache.crop(-3)
        tail = [m(x[:, t:t + 1], cache=cache) for t in range(9, 12)]
        assert (torch.cat(tail, 1) - m(x)[:, 9:]).abs().max() <= 1e-5
        cache.reorder(torch.tensor([1, 1]))  # both beams continue sequence 1
        nxt = torch.randn(1, 1, 40).expand(2, 1, 40)
        out = m(nxt, cache=cache)
        want = m(torch.cat([x[1:], nxt[:1]], 1))[:, -1:]
        assert (out - want).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["auto", "naive", "absorb"])
def test_paged_latent_cache_plugs_in_unchanged(mode):
    """A paged cache in the value_from_key layout (its own ``attend`` over the blocks) gives what
    one full forward gives, through the same module code."""
    paged = pytest.importorskip("attnkit.caches.paged")
    m = _module(12, True, mode)
    x = torch.randn(2, 20, 40)
    with torch.no_grad():
        cache = paged.PagedKVCache(1, 26, 20, value_from_key=True, num_blocks=16, block_size=4)
        outs = [m(x[:, :13], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(13, 20)]
        assert (torch.cat(outs, 1) - m(x)).abs().max() <= 1e-5


def test_latent_cache_stores_576_values_per_token_at_deepseek_v3_dims():
    cfg = MLAConfig(hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, q_lora_rank=1536)
    m = MultiHeadLatentAttention(cfg, device="meta")  # no memory for the 187M weights
    cache = m.new_cache("static", max_batch=2, max_len=10, dtype=torch.bfloat16, device="cpu")
    assert (cache.num_kv_heads, cache.head_dim, cache.v_head_dim, cache.value_from_key) == (1, 576, 512, True)
    assert cache.bytes_per_token == 576 * 2
    assert cache.nbytes == 2 * 10 * 576 * 2  # K only: V is read from K's first 512 channels
    assert m.absorb_max_len == 170  # auto: absorbed below 171 new tokens (expansion vs wider dots)
    assert m.new_cache(dtype=torch.float32, device="cpu").bytes_per_token == 576 * 4


def test_cache_nbytes_grows_with_tokens_not_heads():
    m = _module(12)
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randn(3, 20, 40), cache=cache)
    assert cache.v_buf.numel() == 0
    assert cache.nbytes == 3 * cache.k_buf.shape[2] * 26 * 4 + cache.lengths.numel() * 8
    assert cache.bytes_per_token == 26 * 4


def test_auto_takes_the_absorbed_path_for_cached_steps_only(monkeypatch):
    m = _module(12, False, "auto")
    calls = []
    orig = m.expand_latent
    monkeypatch.setattr(m, "expand_latent", lambda lat: calls.append(lat.shape[2]) or orig(lat))
    cache = m.new_cache()
    big = m.absorb_max_len + 1
    with torch.no_grad():
        m(torch.randn(1, 5, 40))  # no cache (training, scoring): naive
        m(torch.randn(1, big, 40), cache=cache)  # long prefill: naive over the cache
        m(torch.randn(1, 1, 40), cache=cache)  # decode: absorbed, nothing expanded
        m(torch.randn(1, 3, 40), cache=cache)  # short chunk / speculative verification: absorbed
    assert calls == [5, big]
    assert [m.resolve_mode(n, c) for n, c in ((1, False), (1, True), (big, True))] == ["naive", "absorb", "naive"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_absorbed_decode_runs_on_the_grouped_decode_backend(dtype):
    """The absorbed step is MQA: 16 query heads over one latent head, D = 576, V = K[..., :512]."""
    k = torch.zeros(1, 1, 4096, 576, dtype=dtype)
    q = torch.zeros(1, 16, 1, 576, dtype=dtype)
    assert attnkit.describe_call(q, k, k[..., :512], causal=True) == "decode"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make_cache,exc,text", [
    (lambda: DynamicCache(4, 14, 10), ValueError, r"num_kv_heads=4.*needs num_kv_heads=1, head_dim=kv_lora_rank \+ "
                                                  r"qk_rope_head_dim = 20 \+ 6 = 26"),
    (lambda: DynamicCache(1, 26, 20), ValueError, "value_from_key=False"),
    (lambda: DynamicCache(1, 30, 24, value_from_key=True), ValueError, "head_dim=30"),  # another config's latent
    (lambda: StaticCache(1, 26, 20, max_batch=2, max_len=8, value_from_key=True, dtype=torch.float64), TypeError,
     "cache holds torch.float64 but this layer computes its latent in torch.float32"),
    (lambda: {"k": torch.zeros(1)}, TypeError, "cache must be an attnkit KVCache"),
    (lambda: StaticCache(1, 26, 20, max_batch=3, max_len=8, value_from_key=True), ValueError, "max_batch=3"),
    (lambda: StaticCache(1, 26, 20, max_batch=2, max_len=4, value_from_key=True), ValueError, "max_len 4"),
])
def test_cache_that_does_not_fit_is_refused(make_cache, exc, text):
    m = _module(12)
    with pytest.raises(exc, match=text):
        m(torch.randn(2, 5, 40), cache=make_cache())


@pytest.mark.parametrize("call,exc,text", [
    (lambda m: m(torch.randn(2, 5, 41)), ValueError, r"x must be \(B, S, hidden_size=40\), got shape \(2, 5, 41\)"),
    (lambda m: m(torch.randn(5, 40)), ValueError, "x must be"),
    (lambda m: m(torch.randn(2, 5, 40), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError, r"\(2, 5\)"),
    (lambda m: m(torch.randn(2, 5, 40), positions=torch.zeros(2, 4, dtype=torch.long)), ValueError, "positions"),
    (lambda m: m(torch.randn(2, 5, 40), mask=torch.ones(2, 1, 5, 4, dtype=torch.bool)), ValueError,
     r"mask of shape \(2, 1, 5, 4\) does not broadcast"),
    (lambda m: MultiHeadLatentAttention(m.config, mode="fast"), ValueError, "mode must be one of"),
    (lambda m: MultiHeadLatentAttention(DIMS), TypeError, "config must be an MLAConfig"),
    (lambda m: m.new_cache("static", max_batch=2), ValueError, "needs max_len"),
    (lambda m: m.new_cache("paged-ish"), ValueError, "kind must be"),
])
def test_bad_forward_input(call, exc, text):
    m = _module(12)
    with pytest.raises(exc, match=text):
        call(m)


@pytest.mark.slow
def test_static_cache_absorbed_decode_step_compiles_once_fullgraph():
    import torch._dynamo
    m = _module(12, True, "auto")
    cache = m.new_cache("static", max_batch=2, max_len=20)
    x = torch.randn(2, 16, 40)
    with torch.no_grad():
        full = m(x)
        outs = [m(x[:, :8], cache=cache)]
        torch._dynamo.reset()
        step = torch.compile(lambda t: m(t, cache=cache), fullgraph=True)
        outs.append(step(x[:, 8:9]))
        with torch._dynamo.config.patch(error_on_recompile=True):
            outs += [step(x[:, i:i + 1]) for i in range(9, 16)]
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5


def _latent_cache(m, kind):
    if kind == "paged":
        from attnkit.caches import BlockAllocator
        return m.new_cache("paged", allocator=BlockAllocator(16, 4))
    return m.new_cache(kind, max_batch=2, max_len=32)


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("mode", ["naive", "auto-long", "absorb"])
def test_a_failing_call_leaves_the_latent_cache_unchanged(mode, kind):
    """On every path (naive, auto's for chunks over absorb_max_len, absorbed), a bad mask or a
    refusing forced backend leaves the latent cache as it was: the latent is appended and
    attended in one transaction, so the next call equals an untouched twin's."""
    m = _module(12, False, "auto" if mode == "auto-long" else mode)
    if mode == "auto-long":
        m.absorb_max_len = 2  # a 3-token chunk goes the naive way
    x = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(1))
    bad_calls = {
        "mask": lambda c: m(x[:, 5:], cache=c, mask=torch.ones(1, 1, 3, 99, dtype=torch.bool)),
        "backend": lambda c: (setattr(m, "backend", "flex"), m(x[:, 5:], cache=c, need_weights=True)),
    }
    with torch.no_grad():
        for name, call in bad_calls.items():
            m.backend = "auto"
            cache, twin = _latent_cache(m, kind), _latent_cache(m, kind)
            for c in (cache, twin):
                m(x[:, :5], cache=c)
            with pytest.raises((ValueError, TypeError, RuntimeError)):
                call(cache)
            m.backend = "auto"
            assert cache.lengths.tolist() == [5, 5], name
            torch.testing.assert_close(m(x[:, 5:], cache=cache), m(x[:, 5:], cache=twin), rtol=0, atol=0)
            assert cache.lengths.tolist() == [8, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("widen", [False, True], ids=["16-bit", "widened"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_per_head_matmul_matches_the_oracle(dtype, widen, rows, monkeypatch):
    """Both products of absorbed MLA (q_nope @ W_UK, out_latent @ W_UV^T read through W_UV in its
    own row order), in the CPU's 16-bit GEMM and widened to fp32 (which of the two a CPU takes is
    ``half_gemm_unit``'s rule, tests/test_linear.py), against fp64 and torch's matmul in the dtype."""
    import attnkit.modules.mla as MLA

    monkeypatch.setattr(MLA, "_PER_HEAD_UPCAST", frozenset({dtype}) if widen else frozenset())
    g = torch.Generator().manual_seed(rows)
    H, dn, dv, r = 3, 16, 8, 40
    w = torch.randn(H, dn + dv, r, generator=g).to(dtype)  # kv_b_proj's weight as (H, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    B, S = (1, rows) if rows != 40 else (4, 10)
    x = torch.randn(B, H, S, dn, generator=g).to(dtype)
    o = torch.randn(B, H, S, r, generator=g).to(dtype)
    for got, a, b in ((MLA._per_head_matmul(x, w_uk), x, w_uk),
                      (MLA._per_head_matmul(o, w_uv, w_transposed=True), o, w_uv.transpose(1, 2))):
        assert got.dtype == dtype and got.shape == (B, H, S, b.shape[-1])
        rule_r(got, a @ b, a.double() @ b.double(), n_terms=a.shape[-1], what=f"rows {rows}")


def test_per_head_matmul_widens_only_on_cpu(monkeypatch):
    """The CUDA branch's decision, on CPU: a non-CPU tensor (meta standing in) never widens."""
    import attnkit.modules.mla as MLA

    monkeypatch.setattr(MLA, "_PER_HEAD_UPCAST", frozenset({torch.bfloat16}))
    x = torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16)
    assert MLA._per_head_widens(x) and not MLA._per_head_widens(x.to("meta"))
    assert not MLA._per_head_widens(x.half())
