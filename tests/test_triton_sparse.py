"""The Triton decode kernel over per-query selections (:class:`attnkit.masks.SelectedKeys`,
:class:`attnkit.masks.SelectedBlocks`), read in place: each program walks its list of selected
keys, with the interval the selection is ANDed with and the one it is ORed with, over dense,
paged, quantized and V-from-K (MLA) K/V, with every score modifier, against the fp64 oracle
under rule R. Unselected K/V rows are never read (NaN there changes nothing).

Without CUDA these run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1),
on tiny shapes."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.masks import Causal, KeyPadding, SelectedBlocks, SelectedKeys, SlidingWindow

from conftest import AOT_PREAMBLE, base_attention, rule_r, stable_seed

triton_ops = pytest.importorskip("attnkit.backends.triton.ops")
if triton_ops.available() is not None:
    pytest.skip(f"Triton kernels unavailable: {triton_ops.available()}", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, HQ, HKV, S, L, D, DV = 2, 4, 2, 2, 37, 16, 16
PAGE = 8  # the cache's block size; selections use blocks of 4 or 16 keys, so they cross pages
LENS = (37, 29)  # the paged layouts are ragged: their lengths join the mask


def _ids(g, shape, top, dups=True):
    """Random ids in [-1, top): -1 padding and (with ``dups``) an id listed twice per row."""
    ids = torch.randint(-1, top, shape, generator=g)
    if dups and shape[-1] > 2:
        ids[..., -1] = ids[..., 0]
    return ids


def _masks(g):
    """name -> mask: every shape of selection the kernel walks."""
    return {
        "keys": SelectedKeys(_ids(g, (B, S, 7), L)),
        "keys-per-kv-head&causal": SelectedKeys(_ids(g, (B, HKV, S, 6), L), num_heads=HQ) & Causal(),
        "keys-per-query-head": SelectedKeys(_ids(g, (1, HQ, S, 5), L)),
        "blocks&causal": SelectedBlocks(_ids(g, (1, S, 3), -(-L // 4)), 4) & Causal(),
        "blocks|window&causal": (SelectedBlocks(_ids(g, (B, HKV, S, 2), -(-L // 16)), 16, num_heads=HQ)
                                 | SlidingWindow(5)) & Causal(),
        "keys&window": SelectedKeys(_ids(g, (B, S, 9), L)) & SlidingWindow(12, 0),
    }


def _layout(name, k, v, *, dtype):
    """attention()'s K/V arguments for ``name`` from dense (B, Hkv, L, D) k and v, the K/V the
    oracle sees (dequantized), and the mask a paged layout's lengths add (or None).
    ``mla``: V is the first DV channels of K (k is wider)."""
    mla = "mla" in name
    storage = "int8" if "int8" in name else "fp8_e4m3" if "fp8" in name else None
    if "paged" not in name:
        kk, vv = k.to(dtype), (k[..., :DV] if mla else v).to(dtype)
        if storage:
            kv = attnkit.QuantizedKV.quantize(k.to(DEV), None if mla else v.to(DEV), storage,
                                              v_head_dim=DV if mla else None)
            return (kv, None), tuple(t.cpu() for t in kv.gather(torch.float64)), None
        kd = kk.to(DEV)
        return (kd, kd[..., :DV] if mla else vv.to(DEV)), (kk, vv), None
    g = torch.Generator().manual_seed(5)
    nb = -(-L // PAGE)
    table = torch.randperm(B * nb + 2, generator=g)[:B * nb].view(B, nb).int()
    pool_k = torch.randn(B * nb + 2, PAGE, HKV, k.shape[-1], generator=g)  # garbage past each length
    pool_v = torch.randn(B * nb + 2, PAGE, HKV, DV, generator=g)
    pos = torch.arange(L)
    for b in range(B):
        pool_k[table[b, pos // PAGE].long(), pos % PAGE] = k[b].transpose(0, 1)
        pool_v[table[b, pos // PAGE].long(), pos % PAGE] = v[b].transpose(0, 1)
    lens = torch.tensor(LENS)
    pad = KeyPadding(lens)
    if storage:
        kv = attnkit.QuantizedKV.quantize(pool_k.to(DEV), None if mla else pool_v.to(DEV), storage,
                                          v_head_dim=DV if mla else None, block_table=table.to(DEV),
                                          lengths=lens.to(DEV))
        kk, vv = (t.cpu() for t in kv.gather(torch.float64))
        return (kv, None), (kk, vv), pad
    kv = attnkit.PagedKV(pool_k.to(DEV, dtype), None if mla else pool_v.to(DEV, dtype), table.to(DEV),
                         lens.to(DEV), v_head_dim=DV if mla else None)
    kk, vv = k.to(dtype), (k[..., :DV] if mla else v).to(dtype)
    return (kv, None), (kk, vv), pad


def _run_and_check(q, kv_args, kv_ref, mask, *, mods=None, expect_name=True):
    mods = dict(mods or {})
    dev_mods = {key: val.to(DEV) if isinstance(val, torch.Tensor) else val for key, val in mods.items()}
    if expect_name:
        assert attnkit.describe_call(q.to(DEV), *kv_args, mask, backend="triton", detail=True,
                                     **dev_mods) == "triton[split-k+selection]"
    out = attnkit.attention(q.to(DEV), *kv_args, mask, backend="triton", **dev_mods).cpu()
    kk, vv = kv_ref
    sinks = mods.get("sinks")
    gold = attnkit.attention_reference(q.double(), kk.double(), vv.double(), mask, softcap=mods.get("softcap"),
                                       sinks=None if sinks is None else sinks.double())
    base = base_attention(q, kk.to(q.dtype), vv.to(q.dtype), mask, **mods)
    rule_r(out, base, gold, n_terms=max(kk.shape[2], kk.shape[3]))
    # a row the mask leaves empty is exactly 0
    allowed = mask.materialize(B, S, kk.shape[2], "cpu").expand(B, HQ, S, kk.shape[2])
    empty = ~allowed.any(-1)
    assert (out[empty] == 0).all()
    return out, allowed


LAYOUTS = ["dense", "paged", "int8", "fp8-paged", "mla", "mla-paged", "int8-mla-paged"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selections_over_every_layout(layout):
    """Every selection shape (shared lists, per KV head, per query head, blocks, | window,
    & causal, & window; -1 padding and duplicates) over each K/V layout."""
    seed = stable_seed("sparse", layout)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if layout in ("dense", "paged", "mla") else torch.bfloat16
    width = D + 8 if "mla" in layout else D
    k, v = torch.randn(B, HKV, L, width, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    q = torch.randn(B, HQ, S, width, generator=g).to(dtype)
    kv_args, kv_ref, pad = _layout(layout, k, v, dtype=dtype)
    for name, mask in _masks(g).items():
        m = mask if pad is None else mask & pad
        _run_and_check(q, kv_args, kv_ref, m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(dtype):
    g = torch.Generator().manual_seed(stable_seed("half", str(dtype)))
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    q = torch.randn(B, HQ, S, D, generator=g).to(dtype)
    kv_args, kv_ref, _ = _layout("dense", k, v, dtype=dtype)
    masks = _masks(g)
    for name in ("keys-per-kv-head&causal", "blocks|window&causal"):
        _run_and_check(q, kv_args, kv_ref, masks[name])


@pytest.mark.parametrize("layout", ["dense", "int8-mla-paged"])
def test_modifiers_with_a_selection(layout):
    """Soft-capping, ALiBi (at the keys' true positions) and sinks hold with a selection."""
    g = torch.Generator().manual_seed(stable_seed("mods", layout))
    width = D + 8 if "mla" in layout else D
    k, v = torch.randn(B, HKV, L, width, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    q = torch.randn(B, HQ, S, width, generator=g)
    kv_args, kv_ref, pad = _layout(layout, k, v, dtype=torch.float32)
    sel = (SelectedBlocks(_ids(g, (B, HKV, S, 3), -(-L // 4)), 4, num_heads=HQ) | SlidingWindow(3)) & Causal()
    sel = sel if pad is None else sel & pad
    for mods in ({"softcap": 4.0}, {"sinks": torch.randn(HQ, generator=g)}, {"softcap": 3.0}):
        m = sel
        if "softcap" in mods and mods["softcap"] == 3.0:  # ALiBi too
            m = M.ALiBi(M.alibi_slopes(HQ)) & sel
        _run_and_check(q, kv_args, kv_ref, m, mods=mods)


def test_empty_rows_are_exact_zeros():
    """Lists of -1 only, and lists whose keys the causal part cuts: exactly 0 (sinks too)."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    q = torch.randn(B, HQ, S, D, generator=g)
    ids = _ids(g, (B, HKV, S, 4), L, dups=False)
    ids[0, 0] = -1  # KV head 0 of sequence 0: nothing selected
    ids[1, 1, 0] = L - 1  # query 0 of sequence 1 only selects a key past it (causal cuts it)
    ids[1, 1, 0, 1:] = -1
    mask = SelectedKeys(ids, num_heads=HQ) & Causal()
    kv_args, kv_ref, _ = _layout("dense", k, v, dtype=torch.float32)
    for mods in ({}, {"sinks": torch.randn(HQ, generator=g)}):
        out, allowed = _run_and_check(q, kv_args, kv_ref, mask, mods=mods)
        assert (out[0, :2] == 0).all() and (out[1, 2:, 0] == 0).all()


@pytest.mark.parametrize("layout", ["dense", "paged", "int8-paged", "mla"])
def test_unselected_keys_are_never_read(layout):
    """NaN in every K/V row that no query of its KV head may see: the output stays finite and
    equals the oracle on the clean tensors."""
    g = torch.Generator().manual_seed(stable_seed("nan", layout))
    width = D + 8 if "mla" in layout else D
    k, v = torch.randn(B, HKV, L, width, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    q = torch.randn(B, HQ, S, width, generator=g)
    mask = (SelectedBlocks(_ids(g, (B, HKV, S, 2), -(-L // 4)), 4, num_heads=HQ) | SlidingWindow(2)) & Causal()
    kv_args, kv_ref, pad = _layout(layout, k, v, dtype=torch.float32)
    kv_ref = tuple(t.clone() for t in kv_ref)  # the clean K/V (the dense arguments may share their memory)
    mask = mask if pad is None else mask & pad
    seen = mask.materialize(B, S, L, "cpu").expand(B, HQ, S, L).view(B, HKV, HQ // HKV * S, L).any(2)  # (B, Hkv, L)
    assert not seen.all()
    kv = kv_args[0]
    if isinstance(kv, torch.Tensor):  # dense (MLA: v is a view of k)
        kv.transpose(1, 2)[~seen.transpose(1, 2)] = float("nan")
        if kv_args[1].data_ptr() != kv.data_ptr():
            kv_args[1].transpose(1, 2)[~seen.transpose(1, 2)] = float("nan")
    else:  # paged: the pool rows of the unseen positions
        pos = torch.arange(L)
        table = kv.block_table.cpu().long()
        for b in range(B):
            for h in range(HKV):
                p = pos[~seen[b, h]]
                blk, slot = table[b, p // PAGE], p % PAGE
                if isinstance(kv, attnkit.QuantizedKV):
                    kv.k_scale[blk, slot, h] = float("nan")
                    kv.v_scale[blk, slot, h] = float("nan")
                else:
                    kv.k_pool[blk, slot, h] = float("nan")
                    kv.v_pool[blk, slot, h] = float("nan")
    _run_and_check(q, kv_args, kv_ref, mask)


def test_splits_over_a_long_selection_through_the_op():
    """The op's own limits (causal q_start, ragged lengths, a window) AND the selection, split
    over its entries in 3 or by the wave rule, with sinks merged once."""
    g = torch.Generator().manual_seed(11)
    L2, page, bs = 150, 16, 8
    lens = torch.tensor([150, 97])
    k, v = torch.randn(B, HKV, L2, D, generator=g), torch.randn(B, HKV, L2, DV, generator=g)
    q = torch.randn(B, HQ, S, D, generator=g)
    nb = -(-L2 // page)
    table = torch.randperm(B * nb, generator=g).view(B, nb).int()
    pool_k, pool_v = torch.zeros(B * nb, page, HKV, D), torch.zeros(B * nb, page, HKV, DV)
    pos = torch.arange(L2)
    for b in range(B):
        pool_k[table[b, pos // page].long(), pos % page] = k[b].transpose(0, 1)
        pool_v[table[b, pos // page].long(), pos % page] = v[b].transpose(0, 1)
    sel = SelectedBlocks(_ids(g, (B, HKV, S, 12), -(-L2 // bs)), bs, num_heads=HQ) | SlidingWindow(20)
    sinks = torch.randn(HQ, generator=g)
    for splits, window in ((3, None), (0, (60, 0)), (1, None)):
        out = triton_ops.paged_decode_attention(q.to(DEV), pool_k.to(DEV), pool_v.to(DEV), table.to(DEV),
                                                lens.to(DEV), selection=sel, num_splits=splits, sinks=sinks.to(DEV),
                                                window=window).cpu()
        mask = sel & Causal(q_start=lens - S) & KeyPadding(lens)
        if window is not None:
            mask = mask & SlidingWindow(*window, q_start=lens - S)
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, sinks=sinks.double())
        rule_r(out, base_attention(q, k, v, mask, sinks=sinks), gold, n_terms=L2)


def test_kernel_name_and_refusals():
    """describe_call names the selection kernel; a mask with a selection the kernel cannot walk
    (two selections) is refused with its reason; the op refuses such a mask too."""
    q, k = torch.randn(1, 2, 1, D), torch.randn(1, 2, 10, D)
    sel = SelectedKeys(torch.tensor([[[1, 4]]]))
    assert attnkit.describe_call(q, k, k, sel, backend="triton", detail=True) == "triton[split-k+selection]"
    assert attnkit.describe_call(q, k, k, Causal(), backend="triton", detail=True) == "triton[split-k]"
    two = sel & SelectedKeys(torch.tensor([[[4, 5]]]))
    with pytest.raises(Exception, match="selection"):
        attnkit.attention(q, k, k, two, backend="triton")
    with pytest.raises(ValueError, match="selection must hold one"):
        triton_ops.decode_attention(q, k, k, selection=two)
    with pytest.raises(ValueError, match="do not fit"):
        triton_ops.decode_attention(q, k, k, selection=SelectedKeys(torch.tensor([[[1], [2]]])))


def test_auto_takes_cuda_decode_with_a_selection():
    """`auto`'s decision for a CUDA decode step with a selection, made on CPU from the call's
    description: the triton kernel, which reads only the selected keys (plain dense decode of
    equal widths stays with SDPA)."""
    from attnkit.backends import registry

    def call(mask):
        return registry.AttentionCall(2, 16, 4, 1, 4096, 128, 128, torch.bfloat16, torch.device("cuda"), mask,
                                      0.1, 0.0, False, False)

    sel = SelectedBlocks(torch.zeros(2, 4, 1, 8, dtype=torch.long), 64, num_heads=16)
    for mask in (sel, sel & Causal(), (sel | SlidingWindow(63)) & Causal()):
        assert registry.get_backend("triton").auto_skip_reason(call(mask)) is None, mask
        assert registry.get_backend("triton").not_supported_reasons(call(mask)) == [], mask
    assert registry.get_backend("triton").auto_skip_reason(call(Causal())) is not None


_SMEM = {80: 166912, 90: 232448}  # shared memory per block (bytes) on A100 and H100/H200

#: Compiles the selection kernel ahead of time for CUDA (no GPU needed), with the heaviest
#: modifiers, and reports its shared memory and ptxas's register spills.
_AOT = AOT_PREAMBLE + r"""
from attnkit.backends.triton import kernel as td
fn = td._select_kernel
ptrs = {"Q", "K", "V", "TABLE", "QSTART", "LENGTHS", "OP", "LSEP", "SLOPES", "ALIBI_QSTART", "KS", "VS", "WIN_QSTART",
        "OUT", "SINKS", "SEL_IDS", "SEL_COUNTS", "SEL_BOUNDS"}
consts, ints, attrs = kernel_params(fn, ptrs, ("scale_log2", "softcap"), ["DK", "DV", "KV_BLOCK_SIZE", "SPLIT_LEN"])
out = []
for dt, D, Dv, vfk, rows, direct, quant, cap in json.loads(sys.argv[1]):
    cfg = td._config(getattr(torch, dt), D, Dv, rows, vfk)
    short = {"float32": "fp32", "bfloat16": "bf16"}[dt]
    kv = "*i8" if quant else "*" + short
    sig = dict(Q="*" + short, K=kv, V=kv, TABLE="*i32", QSTART="*i32", LENGTHS="*i32",
               OP="*fp32", LSEP="*fp32", SLOPES="*fp32", ALIBI_QSTART="*i32", KS="*fp32", VS="*fp32",
               WIN_QSTART="*i32", OUT="*" + short, SINKS="*fp32", SEL_IDS="*i32", SEL_COUNTS="*i32",
               SEL_BOUNDS="*i32", scale_log2="fp32", softcap="fp32", **{n: "i32" for n in ints})
    cv = dict(V_FROM_K=vfk, HAS_ROPE=cfg["DR"] > 0, PRECISION="ieee" if short == "fp32" else "tf32",
              DOT_F32=False, HAS_SOFTCAP=True, HAS_ALIBI=True, QUANT=quant, FP8=False, HAS_WINDOW=True,
              DIRECT=direct, HAS_SINKS=direct, PAGED=True, PAGE=0,  # a selection gathers per key
              **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_DK", "BLOCK_DR", "BLOCK_DV")})
    assert set(cv) == set(consts), sorted(set(consts) ^ set(cv))
    sig.update({k: "constexpr" for k in cv})
    k = triton.compile(triton.compiler.ASTSource(fn, sig, cv, attrs), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    spills, _ = ptxas_report(k.asm["ptx"], cap)
    out.append(dict(case=[dt, D, Dv, vfk, rows, direct, quant, cap], shared=k.metadata.shared, spills=spills))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_selection_kernel_compiles_for_sm80_and_sm90_within_shared_memory():
    """The selection kernel compiled ahead of time for sm_80 and sm_90 (Triton's CUDA backend and
    its bundled ptxas; no GPU): bf16 GQA 32/8 at D 128 (a list per KV head: 4 rows a program),
    the same over int8 K/V, and absorbed MLA (128 heads on one latent head sharing one list),
    with every modifier on: shared memory within one block's; no register spills for GQA over a
    float cache. The MLA kernel on sm_90 and the int8 single split on sm_80 spill a few bytes
    (16-56 in ptxas's report, moving with unrelated edits: register allocation at the limit),
    held here to at most 64 until a GPU measures whether they cost anything."""
    cases = [["bfloat16", D, Dv, vfk, rows, direct, quant, cap]
             for D, Dv, vfk, rows, quant in ((128, 128, False, 4, False), (128, 128, False, 4, True),
                                            (576, 512, True, 128, False))
             for direct in (False, True) for cap in _SMEM]
    from conftest import compile_ahead

    for r in compile_ahead(_AOT, cases):
        assert r["shared"] <= _SMEM[r["case"][-1]], f"{r['case']}: {r['shared']} B shared"
        _, _, _, vfk, _, _, quant, _ = r["case"]
        most = 64 if vfk or quant else 0
        assert r["spills"] <= most, f"{r['case']}: {r['spills']} bytes of register spills (at most {most})"


def test_the_wave_rule_splits_a_long_selection():
    """One sequence, one KV head, one query: too few programs for a wave, so the wave rule
    (:func:`attnkit.backends.triton.plan.split_plan`) splits the selection's walk of 20 blocks
    of 8 keys and the window's keys; the merge joins the parts exactly."""
    from attnkit.backends.triton import kernel as tk

    g = torch.Generator().manual_seed(3)
    L1 = 300
    q = torch.randn(1, 2, 1, D, generator=g)
    k, v = torch.randn(1, 1, L1, D, generator=g), torch.randn(1, 1, L1, DV, generator=g)
    mask = (SelectedBlocks(torch.randperm(L1 // 8, generator=g)[:20].view(1, 1, 20), 8) | SlidingWindow(9)) & Causal()
    cfg = tk._config(torch.float32, D, DV, 2, False)
    span = 10 + 20 * 8  # the window's keys, then the blocks'
    splits, _ = tk.split_plan(1, 1, 1, span, *tk._INTERPRETER_WAVE, cfg["BLOCK_N"])
    assert splits > 1
    out = attnkit.attention(q.to(DEV), k.to(DEV), v.to(DEV), mask, backend="triton").cpu()
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    rule_r(out, base_attention(q, k, v, mask), gold, n_terms=L1)


def test_nan_in_a_selected_key_reaches_only_the_rows_that_select_it():
    """NaN in gives NaN out: a NaN in one selected key row reaches the rows whose list holds it
    (and no other row)."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 2, 2, D, generator=g)
    k, v = torch.randn(1, 1, 12, D, generator=g), torch.randn(1, 1, 12, DV, generator=g)
    ids = torch.tensor([[[3, 7, -1], [2, 5, 9]]])  # query 0 selects key 7, query 1 does not
    k[0, 0, 7, 0] = float("nan")
    out = attnkit.attention(q.to(DEV), k.to(DEV), v.to(DEV), SelectedKeys(ids), backend="triton").cpu()
    assert torch.isnan(out[0, :, 0]).all() and torch.isfinite(out[0, :, 1]).all()
    with pytest.raises(ValueError, match="key position 12"):
        triton_ops.decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), selection=SelectedKeys(ids + 3))


def test_a_selection_call_compiles_without_graph_breaks():
    """attention() with a block selection, a window joined to it and causal, forced to triton,
    under torch.compile(fullgraph=True): the custom op with its selection arguments stays in the
    graph and gives the eager result."""
    q, k, v = torch.randn(1, 4, 1, D).to(DEV), torch.randn(1, 2, 40, D).to(DEV), torch.randn(1, 2, 40, DV).to(DEV)
    ids = torch.tensor([[[[0, 3, -1]], [[1, 1, 4]]]], device=DEV)

    def f(q, k, v, ids):
        mask = (SelectedBlocks(ids, 8, num_heads=4) | SlidingWindow(3)) & Causal()
        return attnkit.attention(q, k, v, mask, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, ids), f(q, k, v, ids))


@pytest.mark.parametrize("layout", ["dense", "paged", "mla-paged"])
def test_prefill_with_a_selection_walks_each_query_token(layout):
    """A selection call longer than a decode step (Sq = 40 > MAX_Q_LEN) runs the same walk, one
    program per query token, against the oracle; without a selection such a call is refused."""
    from attnkit.backends import BackendNotSupported

    Sq = 40
    g = torch.Generator().manual_seed(stable_seed("prefill", layout))
    width = D + 8 if "mla" in layout else D
    k, v = torch.randn(B, HKV, L, width, generator=g), torch.randn(B, HKV, L, DV, generator=g)
    kv_args, kv_ref, pad = _layout(layout, k, v, dtype=torch.float32)
    q = torch.randn(B, HQ, Sq, width, generator=g)
    Lq = kv_ref[0].shape[2]
    for mask in (SelectedKeys(_ids(g, (B, Sq, 7), Lq)) & Causal(),
                 (SelectedBlocks(_ids(g, (B, HKV, Sq, 2), -(-Lq // 4)), 4, num_heads=HQ) | SlidingWindow(3))):
        assert attnkit.describe_call(q.to(DEV), *kv_args, mask, backend="triton",
                                     detail=True) == "triton[split-k+selection]"
        out = attnkit.attention(q.to(DEV), *kv_args, mask, backend="triton").cpu()
        full = mask if pad is None else mask & pad
        gold = attnkit.attention_reference(q.double(), kv_ref[0].double(), kv_ref[1].double(), full)
        base = base_attention(q, kv_ref[0].to(q.dtype), kv_ref[1].to(q.dtype), full)
        rule_r(out, base, gold, n_terms=Lq)
    with pytest.raises(BackendNotSupported, match="Sq=40 > 16"):
        attnkit.attention(q.to(DEV), *kv_args, Causal(), backend="triton")
