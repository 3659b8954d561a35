"""The lean Triton MLA decode kernel (:mod:`attnkit.backends.triton.latent`) against the fp64
oracle, which calls ``kernel.launch`` hands it, and its ahead-of-time compile for sm_80 / sm_90.

Without CUDA these run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1),
on small latents (rank 64 + rope 16) and one case at DeepSeek's 512 + 64 with few keys."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit.backends.triton import tuning
from attnkit import masks as M
from attnkit.masks import Causal, KeyPadding

from conftest import AOT_PREAMBLE, base_attention, compile_ahead, rule_r, stable_seed

triton_ops = pytest.importorskip("attnkit.backends.triton.ops")
if triton_ops.available() is not None:
    pytest.skip(f"Triton kernels unavailable: {triton_ops.available()}", allow_module_level=True)

from attnkit.backends.triton import kernel as td  # noqa: E402 - after the availability check
from attnkit.backends.triton import latent  # noqa: E402

from test_triton_kernels import _SMEM, _pools  # noqa: E402 - the shared kernel's helpers

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# A split where a row sees nothing takes log2(0) = -inf for its log-sum-exp, as intended; the
# interpreter runs it in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


class _Calls:
    """``latent.launch`` wrapped: counts the calls it serves."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def lean(monkeypatch):
    calls = _Calls(latent.launch)
    monkeypatch.setattr(latent, "launch", calls)
    return calls


def _run(q, k_pool, table, k, seq, S, layout, rank, scale, num_splits):
    """The kernel over a paged pool or the contiguous (B, 1, L, D) cache, and rule R against the
    oracle (causal among the S query tokens, ragged lengths)."""
    q_start = seq - S
    if layout == "contiguous":
        out = triton_ops.decode_attention(q.to(DEV), k.contiguous().to(DEV), None, lengths=seq.to(DEV),
                                          q_start=q_start.to(DEV), scale=scale, v_head_dim=rank,
                                          num_splits=num_splits)
    else:
        out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, None, table, seq.to(DEV), q_start=q_start.to(DEV),
                                                scale=scale, v_head_dim=rank, num_splits=num_splits)
    v = k[..., :rank]
    mask = Causal(q_start=q_start) & KeyPadding(seq)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, scale=scale)
    rule_r(out.cpu(), base_attention(q, k, v, mask, scale=scale), gold)
    return out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", ["page16", "page64", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_latent_decode_matches_oracle(dtype, layout, num_splits, lean):
    """Rank 64 + rope 16 at 128 heads (two 64-row tiles), 16 heads (one 16-row tile) and 48 heads x
    2 speculative tokens (96 rows: a full tile and a part one); ragged lengths with an empty
    sequence (exact zeros) in a scattered table; one split (the output written directly) and
    three merged."""
    seed = stable_seed("latent", str(dtype), layout, num_splits)
    rank, rope = 64, 16
    D = rank + rope
    lens = [0, 37, 150] if layout != "contiguous" else [2, 37, 150]
    page = 64 if layout == "page64" else 16
    k_pool, _, table, k, _ = _pools(3, 1, D, rank, page, lens, dtype, seed=seed, value_from_key=True)
    seq = torch.tensor(lens)
    g = torch.Generator().manual_seed(seed + 1)
    for H, S in ((128, 1), (16, 1), (48, 2)):
        q = torch.randn(3, H, S, D, generator=g, dtype=torch.float64).to(dtype)
        out = _run(q, k_pool, table, k, seq, S, layout, rank, 0.7 / math.sqrt(D), num_splits)
        if layout != "contiguous":
            assert (out[0] == 0).all(), "a sequence with no keys gives exact zeros"
    assert lean.n == 3, "every call went to the lean kernel"


def test_deepseek_latent_512_plus_64(lean):
    """DeepSeek's widths (latent 512, rope 64) at 128 heads, paged by 16, few keys; one split and
    two merged."""
    rank, rope = 512, 64
    D = rank + rope
    lens = [20, 33]
    k_pool, _, table, k, _ = _pools(2, 1, D, rank, 16, lens, torch.bfloat16, seed=5, value_from_key=True)
    q = torch.randn(2, 128, 1, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for splits in (1, 2):
        _run(q, k_pool, table, k, torch.tensor(lens), 1, "page16", rank, 1 / math.sqrt(192), splits)
    assert lean.n == 2


def test_wave_rule_splits_with_one_program_per_sm(monkeypatch, lean):
    """num_splits=0: the wave rule with one program per SM. On an H100-sized stand-in a batch of
    two sequences (two 64-head programs each) splits its 300 keys; the result still matches."""
    monkeypatch.setattr(latent, "_INTERPRETER_SMS", 132)
    merges = []
    monkeypatch.setattr(td, "_merge_kernel", _Recorder(td._merge_kernel, merges))
    k_pool, _, table, k, _ = _pools(2, 1, 80, 64, 16, [150, 300], torch.bfloat16, seed=9, value_from_key=True)
    q = torch.randn(2, 128, 1, 80, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    _run(q, k_pool, table, k, torch.tensor([150, 300]), 1, "page16", 64, 0.1, 0)
    assert merges, "the wave rule split the keys and the merge ran"


class _Recorder:
    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]


def test_lying_table_entry_is_never_read_and_nan_reaches_its_rows(lean):
    """A table entry outside the pool (check=False) is never read: its keys count as masked. NaN in
    a visible latent key gives NaN in every row of its sequence and nowhere else."""
    lens = [40, 40]
    k_pool, _, table, k, _ = _pools(2, 1, 80, 64, 16, lens, torch.bfloat16, seed=13, value_from_key=True)
    q = torch.randn(2, 16, 1, 80, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    seq = torch.tensor(lens)
    lying = table.clone()
    lying[0, 1] = 10_000  # keys 16..31 of sequence 0 point outside the pool
    out = triton_ops.paged_decode_attention(q.to(DEV), k_pool, None, lying, seq.to(DEV), v_head_dim=64, check=False)
    keep = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    keep[0, ..., 16:32] = False
    mask = M.Dense(keep) & Causal(q_start=seq - 1)
    v = k[..., :64]
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    rule_r(out.cpu(), base_attention(q, k, v, mask), gold)
    poisoned = k_pool.clone()
    poisoned[table[1, 0], 3, 0, 5] = float("nan")  # key 3 of sequence 1
    out = triton_ops.paged_decode_attention(q.to(DEV), poisoned, None, table, seq.to(DEV), v_head_dim=64)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert lean.n == 2


def test_config_rows_per_program():
    """64 rows per program from 64 rows up (wgmma's M); fewer rows: the next power of two >= 16."""
    assert [latent.config(r, 576, 512)["BLOCK_H"] for r in (1, 16, 17, 32, 63, 64, 128, 256)] == \
        [16, 16, 32, 32, 64, 64, 64, 64]
    assert latent.config(128, 576, 512)["num_warps"] == 8


def test_the_predicate_takes_exactly_plain_float_latent_calls():
    """``latent.takes``: V from K over one KV head, fp16 / bf16, a power-of-two latent with 16 / 32 /
    64 rope channels, tiles within one cache block, no modifier, no quantized cache."""
    ok = dict(q_dtype=torch.bfloat16, head_dim=576, v_head_dim=512, num_kv_heads=1, v_from_k=True, block_size=64,
              max_len=4096)
    assert latent.takes(**ok)
    assert latent.takes(**{**ok, "q_dtype": torch.float16, "block_size": 16})
    assert latent.takes(**{**ok, "block_size": 24, "max_len": 24})  # a contiguous cache: one block
    assert latent.takes(**{**ok, "head_dim": 288, "v_head_dim": 256})  # MiniCPM3: 256 + 32
    for change in (dict(q_dtype=torch.float32), dict(v_from_k=False), dict(num_kv_heads=2),
                   dict(head_dim=560, v_head_dim=480), dict(head_dim=112, v_head_dim=80), dict(head_dim=512),
                   dict(head_dim=600), dict(head_dim=536), dict(block_size=8), dict(block_size=24),
                   dict(quantized=True), dict(softcap=30.0), dict(alibi=True), dict(window=True), dict(sinks=True),
                   dict(selection=True, selection_lists=2)):
        assert not latent.takes(**{**ok, **change}), change
    # a selection every head reads (DSA's top-k): taken, over pages of any size
    assert latent.takes(**{**ok, "selection": True}) and latent.takes(**{**ok, "selection": True, "block_size": 8})


def test_launch_sends_the_rest_to_the_shared_kernel(lean, monkeypatch):
    """Through ``kernel.launch``: a plain bf16 latent call runs the lean kernel; with sinks, a soft
    cap, fp32, an int8 cache, 8-token pages or a latent of 80 it runs the shared split kernel."""
    shared = []
    monkeypatch.setattr(td, "_split_kernel", _Recorder(td._split_kernel, shared))
    k_pool, _, table, k, _ = _pools(1, 1, 80, 64, 16, [20], torch.bfloat16, seed=17, value_from_key=True)
    q = torch.randn(1, 16, 1, 80, generator=torch.Generator().manual_seed(18)).to(torch.bfloat16)
    seq = torch.tensor([20], device=DEV)
    run = lambda q, pool, table, dv=64, **kw: triton_ops.paged_decode_attention(  # noqa: E731
        q.to(DEV), pool, None, table, seq, v_head_dim=dv, **kw)
    run(q, k_pool, table)
    assert (lean.n, len(shared)) == (1, 0)
    run(q, k_pool, table, sinks=torch.zeros(16, device=DEV))
    run(q, k_pool, table, softcap=20.0)
    run(q.float(), k_pool.float(), table)
    run(q, torch.randint(-127, 128, k_pool.shape, dtype=torch.int8, device=DEV), table,
        k_scale=torch.full(k_pool.shape[:3], 0.01, device=DEV))
    run(q, k_pool.reshape(-1, 8, 1, 80), torch.arange(3, dtype=torch.int32, device=DEV)[None])  # 8-token pages
    q96 = torch.randn(1, 16, 1, 112, generator=torch.Generator().manual_seed(19)).to(torch.bfloat16)
    run(q96, torch.randn(2, 16, 1, 112).to(torch.bfloat16).to(DEV), torch.tensor([[0, 1]], dtype=torch.int32,
                                                                                   device=DEV), dv=80)
    assert (lean.n, len(shared)) == (1, 6)


def test_describe_call_names_the_kernel_that_runs(lean):
    """``describe_call(..., detail=True)`` says which Triton kernel serves a call, and it is the
    one that runs: ``triton[latent]`` for a plain bf16 latent call (paged or contiguous),
    ``triton[latent+selection]`` with a selection every head reads, ``triton[split-k]`` with
    sinks or in fp32."""
    k_pool, _, table, k, _ = _pools(1, 1, 80, 64, 16, [40], torch.bfloat16, seed=41, value_from_key=True)
    q = torch.randn(1, 16, 1, 80, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16).to(DEV)
    seq = torch.tensor([40], device=DEV)
    paged = attnkit.PagedKV(k_pool.to(DEV), None, table.to(DEV), seq, v_head_dim=64)
    dense = k.to(DEV)
    ids = torch.randint(0, 40, (1, 1, 6), generator=torch.Generator().manual_seed(43))
    cases = [
        ((q, paged, None, Causal()), {}, "triton[latent]", 1),
        ((q, dense, dense[..., :64], Causal()), {}, "triton[latent]", 1),
        ((q, paged, None, M.SelectedKeys(ids.to(DEV)) & Causal()), {}, "triton[latent+selection]", 1),
        ((q, paged, None, Causal()), dict(sinks=torch.zeros(16, device=DEV)), "triton[split-k]", 0),
        ((q.float(), dense.float(), dense.float()[..., :64], Causal()), {}, "triton[split-k]", 0),
    ]
    for (qq, kk, vv, mask), kw, name, served in cases:
        before = lean.n
        assert attnkit.describe_call(qq, kk, vv, mask, backend="triton", detail=True, **kw) == name
        attnkit.attention(qq, kk, vv, mask, backend="triton", **kw)
        assert lean.n - before == served, name


def test_tuned_entries_have_a_key_of_their_own_and_reach_the_launch(monkeypatch, lean):
    """The lean kernel reads the tuned table under the shared key plus ``-latent`` (an entry tuned
    for it never reaches the shared kernel's calls of the same shape: sinks, soft cap). A forced
    entry (what a table entry becomes on its GPU) reaches its launch: the split rule sees its keys
    per tile, and the output still matches the oracle."""
    assert tuning.shape_key(torch.bfloat16, 576, 512, True, None, latent=True) == "bfloat16-d576-dv512-vk-latent"
    assert tuning.shape_key(torch.bfloat16, 576, 512, True, None) == "bfloat16-d576-dv512-vk"
    seen = []
    real = latent.split_plan
    monkeypatch.setattr(latent, "split_plan", lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))
    _, _, _, k, _ = _pools(1, 1, 80, 64, 16, [70], torch.bfloat16, seed=23, value_from_key=True)
    q = torch.randn(1, 16, 1, 80, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16)
    for block_n in (16, 32):
        with tuning.forced({"BLOCK_N": block_n, "num_stages": 2}):
            _run(q, None, None, k, torch.tensor([70]), 1, "contiguous", 64, 0.1, 0)
        assert seen[-1] == block_n
    assert lean.n == 2


def _selections(g, B, S, L):
    """name -> a selection every head of a token shares (DeepSeek-V3.2's top-k keys, blocks, the
    blocks joined by a local window), with -1 padding and a repeated id in each list."""
    def ids(shape, top):
        t = torch.randint(-1, top, shape, generator=g)
        t[..., -1] = t[..., 0]
        return t
    return {
        "keys": M.SelectedKeys(ids((B, S, 40), L)),
        "blocks": M.SelectedBlocks(ids((1, S, 5), -(-L // 4)), 4),
        "blocks|window": M.SelectedBlocks(ids((B, S, 3), -(-L // 16)), 16) | M.SlidingWindow(9),
    }


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", ["page16", "page8", "contiguous"])
def test_latent_selection_matches_oracle(layout, num_splits, lean):
    """A selection shared by every head (DeepSeek-V3.2's DSA) walks in the lean kernel: one query
    token's heads per program (128 heads: two 64-row tiles; S = 3 tokens, each its own list),
    keys gathered through the table (pages of 16, of 8, one block per sequence), ragged lengths
    and causal limits; rule R against the oracle, empty rows exactly 0, and NaN in every latent
    row no query selects changes nothing (an unselected key is never read)."""
    seed = stable_seed("latent-sel", layout, num_splits)
    g = torch.Generator().manual_seed(seed)
    rank, rope, H, S, B = 64, 16, 128, 3, 2
    D = rank + rope
    lens = [150, 97]
    page = {"page16": 16, "page8": 8, "contiguous": 150}[layout]
    k_pool, _, table, k, _ = _pools(B, 1, D, rank, page, lens, torch.bfloat16, seed=seed, value_from_key=True)
    seq = torch.tensor(lens)
    q = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    v = k[..., :rank]
    run = lambda pool, sel: triton_ops.paged_decode_attention(  # noqa: E731
        q.to(DEV), pool.to(DEV), None, table.to(DEV), seq.to(DEV), v_head_dim=rank, selection=sel,
        num_splits=num_splits).cpu()
    for name, sel in _selections(g, B, S, max(lens)).items():
        before = lean.n
        out = run(k_pool, sel)
        assert lean.n == before + 1, name
        mask = sel & Causal(q_start=seq - S) & KeyPadding(seq)
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
        rule_r(out, base_attention(q, k, v, mask), gold, n_terms=max(lens))
        allowed = mask.materialize(B, S, k.shape[2]).expand(B, H, S, k.shape[2])
        assert (out[~allowed.any(-1)] == 0).all(), name
        # NaN in every latent row no query of the call sees: the same output
        seen = allowed.any(1).any(1)  # (B, L)
        poisoned = k_pool.clone()
        for b in range(B):
            for pos in range(lens[b]):
                if not seen[b, pos]:
                    poisoned[table[b, pos // page], pos % page] = float("nan")
        assert torch.equal(run(poisoned, sel), out), name


def test_latent_selection_at_deepseek_widths(lean):
    """DeepSeek-V3.2's decode: 128 heads over the 512 + 64 latent, each token's top keys (one list
    for every head), paged by 64; one split and several."""
    rank, rope, H = 512, 64, 128
    D = rank + rope
    lens = [90, 70]
    k_pool, _, table, k, _ = _pools(2, 1, D, rank, 64, lens, torch.bfloat16, seed=31, value_from_key=True)
    g = torch.Generator().manual_seed(32)
    q = torch.randn(2, H, 1, D, generator=g).to(torch.bfloat16)
    seq = torch.tensor(lens)
    ids = torch.stack([torch.randperm(n, generator=g)[:24] for n in lens])[:, None]  # (B, 1, 24)
    mask = M.SelectedKeys(ids) & Causal(q_start=seq - 1) & KeyPadding(seq)
    kv = attnkit.PagedKV(k_pool.to(DEV), None, table.to(DEV), seq.to(DEV), v_head_dim=rank)
    out = attnkit.attention(q.to(DEV), kv, None, mask, backend="triton", scale=1 / math.sqrt(192)).cpu()
    v = k[..., :rank]
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, scale=1 / math.sqrt(192))
    rule_r(out, base_attention(q, k, v, mask, scale=1 / math.sqrt(192)), gold)
    assert lean.n == 1


# ------------------------------------------------------------------ ahead-of-time compile (no GPU)

_AOT = AOT_PREAMBLE + r"""
from attnkit.backends.triton import latent
fn = latent._latent_kernel
ptrs = {"Q", "K", "TABLE", "QSTART", "LENGTHS", "OP", "LSEP", "OUT", "SEL_IDS", "SEL_COUNTS", "SEL_BOUNDS"}
consts, ints, attrs = kernel_params(fn, ptrs, ("scale_log2",), ["KV_BLOCK_SIZE", "SPLIT_LEN"])


out = []
for dt, D, Dv, rows, direct, sel, cap in json.loads(sys.argv[1]):
    cfg = latent.config(rows, D, Dv)
    short = {"float16": "fp16", "bfloat16": "bf16"}[dt]
    sig = dict(Q="*" + short, K="*" + short, TABLE="*i32", QSTART="*i32", LENGTHS="*i32", OP="*fp32", LSEP="*fp32",
               OUT="*" + short, SEL_IDS="*i32", SEL_COUNTS="*i32", SEL_BOUNDS="*i32", scale_log2="fp32",
               **{n: "i32" for n in ints})
    cv = dict(DIRECT=direct, DOT_F32=False, SEL=sel, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_DV=Dv,
              BLOCK_DR=D - Dv)
    assert set(cv) == set(consts), sorted(set(consts) ^ set(cv))
    sig.update({k: "constexpr" for k in cv})
    k = triton.compile(triton.compiler.ASTSource(fn, sig, cv, attrs), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    spills, regs = ptxas_report(k.asm["ptx"], cap)
    out.append(dict(case=[dt, D, Dv, rows, direct, sel, cap], shared=k.metadata.shared, spills=spills, regs=regs,
                    wgmma="wgmma" in k.asm["ptx"], block_h=cfg["BLOCK_H"]))
print(json.dumps(out))
"""

# bf16 absorbed MLA (128 heads on one latent head, 512 + 64), multi-split and single-split, over
# the cache and walking a selection, for sm_80 and sm_90.
_CASES = [["bfloat16", 576, 512, 128, direct, sel, cap] for direct in (False, True) for sel in (False, True)
          for cap in _SMEM]
_compiled: dict = {}


def _compiled_latent_kernels() -> list:
    if "latent" not in _compiled:
        _compiled["latent"] = compile_ahead(_AOT, _CASES)
    return _compiled["latent"]


#: Spill bytes the selection walk may take on sm_90 (its per-key gathers through the block table
#: hold more addresses than a tile in one block: 460-468 bytes with Triton 3.9; benchmarks/NOTES.md).
_SEL_SPILL_CAP = 512


@pytest.mark.slow
def test_latent_kernel_fits_without_spills_on_sm80_and_sm90():
    """The bf16 lean kernel at DeepSeek's widths, compiled ahead for sm_80 and sm_90 with its own
    tiles (64 heads per program), uses no more shared memory than one block may have and spills
    no registers (ptxas's report on the kernel's PTX) over the cache; walking a selection it
    spills none on sm_80 and at most ``_SEL_SPILL_CAP`` bytes on sm_90."""
    for r in _compiled_latent_kernels():
        assert r["block_h"] == 64, r
        assert r["shared"] <= _SMEM[r["case"][-1]], f"{r['case']}: {r['shared']} B shared"
        sel, cap = r["case"][-2], r["case"][-1]
        allowed = _SEL_SPILL_CAP if sel and cap == 90 else 0
        assert r["spills"] <= allowed, f"{r['case']}: {r['spills']} bytes of register spills ({r['regs']} registers)"


@pytest.mark.slow
def test_mla_dots_use_warpgroup_mma_on_sm90():
    """On sm_90 the MLA kernel's dots are warpgroup MMAs (wgmma in the PTX): a row tile of 64
    heads, so Hopper's tensor cores run at full rate."""
    mla = [r for r in _compiled_latent_kernels() if r["case"][-1] == 90]
    assert mla and all(r["wgmma"] for r in mla), [(r["case"], r["block_h"], r["wgmma"]) for r in mla]
