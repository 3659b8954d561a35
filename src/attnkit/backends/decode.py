"""``decode``: small-Sq attention (decode, speculative verification) that reads each KV head
once for all the query heads of its group.

q (B, Hq, Sq, D) is viewed as (B, Hkv, G*Sq, D), so one matmul per KV head streams K and V
once; torch SDPA on CPU instead walks the cache once per query head. Masks become an fp32
additive bias (0 / -inf) on the grouped scores.
"""

from __future__ import annotations

import torch

from ..masks import shifted_bias
from ..reference import group_heads
from ._decode_kernel import grouped_decode
from .registry import AttentionCall, BackendBase

#: Largest Sq this backend takes: past this the work is matmul-bound and SDPA's tiled kernels win.
MAX_DECODE_Q_LEN = 16


def min_auto_kv_elems(dtype: torch.dtype) -> int:
    """Below this many K+V elements ``auto`` leaves decode to SDPA, whose one fused call has
    less overhead. Measured (Sq=1, 16 q / 4 kv heads, D=64, Sk=640, no mask): fp32 SDPA 0.16 ms
    vs this path 0.29 ms; bf16 SDPA 0.96 ms vs 0.34 ms. At Sk=4096 fp32 this path wins (0.73
    vs 0.85 ms)."""
    return 1 << 20 if dtype == torch.float32 else 1 << 16


def grouped_bias(call: AttentionCall, device) -> torch.Tensor | None:
    """The call's mask as an fp32 bias (B|1, Hkv|1, G|1, Sq, Sk), or None without a mask."""
    m = call.mask
    if m is None:
        return None
    allowed = m.materialize(call.batch, call.q_len, call.kv_len, device)
    bias = shifted_bias(m, call.batch, call.q_len, call.kv_len, device)
    if bias is None:
        bias = torch.zeros((), device=device)
    bias = bias.float().masked_fill(~allowed, float("-inf"))
    return group_heads(bias, call.kv_heads)


def decode_refusals(call: AttentionCall, max_q_len: int = MAX_DECODE_Q_LEN) -> list[str]:
    """What every decode kernel (this one, ``triton``) refuses: long queries, weights, dropout."""
    why = []
    if call.q_len > max_q_len:
        why.append(f"Sq={call.q_len} > {max_q_len} (a decode path: small query lengths only)")
    if call.return_weights:
        why.append("return_weights=True")
    if call.dropout_p > 0:
        why.append("dropout_p > 0")
    return why


class DecodeBackend(BackendBase):
    name = "decode"

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        if call.device.type != "cpu":
            return f"{call.device.type}: SDPA's fused kernels serve decode there"
        if torch.compiler.is_compiling():
            return "under torch.compile (its threaded kernel runs eagerly; SDPA traces)"
        kv_elems = call.batch * call.kv_heads * call.kv_len * (call.head_dim + call.v_head_dim)
        # SDPA's fused CPU kernels need equal K and V widths; otherwise (MLA's latent: 576 / 512)
        # it runs its math kernel, which this path beats at any size.
        if call.head_dim == call.v_head_dim and kv_elems < min_auto_kv_elems(call.dtype):
            return f"tiny cache ({kv_elems} K/V elements): per-op overhead dominates, SDPA's one call is faster"
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = decode_refusals(call)
        if call.dtype == torch.float64:
            why.append("fp64 (use math)")
        return why

    def run(self, q, k, v, call: AttentionCall):
        return grouped_decode(q, k, v, call.scale, grouped_bias(call, q.device)), None
