"""What several backends (and :mod:`attnkit.distributed`) share, in a room of its own so that no
backend imports another: the log-sum-exp merge of partial results, sinks joined to a finished
result, the refusals every decode kernel makes, and the test for MLA's V-inside-K cache.

Notation: B batch, Hq query heads, Sq queries, Dv value head dim; ``lse`` is each row's
log-sum-exp of its scores (-inf for a row with nothing visible).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import AttentionCall

__all__ = ["CPU_FLASH", "MAX_DECODE_Q_LEN", "decode_refusals", "finite", "merge_partials", "per_query_sinks",
           "sink_rows", "sinks_refusals", "v_is_prefix_of_k", "with_sinks"]

#: Largest Sq the CPU decode backends take: past this the work is matmul-bound and SDPA's tiled
#: kernels win; ``flex`` leaves calls up to this length to the decode kernels.
MAX_DECODE_Q_LEN = 16


def _cpu_flash_ops():
    """torch's fused CPU flash-attention forward / backward ops, which return and take each row's
    log-sum-exp, or None in a torch without them."""
    aten = torch.ops.aten
    try:
        return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward
    except AttributeError:
        return None


#: (forward, backward) of torch's fused CPU flash attention, or None: SDPA's CPU path with sinks
#: and the ring's whole tiles run it.
CPU_FLASH = _cpu_flash_ops()


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


def per_query_sinks(sinks: Tensor | None) -> bool:
    """Whether ``sinks`` (as :func:`attnkit.attention` hands them on) hold one logit per query,
    (B|1, Hq, Sq), rather than one per query head, (Hq,)."""
    return sinks is not None and sinks.dim() != 1


def sink_rows(sinks: Tensor) -> Tensor:
    """``sinks`` (Hq,) or (B|1, Hq, Sq) as (1, Hq, 1) or (B|1, Hq, Sq): a view that broadcasts
    against each row's log-sum-exp (B, Hq, Sq)."""
    return sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Join sink logits to finished (out, lse): each row's denominator gains exp(sink), which
    carries no value. ``out`` (B, Hq, Sq, Dv), ``lse`` (B, Hq, Sq), ``sinks`` (Hq,) (one per query
    head) or (B|1, Hq, Sq) (one per query), in their dtype. Returns (out * exp(lse - lse'), lse')
    with lse' = logaddexp(lse, sink); a row with nothing allowed (lse -inf) stays exactly 0 and
    gets lse' = sink."""
    new = torch.logaddexp(lse, sink_rows(sinks).to(lse.dtype))
    return out * torch.exp(lse - new).unsqueeze(-1), new


def v_is_prefix_of_k(k: Tensor, v: Tensor) -> bool:
    """True when v is k[..., :Dv] in memory (MLA's latent cache: V = the first channels of K).
    Always False under a trace: traced tensors have no addresses (dynamo cannot compare data
    pointers: torch 2.11's compiled MLA decode failed on CUDA there), so V is then read through
    its own view, which gives the same result."""
    if torch.compiler.is_compiling():
        return False
    return (v.dtype == k.dtype and v.device == k.device and v.dim() == k.dim() and v.shape[:-1] == k.shape[:-1]
            and v.shape[-1] <= k.shape[-1] and v.stride() == k.stride() and v.data_ptr() == k.data_ptr())


def decode_refusals(call: AttentionCall, max_q_len: int | None = MAX_DECODE_Q_LEN, *,
                    query_sinks: bool = False) -> list[str]:
    """What every decode kernel (``decode``, ``paged``, ``triton``) refuses: long queries (past
    ``max_q_len``; None: any length), weights, dropout, and, unless the kernel reads them
    (``query_sinks``), sinks of one logit per query."""
    why = []
    if per_query_sinks(call.sinks) and not query_sinks:
        why.append(f"per-query sinks {tuple(call.sinks.shape)} (this kernel reads one sink logit per query head, "
                   f"(Hq,))")
    if max_q_len is not None and call.q_len > max_q_len:
        why.append(f"Sq={call.q_len} > {max_q_len} (a decode path: small query lengths only)")
    if call.return_weights:
        why.append("return_weights=True")
    if call.dropout_p > 0:
        why.append("dropout_p > 0")
    return why


def sinks_refusals(call: AttentionCall) -> list[str]:
    """Why SDPA cannot run ``call``'s sinks (empty: its CPU flash kernel can, its log-sum-exp
    carrying them). The ``sdpa`` backend refuses for these reasons; the CPU decode backends take
    such calls at any length, since the alternative is the math path."""
    why = []
    if call.device_type != "cpu" or CPU_FLASH is None:
        why.append("sinks (SDPA cannot express them; on CPU, without gradients, its flash kernel's "
                   "log-sum-exp carries them)")
    elif call.needs_grad:
        why.append("sinks with gradients (SDPA cannot express them; the CPU flash path is inference-only)")
    elif call.dropout_p > 0:
        why.append("sinks with dropout (SDPA cannot express them)")
    elif call.mask is not None and not call.reduced.is_top_left_causal:
        why.append("sinks with a mask other than causal (SDPA cannot express them)")
    elif call.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        why.append(f"sinks in {call.dtype}")
    return why
