"""The reference attention: plain torch ops, every feature, any precision.

``attention_math`` is the ``math`` backend (scores and softmax in fp32 for fp16/bf16/fp32,
fp64 for fp64) and what computes ``return_weights``. ``attention_reference`` is the fp64 oracle
the tests trust: the same arithmetic with everything upcast to fp64 and masks materialized.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq = Hkv * G. Query head h uses
KV head h // G. K and V are never repeated per head: q is viewed as (B, Hkv, G, Sq, D) and each
KV head is broadcast over its group.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import Mask, as_mask, shifted_bias

__all__ = ["attention_math", "attention_reference", "group_heads", "safe_softmax"]


def group_heads(t: Tensor, num_kv_heads: int | None = None, *, kv_heads: int | None = None) -> Tensor:
    """(B|1, Hq|1, ...) -> (B|1, Hkv|1, G|1, ...) with Hkv = ``num_kv_heads``, a view where
    possible. ``kv_heads`` is its deprecated spelling."""
    if kv_heads is not None:
        if num_kv_heads is not None:
            raise TypeError("group_heads() got both num_kv_heads= and its deprecated spelling kv_heads=")
        warnings.warn("group_heads(kv_heads=...) is deprecated; use num_kv_heads=", DeprecationWarning, stacklevel=2)
        num_kv_heads = kv_heads
    if t.shape[1] == 1:
        return t.unsqueeze(2)
    return t.unflatten(1, (num_kv_heads, t.shape[1] // num_kv_heads))


def safe_softmax(scores: Tensor, dim: int = -1, row_ok: Tensor | None = None) -> Tensor:
    """Softmax whose empty rows are exactly 0, with zero (finite) gradients.

    ``row_ok`` (broadcastable to scores with size 1 along ``dim``) says which rows have something
    to attend to, decided by the mask alone; without it a row counts as empty when all its
    scores are -inf (then a NaN score keeps its row non-empty: NaN in, NaN out)."""
    if scores.shape[dim] == 0:  # no keys at all: an empty row; P @ V then gives exact zeros
        return scores
    if row_ok is None:
        row_ok = ~(scores.amax(dim, keepdim=True) == float("-inf"))
    probs = torch.softmax(scores.masked_fill(~row_ok, 0.0), dim=dim)
    return probs.masked_fill(~row_ok, 0.0)


def attention_math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    compute_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention in torch ops. Returns (out (B, Hq, Sq, Dv) in q.dtype, weights (B, Hq, Sq, Sk) or None).

    ``compute_dtype`` defaults to fp32 (fp64 for fp64 inputs). ``weights`` are the probabilities
    actually applied to V (after dropout, as torch's MultiheadAttention returns them), in fp32
    (fp64 for fp64 compute). ``softcap`` c: scores -> c * tanh(scores / c) after scaling, before
    masks and biases. ``sinks`` (Hq,): one logit per query head joining each row's softmax
    denominator (a column that carries no value); or (B|1, Hq, Sq): one logit per query. Empty
    rows (the mask allows no key) are 0.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    qg = group_heads(q.to(compute_dtype), Hkv)  # (B, Hkv, G, Sq, D)
    kc = k.to(compute_dtype).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    vc = v.to(compute_dtype).unsqueeze(2)  # (B, Hkv, 1, Sk, Dv)
    scores = torch.matmul(qg, kc.transpose(-1, -2)) * scale  # (B, Hkv, G, Sq, Sk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    row_ok = None
    if mask is not None:
        # The per-row shift of shifted_bias leaves a softmax unchanged, but not its ratio to a sink
        # logit: with sinks the bias is added as given.
        allowed = mask.materialize(B, Sq, Sk, q.device)
        bias = (mask.bias(B, Sq, Sk, q.device) if sinks is not None
                else shifted_bias(mask, B, Sq, Sk, q.device, allowed=allowed))
        if bias is not None:
            scores = scores + group_heads(bias.to(compute_dtype), Hkv)
        allowed = group_heads(allowed, Hkv)
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_ok = allowed.any(-1, keepdim=True)  # the mask alone decides which rows are empty
    if sinks is not None:  # an extra column per row: the head's sink logit, no value
        rows = sinks.view(1, Hq, 1) if sinks.dim() == 1 else sinks  # (1, Hq, 1) or (B|1, Hq, Sq)
        sink = group_heads(rows.to(compute_dtype), Hkv).unsqueeze(-1).expand(*scores.shape[:-1], 1)
        probs = safe_softmax(torch.cat([scores, sink], -1), row_ok=row_ok)[..., :Sk]
    else:
        probs = safe_softmax(scores, row_ok=row_ok)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs, vc)  # (B, Hkv, G, Sq, Dv)
    out = out.flatten(1, 2).to(q.dtype)
    weights = probs.flatten(1, 2).expand(B, Hq, Sq, Sk) if return_weights else None
    if weights is not None and compute_dtype not in (torch.float32, torch.float64):
        weights = weights.float()
    return out, weights


def _sink_rows(sinks: Tensor, q: Tensor) -> Tensor:
    """The oracle's ``sinks`` as attention_math takes them: (Hq,) or (B|1, Hq, Sq)."""
    if sinks.dim() == 4 and sinks.shape[-1] == 1:
        sinks = sinks.squeeze(-1)
    if sinks.shape != (q.shape[1],) and not (sinks.dim() == 3 and sinks.shape[0] in (1, q.shape[0])
                                             and tuple(sinks.shape[1:]) == tuple(q.shape[1:3])):
        raise ValueError(f"sinks must be (Hq,) or (B|1, Hq, Sq[, 1]) for q {tuple(q.shape)}, got {tuple(sinks.shape)}")
    return sinks


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask=None,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """The fp64 oracle: ``attnkit.attention`` semantics, everything in fp64, masks materialized.

    Returns out (B, Hq, Sq, Dv) in fp64 (and weights (B, Hq, Sq, Sk) in fp64 with
    ``return_weights``). Equivalent code, for one (b, h) and mask ``m`` (True = attend)::

        s = (q[b, h].double() @ k[b, h // G].double().T) * scale + bias; s[~m] = -inf
        p = softmax(s) with all -inf rows -> 0;  out = p @ v[b, h // G].double()

    ``sinks``: (Hq,) one logit per query head, or (B|1, Hq, Sq) / (B|1, Hq, Sq, 1) one per query:
    a column of s, without a value, in each row's softmax (an empty row stays 0).
    """
    m = as_mask(mask, causal)
    if m is not None:
        m.check(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, w = attention_math(q.double(), k.double(), v.double(), m, scale=scale,
                            return_weights=return_weights, compute_dtype=torch.float64,
                            softcap=None if softcap is None else float(softcap),
                            sinks=None if sinks is None else _sink_rows(sinks, q).double())
    return (out, w) if return_weights else out
