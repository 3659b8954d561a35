"""CPU decode attention for grouped-query heads, in plain PyTorch ops.

``grouped_decode(q, k, v, scale, bias)`` views q (B, Hq, Sq, D) as (B, Hkv, G*Sq, D), so every
KV head is streamed from memory once for all G*Sq query rows of its group (K/V are never
copied per query head).

Why the fast path looks the way it does (measured on a 2-core AVX2 Zen 3, torch 2.13 CPU):

* bf16/fp16 GEMMs have no fast CPU kernel without AVX512-BF16/AMX (torch falls back to a
  scalar-ish loop: P@V in bf16 runs at ~0.3 GB/s). fp32 GEMM (MKL) is fast. So K and V are
  converted to fp32 in cache-sized chunks (``buf.copy_(k_chunk)``, a vectorised convert that
  reads bf16 at DRAM speed) into a reused per-thread buffer, and the matmuls run in fp32 on data
  that is still in L2. Nothing of size Sk*D is ever materialised in fp32.
* Scores for one KV head are only (G*Sq, Sk) fp32 (512 KiB at G*Sq=4, Sk=32k), so the softmax
  is not "online": all scores of a head are computed first, then one max, ``exp`` in place, and
  P@V accumulated with ``addmm_`` over the same chunks. P stays fp32 (better than the eager
  baseline, which rounds scores to the input dtype) and normalisation is applied to the small
  output, not to P.
* When V is a prefix view of K (MLA's latent cache: V = K[..., :Dv], same memory), the two
  passes would stream the same memory twice, so ``_one_pass_units`` reads (and converts) each
  K chunk once and feeds it to both matmuls while it is in cache, with an online softmax
  across chunks (running max; the sum and P@V rescaled when it grows). MLA absorbed decode
  (16 heads over one latent head, D=576, Dv=512, 1 thread): ~15-25% less time for fp32,
  ~5-12% for bf16 (where the convert and the two GEMMs, not memory traffic, dominate).
* The two or more cores are used by running disjoint sets of KV heads in Python threads (torch
  ops release the GIL), each with intra-op threading set to 1; the GEMMs here are far too small
  (M = G*Sq) for MKL/OpenMP to split them profitably. When there are fewer (batch, KV head)
  units than threads, or they do not divide evenly, the context is split as well and the
  partial results are merged with the usual log-sum-exp rescaling (flash-decoding).
* Rows whose scores are all -inf return exactly 0: the row max is clamped to a finite value so
  ``exp`` gives 0 everywhere, and the denominator is clamped to >= 1 (a row with any finite
  score has denominator >= 1, because its max element contributes exp(0) = 1).

Autograd: when grad mode is on and any input requires grad, or for fp64, a plain grouped
single-call path (fp32/fp64 math, safe softmax) is used, which autograd differentiates.
"""

from __future__ import annotations

import torch

from .._threads import at_fork, run_split
from ..reference import safe_softmax

__all__ = ["grouped_decode"]

# Bytes of fp32 per converted K/V chunk: 1 MiB = 2048 rows at D=128, i.e. the size of L2.
# Measured (bf16, Sk=32k, 2 threads, interleaved runs): 256 KiB 84 ms, 512 KiB 62 ms,
# 1 MiB 52 ms, 2 MiB 66 ms on a loaded machine; in a quiet run 1-2 MiB also beat 256-512 KiB.
_CHUNK_BYTES = 1 << 20
# The same for the one-pass path (V a prefix of K), where one chunk feeds both matmuls.
# Measured (MLA absorbed decode: 16 query heads, D=576, Dv=512, 1 thread, thread CPU time,
# interleaved medians, loaded machine), ctx 4k / 16k: fp32 512 KiB 4.46 / 17.3 ms, 1 MiB 5.28 /
# 15.7, 2 MiB 4.99 / 14.9, 3 MiB 4.97 / 15.1, 4 MiB 5.03 / 15.6 (runs differ; within a run
# 2-3 MiB was best for fp32 and bf16 at both contexts).
_CHUNK_BYTES_ONE_PASS = 2 << 20
# Below this many K+V elements per thread, a thread pool costs more than it saves.
_MIN_ELEMS_PER_THREAD = 1 << 18

# Below these K+V elements per (batch, KV head), one whole-tensor call beats the per-head loop
# (Python overhead per head; fp32 GEMMs need no conversion). Measured, bf16 B=8 ctx=1024:
# per-head 13 ms vs whole 43 ms; fp32 B=8 ctx=1024: per-head 13.5 ms vs whole 8.6 ms.
_MIN_UNIT_ELEMS_HALF = 1 << 18  # Sk >= 1024 at D = Dv = 128
_MIN_UNIT_ELEMS_FP32 = 1 << 20  # Sk >= 4096 at D = Dv = 128

_workspaces: dict[int, dict[str, torch.Tensor]] = {}  # per worker slot (see attnkit._threads)
at_fork(_workspaces.clear)


def _workspace(slot: int | None, name: str, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) fp32 scratch buffer, reused across calls for pooled slots (fresh large
    allocations page-fault on every call, which costs ~1 ms per 4 MiB)."""
    if slot is None:
        return torch.empty(rows, cols, dtype=torch.float32)
    ws = _workspaces.setdefault(slot, {})
    buf = ws.get(name)
    if buf is None or buf.shape[0] < rows or buf.shape[1] < cols:
        r = rows if buf is None else max(rows, buf.shape[0])
        c = cols if buf is None else max(cols, buf.shape[1])
        with torch.inference_mode(False):  # a plain tensor, usable in and out of inference mode
            buf = torch.empty(r, c, dtype=torch.float32)
        ws[name] = buf
    return buf[:rows, :cols]


# --------------------------------------------------------------------------- plain path


def _plain(q, k, v, scale, bias, G):
    """Grouped path in whole-tensor ops; differentiable. Math in fp32 (fp64 for fp64 inputs).
    Without grad, batch items go in slices so the fp32 copies of K/V stay under ~64 MiB."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    step = B
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        step = max(1, (64 << 20) // max(1, 4 * Hkv * Sk * (D + Dv)))
    if step < B:
        def rows(t, i):  # a batch slice, or the tensor itself when it broadcasts over batch
            return t if t is None or t.shape[0] == 1 else t[i:i + step]

        return torch.cat([_plain(q[i:i + step], k[i:i + step], v[i:i + step], scale, rows(bias, i), G)
                          for i in range(0, B, step)])
    ct = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    qg = q.to(ct).reshape(B, Hkv, G * Sq, D)
    s = torch.matmul(qg, k.to(ct).transpose(-1, -2)) * scale  # (B, Hkv, G*Sq, Sk)
    if bias is not None:
        s = (s.view(B, Hkv, G, Sq, Sk) + bias.to(ct)).view(B, Hkv, G * Sq, Sk)
    # Without a mask no row can be all -inf, so the plain softmax is exact (and ~2x cheaper).
    out = torch.matmul(torch.softmax(s, -1) if bias is None else safe_softmax(s), v.to(ct))  # (B, Hkv, G*Sq, Dv)
    return out.reshape(B, Hq, Sq, Dv).to(q.dtype)


# --------------------------------------------------------------------------- fast path

_NEG_BIG = torch.finfo(torch.float32).min


def _run_units(units, inner, qg, k, v, bias_e, G, Sq, m_out, l_out, acc_out, slot, inference=False):
    """Process units (b, h, split, s0, s1) with ``inner`` (``_two_pass_units`` or
    ``_one_pass_units``): scores, exp, P@V for one slice of one KV head.

    Writes the row max m (M,), sum of exp l (M,), and unnormalised P@V (M, Dv) of the unit.
    Grad and inference modes are thread-local, so pool threads take the caller's.
    """
    with torch.inference_mode(inference), torch.no_grad():
        if slot is not None and slot > 0 and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # pool thread; the caller restores the setting afterwards
        inner(units, qg, k, v, bias_e, G, Sq, m_out, l_out, acc_out, slot)


def _v_is_prefix_of_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when v is k[..., :Dv] in memory (MLA's latent cache: V = the first channels of K),
    so every element of v is the element of k at the same index."""
    return (
        v.dtype == k.dtype
        and v.device == k.device
        and v.dim() == k.dim()
        and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1]
        and v.stride() == k.stride()
        and v.data_ptr() == k.data_ptr()
        and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    )


def _two_pass_units(units, qg, k, v, bias_e, G, Sq, m_out, l_out, acc_out, slot):
    """Separate K and V: all scores of a unit first (one max, no rescaling), then P@V."""
    M, D = qg.shape[-2], qg.shape[-1]
    Dv = v.shape[-1]
    conv_k = k.dtype != torch.float32
    conv_v = v.dtype != torch.float32
    ck = max(64, _CHUNK_BYTES // (4 * D))
    cv = max(64, _CHUNK_BYTES // (4 * Dv))
    max_n = max(u[4] - u[3] for u in units)
    sbuf = _workspace(slot, "s", M, max_n)
    kbuf = _workspace(slot, "k", min(ck, max_n), D) if conv_k else None
    vbuf = _workspace(slot, "v", min(cv, max_n), Dv) if conv_v else None
    for b, h, j, s0, s1 in units:
        n = s1 - s0
        s = sbuf[:, :n]
        qh = qg[b, h]
        kh = k[b, h]
        if conv_k:
            for a in range(s0, s1, ck):
                e = min(a + ck, s1)
                kc = kbuf[: e - a]
                kc.copy_(kh[a:e])
                torch.mm(qh, kc.t(), out=s[:, a - s0 : e - s0])
        else:
            torch.mm(qh, kh[s0:s1].t(), out=s)
        if bias_e is not None:
            s.view(G, Sq, n).add_(bias_e[b, h, :, :, s0:s1])
        m = s.amax(-1, keepdim=True).clamp_(min=_NEG_BIG)  # all -inf -> finite, exp() -> 0
        s.sub_(m).exp_()
        m_out[b, h, j] = m.squeeze(-1)
        torch.sum(s, -1, out=l_out[b, h, j])
        acc = acc_out[b, h, j]
        vh = v[b, h]
        if conv_v:
            acc.zero_()
            for a in range(s0, s1, cv):
                e = min(a + cv, s1)
                vc = vbuf[: e - a]
                vc.copy_(vh[a:e])
                acc.addmm_(s[:, a - s0 : e - s0], vc)
        else:
            torch.mm(s, vh[s0:s1], out=acc)


def _one_pass_units(units, qg, k, v, bias_e, G, Sq, m_out, l_out, acc_out, slot):
    """V = K[..., :Dv] (same memory): each K chunk is read (and converted) once and serves both
    matmuls while it is in cache, with an online softmax across chunks (running max m; l and
    acc rescaled by exp(m_old - m_new) when the max grows).

    Masked rows: m starts at the finite _NEG_BIG and only grows, so it is never -inf: a chunk
    where a row is all -inf gives p = exp(-inf - m) = 0, and alpha = exp(m_old - m_new) is
    exp(0) = 1 or exp(huge negative) = 0, never NaN (a row masked so far has l = acc = 0 then
    anyway); a row masked everywhere ends with l = 0, acc = 0, so the caller's clamped
    denominator gives exactly 0.
    """
    M, D = qg.shape[-2], qg.shape[-1]
    Dv = v.shape[-1]
    conv = k.dtype != torch.float32
    c = max(64, _CHUNK_BYTES_ONE_PASS // (4 * D))
    c = max(1, min(c, max(u[4] - u[3] for u in units)))  # no larger buffers than the units need
    sbuf = _workspace(slot, "s", M, c)
    kbuf = _workspace(slot, "k", c, D) if conv else None
    small = _workspace(slot, "m", 4, M)  # running max, new max, rescale factor, chunk sum
    m0, m1, alpha, ls = (small[i].unsqueeze(-1) for i in range(4))  # each (M, 1)
    for b, h, j, s0, s1 in units:
        qh = qg[b, h]
        kh = k[b, h]
        l = l_out[b, h, j].unsqueeze(-1)  # (M, 1)
        acc = acc_out[b, h, j]
        m, m_new = m0, m1
        m.fill_(_NEG_BIG)  # so every max below is finite (>= _NEG_BIG) even if a row is all -inf
        l.zero_()
        acc.zero_()
        for a in range(s0, s1, c):
            e = min(a + c, s1)
            n = e - a
            if conv:
                kc = kbuf[:n]
                kc.copy_(kh[a:e])
            else:
                kc = kh[a:e]
            s = sbuf[:, :n]
            torch.mm(qh, kc.t(), out=s)
            if bias_e is not None:
                s.view(G, Sq, n).add_(bias_e[b, h, :, :, a:e])
            torch.amax(s, -1, keepdim=True, out=m_new)
            torch.maximum(m_new, m, out=m_new)
            torch.sub(m, m_new, out=alpha).exp_()  # <= 1; 0 when m was _NEG_BIG and m_new is not
            s.sub_(m_new).exp_()
            torch.sum(s, -1, keepdim=True, out=ls)
            l.mul_(alpha).add_(ls)
            acc.mul_(alpha).addmm_(s, kc[:, :Dv])
            m, m_new = m_new, m
        m_out[b, h, j] = m.squeeze(-1)


def _fast(q, k, v, scale, bias, G):
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    M = G * Sq
    qg = (q.to(torch.float32) * scale).reshape(B, Hkv, M, D)
    bias_e = None
    if bias is not None:
        bias_e = bias.to(torch.float32).expand(B, Hkv, G, Sq, Sk)

    # Threads: disjoint (batch, KV head) units; split the context too when the units are
    # fewer than the threads or do not divide evenly among them.
    nthreads = torch.get_num_threads()
    total = B * Hkv * Sk * (D + Dv)
    T = max(1, min(nthreads, total // _MIN_ELEMS_PER_THREAD))
    BH = B * Hkv
    if T > 1 and BH % T != 0 and BH < 8 * T:
        nsplit = T
    else:
        nsplit = 1
    nsplit = max(1, min(nsplit, Sk // 256)) if nsplit > 1 else 1
    bounds = [(Sk * j) // nsplit for j in range(nsplit + 1)]
    units = [
        (b, h, j, bounds[j], bounds[j + 1])
        for b in range(B)
        for h in range(Hkv)
        for j in range(nsplit)
    ]
    T = min(T, len(units))

    m_out = torch.empty(B, Hkv, nsplit, M, dtype=torch.float32)
    l_out = torch.empty(B, Hkv, nsplit, M, dtype=torch.float32)
    acc_out = torch.empty(B, Hkv, nsplit, M, Dv, dtype=torch.float32)
    inner = _one_pass_units if _v_is_prefix_of_k(k, v) else _two_pass_units
    args = (inner, qg, k, v, bias_e, G, Sq, m_out, l_out, acc_out)
    inference = torch.is_inference_mode_enabled()

    per = [units[(len(units) * t) // T : (len(units) * (t + 1)) // T] for t in range(T)]
    run_split(per, lambda part, slot: _run_units(part, *args, slot, inference))

    if nsplit == 1:
        out = acc_out[:, :, 0] / l_out[:, :, 0].clamp_min_(1.0).unsqueeze(-1)
    else:
        mx = m_out.amax(2, keepdim=True)
        w = (m_out - mx).exp_()  # (B, Hkv, nsplit, M)
        den = (w * l_out).sum(2)
        out = (acc_out * w.unsqueeze(-1)).sum(2) / den.clamp_min_(1.0).unsqueeze(-1)
    return out.view(B, Hq, Sq, Dv).to(q.dtype)


def grouped_decode(q, k, v, scale: float, bias=None) -> torch.Tensor:
    """Decode attention with grouped-query heads.

    q: (B, Hq, Sq, D) with small Sq; k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); Hq % Hkv == 0 and
    query head h uses KV head h // (Hq // Hkv). bias: None or a float tensor broadcastable to
    (B, Hkv, G, Sq, Sk), G = Hq // Hkv, added to the fp32 scores. Returns (B, Hq, Sq, Dv) in
    q.dtype; rows whose scores are all -inf are exactly 0. Softmax and both matmuls run in
    fp32 (fp64 for fp64 inputs). Inputs may be non-contiguous (e.g. a slice of a cache).
    """
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    if bias is not None and bias.dim() < 5:  # leading 1s: the batch slicing below reads dim 0 as B
        bias = bias.reshape((1,) * (5 - bias.dim()) + tuple(bias.shape))
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (bias is not None and bias.requires_grad)
    )
    per_unit = k.shape[2] * (D + v.shape[-1])
    if (
        needs_grad
        or q.device.type != "cpu"
        or torch.compiler.is_compiling()
        or torch.float64 in (q.dtype, k.dtype, v.dtype)
        or not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point())
        or q.numel() == 0
        or v.shape[-1] == 0
        or per_unit < (_MIN_UNIT_ELEMS_FP32 if k.dtype == torch.float32 else _MIN_UNIT_ELEMS_HALF)
    ):
        return _plain(q, k, v, scale, bias, G)
    return _fast(q, k, v, scale, bias, G)
