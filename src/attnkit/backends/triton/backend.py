"""``triton``: the fused split-K decode kernel (:mod:`attnkit.backends.triton.kernel`, entry
points in :mod:`attnkit.backends.triton.ops`) for ``attnkit.attention`` calls with a few queries
per sequence (Sq <= 16), and for calls of any length with a per-query selection.

It takes the masks a KV cache produces, causal (any ``q_start``), right-side key padding and a
sliding window (any ``q_start``, its own anchor), which it turns into per-sequence limits: query j
of sequence b sees keys ``< min(q_start[b] + j + 1, lengths[b])``, within the window around its
position; the splits cover only the window's keys. When V is a prefix view of K (MLA's latent
cache) each K tile serves as V too.
Quantized K/V (:class:`attnkit.QuantizedKV`, int8 or fp8 e4m3 with per-row scales, dense or
paged) are read in place, one byte per element, and widened in registers; fp8 is decoded with
integer ops, so it needs no fp8 hardware (sm_80 runs it as sm_90 does) and nothing about it
depends on the device.

A per-query selection (:class:`~attnkit.masks.SelectedKeys`, :class:`~attnkit.masks.SelectedBlocks`;
``ReducedMask.selection``: cut by interval masks such as causal, padding and windows, joined with
at most one) is walked in place: each program takes the query heads of one KV head that read one
list, for one query token, and visits only the listed keys (a block's keys in a row) and the
joined interval's keys, each once, split over the list's entries for long selections; prefill
is the same walk, one program per query token (no (Sq, Sk) tensor).
``describe_call(detail=True)`` says ``triton[split-k+selection]`` then, ``triton[split-k]``
otherwise.

``auto`` uses it on CUDA for paged and quantized K/V (read in place; any other backend would
gather, and dequantize, the whole cache first), for selections at any length without gradients
(only the selected keys are read; with gradients they go to ``flex``),
and where SDPA has no fused kernel for the call: K and V of different widths, as in MLA's
absorbed decode (576 / 512), and score modifiers
(soft-cap, sinks, ALiBi), which SDPA cannot run or runs only from a materialized bias. Plain
dense calls with equal widths stay with SDPA's kernels; force ``backend="triton"`` to use it
there. On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``), for tests only:
``auto`` never picks it.
"""

from __future__ import annotations

import torch

from ..common import decode_refusals, v_is_prefix_of_k
from ..registry import AttentionCall, BackendBase
from .limits import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, NO_CAUSAL, interpreting, triton_installed

__all__ = ["TritonBackend"]


class TritonBackend(BackendBase):
    name = "triton"
    layouts = ("dense", "paged", "quantized", "quantized_paged")
    auto_devices = ("cuda",)  # auto_skip_reason: the interpreter on CPU is for tests

    def available(self) -> str | None:
        if not triton_installed():
            return "triton is not installed (pip install triton)"
        if not torch.cuda.is_available() and not interpreting():
            return "needs CUDA (or TRITON_INTERPRET=1 to run on CPU tensors in Triton's interpreter)"
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        walks = call.reduced.limit_parts() is None and call.reduced.selection is not None
        # a selection's programs take one query token each: prefill too (only the selected keys read)
        why = decode_refusals(call, None if walks else MAX_Q_LEN, query_sinks=True)
        if call.needs_grad:
            why.append("gradients required (forward-only kernel)")
        if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            why.append(f"dtype {call.dtype}")
        if call.head_dim > MAX_HEAD_DIM or call.v_head_dim > MAX_V_HEAD_DIM:
            why.append(f"head dims D={call.head_dim} / Dv={call.v_head_dim} above {MAX_HEAD_DIM} / {MAX_V_HEAD_DIM}")
        if call.device_type == "cpu" and not interpreting():
            why.append("CPU tensors without TRITON_INTERPRET=1")
        elif call.device_type not in ("cpu", "cuda"):
            why.append(f"device {call.device_type}")
        if call.reduced.limit_parts() is None and call.reduced.selection is None:
            why.append(f"mask {call.mask!r} (takes causal, right-side key padding, one sliding window, and one "
                       f"per-query selection cut by those and joined with at most one interval)")
        return why

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        if call.device_type != "cuda":
            return "not CUDA (on CPU it runs in Triton's interpreter: for tests)"
        if call.reduced.limit_parts() is None:
            return None  # a selection: only its keys are read (SDPA would score every key through a dense mask)
        if call.kv_layout == "dense" and call.head_dim == call.v_head_dim and not call.modifiers:
            return "dense K/V of equal widths and no score modifier: SDPA's fused kernels serve these"
        return None  # paged / quantized K/V: read in place (the alternative gathers the whole cache every step)

    def kernel_name(self, q, k, v, call: AttentionCall) -> str:
        """``split-k`` (the shared kernel) or ``latent`` (the lean MLA kernel, which
        :func:`attnkit.backends.triton.latent.takes` gives the call to), with ``+selection`` when it
        walks a per-query selection (reads only the selected keys)."""
        from . import latent  # Triton itself is imported only if installed

        parts = call.reduced.limit_parts()  # None: a selection
        if call.kv_layout == "paged":  # what run() hands the kernel: the pool's blocks, V from K without a v_pool
            v_from_k, block = k.v_pool is None, k.k_pool.shape[1]
        elif call.kv_layout == "dense":  # one block of Sk keys per sequence
            v_from_k, block = v_is_prefix_of_k(k, v), call.kv_len
        else:  # quantized: the shared kernel
            v_from_k, block = False, 0
        lean = v_from_k and latent.takes(
            call.dtype, call.head_dim, call.v_head_dim, call.num_kv_heads, True, block, call.kv_len,
            softcap=call.softcap or 0.0, alibi=call.reduced.alibi is not None,
            window=parts is not None and parts[2] is not None, sinks=call.sinks is not None, selection=parts is None,
            selection_lists=1 if parts is not None else call.reduced.selection.heads)
        return ("latent" if lean else "split-k") + ("+selection" if parts is None else "")

    def run(self, q, k, v, call: AttentionCall):
        from . import ops  # imports Triton: only a call that runs here does

        alibi = call.reduced.alibi
        mods = dict(softcap=call.softcap, sinks=call.sinks)
        if call.reduced.limit_parts() is None:  # a selection (not_supported_reasons): its intervals hold every limit
            q_start = NO_CAUSAL
            lengths = torch.full((call.batch,), call.kv_len, device=q.device)
            w_q_start = None
            mods.update(selection=call.reduced.selection)
        else:
            q_start, lengths, w_q_start = call.reduced.limits(q.device, NO_CAUSAL)
        if w_q_start is not None:  # read only the window's keys (its own anchor, which may differ from Causal's)
            window = call.reduced.limit_parts()[2]
            mods.update(window=(window.left, window.right), window_q_start=w_q_start)
        if alibi is not None:  # slopes and each sequence's first ALiBi query position
            mods.update(alibi_slopes=alibi.slopes,
                        alibi_q_start=alibi.positions(call.q_len, call.kv_len, q.device)[:, 0].expand(call.batch))
        if call.kv_layout == "paged":  # k is the PagedKV: read its blocks in place
            out = ops.paged_decode_attention(
                q, k.k_pool, k.v_pool, k.block_table, lengths, q_start=q_start, scale=call.scale,
                v_head_dim=k.value_dim, max_len=call.kv_len, check=False, **mods)  # attention() validated the PagedKV
            return out, None
        if call.kv_layout == "quantized_paged":  # k is the QuantizedKV (validated by attention())
            out = ops.paged_decode_attention(
                q, k.k, k.v, k.block_table, lengths, q_start=q_start, scale=call.scale, v_head_dim=k.value_dim,
                max_len=call.kv_len, check=False, k_scale=k.k_scale, v_scale=k.v_scale, **mods)
            return out, None
        if call.kv_layout == "quantized":  # dense int8 / fp8 rows and their scales, v None: V from K
            out = ops.decode_attention(q, k.k, k.v, lengths=lengths, q_start=q_start, scale=call.scale,
                                       v_head_dim=k.value_dim, check=False, k_scale=k.k_scale, v_scale=k.v_scale,
                                       **mods)
            return out, None
        v_from_k = v_is_prefix_of_k(k, v)
        # lengths are clamped to Sk and the table is [[0], [1], ...]: nothing to check on the device.
        out = ops.decode_attention(q, k, None if v_from_k else v, lengths=lengths, q_start=q_start,
                                   scale=call.scale, v_head_dim=call.v_head_dim, check=False, **mods)
        return out, None
