"""``sdpa``: torch.nn.functional.scaled_dot_product_attention.

Uses ``is_causal`` only where it equals the requested mask (top-left, or bottom-right with
Sq == Sk), ``enable_gqa`` for grouped heads, and one bool or float ``attn_mask`` otherwise.
Rows with nothing to attend to are unmasked before the call (so no kernel sees an all -inf row
and no NaN reaches the gradients) and zeroed after it, which is the attnkit contract.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..masks import shifted_bias
from .registry import AttentionCall, BackendBase


def sdpa_mask(call: AttentionCall, dtype: torch.dtype, device) -> tuple[Tensor | None, Tensor | None]:
    """(attn_mask for SDPA, row_ok (B|1, H|1, Sq, 1) bool or None when every row attends).

    A float bias is shifted per row (see :func:`attnkit.masks.shifted_bias`) and handed over in
    fp32 on CPU, where SDPA adds an fp32 mask to fp16/bf16 scores exactly; elsewhere it is cast
    to the input dtype with finite values clamped into its range (never overflowing to -inf).
    """
    m = call.mask
    allowed = m.materialize(call.batch, call.q_len, call.kv_len, device)
    bias = shifted_bias(m, call.batch, call.q_len, call.kv_len, device)
    if bias is not None:
        if device.type == "cpu" and dtype != torch.float64:
            bias = bias.float()
        else:
            fin = torch.finfo(dtype)
            bias = torch.where(torch.isneginf(bias), bias, bias.clamp(fin.min, fin.max)).to(dtype)
    row_ok = allowed.any(-1, keepdim=True)
    # Under torch.compile the fix-up is applied unconditionally (no data-dependent branch).
    all_ok = False if torch.compiler.is_compiling() else bool(row_ok.all())
    if not all_ok:
        allowed = allowed | ~row_ok
    if bias is None:
        return allowed, (None if all_ok else row_ok)
    attn_mask = bias.masked_fill(~allowed, float("-inf"))
    if not all_ok:
        attn_mask = attn_mask.masked_fill(~row_ok, 0.0)
    return attn_mask, (None if all_ok else row_ok)


def _kernel_choice(call: AttentionCall):
    """Torch's CPU flash kernel's backward in fp16/bf16 is up to ~10x less accurate than the
    eager path for dq (tests/test_attention.py's grid measured it against the fp64 oracle), so
    calls that will be differentiated in half precision on CPU use SDPA's math kernel, which
    upcasts to fp32. Everything else keeps torch's own choice."""
    if call.needs_grad and call.device.type == "cpu" and call.dtype in (torch.float16, torch.bfloat16):
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


class SdpaBackend(BackendBase):
    name = "sdpa"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = []
        if call.return_weights:
            why.append("return_weights=True (SDPA does not return probabilities)")
        return why

    def run(self, q, k, v, call: AttentionCall):
        m = call.mask
        attn_mask = row_ok = None
        is_causal = False
        if m is not None:
            if m.is_top_left_causal(call.q_len, call.kv_len):
                is_causal = True
            else:
                attn_mask, row_ok = sdpa_mask(call, q.dtype, q.device)
        with _kernel_choice(call):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal,
                scale=call.scale, enable_gqa=call.q_heads != call.kv_heads,
            )
        if row_ok is not None:
            out = out.masked_fill(~row_ok, 0.0)
        return out, None
