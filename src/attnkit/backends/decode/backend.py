"""``decode`` and ``paged``: few-query attention on CPU through the split-K engine
(:mod:`attnkit.backends.decode.splitk`), over contiguous K/V (``decode``) or paged K/V (``paged``):
one class, :class:`DecodeBackend`, whose instances differ only in the layouts they read.

Both read each KV head once for all the query heads of its group and every query of the step
(decode, speculative verification: Sq <= 16; soft-capped or ALiBi calls of any length, which
SDPA cannot fuse, a chunk of queries at a time), take the mask as key intervals, and run on the
compiled native kernel when the machine has a compiler (``describe_call(detail=True)`` says
``decode[native]``, ``decode[native (not built yet)]`` or ``decode[torch]``; without the native
kernel ``auto`` leaves them only the calls SDPA cannot fuse, see :func:`auto_skip`). They are
inference paths: calls that need gradients, dropout or the weights go to ``sdpa`` / ``math``
(paged K/V gathered first).
"""

from __future__ import annotations

import torch

from ... import native
from ..common import MAX_DECODE_Q_LEN, decode_refusals, sinks_refusals
from ..registry import AttentionCall, BackendBase
from . import splitk

__all__ = ["MAX_DECODE_Q_LEN", "DecodeBackend", "auto_skip", "min_auto_kv_elems"]


def min_auto_kv_elems(implementation: str) -> int:
    """Below this many K+V elements ``auto`` leaves a dense decode call to SDPA, whose single
    fused call costs less than the engine's per-call set-up (interval bounds, fp32 copy of q,
    partials). ``implementation`` is "native" or "torch": the engine's torch implementation runs
    a few ops per key chunk, so it needs more work to pay off than the native kernel."""
    return 1 << 14 if implementation == "native" else 1 << 20


def _fuses_what_sdpa_cannot(call: AttentionCall) -> bool:
    """Calls the engine takes at any length: a soft cap (no SDPA kernel caps scores: the
    alternative is the math path), ALiBi (SDPA takes it only as a materialized (B, H, Sq, Sk)
    bias), sinks SDPA's flash path cannot take (a window, padding), or a selection the engine
    walks in place (SDPA would take a dense (Sq, Sk) mask and read every key). The engine runs
    them a chunk of queries at a time, without materializing the scores."""
    if call.softcap is not None or call.reduced.has_alibi or splitk.reads_selection(call.reduced, call.num_kv_heads):
        return True
    return call.sinks is not None and bool(sinks_refusals(call))


def auto_skip(call: AttentionCall, implementation: str) -> str | None:
    """Why ``auto`` passes a call the split-K engine supports to another backend (None: ``auto``
    takes it). ``implementation`` is the one that would run it, "native" or "torch"; a pure
    function of the call and the implementation, so every machine's choice is testable on any
    machine."""
    if _fuses_what_sdpa_cannot(call):
        return None  # the alternative is the math path, which materializes the scores
    # The torch implementation runs several ops per key chunk and converts bf16/fp16 chunks to
    # fp32: side by side with SDPA (and with gathering paged K/V for SDPA) it loses nearly
    # everywhere, so without the native kernel the calls SDPA can run go to SDPA.
    if implementation != "native":
        return ("no native kernel here (`attnkit info` says why), and the engine's torch implementation is "
                "slower than SDPA; backend='decode' / 'paged' still forces it")
    if call.kv_layout == "dense" and call.head_dim == call.v_head_dim:
        kv_elems = call.batch * call.num_kv_heads * call.kv_len * (call.head_dim + call.v_head_dim)
        if kv_elems < min_auto_kv_elems(implementation):
            return f"tiny cache ({kv_elems} K/V elements): SDPA's one fused call costs less"
    return None


class DecodeBackend(BackendBase):
    """A backend over the split-K engine: ``DecodeBackend("decode", ("dense", "quantized"))`` and
    ``DecodeBackend("paged", ("paged", "quantized_paged"))``; ``layouts`` are the K/V it reads in
    place (float and quantized: dense, or paged)."""

    auto_devices = ("cpu",)

    def __init__(self, name: str, layouts: tuple[str, ...]):
        self.name, self.layouts = name, tuple(layouts)

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = decode_refusals(call, None if _fuses_what_sdpa_cannot(call) else MAX_DECODE_Q_LEN, query_sinks=True)
        if call.kv_layout not in self.layouts:
            why.append(f"{call.kv_layout} K/V (this backend reads {' or '.join(self.layouts)} K/V)")
        if call.device_type != "cpu":
            why.append(f"{call.device_type} tensors (a CPU engine)")
        if call.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why.append(f"dtype {call.dtype} (fp32, bf16, fp16; fp64 goes to math)")
        if call.needs_grad:
            why.append("gradients required (an inference path)")
        return why

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        if torch.compiler.is_compiling() and native.library_path() is None:
            # traced code must not build the library; once it is loaded, the graph calls the op
            return "under torch.compile before the native kernel is loaded (SDPA traces)"
        # build=False: deciding (and describe_call) must never start the compile; the first call
        # that runs the engine does.
        return auto_skip(call, "native" if torch.compiler.is_compiling() else native.implementation(build=False))

    def kernel_name(self, q, k, v, call: AttentionCall) -> str:
        state = native.status(build=False)  # "native", "native (not built yet)" or "torch (<why>)"
        name = "torch" if state.startswith("torch") else state
        return f"{name}, selection read in place" if splitk.reads_selection(call.reduced, call.num_kv_heads) else name

    def run(self, q, k, v, call: AttentionCall):
        mods = dict(scale=call.scale, mask=call.reduced, softcap=call.softcap, sinks=call.sinks)
        if call.kv_layout == "paged":
            out, _ = splitk.splitk_attention(q, k.k_pool, k.v_pool, block_table=k.block_table, v_head_dim=k.value_dim,
                                             kv_len=call.kv_len, **mods)
        elif call.kv_layout in ("quantized", "quantized_paged"):
            qc, k, post = k.without_channel_scale(q)
            out, _ = splitk.splitk_attention(qc, k.k, k.v, block_table=k.block_table, v_head_dim=k.value_dim,
                                             kv_len=call.kv_len, k_scale=k.k_scale, v_scale=k.v_scale, **mods)
            if qc is not q:  # K's channel scales were folded into the query (fp32)
                out = (out if post is None else out * post).to(q.dtype)
        else:
            out, _ = splitk.splitk_attention(q, k, v, **mods)
        return out, None
