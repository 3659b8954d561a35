"""Context parallelism (attnkit.distributed): ring attention over gloo equals single-process attention.

Spawned tests: ONE group of 4 processes (gloo, CPU, 1 thread each) runs every case, because
process start-up costs seconds: world-size-4 cases on the default group, world-size-2 cases on
the sub-groups {0, 1} and {2, 3} (half the grid each, concurrently; this also exercises
``group=`` with group ranks that differ from global ranks) and world-size-1 cases on singleton
groups. Every rank builds the full tensors from a shared seed, computes the single-process
``attnkit.attention`` result (and gradients by autograd) on them, runs the ring on its shard and
compares its shard of the output and of dq/dk/dv (fp32: ``assert_close`` defaults; bf16: rule R
against the fp64 oracle). Each rank records per-case failures; one parametrized test per case
reads them back, so a failure names its case.

Single-process tests cover the block primitives, masks at global indices, the sharding helpers,
the tile plan (zigzag balances causal work) and bad input.
"""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnkit
from attnkit import masks as M
from attnkit.distributed import (ContextParallel, block_backward, block_forward, gather_sequence, mask_at,
                                 merge_partials, padded_length, ring_attention, shard_positions, shard_sequence,
                                 softmax_delta, unshard_sequence)
from attnkit.distributed import ring as ring_mod
from attnkit.rope import RotaryEmbedding
from conftest import base_attention, make_qkv, rule_r, stable_seed

if not (dist.is_available() and dist.is_gloo_available()):  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 4

# --------------------------------------------------------------------------- the case grid


@dataclass(frozen=True)
class Case:
    kind: str  # "attn" | "module" | "padding" | "error" | "memory"
    world: int
    sharding: str = "zigzag"
    causal: bool = False
    hq: int = 4
    hkv: int = 2
    mask: str = "none"
    S: int = 16
    Sk: int | None = None
    D: int = 8
    Dv: int | None = None
    dtype: str = "fp32"
    tile: int | None = None  # forces small score tiles (several tiles per block)
    scale: float | None = None
    variant: str = ""

    @property
    def id(self) -> str:
        parts = [f"P{self.world}", self.kind, self.sharding, "causal" if self.causal else "full",
                 f"h{self.hq}-{self.hkv}", self.mask, f"S{self.S}"]
        if self.Sk is not None:
            parts.append(f"Sk{self.Sk}")
        if self.Dv is not None:
            parts.append(f"Dv{self.Dv}")
        parts += [self.dtype] + ([f"tile{self.tile}"] if self.tile else []) + \
            ([f"scale{self.scale}"] if self.scale else []) + ([self.variant] if self.variant else [])
        return "-".join(parts)


def _grid(world: int, full: bool) -> list[Case]:
    """Every sharding x causal x mask kind; x every head layout (MHA, GQA, MQA) when ``full``,
    else one head layout per mask, rotating (4 ranks share a machine's few cores, so each case is
    several times dearer there)."""
    S = 8 * 2  # a multiple of 2P for P in (1, 2, 4)
    heads = ((4, 4), (4, 2), (4, 1))
    cases = []
    for j, (sharding, causal) in enumerate(((s, c) for s in ("zigzag", "contiguous") for c in (False, True))):
        for i, mask in enumerate(("none", "keypad", "document", "window")):
            for hq, hkv in (heads if full else [heads[(i + j) % 3]]):
                cases.append(Case("attn", world, sharding, causal, hq, hkv, mask, S))
    cases += [
        Case("attn", world, "zigzag", False, 4, 2, "dense", S),
        Case("attn", world, "contiguous", True, 4, 2, "dense", S),
        Case("attn", world, "zigzag", True, 4, 2, "prefix", S),
        Case("attn", world, "zigzag", False, 4, 2, "keypad_empty", S),
        Case("attn", world, "contiguous", True, 4, 1, "keypad_empty", S),
        Case("attn", world, "zigzag", True, 4, 2, "keypad", 4 * world * 2, tile=40),  # several row tiles
        Case("attn", world, "contiguous", True, 4, 4, "document", 4 * world * 2, tile=40),
        Case("attn", world, "zigzag", True, 4, 2, "none", S, Sk=2 * S),  # cross lengths, bottom-right causal
        Case("attn", world, "contiguous", False, 4, 2, "keypad", S, Sk=2 * S),
        Case("attn", world, "zigzag", True, 2, 1, "none", S, D=8, Dv=4, scale=0.3),
        Case("attn", world, "zigzag", True, 4, 2, "none", S, dtype="fp64"),
        Case("attn", world, "zigzag", True, 4, 2, "keypad", S, dtype="bf16"),
        Case("attn", world, "contiguous", False, 4, 1, "document", S, dtype="bf16"),
        Case("padding", world, "zigzag", False, 4, 2, "keypad", 13),
        Case("padding", world, "contiguous", True, 4, 2, "keypad", 13),
        Case("module", world, "zigzag", True, 4, 2, "none", S, variant="rope"),
        Case("module", world, "contiguous", True, 4, 4, "none", S, variant="rope"),
        Case("module", world, "zigzag", False, 4, 1, "keypad", S, variant="norope-seqfirst"),
        Case("module", world, "zigzag", True, 4, 2, "none", S, variant="dynamic-rope"),
        # Today's models' modifiers: softcap per tile, ALiBi per tile at global positions, sinks
        # once after the last merge (their gradient summed over the group).
        Case("attn", world, "zigzag", True, 4, 2, "keypad", S, variant="softcap"),
        Case("attn", world, "contiguous", False, 4, 1, "document", S, variant="sinks"),
        Case("attn", world, "zigzag", False, 4, 2, "keypad_empty", S, variant="sinks"),
        Case("attn", world, "zigzag", True, 4, 2, "none", S, Sk=2 * S, variant="alibi"),
        Case("attn", world, "contiguous", True, 4, 4, "window", 4 * world * 2, tile=40, variant="softcap-sinks-alibi"),
        Case("attn", world, "zigzag", True, 4, 2, "keypad", S, dtype="bf16", variant="softcap-sinks-alibi"),
        Case("module", world, "zigzag", True, 4, 2, "none", S, variant="rope-modifiers"),
        Case("module", world, "contiguous", True, 4, 1, "keypad", S, variant="norope-alibi-fused"),
    ]
    if world > 1:
        cases += [Case("error", world, variant=v) for v in ("uneven", "odd-zigzag", "additive", "bad-sharding")]
        # Peak memory of forward + backward, in shards (MHA, D=64 so per-row stats are 1/64 shard).
        cases += [Case("memory", world, "zigzag", True, 2, 2, "none", 32 * world, D=64, tile=64),
                  Case("memory", world, "contiguous", False, 2, 2, "none", 32 * world, D=64, tile=64)]
    return cases


P4_CASES = _grid(4, full=False)
P2_CASES = _grid(2, full=True)
P1_CASES = [c for c in _grid(1, full=False) if c.kind in ("attn", "module") and c.mask in ("none", "keypad")]
ALL_CASES = P4_CASES + P2_CASES + P1_CASES
assert len({c.id for c in ALL_CASES}) == len(ALL_CASES)

# --------------------------------------------------------------------------- worker side

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _make_mask(name: str, B: int, S: int, Sk: int, seed: int):
    if name == "none":
        return None
    if name == "keypad":
        return M.KeyPadding(torch.tensor([Sk - 3, Sk // 2 + 1]))
    if name == "keypad_empty":  # sequence 0 has no keys: every one of its queries outputs exactly 0
        return M.KeyPadding(torch.tensor([0, Sk]))
    if name == "document":
        return M.Document(torch.tensor([[3, S - 8, 5], [S, 0, 0]]))
    if name == "window":
        return M.SlidingWindow(3)
    if name == "prefix":
        return M.PrefixLM(torch.tensor([5, 9]))
    if name == "dense":
        g = torch.Generator().manual_seed(seed)
        t = torch.rand(B, 1, S, Sk, generator=g) < 0.6
        t[1, 0, 2] = False  # one fully masked row
        return t
    raise ValueError(name)


def _check(got, want, what):
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def _modifiers(case: Case, mask, seed: int):
    """(mask with ALiBi ANDed in, softcap, sinks leaf or None) for the case's variant."""
    softcap = 1.0 if "softcap" in case.variant else None
    sinks = None
    if "sinks" in case.variant:
        sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    if "alibi" in case.variant:
        alibi = M.ALiBi(M.alibi_slopes(case.hq))
        mask = alibi if mask is None else M.as_mask(mask) & alibi
    return mask, softcap, sinks


def _shard(t, case, rank, dim=2):
    return shard_sequence(t, dim, rank=rank, world_size=case.world, sharding=case.sharding)


def _run_attn(case: Case, group, rank: int):
    seed = stable_seed(case.id)
    B, Sk = 2, case.Sk or case.S
    dtype = DT[case.dtype]
    q, k, v = make_qkv(B, case.hq, case.hkv, case.S, Sk, case.D, case.Dv, dtype=dtype, seed=seed)
    mask, softcap, sinks = _modifiers(case, _make_mask(case.mask, B, case.S, Sk, seed), seed)
    dout = torch.randn(B, case.hq, case.S, case.Dv or case.D, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    leaves = [_shard(t, case, rank).detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.to(dtype).requires_grad_()
    old_tile = ring_mod._TILE_ELEMENTS  # read when the call plans its tiles (backward reuses the plan)
    ring_mod._TILE_ELEMENTS = case.tile or old_tile
    try:
        out = ring_attention(*leaves, causal=case.causal, mask=mask, scale=case.scale, group=group,
                             sharding=case.sharding, softcap=softcap, sinks=sink_leaf)
    finally:
        ring_mod._TILE_ELEMENTS = old_tile
    out.backward(_shard(dout, case, rank).to(dtype))
    ours = [out] + [t.grad for t in leaves]
    names = ["out", "dq", "dk", "dv"]
    if sink_leaf is not None:  # each rank holds its rows' share of the sinks' gradient
        dist.all_reduce(sink_leaf.grad, group=group)
    kw = dict(causal=case.causal, scale=case.scale, softcap=softcap)
    if dtype == torch.bfloat16:  # rule R against the fp64 oracle, with the eager bf16 baseline
        gold_l = [t.detach().double().requires_grad_() for t in (q, k, v)]
        base_l = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        gold_s = None if sinks is None else sinks.clone().requires_grad_()
        base_s = None if sinks is None else sinks.to(dtype).requires_grad_()
        gold = attnkit.attention_reference(*gold_l, mask, sinks=gold_s, **kw)
        base = base_attention(*base_l, mask, sinks=base_s, **kw)
        gold.backward(dout)
        base.backward(dout.to(dtype))
        for name, o, b, g in zip(names, ours, [base] + [t.grad for t in base_l], [gold] + [t.grad for t in gold_l]):
            rule_r(o, _shard(b, case, rank), _shard(g, case, rank), factor=3.0 if name == "dq" else 2.0, what=name)
        if sinks is not None:
            rule_r(sink_leaf.grad, base_s.grad, gold_s.grad, factor=3.0, what="dsinks", n_terms=B * case.S)
        return
    ref_l = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_s = None if sinks is None else sinks.to(dtype).requires_grad_()
    ref = attnkit.attention(*ref_l, mask, sinks=ref_s, **kw)
    ref.backward(dout.to(dtype))
    for name, o, r in zip(names, ours, [ref] + [t.grad for t in ref_l]):
        _check(o, _shard(r, case, rank), name)
    if sinks is not None:
        _check(sink_leaf.grad, ref_s.grad, "dsinks")
    if case.mask == "keypad_empty":  # the zero-output contract, exactly
        for name, o in zip(names, ours):
            if name in ("out", "dq"):
                assert (o[0] == 0).all(), f"{name}: rows with nothing to attend to must be exactly 0"


def _run_padding(case: Case, group, rank: int):
    """Uneven length S: pad to a multiple the sharding accepts, mask the padding, drop it after."""
    seed = stable_seed(case.id)
    B, S = 2, case.S
    Sp = padded_length(S, case.world, case.sharding)
    q, k, v = make_qkv(B, case.hq, case.hkv, S, S, case.D, seed=seed)
    with pytest.raises(ValueError, match="not a multiple"):
        _shard(q, case, rank)
    dout = torch.randn(B, case.hq, S, case.D, generator=torch.Generator().manual_seed(seed))
    pad = lambda t: F.pad(t, (0, 0, 0, Sp - S))  # noqa: E731
    leaves = [_shard(pad(t), case, rank).detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, causal=case.causal, mask=M.KeyPadding(torch.tensor([S, S])), group=group,
                         sharding=case.sharding)
    out.backward(_shard(pad(dout), case, rank))  # padded queries get no upstream gradient
    ref_l = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*ref_l, causal=case.causal)
    ref.backward(dout)
    gathered = [gather_sequence(t, 2, group=group, sharding=case.sharding) for t in [out] + [t.grad for t in leaves]]
    for name, g, r in zip(["out", "dq", "dk", "dv"], gathered, [ref] + [t.grad for t in ref_l]):
        assert g.shape[2] == Sp
        _check(g[:, :, :S], r, name)
        if name in ("dk", "dv"):
            assert (g[:, :, S:] == 0).all(), f"{name}: padded keys must get zero gradient"


def _build_module(case: Case, seed: int):
    torch.manual_seed(seed)
    E = case.hq * case.D
    rope = None
    kw = {}
    if "modifiers" in case.variant:  # Gemma 2 / gpt-oss style: a query scalar, capped scores, sinks, a window
        kw = dict(scale=0.2, softcap=1.5, sinks=True, qk_norm=True, window=5)
    if "alibi" in case.variant:
        kw.update(alibi=True)
    if "fused" in case.variant:
        kw.update(fused_qkv=True)
    if "dynamic" in case.variant:
        rope = RotaryEmbedding(case.D, max_position_embeddings=6, scaling={"rope_type": "dynamic", "factor": 2.0})
    elif "norope" not in case.variant:
        rope = RotaryEmbedding(case.D)
    m = attnkit.MultiHeadAttention(E, case.hq, num_kv_heads=case.hkv, causal=case.causal, rope=rope,
                                   bias=True, batch_first="seqfirst" not in case.variant, **kw).eval()
    with torch.no_grad():  # non-trivial sinks and norms (they start at zeros and ones)
        for name, p in m.named_parameters():
            if name == "sinks" or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return m


def _run_module(case: Case, group, rank: int):
    seed = stable_seed(case.id)
    B = 2
    full = _build_module(case, seed)
    cp_inner = _build_module(case, seed)
    cp = ContextParallel(cp_inner, group=group, sharding=case.sharding)
    E = case.hq * case.D
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, case.S, E, generator=g)
    dy = torch.randn(B, case.S, E, generator=g)
    mask = _make_mask(case.mask, B, case.S, case.S, seed)
    seq_first = "seqfirst" in case.variant
    xf = (x.transpose(0, 1) if seq_first else x).clone().requires_grad_()
    yf = full(xf, mask=mask)
    yf.backward(dy.transpose(0, 1) if seq_first else dy)
    sdim = 0 if seq_first else 1
    xl = _shard(xf.detach(), case, rank, sdim).requires_grad_()
    yl = cp(xl, mask=mask)
    yl.backward(_shard(dy.transpose(0, 1) if seq_first else dy, case, rank, sdim))
    _check(yl, _shard(yf, case, rank, sdim), "out")
    _check(xl.grad, _shard(xf.grad, case, rank, sdim), "dx")
    cp.all_reduce_grads()
    for (name, p), (_, pf) in zip(cp_inner.named_parameters(), full.named_parameters()):
        _check(p.grad, pf.grad, f"grad of {name}")


def _run_error(case: Case, group, rank: int):
    q, k, v = make_qkv(2, 4, 2, 4 * case.world, 4 * case.world, 8, seed=1)
    sh = lambda t: _shard(t, case, rank)  # noqa: E731
    if case.variant == "uneven":  # rank 0 holds a longer shard than the others
        extra = 2 if rank == 0 else 0
        ql, kl, vl = (torch.randn(2, t.shape[1], 4 + extra, 8) for t in (q, k, v))
        with pytest.raises(ValueError, match="disagrees with other ranks"):
            ring_attention(ql, kl, vl, group=group)
    elif case.variant == "odd-zigzag":  # odd local length cannot be two zigzag chunks
        ql, kl, vl = (torch.randn(2, t.shape[1], 3, 8) for t in (q, k, v))
        with pytest.raises(ValueError, match="must be even"):
            ring_attention(ql, kl, vl, group=group, sharding="zigzag")
    elif case.variant == "additive":
        with pytest.raises(TypeError, match="additive"):
            ring_attention(sh(q), sh(k), sh(v), mask=torch.zeros(4 * case.world, 4 * case.world), group=group)
    elif case.variant == "bad-sharding":
        with pytest.raises(ValueError, match="sharding must be one of"):
            ring_attention(sh(q), sh(k), sh(v), group=group, sharding="striped")
    else:
        raise ValueError(case.variant)
    # The group is still usable after a refused call.
    out = ring_attention(sh(q), sh(k), sh(v), causal=True, group=group)
    _check(out, sh(attnkit.attention(q, k, v, causal=True)), "out after errors")


def _peak_new_bytes(fn) -> int:
    """Largest total size of the tensor storages torch ops create while ``fn`` runs (alive at once)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live, state = {}, {"now": 0, "peak": 0}

    def free(key):
        state["now"] -= live.pop(key, 0)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    st = t.untyped_storage()
                    key, n = st.data_ptr(), st.nbytes()
                    if n and key not in live:
                        live[key] = n
                        state["now"] += n
                        state["peak"] = max(state["peak"], state["now"])
                        weakref.finalize(st, free, key)
            return out

    with Mode():
        fn()
    return state["peak"]


def _run_memory(case: Case, group, rank: int):
    """The ring's buffers, counted in shards: besides its inputs (q, k, v, dout) a rank holds at
    most out, dq, two K/V blocks and one dK/dV accumulator (computing), or one K/V block and two
    accumulators (the dK/dV hop): 8 shards, plus per-row statistics and (forced tiny) score tiles.
    The backward that kept the accumulator being filled, the one in flight and the one arriving
    needed 12 (10 at P=2)."""
    seed = stable_seed(case.id)
    q, k, v = make_qkv(1, case.hq, case.hkv, case.S, case.S, case.D, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [_shard(t, case, rank).contiguous().requires_grad_() for t in (q, k, v)]
    dout_l = _shard(dout, case, rank).contiguous()
    shard = leaves[0].numel() * leaves[0].element_size()
    old_tile = ring_mod._TILE_ELEMENTS
    ring_mod._TILE_ELEMENTS = case.tile
    try:
        dist.barrier(group=group)
        peak = _peak_new_bytes(lambda: torch.autograd.grad(
            ring_attention(*leaves, causal=case.causal, group=group, sharding=case.sharding), leaves, dout_l))
    finally:
        ring_mod._TILE_ELEMENTS = old_tile
    # Fused (CPU flash) tiles hold their dq, dk, dv (and, with grouped heads, K/V expanded per
    # head): at most 5 tile-rows per shard row of it; with the forced tiny tiles that is visible.
    side = max(1, math.isqrt(case.tile // case.hq))
    allowance = 8.25 + 5 * side / (case.S // dist.get_world_size(group))
    assert peak <= allowance * shard, f"peak {peak / shard:.2f} shards besides the inputs, want <= {allowance:.2f}"
    assert peak >= 8 * shard, f"peak {peak / shard:.2f} shards: the tracker missed buffers?"


RUNNERS = {"attn": _run_attn, "padding": _run_padding, "module": _run_module, "error": _run_error,
           "memory": _run_memory}


def _run_cases(cases, group, rank, results):
    for case in cases:
        try:
            RUNNERS[case.kind](case, group, rank)
            results[case.id] = None
        except Exception:  # recorded, reported by the case's own test
            results[case.id] = traceback.format_exc(limit=6)


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results: dict[str, str | None] = {}
    try:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        singles = [dist.new_group([r]) for r in range(world)]
        _run_cases(P4_CASES, None, rank, results)
        pair = rank // 2
        _run_cases(P2_CASES[pair::2], pairs[pair], rank % 2, results)
        _run_cases(P1_CASES[rank::world], singles[rank], 0, results)
        dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ring")
    mp.start_processes(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, start_method="spawn")
    merged: dict[str, list[str]] = {}
    for r in range(WORLD):
        for cid, err in json.loads((d / f"rank{r}.json").read_text()).items():
            merged.setdefault(cid, [])
            if err is not None:
                merged[cid].append(f"rank {r}:\n{err}")
    return merged


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_ring_case(ring_results, case):
    assert case.id in ring_results, f"case {case.id} was not run"
    errors = ring_results[case.id]
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_merge_and_backward_equal_full_attention(hq, hkv, dtype):
    """Split the keys into uneven blocks with a causal + padding mask: merged forward and summed
    block backward equal attnkit.attention and its autograd gradients."""
    B, S, D, Dv = 2, 11, 5, 3
    q, k, v = make_qkv(B, hq, hkv, S, S, D, Dv, dtype=dtype, seed=stable_seed(hq, hkv, str(dtype)))
    m = M.Causal() & M.KeyPadding(torch.tensor([0, 9]))  # batch 0: no keys at all
    allowed = m.materialize(B, S, S)
    scale = 0.7
    ref_l = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*ref_l, m, scale=scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    edges = [0, 2, 7, 11]
    out = torch.zeros(B, hq, S, Dv, dtype=dtype)
    lse = torch.full((B, hq, S), float("-inf"), dtype=dtype)
    for a, b in zip(edges, edges[1:]):
        bo, bl = block_forward(q, k[:, :, a:b], v[:, :, a:b], allowed[..., a:b], scale)
        assert bo.dtype == dtype and bl.shape == (B, hq, S)
        out, lse = merge_partials(out, lse, bo, bl)
    torch.testing.assert_close(out, ref.detach())
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    delta = softmax_delta(out, dout)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    dk_acc, dv_acc = torch.zeros_like(k), torch.zeros_like(v)  # in-place accumulation into slices
    for a, b in zip(edges, edges[1:]):
        gq, gk, gv = block_backward(q, k[:, :, a:b], v[:, :, a:b], dout, lse, delta, allowed[..., a:b], scale)
        dq += gq
        dks.append(gk)
        dvs.append(gv)
        for _ in range(2):  # twice: accumulation adds
            _, rk, rv = block_backward(q, k[:, :, a:b], v[:, :, a:b], dout, lse, delta, allowed[..., a:b], scale,
                                       dk_out=dk_acc[:, :, a:b], dv_out=dv_acc[:, :, a:b])
            assert rk.data_ptr() == dk_acc[:, :, a:b].data_ptr() and rv.data_ptr() == dv_acc[:, :, a:b].data_ptr()
    for got, want in ((dq, ref_l[0].grad), (torch.cat(dks, 2), ref_l[1].grad), (torch.cat(dvs, 2), ref_l[2].grad),
                      (dk_acc / 2, ref_l[1].grad), (dv_acc / 2, ref_l[2].grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="dk_out must be"):
        block_backward(q, k, v, dout, lse, delta, allowed, scale, dk_out=torch.zeros(1))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_block_backward_accumulates_dq_in_place(hq, hkv):
    """dq_out: a contiguous buffer, row slices of one (what the ring passes: one baddbmm, or one
    per query-head group for GQA) and a layout no view can batch (through a temporary) all get
    the block's dq added, and are returned."""
    B, S, D, scale = 2, 12, 5, 0.6
    q, k, v = make_qkv(B, hq, hkv, S, S, D, seed=stable_seed("dq_out", hq, hkv))
    allowed = M.Causal().materialize(B, S, S)
    out, lse = block_forward(q, k, v, allowed, scale)
    dout = torch.randn_like(out)
    delta = softmax_delta(out, dout)
    dq_ref, dk_ref, dv_ref = block_backward(q, k, v, dout, lse, delta, allowed, scale)
    rows = [(0, 5), (5, 12)]
    for layout in ("contiguous", "row slices", "seq-major"):
        buf = torch.ones(B, S, hq, D).transpose(1, 2) if layout == "seq-major" else torch.ones(B, hq, S, D)
        parts = rows if layout == "row slices" else [(0, S)]
        for a, b in parts:
            got = block_backward(q[:, :, a:b], k, v, dout[:, :, a:b], lse[:, :, a:b], delta[:, :, a:b],
                                 allowed[:, :, a:b], scale, dq_out=buf[:, :, a:b])[0]
            assert got.data_ptr() == buf[:, :, a:b].data_ptr()
        torch.testing.assert_close(buf, dq_ref + 1, msg=lambda m: f"{layout}: {m}")
    with pytest.raises(ValueError, match="dq_out must be"):
        block_backward(q, k, v, dout, lse, delta, allowed, scale, dq_out=torch.zeros(B, hq, S, D + 1))
    empty = torch.ones(0, hq, S, D)
    assert block_backward(q[:0], k[:0], v[:0], dout[:0], lse[:0], delta[:0], None, scale, dq_out=empty)[0] is empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_delta_in_slabs_equals_rowsum(dtype):
    """Large inputs go a slab of rows at a time (rows not a multiple of the slab: a short last one)."""
    g = torch.Generator().manual_seed(5)
    out, dout = (torch.randn(1, 4, 4100, 64, generator=g).to(dtype) for _ in range(2))
    assert out.numel() > 1 << 20
    delta = softmax_delta(out, dout)
    assert delta.dtype == torch.float32 and delta.shape == (1, 4, 4100)
    torch.testing.assert_close(delta, (dout.float() * out.float()).sum(-1))


def test_block_forward_bf16_meets_rule_r():
    q, k, v = make_qkv(1, 4, 2, 9, 13, 16, dtype=torch.bfloat16, seed=3)
    out, lse = block_forward(q, k, v, None, 0.25)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    gold = attnkit.attention_reference(q, k, v, scale=0.25)
    rule_r(out.to(torch.bfloat16), base_attention(q, k, v, scale=0.25), gold)
    torch.testing.assert_close(lse, torch.logsumexp(
        (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.25, -1).float())


MASKS_AT = {
    "causal": lambda S: M.Causal(),
    "causal_top_left_cross": lambda S: M.Causal("top_left"),
    "causal_offsets": lambda S: M.Causal(q_start=torch.tensor([0, 3])),
    "window2": lambda S: M.SlidingWindow(2, 1),
    "keypad_valid": lambda S: M.KeyPadding(valid=torch.rand(2, S + 3, generator=torch.Generator().manual_seed(0)) < .5),
    "keypad_left": lambda S: M.KeyPadding(torch.tensor([4, 9]), side="left"),
    "querypad": lambda S: M.QueryPadding(torch.tensor([3, S])),
    "document": lambda S: M.Document(torch.tensor([[2, 5, 3], [4, 4, 0]]),
                                     kv_lengths=torch.tensor([[3, 5, 2], [1, 6, 5]])),
    "prefix": lambda S: M.PrefixLM(torch.tensor([2, 6])),
    "dense_heads": lambda S: M.Dense(torch.rand(2, 3, S, S + 3, generator=torch.Generator().manual_seed(1)) < .5),
    "and_or": lambda S: (M.Causal() & M.KeyPadding(torch.tensor([7, 12]))) | M.Document(torch.tensor([3, 3, 4])),
}


@pytest.mark.parametrize("name", list(MASKS_AT))
def test_mask_at_equals_materialized_mask_at_those_indices(name):
    S, Sk = 10, 13
    m = MASKS_AT[name](S)
    full = m.materialize(2, S, Sk).expand(2, 3, S, Sk)
    qi, ki = torch.tensor([7, 0, 1, 8, 9]), torch.tensor([12, 3, 4, 5, 0, 11])
    got = mask_at(m, qi, ki, batch=2, heads=3, q_len=S, kv_len=Sk)
    assert got.dim() == 4
    assert torch.equal(got.expand(2, 3, 5, 6), full[:, :, qi][..., ki])


def test_mask_at_refuses_additive_and_scalar_only_masks():
    with pytest.raises(TypeError, match="additive"):
        mask_at(M.Additive(torch.zeros(4, 4)), torch.arange(2), torch.arange(2), batch=1, heads=1, q_len=4, kv_len=4)

    class ScalarOnly(M.Mask):
        def mask_mod(self, q_len, kv_len, device=None):
            return lambda b, h, q, kv: bool(q >= kv)  # Python control flow: scalars only

    with pytest.raises(TypeError, match="elementwise tensor ops"):
        mask_at(ScalarOnly(), torch.arange(2), torch.arange(2), batch=1, heads=1, q_len=4, kv_len=4)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip_and_positions(sharding, world):
    S = 4 * world
    x = torch.arange(2 * S * 3).reshape(2, S, 3)
    shards = [shard_sequence(x, 1, rank=r, world_size=world, sharding=sharding) for r in range(world)]
    assert all(s.shape == (2, S // world, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, 1, sharding=sharding), x)
    pos = [shard_positions(S, r, world, sharding) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(S))
    for r in range(world):
        assert torch.equal(shards[r], x[:, pos[r]])
    if sharding == "zigzag" and world == 2:
        assert pos[0].tolist() == [0, 1, 6, 7] and pos[1].tolist() == [2, 3, 4, 5]


def _work(world, rank, sharding, S=64, mask=None):
    m = M.Causal() if mask is None else mask
    plan = ring_mod._Plan(m, rank=rank, world=world, sharding=sharding, batch=1, heads=1,
                          q_local=S // world, kv_local=S // world, head_dim=8, device=torch.device("cpu"))
    plan.side = 2  # small tiles, so skipping is visible inside blocks
    area = 0
    for src in range(world):
        for qs, ks, allowed, causal, _ in plan.tiles(src):
            area += (qs.stop - qs.start) * (ks.stop - ks.start)
    return area


def test_zigzag_balances_causal_work_and_skips_masked_tiles():
    world, S = 4, 64
    zig = [_work(world, r, "zigzag", S) for r in range(world)]
    cont = [_work(world, r, "contiguous", S) for r in range(world)]
    assert len(set(zig)) == 1, zig  # every rank computes the same number of scores
    assert cont[-1] > 3 * cont[0], cont  # the last contiguous rank sees every earlier token
    # Skipping keeps the work near the causal S(S+1)/2 scores, not S^2 (tiles are 2 rows by one
    # chunk, so diagonal tiles are computed whole).
    for total in (sum(zig), sum(cont)):
        assert S * (S + 1) // 2 <= total <= 0.65 * S * S, (zig, cont)


def test_padded_length_and_uneven_shard_errors():
    assert padded_length(13, 2, "zigzag") == 16 and padded_length(13, 2, "contiguous") == 14
    assert padded_length(16, 4, "zigzag") == 16
    with pytest.raises(ValueError, match="not a multiple of 4"):
        shard_sequence(torch.zeros(1, 1, 10, 2), 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="sharding must be one of"):
        shard_positions(8, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank"):
        shard_positions(8, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 6)], 1)
    with pytest.raises(ValueError, match="pass both rank and world_size"):
        shard_sequence(torch.zeros(4), 0, rank=0)


def test_ring_attention_without_process_group_says_so():
    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        pytest.skip("a process group is initialized in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_sequence(q, 2)


def test_context_parallel_rejects_what_it_cannot_run():
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        ContextParallel(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="self-attention"):
        ContextParallel(attnkit.MultiHeadAttention(16, 2, kdim=8))
    with pytest.raises(ValueError, match="sharding"):
        ContextParallel(attnkit.MultiHeadAttention(16, 2), sharding="striped")
    cp = ContextParallel(attnkit.MultiHeadAttention(16, 2, dropout=0.1))
    with pytest.raises(ValueError, match="dropout"):
        cp(torch.randn(1, 4, 16))


def test_block_primitives_take_an_empty_batch():
    from attnkit.distributed.blocks import block_backward, block_forward
    q, k, v = torch.randn(0, 4, 16, 8), torch.randn(0, 2, 16, 8), torch.randn(0, 2, 16, 8)
    out, lse = block_forward(q, k, v, None, 0.3)
    assert out.shape == (0, 4, 16, 8) and lse.shape == (0, 4, 16)
    dq, dk, dv = block_backward(q, k, v, out, lse, lse, None, 0.3)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_merge_partials_differentiates_through_empty_rows():
    """Rows where both partials saw nothing (lse -inf twice) stay 0 / -inf, and autograd through
    the public primitive gives zero gradients there, not NaN; other rows match logaddexp."""
    out = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    bo = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    inf = float("-inf")
    lse = torch.tensor([[0.5, inf, inf], [1.0, -2.0, inf]], dtype=torch.float64, requires_grad=True)
    bl = torch.tensor([[inf, 0.3, inf], [0.2, 1.5, inf]], dtype=torch.float64, requires_grad=True)
    m, new = merge_partials(out, lse, bo, bl)
    assert torch.isneginf(new[0, 2]) and torch.isneginf(new[1, 2])
    torch.testing.assert_close(new[1, :2], torch.logaddexp(lse[1, :2], bl[1, :2]))
    (m.sum() + torch.where(torch.isneginf(new), 0.0, new).sum()).backward()
    for t in (out, bo, lse, bl):
        assert torch.isfinite(t.grad).all()
    assert (lse.grad[:, 2] == 0).all() and (out.grad[:, 2] == 0).all()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_cpu_tiles_equal_the_matmul_path(hq, hkv, causal, monkeypatch):
    """Whole (and causal diagonal) tiles on CPU go through torch's fused flash ops; forward,
    merge and backward give what the matmul path gives."""
    from attnkit.distributed import blocks as B_
    q, k, v = make_qkv(2, hq, hkv, 24, 24, 16, seed=stable_seed("fused", hq, hkv, causal))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(B_, "_FUSED", None)
        with torch.no_grad():
            out, lse = block_forward(q, k, v, None, 0.3, causal=causal)
            delta = softmax_delta(out, dout)
            dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
            block_backward(q, k, v, dout, lse, delta, None, 0.3, dq_out=dq, dk_out=dk, dv_out=dv, causal=causal,
                           out=out)
        results.append((out, lse, dq, dk, dv))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    ref = attnkit.attention(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(results[0][0], ref)
