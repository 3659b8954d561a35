"""``attnkit.attention``: the one entry point every attention variant calls.

This file validates inputs, normalises masks and dispatches; nothing here is backend-specific.

Debugging: ``attnkit.set_debug(True)`` (or ``ATTNKIT_DEBUG=1`` in the environment) makes every
``attention`` call log one line to ``logging.getLogger("attnkit")`` at DEBUG level: the backend,
for SDPA the kernel torch picks, the shapes, dtype, device and mask. Off, it costs one check of a
module-level bool per call.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import replace

import torch
from torch import Tensor

from . import backends  # noqa: F401  (registers the built-in backends)
from ._checks import positive_number, shape_of
from .backends.registry import AttentionCall, BackendCompileFailed, as_read_by, get_backend, select
from .kvlayout import PagedKV, QuantizedKV
from .masks import KeyPadding, as_mask
from .reference import attention_math

__all__ = ["attention", "describe_call", "check_qkv", "set_debug"]

_log = logging.getLogger("attnkit")
_DEBUG = False
_DEBUG_HANDLER: logging.Handler | None = None
#: The logger's level before set_debug(True) changed it, restored by set_debug(False).
_LEVEL_BEFORE: int | None = None


def set_debug(enabled: bool = True) -> None:
    """Log one DEBUG line per :func:`attention` call to ``logging.getLogger("attnkit")``:
    ``attnkit.attention: backend=sdpa[flash] q=(B, Hq, Sq, D) k=... v=... dtype=... device=...
    mask=...``. Enabling sets that logger's level to DEBUG; when logging is not configured at
    all (the root logger has no handler) it also attaches a stderr handler, so the lines show.
    Disabling undoes both: the logger gets back the level it had and loses the handler attnkit
    attached. ``ATTNKIT_DEBUG=1`` in the environment turns it on at import."""
    global _DEBUG, _DEBUG_HANDLER, _LEVEL_BEFORE
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if enabled and not _DEBUG:
        _LEVEL_BEFORE = _log.level
        _log.setLevel(logging.DEBUG)
        if _DEBUG_HANDLER is None and not logging.getLogger().handlers and not _log.handlers:
            _DEBUG_HANDLER = logging.StreamHandler()
            _DEBUG_HANDLER.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            _log.addHandler(_DEBUG_HANDLER)
    elif not enabled and _DEBUG:
        if _log.level == logging.DEBUG and _LEVEL_BEFORE is not None:  # unless the user set another since
            _log.setLevel(_LEVEL_BEFORE)
        if _DEBUG_HANDLER is not None:
            _log.removeHandler(_DEBUG_HANDLER)
            _DEBUG_HANDLER = None
    _DEBUG = enabled


def _detailed_name(backend, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> str:
    """``name[kernel]`` for backends that can say which kernel they run (an optional
    ``kernel_name(q, k, v, call)`` method, as SDPA's), else the plain name."""
    kernel_name = getattr(backend, "kernel_name", None)
    return backend.name if kernel_name is None else f"{backend.name}[{kernel_name(q, k, v, call)}]"


def _log_call(backend, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> None:
    name = "math[empty]" if backend is None else _detailed_name(backend, q, k, v, call)
    _log.debug("attnkit.attention: backend=%s q=%s k=%s v=%s dtype=%s device=%s mask=%r dropout_p=%s",
               name, _shape(q), _shape(k), _shape(v), str(q.dtype).removeprefix("torch."), q.device,
               call.mask, call.dropout_p)


if os.environ.get("ATTNKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off"):
    set_debug(True)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t) -> tuple[int, ...] | str:
    """A tensor's shape, or a PagedKV's pool and table shapes, for messages."""
    if isinstance(t, PagedKV):
        return f"paged(pool {tuple(t.k_pool.shape)}, table {tuple(t.block_table.shape)})"
    if isinstance(t, QuantizedKV):
        table = f", table {tuple(t.block_table.shape)}" if t.paged else ""
        return f"quantized({t.dtype}, k {tuple(t.k.shape)}{table})"
    return shape_of(t)


def check_qkv(q, k, v, scale=None, *, layout: str = "(B, H, S, D)") -> float:
    """Check q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) and ``scale``; errors name
    the argument and the shapes (``layout`` is how the 4 dims are described in them). ``k`` may
    be a :class:`attnkit.PagedKV` (then ``v`` is None). Returns the scale (default 1 / sqrt(D))."""
    return _check_qkv(q, k, v, scale, layout)[0]


def _check_qkv(q, k, v, scale, layout: str = "(B, H, S, D)"):
    """:func:`check_qkv`, also returning (B, Hq, Sq, D, Hkv, Sk, Dv)."""
    # Each shape is read once: this runs on every attention call, and every read builds a tuple.
    if isinstance(k, PagedKV):
        if v is not None:
            raise ValueError("v must be None when k is a PagedKV (it holds both K and V)")
        k.validate()
        _check_tensor("q", q, layout)
        pool = k.k_pool
        _, _, Hkv, Dk = pool.shape
        Bk = Bv = k.block_table.shape[0]
        Hk, Sk_ = Hkv, k.kv_len()
        Sk, Dv = Sk_, k.value_dim
        kv_dtype, kv_device = pool.dtype, pool.device  # the pools share them (validate)
        if q.dtype != kv_dtype:
            raise TypeError(f"q and the paged K/V must share a dtype, got q {q.dtype}, paged K/V {kv_dtype}")
        if q.device != kv_device:
            raise ValueError(f"q and the paged K/V must be on one device, got q {q.device}, paged K/V {kv_device}")
        if Bk != q.shape[0]:
            raise ValueError(f"batch sizes differ: q {_shape(q)}, block_table {_shape(k.block_table)}")
    elif isinstance(k, QuantizedKV):
        if v is not None:
            raise ValueError("v must be None when k is a QuantizedKV (it holds both K and V)")
        k.validate()
        _check_tensor("q", q, layout)
        if q.dtype == torch.float64:
            raise TypeError("q must be fp16, bf16 or fp32 with a QuantizedKV (its K/V dequantize to q's dtype), "
                            "got float64")
        Bk = Bv = k.batch
        Hk = Hkv = k.num_kv_heads
        Sk_ = Sk = k.kv_len()
        Dk, Dv = k.head_dim, k.value_dim
        if q.device != k.device:
            raise ValueError(f"q and the quantized K/V must be on one device, got q {q.device}, K/V {k.device}")
    else:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t, layout)
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
        (Bk, Hk, Sk_, Dk), (Bv, Hkv, Sk, Dv) = k.shape, v.shape
    B, Hq, Sq, D = q.shape
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if Hk != Hkv:
        raise ValueError(f"k and v must have the same number of heads: k {_shape(k)}, v {_shape(v)}")
    if Sk_ != Sk:
        raise ValueError(f"k and v must have the same sequence length: k {_shape(k)}, v {_shape(v)}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim: q {_shape(q)}, k {_shape(k)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}): "
                         f"q {_shape(q)}, k {_shape(k)}")
    if D == 0:
        raise ValueError(f"head dim must be at least 1: q {_shape(q)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale), (B, Hq, Sq, D, Hkv, Sk, Dv)


def _check_tensor(name: str, t, layout: str) -> None:
    """A 4-dim floating tensor, or a TypeError / ValueError naming ``name`` and its shape."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims {layout}, got shape {_shape(t)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be fp16, bf16, fp32 or fp64, got {t.dtype}")


def _check_sinks(sinks, q: Tensor) -> Tensor | None:
    """``sinks`` as backends read them: None, (Hq,) one logit per query head, or (B|1, Hq, Sq) one
    per query (a given (B|1, Hq, Sq, 1) loses its last dim, as a view: gradients reach the
    caller's tensor); anything else raises naming ``sinks``, its shape and q's."""
    if sinks is None:
        return None
    B, Hq, Sq = q.shape[:3]
    shapes = (f"(Hq,) = ({Hq},) (one logit per query head) or (B|1, Hq, Sq[, 1]) = ({B}|1, {Hq}, {Sq}[, 1]) "
              f"(one per query)")
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be None or a floating tensor of shape {shapes}, got {type(sinks).__name__}")
    rows = sinks.squeeze(-1) if sinks.dim() == 4 and sinks.shape[-1] == 1 else sinks
    per_query = rows.dim() == 3 and rows.shape[0] in (1, B) and tuple(rows.shape[1:]) == (Hq, Sq)
    if not sinks.dtype.is_floating_point or not (per_query or rows.shape == (Hq,)):
        raise ValueError(f"sinks must be a floating tensor of shape {shapes}, got {sinks.dtype} of shape "
                         f"{shape_of(sinks)} for q {shape_of(q)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return rows


def _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend="auto", softcap=None,
              sinks=None) -> AttentionCall:
    scale, (B, Hq, Sq, D, Hkv, Sk, Dv) = _check_qkv(q, k, v, scale)
    softcap = positive_number("softcap", softcap, none_means="no cap")
    sinks = _check_sinks(sinks, q)
    paged = isinstance(k, PagedKV) or (isinstance(k, QuantizedKV) and k.paged)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if backend != "auto":
        get_backend(backend)  # unknown names and non-strings fail here, empty inputs included
    m = as_mask(mask, causal)
    if paged:  # keys past each sequence's length are not there
        m = KeyPadding(k.lengths) if m is None else m & KeyPadding(k.lengths)
    if m is not None:
        m.check(B, Hq, Sq, Sk)
        if m.allows_all(Sq, Sk):  # e.g. causal decode (Sq = 1): nothing to mask
            m = None
        if isinstance(mask, Tensor) and mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    kv = (k.k_pool, k.v_pool) if isinstance(k, PagedKV) else (None, None) if isinstance(k, QuantizedKV) else (k, v)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, *kv, sinks))
    return AttentionCall(
        batch=B, num_heads=Hq, num_kv_heads=Hkv, q_len=Sq, kv_len=Sk, head_dim=D, v_head_dim=Dv,
        dtype=q.dtype, device=q.device, mask=m, scale=scale, dropout_p=float(dropout_p),
        return_weights=return_weights, needs_grad=needs_grad, kv_layout=_layout(k),
        softcap=softcap, sinks=sinks,
    )


def _layout(k) -> str:
    """The ``kv_layout`` of a call's K: "dense", "paged", "quantized" or "quantized_paged"."""
    if isinstance(k, PagedKV):
        return "paged"
    return k.layout if isinstance(k, QuantizedKV) else "dense"


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
    softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """Scaled dot-product attention for MHA, GQA and MQA.

    Args:
        q: (B, Hq, Sq, D) queries.
        k: (B, Hkv, Sk, D) keys; Hq must be a multiple of Hkv (query head h uses KV head
            h // (Hq // Hkv)). K and V are never copied per query head. Or a
            :class:`attnkit.PagedKV` holding paged keys and values (Sk = max(lengths); keys past
            a sequence's length are masked); then ``v`` is None. Or a :class:`attnkit.QuantizedKV`
            (int8 / fp8 K/V with per-row scales, dense or paged): attention over its dequantized
            K/V, read in place by the CPU split-K engine and the Triton kernel.
        v: (B, Hkv, Sk, Dv) values (None with a PagedKV or a QuantizedKV).
        mask: None, a bool tensor (True = attend), a float tensor added to the scores, or an
            :mod:`attnkit.masks` object; broadcastable to (B, Hq, Sq, Sk). ANDed with ``causal``.
        causal: bottom-right aligned causal mask: query i sees key j iff j <= i + (Sk - Sq).
        scale: multiplies q @ k^T; default 1 / sqrt(D).
        dropout_p: dropout on the attention probabilities (torch semantics, 1 / (1 - p)
            scaling, torch's RNG); 0 is a bitwise no-op.
        backend: "auto" or a registered backend name ("math", "sdpa", "decode", "flex", ...).
        return_weights: also return the probabilities (B, Hq, Sq, Sk) in fp32.
        softcap: c > 0: scores become ``c * tanh(scores / c)`` after scaling, before masks and
            biases (Gemma 2's attention soft-capping).
        sinks: logits that join each row's softmax denominator and carry no value: (Hq,), one
            per query head (gpt-oss's attention sinks), or (B|1, Hq, Sq) / (B|1, Hq, Sq, 1), one
            per query (Inkling 2's); differentiable. A row with no allowed key still outputs
            exactly 0. Per-query sinks run on ``math``, ``sdpa`` (CPU inference), ``flex``, the
            CPU split-K engine (``decode``, ``paged``) and the Triton kernel.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype, or (out, weights) with ``return_weights=True``.
        A query with nothing to attend to gets exactly 0 (zero gradients, zero weights row).

    Equivalent code (fp64 oracle: :func:`attnkit.reference.attention_reference`)::

        s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale   # plus float mask
        s = s.masked_fill(~allowed, -inf); p = softmax(s.float(), -1) (all -inf rows -> 0)
        out = dropout(p) @ v.repeat_interleave(G, 1)
    """
    call = _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend, softcap, sinks)
    chosen = None if call.is_empty else select(call, backend)
    if chosen is None:
        # Nothing to attend to (Sk = 0) or nothing to compute: the contract's zeros, with grads.
        call, k, v = _as_run_by(None, call, k, v)
        if _DEBUG:
            _log_call(None, q, k, v, call)
        out, weights = attention_math(q, k, v, call.mask, scale=call.scale, return_weights=return_weights,
                                      softcap=call.softcap, sinks=call.sinks)
        return (out, weights) if return_weights else out
    failed = frozenset()
    while True:
        run, kr, vr = _as_run_by(chosen, call, k, v)
        if _DEBUG:
            _log_call(chosen, q, kr, vr, run)
        try:
            out, weights = chosen.run(q, kr, vr, run)
            break
        except BackendCompileFailed as e:
            if backend != "auto":
                raise
            # auto: the next backend that accepts the call runs it (correct, maybe slower), and
            # the user hears why once per message (warnings' default filter)
            failed = failed | {chosen.name}
            nxt = select(call, "auto", exclude=failed)
            warnings.warn(f"attnkit: {e}; auto ran this call on {nxt.name!r} instead", RuntimeWarning, stacklevel=2)
            chosen = nxt
    return (out, weights) if return_weights else out


def describe_call(q: Tensor, k: Tensor, v: Tensor, mask=None, *, causal: bool = False,
                  scale: float | None = None, dropout_p: float = 0.0, return_weights: bool = False,
                  softcap: float | None = None, sinks: Tensor | None = None,
                  backend: str = "auto", detail: bool = False) -> str:
    """Name of the backend ``attention`` would run for these arguments (for tests and debugging).

    With ``detail=True`` a backend that can tell adds its kernel: ``"sdpa[flash]"``,
    ``"sdpa[efficient]"``, ``"sdpa[cudnn]"``, ``"sdpa[math]"`` (torch's choice, see
    :func:`attnkit.backends.sdpa.sdpa_kernel_name`), ``"flash[varlen]"``; others stay plain.
    """
    call = _validate(q, k, v, mask, causal, scale, dropout_p, return_weights, backend, softcap, sinks)
    if call.is_empty:
        return "math"
    chosen = select(call, backend)
    if not detail:
        return chosen.name
    call, k, v = _as_run_by(chosen, call, k, v)
    return _detailed_name(chosen, q, k, v, call)


def _as_run_by(backend, call: AttentionCall, k, v):
    """(call, k, v) as ``backend`` runs them: paged K/V it cannot read in place (or any paged K/V
    when no backend runs: an empty call) gathered into dense tensors (:func:`as_read_by`)."""
    if backend is not None:
        run = as_read_by(backend, call)
    else:
        run = call if call.kv_layout == "dense" else replace(call, kv_layout="dense")
    if run.kv_layout != call.kv_layout:
        k, v = k.gather(call.dtype) if isinstance(k, QuantizedKV) else k.gather()
    return run, k, v
