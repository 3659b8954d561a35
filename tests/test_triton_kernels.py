"""The Triton decode kernel (paged and contiguous, GQA, MLA latent) against the fp64 oracle.

Without CUDA these run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1),
on small shapes: the interpreter runs each program in numpy. With CUDA the same tests run the
compiled kernels."""

from __future__ import annotations

import math
import random

import pytest
import torch

import attnkit
from attnkit.caches import DynamicCache, StaticCache
from attnkit.caches.paged import PagedKVCache
from attnkit import masks as M
from attnkit.masks import Causal, KeyPadding, SlidingWindow
from attnkit.backends.triton.plan import split_plan

from conftest import AOT_PREAMBLE, base_attention, compile_ahead, rule_r, scattered_table, stable_seed

triton_ops = pytest.importorskip("attnkit.backends.triton.ops")
if triton_ops.available() is not None:
    pytest.skip(f"Triton kernels unavailable: {triton_ops.available()}", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pools(B, Hkv, D, Dv, page, lens, dtype, *, seed, value_from_key=False):
    """Random pages in a scattered (shuffled) block table; returns k_pool, v_pool | None, table and
    the contiguous (B, Hkv, max_len, D|Dv) K and V the table describes (zeros past each length)."""
    g = torch.Generator().manual_seed(seed)
    table, N = scattered_table(lens, page, random.Random(seed))
    k_pool = torch.randn(N, page, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    v_pool = None if value_from_key else torch.randn(N, page, Hkv, Dv, generator=g, dtype=torch.float64).to(dtype)
    L = max(lens)
    pos = torch.arange(L)
    rows = table.long()[:, pos // page] * page + pos % page  # (B, L) pool rows
    k = k_pool.flatten(0, 1)[rows].permute(0, 2, 1, 3)  # (B, Hkv, L, D)
    v = k[..., :Dv] if value_from_key else v_pool.flatten(0, 1)[rows].permute(0, 2, 1, 3)
    dev = lambda t: None if t is None else t.to(DEV)
    return dev(k_pool), dev(v_pool), table.to(DEV), k, v


def _check(out, q, k, v, mask, scale=None):
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, scale=scale)
    base = base_attention(q, k, v, mask, scale=scale)
    rule_r(out.cpu(), base, gold)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("page", [16, 64])
def test_paged_decode_matches_oracle(page, groups, dtype):
    """Ragged lengths (one sequence empty, lengths not multiples of the page), scattered tables,
    1-8 query tokens (speculative verification: causal among them), GQA ratios 1, 4, 8."""
    seed = stable_seed("paged", page, groups, str(dtype))
    rng = random.Random(seed)
    B, Hkv, D = 3, 2, 32
    S = rng.choice([1, 3, 8])
    lens = [0, rng.randint(S, 40), rng.randint(70, 150)]
    lens[0] = 0
    k_pool, v_pool, table, k, v = _pools(B, Hkv, D, D, page, lens, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, Hkv * groups, S, D, generator=g, dtype=torch.float64).to(dtype)
    seq = torch.tensor(lens)
    q_start = seq - S
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV),
                                            q_start=q_start.to(DEV), num_splits=rng.choice([0, 1, 3]))
    assert out.dtype == dtype and out.shape == (B, Hkv * groups, S, D)
    mask = Causal(q_start=q_start) & KeyPadding(seq)
    _check(out, q, k, v, mask)
    assert (out[0] == 0).all(), "a sequence with no keys gives exact zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank,rope", [(64, 16), (80, 32), (512, 64)])
def test_mla_latent_decode_matches_oracle(rank, rope, dtype):
    """Absorbed-MLA decode: one latent head [c_kv | k_rope], V = its first `rank` channels, many
    query heads; paged (page 16) and contiguous; any rank / rope width (80 and 32: not powers of 2)."""
    seed = stable_seed("mla", rank, rope, str(dtype))
    H, S = (16, 2) if rank < 512 else (4, 1)
    lens = [37, 90]
    D = rank + rope
    k_pool, _, table, k, v = _pools(2, 1, D, rank, 16, lens, dtype, seed=seed, value_from_key=True)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(2, H, S, D, generator=g, dtype=torch.float64).to(dtype)
    scale = 0.7 / math.sqrt(D)
    seq = torch.tensor(lens)
    mask = Causal(q_start=seq - S) & KeyPadding(seq)
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, None, table, seq.to(DEV), scale=scale,
                                            v_head_dim=rank)
    _check(out, q, k, v, mask, scale)
    # Contiguous latent cache (B, 1, L, D) and V as a view of it: the same kernel through strides.
    kc = k.contiguous().to(DEV)
    out_c = triton_ops.decode_attention(q.to(DEV), kc, None, lengths=seq.to(DEV), scale=scale, v_head_dim=rank)
    _check(out_c, q, k, v, mask, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_row_tiles_per_kv_head(dtype):
    """64 query heads on one latent head (MLA-like) and GQA 32/1 at D 64: several row tiles per
    KV head, each reading the cache."""
    for H, D, Dv, vfk in ((64, 576, 512, True), (32, 64, 64, False)):
        lens = [45, 70]
        k_pool, v_pool, table, k, v = _pools(2, 1, D, Dv, 16, lens, dtype, seed=H, value_from_key=vfk)
        q = torch.randn(2, H, 1, D, generator=torch.Generator().manual_seed(H)).to(dtype)
        seq = torch.tensor(lens)
        out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV), v_head_dim=Dv)
        _check(out, q, k, v, Causal(q_start=seq - 1) & KeyPadding(seq))


def test_strided_and_zero_dim_index_tensors():
    """lengths / q_start / block_table given as int32 views with odd strides or as 0-d tensors
    read what they hold (the kernel indexes contiguous rows)."""
    k_pool, v_pool, table, k, v = _pools(2, 2, 16, 16, 16, [20, 30], torch.float32, seed=7)
    q = torch.randn(2, 4, 1, 16)
    mask = Causal(q_start=torch.tensor([19, 29])) & KeyPadding(torch.tensor([20, 30]))
    seq_view = torch.tensor([[20, 5], [30, 7]], dtype=torch.int32, device=DEV)[:, 0]  # stride 2
    table_t = table.t().contiguous().t()  # column-major
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table_t, seq_view)
    _check(out, q, k, v, mask)
    one = torch.tensor([20, 7], dtype=torch.int32, device=DEV)[0]  # a 0-d view: every sequence 20 keys
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, one)
    _check(out, q, k, v, Causal(q_start=torch.tensor([19, 19])) & KeyPadding(torch.tensor([20, 20])))


def test_max_len_below_the_longest_sequence_is_refused():
    q = torch.randn(1, 2, 1, 16, device=DEV)
    k = torch.randn(1, 1, 300, 16, device=DEV)
    with pytest.raises(ValueError, match="max_len=100 is below the longest sequence"):
        triton_ops.paged_decode_attention(q, k.transpose(1, 2), k.transpose(1, 2),
                                          torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                                          torch.tensor([300], device=DEV), max_len=100)


def test_split_count_changes_nothing_but_rounding():
    q = torch.randn(2, 8, 1, 64, device=DEV)
    k = torch.randn(2, 2, 300, 64, device=DEV)
    v = torch.randn(2, 2, 300, 64, device=DEV)
    ref = triton_ops.decode_attention(q, k, v, num_splits=1)
    for n in (2, 5, 7):
        torch.testing.assert_close(triton_ops.decode_attention(q, k, v, num_splits=n), ref)


# --------------------------------------------------------------------------- the split rule

H100 = dict(num_sms=132, programs_per_sm=2, block_n=64)


def test_split_plan_decisions_for_h100_shapes():
    """The wave rule on an H100's 132 SMs (two 4-warp programs each): GQA 32/8 at B 32 fills the
    wave unsplit at 4k and 32k (256 of 264 programs), B 128 more than fills it; one long sequence
    is cut into the fewest chunks that fill one wave; a short sequence is never cut below 128 keys;
    MLA's 4 row tiles of 32 heads at B 32 fill 132 SMs of one program each."""
    assert split_plan(32, 8, 1, 4096, **H100) == (1, 4096)
    assert split_plan(32, 8, 1, 32768, **H100) == (1, 32768)
    assert split_plan(128, 8, 1, 4096, **H100) == (1, 4096)
    assert split_plan(1, 8, 1, 131072, **H100) == (33, 4032)  # 8 x 33 = 264 programs: one wave
    assert split_plan(1, 8, 1, 32768, **H100) == (32, 1024)
    assert split_plan(4, 8, 1, 4096, **H100) == (8, 512)
    assert split_plan(1, 8, 1, 300, **H100) == (3, 128)  # the smallest chunk: 128 keys
    assert split_plan(1, 8, 1, 100, **H100) == (1, 128)  # one tile-rounded chunk covers it
    assert split_plan(32, 1, 4, 4096, num_sms=132, programs_per_sm=1, block_n=32) == (1, 4096)
    assert split_plan(32, 1, 4, 32768, num_sms=132, programs_per_sm=1, block_n=32) == (1, 32768)
    assert split_plan(128, 1, 4, 4096, num_sms=132, programs_per_sm=1, block_n=32) == (1, 4096)
    assert split_plan(1, 1, 4, 32768, num_sms=132, programs_per_sm=1, block_n=32) == (32, 1024)
    # Per-sequence lengths: a short sequence's single chunk is all it adds to the wave.
    assert split_plan(2, 8, 1, [32768, 100], **H100) == (32, 1024)
    assert split_plan(2, 8, 1, 32768, **H100) == (16, 2048)
    assert split_plan(0, 8, 1, [], **H100) == (1, 64)


def test_launch_plans_the_issue_shapes_from_the_kernel_configs():
    """What a launch on an H100 (132 SMs) decides, from the tile sizes _config picks: bf16 GQA
    32/8 at D 128 is one 16-row tile per KV head and 64-key tiles, two 4-warp programs per SM;
    absorbed MLA (128 heads, 512 + 64) is 4 row tiles of 32 heads, 32-key tiles, one 8-warp
    program per SM. Neither splits at B 32 or B 128; one sequence is cut to fill the wave."""
    from attnkit.backends.triton import kernel as td

    gqa = td._config(torch.bfloat16, 128, 128, 8, False)
    mla = td._config(torch.bfloat16, 576, 512, 128, True)
    assert (gqa["BLOCK_M"], gqa["BLOCK_N"], td._programs_per_sm(gqa)) == (16, 64, 2)
    assert (mla["BLOCK_M"], mla["BLOCK_N"], td._programs_per_sm(mla)) == (32, 32, 1)

    def plan(cfg, B, Hkv, rows, L):
        return split_plan(B, Hkv, -(-rows // cfg["BLOCK_M"]), L, 132, td._programs_per_sm(cfg), cfg["BLOCK_N"])

    for B, L in ((32, 4096), (32, 32768), (128, 4096)):
        assert plan(gqa, B, 8, 8, L) == (1, L) and plan(mla, B, 1, 128, L) == (1, L)
    assert plan(gqa, 1, 8, 8, 32768) == (32, 1024)
    assert plan(mla, 1, 1, 128, 32768) == (32, 1024)


def _programs(B, Hkv, tiles, lens, chunk):
    return Hkv * tiles * sum(max(1, -(-n // chunk)) for n in lens)


@pytest.mark.parametrize("seed", range(6))
def test_split_plan_properties(seed):
    """For random shapes and devices: chunks are whole tiles of at least 128 keys (or one chunk
    covering the longest sequence); a split call's programs fit one wave and one tile less per
    chunk would not; never more splits than chunks; a call that fills the wave is not split.
    Monotone: more sequences, heads or row tiles never add splits, more SMs or resident programs
    never remove one, and a longer context never shortens the chunk."""
    rng = random.Random(seed)
    for _ in range(300):
        B, Hkv, tiles = rng.randint(1, 160), rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2, 4])
        L, sms = rng.randint(0, 200_000), rng.choice([8, 108, 132, 170])
        pps, bn = rng.choice([1, 2, 4]), rng.choice([16, 32, 64, 128])
        n, chunk = split_plan(B, Hkv, tiles, L, sms, pps, bn)
        assert n >= 1 and chunk % bn == 0 and n * chunk >= L
        wave = sms * pps
        if n == 1:
            assert chunk >= L
        else:
            assert chunk >= 128 and n == -(-L // chunk) and n <= -(-L // bn)
            assert B * Hkv * tiles < wave and _programs(B, Hkv, tiles, [L] * B, chunk) <= wave
            if chunk - bn >= 128:
                assert _programs(B, Hkv, tiles, [L] * B, chunk - bn) > wave
        if B * Hkv * tiles >= wave:
            assert n == 1
        assert split_plan(B + rng.randint(1, 9), Hkv, tiles, L, sms, pps, bn)[0] <= n
        assert split_plan(B, Hkv * 2, tiles, L, sms, pps, bn)[0] <= n
        assert split_plan(B, Hkv, tiles * 2, L, sms, pps, bn)[0] <= n
        assert split_plan(B, Hkv, tiles, L, sms + rng.randint(1, 64), pps, bn)[0] >= n
        assert split_plan(B, Hkv, tiles, L, sms, pps * 2, bn)[0] >= n
        assert split_plan(B, Hkv, tiles, L + rng.randint(1, 5000), sms, pps, bn)[1] >= chunk


class _CountMerges:
    """Stands in for the merge kernel: counts its launches and runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", ["single", "forced", "planned"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_single_and_multi_split_paths_match_oracle_with_modifiers(layout, splits, dtype, monkeypatch):
    """The single split writes the normalized output itself (the merge kernel never runs); the
    multi-split path (a forced count, or the wave rule on an H100-sized device) writes partials
    and merges them. Both against the oracle, dense and paged, plain, with every modifier at
    once (sinks, soft-cap, ALiBi, a sliding window with its own anchor) and with one sink logit
    per query row, ragged lengths with an empty sequence (exact zeros)."""
    from attnkit.backends.triton import kernel as td

    seed = stable_seed("split-paths", layout, splits, str(dtype))
    B, Hkv, G, S, D, page = 3, 2, 2, 2, 32, 16
    lens = [0, 45, 290] if layout == "paged" else [S, 45, 290]
    k_pool, v_pool, table, k, v = _pools(B, Hkv, D, D, page, lens, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64).to(dtype)
    seq = torch.tensor(lens)
    q_start = seq - S
    w_start = q_start - torch.tensor([0, 1, 5])
    slopes, sinks = M.alibi_slopes(Hkv * G), torch.randn(Hkv * G, generator=g)
    num_splits = {"single": 1, "forced": 3, "planned": 0}[splits]
    if splits == "planned":  # the wave rule on an H100's size: 6 programs, so it splits 290 keys
        monkeypatch.setattr(td, "_INTERPRETER_WAVE", (132, 2))
        assert split_plan(B, Hkv, 1, max(lens), 132, 2, td._config(dtype, D, D, G * S, False)["BLOCK_N"])[0] > 1
    merges = _CountMerges(td._merge_kernel)
    monkeypatch.setattr(td, "_merge_kernel", merges)
    plain = Causal(q_start=q_start) & KeyPadding(seq)
    query_sinks = torch.randn(B, Hkv * G, S, generator=g)  # one logit per query row (Inkling 2)
    for mods, mask in (({}, plain),
                       (dict(sinks=sinks, softcap=6.0, alibi_slopes=slopes, window=(200, 0), window_q_start=w_start),
                        M.ALiBi(slopes, q_start=q_start) & plain & SlidingWindow(200, 0, q_start=w_start)),
                       (dict(sinks=query_sinks), plain)):
        dev_mods = {key: val.to(DEV) if isinstance(val, torch.Tensor) else val for key, val in mods.items()}
        if layout == "paged":
            out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV),
                                                    q_start=q_start.to(DEV), num_splits=num_splits, **dev_mods)
        else:
            out = triton_ops.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), lengths=seq.to(DEV),
                                              q_start=q_start.to(DEV), num_splits=num_splits, **dev_mods)
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, softcap=mods.get("softcap"),
                                           sinks=None if "sinks" not in mods else mods["sinks"].double())
        base = base_attention(q, k, v, mask, softcap=mods.get("softcap"), sinks=mods.get("sinks"))
        rule_r(out.cpu(), base, gold)
        if layout == "paged":
            assert (out[0] == 0).all(), "a sequence with no keys gives exact zeros"
    # The window (202 keys the rows see together) still spans several 128-key chunks.
    assert merges.launches == (0 if splits == "single" else 3), "the merge runs exactly when there are splits"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_latent_single_and_multi_split(num_splits):
    """V read from K (MLA's latent layout, rank 64 + rope 16) with sinks, through the single split
    that writes the output itself and through three merged splits."""
    k_pool, _, table, k, v = _pools(2, 1, 80, 64, 16, [150, 300], torch.bfloat16, seed=21, value_from_key=True)
    g = torch.Generator().manual_seed(22)
    q = torch.randn(2, 16, 1, 80, generator=g).to(torch.bfloat16)
    sinks = torch.randn(16, generator=g)
    seq = torch.tensor([150, 300])
    mask = Causal(q_start=seq - 1) & KeyPadding(seq)
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, None, table, seq.to(DEV), v_head_dim=64,
                                            num_splits=num_splits, sinks=sinks.to(DEV))
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, sinks=sinks.double())
    rule_r(out.cpu(), base_attention(q, k, v, mask, sinks=sinks), gold)


def test_pool_past_two_to_the_31_elements_is_addressed_in_int64():
    """Block offsets are 64-bit: in an int8 pool of more than 2**31 elements (allocated, only the
    used blocks written), a sequence whose blocks lie past element 2**31 reads them, not a
    wrapped-around address."""
    bs, D, Dv = 16, 80, 64
    N = (1 << 31) // (bs * D) + 4
    pool = torch.empty(N, bs, 1, D, dtype=torch.int8, device=DEV)
    scale = torch.empty(N, bs, 1, dtype=torch.float32, device=DEV)
    g = torch.Generator().manual_seed(5)
    blocks = [N - 1, 0, N - 3]
    for blk in blocks:
        pool[blk] = torch.randint(-127, 128, (bs, 1, D), generator=g, dtype=torch.int8).to(DEV)
        scale[blk] = (torch.rand(bs, 1, generator=g) / 64).to(DEV)
    L = 40
    q = torch.randn(1, 4, 1, D, generator=g)
    for splits in (1, 2):
        out = triton_ops.paged_decode_attention(q.to(DEV), pool, None, torch.tensor([blocks], dtype=torch.int32,
                                                device=DEV), torch.tensor([L], device=DEV), v_head_dim=Dv,
                                                k_scale=scale, num_splits=splits)
        k = torch.cat([pool[b, :, 0].cpu().float() * scale[b].cpu() for b in blocks])[:L][None, None]
        mask = Causal(q_start=torch.tensor([L - 1]))
        gold = attnkit.attention_reference(q.double(), k.double(), k[..., :Dv].double(), mask)
        rule_r(out.cpu(), base_attention(q, k, k[..., :Dv], mask), gold)
    del pool


def test_contiguous_sequence_past_two_to_the_31_elements_is_addressed_in_int64():
    """Slot offsets are 64-bit: a contiguous cache is one block of L slots, so one long sequence
    (here more than 2**31 int8 elements, only its last keys written) has slots whose offsets pass
    int32. A sliding window makes the kernel read just those keys."""
    D, Dv, W = 80, 64, 20
    L = (1 << 31) // D + 64
    k = torch.empty(1, 1, L, D, dtype=torch.int8, device=DEV)
    scale = torch.empty(1, 1, L, dtype=torch.float32, device=DEV)
    g = torch.Generator().manual_seed(6)
    k[0, 0, L - W - 1:] = torch.randint(-127, 128, (W + 1, D), generator=g, dtype=torch.int8).to(DEV)
    scale[0, 0, L - W - 1:] = (torch.rand(W + 1, generator=g) / 64).to(DEV)
    q = torch.randn(1, 4, 1, D, generator=g)
    out = triton_ops.decode_attention(q.to(DEV), k, None, v_head_dim=Dv, k_scale=scale, window=(W, 0))
    tail = (k[0, 0, L - W - 1:].cpu().float() * scale[0, 0, L - W - 1:, None].cpu())[None, None]
    gold = attnkit.attention_reference(q.double(), tail.double(), tail[..., :Dv].double(), None)
    rule_r(out.cpu(), base_attention(q, tail, tail[..., :Dv], None), gold)
    del k


def test_non_causal_empty_and_fully_masked_rows():
    q = torch.randn(2, 4, 3, 16, device=DEV)
    k = torch.randn(2, 1, 20, 16, device=DEV)
    v = torch.randn(2, 1, 20, 16, device=DEV)
    out = triton_ops.decode_attention(q, k, v, q_start=triton_ops.NO_CAUSAL)
    _check(out, q.cpu(), k.cpu(), v.cpu(), None)
    # q_start so small that the first query of each sequence sees no key: exact zeros there.
    out = triton_ops.decode_attention(q, k, v, q_start=torch.tensor([-1, 5], device=DEV))
    assert (out[0, :, 0] == 0).all()
    _check(out, q.cpu(), k.cpu(), v.cpu(), Causal(q_start=torch.tensor([-1, 5])))
    # Nothing cached at all.
    empty = triton_ops.decode_attention(q, k[:, :, :0], v[:, :, :0])
    assert empty.shape == (2, 4, 3, 16) and (empty == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("left,right", [(5, 0), (0, 0), (12, 3), (None, 2), (4, None), (200, 0), (61, 0)])
def test_sliding_window_matches_oracle(left, right, dtype):
    """A window (left, right) around each row's own position, anchored apart from the causal
    part (a cache's q_start), over scattered blocks: ragged lengths, an empty sequence, 1-4 query
    tokens, forced split counts (splits start at the window, not at key 0). (61, 0) with 4 queries:
    the rows see 65 keys together, one past a tile, so splits that left out the queries' own
    spread would miss keys."""
    seed = stable_seed("window", left, right, str(dtype))
    rng = random.Random(seed)
    B, Hkv, G, D, page = 3, 2, 2, 32, 16
    S = 4 if left == 61 else rng.choice([1, 4])
    lens = [0, rng.randint(S, 40), rng.randint(90, 150)]
    k_pool, v_pool, table, k, v = _pools(B, Hkv, D, D, page, lens, dtype, seed=seed)
    q = torch.randn(B, Hkv * G, S, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    seq = torch.tensor(lens)
    q_start = seq - S
    w_start = q_start - torch.tensor([0, 1, 7])  # the window's own anchor
    mask = Causal(q_start=q_start) & KeyPadding(seq) & SlidingWindow(left, right, q_start=w_start)
    for splits in (0, 1, 3):
        out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV),
                                                q_start=q_start.to(DEV), num_splits=splits, window=(left, right),
                                                window_q_start=w_start.to(DEV))
        _check(out, q, k, v, mask)
        assert (out[0] == 0).all()


def test_window_arguments_are_checked():
    q, k, v = (torch.randn(1, 2, 1, 16, device=DEV), torch.randn(1, 1, 20, 16, device=DEV),
               torch.randn(1, 1, 20, 16, device=DEV))
    for bad in ((3,), (-1, 0), (2.5, 0), 4):
        with pytest.raises(ValueError, match="window"):
            triton_ops.decode_attention(q, k, v, window=bad)
    with pytest.raises(ValueError, match="window_q_start"):
        triton_ops.decode_attention(q, k, v, window_q_start=3)


def test_old_keyword_spellings_still_work_with_a_deprecation_warning():
    """``seq_lens=``, ``window_start=`` and ``alibi_start=`` are the deprecated spellings of
    ``lengths=``, ``window_q_start=`` and ``alibi_q_start=``: same results, a DeprecationWarning
    naming the new keyword, and both spellings at once is an error."""
    k_pool, v_pool, table, k, v = _pools(2, 1, 16, 16, 8, [20, 9], torch.float32, seed=11)
    q = torch.randn(2, 2, 2, 16, device=DEV)
    lens = torch.tensor([20, 9], device=DEV)
    slopes = torch.tensor([0.5, 0.25], device=DEV)
    new = dict(window=(3, 0), window_q_start=lens - 2, alibi_slopes=slopes, alibi_q_start=lens - 3)
    want = triton_ops.paged_decode_attention(q, k_pool, v_pool, table, lens, **new)
    with pytest.warns(DeprecationWarning) as record:
        got = triton_ops.paged_decode_attention(q, k_pool, v_pool, table, seq_lens=lens, window=(3, 0),
                                                window_start=lens - 2, alibi_slopes=slopes, alibi_start=lens - 3)
    assert torch.equal(got, want)
    said = " ".join(str(w.message) for w in record)
    assert all(f"use {name}=" in said for name in ("lengths", "window_q_start", "alibi_q_start")), said
    kc, vc = k.to(DEV), v.to(DEV)
    with pytest.warns(DeprecationWarning, match="use lengths="):
        got = triton_ops.decode_attention(q, kc, vc, seq_lens=torch.tensor([20, 9], device=DEV))
    assert torch.equal(got, triton_ops.decode_attention(q, kc, vc, lengths=torch.tensor([20, 9], device=DEV)))
    with pytest.raises(TypeError, match="lengths= only"):
        triton_ops.paged_decode_attention(q, k_pool, v_pool, table, lens, seq_lens=lens)


def test_registered_as_a_custom_op_that_compiles_without_graph_breaks():
    q = torch.randn(1, 4, 1, 16, device=DEV)
    k = torch.randn(1, 2, 24, 16, device=DEV)
    v = torch.randn(1, 2, 24, 16, device=DEV)
    args = (q, k.transpose(1, 2), v.transpose(1, 2), torch.zeros(1, 1, dtype=torch.int32, device=DEV),
            torch.tensor([23], dtype=torch.int32, device=DEV), torch.tensor([24], dtype=torch.int32, device=DEV),
            0.25, 16, 24, 2)
    torch.library.opcheck(torch.ops.attnkit.decode_attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))

    def f(q, k, v):
        return triton_ops.decode_attention(q, k, v, q_start=23, lengths=24) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


# --------------------------------------------------------------------------- through attnkit


def test_backend_takes_cache_masks_and_refuses_the_rest():
    q, k, v = (torch.randn(2, 4, 2, 16, device=DEV), torch.randn(2, 2, 30, 16, device=DEV),
               torch.randn(2, 2, 30, 16, device=DEV))
    mask = Causal(q_start=torch.tensor([10, 28])) & KeyPadding(torch.tensor([12, 30]))
    out = attnkit.attention(q, k, v, mask, backend="triton")
    _check(out, q.cpu(), k.cpu(), v.cpu(), mask)
    out = attnkit.attention(q, k, v, causal=True, backend="triton")
    _check(out, q.cpu(), k.cpu(), v.cpu(), Causal())
    assert attnkit.describe_call(q, k, v, causal=True) != "triton"  # auto never picks it on CPU
    with pytest.raises(attnkit.BackendNotSupported, match="triton.*SlidingWindow"):
        attnkit.attention(q, k, v, SlidingWindow(4) & SlidingWindow(2, 1), backend="triton")
    with pytest.raises(attnkit.BackendNotSupported, match="Sq=17"):
        attnkit.attention(torch.randn(2, 4, 17, 16, device=DEV), k, v, backend="triton")
    with pytest.raises(attnkit.BackendNotSupported, match="gradients"):
        attnkit.attention(q.requires_grad_(), k, v, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_caches_through_the_kernel_equal_the_default_path(kind, dtype):
    """Ragged batched decode and a 3-token verification step, MHA/GQA and the MLA latent layout."""
    for Hq, Hkv, D, Dv, vfk in ((4, 2, 16, 16, False), (6, 1, 24, 16, True)):
        caches = []
        for _ in range(2):
            if kind == "paged":
                caches.append(PagedKVCache(Hkv, D, Dv, num_blocks=24, block_size=16, value_from_key=vfk, device=DEV,
                                           dtype=dtype))
            elif kind == "static":
                caches.append(StaticCache(Hkv, D, Dv, max_batch=3, max_len=64, value_from_key=vfk, device=DEV,
                                          dtype=dtype))
            else:
                caches.append(DynamicCache(Hkv, D, Dv, value_from_key=vfk, device=DEV, dtype=dtype))
        g = torch.Generator().manual_seed(3)
        for S, n in ((9, [9, 4, 7]), (1, [1, 1, 0]), (3, [3, 2, 3]), (1, [1, 1, 1])):
            q = torch.randn(3, Hq, S, D, generator=g).to(DEV, dtype)
            k = torch.randn(3, Hkv, S, D, generator=g).to(DEV, dtype)
            v = None if vfk else torch.randn(3, Hkv, S, Dv, generator=g).to(DEV, dtype)
            nn_ = torch.tensor(n, device=DEV)
            want = caches[0].attend(q, k, v, num_new=nn_, backend="math")
            got = caches[1].attend(q, k, v, num_new=nn_, backend="triton" if S <= 16 else "auto")
            tol = {} if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)  # P rounded to fp16 in the kernel
            torch.testing.assert_close(got, want, **tol)


def test_bad_input_names_the_argument():
    q = torch.randn(1, 4, 1, 16, device=DEV)
    pool = torch.randn(4, 16, 2, 16, device=DEV)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    cases = [
        (dict(q=torch.randn(1, 3, 1, 16, device=DEV)), "multiple of KV heads"),
        (dict(q=torch.randn(1, 4, 17, 16, device=DEV)), "at most 16"),
        (dict(q=torch.randn(1, 4, 1, 8, device=DEV)), "head dim"),
        (dict(block_table=table.float()), "block_table"),
        (dict(block_table=torch.full((1, 2), 9, dtype=torch.int32, device=DEV)), "block_table entries"),
        (dict(lengths=torch.tensor([33], device=DEV)), "lengths must be in"),
        (dict(v_pool=None), "v_head_dim"),
        (dict(v_pool=torch.randn(4, 16, 1, 16, device=DEV)), "v_pool"),
        (dict(q=torch.randn(1, 4, 1, 16, device=DEV, dtype=torch.float64)), "dtype"),
        (dict(sinks=torch.zeros(3, device=DEV)), r"sinks must be \(Hq,\) = \(4,\) or .*got shape \(3,\)"),
        (dict(sinks=torch.zeros(1, 4, 2, device=DEV)), r"sinks must be .*\(1, 4, 2\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.long, device=DEV)), "sinks must be a floating tensor"),
    ]
    for change, text in cases:
        kw = dict(q=q, k_pool=pool, v_pool=pool, block_table=table, lengths=torch.tensor([5], device=DEV))
        kw.update(change)
        with pytest.raises((ValueError, TypeError), match=text):
            triton_ops.paged_decode_attention(**kw)


_SMEM = {80: 166912, 90: 232448}  # shared memory per block (bytes) on A100 and H100/H200

_AOT = AOT_PREAMBLE + r"""
from attnkit.backends.triton import kernel as td
fn = td._split_kernel
ptrs = {"Q", "K", "V", "TABLE", "QSTART", "LENGTHS", "OP", "LSEP", "SLOPES", "ALIBI_QSTART", "KS", "VS", "WIN_QSTART",
        "OUT", "SINKS"}
consts, ints, attrs = kernel_params(fn, ptrs, ("scale_log2", "softcap"), ["DK", "DV", "KV_BLOCK_SIZE", "SPLIT_LEN"])


out = []
for dt, D, Dv, vfk, rows, direct, page, cap in json.loads(sys.argv[1]):
    cfg = td._config(getattr(torch, dt), D, Dv, rows, vfk)
    short = {"float32": "fp32", "bfloat16": "bf16"}[dt]
    sig = dict(Q="*" + short, K="*" + short, V="*" + short, TABLE="*i32", QSTART="*i32", LENGTHS="*i32",
               OP="*fp32", LSEP="*fp32", SLOPES="*fp32", ALIBI_QSTART="*i32", KS="*fp32", VS="*fp32",
               WIN_QSTART="*i32", OUT="*" + short, SINKS="*fp32", scale_log2="fp32", softcap="fp32",
               **{n: "i32" for n in ints})
    # The heaviest variant: soft-capping, ALiBi and a window on (more registers per score tile);
    # the single split also applies sinks and writes the output itself.
    cv = dict(V_FROM_K=vfk, HAS_ROPE=cfg["DR"] > 0, PRECISION="ieee" if short == "fp32" else "tf32",
              DOT_F32=False, HAS_SOFTCAP=True, HAS_ALIBI=True, QUANT=False, FP8=False, HAS_WINDOW=True,
              DIRECT=direct, HAS_SINKS=direct, PAGED=page > 0, PAGE=page,  # page 0: one block per sequence
              **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_DK", "BLOCK_DR", "BLOCK_DV")})
    assert set(cv) == set(consts), sorted(set(consts) ^ set(cv))
    sig.update({k: "constexpr" for k in cv})
    k = triton.compile(triton.compiler.ASTSource(fn, sig, cv, attrs), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    spills, regs = ptxas_report(k.asm["ptx"], cap)
    ptx = k.asm["ptx"]
    out.append(dict(case=[dt, D, Dv, vfk, rows, direct, page, cap], shared=k.metadata.shared, spills=spills, regs=regs,
                    wgmma="wgmma" in ptx, block_m=cfg["BLOCK_M"],
                    # global loads of 16 bytes per thread (to registers), async copies to shared
                    # memory by size, and the most copy groups a loop leaves in flight when it waits
                    ld_v4=len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
                    cp_async=collections.Counter(int(n, 16) for n in re.findall(
                        r"cp\.async\.c[ag]\.shared\.global(?:\.\w+)* \[[^]]+\], \[[^]]+\], (0x[0-9a-f]+)", ptx)),
                    in_flight=max((int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)), default=-1)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_configs_compile_within_shared_memory_for_sm80_and_sm90():
    """Compile the split kernel ahead of time for sm_80 and sm_90 (no GPU needed: Triton's CUDA
    backend and its bundled ptxas), with the tile sizes _config picks, at the largest head dims
    the kernel accepts, and check shared memory fits an A100 and an H100 / H200. In a child
    process: the interpreter mode of this one cannot compile."""
    cases = [[dt, D, Dv, vfk, 128, False, 16, cap] for dt in ("float32", "bfloat16")
             for D, Dv, vfk in ((128, 128, False), (576, 512, True), (576, 512, False), (1024, 512, False))
             for cap in _SMEM]
    for r in compile_ahead(_AOT, cases):
        assert r["shared"] <= _SMEM[r["case"][-1]], f"{r['case']}: {r['shared']} B shared"


# bf16 GQA 32/8 at D 128 (8 query rows per KV head) and absorbed MLA (128 heads on one latent
# head, 512 + 64), the multi-split and the single-split variant, for sm_80 and sm_90.
_DECODE_CASES = [["bfloat16", D, Dv, vfk, rows, direct, page, cap]
                 for D, Dv, vfk, rows in ((128, 128, False, 8), (576, 512, True, 128))
                 for direct in (False, True) for page in (16, 0) for cap in _SMEM]
_compiled: dict = {}


def _compiled_decode_kernels() -> list:
    if "decode" not in _compiled:
        _compiled["decode"] = compile_ahead(_AOT, _DECODE_CASES)
    return _compiled["decode"]


@pytest.mark.slow
def test_bf16_gqa_and_mla_kernels_fit_without_spills_on_sm80_and_sm90():
    """The bf16 GQA and MLA decode kernels, compiled ahead for sm_80 and sm_90 with the heaviest
    modifiers, use no more shared memory than one block may have and spill no registers (ptxas's
    report on the kernel's PTX)."""
    for r in _compiled_decode_kernels():
        assert r["shared"] <= _SMEM[r["case"][-1]], f"{r['case']}: {r['shared']} B shared"
        assert r["spills"] == 0, f"{r['case']}: {r['spills']} bytes of register spills ({r['regs']} registers)"


@pytest.mark.slow
def test_bf16_gqa_kernel_streams_k_and_v_in_16_byte_copies_with_tiles_in_flight():
    """The bf16 GQA decode kernel (D 128, 8 rows, paged with 16-key pages and contiguous) on sm_80
    and sm_90: K and V reach shared memory in 16-byte async copies only (no 4-byte copies: a
    table entry staged through shared memory made every iteration wait for all its copies), the
    interior loop waits with copy groups still in flight (the next tiles' K/V load while this
    one's math runs), and the edge tiles load 16-byte vectors to registers."""
    gqa = [r for r in _compiled_decode_kernels() if not r["case"][3]]
    assert {r["case"][-2] for r in gqa} == {16, 0}
    for r in gqa:
        sizes = {int(size): n for size, n in r["cp_async"].items()}
        assert set(sizes) == {16}, f"{r['case']}: async copies by size {sizes}"
        assert sizes[16] >= 2 * 64 * 128 * 2 // 16 // 128, f"{r['case']}: {sizes[16]} 16-byte copies"
        assert r["in_flight"] >= 1, f"{r['case']}: the loop waits for every copy (wait_group {r['in_flight']})"
        assert r["ld_v4"] >= 16, f"{r['case']}: {r['ld_v4']} 16-byte vector loads to registers"


_MERGE_AOT = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from attnkit.backends.triton import kernel as td
fn = td._merge_kernel
out = []
for cap, splits, dv in json.loads(sys.argv[1]):
    block_r = td._merge_rows(4096, splits, dv)
    sig = dict(OP="*fp32", LSEP="*fp32", OUT="*bf16", SINKS="*fp32", ROWS="i32", NSPLIT="i32", DV="i32", HQ="i32",
               S="i32", SINK_ROWS="i32", HAS_SINKS="constexpr", BLOCK_R="constexpr", BLOCK_SPLIT="constexpr", BLOCK_DV="constexpr")
    cv = dict(HAS_SINKS=True, BLOCK_R=block_r, BLOCK_SPLIT=splits, BLOCK_DV=dv)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("OP", "LSEP", "OUT", "SINKS", "DV")}
    k = triton.compile(triton.compiler.ASTSource(fn, sig, cv, attrs), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": 4})
    out.append(dict(case=[cap, splits, dv], block_r=block_r, v4=k.asm["ptx"].count("ld.global.v4")))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_merge_kernel_compiles_for_sm80_and_sm90_with_wide_loads():
    """The merge, a (rows, splits, channels) tile a program, compiles for sm_80 and sm_90 (the
    interpreter cannot tell) and reads the partial outputs in 16-byte vectors."""
    cases = [[cap, splits, dv] for cap in _SMEM for splits, dv in ((4, 128), (16, 512))]
    for r in compile_ahead(_MERGE_AOT, cases):
        assert r["v4"] > 0, f"{r['case']}: no 16-byte loads ({r['block_r']} rows a program)"


def test_addressing_by_block_size():
    """One block per sequence reads contiguous rows; power-of-two pages load their ids per page;
    other sizes and selections gather one table entry per key."""
    from attnkit.backends.triton.kernel import _addressing

    assert _addressing(4096, 4096, False) == (False, 0)  # a contiguous cache: block_size = L
    assert _addressing(4096, 300, True) == (False, 0)
    assert _addressing(16, 300, False) == (True, 16)
    assert _addressing(256, 4096, False) == (True, 256)
    assert _addressing(1, 300, False) == (True, 1)
    assert _addressing(24, 300, False) == (True, 0)
    assert _addressing(16, 300, True) == (True, 0)


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("page", [1, 5, 8, 32, 128])
def test_key_tiles_over_pages_of_any_size_with_interior_tiles_unmasked(page, block_n):
    """Sequences of many tiles (interior tiles skip the visibility masks), pages smaller than a
    tile, equal to it or larger, a power of two or not (per-key gather), speculative rows: against
    the oracle; with a sliding window whose start is not on a tile boundary; and a table entry
    that lies (check=False) inside an interior tile: its keys, and only they, count as masked."""
    from attnkit.backends.triton import tuning

    seed = stable_seed("tiles", page, block_n)
    B, Hkv, G, S, D = 3, 2, 2, 3, 16
    lens = [S, 77, 203]
    k_pool, v_pool, table, k, v = _pools(B, Hkv, D, D, page, lens, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, Hkv * G, S, D, generator=g)
    seq = torch.tensor(lens)
    q_start = seq - S
    plain = Causal(q_start=q_start) & KeyPadding(seq)
    lying = table.clone()
    bad = 96 // page  # the entry of key 96 of sequence 2: an interior tile's
    lying[2, bad] = 10_000
    keep = torch.ones(B, 1, 1, max(lens), dtype=torch.bool)
    keep[2, ..., bad * page:(bad + 1) * page] = False
    w_start = q_start - torch.tensor([0, 3, 7])
    with tuning.forced({"BLOCK_N": block_n}):
        for splits in (1, 3):
            out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV),
                                                    q_start=q_start.to(DEV), num_splits=splits)
            _check(out, q, k, v, plain)
            out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, lying, seq.to(DEV),
                                                    q_start=q_start.to(DEV), num_splits=splits, check=False)
            _check(out, q, k, v, plain & M.Dense(keep))
            out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV),
                                                    q_start=q_start.to(DEV), num_splits=splits, window=(41, 0),
                                                    window_q_start=w_start.to(DEV))
            _check(out, q, k, v, plain & SlidingWindow(41, 0, q_start=w_start))


def test_merge_takes_a_block_of_rows_per_program():
    """The merge combines up to 16 rows a program, fewer as splits and channels widen its tile."""
    from attnkit.backends.triton.kernel import _merge_rows

    assert _merge_rows(256, 4, 128) == 16
    assert _merge_rows(256, 16, 128) == 4
    assert _merge_rows(256, 16, 512) == 1
    assert _merge_rows(3, 2, 32) == 4  # one program, its last row masked
    assert _merge_rows(1, 2, 32) == 1


@pytest.mark.parametrize("sinks", [False, True])
def test_merge_of_many_rows_with_empty_rows_and_sinks(sinks):
    """Three forced splits over 2 x 8 query heads x 3 tokens (rows not a multiple of the merge's
    block), one sequence empty and rows whose splits all saw nothing: exact zeros there, the
    oracle elsewhere, sinks or not."""
    B, Hkv, G, S, D = 2, 2, 4, 3, 16
    lens = [0, 100]
    k_pool, v_pool, table, k, v = _pools(B, Hkv, D, D, 16, lens, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, Hkv * G, S, D, generator=g)
    sink = torch.randn(Hkv * G, generator=g) if sinks else None
    seq = torch.tensor(lens)
    q_start = seq - S
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, v_pool, table, seq.to(DEV), q_start=q_start.to(DEV),
                                            num_splits=3, sinks=None if sink is None else sink.to(DEV))
    mask = Causal(q_start=q_start) & KeyPadding(seq)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask,
                                       sinks=None if sink is None else sink.double())
    rule_r(out.cpu(), base_attention(q, k, v, mask, sinks=sink), gold)
    assert (out[0] == 0).all(), "a sequence with no keys gives exact zeros"


def test_table_padding_past_a_sequences_pages_is_accepted_and_a_lying_entry_is_never_read():
    """check=True validates only the entries holding tokens (the allocator pads with -1); with
    check=False (a caller's checked=True table) an entry outside the pool is never read: its keys
    count as masked, and nothing outside the pool is touched (on a GPU that read would fault)."""
    lens = [20, 5]
    k_pool, v_pool, table, k, v = _pools(2, 1, 16, 16, 8, lens, torch.float32, seed=3)
    table = torch.cat([table, torch.full((2, 2), -1, dtype=table.dtype, device=table.device)], 1)
    table[1, 1:] = -1  # sequence 1 holds 5 tokens: one page; the rest is padding
    q = torch.randn(2, 2, 1, 16).to(DEV)
    seq = torch.tensor(lens, device=DEV)
    out = triton_ops.paged_decode_attention(q, k_pool, v_pool, table, seq)
    _check(out, q.cpu(), k, v, M.KeyPadding(torch.tensor(lens)) & M.Causal(q_start=torch.tensor(lens) - 1))
    lying = table.clone()
    lying[0, 1] = 10_000  # keys 8..15 of sequence 0 point outside the pool
    with pytest.raises(ValueError, match="block_table entries holding tokens"):
        triton_ops.paged_decode_attention(q, k_pool, v_pool, lying, seq)
    out = triton_ops.paged_decode_attention(q, k_pool, v_pool, lying, seq, check=False)
    keep = torch.ones(2, 1, 1, max(lens), dtype=torch.bool)
    keep[0, ..., 8:16] = False
    mask = M.Dense(keep) & M.KeyPadding(torch.tensor(lens))
    _check(out, q.cpu(), k, v, mask)


@pytest.mark.parametrize("layout", ["dense", "paged", "fp8_e4m3", "int8-paged"])
def test_windowed_cache_steps_with_modifiers_through_attention(layout):
    """A windowed layer's decode step (a cache's q_start for the window and for causality, ragged
    lengths) with sinks (gpt-oss) or a soft cap and ALiBi, over each K/V layout the kernel reads:
    the oracle runs on the same (dequantized) K/V."""
    B, Hq, Hkv, S, L, D = 2, 4, 2, 2, 70, 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, Hq, S, D, generator=g)
    k, v = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    old, new = torch.tensor([60, 30]), torch.tensor([62, 32])
    mask = Causal(q_start=old) & KeyPadding(new) & SlidingWindow(9, q_start=old.clone())
    kv, kk, vv = (k.to(DEV), v.to(DEV)), k, v
    if layout.endswith("paged"):
        table = torch.randperm(B * 5, generator=g).view(B, 5)
        pool_k, pool_v = torch.zeros(B * 5, 16, Hkv, D), torch.zeros(B * 5, 16, Hkv, D)
        pos = torch.arange(L)
        for b in range(B):
            pool_k[table[b, pos // 16], pos % 16] = k[b].transpose(0, 1)
            pool_v[table[b, pos // 16], pos % 16] = v[b].transpose(0, 1)
        lens = torch.full((B,), L, device=DEV)
        if layout == "paged":
            kv = (attnkit.PagedKV(pool_k.to(DEV), pool_v.to(DEV), table.to(DEV), lens), None)
        else:
            kv = (attnkit.QuantizedKV.quantize(pool_k.to(DEV), pool_v.to(DEV), layout.split("-")[0],
                                               block_table=table.to(DEV), lengths=lens), None)
    elif layout != "dense":
        kv = (attnkit.QuantizedKV.quantize(k.to(DEV), v.to(DEV), layout), None)
    if isinstance(kv[0], attnkit.QuantizedKV):
        kk, vv = (t.cpu() for t in kv[0].gather(torch.float32))
    for mods in ({"sinks": torch.randn(Hq, generator=g)},
                 {"softcap": 5.0, "alibi": M.alibi_slopes(Hq)}):
        alibi = mods.pop("alibi", None)
        m = mask if alibi is None else M.ALiBi(alibi, q_start=old) & mask
        dev_mods = {key: val.to(DEV) if isinstance(val, torch.Tensor) else val for key, val in mods.items()}
        assert attnkit.describe_call(q.to(DEV), *kv, m, backend="triton", **dev_mods) == "triton"
        out = attnkit.attention(q.to(DEV), *kv, m, backend="triton", **dev_mods)
        sinks = mods.get("sinks")
        gold = attnkit.attention_reference(q.double(), kk.double(), vv.double(), m, softcap=mods.get("softcap"),
                                           sinks=None if sinks is None else sinks.double())
        rule_r(out.cpu(), base_attention(q, kk, vv, m, **mods), gold)
