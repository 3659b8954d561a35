"""Attention over a paged KV cache in plain torch (any device; tuned for CPU), reading the pages
where they are: no (B, max_len) copy of the cache is ever made.

Notation: B batch rows, Hq / Hkv query / KV heads, G = Hq // Hkv, S queries per sequence this
step, M = G * S query rows per KV head, D / Dv head dims, N * bs pool rows (one per token slot:
the pool (N, bs, Hkv, D) viewed as (N * bs, Hkv, D)). Query j of sequence b sits at position
``old[b] + j`` and sees the keys at positions ``< lim[b, j] = min(old[b] + j + 1, new[b])``
(exactly the cache protocol's ``Causal(offsets=old) & KeyPadding(new)``).

A sequence's keys lie in *runs* of consecutive blocks. In the (N * bs, Hkv, D) layout a run is
one strided matrix per head, so it needs no copy. Small-S steps (decode, speculative
verification; S <= 16) therefore split the keys into

* *view pieces*: runs of at least ``min_view_rows`` tokens (split at ``max_piece_rows``), each
  one batched GEMM over the KV heads, ``(Hkv, M, D) @ (Hkv, D, n)``, on the pool itself (every KV
  head read once for its whole query group);
* *groups*: the short runs (a fragmented tail, block size 1, short sequences), packed per
  sequence into a padded (Ng, Lg) table of pool rows and gathered a few MiB at a time (the copy
  stays in cache) for one bmm per KV head, so a fragmented table costs a few ops per chunk, not
  one per block;

spread over threads like the ``decode`` backend (disjoint units, intra-op threads set to 1).
Every part yields per-row (max, sum of exp, unnormalised P @ V), merged per sequence with the
exact log-sum-exp rule (flash-decoding). Why not one batched matmul over every live block? On a
CPU decode is memory-bound: gathering all blocks first reads and writes the cache once more, and
per-block GEMMs of (M x D) @ (D x bs) are too small to run at speed; reading long runs in place
moves each byte once.

Longer steps (chunked prefill) are compute-bound: each sequence's keys (a view when it is one
run, otherwise that sequence's rows gathered) go through :func:`attnkit.attention` with its own
causal offset, so the tiled backends do the work.

Softmax and both matmuls run in fp32 (fp64 for fp64); fp16/bf16 pieces are converted to fp32 in
per-thread scratch buffers. A row with no visible key is exactly 0: its max is clamped to a
finite value so ``exp`` gives 0, and the merged denominator is clamped to >= 1 (a row with any
visible key has denominator >= 1: its largest score contributes exp(0)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._threads import at_fork, run_split
from ..backends.decode import MAX_DECODE_Q_LEN
from ..functional import attention
from ..masks import Causal

__all__ = ["Plan", "build_plan", "paged_attention", "piece_sizes"]

#: A run with fewer K+V bytes than this is gathered into the group pass: one more view piece
#: costs a handful of ops (~50-100 us), about the time to gather 128 KiB here.
VIEW_MIN_BYTES = 128 << 10
#: Longest view piece (rows); long runs are split so threads get balanced work.
PIECE_MAX_ROWS = 4096
#: fp32 bytes of one piece's scores (Hkv, M, n), and of one converted fp16/bf16 K piece.
PIECE_MAX_SCORE_BYTES = 4 << 20
PIECE_MAX_CONVERT_BYTES = 2 << 20
#: Longest group (rows) in the batched pass; bounds the padding of the (Ng, Lg) tensor.
GROUP_MAX_ROWS = 512
#: K+V elements gathered per unit of groups (8 MiB of fp32 K+V at a time: the copy stays in cache).
GROUP_CHUNK_ELEMS = 1 << 21
# Below this many K+V elements a thread pool costs more than it saves.
_MIN_ELEMS_PER_THREAD = 1 << 18
# Position given to padding rows of a group: no query sees it.
_FAR = 1 << 62


def piece_sizes(token_bytes: int, kv_heads: int, head_dim: int, q_rows: int, convert: bool) -> tuple[int, int, int]:
    """(min_view_rows, max_piece_rows, group_rows) for a layer whose token takes ``token_bytes``
    (K and V) and whose score rows per KV head are ``q_rows`` (M)."""
    min_view = max(1, min(1024, VIEW_MIN_BYTES // max(1, token_bytes)))
    budget = PIECE_MAX_SCORE_BYTES // (4 * kv_heads * max(1, q_rows))
    if convert:
        budget = min(budget, PIECE_MAX_CONVERT_BYTES // (4 * kv_heads * head_dim))
    max_piece = min(PIECE_MAX_ROWS, max(budget, 64))
    return min_view, max_piece, GROUP_MAX_ROWS


@dataclass
class Plan:
    """Where each sequence's keys are, for one step (shared by every layer of the step).

    ``views``: (b, first pool row, rows, first position) of the zero-copy pieces.
    ``grp_rows`` / ``grp_pos``: (Ng, Lg) pool rows and positions of the gathered groups
    (padding: row 0, a position no query sees); ``grp_seq`` (Ng,) their sequences.
    ``lim`` (B, S): query j of sequence b sees positions ``< lim[b, j]``.
    """

    B: int
    S: int
    old: list[int]
    new: list[int]
    lim: Tensor
    lim0: list[int] = field(default_factory=list)
    views: list[tuple[int, int, int, int]] = field(default_factory=list)
    grp_rows: Tensor | None = None
    grp_pos: Tensor | None = None
    grp_seq: Tensor | None = None
    runs: list[list[tuple[int, int]]] = field(default_factory=list)
    block_size: int = 1


def _expand(starts: list[int], counts: list[int], device) -> Tensor:
    """Concatenation of ``range(starts[i], starts[i] + counts[i])`` as one long tensor."""
    s = torch.tensor(starts, dtype=torch.long, device=device)
    c = torch.tensor(counts, dtype=torch.long, device=device)
    total = int(sum(counts))
    begin = torch.cumsum(c, 0) - c  # where each range starts in the output
    return torch.repeat_interleave(s - begin, c, output_size=total) + torch.arange(total, device=device)


def build_plan(runs: list[list[tuple[int, int]]], old: list[int], new: list[int], S: int, block_size: int, *,
               min_view_rows: int, max_piece_rows: int, group_rows: int, device) -> Plan:
    """Split each sequence's runs ``[(first block, blocks), ...]`` (in position order) into view
    pieces and padded groups."""
    B, bs = len(new), block_size
    old_t = torch.tensor(old, dtype=torch.long, device=device)
    new_t = torch.tensor(new, dtype=torch.long, device=device)
    lim = torch.minimum(old_t[:, None] + torch.arange(1, S + 1, device=device), new_t[:, None])
    plan = Plan(B, S, old, new, lim, [min(o + 1, n) for o, n in zip(old, new)], runs=runs, block_size=bs)
    short: list[tuple[int, int, int, int]] = []  # (b, first row, rows, first position)
    for b, (rs, n_tok) in enumerate(zip(runs, new)):
        pos = 0
        for blk0, cnt in rs:
            if pos >= n_tok:
                break
            n, r0 = min(cnt * bs, n_tok - pos), blk0 * bs
            if n >= min_view_rows:
                for off in range(0, n, max_piece_rows):
                    plan.views.append((b, r0 + off, min(max_piece_rows, n - off), pos + off))
            else:
                for off in range(0, n, group_rows):
                    short.append((b, r0 + off, min(group_rows, n - off), pos + off))
            pos += cnt * bs
    if short:
        # Pack each sequence's short runs (cut at group_rows) into groups of <= group_rows rows.
        grp_of, slot_of, fill, seqs = [], [], [], []
        for b, _, n, _ in short:
            if not seqs or seqs[-1] != b or fill[-1] + n > group_rows:
                seqs.append(b)
                fill.append(0)
            grp_of.append(len(seqs) - 1)
            slot_of.append(fill[-1])
            fill[-1] += n
        Ng, Lg = len(seqs), max(fill)
        counts = [n for _, _, n, _ in short]
        rows = _expand([r0 for _, r0, _, _ in short], counts, device)
        pos = _expand([p for _, _, _, p in short], counts, device)
        dest = _expand([g * Lg + s for g, s in zip(grp_of, slot_of)], counts, device)
        grid = torch.zeros(Ng * Lg, dtype=torch.long, device=device)
        plan.grp_rows = grid.index_copy_(0, dest, rows).view(Ng, Lg)
        plan.grp_pos = torch.full_like(grid, _FAR).index_copy_(0, dest, pos).view(Ng, Lg)
        plan.grp_seq = torch.tensor(seqs, dtype=torch.long, device=device)
    return plan


def sequence_rows(plan: Plan, b: int) -> tuple[int, int] | Tensor:
    """Pool rows of sequence b's keys: (first row, rows) when they are one run, else a tensor."""
    n, bs = plan.new[b], plan.block_size
    starts, counts, pos = [], [], 0
    for blk0, cnt in plan.runs[b]:
        if pos >= n:
            break
        starts.append(blk0 * bs)
        counts.append(min(cnt * bs, n - pos))
        pos += cnt * bs
    if len(starts) == 1:
        return starts[0], counts[0]
    return _expand(starts, counts, plan.lim.device)


# --------------------------------------------------------------------------- workspaces

_workspaces: dict[tuple[int, str], Tensor] = {}  # per worker slot (see attnkit._threads)
at_fork(_workspaces.clear)
# Larger scratch is allocated per call (its page faults are small next to the work it serves)
# rather than kept alive between calls.
_WORKSPACE_MAX_BYTES = 32 << 20


def _workspace(slot: int | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """A scratch tensor, reused per (thread slot, name) on CPU (fresh large allocations
    page-fault on every call); made outside inference mode so it works in and out of it.
    ``slot=None``: a fresh tensor."""
    numel = math.prod(shape)
    if slot is None or numel * dtype.itemsize > _WORKSPACE_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = _workspaces.get((slot, name))
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        grown = numel if buf is None or buf.dtype != dtype else max(numel, buf.numel() * 3 // 2)  # a step at a time
        with torch.inference_mode(False):
            buf = torch.empty(grown, dtype=dtype)
        _workspaces[(slot, name)] = buf
    return buf[:numel].view(shape)


# --------------------------------------------------------------------------- small-S path


@dataclass
class _Work:
    """What every unit of a small-S call reads and where it writes its (max, sum, P@V) rows."""

    plan: Plan
    qg: Tensor  # (B, Hkv, M, D) scaled queries in the compute dtype
    kf: Tensor
    vf: Tensor | None  # None: V is K's first Dv channels
    G: int
    S: int
    Dv: int
    m: Tensor  # (P, Hkv, M): parts = view pieces, then groups
    sums: Tensor  # (P, Hkv, M)
    acc: Tensor  # (P, Hkv, M, Dv)
    n_views: int
    group_chunk: int  # groups per unit


def _view_piece(w: _Work, i: int, slot: int | None) -> None:
    """View piece i: scores, exp, P@V of one run slice for every KV head, read in place."""
    b, r0, n, p0 = w.plan.views[i]
    qg, ct = w.qg, w.qg.dtype
    Hkv, M, D = qg.shape[1:]
    dev = qg.device
    kseg = w.kf[r0:r0 + n]  # (n, Hkv, D), a view of the pool
    if kseg.dtype != ct:
        kseg = _workspace(slot, "k", (n, Hkv, D), ct, dev).copy_(kseg)
    s = _workspace(slot, "s", (Hkv, M, n), ct, dev)
    torch.matmul(qg[b], kseg.permute(1, 2, 0), out=s)  # (Hkv, M, n)
    if p0 + n > w.plan.lim0[b]:  # some key here comes after some query
        kpos = torch.arange(p0, p0 + n, device=dev)
        s.view(Hkv, w.G, w.S, n).masked_fill_(kpos[None, :] >= w.plan.lim[b][:, None], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(ct).min)  # all -inf -> finite: exp() gives 0
    s.sub_(m).exp_()
    w.m[i] = m.squeeze(-1)
    torch.sum(s, -1, out=w.sums[i])
    if w.vf is None:
        vseg = kseg[..., :w.Dv]
    else:
        vseg = w.vf[r0:r0 + n]
        if vseg.dtype != ct:
            vseg = _workspace(slot, "v", (n, Hkv, w.Dv), ct, dev).copy_(vseg)
    torch.matmul(s, vseg.permute(1, 0, 2), out=w.acc[i])  # (Hkv, M, Dv)


def _gather(pool: Tensor, idx: Tensor, ct: torch.dtype, slot: int | None, name: str) -> Tensor:
    """pool[idx] (len(idx), Hkv, ·) in ct, through reused scratch."""
    rows = pool.reshape(pool.shape[0], -1)  # row gathers are fastest on 2-D tensors
    shape = (idx.numel(), rows.shape[1])
    if pool.dtype == ct:
        out = torch.index_select(rows, 0, idx, out=_workspace(slot, name, shape, ct, pool.device))
    else:
        raw = torch.index_select(rows, 0, idx, out=_workspace(slot, name + "_raw", shape, pool.dtype, pool.device))
        out = _workspace(slot, name, shape, ct, pool.device).copy_(raw)
    return out.view(idx.numel(), *pool.shape[1:])


def _group_chunk(w: _Work, c: int, slot: int | None) -> None:
    """Groups [c * chunk, (c + 1) * chunk): gathered (a few MiB at a time, so the copy stays
    in cache), then one bmm per KV head."""
    plan, qg, ct = w.plan, w.qg, w.qg.dtype
    Hkv, M, D = qg.shape[1:]
    g0 = c * w.group_chunk
    g1 = min(g0 + w.group_chunk, plan.grp_rows.shape[0])
    ng, Lg, Dv = g1 - g0, plan.grp_rows.shape[1], w.Dv
    idx = plan.grp_rows[g0:g1].reshape(-1)
    seq = plan.grp_seq[g0:g1]
    kg = _gather(w.kf, idx, ct, slot, "gk").view(ng, Lg, Hkv, D)
    vg = kg[..., :Dv] if w.vf is None else _gather(w.vf, idx, ct, slot, "gv").view(ng, Lg, Hkv, Dv)
    qh = qg.index_select(0, seq)  # (ng, Hkv, M, D)
    # One bmm per KV head: kg[:, :, h] is (ng, Lg, D) with one batch stride, read in place
    # (a (ng, Hkv) batch would make matmul copy K into a head-major layout first).
    s = _workspace(slot, "gs", (Hkv, ng, M, Lg), ct, qg.device)
    for h in range(Hkv):
        torch.matmul(qh[:, h], kg[:, :, h].transpose(1, 2), out=s[h])
    hidden = plan.grp_pos[g0:g1, None, :] >= plan.lim.index_select(0, seq)[:, :, None]  # (ng, S, Lg)
    s.view(Hkv, ng, w.G, w.S, Lg).masked_fill_(hidden[None, :, None], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(ct).min)
    s.sub_(m).exp_()
    p = w.n_views + g0
    w.m[p:p + ng] = m.squeeze(-1).transpose(0, 1)
    w.sums[p:p + ng] = s.sum(-1).transpose(0, 1)
    acc = _workspace(slot, "gacc", (Hkv, ng, M, Dv), ct, qg.device)
    for h in range(Hkv):
        torch.matmul(s[h], vg[:, :, h], out=acc[h])
    w.acc[p:p + ng] = acc.transpose(0, 1)


def _run_units(w: _Work, units, slot: int | None, inference: bool) -> None:
    """Units ("v", piece) / ("g", chunk). Grad and inference modes are thread-local, so pool
    threads take the caller's."""
    with torch.inference_mode(inference), torch.no_grad():
        if slot is not None and slot > 0 and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # pool thread; the caller restores its own setting
        for kind, i, _ in units:
            (_view_piece if kind == "v" else _group_chunk)(w, i, slot)


def _small(q: Tensor, kf: Tensor, vf: Tensor | None, Dv: int, plan: Plan, scale: float) -> Tensor:
    """Decode / verification: long runs read in place, short runs gathered in chunks; every
    part's rows merged per sequence."""
    B, Hq, S, D = q.shape
    Hkv = kf.shape[1]
    G = Hq // Hkv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = (q.to(ct) * scale).reshape(B, Hkv, G * S, D)  # row g * S + j: query j of head (kv, g)
    M, n_views = G * S, len(plan.views)
    Ng, Lg = (0, 0) if plan.grp_rows is None else tuple(plan.grp_rows.shape)
    token_elems = Hkv * (D + (0 if vf is None else Dv))
    chunk = max(1, GROUP_CHUNK_ELEMS // max(1, Lg * token_elems))
    P = n_views + Ng
    w = _Work(plan, qg, kf, vf, G, S, Dv, torch.empty(P, Hkv, M, dtype=ct, device=q.device),
              torch.empty(P, Hkv, M, dtype=ct, device=q.device), torch.empty(P, Hkv, M, Dv, dtype=ct, device=q.device),
              n_views, chunk)
    units = [("v", i, v[2]) for i, v in enumerate(plan.views)]
    units += [("g", c, (min((c + 1) * chunk, Ng) - c * chunk) * Lg) for c in range(-(-Ng // chunk))]
    inference = torch.is_inference_mode_enabled()
    total = sum(u[2] for u in units) * token_elems
    T = min(torch.get_num_threads(), len(units), max(1, total // _MIN_ELEMS_PER_THREAD))
    if q.device.type != "cpu":
        _run_units(w, units, None, inference)
    else:  # reused scratch (slots) and threads while holding attnkit's pool; else one thread, fresh buffers
        per: list[list] = [[] for _ in range(T)]  # biggest unit first to the least loaded thread
        load = [0] * T
        for u in sorted(units, key=lambda u: -u[2]):
            t = load.index(min(load))
            per[t].append(u)
            load[t] += u[2]
        run_split(per, lambda part, slot: _run_units(w, part, slot, inference))
    seq = torch.tensor([v[0] for v in plan.views], dtype=torch.long, device=q.device)
    if Ng:
        seq = torch.cat([seq, plan.grp_seq])
    return _merge(q, seq, w.m, w.sums, w.acc, Dv)


def _merge(q: Tensor, seq: Tensor, m: Tensor, sums: Tensor, acc: Tensor, Dv: int) -> Tensor:
    """Exact log-sum-exp merge per sequence of the parts' row max m (P, Hkv, M), sums of exp
    and unnormalised P@V acc (P, Hkv, M, Dv); part p belongs to sequence seq[p]."""
    B, Hq, S, _ = q.shape
    ct = m.dtype
    if m.shape[0] == 0:  # no sequence has a visible key: the contract's zeros
        return q.new_zeros(B, Hq, S, Dv)
    Hkv, M = m.shape[1], m.shape[2]
    if m.shape[0] == B and bool((seq == torch.arange(B, device=seq.device)).all()):
        out = acc / sums.clamp_min_(1.0).unsqueeze(-1)  # one part per sequence: nothing to merge
    else:
        top = torch.full((B, Hkv, M), torch.finfo(ct).min, dtype=ct, device=m.device)
        top.scatter_reduce_(0, seq[:, None, None].expand_as(m), m, "amax")
        w = (m - top.index_select(0, seq)).exp_()  # (P, Hkv, M)
        den = torch.zeros(B, Hkv, M, dtype=ct, device=m.device).index_add_(0, seq, w * sums)
        num = torch.zeros(B, Hkv, M, Dv, dtype=ct, device=m.device).index_add_(0, seq, acc * w.unsqueeze(-1))
        out = num / den.clamp_min_(1.0).unsqueeze(-1)
    return out.view(B, Hq, S, Dv).to(q.dtype)


# --------------------------------------------------------------------------- entry point


def paged_attention(q: Tensor, kf: Tensor, vf: Tensor | None, plan: Plan, scale: float,
                    v_head_dim: int | None = None) -> Tensor:
    """Attention of q (B, Hq, S, D) over the paged keys described by ``plan``.

    kf: (N * bs, Hkv, D) the K pool viewed by token slot; vf: (N * bs, Hkv, Dv), or None when V
    is K's first ``v_head_dim`` channels (MLA's latent cache). Returns (B, Hq, S, Dv) in q's
    dtype; a query with no visible key gets exactly 0.
    """
    B, Hq, S, _ = q.shape
    Dv = vf.shape[-1] if vf is not None else v_head_dim
    if q.numel() == 0:
        return q.new_zeros(B, Hq, S, Dv)
    if S <= MAX_DECODE_Q_LEN:
        return _small(q, kf, vf, Dv, plan, scale)
    return _long(q, kf, vf, Dv, plan, scale)


def _long(q, kf, vf, Dv, plan, scale):
    """Chunked prefill: per sequence, its keys through :func:`attnkit.attention` with its offset."""
    B, Hq, S, _ = q.shape
    out = q.new_zeros(B, Hq, S, Dv)
    for b in range(B):
        n = plan.new[b]
        if n == 0:
            continue  # nothing to attend to: zeros
        where = sequence_rows(plan, b)
        if isinstance(where, tuple):
            r0, cnt = where
            kb = kf[r0:r0 + cnt]
            vb = kb[..., :Dv] if vf is None else vf[r0:r0 + cnt]
        else:
            kb = kf.index_select(0, where)
            vb = kb[..., :Dv] if vf is None else vf.index_select(0, where)
        old = plan.old[b]
        mask = Causal() if n - old == S else Causal(offsets=torch.tensor([old], device=q.device))
        out[b] = attention(q[b:b + 1], kb.permute(1, 0, 2)[None], vb.permute(1, 0, 2)[None], mask,
                           scale=scale)[0]
    return out
