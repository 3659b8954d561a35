"""Quantized KV caches (``kv_dtype="int8"`` / ``"fp8_e4m3"``): every cache kind decodes to attention
over the dequantized K/V (rule R against the fp64 oracle); failed steps leave data and scales as
they were; fork, prefix caching, copy-on-write, reorder and crop move the scales with the data
(the same operation on a float cache, then quantized); bytes count data + scales; Decoder
generation (eager and compiled), sizing and the command line take the flag. K channel scales
(``k_channel_scale``): the default policy per storage dtype, forced and given scales, set at the
first write (unset by a failed first step and by reset), shared by a paged pool's forks and
prefixes, and what makes int8 keys with outlier channels accurate."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.caches import BlockAllocator, DynamicCache, PagedKVCache, SlidingWindowCache, StaticCache
from attnkit.caches.quant_policy import as_bytes
from attnkit.cli import build_parser, main
from attnkit.kvquant import channel_scale, dequantize, kv_storage_dtype, quantize
from attnkit.models import Decoder, DecoderConfig
from attnkit.modules import MLAConfig, MultiHeadLatentAttention
from attnkit.sizing import AttentionDims, bytes_per_token, kv_cache_bytes, kv_cache_table

from conftest import base_attention, make_qkv, rule_r, stable_seed

QDTYPES = ["int8"] + (["fp8_e4m3"] if hasattr(torch, "float8_e4m3fn") else [])
#: Contiguous, ring, paged, and MLA's latent layout (one head, V = the first Dv channels of K).
KINDS = ["dynamic", "static", "sliding", "paged", "mla-dynamic", "mla-static", "mla-paged"]
HQ = 4
WINDOW = 6


def dims(kind):
    """(Hkv, D, Dv, value_from_key)."""
    return (1, 24, 16, True) if kind.startswith("mla") else (2, 16, 12, False)


def build(kind, kv_dtype, *, B=2, dtype=torch.float32, prefix_caching=False, max_rollback=0, **extra):
    Hkv, D, Dv, vfk = dims(kind)
    base = kind.removeprefix("mla-")
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, **extra)
    if base == "dynamic":
        return DynamicCache(Hkv, D, Dv, value_from_key=vfk, **kw)
    if base == "static":
        return StaticCache(Hkv, D, Dv, max_batch=B, max_len=32, value_from_key=vfk, **kw)
    if base == "sliding":
        return SlidingWindowCache(Hkv, D, Dv, window=WINDOW, max_batch=B, max_rollback=max_rollback, **kw)
    alloc = BlockAllocator(24, 4, prefix_caching=prefix_caching)
    return PagedKVCache(Hkv, D, Dv, allocator=alloc, value_from_key=vfk, **kw)


def dq(t, kv_dtype, c=None):
    """What a quantized cache holds for the rows ``t`` (B, H, S, ·), dequantized (fp32): with a K
    channel scale ``c`` (H, ·), divided by it before quantizing and multiplied back after."""
    if c is None:
        return dequantize(*quantize(t, kv_dtype))
    return dequantize(*quantize(t.float() / c[:, None, :], kv_dtype)) * c[:, None, :]


#: Channels of K made OUTLIER times larger (keys' outlier channels; one inside MLA's V part).
OUTLIERS, OUTLIER = [3, 10], 8.0


def step_kv(kind, B, S, dtype, seed):
    Hkv, D, Dv, vfk = dims(kind)
    q, k, v = make_qkv(B, HQ, Hkv, S, S, D, Dv, dtype=dtype, seed=seed)
    k[..., OUTLIERS] *= OUTLIER
    return q, k, (None if vfk else v)


def allowed(kind, total, S):
    """(total - S .. total - 1) queries over keys 0 .. total - 1: causal, and the window of a sliding cache."""
    qpos = torch.arange(total - S, total)[:, None]
    kpos = torch.arange(total)[None]
    ok = kpos <= qpos
    if kind == "sliding":
        ok &= kpos > qpos - WINDOW
    return ok[None, None]


def snapshot(cache):
    """Every buffer's bytes (data, scales, lengths) and the lengths."""
    bufs = {n: as_bytes(b).clone() for n, b in cache.named_buffers()}
    return bufs, cache.lengths.clone()


def assert_same(a, b):
    assert a[0].keys() == b[0].keys()
    for n in a[0]:
        assert torch.equal(a[0][n], b[0][n]), n
    assert torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------- decode against the oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_equals_attention_over_dequantized_kv(kind, kv_dtype, dtype):
    """Prefill, decode steps and a verification chunk through the quantized cache equal the fp64
    oracle over the dequantized K/V written so far (rule R; the sliding cache's window included).
    K has outlier channels; int8 caches divide it by their channel scale (folded into q, and into
    the output where V is read from K), so the oracle's K is ``dequantized * channel scale``."""
    B = 2
    cache = build(kind, kv_dtype, B=B, dtype=dtype)
    Dv = dims(kind)[2]
    ks, vs, total = [], [], 0
    for i, S in enumerate([5, 1, 1, 3, 1, 1]):
        q, k, v = step_kv(kind, B, S, dtype, stable_seed(kind, kv_dtype, i))
        out = cache.attend(q, k, v)
        total += S
        c = cache.k_channel_scale  # int8: set by the first step (K over V's channels too with MLA)
        assert (c is not None) == (kv_dtype == "int8")
        ks.append(dq(k, kv_dtype, c))
        K = torch.cat(ks, 2)
        if v is None:
            V = K[..., :Dv]
        else:
            vs.append(dq(v, kv_dtype))
            V = torch.cat(vs, 2)
        mask = allowed(kind, total, S)
        gold = attnkit.attention_reference(q.double(), K.double(), V.double(), mask)
        base = base_attention(q, K.to(dtype), V.to(dtype), mask)
        rule_r(out, base, gold, what=f"step {i}", n_terms=max(total, K.shape[-1]))
    assert cache.lengths.tolist() == [total] * B


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged", "mla-paged"])
def test_dense_view_is_dequantized_in_the_compute_dtype(kind, kv_dtype):
    cache = build(kind, kv_dtype, dtype=torch.bfloat16)
    _, k, v = step_kv(kind, 2, 5, torch.bfloat16, 3)
    k_all, v_all, _ = cache.update(k, v)
    assert k_all.dtype == v_all.dtype == torch.bfloat16
    want = dq(k, kv_dtype, cache.k_channel_scale)  # the channel scale multiplied back (int8)
    assert torch.equal(k_all[:, :, :5], want.to(torch.bfloat16))
    if v is not None:
        assert torch.equal(v_all[:, :, :5], dq(v, kv_dtype).to(torch.bfloat16))
    else:
        assert torch.equal(v_all[:, :, :5], want[..., :dims(kind)[2]].to(torch.bfloat16))
    with cache.transaction(2, 1) as c:  # the step's own view: a QuantizedKV in the storage dtype
        c.cache.write(c.step, *step_kv(kind, 2, 1, torch.bfloat16, 4)[1:])
        kv, none, _ = c.cache.view(c.step)
    assert isinstance(kv, attnkit.QuantizedKV) and none is None and kv.dtype == kv_storage_dtype(kv_dtype)
    assert kv.paged == kind.endswith("paged") and (kv.v is None) == kind.startswith("mla")
    assert kv.k_channel_scale is cache.k_channel_scale


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_ragged_batch_equals_each_sequence_alone(kind, kv_dtype):
    """Right-padded prompts (num_new): padding is never stored (a contiguous cache holds data 0
    and scale 0 there), the channel scale is measured on the real tokens only, and each row
    decodes as it would alone (with the same channel scale)."""
    lens = [3, 6]
    seqs = [step_kv(kind, 1, n + 2, torch.float32, 10 + i) for i, n in enumerate(lens)]
    pad = lambda t, n: torch.cat([t[:, :, :n], torch.full_like(t[:, :, :6 - n], 70.0)], 2)  # noqa: E731
    cache = build(kind, kv_dtype)
    qkv = [torch.cat([pad(s[j], n) for s, n in zip(seqs, lens)]) for j in range(3)]
    out = cache.attend(*qkv, num_new=torch.tensor(lens))
    if kind != "paged":
        assert cache.k_scale[0, :, 3:6].eq(0).all() and as_bytes(cache.k_buf)[0, :, 3:6].eq(0).all()
    if kv_dtype == "int8":  # the padding (70, larger than any real key) did not set it
        real = torch.cat([s[1][:, :, :n] for s, n in zip(seqs, lens)], 2)
        assert torch.equal(cache.k_channel_scale, channel_scale(real))
    step = [torch.cat([s[j][:, :, n:n + 1] for s, n in zip(seqs, lens)]) for j in range(3)]
    nxt = cache.attend(*step)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        alone = build(kind, kv_dtype, B=1, k_channel_scale=cache.k_channel_scale)
        want = alone.attend(*(t[:, :, :n] for t in s))
        torch.testing.assert_close(out[b:b + 1, :, :n], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nxt[b:b + 1], alone.attend(*(t[:, :, n:n + 1] for t in s)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- exception safety


def failing_attends(cache, q, k, v) -> list:
    """Steps on ``cache`` that raise after the write (a mask of the wrong width, a q attention
    refuses, an unknown backend), with the errors they raise."""
    bad_q = torch.randn(*q.shape[:3], q.shape[3] + 1)
    return [(lambda: cache.attend(q, k, v, torch.ones(1, 1, 1, 99, dtype=torch.bool)), ValueError),
            (lambda: cache.attend(bad_q, k, v), ValueError),
            (lambda: cache.attend(q, k, v, backend="no-such-backend"), (ValueError, attnkit.BackendNotSupported))]


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_failed_step_leaves_data_and_scales_unchanged(kind, kv_dtype):
    """Calls that raise before the write (k of the wrong dtype) and after it (a bad mask, a q the
    attention refuses, an unknown backend) leave every buffer (data, scales) and the lengths
    bitwise as they were; the next valid call equals an untouched twin's."""
    cache, twin = build(kind, kv_dtype), build(kind, kv_dtype)
    prefill = step_kv(kind, 2, 5, torch.float32, 1)
    for c in (cache, twin):
        c.attend(*prefill)
    before = snapshot(cache)
    q, k, v = step_kv(kind, 2, 3, torch.float32, 2)  # 3 tokens: a sliding cache overwrites ring slots
    calls = [(lambda: cache.attend(q, k.double(), None if v is None else v.double()), TypeError),
             *failing_attends(cache, q, k, v)]
    for call, err in calls:
        with pytest.raises(err):
            call()
        assert_same(snapshot(cache), before)
    torch.testing.assert_close(cache.attend(q, k, v), twin.attend(q, k, v), rtol=0, atol=0)
    assert_same(snapshot(cache), snapshot(twin))


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_failed_model_forward_leaves_every_layer_unchanged(attention, kind, kv_dtype, monkeypatch):
    """The second layer raises after the first wrote its quantized K/V: both layers' data and
    scales (and a paged allocator's counts) are as before, and the next forward equals a twin's."""
    m = _model(attention)
    caches, twin = (m.new_caches(kind, max_batch=2, max_len=32, kv_dtype=kv_dtype) for _ in range(2))
    with torch.inference_mode():
        for c in (caches, twin):
            m(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), caches=c)
    before = [snapshot(c) for c in caches]
    alloc = getattr(caches[0], "allocator", None)
    counts = None if alloc is None else (alloc.num_used, alloc.num_free)

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 fails")
    monkeypatch.setattr(caches[1], "write", broken)
    wrote = []
    monkeypatch.setattr(caches[0], "write", lambda *a, _w=caches[0].write: (wrote.append(1), _w(*a))[1])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="layer 1 fails"):
        m(torch.tensor([[3, 4], [4, 5]]), caches=caches)
    assert wrote  # the first layer did write before the step was aborted
    for c, b in zip(caches, before):
        assert_same(snapshot(c), b)
    if alloc is not None:
        assert (alloc.num_used, alloc.num_free) == counts
    monkeypatch.undo()
    with torch.inference_mode():
        nxt = torch.tensor([[3, 4], [4, 5]])
        assert torch.equal(m(nxt, caches=caches), m(nxt, caches=twin))


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_failed_first_forward_leaves_channel_scales_unset(attention, kind, monkeypatch):
    """The first forward of an int8 model: layer 0 writes (and sets its channel scale), layer 1
    raises; every layer's scale is unset again, and the next forward (which measures them anew)
    equals a twin's."""
    m = _model(attention)
    caches, twin = (m.new_caches(kind, max_batch=2, max_len=32, kv_dtype="int8") for _ in range(2))
    before = [snapshot(c) for c in caches]
    monkeypatch.setattr(caches[1], "write", lambda *a: (_ for _ in ()).throw(RuntimeError("layer 1 fails")))
    set_in_step = []
    monkeypatch.setattr(caches[0], "write", lambda *a, _w=caches[0].write: (
        _w(*a), set_in_step.append(caches[0].k_channel_scale is not None))[0])
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="layer 1 fails"):
        m(ids, caches=caches)
    assert set_in_step == [True]  # layer 0 had set its scale inside the failed step
    for c, b in zip(caches, before):
        assert c.k_channel_scale is None
        assert_same(snapshot(c), b)
    monkeypatch.undo()
    with torch.inference_mode():
        assert torch.equal(m(ids, caches=caches), m(ids, caches=twin))
    for c, t in zip(caches, twin):
        assert torch.equal(c.k_channel_scale, t.k_channel_scale)


@pytest.mark.parametrize("kind", KINDS)
def test_failed_first_step_leaves_channel_scale_unset(kind):
    """A first step that raises after its write (bad mask, a q attention refuses, an unknown
    backend) leaves the scale unset and every buffer as it was; the next step sets it from its
    own K and equals an untouched twin's."""
    cache, twin = build(kind, "int8"), build(kind, "int8")
    before = snapshot(cache)
    q, k, v = step_kv(kind, 2, 5, torch.float32, 21)
    for call, err in failing_attends(cache, q, k, v):
        with pytest.raises(err):
            call()
        assert cache.k_channel_scale is None
        assert_same(snapshot(cache), before)
    _, k2, v2 = step_kv(kind, 2, 5, torch.float32, 22)
    torch.testing.assert_close(cache.attend(q, k2, v2), twin.attend(q, k2, v2), rtol=0, atol=0)
    assert torch.equal(cache.k_channel_scale, channel_scale(k2))
    assert_same(snapshot(cache), snapshot(twin))


# ---------------------------------------------------------------------------- editing moves the scales


def _same_as_float_then_quantized(kind, kv_dtype, fcache, qcache, seed):
    """One more step in both caches: the quantized cache's dense view equals the float cache's
    K/V quantized by ``QuantizedKV.quantize`` with the cache's channel scale (bitwise: data, row
    scales and the one channel scale all moved with their tokens)."""
    B = fcache.lengths.shape[0]
    _, k, v = step_kv(kind, B, 1, torch.float32, seed)
    fk, fv, _ = fcache.update(k, v)
    qk, qv, _ = qcache.update(k, v)
    c = qcache.k_channel_scale
    assert (c is not None) == (kv_dtype == "int8")
    want = attnkit.QuantizedKV.quantize(fk, None if v is None else fv, kv_dtype, v_head_dim=fv.shape[-1],
                                        k_channel_scale=c).gather(torch.float32)
    assert torch.equal(qk, want[0])
    assert torch.equal(qv, want[1])


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["reorder", "crop"])
def test_reorder_and_crop_move_scales_with_data(kind, kv_dtype, op):
    rollback = 2 if kind == "sliding" else 0
    f = build(kind, None, max_rollback=rollback)
    q_ = build(kind, kv_dtype, max_rollback=rollback)
    for i, S in enumerate([5, 2]):
        _, k, v = step_kv(kind, 2, S, torch.float32, stable_seed(kind, op, i))
        f.update(k, v)
        q_.update(k, v)
    for c in (f, q_):
        if op == "crop":
            c.crop(-2)
        else:  # beam search: row 1 continues twice (paged: a fork, copy-on-write at the next step)
            c.reorder(torch.tensor([1, 1]))
    _same_as_float_then_quantized(kind, kv_dtype, f, q_, 99)
    if kind.endswith("paged") and op == "reorder":
        a = q_.allocator
        assert [a.length(s) for s in a.batch] == [8, 8] and a.blocks(a.batch[0])[0] == a.blocks(a.batch[1])[0]


@pytest.mark.parametrize("kv_dtype", QDTYPES)
def test_dynamic_reorder_can_grow_the_batch(kv_dtype):
    f, q_ = build("dynamic", None), build("dynamic", kv_dtype)
    _, k, v = step_kv("dynamic", 2, 5, torch.float32, 5)
    f.update(k, v)
    q_.update(k, v)
    for c in (f, q_):
        c.reorder(torch.tensor([0, 1, 0]))
    _same_as_float_then_quantized("dynamic", kv_dtype, f, q_, 6)


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("kind", ["paged", "mla-paged"])
def test_prefix_caching_and_copy_on_write_move_scales(kind, kv_dtype):
    """A second request reuses the cached blocks of the first (data and scales), and a fork that
    appends into a shared partial block copies both into its private block."""
    f, q_ = build(kind, None, prefix_caching=True), build(kind, kv_dtype, prefix_caching=True)
    toks = list(range(100, 110))
    _, k, v = step_kv(kind, 1, 10, torch.float32, 7)
    assert (q_.k_channel_scale is None) and q_.channel_scaled == (kv_dtype == "int8")
    for c in (f, q_):
        a = c.allocator
        c.set_batch([a.add_sequence()])
        with attnkit.caches.step([c], batch=1, tokens=10, token_ids=[toks]) as (bound,):
            bound.update(k, v)
        first = a.batch[0]
        a.set_batch([])
        a.free(first)
        second = a.add_sequence(token_ids=toks + [7, 8])
        assert a.length(second) == 8  # two cached blocks reused
        c.set_batch([second])
        assert a.num_cached_blocks == 2
    _same_as_float_then_quantized(kind, kv_dtype, f, q_, 8)
    # fork the 9-token sequence (a partial third block) and append to both: copy-on-write
    for c in (f, q_):
        c.reorder(torch.tensor([0, 0]))
    _same_as_float_then_quantized(kind, kv_dtype, f, q_, 9)
    a = q_.allocator
    b0, b1 = (a.blocks(s) for s in a.batch)
    assert b0[:2] == b1[:2] and b0[2] != b1[2]
    src, dst = b0[2], b1[2]  # the copied block's first token: same scale in both copies
    assert torch.equal(q_.k_scale[src, 0], q_.k_scale[dst, 0]) and q_.k_scale[dst, 0].ne(0).all()
    # one channel scale for the pool: the first request's, kept through reuse, fork and copy
    if kv_dtype == "int8":
        assert torch.equal(q_.k_channel_scale, channel_scale(k))


# ---------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("kv_dtype", QDTYPES)
def test_bytes_count_data_and_scales(kv_dtype):
    st = kv_storage_dtype(kv_dtype)
    spec = AttentionDims(2, 16, 12)
    per = 2 * (16 + 12) * 1 + 2 * 2 * 4  # one byte per value, an fp32 scale per row of K and of V
    assert bytes_per_token(spec, st) == kv_cache_bytes(spec, dtype=st) == per
    assert kv_cache_bytes(spec, context=10, layers=3, batch=2, dtype=st) == 60 * per
    static = StaticCache(2, 16, 12, max_batch=3, max_len=10, kv_dtype=kv_dtype)
    assert static.bytes_per_token == per and static.nbytes == 3 * 10 * per
    sliding = SlidingWindowCache(2, 16, 12, window=4, max_batch=3, kv_dtype=kv_dtype)
    assert sliding.bytes_per_token == per and sliding.nbytes == 3 * (4 + 1) * per
    paged = PagedKVCache(2, 16, 12, num_blocks=5, block_size=4, kv_dtype=kv_dtype)
    assert paged.nbytes == 5 * 4 * per
    paged.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 12))
    assert paged.nbytes_used == 2 * 4 * per
    assert DynamicCache(2, 16, 12, kv_dtype=kv_dtype).bytes_per_token == per
    assert DynamicCache(2, 16, 12).bytes_per_token == 2 * 28 * 4  # float caches as before
    # MLA's latent: one scale per token (V is read from the same row)
    cfg = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    latent = MultiHeadLatentAttention(cfg).new_cache("static", max_batch=2, max_len=7, kv_dtype=kv_dtype)
    assert latent.bytes_per_token == kv_cache_bytes(cfg, dtype=st) == 24 + 4
    assert latent.nbytes == 2 * 7 * 28
    for name, layers in (("gqa", 2), ("mla", 2)):
        m = _model(name)
        layer_spec = m.model.layers[0].self_attn
        spec_bytes = bytes_per_token(layer_spec.config if name == "mla" else layer_spec, st)
        assert m.kv_bytes_per_token(kv_dtype=kv_dtype) == layers * spec_bytes
        assert m.kv_bytes_per_token(kv_dtype=kv_dtype) < m.kv_bytes_per_token()


def test_kv_command_reports_scales(capsys):
    assert main(["kv", "gqa:heads=4,kv_heads=2,head_dim=16,layers=3", "--dtype", "int8", "--context", "10"]) == 0
    out = capsys.readouterr().out
    assert "int8 + fp32 scale per row" in out
    per = 2 * 32 + 2 * 2 * 4
    assert f"| {per:,} |" in out and f"{30 * per / 1024:.2f} KiB" in out  # per layer; 10 tokens x 3 layers
    assert "fp32 scale" not in kv_cache_table(["llama-3-8b"], dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- K channel scales


def test_channel_scale_is_the_median_ratio_clamped_to_one():
    """Each channel's absmax over batch and tokens / its head's median channel absmax where that
    is at least 2 (an outlier), else 1; zero, NaN and inf channels (and an empty k) get 1, and do
    not move the median."""
    k = torch.zeros(2, 2, 3, 5)
    k[:, 0] = torch.tensor([1.0, 2.0, 4.0, 40.0, 0.5])  # head 0: median 2 (1.0 / 2 and 2.0 / 2 are below the threshold)
    k[1, 1, 2] = torch.tensor([3.0, -30.0, 0.0, float("nan"), 3.0])  # head 1: median of 3, 30, 3 (0 and NaN out)
    k[0, 1, 0, 2] = float("inf")
    want = torch.tensor([[1.0, 1.0, 2.0, 20.0, 1.0], [1.0, 10.0, 1.0, 1.0, 1.0]])
    c = channel_scale(k)
    assert c.dtype == torch.float32 and torch.equal(c, want)
    assert torch.equal(channel_scale(torch.zeros(1, 2, 0, 4)), torch.ones(2, 4))
    assert torch.equal(channel_scale(torch.zeros(1, 2, 3, 4)), torch.ones(2, 4))
    with pytest.raises(ValueError, match="channel_scale: k must be"):
        channel_scale(torch.zeros(2, 3, 4))


CONSTRUCTORS = {
    "dynamic": lambda **kw: DynamicCache(2, 16, 12, **kw),
    "static": lambda **kw: StaticCache(2, 16, 12, max_batch=2, max_len=16, **kw),
    "sliding": lambda **kw: SlidingWindowCache(2, 16, 12, window=6, max_batch=2, **kw),
    "paged": lambda **kw: PagedKVCache(2, 16, 12, num_blocks=12, block_size=4, **kw),
    "mla": lambda **kw: MultiHeadLatentAttention(MLA_CFG).new_cache("dynamic", **kw),
}
MLA_CFG = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8)


def _first_write(cache, seed=31):
    H, D = cache.num_kv_heads, cache.head_dim
    torch.manual_seed(seed)
    k = torch.randn(2, H, 5, D)
    k[..., OUTLIERS] *= OUTLIER
    cache.update(k, None if cache.value_from_key else torch.randn(2, H, 5, cache.v_head_dim))
    return k


@pytest.mark.parametrize("kv_dtype", [None] + QDTYPES)
@pytest.mark.parametrize("kind", list(CONSTRUCTORS))
def test_channel_scale_default_policy(kind, kv_dtype):
    """Default: on for int8 (set from the first write's K, then fixed), off for fp8 and float caches."""
    cache = CONSTRUCTORS[kind](kv_dtype=kv_dtype)
    on = kv_dtype == "int8"
    assert cache.channel_scaled == on and cache.k_channel_scale is None
    k = _first_write(cache)
    if not on:
        assert cache.k_channel_scale is None
        return
    c = cache.k_channel_scale
    assert c.shape == (cache.num_kv_heads, cache.head_dim) and c.dtype == torch.float32
    assert torch.equal(c, channel_scale(k)) and (c[:, OUTLIERS] > 4).all()
    _first_write(cache, seed=32)  # later writes keep it (the same tensor)
    assert cache.k_channel_scale is c


@pytest.mark.parametrize("kind", list(CONSTRUCTORS))
def test_channel_scale_forced_and_given(kind):
    """True turns it on for fp8, False off for int8; a given tensor is used as is, for every
    write, and kept by reset (only a computed scale is unset)."""
    if "fp8_e4m3" in QDTYPES:
        fp8 = CONSTRUCTORS[kind](kv_dtype="fp8_e4m3", k_channel_scale=True)
        k = _first_write(fp8)
        assert fp8.channel_scaled and torch.equal(fp8.k_channel_scale, channel_scale(k))
    off = CONSTRUCTORS[kind](kv_dtype="int8", k_channel_scale=False)
    _first_write(off)
    assert not off.channel_scaled and off.k_channel_scale is None
    H, D = off.num_kv_heads, off.head_dim
    given = torch.linspace(1.0, 3.0, H * D, dtype=torch.float64).view(H, D)
    cache = CONSTRUCTORS[kind](kv_dtype="int8", k_channel_scale=given)
    assert torch.equal(cache.k_channel_scale, given.float())
    k = _first_write(cache)
    assert torch.equal(cache.k_channel_scale, given.float())
    if kind in ("dynamic", "mla"):  # what it stored: K / given, quantized
        assert torch.equal(cache.k_buf[:, :, :5], quantize(k / given.float()[:, None, :], "int8")[0])
    cache.reset()
    assert torch.equal(cache.k_channel_scale, given.float())


@pytest.mark.parametrize("kind", list(CONSTRUCTORS))
def test_bad_channel_scale_is_a_clear_error(kind):
    """A tensor of the wrong shape or dtype, or with a value not finite or not > 0 (in fp32), and
    True or a tensor without a kv_dtype, raise a ValueError naming k_channel_scale and the shapes."""
    make = CONSTRUCTORS[kind]
    H, D = (1, MLA_CFG.latent_dim) if kind == "mla" else (2, 16)
    shape = rf"\({H}, {D}\)"
    bad = [torch.ones(D), torch.ones(H, D + 1), torch.ones(H, D, dtype=torch.int32)]
    for t in bad:
        with pytest.raises(ValueError, match=rf"k_channel_scale must be a floating \(Hkv, D\) = {shape}.*shape"):
            make(kv_dtype="int8", k_channel_scale=t)
    for val in (0.0, -1.0, float("nan"), float("inf"), 1e300):
        t = torch.ones(H, D, dtype=torch.float64)
        t[0, 1] = val
        with pytest.raises(ValueError, match=rf"k_channel_scale \(Hkv, D\) = {shape} must be finite and > 0"):
            make(kv_dtype="int8", k_channel_scale=t)
    for val in (True, torch.ones(H, D)):
        with pytest.raises(ValueError, match="k_channel_scale .* needs kv_dtype"):
            make(kv_dtype=None, k_channel_scale=val)
    with pytest.raises(TypeError, match="k_channel_scale must be None, a bool or"):
        make(kv_dtype="int8", k_channel_scale="yes")
    assert not make(kv_dtype=None, k_channel_scale=False).channel_scaled


def test_bad_channel_scale_leaves_a_shared_allocator_unchanged():
    """A paged layer refused for its channel scale is never attached to the model's allocator."""
    alloc = BlockAllocator(8, 4)
    ok = PagedKVCache(2, 16, allocator=alloc, kv_dtype="int8")
    with pytest.raises(ValueError, match="k_channel_scale"):
        PagedKVCache(2, 16, allocator=alloc, kv_dtype="int8", k_channel_scale=torch.zeros(2, 16))
    assert alloc.num_attached == 1 and alloc.attached == (ok,)
    ok.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))  # not a shared allocator: steps alone


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged", "mla-dynamic", "mla-paged"])
def test_reset_recomputes_the_channel_scale(kind):
    cache = build(kind, "int8")
    _, k, v = step_kv(kind, 2, 5, torch.float32, 41)
    cache.update(k, v)
    assert torch.equal(cache.k_channel_scale, channel_scale(k))
    with pytest.raises(RuntimeError, match="still holds tokens"):  # they were written with it
        cache.forget_channel_scale()
    cache.reset()
    assert cache.k_channel_scale is None and cache.lengths.numel() == 0
    _, k2, v2 = step_kv(kind, 2, 4, torch.float32, 42)
    k2 = k2 * torch.linspace(1, 5, k2.shape[-1])  # other channels large now
    cache.update(k2, v2)
    assert torch.equal(cache.k_channel_scale, channel_scale(k2))
    fresh = build(kind, "int8")  # the reset cache decodes as a fresh one fed the same tokens
    fresh.update(k2, v2)
    q, k3, v3 = step_kv(kind, 2, 1, torch.float32, 43)
    torch.testing.assert_close(cache.attend(q, k3, v3), fresh.attend(q, k3, v3), rtol=0, atol=0)


def test_paged_reset_keeps_the_scale_while_the_pool_holds_reusable_rows():
    """Paged layers share one scale per pool: reset() keeps it while a sequence outside the batch
    or a prefix-cached block (written with it) is still there, and unsets it in every layer of
    the allocator once the pool is empty."""
    alloc = BlockAllocator(16, 4, prefix_caching=True)
    layers = [PagedKVCache(2, 16, 12, allocator=alloc, kv_dtype="int8") for _ in range(2)]
    toks = list(range(8))
    alloc.set_batch([alloc.add_sequence()])
    with attnkit.caches.step(layers, batch=1, tokens=8, token_ids=[toks]) as bound:
        for c in bound:
            _, k, v = step_kv("paged", 1, 8, torch.float32, 51)
            c.update(k, v)
    scales = [c.k_channel_scale for c in layers]
    assert all(s is not None for s in scales)
    keep = alloc.fork(alloc.batch[0])  # a sequence outside the batch
    attnkit.caches.reset(layers)
    assert [c.k_channel_scale for c in layers] == scales
    alloc.free(keep)  # its two full blocks stay cached for a later prompt
    attnkit.caches.reset(layers)
    assert alloc.num_cached_blocks == 2 and [c.k_channel_scale for c in layers] == scales
    reuse = alloc.add_sequence(token_ids=toks + [99])
    assert alloc.length(reuse) == 8  # both blocks reused: read with the same scale
    alloc.free(reuse)
    hog = alloc.add_sequence()  # takes every block: the cached ones are evicted
    alloc.append(hog, alloc.num_free * alloc.block_size)
    alloc.free(hog)
    assert alloc.num_cached_blocks == 0 and not alloc.sequences
    attnkit.caches.reset(layers)
    assert all(c.k_channel_scale is None for c in layers)


ACCURACY_CACHES = {  # D 128 (4 outlier channels), room for 2 x 56 tokens
    "dynamic": lambda **kw: DynamicCache(2, 128, **kw),
    "sliding": lambda **kw: SlidingWindowCache(2, 128, window=32, max_batch=2, **kw),
    "paged": lambda **kw: PagedKVCache(2, 128, num_blocks=32, block_size=4, **kw),
    "mla-static": lambda **kw: StaticCache(1, 128, 96, max_batch=2, max_len=64, value_from_key=True, **kw),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", list(ACCURACY_CACHES))
def test_channel_scales_make_int8_keys_with_outlier_channels_accurate(kind, seed):
    """K with 4 of 128 channels 20x larger: after a 48-token prefill, 8 decode steps through an
    int8 cache with its channel scale (the default) are much closer to exact attention over the
    float K/V than with k_channel_scale=False. Error: RMS(out - exact) / RMS(exact); asserted:
    the channel-scaled error is less than half the unscaled one."""
    vfk = kind.startswith("mla")
    Hkv, B, P, T = (1 if vfk else 2), 2, 48, 8
    q, k, v = make_qkv(B, 8, Hkv, P + T, P + T, 128, seed=stable_seed(kind, seed))
    k[..., [1, 17, 33, 49]] *= 20
    v = None if vfk else v
    sl = lambda t, a, b: None if t is None else t[:, :, a:b]  # noqa: E731
    outs = {}
    for scaled in (True, False):
        cache = ACCURACY_CACHES[kind](kv_dtype="int8", **({} if scaled else dict(k_channel_scale=False)))
        assert cache.channel_scaled == scaled
        cache.attend(q[:, :, :P], k[:, :, :P], sl(v, 0, P))
        outs[scaled] = torch.cat([cache.attend(*(sl(t, P + i, P + i + 1) for t in (q, k, v))) for i in range(T)], 2)
    qpos, kpos = torch.arange(P, P + T)[:, None], torch.arange(P + T)[None]
    mask = (kpos <= qpos) & ((kpos > qpos - 32) if kind == "sliding" else True)
    exact = attnkit.attention_reference(q[:, :, P:].double(), k.double(), (k[..., :96] if vfk else v).double(),
                                        mask[None, None])
    rms = lambda x: x.pow(2).mean().sqrt().item()  # noqa: E731
    err = {s: rms(o.double() - exact) / rms(exact) for s, o in outs.items()}
    assert err[True] < 0.5 * err[False], err


def test_channel_scale_in_repr_and_bytes():
    """repr says the policy and the scale; bytes_per_token is per token (the scale is per layer),
    nbytes counts the (Hkv, D) fp32 scale once it is set."""
    cache = StaticCache(2, 16, 12, max_batch=1, max_len=8, kv_dtype="int8")
    per, cap = cache.bytes_per_token, cache.nbytes
    assert "kv_dtype='int8', k_channel_scale=first write" in repr(cache)
    cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 12))
    assert "k_channel_scale=set (2, 16), max " in repr(cache)
    assert cache.bytes_per_token == per == 2 * 28 + 2 * 2 * 4
    assert cache.nbytes == cap + 2 * 16 * 4 + 8  # the (Hkv, D) fp32 scale, and lengths (1,) now held
    assert "k_channel_scale=off" in repr(DynamicCache(2, 16, kv_dtype="int8", k_channel_scale=False))
    given = DynamicCache(2, 16, kv_dtype="int8", k_channel_scale=torch.ones(2, 16))
    assert "k_channel_scale=given (2, 16)" in repr(given)
    assert "k_channel_scale" not in repr(DynamicCache(2, 16)) and "k_channel_scale" in repr(
        PagedKVCache(2, 16, num_blocks=2, kv_dtype="int8"))


@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_decoder_new_caches_passes_k_channel_scale(attention, cache):
    m = _model(attention)
    kw = dict(max_batch=2, max_len=16, kv_dtype="int8")
    assert all(c.channel_scaled for c in m.new_caches(cache, **kw))
    assert not any(c.channel_scaled for c in m.new_caches(cache, **kw, k_channel_scale=False))
    assert all(c.channel_scaled for c in m.new_caches(cache, max_batch=2, max_len=16, kv_dtype="fp8_e4m3",
                                                      k_channel_scale=True)) if len(QDTYPES) > 1 else True
    H, D = m.new_caches(cache, **kw)[0].num_kv_heads, m.new_caches(cache, **kw)[0].head_dim
    given = [torch.full((H, D), 2.0), False]
    cs = m.new_caches(cache, **kw, k_channel_scale=given)
    assert torch.equal(cs[0].k_channel_scale, given[0]) and not cs[1].channel_scaled
    with pytest.raises(ValueError, match="k_channel_scale has 1 entries for 2 layers"):
        m.new_caches(cache, **kw, k_channel_scale=[True])
    with pytest.raises(ValueError, match="k_channel_scale"):
        m.new_caches(cache, max_batch=2, max_len=16, k_channel_scale=True)


# ---------------------------------------------------------------------------- models


def _model(attention, std=0.02):
    torch.manual_seed(0)
    extra = dict(num_kv_heads=2) if attention == "gqa" else dict(
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, attention=attention, **extra)
    return Decoder(cfg, init_std=std).eval()


class RoundTripCache(DynamicCache):
    """A float cache holding what a quantized cache dequantizes to: the reference of generation
    (int8: K divided by the channel scale of the first write, quantized, multiplied back)."""

    def __init__(self, like, kv_dtype):
        super().__init__(like.num_kv_heads, like.head_dim, like.v_head_dim, value_from_key=like.value_from_key,
                         dtype=like.dtype)
        self.rt, self.c = kv_dtype, None

    def write(self, step, k, v):
        if self.c is None and kv_storage_dtype(self.rt) == torch.int8:
            self.c = channel_scale(k)  # the prompts are all as long: no padding to leave out
        back = lambda t, c=None: None if t is None else dq(t, self.rt, c).to(t.dtype)  # noqa: E731
        super().write(step, back(k, self.c), back(v))


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 3, 5, 7, 9]]


def _greedy(m, caches, n):
    ids = torch.tensor(PROMPTS)
    out = []
    with torch.inference_mode():
        tok = m(ids, caches=caches, logits_to_keep=1)[:, -1].argmax(-1)
        out.append(tok)
        for _ in range(n - 1):
            tok = m(tok[:, None], caches=caches, logits_to_keep=1)[:, -1].argmax(-1)
            out.append(tok)
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("kv_dtype", QDTYPES)
@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_generate_equals_a_cache_of_dequantized_values(attention, cache, kv_dtype):
    m = _model(attention, std=0.1)
    got = m.generate(PROMPTS, 8, cache=cache, kv_dtype=kv_dtype).tokens
    ref = [RoundTripCache(c, kv_dtype) for c in m.new_caches("dynamic")]
    assert got == _greedy(m, ref, 8)
    # the logits themselves, step by step
    qc = m.new_caches(cache, max_batch=3, max_len=16, kv_dtype=kv_dtype)
    rc = [RoundTripCache(c, kv_dtype) for c in m.new_caches("dynamic")]
    with torch.inference_mode():
        for ids in (torch.tensor(PROMPTS), torch.tensor([[4], [5], [6]]), torch.tensor([[7], [8], [9]])):
            torch.testing.assert_close(m(ids, caches=qc), m(ids, caches=rc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_int8_generation_agrees_with_the_float_cache_where_logits_are_decided(attention):
    """The first token equals the float cache's wherever its top-2 logit margin exceeds 4x the
    largest logit change quantization made (so a flip would be a real error, not a tie)."""
    m = _model(attention)
    ids = torch.tensor(PROMPTS)
    with torch.inference_mode():
        lf = m(ids, caches=m.new_caches("dynamic"), logits_to_keep=1)[:, -1]
        lq = m(ids, caches=m.new_caches("dynamic", kv_dtype="int8"), logits_to_keep=1)[:, -1]
    change = (lq - lf).abs().max()
    assert 0 < change < 0.05  # quantized, and close
    top2 = lf.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) > 4 * change
    assert decided.any()
    want = m.generate(PROMPTS, 1).tokens
    got = m.generate(PROMPTS, 1, kv_dtype="int8").tokens
    assert [g for g, d in zip(got, decided) if d] == [w for w, d in zip(want, decided) if d]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_compiled_decode_with_a_quantized_cache(attention):
    """The quantize-on-write traces: the compiled static step (fullgraph) gives the eager tokens
    and serves a second call without recompiling."""
    m = _model(attention, std=0.1)
    want = m.generate(PROMPTS, 8, cache="static", kv_dtype="int8").tokens
    assert m.generate(PROMPTS, 8, cache="static", compile="eager", kv_dtype="int8").tokens == want
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert m.generate(PROMPTS, 8, cache="static", compile="eager", kv_dtype="int8").tokens == want


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype="int4"), "kv_dtype must be"),
    (dict(kv_dtype="bf16"), "kv_dtype must be"),
    (dict(kv_dtype="int8", cache=None), "kv_dtype='int8' quantizes the KV cache"),
])
def test_bad_kv_dtype_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _model("gqa").generate(PROMPTS, 2, **kwargs)


def test_caches_refuse_unknown_kv_dtype():
    for make in (lambda: DynamicCache(2, 8, kv_dtype="int4"),
                 lambda: PagedKVCache(2, 8, num_blocks=2, kv_dtype=torch.float16),
                 lambda: _model("gqa").new_caches("static", max_batch=1, max_len=4, kv_dtype="q8")):
        with pytest.raises(ValueError, match="kv_dtype must be"):
            make()


def test_cli_kv_dtype_flag(capsys):
    parse = lambda *a: build_parser().parse_args(["generate", "folder", "--prompt", "p", *a])  # noqa: E731
    assert parse().kv_dtype is None
    assert parse("--kv-dtype", "int8").kv_dtype == "int8"
    assert parse("--kv-dtype", "fp8").kv_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit) as e:
        main(["generate", "folder", "--prompt", "p", "--kv-dtype", "int4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    # the spellings a user types, not Python values (None, torch.int8)
    assert "--kv-dtype" in err and "'int4'" in err and "int8" in err and "fp8_e4m3" in err
    assert "torch." not in err and "None" not in err
