"""Per-query selections (SelectedKeys, SelectedBlocks): their meaning against element-by-element
definitions, composition with every other mask and the score modifiers under rule R on every
backend that takes them, empty rows, duplicates and order, validation, and the reduced form
kernels read (ReducedSelection) saying exactly what the mask says."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported, get_backend
from attnkit.masks.reduced import ReducedMask, ReducedSelection

from conftest import DTYPES, check_against_oracle, make_qkv, rule_r, stable_seed

# --------------------------------------------------------------------------- makers


def rand_ids(shape, n_ids: int, seed: int, *, empty_row: bool = True) -> torch.Tensor:
    """int64 ids in [-2, n_ids) of ``shape`` (B, [Hs,] Sq, n): duplicates and unused slots
    (negative) included, and, with ``empty_row`` and Sq > 0, query 0 of item 0 selecting
    nothing."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, max(n_ids, 1), shape, generator=g)
    if n_ids == 0:
        ids = torch.full(shape, -1)
    if shape[-1] > 1:
        ids[..., 1] = ids[..., 0]  # a duplicate in every list
    if empty_row and shape[-2] > 0:
        ids[0, ..., 0, :] = -1
    return ids


def selection(kind: str, B: int, Hq: int, Hkv: int, Sq: int, Sk: int, seed: int) -> M.Selection:
    """One selection of ``kind``: keys|blocks, shared (B, Sq, n) or per KV head (B, Hkv, Sq, n)."""
    what, heads = kind.split("-")
    lead = (B, Sq) if heads == "shared" else (B, Hkv, Sq)
    nh = Hq if heads == "per_head" else None
    if what == "keys":
        return M.SelectedKeys(rand_ids((*lead, min(Sk, 5) + 1), Sk, seed), num_heads=nh)
    bs = 4
    return M.SelectedBlocks(rand_ids((*lead, 3), -(-Sk // bs), seed), bs, num_heads=nh)


def like(sel: M.Selection, ids: torch.Tensor) -> M.Selection:
    """A selection of the same kind, block size and num_heads as ``sel`` over other ``ids``."""
    if isinstance(sel, M.SelectedKeys):
        return M.SelectedKeys(ids, num_heads=sel.num_heads)
    return M.SelectedBlocks(ids, sel.block_size, num_heads=sel.num_heads)


def compose(sel: M.Selection, how: str, B: int, Sq: int, Sk: int) -> M.Mask:
    if how == "alone":
        return sel
    if how == "causal":
        return sel & M.Causal()
    if how == "padding":  # right key padding and a padded query
        return sel & M.KeyPadding(torch.tensor([Sk, max(Sk - 3, 0)])[:B]) & \
            M.QueryPadding(torch.tensor([Sq, max(Sq - 1, 0)])[:B])
    if how == "window":  # the selection and the local keys before the query
        return (sel | M.SlidingWindow(3)) & M.Causal()
    if how == "document":
        return sel & M.Document(torch.tensor([Sq // 2, Sq - Sq // 2]), torch.tensor([Sk // 2, Sk - Sk // 2]))
    raise AssertionError(how)


KINDS = ["keys-shared", "keys-per_head", "blocks-shared", "blocks-per_head"]
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
COMPOSE = ["alone", "causal", "padding", "window", "document"]


def brute_selection(sel: M.Selection, Hq: int, Sq: int, Sk: int, B: int = 2) -> torch.Tensor:
    """(B, Hq, Sq, Sk) bool from the definition, element by element: query i of sequence b, head
    h sees key j iff j // block_size is among the non-negative ids of list h // (Hq // Hs)."""
    ids = sel.ids if sel.ids.dim() == 4 else sel.ids.unsqueeze(1)
    G = Hq // ids.shape[1]
    out = torch.zeros(B, Hq, Sq, Sk, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(Hq), range(Sq), range(Sk)):
        lst = ids[b if ids.shape[0] > 1 else 0, h // G, i].tolist()
        out[b, h, i, j] = (j // sel.block_size) in [x for x in lst if x >= 0]
    return out


# --------------------------------------------------------------------------- meaning


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (3, 9), (5, 13), (4, 2)])
def test_materialize_and_mask_mod_match_the_definition(kind, heads, Sq, Sk):
    """materialize() and the FlexAttention mask_mod (called on scalars and on broadcast index
    tensors) both equal the element-by-element definition, the per-KV-head lists serving their
    groups of query heads."""
    Hq, Hkv = HEADS[heads]
    sel = selection(kind, 2, Hq, Hkv, Sq, Sk, stable_seed(kind, heads, Sq, Sk))
    want = brute_selection(sel, Hq, Sq, Sk)
    got = sel.materialize(2, Sq, Sk).expand(2, Hq, Sq, Sk)
    assert torch.equal(got, want)
    mod = sel.mask_mod(Sq, Sk, "cpu")
    for b, h, i, j in itertools.product(range(2), range(Hq), range(Sq), range(Sk)):
        assert bool(mod(torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j))) == bool(want[b, h, i, j])
    grid = mod(torch.arange(2).view(-1, 1, 1, 1), torch.arange(Hq).view(1, -1, 1, 1),
               torch.arange(Sq).view(1, 1, -1, 1), torch.arange(Sk).view(1, 1, 1, -1))
    assert torch.equal(grid.expand(2, Hq, Sq, Sk), want)


def test_block_selection_covers_a_partial_last_block():
    """With Sk not a multiple of block_size, the last block holds the remaining keys and may be
    selected; the next id is past the end and raises."""
    sel = M.SelectedBlocks(torch.tensor([[[2, -1], [0, 1]]]), block_size=4)
    got = sel.materialize(1, 2, 10)[0, 0]
    assert got[0].tolist() == [False] * 8 + [True, True]
    assert got[1].tolist() == [True] * 8 + [False, False]
    with pytest.raises(ValueError, match=r"block_ids holds block 3.*3 blocks"):
        M.SelectedBlocks(torch.tensor([[[3]]]), block_size=4).materialize(1, 1, 10)


def test_composition_means_and_or_of_the_parts():
    """& and | with a selection mean the AND / OR of the materialized parts."""
    B, Sq, Sk = 2, 5, 11
    sel = M.SelectedKeys(rand_ids((B, Sq, 4), Sk, 3))
    S = sel.materialize(B, Sq, Sk)
    for other in (M.Causal(), M.KeyPadding(torch.tensor([11, 6])), M.SlidingWindow(2),
                  M.Document(torch.tensor([2, 3]), torch.tensor([5, 6])), M.PrefixLM(torch.tensor([0, 3]))):
        O = other.materialize(B, Sq, Sk)
        assert torch.equal((sel & other).materialize(B, Sq, Sk), S & O)
        assert torch.equal((sel | other).materialize(B, Sq, Sk), S | O)


def test_duplicates_count_once():
    """A key listed twice is selected once: the same mask, and the same output bit for bit, as
    the list without the duplicate; the reduced ids hold it once."""
    q, k, v = make_qkv(1, 2, 1, 2, 9, 8)
    once = M.SelectedKeys(torch.tensor([[[4, 1, -1, -1], [7, -1, -1, -1]]]))
    twice = M.SelectedKeys(torch.tensor([[[4, 1, 4, 4], [7, 7, -1, 7]]]))
    assert torch.equal(once.materialize(1, 2, 9), twice.materialize(1, 2, 9))
    for backend in ("math", "sdpa", "decode"):
        assert torch.equal(attnkit.attention(q, k, v, once, backend=backend),
                           attnkit.attention(q, k, v, twice, backend=backend))
    red = ReducedMask(twice, 1, 2, 9).selection
    assert red.ids("cpu").tolist() == [[[[1, 4, -1, -1], [7, -1, -1, -1]]]]
    assert red.counts("cpu").tolist() == [[[2, 1]]]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(KINDS), st.sampled_from(["alone", "causal", "window"]))
def test_order_within_a_list_changes_nothing(seed, kind, how):
    """Permuting each query's list (ids and unused slots alike) changes neither the mask, the
    reduced ids, nor the output (bitwise, on the same backend)."""
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 3, 17
    sel = selection(kind, B, Hq, Hkv, Sq, Sk, seed)
    g = torch.Generator().manual_seed(seed)
    perm = torch.argsort(torch.rand(sel.ids.shape, generator=g), -1)
    shuffled = like(sel, sel.ids.gather(-1, perm))
    a, b = compose(sel, how, B, Sq, Sk), compose(shuffled, how, B, Sq, Sk)
    assert torch.equal(a.materialize(B, Sq, Sk), b.materialize(B, Sq, Sk))
    assert torch.equal(ReducedMask(a, B, Sq, Sk).selection.ids("cpu"), ReducedMask(b, B, Sq, Sk).selection.ids("cpu"))
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, 8, seed=seed)
    assert torch.equal(attnkit.attention(q, k, v, a, backend="math"), attnkit.attention(q, k, v, b, backend="math"))


# --------------------------------------------------------------------------- the oracle grid


def _backends_for(Sq: int, auto: bool = True) -> list[str]:
    """The backends that take a selection on CPU: the dense path of math and sdpa, the split-K
    engine (few-query calls) and, with ``auto``, auto's choice (one of these on CPU)."""
    return ["math", "sdpa"] + (["decode"] if Sq <= 16 else []) + (["auto"] if auto else [])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", COMPOSE)
def test_oracle_grid(dtype, heads, kind, how):
    """Rule R, forward and backward, for both selections, shared and per KV head, under every
    composition, over MHA/GQA/MQA, odd sizes and dtypes, on every backend that takes the call."""
    Hq, Hkv = HEADS[heads]
    sizes = [(1, 333, 7), (17, 17, 80), (5, 40, 1)]
    if dtype != "fp32":  # half precision: one of the sizes, in turn over the grid (its CPU backward is slow)
        sizes = [sizes[stable_seed(heads, kind, how) % 3]]
    for Sq, Sk, D in sizes:
        seed = stable_seed(dtype, heads, kind, how, Sq, Sk, D)
        q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, D, dtype=DTYPES[dtype], seed=seed,
                           dist="randn" if seed % 2 else "rand")
        mask = compose(selection(kind, 2, Hq, Hkv, Sq, Sk, seed), how, 2, Sq, Sk)
        for backend in _backends_for(Sq, auto=False):
            check_against_oracle(q, k, v, mask, backend=backend)


@pytest.mark.parametrize("kind", KINDS)
def test_wide_head_dim_and_empty_query(kind):
    """D = 256, and a step with no query (Sq = 0), hold rule R too."""
    Hq, Hkv = 4, 2
    for Sq, Sk, D in ((3, 33, 256), (0, 9, 7)):
        q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, D, seed=Sq)
        mask = selection(kind, 2, Hq, Hkv, Sq, Sk, Sq) & M.Causal()
        for backend in _backends_for(Sq):
            check_against_oracle(q, k, v, mask, backend=backend)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("modifier", ["alibi", "softcap", "sinks", "all"])
@pytest.mark.parametrize("Sq", [1, 20])
def test_modifiers_with_a_selection(kind, modifier, Sq):
    """ALiBi, soft-capping and sinks apply to the selected keys only, under rule R (gradients
    too), on math, auto and the split-K engine (which runs modifiers at any length)."""
    Hq, Hkv, Sk, D = 4, 2, 37, 16
    seed = stable_seed(kind, modifier, Sq)
    q, k, v = make_qkv(2, Hq, Hkv, Sq, Sk, D, seed=seed)
    mask = (selection(kind, 2, Hq, Hkv, Sq, Sk, seed) | M.SlidingWindow(2)) & M.Causal()
    kw = {}
    if modifier in ("alibi", "all"):
        mask = M.ALiBi(M.alibi_slopes(Hq)) & mask
    if modifier in ("softcap", "all"):
        kw["softcap"] = 5.0
    if modifier in ("sinks", "all"):
        kw["sinks"] = torch.randn(Hq)
    for backend in ("math", "auto", "decode"):
        check_against_oracle(q, k, v, mask, backend=backend, **kw)


def test_paged_keys_with_a_selection():
    """A selection over paged K/V: the paged engine and auto equal the same call on the dense
    K/V (the paged lengths ANDed in)."""
    B, Hq, Hkv, Sq, Sk, D, bs = 2, 4, 2, 2, 24, 16, 8
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=5)
    lengths = torch.tensor([24, 13])
    table = torch.tensor([[0, 1, 2], [3, 4, 5]])
    pool = lambda t: t.permute(0, 2, 1, 3).reshape(B * Sk // bs, bs, Hkv, D)  # noqa: E731
    kv = attnkit.PagedKV(pool(k), pool(v), table, lengths)
    ids = rand_ids((B, Sq, 6), 13, 5)
    mask = M.SelectedKeys(ids) & M.Causal()
    want = attnkit.attention_reference(q, k, v, mask & M.KeyPadding(lengths)).float()
    for backend in ("paged", "auto"):
        got = attnkit.attention(q, kv, None, mask, backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- empty rows


@pytest.mark.parametrize("kind", KINDS)
def test_a_query_with_nothing_selected_outputs_zero(kind):
    """A list of unused slots only selects nothing: that row outputs exactly 0 with zero
    gradients on every backend, and the other rows are those of the oracle."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 3, 20, 8
    sel = selection(kind, B, Hq, Hkv, Sq, Sk, 11)
    sel.ids[0, ..., 0, :] = -1  # item 0, query 0: nothing (every list)
    sel.ids[1, ..., 2, :] = -5
    for backend in ("math", "sdpa", "auto", "decode"):
        q, k, v = (t.requires_grad_(backend != "decode") for t in make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=1))
        out = check_against_oracle(q, k, v, sel, backend=backend)
        assert (out[0, :, 0] == 0).all() and (out[1, :, 2] == 0).all()
        if backend == "decode":
            continue
        out = attnkit.attention(q, k, v, sel, backend=backend)
        out.backward(torch.randn_like(out))
        assert torch.isfinite(q.grad).all() and (q.grad[0, :, 0] == 0).all() and (q.grad[1, :, 2] == 0).all()


# --------------------------------------------------------------------------- which backend


def test_describe_call_names_the_backend_that_runs_a_selection():
    """describe_call names the backend that runs a selection call, auto and forced, and the
    Triton kernel says it walks the selection."""
    q, k, v = make_qkv(1, 4, 2, 1, 64, 16)
    mask = M.SelectedKeys(rand_ids((1, 1, 8), 64, 2)) & M.Causal()
    chosen = attnkit.describe_call(q, k, v, mask)
    assert chosen in ("decode", "sdpa")
    check_against_oracle(q, k, v, mask, backend=chosen)
    for forced in ("math", "sdpa", "decode"):
        assert attnkit.describe_call(q, k, v, mask, backend=forced) == forced
    if get_backend("triton").available() is None:
        assert attnkit.describe_call(q, k, v, mask, backend="triton", detail=True) == "triton[split-k+selection]"


def test_auto_sends_cuda_prefill_with_a_selection_to_a_kernel_that_skips_blocks():
    """`auto`'s decision for CUDA calls, made on CPU from the call's description: prefill with a
    selection (alone, under causal, with a local window) goes to the Triton kernel, which walks
    each query's selected keys, and with gradients to FlexAttention, which skips the key blocks
    no query of a tile selects; never to SDPA over a materialized mask. A call without a
    selection stays with SDPA. A selection per KV head gets a block mask per query head."""
    from dataclasses import replace

    from attnkit.backends import flex, registry

    def call(mask, Sq=2048):
        return registry.AttentionCall(1, 16, 4, Sq, 2048, 128, 128, torch.bfloat16, torch.device("cuda"), mask,
                                      0.1, 0.0, False, False)

    shared = M.SelectedKeys(torch.zeros(1, 2048, 8, dtype=torch.long))
    per_head = M.SelectedBlocks(torch.zeros(1, 4, 2048, 2, dtype=torch.long), 64, num_heads=16)
    for mask in (shared, shared & M.Causal(), (per_head | M.SlidingWindow(63)) & M.Causal()):
        c = call(mask)
        assert "selection" in flex.sdpa_cannot_fuse(c)
        if get_backend("flex").available() is None:
            want = "triton" if get_backend("triton").available() is None else "flex"
            assert registry.select(c).name == want, mask  # a kernel reading it, never SDPA
            assert registry.select(replace(c, needs_grad=True)).name == "flex", f"{mask} (backward)"
    assert flex.block_mask_heads(call(shared)) is None and flex.block_mask_heads(call(per_head)) == 16
    assert flex.sdpa_cannot_fuse(call(M.Causal())) is None


@pytest.mark.slow
@pytest.mark.skipif(get_backend("flex").available() is not None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("kind", ["keys-shared", "keys-per_head"])
def test_flex_reads_the_selection_through_its_mask_mod(kind, monkeypatch):
    """FlexAttention (forced, CPU forward) computes a selection from its mask_mod, under rule R,
    with lists that leave whole 128-key blocks empty for some heads and not for others: a list
    per KV head gets a block mask per head. Neither the block mask nor the mask_mod builds an
    (Sq, Sk) tensor (the dense table and create_block_mask, which evaluates every pair, fail)."""
    from attnkit.backends import flex

    def dense(*a, **k):
        raise AssertionError("an (Sq, Sk) table was built")

    flex._BLOCK_MASKS.clear()
    Hq, Hkv, Sq, Sk = 2, 2, 130, 300
    q, k, v = make_qkv(1, Hq, Hkv, Sq, Sk, 16, seed=9)
    if kind == "keys-shared":
        ids = torch.randint(0, Sk, (1, Sq, 6))
        ids[..., 0] = 0
    else:
        ids = torch.full((1, Hkv, Sq, 6), -1)
        ids[:, 0, :, 0] = 0  # head 0: key 0 only; head 1: keys in the last block
        ids[:, 1] = torch.randint(260, Sk, (1, Sq, 6))
    mask = M.SelectedKeys(ids)
    with monkeypatch.context() as patch:
        patch.setattr(M.Selection, "_table", dense)
        patch.setattr(flex._flex_module(), "create_block_mask", dense)
        out = attnkit.attention(q, k, v, mask, backend="flex")
    check_against_oracle(q, k, v, mask, backend="flex", grad=False)  # the oracle materializes the mask
    torch.testing.assert_close(out, attnkit.attention(q, k, v, mask, backend="flex"), rtol=0, atol=0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make,exc,text", [
    (lambda: M.SelectedKeys(torch.zeros(1, 2, 3)), TypeError,
     r"indices must be an integer tensor.*float32.*\(1, 2, 3\)"),
    (lambda: M.SelectedKeys(torch.zeros(1, 2, 3, dtype=torch.bool)), TypeError, r"indices.*torch\.bool"),
    (lambda: M.SelectedKeys(torch.zeros(2, 3, dtype=torch.long)), ValueError, r"indices must be .*\(2, 3\)"),
    (lambda: M.SelectedKeys(torch.zeros(1, 1, 2, 3, 4, dtype=torch.long)), ValueError, r"indices .*\(1, 1, 2, 3, 4\)"),
    (lambda: M.SelectedBlocks(torch.zeros(1, 2, 3), 4), TypeError, r"block_ids must be an integer tensor"),
    (lambda: M.SelectedBlocks(torch.zeros(1, 2, 3, dtype=torch.long), 0), ValueError, "block_size must be >= 1"),
    (lambda: M.SelectedBlocks(torch.zeros(1, 2, 3, dtype=torch.long), 1.5), TypeError, "block_size must be an int"),
    (lambda: M.SelectedKeys(torch.zeros(1, 3, 2, 4, dtype=torch.long), num_heads=4), ValueError,
     r"num_heads=4 is not a multiple of the 3 selection heads"),
    (lambda: M.SelectedKeys(torch.zeros(1, 3, 2, 4, dtype=torch.long), num_heads=0), ValueError, "num_heads"),
])
def test_bad_selection_arguments(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


@pytest.mark.parametrize("mask,text", [
    (M.SelectedKeys(torch.tensor([[[0, 9]]]).expand(2, 3, 2)), r"indices holds key position 9, but the call has Sk=9 "
                                                                r"keys \(indices of shape \(2, 3, 2\)"),
    (M.SelectedBlocks(torch.tensor([[[0, 3]]]).expand(2, 3, 2), 3), r"block_ids holds block 3, but Sk=9 keys in "
                                                                    r"blocks of block_size=3 make 3 blocks"),
    (M.SelectedKeys(torch.zeros(3, 3, 2, dtype=torch.long)), r"indices has shape \(3, 3, 2\): its first dim .* B=2"),
    (M.SelectedKeys(torch.zeros(2, 4, 2, dtype=torch.long)), r"indices has shape \(2, 4, 2\): .* Sq=3"),
    (M.SelectedKeys(torch.zeros(2, 2, 3, 2, dtype=torch.long)), r"indices has shape \(2, 2, 3, 2\): 2 selection heads "
                                                                r"for 4 query heads; pass num_heads=4"),
    (M.SelectedKeys(torch.zeros(2, 3, 3, 2, dtype=torch.long)), r"3 selection heads do not divide the call's 4"),
    (M.SelectedKeys(torch.zeros(2, 2, 3, 2, dtype=torch.long), num_heads=8), r"num_heads=8, but the call has 4"),
])
def test_a_selection_that_does_not_fit_the_call_raises(mask, text):
    """attention() refuses a selection that does not fit the call before running anything, with
    a ValueError naming the argument and the shapes; an out-of-range id is never read."""
    q, k, v = make_qkv(2, 4, 2, 3, 9, 8)
    with pytest.raises(ValueError, match=text):
        attnkit.attention(q, k, v, mask)
    with pytest.raises(ValueError, match=text):
        attnkit.attention_reference(q, k, v, mask & M.Causal())


# --------------------------------------------------------------------------- the reduced form


def _from_reduced(red: ReducedSelection, Hq: int, B: int, Sq: int, Sk: int) -> torch.Tensor:
    """(B, Hq, Sq, Sk) bool rebuilt from the reduced form's documented meaning alone."""
    keys = red.keys("cpu").long()  # (B|1, Hs, Sq, n)
    sel = torch.zeros(*keys.shape[:-1], Sk + 1, dtype=torch.bool)
    sel.scatter_(-1, torch.where(keys < 0, Sk, keys), True)
    sel = sel[..., :Sk].repeat_interleave(Hq // red.heads, 1).expand(B, Hq, Sq, Sk)
    j = torch.arange(Sk)
    ok = sel
    if red.union("cpu") is not None:
        ulo, uhi = (t.expand(B, Sq)[:, None, :, None] for t in red.union("cpu"))
        ok = ok | ((j >= ulo) & (j < uhi))
    lo, hi = (t.expand(B, Sq)[:, None, :, None] for t in red.within("cpu"))
    return ok & (j >= lo) & (j < hi)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["alone", "causal", "padding", "window"])
def test_the_reduced_selection_says_what_the_mask_says(kind, how):
    """ReducedSelection's ids (or keys), union and within intervals rebuild exactly the mask
    (without its ALiBi part); ids are distinct, ascending, -1 after them, counted by counts."""
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 5, 23
    sel = selection(kind, B, Hq, Hkv, Sq, Sk, stable_seed(kind, how))
    mask = M.ALiBi(M.alibi_slopes(Hq)) & compose(sel, how, B, Sq, Sk)
    red = ReducedMask(mask, B, Sq, Sk)
    assert red.has_selection and red.intervals("cpu") is None and red.limit_parts() is None
    s = red.selection
    assert s.mask is sel and s.heads == sel.heads and s.block_size == sel.block_size
    want = red.rest.materialize(B, Sq, Sk).expand(B, Hq, Sq, Sk)
    assert torch.equal(_from_reduced(s, Hq, B, Sq, Sk), want)
    ids, counts = s.ids("cpu"), s.counts("cpu")
    assert ids.dtype == counts.dtype == torch.int32
    n = ids.shape[-1]
    used = torch.arange(n) < counts[..., None]
    assert torch.equal(used, ids >= 0)
    big = torch.where(used, ids, torch.iinfo(torch.int32).max)
    assert (big[..., 1:] > big[..., :-1])[used[..., 1:]].all()  # strictly ascending over the used slots


@pytest.mark.parametrize("make", [
    lambda s: s & M.Document(torch.tensor([2, 3])),
    lambda s: s & M.SelectedKeys(torch.zeros(2, 5, 1, dtype=torch.long)),
    lambda s: s | M.SlidingWindow(1) | M.Causal("top_left"),
    lambda s: (s & M.Causal()) | M.SlidingWindow(1),
    lambda s: s & M.KeyPadding(valid=torch.ones(2, 9, dtype=torch.bool)),
    lambda s: s & M.Additive(torch.zeros(5, 9)),
], ids=["document", "two selections", "or of two windows", "and under or", "valid padding", "additive"])
def test_a_selection_no_kernel_reads_is_left_to_the_dense_path(make):
    """Where the selection sits in a tree no kernel reads in place, the reduced form offers no
    selection and no intervals: every backend then takes the dense path, which is exact."""
    B, Sq, Sk = 2, 5, 9
    mask = make(M.SelectedKeys(rand_ids((B, Sq, 3), Sk, 4)))
    red = ReducedMask(mask, B, Sq, Sk)
    assert red.has_selection and red.selection is None and red.intervals("cpu") is None
    q, k, v = make_qkv(B, 2, 1, Sq, Sk, 8, seed=4)
    for backend in ("math", "sdpa", "decode"):
        check_against_oracle(q, k, v, mask, backend=backend)


def test_masks_without_a_selection_reduce_as_before():
    """A mask without a selection has no selection in its reduced form, and its intervals are
    unchanged."""
    for mask in (None, M.Causal(), M.Causal() & M.KeyPadding(torch.tensor([3, 9])), M.Document(torch.tensor([2, 3]))):
        red = ReducedMask(mask, 2, 5, 9)
        assert not red.has_selection and red.selection is None
    lo, hi = ReducedMask(M.Causal(), 2, 5, 9).intervals("cpu")
    assert lo.tolist() == [[0] * 5] and hi.tolist() == [[5, 6, 7, 8, 9]]


def test_block_keys_are_expanded_only_on_request():
    """A block selection's reduced ids are block ids; keys() expands them (the partial last
    block cut at Sk)."""
    sel = M.SelectedBlocks(torch.tensor([[[2, 0, -1, 0]]]), block_size=4)
    red = ReducedMask(sel & M.Causal(), 1, 1, 10).selection
    assert red.block_size == 4 and red.ids("cpu").tolist() == [[[[0, 2, -1, -1]]]]
    assert red.keys("cpu").tolist() == [[[[0, 1, 2, 3, 8, 9] + [-1] * 10]]]


def test_lists_hold_exactly_the_keys_each_query_sees():
    """ReducedSelection.lists: per query and list, entries [lo, hi) are the keys the definition
    allows, ascending and distinct, for every composition and any chunk of queries."""
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 6, 23
    for kind, how in itertools.product(KINDS, ["alone", "causal", "padding", "window"]):
        mask = compose(selection(kind, B, Hq, Hkv, Sq, Sk, stable_seed(kind, how)), how, B, Sq, Sk)
        red = ReducedMask(mask, B, Sq, Sk).selection
        want = mask.materialize(B, Sq, Sk, "cpu").expand(B, Hq, Sq, Sk)
        for start, stop in ((0, Sq), (2, 5)):
            keys, lo, hi = red.lists("cpu", start, stop)
            for b, i, s in itertools.product(range(B), range(stop - start), range(red.heads)):
                seen = keys[b, i, s, lo[b, i, s]:hi[b, i, s]].tolist()
                h = s * (Hq // red.heads)  # the first query head of the list
                assert seen == want[b, h, start + i].nonzero().flatten().tolist(), (kind, how, b, i, s)


# --------------------------------------------------------------------------- the engine walks the selection


def _layout(name: str, q, k, v, seed: int):
    """(kv, v or None, (k64, v64) dense fp64 for the oracle, kv_mask): K/V in layout ``name``
    (dense, paged, int8, int8_paged, mla: V read from K) and the mask the layout adds (paged
    lengths) for the oracle over the dense K/V."""
    B, Hkv, Sk, D = k.shape
    if name == "mla":
        return k, k[..., :v.shape[-1]], (k.double(), k[..., :v.shape[-1]].double()), None
    if name == "dense":
        return k, v, (k.double(), v.double()), None
    if name == "int8":
        qkv = attnkit.QuantizedKV.quantize(k, v, "int8")
        return qkv, None, qkv.gather(torch.float64), None
    bs, g = 8, torch.Generator().manual_seed(seed)
    W = -(-Sk // bs)
    N = B * W + 3
    table = torch.randperm(N, generator=g)[:B * W].view(B, W)
    lens = torch.tensor([Sk] + [Sk - 5] * (B - 1))
    pool_k = (torch.randn(N, bs, Hkv, D) * 100).to(k.dtype)
    pool_v = (torch.randn(N, bs, Hkv, v.shape[-1]) * 100).to(k.dtype)
    pos = torch.arange(Sk)
    for b in range(B):
        pool_k[table[b, pos // bs], pos % bs] = k[b].transpose(0, 1)
        pool_v[table[b, pos // bs], pos % bs] = v[b].transpose(0, 1)
    pad = M.KeyPadding(lens)
    if name == "paged":
        return attnkit.PagedKV(pool_k, pool_v, table, lens), None, (k.double(), v.double()), pad
    qkv = attnkit.QuantizedKV.quantize(pool_k, pool_v, "int8", block_table=table, lengths=lens)
    return qkv, None, qkv.gather(torch.float64), pad


@pytest.mark.parametrize("layout", ["dense", "paged", "int8", "int8_paged", "mla"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_walks_the_selection_under_rule_r(implementation, monkeypatch, layout, kind):
    """The split-K engine (native kernel and torch implementation) reads the selection in place
    for every K/V layout, under every composition it reads (alone, cut by causal / padding,
    joined with a window), for decode, speculative and prefill lengths (chunked), with and without
    ALiBi, soft cap and sinks: rule R against the fp64 oracle over the same K/V."""
    from attnkit.backends.decode import splitk

    monkeypatch.setattr(splitk, "SELECTION_Q_CHUNK", 16)  # prefill below crosses chunks
    B, Hq, Sk = 2, 4, 41
    Hkv, D, Dv = (1, 40, 32) if layout == "mla" else (2, 32, 32)
    for Sq, how in itertools.product((1, 5, 37), ["alone", "causal", "padding", "window"]):
        seed = stable_seed(layout, kind, how, Sq)
        q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, Dv=Dv, seed=seed,
                           dtype=torch.bfloat16 if seed % 3 == 0 else torch.float32)
        kv, v_arg, (k64, v64), kv_mask = _layout(layout, q, k, v, seed)
        mask = compose(selection(kind, B, Hq, Hkv, Sq, Sk, seed), how, B, Sq, Sk)
        kw = {}
        if seed % 2:
            mask = M.ALiBi(M.alibi_slopes(Hq)) & mask
            kw = {"softcap": 4.0, "sinks": torch.randn(Hq)}
        assert splitk.reads_selection(ReducedMask(mask, B, Sq, Sk), Hkv)
        out = attnkit.attention(q, kv, v_arg, mask, backend="decode" if kv_mask is None else "paged", **kw)
        full = mask if kv_mask is None else mask & kv_mask
        gold = attnkit.attention_reference(q.double(), k64, v64, full, **kw)
        base = attnkit.attention(q, k64.to(q.dtype), v64.to(q.dtype), full, backend="math", **kw)
        rule_r(out, base, gold, n_terms=Sk)


@pytest.mark.parametrize("layout", ["dense", "paged", "mla"])
@pytest.mark.parametrize("kind", ["keys-shared", "blocks-per_head"])
def test_the_engine_never_reads_a_key_no_query_selected(implementation, layout, kind):
    """Every K and V row no list selects holds NaN: the engine's output stays the oracle's over
    the clean K/V (a row it read would turn its query's output to NaN)."""
    B, Hq, Sk = 2, 4, 50
    Hkv, D, Dv = (1, 40, 32) if layout == "mla" else (2, 32, 32)
    for Sq in (1, 6):
        seed = stable_seed("nan", layout, kind, Sq)
        q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, Dv=Dv, seed=seed)
        if layout == "mla":
            v = k[..., :Dv]
        mask = selection(kind, B, Hq, Hkv, Sq, Sk, seed) & M.Causal()
        kv_mask = _layout(layout, q, k, v, seed)[3]
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(),
                                           mask if kv_mask is None else mask & kv_mask)
        seen = mask.materialize(B, Sq, Sk, "cpu").expand(B, Hq, Sq, Sk).any(2)  # (B, Hq, Sk)
        unread = ~seen.view(B, Hkv, Hq // Hkv, Sk).any(2)  # (B, Hkv, Sk): no query of the KV head sees it
        k, v = k.clone(), v.clone()
        k[unread], v[unread] = float("nan"), float("nan")
        if layout == "mla":
            v = k[..., :Dv]
        kv, v_arg, _, kv_mask = _layout(layout, q, k, v, seed)
        out = attnkit.attention(q, kv, v_arg, mask, backend="decode" if kv_mask is None else "paged")
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), gold, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_nan_in_a_selected_key_reaches_the_rows_that_select_it(implementation, layout):
    """NaN in one key row that some queries select: those queries' outputs are NaN, every other
    row equals the oracle's (only the selection decides what a row reads)."""
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 3, 40, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=9)
    ids = torch.tensor([[[3, 7, -1], [7, 11, 20], [1, 2, 5]]])  # query 2 does not select key 7
    mask = M.SelectedKeys(ids)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    k, v = k.clone(), v.clone()
    k[:, 1, 7] = float("nan")  # KV head 1: query heads 2 and 3
    kv, v_arg, _, _ = _layout(layout, q, k, v, 9) if layout == "paged" else (k, v, None, None)
    out = attnkit.attention(q, kv, v_arg, mask, backend="decode" if layout == "dense" else "paged")
    assert out[0, 2:, :2].isnan().all() and not out[0, :2].isnan().any() and not out[0, :, 2].isnan().any()
    ok = ~out.isnan().any(-1, keepdim=True).expand_as(out)
    torch.testing.assert_close(out[ok].double(), gold[ok], rtol=0, atol=1e-5)


def test_auto_reads_the_selection_in_place_on_cpu_and_never_builds_a_dense_mask(monkeypatch):
    """On CPU, auto gives a selection call of any length to the split-K engine, which says so in
    describe_call, and the call builds no (Sq, Sk) mask: the reduced mask's dense form is never
    asked for."""
    from attnkit import native

    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 40, 300, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, seed=8)
    mask = M.SelectedKeys(rand_ids((B, Sq, 12), Sk, 8)) & M.Causal()
    detail = attnkit.describe_call(q, k, v, mask, detail=True)
    if native.status(build=False).startswith("native"):
        assert detail.startswith("decode[native") and detail.endswith("selection read in place]")
    want = attnkit.attention_reference(q, k, v, mask).float()

    def refuse(*args, **kwargs):
        raise AssertionError("a dense mask was built")

    monkeypatch.setattr(ReducedMask, "dense", refuse)
    monkeypatch.setattr(M.Mask, "materialize", refuse)
    got = attnkit.attention(q, k, v, mask, backend="decode")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_selection_per_query_head_of_a_kv_group_takes_the_dense_path():
    """Lists per query head inside a KV group (Hs = Hq > Hkv) are not walked in place (a KV
    head's rows would need several lists): decode takes them densely, still exact."""
    from attnkit.backends.decode import splitk

    B, Hq, Hkv, Sq, Sk = 1, 4, 2, 2, 30
    sel = M.SelectedKeys(rand_ids((B, Hq, Sq, 5), Sk, 3), num_heads=Hq)
    assert not splitk.reads_selection(ReducedMask(sel, B, Sq, Sk), Hkv)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, 16, seed=3)
    check_against_oracle(q, k, v, sel, backend="decode")


def test_the_native_kernel_never_reads_past_what_it_holds():
    """The native op builds each query's list from the ids as given: order and repeats mean
    nothing, ids past the keys K/V holds are never read (the mask's own check raises for them
    in eager calls), and a paged key whose block is outside the pool raises ValueError."""
    from attnkit import native

    ops = native.load()
    if ops is None:
        pytest.skip(f"no native kernel here: {native.status()}")
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)

    def call(ids, kk=k, vv=v, table=None, hi=20):
        ids = torch.tensor([[[ids]]])
        return ops.splitk_attention(q, kk, vv, None, None, 16, table, None, None, None, None, None, None, 0.25, 0.0,
                                    1, False, ids, 1, torch.tensor([0]), torch.tensor([hi]), None, None, 1)[0]

    want = attnkit.attention_reference(q, k, v, M.SelectedKeys(torch.tensor([[[0, 3, 19]]]))).float()
    for ids in ([0, 3, 19], [19, 3, 0, 3, -1], [3, 0, 19, 20, 1 << 40]):
        torch.testing.assert_close(call(ids), want, rtol=0, atol=1e-6)
    pool_k, pool_v = torch.randn(3, 4, 1, 16), torch.randn(3, 4, 1, 16)
    table = torch.tensor([[2, -1, 0]])
    call([0, 9], pool_k, pool_v, table, hi=12)
    with pytest.raises(ValueError, match="block_table entry -1"):
        call([0, 5], pool_k, pool_v, table, hi=12)


def _tiles(allowed: torch.Tensor, qb: int, kb: int) -> torch.Tensor:
    """(B, H, nqb, nkb): whether each tile of a materialized mask allows some pair."""
    B, H, Sq, Sk = allowed.shape
    nq, nk = -(-Sq // qb), -(-Sk // kb)
    a = torch.nn.functional.pad(allowed, (0, nk * kb - Sk, 0, nq * qb - Sq))
    return a.view(B, H, nq, qb, nk, kb).any(5).any(3)


@pytest.mark.parametrize("case", ["keys", "keys-per-head", "blocks-unaligned", "blocks-wide", "keys&causal",
                                  "(blocks|window)&causal", "ragged-causal&padding"])
def test_block_occupancy_covers_every_allowed_tile_without_the_dense_mask(case, monkeypatch):
    """Mask.block_occupancy: every (query block, key block) tile holding an allowed pair is
    marked (a superset: block-sparse kernels skip the rest), exactly for a selection or an
    interval mask alone, and the selection's bitmap mask_mod says what materialize says, pair by
    pair; neither builds the (Sq, Sk) table."""
    B, Hq, Sq, Sk, qb, kb = 2, 4, 37, 150, 8, 16
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(-1, Sk, (B, Sq, 5), generator=g)
    blocks48 = torch.randint(-1, -(-Sk // 12), (1, 2, Sq, 3), generator=g)
    masks = {
        "keys": M.SelectedKeys(ids),
        "keys-per-head": M.SelectedKeys(torch.randint(0, Sk, (B, 2, Sq, 4), generator=g), num_heads=Hq),
        "blocks-unaligned": M.SelectedBlocks(blocks48, 12, num_heads=Hq),  # 12-key blocks straddle 16-key tiles
        "blocks-wide": M.SelectedBlocks(torch.randint(0, 3, (B, Sq, 2), generator=g), 40),  # a block spans 3 tiles
        "keys&causal": M.SelectedKeys(ids) & M.Causal(),
        "(blocks|window)&causal": (M.SelectedBlocks(blocks48, 12, num_heads=Hq) | M.SlidingWindow(7)) & M.Causal(),
        "ragged-causal&padding": M.Causal(q_start=torch.tensor([100, 3])) & M.KeyPadding(torch.tensor([140, 20])),
    }
    mask = masks[case]
    allowed = mask.materialize(B, Sq, Sk).expand(B, Hq, Sq, Sk)
    want = _tiles(allowed, qb, kb)
    monkeypatch.setattr(M.Selection, "_table", lambda *a: (_ for _ in ()).throw(AssertionError("dense table")))
    occ = mask.block_occupancy(B, Sq, Sk, qb, kb)
    assert occ is not None
    occ = occ.repeat_interleave(Hq // occ.shape[1], dim=1).expand(B, Hq, -1, -1)
    assert not (want & ~occ).any(), "a tile holding an allowed pair is not marked"
    if case in ("keys", "keys-per-head", "blocks-unaligned", "blocks-wide", "ragged-causal&padding"):
        assert torch.equal(occ, want)
    mod = mask.mask_mod(Sq, Sk)
    b, h, q, kv = (torch.arange(n).view(*(-1 if i == d else 1 for i in range(4))) for d, n in enumerate((B, Hq, Sq, Sk)))
    assert torch.equal(mod(b, h, q, kv).expand(B, Hq, Sq, Sk), allowed)
