"""attnkit.models.generate: every cache kind equals recomputation, ragged batches equal each prompt
alone, seeds reproduce samples, EOS per sequence, streaming, options, and a compiled decode step
that never recompiles."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import Decoder, DecoderConfig, generate, sample_next, stream

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
VARIANTS = {"mha": {}, "gqa": {"num_kv_heads": 2}, "mqa": {}, "mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 4}}
PROMPTS = [[5, 9, 3, 7, 1, 2, 8], [4, 4, 11], [30], [2, 60, 17, 9, 40]]  # ragged, one single token
CACHES = ["dynamic", "static", "paged"]


def tiny(attention="gqa", seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(**{**TINY, **VARIANTS[attention], **kw, "attention": attention}), init_std=0.2).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request):
    return tiny(request.param)


def test_every_cache_equals_recomputation_token_for_token(model):
    """Greedy decoding with each cache kind gives exactly the tokens of recomputing the whole
    (left-padded) sequence every step without any cache."""
    want = model.generate(PROMPTS, 24, cache=None).tokens
    assert all(len(t) == 24 for t in want)
    for cache in CACHES:
        assert model.generate(PROMPTS, 24, cache=cache).tokens == want, cache


@pytest.mark.parametrize("cache", CACHES)
def test_ragged_batch_equals_each_prompt_alone(model, cache):
    batched = model.generate(PROMPTS, 16, cache=cache).tokens
    assert batched == [model.generate([p], 16, cache=cache).tokens[0] for p in PROMPTS]


def test_batched_row_does_not_depend_on_its_neighbours(model):
    """No pad-token leakage: the same prompt next to different (longer, shorter) neighbours gives
    the same tokens."""
    p = [7, 3, 9, 1]
    rows = [model.generate(batch, 12).tokens[batch.index(p)] for batch in
            ([p], [p, [1] * 9], [[2], p], [[8] * 14, p, [5, 6]])]
    assert all(r == rows[0] for r in rows)


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # within max_position_embeddings: see attnkit/rope/
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "partial": {"rope_type": "default", "partial_rotary_factor": 0.5},
    "yarn-partial": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                     "partial_rotary_factor": 0.25},
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_every_rope_variant_cached_equals_recompute(rope, interleaved):
    """Every RoPE variant and layout, through the one forward path: each cache kind gives the
    tokens of recomputing the whole sequence every step (cache=None)."""
    m = tiny("gqa", seed=7, rope_scaling=ROPES[rope], rope_interleave=interleaved, max_position_embeddings=64)
    want = m.generate(PROMPTS, 16, cache=None).tokens
    for cache in CACHES:
        assert m.generate(PROMPTS, 16, cache=cache).tokens == want, cache


@pytest.mark.parametrize("kw", [dict(attention_bias=True, mlp_bias=True), dict(dtype=torch.bfloat16),
                                dict(fused_projections=False)],
                         ids=["bias", "bf16", "unfused"])
def test_bias_bf16_and_unfused_cached_equals_recompute(kw):
    """(MLA is left out of bf16: its cached decode takes the absorbed path, which rounds
    differently from the naive recomputation by design; test_mla covers it with tolerances.)"""
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    m = tiny(kw.pop("attention", "gqa"), seed=8, **kw).to(dtype)
    want = m.generate(PROMPTS, 16, cache=None).tokens
    for cache in CACHES:
        assert m.generate(PROMPTS, 16, cache=cache).tokens == want, cache


def test_partial_rotary_generates():
    """A model with partial rotary (half of each head rotated) generates, with the same tokens as
    recomputation."""
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                              rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})).eval()
    assert m.model.rope.rotary_dim == 16 and m.config.head_dim == 32
    out = m.generate([[1, 2, 3]], 4)
    assert len(out.tokens[0]) == 4 and out.tokens == m.generate([[1, 2, 3]], 4, cache=None).tokens


def test_generation_runs_the_one_forward_path(monkeypatch):
    """Every step of every cache kind is a Decoder.forward through each attention module's forward
    (no second decode path)."""
    m = tiny("gqa", seed=9)
    calls = {"forward": 0, "attn": 0}
    fwd, attn_fwd = type(m).forward, type(m.model.layers[0].self_attn).forward

    def counting_forward(self, *a, **k):
        calls["forward"] += 1
        return fwd(self, *a, **k)

    def counting_attn(self, *a, **k):
        calls["attn"] += 1
        return attn_fwd(self, *a, **k)
    monkeypatch.setattr(type(m), "forward", counting_forward)
    monkeypatch.setattr(type(m.model.layers[0].self_attn), "forward", counting_attn)
    for cache in CACHES:
        calls.update(forward=0, attn=0)
        m.generate(PROMPTS, 6, cache=cache)
        assert calls == {"forward": 6, "attn": 6 * 2}, cache


# ---------------------------------------------------------------------------- sampling


def test_seed_reproduces_samples_and_other_seeds_differ(model):
    kw = dict(temperature=1.5, top_k=40, top_p=0.95)
    a = model.generate(PROMPTS, 20, seed=7, **kw).tokens
    assert model.generate(PROMPTS, 20, seed=7, **kw).tokens == a
    assert model.generate(PROMPTS, 20, seed=7, cache="static", **kw).tokens == a
    assert model.generate(PROMPTS, 20, seed=8, **kw).tokens != a


def test_sampling_filters_that_leave_one_token_are_greedy(model):
    greedy = model.generate(PROMPTS, 12).tokens
    assert model.generate(PROMPTS, 12, temperature=0.8, top_k=1, seed=0).tokens == greedy
    assert model.generate(PROMPTS, 12, temperature=0.8, top_p=1e-6, seed=0).tokens == greedy


def test_sample_next_follows_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits, temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)
    top3 = sample_next(logits, temperature=1.0, top_k=3, generator=g)
    assert set(top3.tolist()) == {0, 1, 2}
    p = logits[0].softmax(-1)  # nucleus: smallest prefix of sorted probs reaching top_p
    nucleus = sample_next(logits, temperature=1.0, top_p=float(p[0] + p[1]) - 1e-3, generator=g)
    assert set(nucleus.tolist()) == {0, 1}
    hot = sample_next(logits[:1], temperature=0.0)
    assert hot.tolist() == [0]
    # At the exact boundary the set stops where the mass is reached (as Hugging Face's top-p).
    even = torch.log(torch.tensor([[0.5, 0.25, 0.25]])).repeat(4000, 1)
    assert set(sample_next(even, temperature=1.0, top_p=0.75, generator=g).tolist()) == {0, 1}
    assert set(sample_next(torch.zeros(4000, 2), temperature=1.0, top_p=0.5, generator=g).tolist()) == {0}
    with pytest.raises(ValueError, match="temperature=1e-45 is too small"):
        sample_next(logits[:1], temperature=1e-45)


# ---------------------------------------------------------------------------- stopping and streaming


def test_eos_stops_each_sequence_on_its_own(model):
    free = model.generate(PROMPTS, 20).tokens
    eos = free[0][3]  # the 4th token of row 0
    got = model.generate(PROMPTS, 20, eos=eos)
    for row, full, reason in zip(got.tokens, free, got.finish_reasons):
        if eos in full:
            cut = full.index(eos) + 1
            assert row == full[:cut] and reason == "eos"
        else:
            assert row == full and reason == "length"
    assert got.finish_reasons[0] == "eos" and len(got.tokens[0]) <= 4


def test_batch_stops_when_every_sequence_has_ended():
    m = tiny("gqa")
    free = m.generate([[3, 4]], 10).tokens[0]
    got = m.generate([[3, 4]], 500, eos=free[1])
    assert got.tokens[0] == free[:free.index(free[1]) + 1]
    assert got.decode_steps < 3  # no steps after the only sequence ended


def test_stream_yields_tokens_as_they_come(model):
    eos = model.generate(PROMPTS, 10).tokens[1][2]
    steps = list(model.stream(PROMPTS, 10, eos=eos))
    want = model.generate(PROMPTS, 10, eos=eos).tokens
    assert len(steps) == max(len(t) for t in want)
    for b, row in enumerate(want):
        col = [s[b] for s in steps]
        assert col[:len(row)] == row and all(t is None for t in col[len(row):])


def test_stream_checks_arguments_at_once_and_keeps_the_callers_grad_mode():
    m = tiny()
    with pytest.raises(ValueError, match="max_new_tokens"):
        stream(m, PROMPTS, -1)  # not at the first next()
    it = m.stream([[1, 2]], 3)
    for _ in it:
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_prompt_forms_and_empty_generation():
    m = tiny()
    a = m.generate([[3, 4, 5]], 4).tokens
    assert m.generate([3, 4, 5], 4).tokens == a
    assert m.generate(torch.tensor([3, 4, 5]), 4).tokens == a
    assert m.generate(torch.tensor([[3, 4, 5]]), 4).tokens == a
    assert m.generate([torch.tensor([3, 4, 5])], 4).tokens == a
    out = m.generate([[3, 4, 5]], 0)
    assert out.tokens == [[]] and out.finish_reasons == ["length"]
    assert out.sequences == [[3, 4, 5]] and m.generate([[3]], 3).sequences[0][:1] == [3]


def test_timings_are_reported():
    g = tiny().generate(PROMPTS, 8)
    assert g.prefill_seconds > 0 and g.decode_seconds > 0 and g.decode_steps == 7
    assert g.decode_tokens_per_second > 0 and g.compile_seconds == 0 and g.decode_tokens is None


def test_the_compiling_step_is_timed_apart_from_the_decode_steps(monkeypatch):
    """A compiled configuration's first decode step (its compilation) is reported as
    ``compile_seconds``, not as a decode step: tokens/s count the timed steps' tokens only, and
    a later call of the same configuration times every step."""
    import time as time_module

    from attnkit.models import generation

    compiles = []

    def slow_compile(fn, **kwargs):  # compiles on the first call, as torch.compile does
        def compiled(*args):
            if not compiles:
                compiles.append(1)
                time_module.sleep(0.2)
            return fn(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", slow_compile)
    m = tiny("gqa", seed=12)
    eos = m.generate(PROMPTS, 8, cache=None).tokens[0][2]  # the first prompt stops after 3 tokens
    first = m.generate(PROMPTS, 8, cache="static", compile=True, eos=eos)
    assert first.tokens == m.generate(PROMPTS, 8, cache=None, eos=eos).tokens
    assert first.compile_seconds >= 0.2 and first.decode_seconds < first.compile_seconds
    assert first.decode_steps == 6  # 8 tokens: the prefill's, the compiling step's, 6 timed
    produced_by_compiling_step = sum(len(t) >= 2 for t in first.tokens)
    assert first.decode_tokens == sum(len(t) - 1 for t in first.tokens) - produced_by_compiling_step
    assert first.decode_tokens_per_second == first.decode_tokens / first.decode_seconds
    again = m.generate(PROMPTS, 8, cache="static", compile=True, eos=eos)
    assert again.compile_seconds == 0 and again.decode_steps == 7 and again.decode_tokens is None
    assert len(generation._COMPILED[m]) == 1


@pytest.mark.parametrize("kw,err,msg", [
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens"),
    (dict(temperature=-0.5), ValueError, "temperature must be a number >= 0"),
    (dict(top_k=0), ValueError, "top_k must be None or an int >= 1"),
    (dict(top_p=0.0), ValueError, r"top_p must be None or a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(eos=64), ValueError, r"eos ids \[64\] are outside the vocabulary"),
    (dict(eos="</s>"), TypeError, "eos must be None, a token id or a collection"),
    (dict(cache="ring"), ValueError, "cache must be one of"),
    (dict(cache="dynamic", compile=True), ValueError, "compile needs cache='static'"),
    (dict(compile=1), TypeError, "compile must be a bool"),
    (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 is empty"),
    (dict(prompts=[[1, 64]]), ValueError, r"token ids \[64\] outside the vocabulary"),
    (dict(prompts=torch.ones(2, 3)), ValueError, "integer tensor"),
    (dict(prompts=[]), ValueError, "prompts is empty"),
    (dict(prompts="hello"), TypeError, "prompts must be a tensor or a list"),
    (dict(prompts=[[1, 2], [1.5]]), TypeError, "prompt 1 must be a sequence of ints"),
])
def test_bad_options_raise_clear_errors(kw, err, msg):
    m = tiny()
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kw}
    with pytest.raises(err, match=msg):
        generate(m, args.pop("prompts"), args.pop("max_new_tokens"), **args)
    with pytest.raises(TypeError, match="Decoder"):
        generate(torch.nn.Linear(2, 2), [[1]], 2)


# ---------------------------------------------------------------------------- torch.compile


def test_compiled_static_decode_step_never_recompiles():
    """The decode step compiles once (dynamo with the eager backend: the graph capture and guards
    are what recompiles depend on) and then serves every step of this call and of later calls with
    the same batch and capacity, producing the uncompiled tokens."""
    import torch._dynamo
    m = tiny("gqa", seed=4)
    want = m.generate(PROMPTS, 20, cache=None).tokens
    torch._dynamo.reset()
    assert m.generate(PROMPTS, 20, cache="static", compile="eager").tokens == want
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile raises
        assert m.generate(PROMPTS, 20, cache="static", compile="eager").tokens == want
        other = [[9, 8, 7], [1], [2, 2, 2, 2], [3, 3]]
        assert m.generate(other, 18, cache="static", compile="eager").tokens == \
            m.generate(other, 18, cache=None).tokens


def test_compiled_steps_live_in_generation_and_go_with_the_model():
    """The compiled steps and their cache pool belong to generation, not to the model: the model
    has no attribute for them, a deep copy starts without them, and they do not keep a dropped
    model alive."""
    import copy
    import gc
    import weakref

    import torch._dynamo
    from attnkit.models import generation
    m = tiny("gqa", seed=6)
    torch._dynamo.reset()
    m.generate(PROMPTS[:2], 4, cache="static", compile="eager")
    assert not any("compiled" in name for name in vars(m))
    assert m in generation._COMPILED and copy.deepcopy(m) not in generation._COMPILED
    alive = weakref.ref(m)
    del m
    gc.collect()
    torch._dynamo.reset()  # dynamo's own caches may hold the last frame's locals until reset
    gc.collect()
    assert alive() is None


def test_compiled_generation_survives_more_configurations_than_dynamos_recompile_limit():
    """Compiled generation for more (model, dtype, kv_dtype, capacity) configurations than dynamo's
    per-function recompile limit, in one process: every configuration compiles its own step and
    gives the eager tokens, none falls back to eager, and dynamo's limit is left as it was."""
    import copy
    import warnings

    import torch._dynamo
    limit = torch._dynamo.config.recompile_limit
    torch.manual_seed(0)
    fp32 = Decoder(DecoderConfig(**{**TINY, "num_layers": 1, **VARIANTS["gqa"], "attention": "gqa"}),
                   init_std=0.2).eval()
    models = [fp32, copy.deepcopy(fp32).to(torch.bfloat16)]
    # prompts of 4, 300 and 600 tokens: capacities 256, 512 and 1024 (compiled_capacity)
    configs = [(m, kv, p) for p in (4, 300, 600) for m in models for kv in (None, "int8")][:limit + 1]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager would warn
        for m, kv, p in configs:
            prompt = [[(7 * i) % 64 for i in range(p)]]
            want = m.generate(prompt, 3, cache="static", kv_dtype=kv).tokens
            assert m.generate(prompt, 3, cache="static", compile="eager", kv_dtype=kv).tokens == want, \
                (m.dtype, kv, p)
    assert torch._dynamo.config.recompile_limit == limit


def test_compiled_capacity_rule():
    """A new compiled step's capacity: the next power of two from 256, at most the model's
    max_position_embeddings (rounded up to 64) when the call fits in it, never below the call."""
    from attnkit.models.generation import compiled_capacity
    assert [compiled_capacity(t) for t in (1, 7, 256, 257, 1000, 5000)] == [256, 256, 256, 512, 1024, 8192]
    assert compiled_capacity(300, limit=2048) == 512
    assert compiled_capacity(3000, limit=3000) == 3008  # not 4096: no call of this model reaches it
    assert compiled_capacity(5000, limit=3000) == 8192  # beyond the model's positions: the plain rule
    assert compiled_capacity(100, limit=40) == 256


def test_spare_capacity_is_free_only_where_the_decode_step_reads_held_keys(monkeypatch):
    """The capacity rule's device branch, decided on CPU: CUDA (SDPA reads the whole capacity
    under a key-padding mask) and a CPU without the native engine round P + T up to 64 and share
    a step only at that size; a CPU with the engine takes power-of-two buckets."""
    from attnkit import native
    from attnkit.models import generation
    assert not generation.spare_capacity_is_free(torch.device("cuda"))
    assert not generation.spare_capacity_is_free(torch.device("meta"))
    for impl in ("native", "torch"):
        monkeypatch.setattr(native, "implementation", lambda build=True, impl=impl: impl)
        assert generation.spare_capacity_is_free(torch.device("cpu")) == (impl == "native")


def test_compiled_steps_are_per_rounded_size_where_spare_capacity_costs_time(monkeypatch):
    from attnkit.models import generation
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(generation, "spare_capacity_is_free", lambda device: False)
    m = tiny("gqa", seed=13)
    for n, new in ((100, 20), (5, 3), (110, 10)):
        m.generate([[1] * n], new, cache="static", compile=True)
    assert [key[1] for key in generation._COMPILED[m]] == [64, 128]  # the two of 120 share a step, 8 does not


def test_compiled_steps_are_reused_by_every_call_that_fits(monkeypatch):
    """Calls of other prompt and generation lengths reuse a compiled step whose static caches
    hold them (the smallest that does), without recompiling, and give the eager tokens; a call
    that fits none compiles a step of the next capacity."""
    import torch._dynamo
    from attnkit.models import generation
    monkeypatch.setattr(generation, "spare_capacity_is_free", lambda device: True)
    m = tiny("gqa", seed=10)
    torch._dynamo.reset()

    def prompt(n):
        return [[(5 * i + 1) % 64 for i in range(n)]]

    assert m.generate(prompt(100), 20, cache="static", compile="eager").tokens == \
        m.generate(prompt(100), 20, cache=None).tokens
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile raises
        for n, new in ((5, 3), (230, 20), (37, 9)):
            assert m.generate(prompt(n), new, cache="static", compile="eager").tokens == \
                m.generate(prompt(n), new, cache=None).tokens, (n, new)
    assert [key[1] for key in generation._COMPILED[m]] == [256]
    m.generate(prompt(300), 4, cache="static", compile="eager")  # 304 positions: a step of 512
    m.generate(prompt(10), 4, cache="static", compile="eager")  # the smallest that fits: 256
    assert [key[1] for key in generation._COMPILED[m]] == [512, 256]


def test_compiled_capacity_falls_back_to_the_call_when_memory_is_short(monkeypatch):
    """Where the power-of-two capacity would not fit the device's memory, the step gets the
    call's own positions rounded up to 64."""
    from attnkit.models import generation
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(generation, "spare_capacity_is_free", lambda device: True)
    m = tiny("gqa", seed=11)
    per_token = m.kv_bytes_per_token()
    monkeypatch.setattr(generation, "_device_memory", lambda device: 192 * per_token)
    m.generate([[1, 2, 3]] * 1, 150, cache="static", compile=True)  # 153 positions: 256 does not fit
    assert [key[1] for key in generation._COMPILED[m]] == [192]


def test_a_step_compile_refuses_runs_eagerly_with_a_warning(monkeypatch):
    """When torch.compile refuses the decode step (here: dynamo's recompile limit under
    fullgraph=True), generation warns with the reason and finishes eagerly with the same tokens;
    later calls of that configuration run eagerly without asking again."""
    import torch._dynamo

    calls = []

    def refusing_compile(fn, **kwargs):
        def compiled(*args):
            calls.append(1)
            raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
        return compiled

    m = tiny("gqa", seed=8)
    want = m.generate(PROMPTS, 6, cache="static").tokens
    monkeypatch.setattr(torch, "compile", refusing_compile)
    with pytest.warns(RuntimeWarning, match="could not be compiled .FailOnRecompileLimitHit.*runs eagerly"):
        assert m.generate(PROMPTS, 6, cache="static", compile=True).tokens == want
    assert m.generate(PROMPTS, 6, cache="static", compile=True).tokens == want
    assert len(calls) == 1


def test_a_compiled_steps_own_errors_are_not_swallowed(monkeypatch):
    """Only compilation's refusals fall back to eager: an error of the step itself propagates."""
    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("the step's own failure")
        return compiled

    m = tiny("gqa", seed=8)
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(RuntimeError, match="the step's own failure"):
        m.generate(PROMPTS, 4, cache="static", compile=True)


def test_compiled_steps_per_model_are_bounded(monkeypatch):
    """A model keeps at most MAX_COMPILED_STEPS compiled configurations (and their static
    caches), the least recently used dropped first."""
    from attnkit.models import generation
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    m = tiny("gqa", seed=9)
    n = generation.MAX_COMPILED_STEPS
    for b in range(1, n + 3):
        m.generate([[1, 2, 3]] * b, 2, cache="static", compile=True)
    kept = generation._COMPILED[m]
    assert len(kept) == n and sorted(key[0] for key in kept) == list(range(3, n + 3))


@pytest.mark.slow
def test_inductor_compiled_decode_equals_eager():
    import torch._dynamo
    m = tiny("gqa", seed=5)
    want = m.generate(PROMPTS, 16, cache=None).tokens
    torch._dynamo.reset()
    assert m.generate(PROMPTS, 16, cache="static", compile=True).tokens == want
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert m.generate(PROMPTS, 16, cache="static", compile=True).tokens == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_compiled_decode_on_cuda_equals_eager(attention, kv_dtype):
    """``generate(compile=True)`` on CUDA (inductor with CUDA graphs; the static caches written in
    place, the one-token step masked by the lengths) gives the eager CUDA tokens, and a second
    call replays the step without recompiling. Only a GPU run (``gpu_check.py``) reaches it."""
    import torch._dynamo
    from attnkit.models import generation
    m = tiny(attention, seed=7).cuda()
    want = m.generate(PROMPTS, 12, cache="static", kv_dtype=kv_dtype).tokens
    torch._dynamo.reset()
    assert m.generate(PROMPTS, 12, cache="static", compile=True, kv_dtype=kv_dtype).tokens == want
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert m.generate(PROMPTS, 12, cache="static", compile=True, kv_dtype=kv_dtype).tokens == want
    # CUDA's plain decode reads the whole capacity (SDPA): the step keeps P + T rounded to 64
    assert [key[1] for key in generation._COMPILED[m]] == [-(-(max(map(len, PROMPTS)) + 12) // 64) * 64]


def test_generating_past_max_position_embeddings_warns():
    m = tiny(max_position_embeddings=12)
    with pytest.warns(UserWarning, match="max_position_embeddings=12"):
        out = m.generate([[1, 2, 3, 4, 5]], max_new_tokens=8)
    assert len(out.tokens[0]) == 8  # still generates: a warning, not an error
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.generate([[1, 2, 3, 4, 5]], max_new_tokens=7)  # 12 positions: within the limit


# ---------------------------------------------------------------------------- reliability


@pytest.mark.filterwarnings("ignore:prompt .* exceeds the model's max_position_embeddings")
@pytest.mark.parametrize("cache", ["dynamic", None])
def test_resources_grow_with_the_tokens_generated(cache):
    """max_new_tokens is a bound, not an allocation: 10**12 stops at the first EOS at once (the
    old code allocated for every token up front: +3.5 GB for 4 million, an allocator crash at
    10**9)."""
    m = tiny("gqa", seed=1)
    first = m.generate([[3, 4, 5]], 1, cache=cache).tokens[0][0]
    out = m.generate([[3, 4, 5]], 10 ** 12, eos=first, cache=cache)
    assert out.tokens == [[first]] and out.finish_reasons == ["eos"]
    it = m.stream([[3, 4, 5], [6]], 10 ** 12, cache=cache)
    assert len([next(it) for _ in range(3)]) == 3
    it.close()


@pytest.mark.filterwarnings("ignore:prompt .* exceeds the model's max_position_embeddings")
@pytest.mark.parametrize("cache", ["static", "paged"])
def test_fixed_capacity_caches_refuse_absurd_capacities(cache):
    m = tiny("gqa", seed=1)
    with pytest.raises(ValueError, match=rf"cache='{cache}' preallocates its whole capacity.*GiB.*cache='dynamic'"):
        m.generate([[3, 4, 5]], 10 ** 12, cache=cache)


def _nan_at(model, call: int, row: int):
    """Make the lm_head's output NaN for ``row`` at its ``call``-th call (0-based)."""
    seen = {"n": 0}

    def hook(mod, args, out):
        if seen["n"] == call:
            out = out.clone()
            out[row] = float("nan")
        seen["n"] += 1
        return out
    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.7, seed=0)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("cache", ["dynamic", None])
def test_nan_logits_raise_naming_the_step_and_sequence(sampling, cache):
    """NaN logits raise a FloatingPointError naming the step and the sequence, for greedy
    decoding and sampling alike (not a token, not a complaint about the temperature)."""
    m = tiny("gqa", seed=2)
    h = _nan_at(m, 2, 1)
    with pytest.raises(FloatingPointError, match=r"step 2 .*sequence\(s\) \[1\] are NaN"):
        m.generate(PROMPTS, 8, cache=cache, **sampling)
    h.remove()
    h = _nan_at(m, 0, 0)
    steps = m.stream(PROMPTS, 8, cache=cache, **sampling)
    with pytest.raises(FloatingPointError, match=r"step 0 .*sequence\(s\) \[0\]"):
        next(steps)
    h.remove()
    with pytest.raises(FloatingPointError, match=r"rows \[1\] contain NaN"):
        sample_next(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))
