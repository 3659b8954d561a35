"""A lean Triton decode kernel for absorbed MLA: many query heads over one latent KV head whose
V is the first ``Dv`` channels of K (DeepSeek: 128 heads, K rows ``[c_kv (512) | k_rope (64)]``).

It serves the plain calls of that layout, what :func:`takes` accepts: V from K over one KV head,
fp16 / bf16 queries and cache, a power-of-two latent width of 16..512 with 16, 32 or 64 rope
channels, the causal limits of decode and speculative verification or a selection every head
reads (DeepSeek-V3.2's top-k keys per query token), and no soft cap, ALiBi, window, sinks or
quantized cache. :func:`attnkit.backends.triton.kernel.launch` hands
every other call to the shared kernel (``kernel._attend``). Why a kernel of its own:

* **64 heads per program.** A program takes ``BLOCK_H`` = 64 of the ``G * S`` query rows of the
  latent head (fewer rows: the next power of two >= 16), so each latent tile is read once per
  64 heads instead of once per 32, and both dots have 64 rows: the smallest M of Hopper's
  warpgroup MMA (wgmma). The shared kernel's 64-row tiles spill registers once its modifiers are
  compiled in (``benchmarks/NOTES.md``); this body has none of them.
* **One latent tile, two uses.** The ``BLOCK_N x Dv`` latent tile is the score dot's K (through a
  transpose) and P @ V's V; the rope channels are a second, narrow score dot into the same scores.
* **Little per-key state.** The 64 x 512 fp32 accumulator takes half of a thread's registers at
  8 warps, so the rest is kept small: a key tile lies in one cache block (one table entry per
  tile, keys at consecutive slots: paged blocks of a power-of-two size, or a contiguous cache),
  channel tiles are exactly the data's widths (no channel masks), output offsets are a scalar base
  plus the tile's rows, and the accumulator is updated in place by the P @ V dot.

With a selection a program takes one query token's heads (they share its list) and walks the
window's keys, then the listed ones, gathering each key's row through the block table (any block
size), as the shared kernel's ``_select_kernel`` does; the splits cut the walk. The gathers hold
more addresses than a tile in one block: on sm_90 this variant spills a few hundred bytes
(``benchmarks/NOTES.md``), so ``bench_gpu.py`` times it beside the shared kernel.

Rows, limits and results are the shared kernel's: row ``g * S + j`` is query head ``g`` at query
token ``j``, which sees the keys at positions ``< min(q_start[b] + j + 1, lengths[b])``; a row that
sees nothing gets exactly 0; NaN in q or in a visible key reaches the rows that see it. The cache
is a paged pool ``(N, block_size, 1, D)`` read through a block table (a contiguous cache is one
block of L slots per sequence, as ``kernel.launch`` passes it); a table entry outside ``[0, N)`` is
never read and its keys count as masked; pool offsets are int64. Scores, softmax and accumulation
are fp32, P is rounded to q's dtype for P @ V. Splits follow the wave rule
(:func:`attnkit.backends.triton.plan.split_plan`) with one program per SM (a 64-row program fills
an SM's registers); several splits are merged by ``kernel.merge_splits``, one split writes the
output itself.

Launch parameters (``BLOCK_N``, ``num_warps``, ``num_stages``) come from :func:`config` unless the
tuned table (:mod:`attnkit.backends.triton.tuning`) has an entry for the GPU and this kernel's
shape key (``shape_key(..., latent=True)``). ``tests/test_triton_latent.py`` compiles the kernel
ahead of time for sm_80 and sm_90 and checks shared memory, register spills and wgmma.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import tuning
from .limits import interpreting
from .plan import split_plan

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: kernel.py reports it (available())
    triton = tl = None

__all__ = ["config", "launch", "takes"]

_LOG2E = 1.4426950408889634
#: Widest rope part (K channels past the latent) the kernel's second score dot takes.
MAX_ROPE = 64
#: Widest latent (Dv) the kernel's tiles are sized for.
MAX_LATENT = 512


def takes(q_dtype: torch.dtype, head_dim: int, v_head_dim: int, num_kv_heads: int, v_from_k: bool,
          block_size: int, max_len: int, *, quantized: bool = False, softcap: float = 0.0, alibi: bool = False,
          window: bool = False, sinks: bool = False, selection: bool = False, selection_lists: int = 1) -> bool:
    """Whether the lean latent kernel serves a decode call of this description (else the shared
    kernel does): V read from K over one KV head, fp16 / bf16 queries and cache; a power-of-two
    latent ``v_head_dim`` of 16..512 and 16, 32 or 64 rope channels past it (tiles exactly as wide
    as the data: no channel masks, which would keep the rope tile out of the load pipeline); cache
    blocks of a power-of-two size >= 16 tokens, or every key in one block (``max_len <=
    block_size``: a contiguous cache), so that a key tile lies in one block; and no soft cap, ALiBi,
    window or sinks. A selection (``selection``) is taken when every query head reads one list
    (``selection_lists`` 1: DeepSeek-V3.2's top-k keys), over cache blocks of any size (its tiles
    gather key by key). A pure function of the call, so the choice is tested on CPU."""
    rope = head_dim - v_head_dim
    one_block_tiles = max_len <= block_size or (block_size >= 16 and block_size & (block_size - 1) == 0)
    return (v_from_k and num_kv_heads == 1 and q_dtype in (torch.float16, torch.bfloat16) and not quantized
            and 16 <= v_head_dim <= MAX_LATENT and v_head_dim & (v_head_dim - 1) == 0
            and rope in (16, 32, MAX_ROPE) and (one_block_tiles or selection)
            and not (selection and selection_lists != 1)
            and not (softcap > 0 or alibi or window or sinks))


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def config(rows: int, head_dim: int, v_head_dim: int) -> dict:
    """Tiles for ``rows`` query rows (``G * S``): 64 rows per program when there are that many
    (wgmma's M), else the next power of two >= 16; keys per tile, warps and stages by the
    latent's width. A 64 x 512 fp32 accumulator over 8 warps is 128 registers of a thread's 255,
    which leaves room for a 16-key tile's scores but not a 32-key one's (ptxas spills: the
    ahead-of-time compile test checks it)."""
    wide = v_head_dim > 128
    return dict(BLOCK_H=64 if rows >= 64 else _pow2(rows), BLOCK_N=16 if wide else 64,
                num_warps=8 if wide else 4, num_stages=3)


#: The interpreter's stand-in for a GPU's SM count in the split rule (kernel._INTERPRETER_WAVE's).
_INTERPRETER_SMS = 4


if triton is not None:

    @triton.jit
    def _latent_kernel(
        Q, K, TABLE, QSTART, LENGTHS, OP, LSEP, OUT,
        scale_log2,
        stride_qb, stride_qh, stride_qs,
        stride_kn, stride_kt,
        stride_tb,
        G, S, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS,
        SEL_IDS, SEL_COUNTS, SEL_BOUNDS, stride_ib, stride_is, stride_cb, stride_cs, SEL_BLOCK,
        DIRECT: tl.constexpr, DOT_F32: tl.constexpr, SEL: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    ):
        pid_h = tl.program_id(1)
        pid_s = tl.program_id(2)
        if SEL:
            # One query token jq and BLOCK_H of its G heads, which all read the token's list: the
            # keys of [u_lo, u_hi) (a joined window), then the listed ones within [lo, hi) (the
            # host folded every limit into these bounds), each key once.
            b = tl.program_id(0) // S
            jq = tl.program_id(0) % S
            h = tl.minimum(pid_h * BLOCK_H + tl.arange(0, BLOCK_H), G - 1)  # past G: the last head again
            j = jq + 0 * h
            bounds = SEL_BOUNDS + (b * S + jq) * 4
            lo = tl.load(bounds)
            hi = tl.load(bounds + 1)
            u_lo = tl.load(bounds + 2)
            u_hi = tl.load(bounds + 3)
            u_len = u_hi - u_lo
            ids_row = SEL_IDS + b * stride_ib + jq * stride_is
            n_sel = tl.where(hi > lo, tl.load(SEL_COUNTS + b * stride_cb + jq * stride_cs), 0)
            start = pid_s * SPLIT_LEN
            end = tl.minimum(start + SPLIT_LEN, u_len + n_sel * SEL_BLOCK)  # this split of the walk
            n_rows = G  # this token's output rows (b, h, jq), S rows apart
            row_step = S
            first = (b.to(tl.int64) * G + pid_h * BLOCK_H) * S + jq
        else:
            b = tl.program_id(0)
            # row = g * S + j; the rows past G * S repeat the last one (read, never stored: no masks).
            rows = tl.minimum(pid_h * BLOCK_H + tl.arange(0, BLOCK_H), G * S - 1)
            j = rows % S
            h = rows // S
            length = tl.load(LENGTHS + b)
            start = pid_s * SPLIT_LEN
            end = tl.minimum(start + SPLIT_LEN, length)
            lim = tl.minimum(tl.load(QSTART + b) + j + 1, end)  # keys < lim are visible to the row (and in the split)
            n_rows = G * S  # output rows (b, h, j) in order
            row_step = 1
            first = b.to(tl.int64) * G * S + pid_h * BLOCK_H

        # q: the latent part (BLOCK_H, BLOCK_DV) and the rope part (BLOCK_H, BLOCK_DR), exact widths.
        dv = tl.arange(0, BLOCK_DV)
        dr = tl.arange(0, BLOCK_DR)
        q_base = Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + j[:, None] * stride_qs
        q = tl.load(q_base + dv[None, :])
        q_r = tl.load(q_base + BLOCK_DV + dr[None, :])
        if DOT_F32:
            q = q.to(tl.float32)
            q_r = q_r.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

        for n0 in range(start, end, BLOCK_N):
            if SEL:
                # Entry e of the walk: the window's key u_lo + e (e < u_len), else key t % SEL_BLOCK of
                # the list's entry t // SEL_BLOCK (t = e - u_len), if in [lo, hi) and not the window's.
                # Keys are gathered one by one through the table; an unselected key is never read.
                e = n0 + tl.arange(0, BLOCK_N)
                in_u = e < u_len
                t = tl.maximum(e - u_len, 0)
                sid = tl.load(ids_row + t // SEL_BLOCK, mask=(e < end) & (e >= u_len), other=-1)
                spos = sid * SEL_BLOCK + t % SEL_BLOCK
                s_ok = (sid >= 0) & (spos >= lo) & (spos < hi) & ((spos < u_lo) | (spos >= u_hi))
                pos_ok = (e < end) & (in_u | s_ok)
                pos = tl.where(pos_ok, tl.where(in_u, u_lo + e, spos), 0)
                blk = tl.load(TABLE + b * stride_tb + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
                pos_ok = pos_ok & (blk >= 0) & (blk < NUM_KV_BLOCKS)  # an entry outside the pool: masked
                k_row = K + tl.where(pos_ok, blk, 0) * stride_kn + (pos % KV_BLOCK_SIZE).to(tl.int64) * stride_kt
            else:
                # The tile lies in one cache block (launch: BLOCK_N divides the block size, or every key
                # is in the first block): one table entry, keys at consecutive slots. An entry outside
                # the pool is never read; its keys count as masked.
                blk = tl.load(TABLE + b * stride_tb + n0 // KV_BLOCK_SIZE).to(tl.int64)
                blk_ok = (blk >= 0) & (blk < NUM_KV_BLOCKS)
                pos = n0 + tl.arange(0, BLOCK_N)
                pos_ok = pos < tl.where(blk_ok, end, 0)
                blk = tl.where(blk_ok, blk, 0)
                cut = tl.where(blk_ok, lim, 0)  # the row's visible keys: below cut
                k_row = K + blk * stride_kn + (n0 % KV_BLOCK_SIZE).to(tl.int64) * stride_kt \
                    + tl.arange(0, BLOCK_N) * stride_kt
            kv = tl.load(k_row[:, None] + dv[None, :], mask=pos_ok[:, None], other=0.0)  # latent: K and V
            k_r = tl.load(k_row[:, None] + BLOCK_DV + dr[None, :], mask=pos_ok[:, None], other=0.0)
            if DOT_F32:
                kv = kv.to(tl.float32)
                k_r = k_r.to(tl.float32)
            s = tl.dot(q_r, tl.trans(k_r), tl.dot(q, tl.trans(kv)))
            if SEL:  # every row of the program sees the same keys
                s = tl.where(pos_ok[None, :], s * scale_log2, float("-inf"))
            else:
                s = tl.where(pos[None, :] < cut[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # P rounded to q's dtype for P @ V, as every fused kernel does.
            p = p.to(Q.dtype.element_ty)
            if DOT_F32:
                p = p.to(tl.float32)
            # Accumulated in place: a second 64 x 512 fp32 tile would not fit in registers.
            acc = tl.dot(p, kv, acc * alpha[:, None])
            m_i = m_new

        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        # The tile's row r is output row first + r * row_step of the contiguous (B, Hq, S[, NSPLIT], Dv)
        # result (Hq == G): a scalar base and the tile's offsets, so no per-row index lives across the loop.
        r = tl.arange(0, BLOCK_H)
        r_ok = r < n_rows - pid_h * BLOCK_H
        if DIRECT:  # the only split: the normalized output in OUT's dtype
            tl.store(OUT + first * BLOCK_DV + (r * row_step)[:, None] * BLOCK_DV + dv[None, :],
                     out.to(OUT.dtype.element_ty), mask=r_ok[:, None])
        else:
            lse = m_i + tl.log2(l_i)  # -inf for a row that saw nothing (m_i -inf, l_i 0)
            # Partial rows (B, Hq, S, NSPLIT): the tile's row r is (first + r * row_step) * NSPLIT + pid_s
            # (the lse's offsets as a scalar base and int32 steps: one int64 vector fewer, no spill).
            prow = (first + r * row_step) * NSPLIT + pid_s
            tl.store(LSEP + (first * NSPLIT + pid_s) + r * (row_step * NSPLIT), lse, mask=r_ok)
            tl.store(OP + prow[:, None] * BLOCK_DV + dv[None, :], out, mask=r_ok[:, None])


def launch(q: Tensor, k: Tensor, table: Tensor, q_start: Tensor, lengths: Tensor, scale: float, v_head_dim: int,
           max_len: int, num_splits: int, merge: Callable[[Tensor, Tensor, Tensor], Tensor],
           sel_ids: Tensor | None = None, sel_counts: Tensor | None = None, sel_bounds: Tensor | None = None,
           sel_block_size: int = 1, sel_span: int = 0) -> Tensor:
    """The lean kernel (and the merge, for several splits) on a call :func:`takes` accepts, with
    ``kernel.launch``'s arguments: q (B, Hq, S, D) fp16 / bf16; k (N, bs, 1, D) in q's dtype, last
    dim contiguous (a contiguous cache: one block of ``bs = L`` slots per sequence); table (B, nb)
    int; q_start, lengths (B,) int32; ``num_splits`` <= 0: the wave rule; ``merge``:
    :func:`attnkit.backends.triton.kernel.merge_splits` (given by ``kernel.launch``, which imports
    this module: the merge is shared, and the two modules do not import each other). A selection
    (``sel_*`` as ``kernel.launch`` takes them, one list per query token: ``sel_ids`` (B|1, 1, S,
    n)): a program takes one query token's heads and walks its list, the splits cutting the walk
    (``sel_span`` entries at most). Returns (B, Hq, S, v_head_dim)."""
    B, Hq, S, D = q.shape
    Dv = v_head_dim
    out = torch.empty((B, Hq, S, Dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    sel = sel_ids is not None
    arch = tuning.arch_of(q.device) if q.device.type == "cuda" else None
    key = tuning.shape_key(q.dtype, D, Dv, True, None, selection=sel, latent=True)
    cfg = tuning.tuned(config(Hq if sel else Hq * S, D, Dv), arch, key)
    block_h, block_size = cfg["BLOCK_H"], k.shape[1]
    if sel:  # programs: one query token's heads each; keys gathered one by one (any block size)
        span, block_n, seqs = max(1, sel_span), cfg["BLOCK_N"], B * S
        h_tiles = -(-Hq // block_h)
    else:  # keys per tile: a tile must lie in one cache block (one table entry per tile)
        span, seqs = max(1, max_len), B
        block_n = cfg["BLOCK_N"] if span <= block_size else min(cfg["BLOCK_N"], block_size)
        h_tiles = -(-Hq * S // block_h)
    if num_splits <= 0:  # the wave rule, one program per SM
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" \
            else _INTERPRETER_SMS
        num_splits, split_len = split_plan(seqs, 1, h_tiles, span, sms, 1, block_n)
    else:
        num_splits = min(num_splits, -(-span // block_n), 1024)
        split_len = -(-(-(-span // num_splits)) // block_n) * block_n
    direct = num_splits == 1
    if direct:
        op = lsep = lengths  # unread
    else:
        op = torch.empty((B, Hq, S, num_splits, Dv), dtype=torch.float32, device=q.device)
        lsep = torch.empty((B, Hq, S, num_splits), dtype=torch.float32, device=q.device)
    if sel:  # list 0 of each token: every head reads it
        sel_args = (sel_ids, sel_counts, sel_bounds, sel_ids.stride(0), sel_ids.stride(2), sel_counts.stride(0),
                    sel_counts.stride(2), sel_block_size)
    else:
        sel_args = (lengths, lengths, lengths, 0, 0, 0, 0, 1)  # unread
    _latent_kernel[(seqs, h_tiles, num_splits)](
        q, k, table, q_start, lengths, op, lsep, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1),
        table.stride(0),
        Hq, S, block_size, split_len, num_splits, k.shape[0],
        *sel_args,
        DIRECT=direct, SEL=sel,
        # Triton 3.9's interpreter computes bf16 dots wrongly: there, operands go up to fp32.
        DOT_F32=q.dtype == torch.bfloat16 and interpreting(),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DV=Dv, BLOCK_DR=D - Dv,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if direct:
        return out
    return merge(op, lsep, out)
