"""The split-K engine in torch ops: the implementation the engine runs where no native kernel
can be built (and the arithmetic the native kernel follows), key chunk by key chunk.

Notation as in :mod:`attnkit.backends.decode.splitk`: B batch, Hq / Hkv query / KV heads,
G = Hq // Hkv, Sq queries, M = G * Sq query rows per KV head, Sk keys, D / Dv head dims; ``lo`` /
``hi`` (B, Sq) int64: each query row's key interval ``[lo, hi)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...kvquant import finite_or_nan
from ..common import finite, merge_partials

__all__ = ["paged_reach", "torch_selected", "torch_splitk"]

#: Quantized storage dtypes whose rows are zeroed as raw bytes (fp8 has no masked_fill).
_BYTE_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)

#: fp32 bytes of K+V per chunk: the converted chunk stays in cache.
_TORCH_CHUNK_BYTES = 8 << 20


def paged_reach(block_table: Tensor, num_blocks: int, block_size: int, lo: Tensor, hi: Tensor) -> Tensor:
    """(B,) one past the last key any row of each sequence sees. The torch implementation reads the table
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


def torch_splitk(q, k, v, Dv, Hkv, Sk, scale, lo, hi, bias, block_table, softcap, slopes, qpos, k_scale=None,
                 v_scale=None):
    """The engine in torch ops: key chunks scored for all M rows of every KV head at once, each
    chunk's (out, lse) merged into the running result by :func:`merge_partials`. Quantized K/V
    (``k_scale``) take the native kernel's arithmetic: scores times the key rows' scales,
    probabilities times the value rows' scales before P @ V.

    Args: q (B, Hq, Sq, D); k, v dense (B, Hkv, Sk, D) / (B, Hkv, Sk, Dv) or, with
    ``block_table`` (B, W), pools (N, bs, Hkv, D) / (N, bs, Hkv, Dv); ``v`` None: V is
    K[..., :Dv]; lo, hi (B, Sq) int64 key intervals; bias None or fp32 (B|1, Hq|1, Sq, Sk);
    slopes (Hq,) with qpos (B, Sq): ALiBi; k_scale / v_scale: row scales of quantized K / V.

    Returns (out (B, Hq, Sq, Dv) fp32, lse (B, Hq, Sq) fp32), without sinks."""
    B, Hq, Sq, D = q.shape
    G, M = Hq // Hkv, (Hq // Hkv) * Sq
    qg = (q.detach().float() * scale).reshape(B, Hkv, M, D)
    row_lo = lo[:, None, None, :].expand(B, 1, G, Sq).reshape(B, 1, M, 1)
    row_hi = hi[:, None, None, :].expand(B, 1, G, Sq).reshape(B, 1, M, 1)
    start = int(lo.min()) if lo.numel() else 0
    end = int(hi.max()) if hi.numel() else 0
    if block_table is not None:
        seq_end = paged_reach(block_table, k.shape[0], k.shape[1], lo, hi)
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
            # not the table's padding (the entries below the reach were checked by paged_reach),
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


def _zero_rows(t: Tensor, keep: Tensor) -> Tensor:
    """``t`` with the rows where ``keep`` (broadcast over the last dim) is False set to zero bytes."""
    raw = t.view(torch.uint8) if t.dtype in _BYTE_DTYPES else t
    raw = raw.masked_fill(~keep, 0)
    return raw.view(t.dtype) if raw.dtype != t.dtype else raw


def torch_selected(q, k, v, Dv, Hkv, scale, keys, klo, khi, seq_div, block_table, softcap, slopes, qpos,
                   k_scale=None, v_scale=None):
    """The engine's selection walk in torch ops: each list's keys gathered (entries outside a
    list's ``[klo, khi)`` zeroed, so a NaN row there is never read), then :func:`torch_splitk` over
    the gathered rows, with the entries outside masked and ALiBi at the keys' own positions as an
    fp32 bias.

    Args: q (B, Hq, 1, D), query b reading K/V sequence b // seq_div: dense (B // seq_div, Hkv,
    Sk, D), or pools (N, bs, Hkv, D) with ``block_table`` (B // seq_div, W); keys (B, Hs, L)
    int32 ascending key positions (Hs divides Hkv: KV head h reads list h // (Hkv // Hs)); klo /
    khi (B, Hs) int64; slopes (Hq,) with qpos (B, 1): ALiBi; k_scale / v_scale: quantized K / V.

    Returns (out (B, Hq, 1, Dv) fp32, lse (B, Hq, 1) fp32), without sinks."""
    B, Hq, _, D = q.shape
    L, Hs = keys.shape[-1], keys.shape[1]
    dev = q.device
    t = torch.arange(L, device=dev)
    head_list = torch.arange(Hkv, device=dev) // (Hkv // Hs)
    valid = ((t >= klo[:, :, None]) & (t < khi[:, :, None]))[:, head_list]  # (B, Hkv, L)
    pos = torch.where(valid, keys.long()[:, head_list], 0)
    kb = (torch.arange(B, device=dev) // seq_div)[:, None, None]
    h = torch.arange(Hkv, device=dev)[None, :, None]
    if block_table is None:
        if valid.any() and int(pos.max()) >= k.shape[2]:
            raise ValueError(f"split-K selection: a key position {int(pos.max())} is past k's Sk={k.shape[2]}")
        at = (kb, h, pos)
    else:
        bs = k.shape[1]
        blk = block_table[kb, pos // bs].long()
        bad = valid & ((blk < 0) | (blk >= k.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"paged attention: block_table entries {blk[bad].tolist()[:8]} are outside the pool of "
                             f"{k.shape[0]} blocks")
        at = (torch.where(valid, blk, 0), pos % bs, h)
    kg = _zero_rows(k[at], valid[..., None])  # (B, Hkv, L, D)
    vg = None if v is None else _zero_rows(v[at], valid[..., None])
    ksc = vsc = None
    if k_scale is not None:
        ksc = k_scale[at].masked_fill(~valid, 0)
        vsc = None if v_scale is None else v_scale[at].masked_fill(~valid, 0)
    # entries outside a list score -inf; ALiBi at each key's position from its query's
    G = Hq // Hkv
    bias = torch.zeros(B, Hkv, G, L, device=dev).masked_fill(~valid[:, :, None], float("-inf"))
    if slopes is not None:
        dist = (pos - qpos.reshape(B, 1, 1)).float()  # (B, Hkv, L)
        bias = bias + slopes.float().view(1, Hkv, G, 1) * dist[:, :, None]
    lo = torch.zeros(B, 1, dtype=torch.long, device=dev)
    hi = torch.full((B, 1), L, dtype=torch.long, device=dev)
    return torch_splitk(q, kg, vg, Dv, Hkv, L, scale, lo, hi, bias.reshape(B, Hq, 1, L), None, softcap, None, None,
                        ksc, vsc if v is not None else None)
