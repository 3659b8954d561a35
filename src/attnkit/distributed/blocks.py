"""Attention on one (query block, key block) pair, with its log-sum-exp, and the exact merge.

These are the pieces of every split-KV attention (ring / context parallelism, split-K decoding,
paged caches): attend a block of queries to one block of keys, keep each row's log-sum-exp
``lse``, merge partial results exactly, and run the flash-attention backward of one block given
the *final* (merged) ``lse`` and output.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq = Hkv * G; query head h uses
KV head h // G. K and V are never repeated per head: q is viewed as (B, Hkv, G * Sq, D) so one
matmul serves a whole group. ``allowed`` is None (every pair allowed) or a bool tensor
broadcastable to (B, Hq, Sq, Sk), True = attend. Everything is computed in fp32 (fp64 for
fp64 inputs) and returned in that compute dtype.

A row with nothing allowed has ``lse = -inf``, output 0 and gradients 0, so merging it changes
nothing and a row masked everywhere ends as exactly 0 (the library's contract).

On CPU, outside autograd, whole tiles (``allowed`` None, or ``causal`` on a diagonal tile) run
torch's fused flash-attention ops instead of the matmuls below (backward given the final ``out``
and ``lse``: flash-attention's backward then yields exactly this tile's share): the same
arithmetic, faster (``benchmarks/bench_ring.py``, ``benchmarks/results/ring.md``). Tiles a mask
cuts through keep the matmuls.

Equivalent code for one block, one (b, h)::

    s = q @ k.T * scale; s[~allowed] = -inf
    lse = logsumexp(s, -1); p = exp(s - lse[:, None]); out = p @ v
    # backward, with the final lse, out and dout of the whole row:
    delta = (dout * out).sum(-1); dp = dout @ v.T; ds = p * (dp - delta[:, None])
    dq = ds @ k * scale; dk = ds.T @ q * scale; dv = p.T @ dout
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import shape_of
from ..backends.common import CPU_FLASH, finite, merge_partials  # the split-K engine's merge rule, written once
from ..masks import Mask, has_bias
from ..reference import group_heads

__all__ = ["compute_dtype", "block_forward", "block_backward", "merge_partials", "softmax_delta", "mask_at"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64, fp32 for everything else (fp16/bf16 softmax runs in fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat_groups(t: Tensor, num_kv_heads: int) -> Tensor:
    """(B, Hq, S, X) -> (B, Hkv, G * S, X): one matmul per KV head covers its whole group."""
    B, Hq, S, X = t.shape
    return t.reshape(B, num_kv_heads, (Hq // num_kv_heads) * S, X)


def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float, softcap: float | None = None,
            bias: Tensor | None = None, keep_tanh: bool = False) -> tuple[Tensor, Tensor | None]:
    """Scaled scores (B, Hkv, G, Sq, Sk) in the compute dtype: soft-capped, then ``bias`` added,
    then masked. With ``keep_tanh`` (and a softcap) also tanh(scores / softcap), which the
    backward needs for the cap's derivative 1 - tanh^2; else None."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    ct = compute_dtype(q.dtype)
    s = torch.matmul(_flat_groups(q.to(ct), Hkv), k.to(ct).transpose(-1, -2)).mul_(scale)
    th = None
    if softcap is not None:
        s.div_(softcap).tanh_()
        th = s.clone() if keep_tanh else None
        s.mul_(softcap)
    s = s.view(B, Hkv, Hq // Hkv, Sq, Sk)
    if bias is not None:
        s.add_(group_heads(bias.to(ct), Hkv))
    if allowed is not None:  # in place: one score-sized buffer per tile
        s.masked_fill_(~group_heads(allowed, Hkv), float("-inf"))
    return s, th


_FUSED = CPU_FLASH  # torch's fused CPU flash forward / backward (log-sum-exp in and out), or None


def _use_fused(q: Tensor, allowed: Tensor | None, softcap: float | None, bias: Tensor | None) -> bool:
    """Whole tiles (or causal diagonal tiles) on CPU run in torch's fused flash kernel: faster than
    the matmuls below (``benchmarks/bench_ring.py``, ``benchmarks/results/ring.md``) with the same
    fp32 (fp64) arithmetic (``test_fused_cpu_tiles_equal_the_matmul_path``). Masked tiles keep the matmul path (rows with nothing allowed),
    and so do soft-capped or biased (ALiBi) tiles: the fused op has neither."""
    return (_FUSED is not None and allowed is None and softcap is None and bias is None and q.device.type == "cpu"
            and not torch.is_grad_enabled())


def _expand_heads(t: Tensor, groups: int) -> Tensor:
    """(B, Hkv, S, X) -> (B, Hkv * G, S, X) for the fused op, which has no grouped heads (a
    tile-sized copy)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _causal_allowed(q_len: int, kv_len: int, device) -> Tensor:
    return torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device).tril()


def block_forward(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float, *,
                  causal: bool = False, softcap: float | None = None,
                  bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` to this block of keys alone (no autograd: gradients come from
    :func:`block_backward`).

    Args:
        q: (B, Hq, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); Hq a multiple of Hkv.
        allowed: None or a bool (B|1, Hq|1, Sq, Sk) mask of this block (True = attend).
        scale: multiplies q @ k^T.
        causal: top-left causal within the block (query i sees keys j <= i); ``allowed`` None.
        softcap: c > 0: scores become c * tanh(scores / c) after scaling, before ``bias``.
        bias: None or a float (B|1, Hq, Sq, Sk) added to the (capped) scores (ALiBi's distances).

    Returns:
        out (B, Hq, Sq, Dv) normalised within the block, and lse (B, Hq, Sq), both in the compute
        dtype; rows with nothing allowed get out 0 and lse -inf.
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Sk, Dv = v.shape[1], v.shape[2], v.shape[3]
    ct = compute_dtype(q.dtype)
    if B == 0 or Sk == 0 or Sq == 0:
        return q.new_zeros(B, Hq, Sq, Dv, dtype=ct), q.new_full((B, Hq, Sq), float("-inf"), dtype=ct)
    if _use_fused(q, allowed, softcap, bias) and (not causal or Sq <= Sk) and q.shape[-1] == Dv:
        G = Hq // Hkv
        out, lse = _FUSED[0](q.to(ct), _expand_heads(k.to(ct), G), _expand_heads(v.to(ct), G), 0.0, causal,
                             scale=scale)
        return out, lse.to(ct)
    if causal:
        allowed = _causal_allowed(Sq, Sk, q.device)
    s = _scores(q, k, allowed, scale, softcap, bias)[0]  # (B, Hkv, G, Sq, Sk)
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows with nothing allowed
    p = s.sub_(finite(lse).unsqueeze(-1)).exp_()
    out = torch.matmul(p.view(B, Hkv, -1, Sk), v.to(ct))  # (B, Hkv, G * Sq, Dv)
    return out.view(B, Hq, Sq, Dv), lse.view(B, Hq, Sq)


def softmax_delta(out: Tensor, dout: Tensor) -> Tensor:
    """delta = rowsum(dout * out) (B, Hq, Sq) in the compute dtype, from the *final* output.

    Computed a slab of rows at a time, so the product (and, for fp16/bf16, the fp32 copies of
    ``out`` and ``dout``) never takes more than about 1/16 of ``out``'s size: a ring holds the
    whole backward's buffers when it calls this."""
    ct = compute_dtype(out.dtype)
    delta = torch.empty(out.shape[:-1], dtype=ct, device=out.device)
    rows = out.shape[-2]
    step = rows if out.numel() <= 1 << 20 else max(1, -(-rows // 16))  # small: one slab
    for r0 in range(0, rows, step):
        sl = slice(r0, r0 + step)
        delta[..., sl] = (dout[..., sl, :].to(ct) * out[..., sl, :].to(ct)).sum(-1)
    return delta


def block_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
                   allowed: Tensor | None, scale: float, *, dq_out: Tensor | None = None,
                   dk_out: Tensor | None = None, dv_out: Tensor | None = None, causal: bool = False,
                   out: Tensor | None = None, softcap: float | None = None,
                   bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of the gradients, given the final lse and delta of each query row.

    Args:
        q, k, v, allowed, scale, causal, softcap, bias: as in :func:`block_forward`.
        dout: (B, Hq, Sq, Dv) gradient of the final output.
        lse: (B, Hq, Sq) log-sum-exp over *all* keys (not just this block's).
        delta: (B, Hq, Sq) :func:`softmax_delta` of the final output.
        dq_out, dk_out, dv_out: optional (B, Hq, Sq, D) / (B, Hkv, Sk, D) / (B, Hkv, Sk, Dv)
            accumulators in the compute dtype (views are fine, e.g. a slice along the sequence of
            a larger buffer): the block's dq / dk / dv are *added* to them in place and they are
            returned. dk and dv never need a temporary; dq needs none when its (B, Hkv, G, Sq)
            dims can be viewed as batches of rows (any slice along Sq of a contiguous buffer),
            else one block-sized temporary.
        out: (B, Hq, Sq, Dv) the final output of these query rows, optional: with it, whole tiles
            on CPU run torch's fused flash backward (which takes out and lse, not delta).

    Returns:
        dq (B, Hq, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, Dv) in the compute dtype; dk and dv
        are summed over each KV head's group of query heads. Summing the blocks' dq (and each key
        block's dk, dv over the query blocks) gives the gradients of the whole attention.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = v.shape[1], v.shape[2], v.shape[3]
    ct = compute_dtype(q.dtype)
    for name, t, want in (("dq_out", dq_out, (B, Hq, Sq, D)), ("dk_out", dk_out, (B, Hkv, Sk, D)),
                          ("dv_out", dv_out, (B, Hkv, Sk, Dv))):
        if t is not None and (tuple(t.shape) != want or t.dtype != ct):
            raise ValueError(f"{name} must be {want} in {ct}, got {tuple(t.shape)} in {t.dtype}")
    dk = k.new_zeros(B, Hkv, Sk, D, dtype=ct) if dk_out is None else dk_out
    dv = v.new_zeros(B, Hkv, Sk, Dv, dtype=ct) if dv_out is None else dv_out
    if B == 0 or Sk == 0 or Sq == 0:
        return (q.new_zeros(B, Hq, Sq, D, dtype=ct) if dq_out is None else dq_out), dk, dv
    if out is not None and _use_fused(q, allowed, softcap, bias) and (not causal or Sq <= Sk) and D == Dv:
        G = Hq // Hkv
        gq, gk, gv = _FUSED[1](dout.to(ct), q.to(ct), _expand_heads(k.to(ct), G), _expand_heads(v.to(ct), G),
                               out.to(ct), lse.to(torch.float32 if ct == torch.float32 else ct), 0.0, causal,
                               scale=scale)
        dk.add_(gk.view(B, Hkv, G, Sk, D).sum(2) if G > 1 else gk)
        dv.add_(gv.view(B, Hkv, G, Sk, Dv).sum(2) if G > 1 else gv)
        return (gq if dq_out is None else dq_out.add_(gq)), dk, dv
    if causal:
        allowed = _causal_allowed(Sq, Sk, q.device)
    kc, vc = k.to(ct), v.to(ct)
    s, th = _scores(q, kc, allowed, scale, softcap, bias, keep_tanh=True)  # (B, Hkv, G, Sq, Sk)
    p = s.sub_(finite(lse.to(ct)).reshape(B, Hkv, -1, Sq, 1)).exp_().view(B * Hkv, -1, Sk)  # (B*Hkv, G*Sq, Sk)
    do = _flat_groups(dout.to(ct), Hkv).reshape(B * Hkv, -1, Dv)  # (B*Hkv, G*Sq, Dv)
    # dv += p^T dout, summed over the group by the matmul itself; accumulated in place.
    dv.view(B * Hkv, Sk, Dv).baddbmm_(p.transpose(-1, -2), do)
    dp = torch.bmm(do, vc.reshape(B * Hkv, Sk, Dv).transpose(-1, -2))  # (B*Hkv, G*Sq, Sk)
    ds = p.mul_(dp.sub_(delta.to(ct).reshape(B * Hkv, -1, 1)))  # p is not needed after this
    del dp
    if th is not None:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
        ds.mul_(th.square_().neg_().add_(1).view(ds.shape))
        del th
    kf = kc.reshape(B * Hkv, Sk, D)
    if dq_out is None:
        dq = torch.bmm(ds, kf).mul_(scale).view(B, Hq, Sq, D)
    else:
        dq = dq_out
        _add_bmm(dq_out, ds, kf, B, Hkv, scale)
    dk.view(B * Hkv, Sk, D).baddbmm_(ds.transpose(-1, -2), _flat_groups(q.to(ct), Hkv).reshape(B * Hkv, -1, D),
                                      alpha=scale)
    return dq, dk, dv


def _add_bmm(out: Tensor, a: Tensor, b: Tensor, B: int, Hkv: int, alpha: float) -> None:
    """``out`` (B, Hkv * G, R, C) += alpha * ``a`` (B * Hkv, G * R, K) @ ``b`` (B * Hkv, K, C),
    in place: one baddbmm on ``out`` viewed as (B * Hkv, G * R, C) if its strides allow (it is
    contiguous, or G == 1 and it is a slice along R of a contiguous buffer), else one per group
    (a slice along R of a contiguous buffer), else through a temporary."""
    G, R, C = out.shape[1] // Hkv, out.shape[2], out.shape[3]
    whole = _view_or_none(out, (B * Hkv, G * R, C))
    if whole is not None:
        whole.baddbmm_(a, b, alpha=alpha)
        return
    groups, a_g = out.view(B, Hkv, G, R, C), a.view(B * Hkv, G, R, a.shape[-1])
    for g in range(G):
        target = _view_or_none(groups[:, :, g], (B * Hkv, R, C))
        if target is not None:
            target.baddbmm_(a_g[:, g], b, alpha=alpha)
        else:
            groups[:, :, g].add_(torch.bmm(a_g[:, g], b).view(B, Hkv, R, C), alpha=alpha)


def _view_or_none(t: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    try:
        return t.view(shape)
    except RuntimeError:  # these strides cannot be viewed as ``shape`` without a copy
        return None


def mask_at(mask: Mask, q_idx: Tensor, kv_idx: Tensor, *, batch: int, heads: int, q_len: int, kv_len: int,
            mask_mod=None) -> Tensor:
    """``mask`` restricted to arbitrary global query / key indices.

    ``mask`` describes a full (Sq, Sk) = (``q_len``, ``kv_len``) problem; ``q_idx`` (n,) and
    ``kv_idx`` (m,) are int64 indices into it (for example the tokens of one zigzag shard).
    Returns a bool tensor broadcastable to (B, H, n, m), True = attend, equal to
    ``mask.materialize(B, q_len, kv_len)[:, :, q_idx][..., kv_idx]`` without building the full
    (Sq, Sk) grid. It calls the mask's FlexAttention ``mask_mod`` once on broadcast index tensors
    (batch (B,1,1,1), head (1,H,1,1), query (1,1,n,1), key (1,1,1,m)), which every
    :mod:`attnkit.masks` mask supports; ``mask_mod`` may pass a prebuilt one. Additive (float)
    masks are refused: their values, not only where they are -inf, change the result.
    """
    if has_bias(mask):
        raise TypeError(f"mask_at needs a boolean mask; {mask!r} carries an additive float bias")
    device = q_idx.device
    mod = mask.mask_mod(q_len, kv_len, device) if mask_mod is None else mask_mod
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    try:
        out = mod(b, h, q_idx.view(1, 1, -1, 1), kv_idx.view(1, 1, 1, -1))
    except Exception as e:  # a user Mask whose mask_mod only works on scalars
        raise TypeError(f"mask {mask!r} cannot be evaluated on index tensors: its mask_mod must use "
                        f"elementwise tensor ops ({type(e).__name__}: {e})") from e
    want = (batch, heads, q_idx.numel(), kv_idx.numel())
    if not isinstance(out, Tensor) or out.dtype != torch.bool or out.dim() > 4 or any(
            g not in (1, w) for g, w in zip((1,) * (4 - out.dim()) + tuple(out.shape), want)):
        raise TypeError(f"mask {mask!r}: mask_mod on index tensors gave "
                        f"{getattr(out, 'dtype', type(out).__name__)} of shape {shape_of(out)}, "
                        f"expected a bool tensor broadcastable to (B, H, n, m) = {want}")
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
