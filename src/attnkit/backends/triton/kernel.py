"""The Triton kernels of the ``triton`` backend: decode attention over a paged or contiguous KV
cache (GQA, MLA latent), split-K. The public entry points, which check their arguments, are in
:mod:`attnkit.backends.triton.ops`.

One kernel serves every cache layout attnkit has:

* **paged** pools ``(N, block_size, Hkv, D)`` read through a block table ``(B, max_blocks)``;
* **contiguous** caches ``(B, Hkv, L, D)``: the same pool seen as ``(B, L, Hkv, D)`` through its
  strides, with block table ``[[0], [1], ...]`` and ``block_size = L`` (no copy);
* **V from K** (MLA's latent cache, ``V = K[..., :Dv]``): each K tile is loaded once and used
  for both the scores (``[c_kv | k_rope]`` against the absorbed query ``[q_nope W_UK | q_rope]``)
  and the output (in latent space). Any ``kv_lora_rank`` / rope width works (padded to powers of
  two inside the kernel), not only DeepSeek's 512 / 64;
* **quantized** K/V (:mod:`attnkit.kvquant`: int8 or fp8 e4m3 rows with one fp32 scale each,
  ``k_scale`` / ``v_scale`` indexed like the rows without their last dim), in any of the layouts
  above: read in place, one byte per element, widened in registers (see "Quantized K/V" below).

The plain calls of absorbed MLA (V from K over one latent head, fp16 / bf16, no modifier, no
selection or one every head reads: :func:`attnkit.backends.triton.latent.takes`) go to a lean
kernel of their own,
:mod:`attnkit.backends.triton.latent`: 64 query heads per program, so each latent tile is read
once per 64 heads and its dots can be Hopper's warpgroup MMAs, which this kernel's register
budget does not allow once its modifiers are compiled in. Every other call runs here.

Work split: program ``(b * Hkv + kv_head, row tile, split)``. A row tile holds ``BLOCK_M`` of
the ``G * S`` query rows that share one KV head (G query heads per KV head, S query tokens:
decode S = 1, speculative verification S <= 16), so each KV head is read once for its whole query
group. The context is cut into ``num_splits`` ranges (flash-decoding), each giving an fp32
partial output and its log-sum-exp; a second kernel merges them exactly. The split count comes
from a wave rule (:func:`attnkit.backends.triton.plan.split_plan`): split only while the
unsplit grid does not fill one wave of resident programs. With one split the kernel writes the
normalized output itself (sinks included), with no partials and no merge. Scores, softmax and
accumulation are fp32 (base-2 exponentials with the scale folded in); P is rounded to q's dtype
(the float cache's) for the P @ V product, as every fused kernel does.

Key tiles (:func:`_walk` runs a range of them, :func:`_tile` is one; :func:`launch` picks the
layout with :func:`_addressing`). How a tile finds its keys is a constexpr:

* one block per sequence (``PAGED`` off: contiguous caches, or pages no shorter than any
  sequence): the sequence's table entry is read once per program and a tile is ``BLOCK_N``
  contiguous rows of that block: no table access per key at all;
* pages of a power-of-two size ``PAGE``: tiles start at multiples of ``BLOCK_N``, so a tile is
  ``BLOCK_N // PAGE`` whole pages, or lies in one page; its page ids are one small vector load
  (or one id), and each key's address is ``page id * page stride + slot * slot stride`` with
  the slot a constexpr shift and mask. The ids are loaded one tile ahead, into registers: a
  tile's K/V copies never wait on a table load of their own iteration, and the loop's software
  pipeline (``num_stages``) keeps the next tiles' 16-byte K/V copies in flight during this
  tile's math;
* any other block size, and a selection's scattered keys: one table entry per key
  (``pos // block_size``), as a gather.

Masks only where a tile needs them: the tiles every row sees entirely (below every row's limit,
at or above every row's window start, before the split's end) form one range, walked without the
per-score visibility ``where`` and without key masks on the loads; the few tiles before it (a
window's start) and after it (the rows' limits, the split's end) are walked masked, in loops of
their own that are not pipelined. The table-validity rule holds in both: a table entry outside
``[0, N)`` is never read and its keys count as masked (a page's keys share one load predicate).
The latent (V from K) and selection kernels make one masked walk (their register budget holds
one loop body).

The merge (more than one split) combines up to 16 rows a program, each a (rows, splits,
channels) tile: the partial outputs are read as wide rows, the grid is up to 16 times smaller.

Visibility, per query row: query ``j`` of sequence ``b`` sees the keys at positions
``< min(q_start[b] + j + 1, lengths[b])``. That is the cache protocol's
``Causal(q_start=q_start) & KeyPadding(lengths)``; ``q_start = lengths - S`` is plain bottom-right
causal, and a huge ``q_start`` means no causality. A sliding window ``(left, right)`` with its own
``window_q_start`` (``SlidingWindow(left, right, q_start=window_q_start)``) further keeps the keys
within ``[w - left, w + right]`` of the row's position ``w = window_q_start[b] + j``, and the
splits then cover only the keys some row of the sequence can see (a 4k window over a 128k cache
reads 4k keys). A row that sees nothing gets exactly 0.

Selections (``_select_kernel``: :class:`~attnkit.masks.SelectedKeys` /
:class:`~attnkit.masks.SelectedBlocks` as ``ReducedMask.selection`` gives them; ``_split_kernel``
is the same body, :func:`_attend`, without one): the rows of a program must share their keys, so
a program takes one query token and the query heads of its KV head that read one list
(``gcd(G, Hq // Hs)`` heads: all G for a list shared by every head or one per KV head). Its keys
are ``(W | listed) & R & limits``. The host folds R's interval and the call's limits (causal,
lengths, window) into one visible range ``[lo, hi)`` per query token, and W into ``[u_lo, u_hi)``
inside it; the program walks W's keys first, then the list's entries (ids ascending, stopping at
its count), a block's ``block_size`` keys in a row, skipping the keys W holds (each key counted
once) and those outside the range. A key tile's rows are gathered by position (paged: through
the block table) and only visible ones are loaded: an unselected key is never read. Splits cut
this walk (W's keys, then the list's), not the positions, so a long list splits like a long
context; ALiBi uses the keys' true positions.

Quantized K/V: a tile of int8 or e4m3 rows is widened to fp32 and then to q's dtype, exactly
(every int8 and every e4m3 value is an fp16 and a bf16 value), so the score dot product is the
float kernel's, on the stored integers. The scales are then applied per key, not per element:

* each score is multiplied by its key's scale before soft-capping and ALiBi: one multiply per
  score instead of one per K element, and no rounding of ``data * scale`` to q's dtype (a tile
  dequantized in registers would round every element before the dot);
* each probability, once the row's sum ``l`` has it, is multiplied by its value's scale before
  P @ V (attention over ``data * scale``, as the CPU split-K engine computes it). A V scale is about
  ``max|v| / 127``, so ``p * scale`` can fall below fp16's normal range (6e-5) and lose its
  digits when P is rounded to q's dtype: the tile's scales are divided by their largest (finite)
  one first, and the tile's P @ V multiplied by it after. Only visible keys take their scale
  (``where``), so a NaN or inf scale reaches the rows that see that key and no other.

fp8 rows are decoded from their bytes with integer ops (sign and exponent|mantissa moved into an
fp16's fields, then times 2**8): the same code on every GPU (sm_80 has no fp8 conversion) and in
the interpreter, so nothing about fp8 depends on the device. The bytes 0x7f / 0xff (e4m3fn's NaN)
decode as NaN, as on the CPU kernel.

Registered as the ``attnkit::decode_attention`` custom op (with a fake implementation), so
``torch.compile`` keeps it in the graph. Runs on CUDA, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported): that is how the tests
check it on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import tuning
from .limits import UNBOUNDED, interpreting
from .plan import split_plan

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: only this module needs it
    triton = tl = None

__all__ = ["available", "decode_op", "launch", "merge_splits"]

_LOG2E = 1.4426950408889634


def available(device: torch.device | str | None = None) -> str | None:
    """None when the kernels can run on ``device`` (default: CUDA if present), else why not."""
    if triton is None:
        return "triton is not installed (pip install triton)"
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if dev.type == "cpu":
        return None if interpreting() else "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before import)"
    return f"no Triton kernels for device type {dev.type!r}"


if triton is not None:

    @triton.jit
    def _widen(x, FP8: tl.constexpr):
        """Quantized elements to fp32, exactly: int8, or e4m3fn given as its bytes (uint8)."""
        if FP8:
            # e4m3 is (sign, 4-bit exponent of bias 7, 3-bit mantissa): put the sign in an fp16's
            # sign bit and the 7 other bits at the top of its exponent|mantissa fields. That fp16
            # is the value times 2**(7 - 15) (subnormals included: both formats' subnormals have
            # exponent field 0), so multiplying by 2**8 restores it. int32 ops, truncated to
            # 16 bits (two's complement keeps the bit pattern) before the bitcast.
            b = x.to(tl.int32)
            h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
            f = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            return tl.where((b & 0x7F) == 0x7F, float("nan"), f)  # e4m3fn's NaN codes
        else:
            return x.to(tl.float32)

    @triton.jit
    def _page_ids(TB, n0, end, PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The table entries of the key tile at ``n0`` with pages of PAGE keys (a power of two):
        one id when a page holds the tile, else the BLOCK_N // PAGE ids of its pages as one vector;
        entries at or past ``end`` are not read. 0 for the other layouts (unread)."""
        if not PAGED or PAGE == 0:
            return 0
        elif PAGE >= BLOCK_N:
            return tl.load(TB + n0 // PAGE, mask=n0 < end, other=0)
        else:
            pg = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
            return tl.load(TB + pg, mask=pg * PAGE < end, other=0)

    @triton.jit
    def _tile(
        n0, end, ids, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
        stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
        KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
        ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, SEL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
        MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One key tile of the online softmax, from ``n0`` (a position, or with SEL an entry of
        the walk; ``ids``: its page ids, :func:`_page_ids`): returns the updated (m_i, l_i, acc).
        MASKED: the tile may hold keys some row must not see (past ``end`` or ``lim``, below
        ``low``, unselected); without it every key of the tile is visible to every row and only
        the table-validity rule masks (paged layouts)."""
        if SEL:
            # Entry e of the walk: W's key u_lo + e (e < u_len), else key t % SEL_BLOCK of the
            # list's entry t // SEL_BLOCK (t = e - u_len): a block's keys are contiguous.
            e = n0 + tl.arange(0, BLOCK_N)
            e_ok = e < end
            u_len = u_hi - u_lo
            in_u = e < u_len
            t = tl.maximum(e - u_len, 0)
            sid = tl.load(ids_row + t // SEL_BLOCK, mask=e_ok & (e >= u_len), other=-1)
            spos = sid * SEL_BLOCK + t % SEL_BLOCK
            # A listed key counts if visible and not W's (W's keys were counted above).
            s_ok = (sid >= 0) & (spos >= lo) & (spos < hi) & ((spos < u_lo) | (spos >= u_hi))
            pos = tl.where(in_u, u_lo + e, spos)
            pos_ok = e_ok & (in_u | s_ok)
            pos = tl.where(pos_ok, pos, 0)
        else:
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
        # Where the tile's keys live: blk (cache block, int64: a pool can pass 2**31 elements) and
        # slot per key. A table entry outside the pool (a caller's check=False table that lies:
        # checking it would cost a device sync) is never read; its keys count as masked (key_ok).
        if not PAGED:  # one block per sequence (contiguous caches): Kh, Vh, ... point into it
            blk = 0
            slot = pos.to(tl.int64)
        elif SEL or PAGE == 0:  # keys anywhere, or a block size that is not a power of two: per key
            blk = tl.load(TB + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            slot = (pos % KV_BLOCK_SIZE).to(tl.int64)
        elif PAGE >= BLOCK_N:  # the tile lies in one page (tiles start at multiples of BLOCK_N)
            blk = ids.to(tl.int64) + tl.zeros([BLOCK_N], tl.int64)
            slot = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
        else:  # BLOCK_N // PAGE whole pages: a page's keys share its id
            blk = tl.reshape(tl.broadcast_to(ids[:, None], (BLOCK_N // PAGE, PAGE)), (BLOCK_N,)).to(tl.int64)
            slot = (tl.arange(0, BLOCK_N) % PAGE).to(tl.int64)
        if PAGED:
            if MASKED:
                key_ok = pos_ok & (blk >= 0) & (blk < NUM_KV_BLOCKS)
            else:
                key_ok = (blk >= 0) & (blk < NUM_KV_BLOCKS)
            blk = tl.where(key_ok, blk, 0)
        else:
            key_ok = pos_ok
        k_base = Kh + blk * stride_kn + slot * stride_kt
        # Loads are masked along keys in edge tiles and, in interior ones, only behind a table
        # entry outside the pool (a page's keys share one predicate); contiguous interior tiles
        # load unmasked.
        if MASKED or PAGED:
            k = tl.load(k_base[:, None] + dk[None, :], mask=key_ok[:, None] & (dk[None, :] < DK), other=0.0)
        else:
            k = tl.load(k_base[:, None] + dk[None, :], mask=dk[None, :] < DK, other=0.0)
        if QUANT:  # exact: int8 and e4m3 values are values of q's dtype
            k = _widen(k, FP8).to(q.dtype)
        elif DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_ROPE:
            if MASKED or PAGED:
                k_r = tl.load(k_base[:, None] + DK + dr[None, :], mask=key_ok[:, None] & (dr[None, :] < DR),
                              other=0.0)
            else:
                k_r = tl.load(k_base[:, None] + DK + dr[None, :], mask=dr[None, :] < DR, other=0.0)
            if QUANT:
                k_r = _widen(k_r, FP8).to(q_r.dtype)
            elif DOT_F32:
                k_r = k_r.to(tl.float32)
            s += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        if QUANT:  # each key's score times its K row scale, before soft-capping and ALiBi
            if MASKED or PAGED:
                ksc = tl.load(KSh + blk * stride_ksn + slot * stride_kst, mask=key_ok, other=0.0)
            else:
                ksc = tl.load(KSh + blk * stride_ksn + slot * stride_kst)
            s = s * ksc[None, :]
        if HAS_SOFTCAP:  # c * tanh(scaled score / c), in log2 units after
            y = s * (scale_log2 * 0.6931471805599453 / softcap)
            e2 = tl.exp2(-2.8853900817779268 * tl.abs(y))  # exp(-2|y|)
            th = (1.0 - e2) / (1.0 + e2)
            s = tl.where(y < 0, -th, th) * (softcap * 1.4426950408889634)
        else:
            s = s * scale_log2
        if HAS_ALIBI:
            s += slope[:, None] * (pos[None, :] - alibi_pos[:, None]).to(tl.float32)
        if MASKED:
            if SEL:  # every row of the program sees the same keys
                vis = key_ok[None, :] & row_ok[:, None]
            else:
                vis = (pos[None, :] < lim[:, None]) & key_ok[None, :]
                if HAS_WINDOW:
                    vis = vis & (pos[None, :] >= low[:, None])
            s = tl.where(vis, s, float("-inf"))
        elif PAGED:  # an interior tile: only a lying table entry can hide a key
            vis = key_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FROM_K:
            v = k  # V = K[..., :Dv]: the tile just read (DK == DV), widened if quantized
        else:
            v_base = Vh + blk * stride_vn + slot * stride_vt
            if MASKED or PAGED:
                v = tl.load(v_base[:, None] + dv[None, :], mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0)
            else:
                v = tl.load(v_base[:, None] + dv[None, :], mask=dv[None, :] < DV, other=0.0)
            if QUANT:
                v = _widen(v, FP8).to(q.dtype)
            elif DOT_F32:
                v = v.to(tl.float32)
        if QUANT:  # each probability (l_i has it) times its V row scale, over the tile's largest
            if V_FROM_K:
                vsc = ksc
            elif MASKED or PAGED:
                vsc = tl.load(VSh + blk * stride_vsn + slot * stride_vst, mask=key_ok, other=0.0)
            else:
                vsc = tl.load(VSh + blk * stride_vsn + slot * stride_vst)
            if MASKED or PAGED:
                top = tl.max(tl.where(key_ok & (tl.abs(vsc) < float("inf")), tl.abs(vsc), 0.0), 0)
                top = tl.where(top > 0.0, top, 1.0)
                p = tl.where(vis, p * (vsc / top)[None, :], 0.0)
            else:  # every row sees every key of the tile
                top = tl.max(tl.where(tl.abs(vsc) < float("inf"), tl.abs(vsc), 0.0), 0)
                top = tl.where(top > 0.0, top, 1.0)
                p = p * (vsc / top)[None, :]
        # P rounded to q's (the float cache's) dtype, as every fused kernel does (a no-op for fp32).
        p = p.to(Q.dtype.element_ty)
        if DOT_F32:
            p = p.to(tl.float32)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if QUANT:
            pv = pv * top
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _walk(
        n_lo, n_hi, end, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
        stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
        KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
        ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, SEL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
        MASKED: tl.constexpr, STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """The key tiles from ``n_lo`` up to ``n_hi`` (:func:`_tile` each), with STAGES pipeline
        stages (None: the launch's). Each tile's page ids are loaded one iteration ahead, into
        registers: a tile's K/V addresses never wait on a table load of its own iteration, and
        the pipeliner can issue the next tiles' K/V copies while this one's math runs."""
        ids = _page_ids(TB, n_lo, end, PAGED, PAGE, BLOCK_N)
        for n0 in tl.range(n_lo, n_hi, BLOCK_N, num_stages=STAGES):
            ids_next = _page_ids(TB, n0 + BLOCK_N, end, PAGED, PAGE, BLOCK_N)
            m_i, l_i, acc = _tile(
                n0, end, ids, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
                stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
                KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
                ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
                V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, SEL, PAGED,
                PAGE, MASKED, BLOCK_N)
            ids = ids_next
        return m_i, l_i, acc

    @triton.jit
    def _attend(
        Q, K, V, TABLE, QSTART, LENGTHS, OP, LSEP, SLOPES, ALIBI_QSTART, KS, VS, WIN_QSTART, OUT, SINKS,
        scale_log2, softcap,
        stride_qb, stride_qh, stride_qs,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_ksn, stride_kst, stride_ksh,
        stride_vsn, stride_vst, stride_vsh,
        stride_tb,
        HKV, G, S, DK, DR, DV, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS, WLEFT, WRIGHT, SINK_ROWS,
        SEL_IDS, SEL_COUNTS, SEL_BOUNDS,
        stride_ib, stride_ih, stride_is, stride_cb, stride_ch, stride_cs,
        SEL_BLOCK, SEL_GS, SEL_CH, SEL_MT,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
        SEL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        # Scalar bases in int64 (offsets past 2**31 elements are realistic); per-element offsets
        # from them stay int32 (a sequence's rows of one head), except cache blocks and slots
        # (int64 in _tile).
        Qb = Q + b.to(tl.int64) * stride_qb
        Kh = K + kvh.to(tl.int64) * stride_kh
        Vh = V + kvh.to(tl.int64) * stride_vh
        # the row scales of this KV head when quantized (unread otherwise; VS unread when V comes from K)
        KSh = KS + kvh.to(tl.int64) * stride_ksh
        VSh = VS + kvh.to(tl.int64) * stride_vsh
        TB = TABLE + b * stride_tb  # this sequence's block table row

        if SEL:
            # One query token jq and a chunk of SEL_CH query heads that read one selection list:
            # every row of the program sees the same keys. pid_m = (chunk * S + jq) * SEL_MT + tile.
            mt = pid_m % SEL_MT
            jq = (pid_m // SEL_MT) % S
            chunk = pid_m // (SEL_MT * S)
            r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = r < SEL_CH
            g = chunk * SEL_CH + r
            j = jq + 0 * r
            h = kvh * G + g
            lst = (kvh * G + chunk * SEL_CH) // SEL_GS  # the list these heads read
            # The keys the rows see: [lo, hi) (the call's limits AND the selection's interval R,
            # folded on the host), W's keys in it, [u_lo, u_hi), once, then the listed keys in it
            # that W does not hold.
            bounds = SEL_BOUNDS + (S * b + jq) * 4  # (B, S, 4): lo, hi, u_lo, u_hi
            lo = tl.load(bounds)
            hi = tl.load(bounds + 1)
            u_lo = tl.load(bounds + 2)
            u_hi = tl.load(bounds + 3)
            ids_row = SEL_IDS + b * stride_ib + lst * stride_ih + jq * stride_is
            n_sel = tl.load(SEL_COUNTS + b * stride_cb + lst * stride_ch + jq * stride_cs)
            n_sel = tl.where(hi > lo, n_sel, 0)  # nothing visible: no entry to walk
            total = u_hi - u_lo + n_sel * SEL_BLOCK  # entries of this program's walk: W's keys, then the list's
            base = 0
            lim = j  # unread: the walk applies the limits
            low = j
        else:
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * S + j
            row_ok = rows < G * S
            j = rows % S
            h = kvh * G + rows // S
            length = tl.load(LENGTHS + b)
            lim = tl.minimum(tl.load(QSTART + b) + j + 1, length)  # keys < lim are visible
            if HAS_WINDOW:  # and keys >= low: the window around each row's own position
                w_qstart = tl.load(WIN_QSTART + b)
                lim = tl.minimum(lim, w_qstart + j + WRIGHT + 1)
                low = w_qstart + j - WLEFT
                # the first key any row of the sequence sees, down to a tile boundary (a tile
                # never straddles pages it does not fully hold)
                base = tl.maximum(w_qstart - WLEFT, 0) // BLOCK_N * BLOCK_N
            else:
                low = lim  # unread
                base = 0
            ids_row = SEL_IDS  # unread: no selection
            lo = 0
            hi = 0
            u_lo = 0
            u_hi = 0
        if HAS_ALIBI:  # slope of each row's head (log2 units), and the row's ALiBi query position
            slope = tl.load(SLOPES + h, mask=row_ok, other=0.0) * 1.4426950408889634
            alibi_pos = tl.load(ALIBI_QSTART + b) + j
        else:
            slope = 0.0
            alibi_pos = 0

        dk = tl.arange(0, BLOCK_DK)
        q_base = Qb + h[:, None] * stride_qh + j[:, None] * stride_qs
        q = tl.load(q_base + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        if HAS_ROPE:
            dr = tl.arange(0, BLOCK_DR)
            q_r = tl.load(q_base + DK + dr[None, :], mask=row_ok[:, None] & (dr[None, :] < DR), other=0.0)
            if DOT_F32:
                q_r = q_r.to(tl.float32)
        else:
            dr = dk  # unread
            q_r = q
        dv = tl.arange(0, BLOCK_DV)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        start = base + pid_s * SPLIT_LEN
        if SEL:
            end = tl.minimum(start + SPLIT_LEN, total)
        else:
            end = tl.minimum(start + SPLIT_LEN, length)
        if not PAGED:
            # One block holds the whole sequence (a contiguous cache): its one table entry, read
            # once; its keys are contiguous rows of it. An entry outside the pool: nothing is read.
            blk0 = tl.load(TB).to(tl.int64)
            ok0 = (blk0 >= 0) & (blk0 < NUM_KV_BLOCKS)
            blk0 = tl.where(ok0, blk0, 0)
            Kh += blk0 * stride_kn
            Vh += blk0 * stride_vn
            KSh += blk0 * stride_ksn
            VSh += blk0 * stride_vsn
            if SEL:
                end = tl.where(ok0, end, start)
            else:  # (and no key past the block, whatever a check=False call's lengths say)
                end = tl.where(ok0, tl.minimum(end, KV_BLOCK_SIZE), start)
        if SEL or V_FROM_K:
            # One walk, every tile masked (a selection's rows share keys but its tiles are gathered;
            # the latent kernel's registers hold one loop body, not three).
            m_i, l_i, acc = _walk(
                start, end, end, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
                stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
                KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
                ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
                V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, SEL, PAGED,
                PAGE, True, None, BLOCK_N)
        else:
            # Interior tiles, [mid_lo, mid_hi): every key of them is visible to every row (below
            # every row's limit, at or above every row's window start), so they skip the
            # visibility masks; the few tiles before and after them (the window's start, the
            # rows' limits, the split's end) take them, in loops of their own left unpipelined.
            mid_hi = start + tl.maximum(tl.minimum(tl.min(lim, 0), end) - start, 0) // BLOCK_N * BLOCK_N
            if HAS_WINDOW:
                mid_lo = start + (tl.maximum(tl.max(low, 0) - start, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
                mid_lo = tl.minimum(mid_lo, mid_hi)
                m_i, l_i, acc = _walk(
                    start, mid_lo, end, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
                stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
                KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
                ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
                V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, SEL, PAGED,
                PAGE, True, 1, BLOCK_N)
            else:
                mid_lo = start
            m_i, l_i, acc = _walk(
                mid_lo, mid_hi, end, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
                stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
                KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
                ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
                V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, SEL, PAGED,
                PAGE, False, None, BLOCK_N)
            m_i, l_i, acc = _walk(
                mid_hi, end, end, m_i, l_i, acc, Q, q, q_r, dk, dr, dv, Kh, Vh, KSh, VSh, TB,
                stride_kn, stride_kt, stride_vn, stride_vt, stride_ksn, stride_kst, stride_vsn, stride_vst,
                KV_BLOCK_SIZE, NUM_KV_BLOCKS, DK, DR, DV, lim, low, row_ok, slope, alibi_pos, scale_log2, softcap,
                ids_row, SEL_BLOCK, u_lo, u_hi, lo, hi,
                V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, SEL, PAGED,
                PAGE, True, 1, BLOCK_N)

        seen = l_i > 0.0
        if DIRECT:  # the only split: the normalized output, in OUT's dtype (what the merge would give)
            orow = ((b * HKV * G + h) * S + j).to(tl.int64)  # OUT is contiguous (B, Hq, S, DV)
            den = l_i
            if HAS_SINKS:  # the row's sink joins the denominator (a row that saw nothing stays 0)
                # SINKS: one logit per query head (Hq,), or per query row (B, Hq, S) when SINK_ROWS
                sink = tl.load(SINKS + tl.where(SINK_ROWS != 0, orow, h), mask=row_ok, other=0.0) * 1.4426950408889634
                den += tl.where(seen, tl.exp2(sink - tl.where(seen, m_i, 0.0)), 0.0)
            out = acc / tl.where(seen, den, 1.0)[:, None]
            tl.store(OUT + orow[:, None] * DV + dv[None, :], out.to(OUT.dtype.element_ty),
                     mask=row_ok[:, None] & (dv[None, :] < DV))
        else:
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            # Partials are contiguous (B, Hq, S, NSPLIT[, DV]); row (b, h, j).
            prow = ((b * HKV * G + h) * S + j).to(tl.int64) * NSPLIT + pid_s
            tl.store(LSEP + prow, lse, mask=row_ok)
            tl.store(OP + prow[:, None] * DV + dv[None, :], out, mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _split_kernel(
        Q, K, V, TABLE, QSTART, LENGTHS, OP, LSEP, SLOPES, ALIBI_QSTART, KS, VS, WIN_QSTART, OUT, SINKS,
        scale_log2, softcap,
        stride_qb, stride_qh, stride_qs,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_ksn, stride_kst, stride_ksh,
        stride_vsn, stride_vst, stride_vsh,
        stride_tb,
        HKV, G, S, DK, DR, DV, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS, WLEFT, WRIGHT, SINK_ROWS,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr, PAGED: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # The decode kernel over the call's limits (causal, lengths, window): _attend without a selection.
        _attend(Q, K, V, TABLE, QSTART, LENGTHS, OP, LSEP, SLOPES, ALIBI_QSTART, KS, VS, WIN_QSTART, OUT, SINKS,
            scale_log2, softcap,
            stride_qb, stride_qh, stride_qs,
            stride_kn, stride_kt, stride_kh,
            stride_vn, stride_vt, stride_vh,
            stride_ksn, stride_kst, stride_ksh,
            stride_vsn, stride_vst, stride_vsh,
            stride_tb,
            HKV, G, S, DK, DR, DV, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS, WLEFT, WRIGHT, SINK_ROWS,
            LENGTHS, LENGTHS, LENGTHS, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1,  # no selection: unread
            V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, DIRECT,
            HAS_SINKS,
            False, PAGED, PAGE, BLOCK_M, BLOCK_N, BLOCK_DK, BLOCK_DR, BLOCK_DV)

    @triton.jit
    def _select_kernel(
        Q, K, V, TABLE, QSTART, LENGTHS, OP, LSEP, SLOPES, ALIBI_QSTART, KS, VS, WIN_QSTART, OUT, SINKS,
        scale_log2, softcap,
        stride_qb, stride_qh, stride_qs,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_ksn, stride_kst, stride_ksh,
        stride_vsn, stride_vst, stride_vsh,
        stride_tb,
        HKV, G, S, DK, DR, DV, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS, WLEFT, WRIGHT, SINK_ROWS,
        SEL_IDS, SEL_COUNTS, SEL_BOUNDS,
        stride_ib, stride_ih, stride_is, stride_cb, stride_ch, stride_cs,
        SEL_BLOCK, SEL_GS, SEL_CH, SEL_MT,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr, PAGED: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # The decode kernel walking a per-query selection (within the call's limits): _attend with SEL.
        _attend(Q, K, V, TABLE, QSTART, LENGTHS, OP, LSEP, SLOPES, ALIBI_QSTART, KS, VS, WIN_QSTART, OUT, SINKS,
            scale_log2, softcap,
            stride_qb, stride_qh, stride_qs,
            stride_kn, stride_kt, stride_kh,
            stride_vn, stride_vt, stride_vh,
            stride_ksn, stride_kst, stride_ksh,
            stride_vsn, stride_vst, stride_vsh,
            stride_tb,
            HKV, G, S, DK, DR, DV, KV_BLOCK_SIZE, SPLIT_LEN, NSPLIT, NUM_KV_BLOCKS, WLEFT, WRIGHT, SINK_ROWS,
            SEL_IDS, SEL_COUNTS, SEL_BOUNDS, stride_ib, stride_ih, stride_is, stride_cb, stride_ch, stride_cs,
            SEL_BLOCK, SEL_GS, SEL_CH, SEL_MT,
            V_FROM_K, HAS_ROPE, PRECISION, DOT_F32, HAS_SOFTCAP, HAS_ALIBI, QUANT, FP8, HAS_WINDOW, DIRECT,
            HAS_SINKS,
            True, PAGED, PAGE, BLOCK_M, BLOCK_N, BLOCK_DK, BLOCK_DR, BLOCK_DV)

    @triton.jit
    def _merge_kernel(OP, LSEP, OUT, SINKS, ROWS, NSPLIT, DV, HQ, S, SINK_ROWS, HAS_SINKS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_SPLIT: tl.constexpr, BLOCK_DV: tl.constexpr):
        # BLOCK_R rows (b, h, j) flattened a program, as one (rows, splits, channels) tile: OUT is
        # contiguous (B, Hq, S, DV), the partials (B, Hq, S, NSPLIT[, DV]).
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = row < ROWS
        sp = tl.arange(0, BLOCK_SPLIT)
        dv = tl.arange(0, BLOCK_DV)
        ok = row_ok[:, None] & (sp[None, :] < NSPLIT)
        lse = tl.load(LSEP + row[:, None] * NSPLIT + sp[None, :], mask=ok, other=float("-inf"))
        mx = tl.max(lse, 1)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)[:, None])  # splits that saw nothing: 0
        den = tl.sum(w, 1)
        if HAS_SINKS:  # the row's sink joins the denominator once (a row that saw nothing stays 0)
            sink = tl.load(SINKS + tl.where(SINK_ROWS != 0, row, (row // S) % HQ), mask=row_ok, other=0.0) \
                * 1.4426950408889634
            den += tl.where(mx == float("-inf"), 0.0, tl.exp2(sink - mx))
        o = tl.load(OP + (row[:, None, None] * NSPLIT + sp[None, :, None]) * DV + dv[None, None, :],
                    mask=ok[:, :, None] & (dv[None, None, :] < DV), other=0.0)
        res = tl.sum(o * w[:, :, None], 1) / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(OUT + row[:, None] * DV + dv[None, :], res.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def _config(dtype: torch.dtype, D: int, Dv: int, rows: int, v_from_k: bool) -> dict:
    """Tile sizes for one call. K channels are scored in a main tile of a power-of-two width
    (Dv when V is read from K, so that tile is V too) plus a remainder tile (MLA's rope part; 576
    = 512 + 64, 192 = 128 + 64), so padding stays small. fp32 tiles are small: fp32 dots are plain
    FMA loops (no tensor cores at "ieee" precision) whose operands live in registers.
    ``tests/test_triton_kernels.py`` compiles these for sm_80 / sm_90 and checks shared memory."""
    dk = Dv if v_from_k else (D if D & (D - 1) == 0 else 1 << (D.bit_length() - 1))
    dr = D - dk
    bdk, bdr, bdv = _pow2(dk), _pow2(dr), _pow2(Dv)
    width = bdk + (bdr if dr else 0) + (0 if v_from_k else bdv)  # elements loaded per key
    if dtype == torch.float32:
        block_m, block_n = 16, (32 if width <= 128 else 16)
    else:
        block_m = min(64 if bdv <= 128 else 32, _pow2(rows))
        block_n = 64 if width <= 512 else 32
    # The pipelined loop keeps num_stages - 1 K/V tiles in flight in shared memory: two where they
    # leave room on an A100 (163 KB a block) for the rest of the kernel's shared memory, else one.
    tile_bytes = block_n * width * dtype.itemsize
    return dict(DK=dk, DR=dr, BLOCK_DK=bdk, BLOCK_DR=bdr, BLOCK_DV=bdv, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=4 if width <= 512 else 8, num_stages=3 if 2 * tile_bytes <= 96 * 1024 else 2)


def _addressing(block_size: int, max_len: int, selection: bool) -> tuple[bool, int]:
    """How the kernel finds a sequence's keys: ``(PAGED, PAGE)``. A sequence in one block
    (contiguous caches: ``block_size = L``; or pages no shorter than any sequence): not PAGED, its
    keys are contiguous rows of that block, one table entry per program. Pages of a power-of-two
    size: PAGE = that size, a tile's page ids loaded as one vector (or one id when a page holds
    whole tiles) ahead of its K/V loads. Any other size, or a selection's scattered keys: PAGE = 0,
    one table entry per key."""
    paged = max_len > block_size
    page = block_size if paged and not selection and block_size & (block_size - 1) == 0 else 0
    return paged, page


def _merge_rows(rows: int, block_split: int, block_dv: int) -> int:
    """Rows one merge program combines: a power of two, up to 16, whose (rows, splits, channels)
    fp32 tile stays within 8192 elements (32 KB of registers over a 4-warp program)."""
    r = 1
    while r < 16 and r < rows and 2 * r * block_split * block_dv <= 8192:
        r *= 2
    return r


#: The interpreter's stand-in for a GPU's size (SMs, programs per SM) in the split rule.
_INTERPRETER_WAVE = (4, 1)


def _programs_per_sm(cfg: dict) -> int:
    """Programs of one configuration an SM holds at once: an estimate from the warps (a 4-warp
    program's tiles fit twice in an SM's registers and shared memory, an 8-warp one's once)."""
    return 2 if cfg["num_warps"] <= 4 else 1


def _wave(device: torch.device, cfg: dict) -> tuple[int, int]:
    """(SM count, programs per SM) of ``device`` for the split rule."""
    if device.type != "cuda":
        return _INTERPRETER_WAVE
    return torch.cuda.get_device_properties(device).multi_processor_count, _programs_per_sm(cfg)


def launch(q: Tensor, k: Tensor, v: Tensor | None, table: Tensor, q_start: Tensor, lengths: Tensor,
           scale: float, v_head_dim: int, max_len: int, num_splits: int, softcap: float = 0.0,
           slopes: Tensor | None = None, alibi_q_start: Tensor | None = None, sinks: Tensor | None = None,
           k_scale: Tensor | None = None, v_scale: Tensor | None = None, window_q_start: Tensor | None = None,
           window_left: int = 0, window_right: int = 0, sel_ids: Tensor | None = None,
           sel_counts: Tensor | None = None, sel_bounds: Tensor | None = None, sel_block_size: int = 1,
           sel_span: int = 0) -> Tensor:
    """Launch the split and merge kernels on checked arguments: q (B, Hq, S, D); k (N, bs, Hkv, D)
    and v (N, bs, Hkv, Dv) | None (V = K[..., :Dv]) with bs tokens per cache block, last dims
    contiguous; table (B, nb) int; q_start, lengths (B,) int32; softcap (0: off); slopes (Hq,)
    fp32 with alibi_q_start (B,) int32 (ALiBi query position of each sequence's first query);
    sinks (Hq,) fp32, one logit per query head, or (B|1, Hq, S[, 1]), one per query row; quantized (int8 / fp8 e4m3) k and v: k_scale (N, bs, Hkv) and v_scale
    (N, bs, Hkv) | None (with v None) fp32, any strides; window_q_start (B,) int32 with
    window_left / window_right in [0, UNBOUNDED]: a sliding window. Returns (B, Hq, S, Dv).

    A selection (``sel_ids`` given) further restricts each query row to listed keys: sel_ids
    (B|1, Hs, S, n) int32, each list's distinct block ids ascending then -1, of ``sel_block_size``
    keys each (1: key positions), query head h reading list ``h // (Hq // Hs)``; sel_counts
    (B|1, Hs, S) int32, the ids in each list; sel_bounds (B, S, 4) int32 contiguous, per query
    token: ``lo, hi, u_lo, u_hi`` with ``0 <= lo``, ``u_lo <= u_hi``: the token sees the keys of
    ``[u_lo, u_hi)`` and the listed keys within ``[lo, hi)`` (the caller folds every limit into
    them: the limits above are not applied again); ``sel_span``: the most entries one row walks
    (``u_hi - u_lo`` plus n * sel_block_size), which the splits cut."""
    B, Hq, S, D = q.shape
    block_size, Hkv = k.shape[1], k.shape[2]
    from . import latent  # the lean MLA kernel serves the plain latent calls (its module docstring)
    if latent.takes(q.dtype, D, v_head_dim, Hkv, v is None, block_size, max_len, quantized=k_scale is not None,
                    softcap=softcap, alibi=slopes is not None, window=window_q_start is not None,
                    sinks=sinks is not None, selection=sel_ids is not None,
                    selection_lists=1 if sel_ids is None else sel_ids.shape[1]):
        return latent.launch(q, k, table, q_start, lengths, scale, v_head_dim, max_len, num_splits, merge_splits,
                             sel_ids, sel_counts, sel_bounds, sel_block_size, sel_span)
    G = Hq // Hkv
    Dv = v_head_dim
    out = torch.empty((B, Hq, S, Dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    v_from_k = v is None
    sel = sel_ids is not None
    # the kernel's own tiles, with this GPU's tuned launch parameters where the table has them
    arch = tuning.arch_of(q.device) if q.device.type == "cuda" else None
    key = tuning.shape_key(q.dtype, D, Dv, v_from_k, None if k_scale is None else k.dtype, sel)
    if sel:  # programs of sel_ch query heads that share a KV head and a list, one query token each
        sel_gs = Hq // sel_ids.shape[1]
        sel_ch = math.gcd(G, sel_gs)
        cfg = tuning.tuned(_config(q.dtype, D, Dv, sel_ch, v_from_k), arch, key)
        sel_mt = -(-sel_ch // cfg["BLOCK_M"])
        m_tiles = G // sel_ch * S * sel_mt
        span = max(1, sel_span)
    else:
        cfg = tuning.tuned(_config(q.dtype, D, Dv, G * S, v_from_k), arch, key)
        m_tiles = -(-G * S // cfg["BLOCK_M"])
        span = max(1, max_len)  # keys the splits of a sequence cover
        if window_q_start is not None and max(window_left, window_right) < UNBOUNDED:
            # what the rows of a window can see, from the tile boundary below the window's start
            span = max(1, min(span, window_left + window_right + S + cfg["BLOCK_N"] - 1))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    longest = -(-span // block_n)  # key tiles of the longest span
    if num_splits <= 0:  # the wave rule (plan.split_plan)
        num_splits, split_len = split_plan(B, Hkv, m_tiles, span, *_wave(q.device, cfg), block_n)
    else:
        num_splits = min(num_splits, longest, 1024)
        split_len = -(-span // num_splits)
        split_len = -(-split_len // block_n) * block_n
    direct = num_splits == 1  # the split kernel writes the output: no partials, no merge
    paged, page = _addressing(block_size, max_len, sel)
    if direct:
        op = lsep = lengths  # unread
    else:
        op = torch.empty((B, Hq, S, num_splits, Dv), dtype=torch.float32, device=q.device)
        lsep = torch.empty((B, Hq, S, num_splits), dtype=torch.float32, device=q.device)
    sinks, sink_rows = _sink_rows(sinks, B, Hq, S)
    quant = k_scale is not None
    fp8 = quant and k.dtype != torch.int8
    if fp8:  # e4m3 rows go in as their bytes: the kernel decodes them (_widen), on any GPU
        k, v = k.view(torch.uint8), None if v_from_k else v.view(torch.uint8)
    vv = k if v_from_k else v
    ks = k_scale if quant else q  # unread when not quantized
    vs = ks if v_scale is None else v_scale
    scale_strides = (*ks.stride(), *vs.stride()) if quant else (0,) * 6  # (N, bs, Hkv) each
    kernel = _select_kernel if sel else _split_kernel
    kernel[(B * Hkv, m_tiles, num_splits)](
        q, k, vv, table, q_start, lengths, op, lsep,
        lengths if slopes is None else slopes, lengths if alibi_q_start is None else alibi_q_start,  # unread if off
        ks, vs, lengths if window_q_start is None else window_q_start,  # unread if off
        out, lengths if sinks is None else sinks,  # sinks read only by the single split
        scale * _LOG2E, float(softcap),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        vv.stride(0), vv.stride(1), vv.stride(2),
        *scale_strides,
        table.stride(0),
        Hkv, G, S, cfg["DK"], cfg["DR"], Dv, block_size, split_len, num_splits, k.shape[0], window_left,
        window_right, int(sink_rows),
        *((sel_ids, sel_counts, sel_bounds, *sel_ids.stride()[:3], *sel_counts.stride(), sel_block_size, sel_gs,
           sel_ch, sel_mt) if sel else ()),
        V_FROM_K=v_from_k, HAS_ROPE=cfg["DR"] > 0, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton 3.9's interpreter computes bf16 dots wrongly: there, operands go up to fp32 (exact
        # products, fp32 sums: what the GPU's bf16 dot with fp32 accumulation gives).
        DOT_F32=q.dtype == torch.bfloat16 and interpreting(),
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=slopes is not None, QUANT=quant, FP8=fp8,
        HAS_WINDOW=window_q_start is not None, DIRECT=direct, HAS_SINKS=sinks is not None,
        PAGED=paged, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=cfg["BLOCK_DK"],
        BLOCK_DR=cfg["BLOCK_DR"], BLOCK_DV=cfg["BLOCK_DV"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if direct:
        return out
    return merge_splits(op, lsep, out, sinks)


def _sink_rows(sinks: Tensor | None, B: int, Hq: int, S: int) -> tuple[Tensor | None, bool]:
    """The kernels' sinks: (Hq,) fp32 as given (one logit per query head), or one per query row as
    a contiguous (B, Hq, S) fp32 tensor from (B|1, Hq, S[, 1]); and whether they are per row."""
    if sinks is None or sinks.dim() == 1:
        return sinks, False
    rows = sinks.reshape(sinks.shape[0], Hq, S).expand(B, Hq, S)
    return rows.to(torch.float32).contiguous(), True


def merge_splits(op: Tensor, lsep: Tensor, out: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Merge the splits' partial outputs op (B, Hq, S, NSPLIT, Dv) fp32 and their base-2
    log-sum-exps lsep (B, Hq, S, NSPLIT), both contiguous, into out (B, Hq, S, Dv) contiguous
    (sinks (Hq,) or (B|1, Hq, S[, 1]) fp32 join each row's denominator once); returns out. The
    merge of every decode kernel here (:mod:`attnkit.backends.triton.latent`'s too)."""
    B, Hq, S, nsplit, Dv = op.shape
    sinks, sink_rows = _sink_rows(sinks, B, Hq, S)
    rows = B * Hq * S
    block_split, block_dv = _pow2(nsplit, 2), _pow2(Dv)
    block_r = _merge_rows(rows, block_split, block_dv)  # a block of rows per program
    _merge_kernel[(-(-rows // block_r),)](op, lsep, out, lsep if sinks is None else sinks, rows, nsplit, Dv, Hq, S,
                                          int(sink_rows), HAS_SINKS=sinks is not None, BLOCK_R=block_r, BLOCK_SPLIT=block_split,
                                          BLOCK_DV=block_dv)
    return out


# ------------------------------------------------------------------ custom op (torch.compile)

@torch.library.custom_op("attnkit::decode_attention", mutates_args=())
def decode_op(q: Tensor, k: Tensor, v: Tensor | None, table: Tensor, q_start: Tensor, lengths: Tensor,
              scale: float, v_head_dim: int, max_len: int, num_splits: int, softcap: float = 0.0,
              slopes: Tensor | None = None, alibi_q_start: Tensor | None = None,
              sinks: Tensor | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
              window_q_start: Tensor | None = None, window_left: int = 0, window_right: int = 0,
              sel_ids: Tensor | None = None, sel_counts: Tensor | None = None, sel_bounds: Tensor | None = None,
              sel_block_size: int = 1, sel_span: int = 0) -> Tensor:
    """:func:`launch` as the custom op ``attnkit::decode_attention``, which torch.compile keeps in
    its graph."""
    why = available(q.device)
    if why:
        raise RuntimeError(f"attnkit::decode_attention: {why}")
    return launch(q, k, v, table, q_start, lengths, scale, v_head_dim, max_len, num_splits, softcap, slopes,
                  alibi_q_start, sinks, k_scale, v_scale, window_q_start, window_left, window_right, sel_ids,
                  sel_counts, sel_bounds, sel_block_size, sel_span)


@decode_op.register_fake
def _(q, k, v, table, q_start, lengths, scale, v_head_dim, max_len, num_splits, softcap=0.0, slopes=None,
      alibi_q_start=None, sinks=None, k_scale=None, v_scale=None, window_q_start=None, window_left=0,
      window_right=0, sel_ids=None, sel_counts=None, sel_bounds=None, sel_block_size=1, sel_span=0):
    B, Hq, S, _ = q.shape
    return q.new_empty((B, Hq, S, v_head_dim))
