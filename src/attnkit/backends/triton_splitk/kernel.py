"""Triton decode attention over a paged or contiguous KV cache (GQA, MLA latent), split-K.

One kernel serves every cache layout attnkit has:

* **paged** pools ``(N, page, Hkv, D)`` read through a block table ``(B, max_blocks)``;
* **contiguous** caches ``(B, Hkv, L, D)``: the same pool seen as ``(B, L, Hkv, D)`` through its
  strides, with block table ``[[0], [1], ...]`` and ``page = L`` (no copy);
* **V from K** (MLA's latent cache, ``V = K[..., :Dv]``): each K tile is loaded once and used
  for both the scores (``[c_kv | k_rope]`` against the absorbed query ``[q_nope W_UK | q_rope]``)
  and the output (in latent space). Any ``kv_lora_rank`` / rope width works (padded to powers of
  two inside the kernel), not only DeepSeek's 512 / 64;
* **quantized** K/V (:mod:`attnkit.kvquant`: int8 or fp8 e4m3 rows with one fp32 scale each,
  ``k_scale`` / ``v_scale`` indexed like the rows without their last dim), in any of the layouts
  above: read in place, one byte per element, widened in registers (see "Quantized K/V" below).

Work split: program ``(b * Hkv + kv_head, row tile, split)``. A row tile holds ``BLOCK_M`` of
the ``G * S`` query rows that share one KV head (G query heads per KV head, S query tokens:
decode S = 1, speculative verification S <= 16), so each KV head is read once for its whole query
group. The context is cut into ``num_splits`` ranges (flash-decoding), each giving an fp32
partial output and its log-sum-exp; a second kernel merges them exactly. Scores, softmax and
accumulation are fp32 (base-2 exponentials with the scale folded in); P is rounded to q's dtype
(the float cache's) for the P @ V product, as every fused kernel does.

Visibility, per query row: query ``j`` of sequence ``b`` sees the keys at positions
``< min(q_start[b] + j + 1, seq_lens[b])``. That is the cache protocol's
``Causal(offsets=old) & KeyPadding(new)``; ``q_start = seq_lens - S`` is plain bottom-right causal,
and a huge ``q_start`` means no causality. A sliding window ``(left, right)`` anchored at
``window_start`` (``SlidingWindow(left, right, offsets=window_start)``) further keeps the keys
within ``[w - left, w + right]`` of the row's position ``w = window_start[b] + j``, and the splits
then cover only the keys some row of the sequence can see (a 4k window over a 128k cache reads
4k keys). A row that sees nothing gets exactly 0.

Quantized K/V: a tile of int8 or e4m3 rows is widened to fp32 and then to q's dtype, exactly
(every int8 and every e4m3 value is an fp16 and a bf16 value), so the score dot product is the
float kernel's, on the stored integers. The scales are then applied per key, not per element:

* each score is multiplied by its key's scale before soft-capping and ALiBi: one multiply per
  score instead of one per K element, and no rounding of ``data * scale`` to q's dtype (a tile
  dequantized in registers would round every element before the dot);
* each probability, once the row's sum ``l`` has it, is multiplied by its value's scale before
  P @ V (attention over ``data * scale``, as the CPU engine computes it). A V scale is about
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
interpreter (``TRITON_INTERPRET=1`` set before this module is imported): that is how CI checks it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._checks import shape_of
from ...kvquant import QUANTIZED_DTYPES
from . import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, NO_CAUSAL, interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: only this module needs it
    triton = tl = None

__all__ = ["available", "decode_attention", "interpreting", "paged_decode_attention", "MAX_Q_LEN", "NO_CAUSAL"]

_LOG2E = 1.4426950408889634
#: A window extent standing for "unbounded" (window positions are within +-NO_CAUSAL, so
#: position +- extent stays inside int32).
UNBOUNDED = 1 << 29


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
    def _split_kernel(
        Q, K, V, TABLE, QSTART, SEQLEN, OP, LSEP, SLOPES, APOS, KS, VS, WSTART,
        scale_log2, softcap,
        stride_qb, stride_qh, stride_qs,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_ksn, stride_kst, stride_ksh,
        stride_vsn, stride_vst, stride_vsh,
        stride_tb,
        HKV, G, S, DK, DR, DV, PAGE, SPLIT_LEN, NSPLIT, NPAGES, WLEFT, WRIGHT,
        V_FROM_K: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
        HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        # Scalar bases in int64 (offsets past 2**31 elements are realistic); per-element offsets
        # from them stay int32 (a sequence's rows of one head), except pages (int64 below).
        Qb = Q + b.to(tl.int64) * stride_qb
        Kh = K + kvh.to(tl.int64) * stride_kh
        Vh = V + kvh.to(tl.int64) * stride_vh
        if QUANT:  # the row scales of this KV head (VS is unread when V comes from K)
            KSh = KS + kvh.to(tl.int64) * stride_ksh
            VSh = VS + kvh.to(tl.int64) * stride_vsh

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * S + j
        row_ok = rows < G * S
        j = rows % S
        h = kvh * G + rows // S
        seq_len = tl.load(SEQLEN + b)
        lim = tl.minimum(tl.load(QSTART + b) + j + 1, seq_len)  # keys < lim are visible
        if HAS_WINDOW:  # and keys >= low: the window around each row's own position
            w_start = tl.load(WSTART + b)
            lim = tl.minimum(lim, w_start + j + WRIGHT + 1)
            low = w_start + j - WLEFT
            base = tl.maximum(w_start - WLEFT, 0)  # the first key any row of the sequence sees
        else:
            base = 0
        if HAS_ALIBI:  # slope of each row's head (log2 units), and the row's ALiBi query position
            slope = tl.load(SLOPES + h, mask=row_ok, other=0.0) * 1.4426950408889634
            apos = tl.load(APOS + b) + j

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
        dv = tl.arange(0, BLOCK_DV)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        start = base + pid_s * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, seq_len)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
            page = tl.load(TABLE + b * stride_tb + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
            # A table entry outside the pool (a caller's checked=True table that lies: checking
            # it would cost a device sync) is never read; its keys count as masked.
            pos_ok = pos_ok & (page >= 0) & (page < NPAGES)
            page = tl.where(pos_ok, page, 0)
            slot = pos % PAGE
            k_base = Kh + page * stride_kn + slot * stride_kt
            k = tl.load(k_base[:, None] + dk[None, :], mask=pos_ok[:, None] & (dk[None, :] < DK), other=0.0)
            if QUANT:  # exact: int8 and e4m3 values are values of q's dtype
                k = _widen(k, FP8).to(q.dtype)
            elif DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if HAS_ROPE:
                k_r = tl.load(k_base[:, None] + DK + dr[None, :], mask=pos_ok[:, None] & (dr[None, :] < DR),
                              other=0.0)
                if QUANT:
                    k_r = _widen(k_r, FP8).to(q_r.dtype)
                elif DOT_F32:
                    k_r = k_r.to(tl.float32)
                s += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
            if QUANT:  # each key's score times its K row scale, before soft-capping and ALiBi
                ksc = tl.load(KSh + page * stride_ksn + slot * stride_kst, mask=pos_ok, other=0.0)
                s = s * ksc[None, :]
            if HAS_SOFTCAP:  # c * tanh(scaled score / c), in log2 units after
                y = s * (scale_log2 * 0.6931471805599453 / softcap)
                e = tl.exp2(-2.8853900817779268 * tl.abs(y))  # exp(-2|y|)
                t = (1.0 - e) / (1.0 + e)
                s = tl.where(y < 0, -t, t) * (softcap * 1.4426950408889634)
            else:
                s = s * scale_log2
            if HAS_ALIBI:
                s += slope[:, None] * (pos[None, :] - apos[:, None]).to(tl.float32)
            vis = (pos[None, :] < lim[:, None]) & pos_ok[None, :]
            if HAS_WINDOW:
                vis = vis & (pos[None, :] >= low[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_FROM_K:
                v = k  # V = K[..., :Dv]: the tile just read (DK == DV), widened if quantized
            else:
                v_base = Vh + page * stride_vn + slot * stride_vt
                v = tl.load(v_base[:, None] + dv[None, :], mask=pos_ok[:, None] & (dv[None, :] < DV), other=0.0)
                if QUANT:
                    v = _widen(v, FP8).to(q.dtype)
                elif DOT_F32:
                    v = v.to(tl.float32)
            if QUANT:  # each probability (l_i has it) times its V row scale, over the tile's largest
                if V_FROM_K:
                    vsc = ksc
                else:
                    vsc = tl.load(VSh + page * stride_vsn + slot * stride_vst, mask=pos_ok, other=0.0)
                top = tl.max(tl.where(pos_ok & (tl.abs(vsc) < float("inf")), tl.abs(vsc), 0.0), 0)
                top = tl.where(top > 0.0, top, 1.0)
                p = tl.where(vis, p * (vsc / top)[None, :], 0.0)
            # P rounded to q's (the float cache's) dtype, as every fused kernel does (a no-op for fp32).
            p = p.to(Q.dtype.element_ty)
            if DOT_F32:
                p = p.to(tl.float32)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            if QUANT:
                pv = pv * top
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        seen = l_i > 0.0
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        # Partials are contiguous (B, Hq, S, NSPLIT[, DV]); row (b, h, j).
        prow = ((b * HKV * G + h) * S + j).to(tl.int64) * NSPLIT + pid_s
        tl.store(LSEP + prow, lse, mask=row_ok)
        tl.store(OP + prow[:, None] * DV + dv[None, :], out, mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _merge_kernel(OP, LSEP, OUT, SINKS, NSPLIT, DV, HQ, S, HAS_SINKS: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                      BLOCK_DV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # (b, h, j) flattened; OUT is contiguous (B, Hq, S, DV)
        sp = tl.arange(0, BLOCK_SPLIT)
        dv = tl.arange(0, BLOCK_DV)
        lse = tl.load(LSEP + row * NSPLIT + sp, mask=sp < NSPLIT, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # splits that saw nothing: 0
        den = tl.sum(w, 0)
        if HAS_SINKS:  # the head's sink joins the denominator once (a row that saw nothing stays 0)
            sink = tl.load(SINKS + (row // S) % HQ) * 1.4426950408889634
            den += tl.where(mx == float("-inf"), 0.0, tl.exp2(sink - mx))
        o = tl.load(OP + (row * NSPLIT + sp[:, None]) * DV + dv[None, :],
                    mask=(sp[:, None] < NSPLIT) & (dv[None, :] < DV), other=0.0)
        res = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
        tl.store(OUT + row * DV + dv, res.to(OUT.dtype.element_ty), mask=dv < DV)


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
    return dict(DK=dk, DR=dr, BLOCK_DK=bdk, BLOCK_DR=bdr, BLOCK_DV=bdv, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=4 if width <= 512 else 8, num_stages=3)


def _num_splits(device: torch.device, programs: int, max_len: int, block_n: int) -> int:
    """Enough splits to give every SM about two programs, never a split shorter than a tile."""
    if device.type != "cuda":
        return max(1, min(4, -(-max_len // (4 * block_n))))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, programs))
    return max(1, min(want, -(-max_len // block_n), 64))


def _launch(q: Tensor, k: Tensor, v: Tensor | None, table: Tensor, q_start: Tensor, seq_lens: Tensor,
            scale: float, v_head_dim: int, max_len: int, num_splits: int, softcap: float = 0.0,
            slopes: Tensor | None = None, alibi_start: Tensor | None = None, sinks: Tensor | None = None,
            k_scale: Tensor | None = None, v_scale: Tensor | None = None, window_start: Tensor | None = None,
            window_left: int = 0, window_right: int = 0) -> Tensor:
    """q (B, Hq, S, D); k (N, page, Hkv, D) and v (N, page, Hkv, Dv) | None (V = K[..., :Dv]),
    last dims contiguous; table (B, nb) int; q_start, seq_lens (B,) int32; softcap (0: off);
    slopes (Hq,) fp32 with alibi_start (B,) int32 (ALiBi query position of each sequence's first
    query); sinks (Hq,) fp32; quantized (int8 / fp8 e4m3) k and v: k_scale (N, page, Hkv) and
    v_scale (N, page, Hkv) | None (with v None) fp32, any strides; window_start (B,) int32 with
    window_left / window_right in [0, UNBOUNDED]: a sliding window. Returns (B, Hq, S, Dv)."""
    B, Hq, S, D = q.shape
    page, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    Dv = v_head_dim
    out = torch.empty((B, Hq, S, Dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    v_from_k = v is None
    cfg = _config(q.dtype, D, Dv, G * S, v_from_k)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    m_tiles = -(-G * S // block_m)
    span = max(1, max_len)  # keys the splits of a sequence cover
    if window_start is not None and max(window_left, window_right) < UNBOUNDED:
        span = max(1, min(span, window_left + window_right + S))  # what the rows of a window can see
    longest = -(-span // block_n)  # key tiles of the longest span
    num_splits = _num_splits(q.device, B * Hkv * m_tiles, span, block_n) if num_splits <= 0 \
        else min(num_splits, longest, 1024)
    split_len = -(-span // num_splits)
    split_len = -(-split_len // block_n) * block_n
    op = torch.empty((B, Hq, S, num_splits, Dv), dtype=torch.float32, device=q.device)
    lsep = torch.empty((B, Hq, S, num_splits), dtype=torch.float32, device=q.device)
    quant = k_scale is not None
    fp8 = quant and k.dtype != torch.int8
    if fp8:  # e4m3 rows go in as their bytes: the kernel decodes them (_widen), on any GPU
        k, v = k.view(torch.uint8), None if v_from_k else v.view(torch.uint8)
    vv = k if v_from_k else v
    ks = k_scale if quant else lsep  # unread when not quantized
    vs = ks if v_scale is None else v_scale
    scale_strides = (*ks.stride(), *vs.stride()) if quant else (0,) * 6  # (N, page, Hkv) each
    _split_kernel[(B * Hkv, m_tiles, num_splits)](
        q, k, vv, table, q_start, seq_lens, op, lsep,
        seq_lens if slopes is None else slopes, seq_lens if alibi_start is None else alibi_start,  # unread if off
        ks, vs, seq_lens if window_start is None else window_start,  # unread if off
        scale * _LOG2E, float(softcap),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        vv.stride(0), vv.stride(1), vv.stride(2),
        *scale_strides,
        table.stride(0),
        Hkv, G, S, cfg["DK"], cfg["DR"], Dv, page, split_len, num_splits, k.shape[0], window_left, window_right,
        V_FROM_K=v_from_k, HAS_ROPE=cfg["DR"] > 0, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton 3.9's interpreter computes bf16 dots wrongly: there, operands go up to fp32 (exact
        # products, fp32 sums: what the GPU's bf16 dot with fp32 accumulation gives).
        DOT_F32=q.dtype == torch.bfloat16 and interpreting(),
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=slopes is not None, QUANT=quant, FP8=fp8,
        HAS_WINDOW=window_start is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=cfg["BLOCK_DK"], BLOCK_DR=cfg["BLOCK_DR"],
        BLOCK_DV=cfg["BLOCK_DV"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    _merge_kernel[(B * Hq * S,)](op, lsep, out, lsep if sinks is None else sinks, num_splits, Dv, Hq, S,
                                 HAS_SINKS=sinks is not None, BLOCK_SPLIT=_pow2(num_splits, 2), BLOCK_DV=_pow2(Dv))
    return out


# ------------------------------------------------------------------ custom op (torch.compile)

@torch.library.custom_op("attnkit::decode_attention", mutates_args=())
def _decode_op(q: Tensor, k: Tensor, v: Tensor | None, table: Tensor, q_start: Tensor, seq_lens: Tensor,
               scale: float, v_head_dim: int, max_len: int, num_splits: int, softcap: float = 0.0,
               slopes: Tensor | None = None, alibi_start: Tensor | None = None,
               sinks: Tensor | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
               window_start: Tensor | None = None, window_left: int = 0, window_right: int = 0) -> Tensor:
    why = available(q.device)
    if why:
        raise RuntimeError(f"attnkit::decode_attention: {why}")
    return _launch(q, k, v, table, q_start, seq_lens, scale, v_head_dim, max_len, num_splits, softcap, slopes,
                   alibi_start, sinks, k_scale, v_scale, window_start, window_left, window_right)


@_decode_op.register_fake
def _(q, k, v, table, q_start, seq_lens, scale, v_head_dim, max_len, num_splits, softcap=0.0, slopes=None,
      alibi_start=None, sinks=None, k_scale=None, v_scale=None, window_start=None, window_left=0, window_right=0):
    B, Hq, S, _ = q.shape
    return q.new_empty((B, Hq, S, v_head_dim))


# ------------------------------------------------------------------ public entry points

def _lengths(x, name: str, B: int, device, default: Tensor | None = None) -> Tensor:
    if x is None:
        return default
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.shape not in ((B,), ()):
        raise ValueError(f"{name} must be an int or a ({B},) int tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return t.expand(B)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor | None, block_table: Tensor, seq_lens,
                           *, q_start=None, scale: float | None = None, v_head_dim: int | None = None,
                           max_len: int | None = None, num_splits: int = 0, check: bool = True,
                           softcap: float | None = None, alibi_slopes: Tensor | None = None, alibi_start=None,
                           sinks: Tensor | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, window: tuple[int | None, int | None] | None = None,
                           window_start=None) -> Tensor:
    """Attention of a few new queries per sequence over a paged KV cache, in one fused kernel.

    Args:
        q: (B, Hq, S, D), S <= 16 query tokens per sequence (decode, speculative verification).
        k_pool: (N, page, Hkv, D) key pages in q's dtype, or int8 / fp8 e4m3 with ``k_scale``;
            Hq must be a multiple of Hkv.
        v_pool: (N, page, Hkv, Dv) value pages of k_pool's dtype, or None: V is
            ``k_pool[..., :v_head_dim]`` (MLA), scaled by ``k_scale`` when quantized.
        block_table: (B, max_blocks) int: sequence b's token t lives in page
            ``block_table[b, t // page]`` at slot ``t % page``.
        seq_lens: (B,) or int: keys per sequence (including this step's tokens).
        q_start: (B,) or int position of each sequence's first query; default ``seq_lens - S``
            (causal). Query j sees keys ``< min(q_start + j + 1, seq_lens)``.
        scale: default 1 / sqrt(D).
        v_head_dim: Dv when ``v_pool`` is None (required then).
        max_len: max(seq_lens) if known on the host (saves a device sync).
        num_splits: context splits per sequence (0: chosen from the GPU's SM count).
        check: validate lengths and block table entries against the pool (a device sync); callers
            that built them on the host (the caches, the ``triton`` backend) pass False.
        softcap: c of ``c * tanh(score / c)`` on the scaled scores (Gemma 2).
        alibi_slopes: (Hq,) ALiBi slopes, with ``alibi_start`` (B,) or int: the ALiBi position of
            each sequence's first query (default ``q_start``); adds ``slope * (key - query)``.
        sinks: (Hq,) logits joining each row's softmax denominator (gpt-oss).
        k_scale: (N, page, Hkv) fp32 scales of quantized ``k_pool`` rows (:mod:`attnkit.kvquant`):
            attention over ``k_pool * k_scale[..., None]``; any strides.
        v_scale: (N, page, Hkv) fp32 scales of quantized ``v_pool`` rows (None with v_pool None).
        window: ``(left, right)`` extents (ints >= 0, None: unbounded) of a sliding window
            (:class:`attnkit.masks.SlidingWindow`): query j also sees only the keys within
            ``[w - left, w + right]`` of its window position ``w = window_start + j``.
        window_start: (B,) or int window position of each sequence's first query; default
            ``seq_lens - S`` (bottom-right).

    Returns:
        (B, Hq, S, Dv) in q's dtype; a query that sees no key gets 0.
    """
    why = available(q.device if isinstance(q, Tensor) else None)
    if why:
        raise RuntimeError(f"paged_decode_attention: {why}")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be (B, Hq, S, D), got shape {shape_of(q)}")
    if not isinstance(k_pool, Tensor) or k_pool.dim() != 4:
        raise ValueError(f"k_pool must be (N, page, Hkv, D), got shape {shape_of(k_pool)}")
    B, Hq, S, D = q.shape
    N, page, Hkv, Dk = k_pool.shape
    if Dk != D:
        raise ValueError(f"q {shape_of(q)} and k_pool {shape_of(k_pool)} must share the head dim")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}, q {shape_of(q)}) must be a multiple of KV heads ({Hkv}, k_pool "
                         f"{shape_of(k_pool)})")
    if S > MAX_Q_LEN:
        raise ValueError(f"q has {S} tokens per sequence (shape {shape_of(q)}); this kernel takes at most {MAX_Q_LEN}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} (q {shape_of(q)}) is above the kernel's {MAX_HEAD_DIM}")
    if v_pool is None:
        if v_head_dim is None or not 0 < v_head_dim <= D:
            raise ValueError(f"with v_pool=None (V = K[..., :Dv]) v_head_dim must be in [1, D={D}], got {v_head_dim}")
        Dv = v_head_dim
    else:
        if not isinstance(v_pool, Tensor) or v_pool.dim() != 4 or v_pool.shape[:3] != k_pool.shape[:3]:
            raise ValueError(f"v_pool must be (N, page, Hkv, Dv) matching k_pool {shape_of(k_pool)}, got "
                             f"{shape_of(v_pool)}")
        if v_head_dim is not None and v_head_dim != v_pool.shape[3]:
            raise ValueError(f"v_head_dim={v_head_dim} but v_pool {shape_of(v_pool)}")
        Dv = v_pool.shape[3]
    if Dv > MAX_V_HEAD_DIM:
        raise ValueError(f"value head dim {Dv} is above the kernel's {MAX_V_HEAD_DIM}")
    if k_scale is not None or v_scale is not None or k_pool.dtype in QUANTIZED_DTYPES:
        _check_quantized(q, k_pool, v_pool, k_scale, v_scale)
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t is not None and ((t.dtype != q.dtype and k_scale is None) or t.device != q.device):
            raise TypeError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != B \
            or block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise ValueError(f"block_table must be a (B={B}, max_blocks) int tensor, got "
                         f"{getattr(block_table, 'dtype', type(block_table).__name__)} of shape {shape_of(block_table)}")
    seq = _lengths(seq_lens, "seq_lens", B, q.device)
    qs = _lengths(q_start, "q_start", B, q.device, default=seq - S if isinstance(seq, Tensor) else None)
    room = block_table.shape[1] * page
    if check and B and not torch.compiler.is_compiling():
        lo, hi = int(seq.min()), int(seq.max())
        if lo < 0 or hi > room:
            raise ValueError(f"seq_lens must be in [0, max_blocks * page = {room}] (block_table "
                             f"{shape_of(block_table)}, page {page}), got {seq.tolist()}")
        if max_len is not None and max_len < hi:
            raise ValueError(f"max_len={max_len} is below the longest sequence ({hi} keys): keys would be skipped")
        used = torch.arange(block_table.shape[1], device=block_table.device)[None] < (-(-seq // page))[:, None]
        bad = used & ((block_table < 0) | (block_table >= N))
        if bool(bad.any()):  # entries past a sequence's last page (padding such as -1) are never read
            raise ValueError(f"block_table entries holding tokens must be in [0, N={N}) (k_pool {shape_of(k_pool)}, "
                             f"block_table {shape_of(block_table)}), got {block_table[bad].tolist()[:8]}")
    if max_len is None:
        max_len = int(seq.max()) if B else 0
    if scale is None:
        scale = D ** -0.5
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    if v_pool is not None and v_pool.stride(-1) != 1:
        v_pool = v_pool.contiguous()
    # The kernel indexes these as contiguous int32 rows.
    slopes = astart = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
        astart = _lengths(alibi_start, "alibi_start", B, q.device, default=qs).to(torch.int32).contiguous()
    sinks = None if sinks is None else sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    w_start, w_left, w_right = None, 0, 0
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or any(
                w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0) for w in window):
            raise ValueError(f"window must be (left, right), each an int >= 0 or None, got {window!r}")
        w_left, w_right = (UNBOUNDED if w is None else min(w, UNBOUNDED) for w in window)
        w_start = _lengths(window_start, "window_start", B, q.device, default=seq - S)
        w_start = w_start.clamp(-NO_CAUSAL, NO_CAUSAL).to(torch.int32).contiguous()
    elif window_start is not None:
        raise ValueError("window_start is given without a window")
    k_scale = None if k_scale is None else k_scale.detach()
    v_scale = None if v_scale is None else v_scale.detach()
    return _decode_op(q, k_pool, v_pool, block_table.to(torch.int32).contiguous(),
                      qs.clamp(-NO_CAUSAL, NO_CAUSAL).to(torch.int32).contiguous(), seq.to(torch.int32).contiguous(),
                      float(scale), int(Dv), int(max_len), int(num_splits), float(softcap or 0.0), slopes, astart,
                      sinks, k_scale, v_scale, w_start, int(w_left), int(w_right))


def _check_quantized(q: Tensor, k_pool: Tensor, v_pool: Tensor | None, k_scale, v_scale) -> None:
    """Quantized pools: int8 / fp8 data of one dtype, with fp32 scales of shape ``pool.shape[:3]``."""
    names = " or ".join(str(d).replace("torch.", "") for d in QUANTIZED_DTYPES)
    if k_scale is None:
        raise ValueError(f"k_pool is {k_pool.dtype} (quantized): pass k_scale, fp32 of shape k_pool.shape[:3] = "
                         f"{tuple(k_pool.shape[:3])}")
    if k_pool.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"k_scale is given, so k_pool must be quantized ({names}), got {k_pool.dtype}")
    if v_pool is not None and v_pool.dtype != k_pool.dtype:
        raise TypeError(f"v_pool is {v_pool.dtype}, k_pool {k_pool.dtype}: quantized K/V share one dtype")
    if (v_pool is None) != (v_scale is None):
        raise ValueError("v_scale must be given with a quantized v_pool and None without one (V read from K uses "
                         "k_scale)")
    for name, sc, pool in (("k_scale", k_scale, k_pool), ("v_scale", v_scale, v_pool)):
        if pool is None:
            continue
        if not isinstance(sc, Tensor) or sc.dtype != torch.float32 or sc.device != q.device:
            raise TypeError(f"{name} must be an fp32 tensor on {q.device}, got "
                            f"{getattr(sc, 'dtype', type(sc).__name__)} on {getattr(sc, 'device', '-')}")
        if sc.shape != pool.shape[:3]:
            raise ValueError(f"{name} must have shape {tuple(pool.shape[:3])} (one scale per row of "
                             f"{shape_of(pool)}), got {shape_of(sc)}")


def decode_attention(q: Tensor, k: Tensor, v: Tensor | None, *, seq_lens=None, q_start=None,
                     scale: float | None = None, v_head_dim: int | None = None, num_splits: int = 0,
                     check: bool = True, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     **modifiers) -> Tensor:
    """:func:`paged_decode_attention` over a contiguous cache: k (B, Hkv, L, D), v (B, Hkv, L, Dv)
    or None (V = ``k[..., :v_head_dim]``). ``seq_lens`` defaults to L and ``q_start`` to
    ``seq_lens - S`` (bottom-right causal); pass ``q_start=NO_CAUSAL`` for no causality.
    Quantized (int8 / fp8 e4m3) k and v take k_scale (B, Hkv, L) and v_scale (B, Hkv, L) | None."""
    if not isinstance(k, Tensor) or k.dim() != 4 or not isinstance(q, Tensor) or q.dim() != 4 or k.shape[0] != q.shape[0]:
        raise ValueError(f"q must be (B, Hq, S, D) and k (B, Hkv, L, D) with the same B, got q {shape_of(q)}, "
                         f"k {shape_of(k)}")
    if v is not None and (not isinstance(v, Tensor) or v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be (B, Hkv, L, Dv) matching k {shape_of(k)}, got {shape_of(v)}")
    B, L = k.shape[0], k.shape[2]
    table = torch.arange(B, dtype=torch.int32, device=k.device)[:, None]
    if L == 0:  # nothing cached: a page of one empty slot keeps the kernel's indexing valid
        if seq_lens is not None and bool((torch.as_tensor(seq_lens) != 0).any()):
            raise ValueError(f"seq_lens must be 0 for an empty cache (k {shape_of(k)}), got {seq_lens}")
        k = k.new_zeros(B, k.shape[1], 1, k.shape[3])
        v = None if v is None else v.new_zeros(B, v.shape[1], 1, v.shape[3])
        k_scale, v_scale = (None if t is None else t.new_zeros(B, t.shape[1], 1) for t in (k_scale, v_scale))
        seq_lens = 0
    seq = torch.full((B,), L, device=k.device) if seq_lens is None else seq_lens
    t12 = lambda t: None if t is None else t.transpose(1, 2)  # noqa: E731 - (B, Hkv, L, ...) as (B, L, Hkv, ...)
    for name, sc, rows in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        if isinstance(sc, Tensor) and rows is not None and sc.shape != rows.shape[:3]:
            raise ValueError(f"{name} must have shape {tuple(rows.shape[:3])} (one scale per row of "
                             f"{shape_of(rows)}), got {shape_of(sc)}")
    return paged_decode_attention(q, t12(k), t12(v), table, seq,
                                  q_start=q_start, scale=scale, v_head_dim=v_head_dim,
                                  max_len=L if seq_lens is None or not check else None, num_splits=num_splits,
                                  check=check, k_scale=t12(k_scale), v_scale=t12(v_scale), **modifiers)
