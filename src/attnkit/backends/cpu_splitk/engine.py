"""The CPU split-K engine: one implementation of few-query attention over contiguous or paged K/V,
shared by the ``decode`` and ``paged`` backends; its merge rule is the ring's too.

Notation: B batch, Hq / Hkv query / KV heads, G = Hq // Hkv, Sq queries per sequence, M = G * Sq
query rows per KV head, Sk keys, D / Dv head dims.

Two implementations with one semantics:

* native (:mod:`attnkit.native`): a C++ kernel compiled on first use for the CPU it runs
  on, threads from torch's intra-op pool. Each unit (sequence, KV head, key slice) streams its
  keys once for all M query rows, converting fp16/bf16 rows to fp32 in registers-sized tiles,
  with an online softmax; slices merge by log-sum-exp.
* torch: the same in torch ops, key chunk by key chunk, when no compiler is available.

The mask reaches the engine as one interval of keys per query row (``Mask.key_range``: causal,
windows, padding, the paged ``lengths``), so nothing of size (Sq, Sk) is built; a mask that is not
an interval becomes an fp32 bias. Contract (as :func:`attnkit.attention`): a row with no visible
key is exactly 0 (lse -inf); NaN in a visible score gives NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import native
from ...kvquant import finite_or_nan
from ...masks import Mask, ReducedMask

__all__ = ["splitk_attention", "merge_partials", "finite", "engine_name", "v_is_prefix_of_k"]

#: Quantized storage dtypes whose rows the torch path zeroes as raw bytes (fp8 has no masked_fill).
_BYTE_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)

#: fp32 bytes of K+V per chunk in the torch implementation: the converted chunk stays in cache.
_TORCH_CHUNK_BYTES = 8 << 20


def engine_name() -> str:
    """"native" or "torch": the implementation the engine runs on this machine."""
    return "native" if native.load() is not None else "torch"


def finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row with nothing visible) replaced by 0, to subtract safely."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge_partials(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Exact merge of two partial results over disjoint key sets (flash-decoding's rule).

    ``out``/``block_out`` (..., Sq, Dv) each normalised over its own keys, ``lse``/``block_lse``
    (..., Sq). Returns the (out, lse) of attending to both key sets. Rows where both lse are -inf
    stay 0 / -inf, with zero (not NaN) gradients; NaN propagates."""
    both_empty = torch.isneginf(lse) & torch.isneginf(block_lse)
    # logaddexp(-inf, -inf)'s gradient is NaN: feed it zeros there and select -inf after.
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    new = torch.logaddexp(torch.where(both_empty, zero, lse), torch.where(both_empty, zero, block_lse))
    new = torch.where(both_empty, torch.full_like(new, float("-inf")), new)
    ref = finite(new)
    merged = out * torch.exp(lse - ref).unsqueeze(-1) + block_out * torch.exp(block_lse - ref).unsqueeze(-1)
    return merged, new


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Join per-head sink logits to finished (out, lse): each row's denominator gains
    exp(sink), which carries no value. ``out`` (B, Hq, Sq, Dv), ``lse`` (B, Hq, Sq), ``sinks`` (Hq,)
    in their dtype. Returns (out * exp(lse - lse'), lse') with lse' = logaddexp(lse, sink); a row
    with nothing allowed (lse -inf) stays exactly 0 and gets lse' = sink."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - new).unsqueeze(-1), new


def v_is_prefix_of_k(k: Tensor, v: Tensor) -> bool:
    """True when v is k[..., :Dv] in memory (MLA's latent cache: V = the first channels of K).
    Always False under a trace: traced tensors have no addresses (dynamo cannot compare data
    pointers; torch 2.11 failed compiled MLA decode on CUDA there), so V is then read through
    its own view, which gives the same result."""
    if torch.compiler.is_compiling():
        return False
    return (v.dtype == k.dtype and v.device == k.device and v.dim() == k.dim() and v.shape[:-1] == k.shape[:-1]
            and v.shape[-1] <= k.shape[-1] and v.stride() == k.stride() and v.data_ptr() == k.data_ptr())


def _bounds(reduced: ReducedMask, B: int, Hq: int, Sq: int, Sk: int, device,
            shift: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lo (B, Sq), hi (B, Sq)) int64 key intervals of the mask without its ALiBi part, and an
    fp32 bias (B|1, Hq|1, Sq, Sk) for a mask that is not an interval (then each row's interval
    spans its allowed keys). ``shift``: subtract each row's largest bias (not with sinks, whose
    ratio to the scores a shift would change)."""
    rng = reduced.intervals(device)
    bias = None
    if rng is None:
        allowed, b = reduced.dense(device, alibi=False, shift=shift)
        b = torch.zeros((), device=device) if b is None else b.float()
        bias = b.masked_fill(~allowed, float("-inf"))
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        lo, hi = _allowed_span(allowed, Sk)
    else:
        lo, hi = rng
    lo = lo.to(device=device, dtype=torch.long).clamp(0, Sk).expand(B, Sq).contiguous()
    hi = hi.to(device=device, dtype=torch.long).clamp(0, Sk).expand(B, Sq).contiguous()
    return lo, hi, bias


def _allowed_span(allowed: Tensor, Sk: int) -> tuple[Tensor, Tensor]:
    """(lo, hi) (B|1, Sq): the first allowed key and one past the last of each query row, over
    every head (lo = hi = 0 for a row that allows nothing). A mask that is not an interval still
    bounds the keys the engine reads: a paged sequence's keys past its length are never allowed,
    so its table entries there (padding, such as -1) are never read."""
    seen = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).any(1)  # (B|1, Sq, Sk)
    any_key = seen.any(-1)
    lo = seen.to(torch.uint8).argmax(-1)  # the first True (argmax returns the first maximum)
    hi = Sk - seen.flip(-1).to(torch.uint8).argmax(-1)
    zero = torch.zeros((), dtype=torch.long, device=allowed.device)
    return torch.where(any_key, lo, zero), torch.where(any_key, hi, zero)


def splitk_attention(q: Tensor, k: Tensor, v: Tensor | None, *, scale: float,
                     mask: Mask | ReducedMask | None = None,
                     block_table: Tensor | None = None, v_head_dim: int | None = None, kv_len: int | None = None,
                     sinks: Tensor | None = None, softcap: float | None = None,
                     k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     return_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention on CPU without autograd: a decode step's few queries in one engine call, longer
    calls (soft-capped or ALiBi prefill) a chunk of :data:`Q_CHUNK` queries at a time.

    Args:
        q: (B, Hq, Sq, D).
        k, v: dense (B, Hkv, Sk, D) / (B, Hkv, Sk, Dv), or with ``block_table`` the pools
            (N, bs, Hkv, D) / (N, bs, Hkv, Dv). ``v=None``: V is K[..., :v_head_dim].
        mask: an attnkit mask over (B, Hq, Sq, Sk) (the paged lengths already folded in), or the
            call's :class:`attnkit.masks.ReducedMask` (what the backend passes).
        block_table: (B, W) block ids for paged pools; ``kv_len`` is then the logical Sk.
        sinks: (Hq,) logits joining each row's denominator; softcap: c of c * tanh(s / c);
            an :class:`attnkit.masks.ALiBi` in ``mask`` is applied per score.
        k_scale, v_scale: quantized K/V (int8 / fp8 ``k`` and ``v``, :mod:`attnkit.kvquant`): fp32
            scales of their rows, ``k.shape[:3]`` / ``v.shape[:3]`` (``v_scale`` None with ``v``
            None). A key's score is its dot product with the quantized row times its K scale, and
            its probability is multiplied by its V scale before P @ V: attention over
            ``data * scale`` without building it.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype and, with ``return_lse``, lse (B, Hq, Sq) fp32 (without
        the sinks).
    """
    B, Hq, Sq, D = q.shape
    if v is not None and block_table is None and v_is_prefix_of_k(k, v) and (
            k_scale is None or v_scale is None or v_scale is k_scale):
        v_head_dim, v, v_scale = v.shape[-1], None, None
    Dv = v.shape[-1] if v is not None else int(v_head_dim)
    Hkv = k.shape[2] if block_table is not None else k.shape[1]
    Sk = kv_len if block_table is not None else k.shape[2]
    reduced = mask if isinstance(mask, ReducedMask) else ReducedMask(mask, B, Sq, Sk)
    alibi = reduced.alibi  # computed per score, never materialized
    # Traced code never builds or loads the library (auto takes this engine under torch.compile
    # only once it is loaded): the op is called by name, its Meta kernel gives the shapes.
    ops = (torch.ops.attnkit_cpu if native.library_path() is not None else None) \
        if torch.compiler.is_compiling() else native.load()
    if Sq > Q_CHUNK:
        return _chunked(q, k, v, Dv, Hkv, Sk, scale, reduced, block_table, sinks, softcap, return_lse, k_scale,
                        v_scale)
    if ops is not None and reduced.rest is None and block_table is None:
        lo = hi = bias = None  # the kernel's default: every row sees all Sk keys
    elif ops is not None and Sq == 1 and reduced.padding_lengths is not None:
        # A decode step over right-padded keys (a paged call's lengths, a static cache's step):
        # each row sees its sequence's keys [0, length). No interval tensors to build: the kernel
        # reads hi as B * Sq = B contiguous int64, which the (B,) lengths already are. Paged
        # lengths were validated against the pages; dense ones may pass Sk (all keys allowed).
        lo, bias, hi = None, None, reduced.padding_lengths
        if block_table is None:
            hi = hi.clamp(max=Sk)
        if hi.dtype != torch.long or hi.device != q.device or not hi.is_contiguous():
            hi = hi.to(device=q.device, dtype=torch.long).contiguous()
    else:
        lo, hi, bias = _bounds(reduced, B, Hq, Sq, Sk, q.device, shift=sinks is None)
    slopes = qpos = None
    if alibi is not None:
        slopes = alibi.slopes.to(q.device).contiguous()
        if not (ops is not None and block_table is None and alibi.offsets is None and alibi.align == "bottom_right"):
            qpos = alibi.positions(Sq, Sk, q.device).expand(B, Sq).contiguous()  # else the kernel's default
    sinks32 = None if sinks is None else sinks.detach().float().contiguous()
    if ops is not None:
        b32 = None if bias is None else bias.expand(B, Hq, Sq, Sk)
        out, lse = ops.splitk_attention(_plain(q, whole=True), _plain(k), None if v is None else _plain(v),
                                        _scales(k_scale), _scales(v_scale), Dv, _table(block_table), lo, hi, b32,
                                        slopes, qpos, sinks32, float(scale), float(softcap or 0.0), Hkv, return_lse)
        return out, (lse if return_lse else None)
    out, lse = _torch_splitk(q, k, v, Dv, Hkv, Sk, scale, lo, hi, bias, block_table, softcap, slopes, qpos,
                             k_scale, v_scale)
    if sinks32 is not None:
        out = with_sinks(out, lse, sinks32)[0]
    return out.to(q.dtype), (lse if return_lse else None)


def _plain(t: Tensor, whole: bool = False) -> Tensor:
    """``t`` as the kernel reads it: detached, unit stride in the last dim (``whole``: contiguous).
    A last dim of size 1 has no meaningful stride (``contiguous()`` keeps any): the kernel reads
    it as it is. Copies and detaches only when needed: each skipped no-op is a dispatch on every
    decode step."""
    if t.requires_grad:
        t = t.detach()
    if not (t.is_contiguous() if whole else t.stride(-1) == 1 or t.shape[-1] <= 1):
        t = t.contiguous()
    return t


def _scales(scale: Tensor | None) -> Tensor | None:
    """Row scales as the kernel reads them: fp32, detached (any strides)."""
    if scale is None:
        return None
    return scale.detach() if scale.dtype == torch.float32 else scale.detach().float()


def _table(block_table: Tensor | None) -> Tensor | None:
    """The (B, W) block table as the kernel reads it: int64, contiguous."""
    if block_table is None or (block_table.dtype == torch.long and block_table.is_contiguous()):
        return block_table
    return block_table.long().contiguous()


#: Query rows per engine call. A call scores all G * Sq rows of a KV head against each key tile,
#: with partial results per key slice: longer calls (prefill with a soft cap, which no SDPA kernel
#: takes) go a chunk of queries at a time, which bounds those buffers and lets each chunk stop at
#: the last key its rows see (causal prefill does about half the work).
Q_CHUNK = 64


def _chunked(q, k, v, Dv, Hkv, Sk, scale, reduced, block_table, sinks, softcap, return_lse, k_scale=None,
             v_scale=None):
    """:func:`splitk_attention` a chunk of Q_CHUNK queries at a time: the intervals, bias and
    ALiBi positions of the whole call, sliced per chunk."""
    B, Hq, Sq, _ = q.shape
    alibi = reduced.alibi
    lo, hi, bias = _bounds(reduced, B, Hq, Sq, Sk, q.device, shift=sinks is None)
    slopes = qpos = None
    if alibi is not None:
        slopes = alibi.slopes.to(q.device).contiguous()
        qpos = alibi.positions(Sq, Sk, q.device).expand(B, Sq).contiguous()
    ops = native.load()
    out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype if ops is not None else torch.float32, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device) if return_lse or ops is None else None
    sinks32 = None if sinks is None else sinks.detach().float().contiguous()
    if ops is not None:
        k = _plain(k)
        v = None if v is None else _plain(v)
    table = _table(block_table)
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(Sq, i0 + Q_CHUNK)
        lo_c, hi_c = lo[:, i0:i1].contiguous(), hi[:, i0:i1].contiguous()
        b_c = None if bias is None else bias.expand(B, Hq, Sq, Sk)[:, :, i0:i1]
        p_c = None if qpos is None else qpos[:, i0:i1].contiguous()
        if ops is not None:
            o, l_c = ops.splitk_attention(_plain(q[:, :, i0:i1], whole=True), k, v, _scales(k_scale),
                                          _scales(v_scale), Dv, table, lo_c, hi_c, b_c, slopes, p_c, sinks32,
                                          float(scale), float(softcap or 0.0), Hkv, return_lse)
        else:
            o, l_c = _torch_splitk(q[:, :, i0:i1], k, v, Dv, Hkv, Sk, scale, lo_c, hi_c, b_c, block_table, softcap,
                                   slopes, p_c, k_scale, v_scale)
        out[:, :, i0:i1] = o
        if lse is not None:
            lse[:, :, i0:i1] = l_c
    if ops is None:
        if sinks32 is not None:
            out = with_sinks(out, lse, sinks32)[0]
        out = out.to(q.dtype)
    return out, (lse if return_lse else None)


def _paged_reach(block_table: Tensor, num_blocks: int, block_size: int, lo: Tensor, hi: Tensor) -> Tensor:
    """(B,) one past the last key any row of each sequence sees. The torch engine reads the table
    entries below it and refuses (ValueError) any of them outside the pool, as the native kernel
    does: an entry is never clamped to a plausible block."""
    seq_end = torch.where(lo < hi, hi, torch.zeros_like(hi)).amax(1) if hi.shape[1] else \
        torch.zeros(hi.shape[0], dtype=torch.long, device=hi.device)
    W = block_table.shape[1]
    reach = int(seq_end.max()) if seq_end.numel() else 0
    if reach > W * block_size:
        raise ValueError(f"paged attention: rows read keys up to {reach} but the block_table "
                         f"{tuple(block_table.shape)} holds {W} blocks of {block_size} tokens")
    used = torch.arange(W, device=block_table.device)[None] < (-(-seq_end // block_size))[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        raise ValueError(f"paged attention: block_table entries {block_table[bad].tolist()[:8]} are outside the "
                         f"pool of {num_blocks} blocks")
    return seq_end


def _torch_splitk(q, k, v, Dv, Hkv, Sk, scale, lo, hi, bias, block_table, softcap, slopes, qpos, k_scale=None,
                  v_scale=None):
    """The engine in torch ops: key chunks scored for all M rows of every KV head at once, each
    chunk's (out, lse) merged into the running result by :func:`merge_partials`. Quantized K/V
    (``k_scale``) take the native kernel's arithmetic: scores times the key rows' scales,
    probabilities times the value rows' scales before P @ V."""
    B, Hq, Sq, D = q.shape
    G, M = Hq // Hkv, (Hq // Hkv) * Sq
    qg = (q.detach().float() * scale).reshape(B, Hkv, M, D)
    row_lo = lo[:, None, None, :].expand(B, 1, G, Sq).reshape(B, 1, M, 1)
    row_hi = hi[:, None, None, :].expand(B, 1, G, Sq).reshape(B, 1, M, 1)
    start = int(lo.min()) if lo.numel() else 0
    end = int(hi.max()) if hi.numel() else 0
    if block_table is not None:
        seq_end = _paged_reach(block_table, k.shape[0], k.shape[1], lo, hi)
    C = max(64, _TORCH_CHUNK_BYTES // max(1, 4 * B * Hkv * (D + Dv)))
    out = torch.zeros(B, Hkv, M, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hkv, M), float("-inf"), dtype=torch.float32, device=q.device)
    for a in range(start, end, C):
        e = min(a + C, end)
        ksc = vsc = None
        if block_table is None:
            kc = k[:, :, a:e]
            vc = kc[..., :Dv] if v is None else v[:, :, a:e]
            if k_scale is not None:
                ksc = finite_or_nan(k_scale[:, :, a:e])
                vsc = ksc if v is None else finite_or_nan(v_scale[:, :, a:e])
        else:
            pos = torch.arange(a, e, device=q.device)
            bs = k.shape[1]
            # A row's positions past its sequence's reach are masked below: read block 0 there,
            # not the table's padding (the entries below the reach were checked by _paged_reach),
            # and zero its values (another sequence's V, NaN included, times probability 0).
            beyond = pos[None] >= seq_end[:, None]  # (B, c)
            blk = block_table[:, pos // bs].long().masked_fill(beyond, 0)
            kc = k[blk, pos % bs].permute(0, 2, 1, 3)  # (B, Hkv, c, D)
            vc = kc[..., :Dv] if v is None else v[blk, pos % bs].permute(0, 2, 1, 3)
            if k_scale is not None:
                ksc = finite_or_nan(k_scale[blk, pos % bs].permute(0, 2, 1))  # (B, Hkv, c)
                vsc = ksc if v is None else finite_or_nan(v_scale[blk, pos % bs].permute(0, 2, 1))
                vsc = vsc.masked_fill(beyond[:, None, :], 0)
            vc = (vc.view(torch.uint8) if vc.dtype in _BYTE_DTYPES else vc).masked_fill(beyond[:, None, :, None], 0)
            vc = vc.view(kc.dtype) if vc.dtype != kc.dtype else vc
        s = torch.matmul(qg, kc.detach().float().transpose(-1, -2))  # (B, Hkv, M, c)
        if ksc is not None:
            s = s * ksc.unsqueeze(2)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            bc = bias[..., a:e].expand(B, Hq, Sq, e - a).reshape(B, Hkv, M, e - a)
            s = s + bc
        j = torch.arange(a, e, device=q.device)
        if slopes is not None:  # slope[h] * (j - qpos[b, i]) for row (h, i)
            dist = (j[None, None, :] - qpos[:, :, None]).float()  # (B, Sq, c)
            s = s + (slopes.view(1, Hq, 1, 1) * dist[:, None]).reshape(B, Hkv, M, e - a)
        outside = (j < row_lo) | (j >= row_hi)
        s = s.masked_fill(outside, float("-inf"))
        c_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - finite(c_lse).unsqueeze(-1))
        if vsc is not None:  # a row's keys only: a NaN value scale outside them leaves it alone
            p = (p * vsc.unsqueeze(2)).masked_fill(outside, 0.0)
        c_out = torch.matmul(p, vc.detach().float())
        out, lse = merge_partials(out, lse, c_out, c_lse)
    return out.reshape(B, Hq, Sq, Dv), lse.reshape(B, Hq, Sq)
