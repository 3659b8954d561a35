"""``attnkit.attention``: the one entry point every attention variant calls.

This file validates inputs, normalises masks and dispatches; nothing here is backend-specific.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import backends  # noqa: F401  (registers the built-in backends)
from .backends.registry import AttentionCall, get_backend, select
from .masks import as_mask
from .reference import attention_math

__all__ = ["attention", "describe_call", "check_qkv"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(q, k, v, scale=None, *, layout: str = "(B, H, S, D)") -> float:
    """Check q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) and ``scale``; errors name
    the argument and the shapes (``layout`` is how the 4 dims are described in them). Returns
    the scale (default 1 / sqrt(D))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {_shape(t)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp16, bf16, fp32 or fp64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, Hq, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if k.shape[1] != Hkv:
        raise ValueError(f"k and v must have the same number of heads: k {_shape(k)}, v {_shape(v)}")
    if k.shape[2] != Sk:
        raise ValueError(f"k and v must have the same sequence length: k {_shape(k)}, v {_shape(v)}")
    if k.shape[3] != D:
        raise ValueError(f"q and k must have the same head dim: q {_shape(q)}, k {_shape(k)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}): "
                         f"q {_shape(q)}, k {_shape(k)}")
    if D == 0:
        raise ValueError(f"head dim must be at least 1: q {_shape(q)}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend="auto") -> AttentionCall:
    scale = check_qkv(q, k, v, scale)
    B, Hq, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if backend != "auto":
        get_backend(backend)  # unknown names and non-strings fail here, empty inputs included
    m = as_mask(mask, causal)
    if m is not None:
        m.check(B, Hq, Sq, Sk)
        if m.allows_all(Sq, Sk):  # e.g. causal decode (Sq = 1): nothing to mask
            m = None
        if isinstance(mask, Tensor) and mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return AttentionCall(
        batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Sq, kv_len=Sk, head_dim=D, v_head_dim=Dv,
        dtype=q.dtype, device=q.device, mask=m, scale=float(scale), dropout_p=float(dropout_p),
        return_weights=return_weights, needs_grad=needs_grad,
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask=None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
):
    """Scaled dot-product attention for MHA, GQA and MQA.

    Args:
        q: (B, Hq, Sq, D) queries.
        k: (B, Hkv, Sk, D) keys; Hq must be a multiple of Hkv (query head h uses KV head
            h // (Hq // Hkv)). K and V are never copied per query head.
        v: (B, Hkv, Sk, Dv) values.
        mask: None, a bool tensor (True = attend), a float tensor added to the scores, or an
            :mod:`attnkit.masks` object; broadcastable to (B, Hq, Sq, Sk). ANDed with ``causal``.
        causal: bottom-right aligned causal mask: query i sees key j iff j <= i + (Sk - Sq).
        scale: multiplies q @ k^T; default 1 / sqrt(D).
        dropout_p: dropout on the attention probabilities (torch semantics, 1 / (1 - p)
            scaling, torch's RNG); 0 is a bitwise no-op.
        backend: "auto" or a registered backend name ("math", "sdpa", "decode", "flex", ...).
        return_weights: also return the probabilities (B, Hq, Sq, Sk) in fp32.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype, or (out, weights) with ``return_weights=True``.
        A query with nothing to attend to gets exactly 0 (zero gradients, zero weights row).

    Equivalent code (fp64 oracle: :func:`attnkit.reference.attention_reference`)::

        s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale   # plus float mask
        s = s.masked_fill(~allowed, -inf); p = softmax(s.float(), -1) (all -inf rows -> 0)
        out = dropout(p) @ v.repeat_interleave(G, 1)
    """
    call = _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend)
    if call.is_empty:
        # Nothing to attend to (Sk = 0) or nothing to compute: the contract's zeros, with grads.
        out, weights = attention_math(q, k, v, call.mask, scale=call.scale, return_weights=return_weights)
    else:
        out, weights = select(call, backend).run(q, k, v, call)
    return (out, weights) if return_weights else out


def describe_call(q: Tensor, k: Tensor, v: Tensor, mask=None, *, causal: bool = False,
                  scale: float | None = None, dropout_p: float = 0.0, return_weights: bool = False,
                  backend: str = "auto") -> str:
    """Name of the backend ``attention`` would run for these arguments (for tests and debugging)."""
    call = _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend)
    return "math" if call.is_empty else select(call, backend).name
