"""``sdpa``: torch.nn.functional.scaled_dot_product_attention.

Uses ``is_causal`` only where it equals the requested mask (top-left, or bottom-right with
Sq == Sk), ``enable_gqa`` for grouped heads, and one bool or float ``attn_mask`` otherwise.
Rows with nothing to attend to are unmasked before the call (so no kernel sees an all -inf row
and no NaN reaches the gradients) and zeroed after it, which is the attnkit contract.

On CUDA a bottom-right causal mask with Sq < Sk (chunked prefill, speculative verification)
is handed over as ``torch.nn.attention.bias.causal_lower_right(Sq, Sk)``, which SDPA runs on its
flash or memory-efficient kernel instead of a materialized (Sq, Sk) mask. With Sq < Sk every
query sees at least Sk - Sq + 1 keys, so no row is empty; Sq > Sk (rows with no key) keeps the
materialized mask and the zero fix-up. CPU calls are unchanged (there SDPA's CPU flash kernel
takes the materialized mask directly).

:func:`sdpa_kernel_name` says which SDPA kernel a call reaches ("flash", "efficient", "cudnn",
"math", "overrideable"; "unknown" where torch cannot say).

Sinks on CPU, for inference, one per query head (gpt-oss) or one per query (Inkling 2): SDPA's
CPU flash kernel returns each row's log-sum-exp beside its output, which is all a sink needs
(:func:`attnkit.backends.common.with_sinks`), so unmasked and causal prefill with sinks runs the
fused kernel (K/V expanded per query head, as the op has no grouped heads). Soft-capping changes every score, which no SDPA kernel can do.

bf16 inference on AVX-512 CPUs without AMX-BF16 (:func:`sdpa_upcasts`, a rule of the call and
the CPU's flags): torch's CPU flash kernel runs bf16 slower than fp32 there (its fp32 blocks use
MKL's GEMM, its bf16 ones do not gain from the bf16 dot product; benchmarks/NOTES.md), so q, k and v
are widened to fp32 for the call and the output rounded once to bf16: the same kernel, fp32
inputs exact, a result at least as accurate. The call holds fp32 copies of q, k and v meanwhile,
so calls whose copies would pass :data:`UPCAST_MAX_BYTES` keep bf16. AVX2 CPUs (bf16 about as
fast as fp32 there) and AMX ones keep bf16.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._sysinfo import cpu_flags
from .common import CPU_FLASH, sinks_refusals, with_sinks
from .registry import AttentionCall, BackendBase


def _causal_bias_module():
    """``torch.nn.attention.bias``, imported on first use: it imports ``torch._dynamo``, which
    ``import attnkit`` must not pay for; only CUDA calls with a lower-right causal mask
    (and the kernel-name report for them) need it."""
    import torch.nn.attention.bias as bias_module

    return bias_module


#: torch's own kernel chooser (private; absent in some builds, then kernels read "unknown").
_FUSED_SDP_CHOICE = getattr(torch, "_fused_sdp_choice", None)
_KERNEL_NAMES = {getattr(SDPBackend, member).value: name for member, name in (
    ("FLASH_ATTENTION", "flash"), ("EFFICIENT_ATTENTION", "efficient"), ("CUDNN_ATTENTION", "cudnn"),
    ("MATH", "math"), ("OVERRIDEABLE", "overrideable")) if hasattr(SDPBackend, member)}


def sdpa_kernel_name(q: Tensor, k: Tensor, v: Tensor, attn_mask=None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> str:
    """The SDPA kernel ``F.scaled_dot_product_attention`` picks for these arguments, under the
    current ``sdpa_kernel`` context: "flash", "efficient", "cudnn", "math" or "overrideable";
    "unknown" where this torch cannot tell (no ``torch._fused_sdp_choice``, or it raised).

    q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); ``attn_mask`` a tensor or a
    ``CausalBias``, which is resolved the way SDPA dispatches it (flash, else efficient, else
    the materialized mask). On CPU the answer is "flash" (torch's CPU flash kernel) or "math".
    """
    if _FUSED_SDP_CHOICE is None:
        return "unknown"
    try:
        if type(attn_mask).__name__ == "CausalBias":  # without importing its module (see above)
            return _causal_bias_kernel(q, k, v, attn_mask, dropout_p, scale, enable_gqa)
        choice = _FUSED_SDP_CHOICE(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    except (TypeError, ValueError, RuntimeError):
        return "unknown"
    return _KERNEL_NAMES.get(int(choice), "unknown")


def _causal_bias_kernel(q, k, v, bias, dropout_p, scale, enable_gqa) -> str:
    """Mirror of ``CausalBias._dispatch``: square or upper-left -> ``is_causal``; lower-right ->
    flash if usable, else efficient if usable, else SDPA with the materialized mask."""
    Sq, Sk = bias.seq_len_q, bias.seq_len_kv
    if Sq == Sk or bias.variant == _causal_bias_module().CausalVariant.UPPER_LEFT:
        return sdpa_kernel_name(q, k, v, None, dropout_p, True, scale, enable_gqa)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, dropout_p, False, enable_gqa)
    if torch.backends.cuda.can_use_flash_attention(params, False):
        return "flash"
    if torch.backends.cuda.can_use_efficient_attention(params, False):
        return "efficient"
    dense = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
    return sdpa_kernel_name(q, k, v, dense, dropout_p, False, scale, enable_gqa)


def sdpa_bias_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a float bias is handed to SDPA in, for inputs of ``dtype`` on ``device_type``.

    fp64 inputs: fp64 (exact). CPU: fp32, which SDPA's CPU kernels add to the fp32 scores of
    fp16/bf16 inputs exactly. Elsewhere (CUDA): the input dtype, the only float bias SDPA's fused
    CUDA kernels (memory-efficient, cuDNN) take. A pure function of the call's description, so
    tests run the CUDA decision on CPU and hold the bias the kernel will see to rule R
    (tests/test_sdpa_bias.py)."""
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if device_type == "cpu" else dtype


def sdpa_mask(call: AttentionCall, dtype: torch.dtype, device,
              bias_dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(attn_mask for SDPA, row_ok (B|1, H|1, Sq, 1) bool or None when every row attends).

    A float bias is shifted per row over the keys the mask allows (see
    :func:`attnkit.masks.shifted_bias`), so every allowed key's value is at most 0 and the ones
    that matter are small, then cast to ``bias_dtype`` (default :func:`sdpa_bias_dtype`) with
    finite values clamped into its range (never overflowing to -inf)."""
    allowed, bias = call.reduced.dense(device)
    if bias is not None:
        bt = sdpa_bias_dtype(call.device_type, dtype) if bias_dtype is None else bias_dtype
        bias = bias.float() if bias.dtype != torch.float64 else bias
        if bt not in (torch.float32, torch.float64):
            fin = torch.finfo(bt)
            bias = torch.where(torch.isneginf(bias), bias, bias.clamp(fin.min, fin.max))
        bias = bias.to(bt)
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


def _flash_usable(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> bool:
    """Whether SDPA's flash kernel accepts these inputs with no mask (torch's own check)."""
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, call.dropout_p, False,
                                                call.num_heads != call.num_kv_heads)
        return bool(torch.backends.cuda.can_use_flash_attention(params, False))
    except (TypeError, RuntimeError):  # a torch whose SDPAParams takes other arguments
        return False


def _lower_right_bias(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> bool:
    """Use ``causal_lower_right`` for this call: CUDA, the whole mask is bottom-right causal,
    Sq < Sk (no empty rows), not being traced by torch.compile, and, with grouped heads, SDPA's
    flash kernel usable (CausalBias's memory-efficient branch calls the kernel without
    ``enable_gqa``, so grouped calls that cannot go to flash keep the materialized mask)."""
    if call.device_type != "cuda" or not call.q_len < call.kv_len or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cuda"):  # CausalBias calls kernels autocast does not cast
        return False
    if not call.reduced.is_bottom_right_causal:
        return False
    return call.num_heads == call.num_kv_heads or _flash_usable(q, k, v, call)


def _math_for_grads(call: AttentionCall) -> bool:
    """Torch's CPU flash kernel's backward in fp16/bf16 is much less accurate than the eager path
    for dq (outside rule R against the fp64 oracle in tests/test_attention.py's grid), so calls
    that will be differentiated in half precision on CPU use SDPA's math kernel, which upcasts to
    fp32. Everything else keeps torch's own choice."""
    return call.needs_grad and call.device_type == "cpu" and call.dtype in (torch.float16, torch.bfloat16)


#: The most bytes of fp32 copies of q, k and v a bf16 call widened to fp32 holds (see the module
#: docstring); larger calls keep bf16.
UPCAST_MAX_BYTES = 256 << 20


def sdpa_upcasts(call: AttentionCall, flags: frozenset[str] | set[str]) -> bool:
    """Whether :class:`SdpaBackend` runs ``call`` in fp32 on a CPU with feature ``flags``
    (``/proc/cpuinfo`` names): a bf16 CPU call with no gradient or dropout whose fp32 q, k and v
    fit :data:`UPCAST_MAX_BYTES`, on a CPU with AVX-512 (``avx512f``) and without AMX-BF16 (see
    the module docstring). A pure function, so the rule for any CPU is testable on this one."""
    widths = max(call.head_dim, call.v_head_dim)  # as run: the narrower of K and V is padded
    copies = 4 * call.batch * widths * (call.num_heads * call.q_len + 2 * call.num_kv_heads * call.kv_len)
    return (call.device_type == "cpu" and call.dtype == torch.bfloat16 and not call.needs_grad
            and call.dropout_p == 0.0 and "avx512f" in flags and "amx_bf16" not in flags
            and copies <= UPCAST_MAX_BYTES)


#: This CPU's flags, read once at import (never inside code torch.compile traces).
_FLAGS_HERE = cpu_flags()


class SdpaBackend(BackendBase):
    name = "sdpa"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = []
        if call.return_weights:
            why.append("return_weights=True (SDPA does not return probabilities)")
        if call.softcap is not None:
            why.append("softcap (SDPA cannot express it)")
        if call.sinks is not None:
            why += sinks_refusals(call)
        return why

    def sdpa_args(self, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall):
        """(attn_mask, row_ok, is_causal) this backend hands to SDPA for ``call``; ``attn_mask``
        is None, a bool/float tensor or a ``CausalBias``; ``row_ok`` as in :func:`sdpa_mask`."""
        if call.mask is None:
            return None, None, False
        if call.reduced.is_top_left_causal:
            return None, None, True
        if _lower_right_bias(q, k, v, call):
            return _causal_bias_module().causal_lower_right(call.q_len, call.kv_len), None, False
        attn_mask, row_ok = sdpa_mask(call, q.dtype, q.device)
        return attn_mask, row_ok, False

    def kernel_name(self, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> str:
        """The SDPA kernel :meth:`run` reaches for ``call`` (see :func:`sdpa_kernel_name`)."""
        q, k, v = _equal_widths(q, k, v)
        attn_mask, _, is_causal = self.sdpa_args(q, k, v, call)
        with sdpa_kernel([SDPBackend.MATH]) if _math_for_grads(call) else contextlib.nullcontext():
            return sdpa_kernel_name(q, k, v, attn_mask, call.dropout_p, is_causal, call.scale,
                                    call.num_heads != call.num_kv_heads)

    def run(self, q, k, v, call: AttentionCall):
        Dv, dtype = v.shape[-1], q.dtype
        q, k, v = _equal_widths(q, k, v)
        if sdpa_upcasts(call, _FLAGS_HERE):
            q, k, v = q.float(), k.float(), v.float()
        out = self._run(q, k, v, call)
        return out[..., :Dv].to(dtype), None

    def _run(self, q, k, v, call: AttentionCall) -> Tensor:
        """:meth:`run` on equal widths, in q's dtype (bf16 calls maybe already widened)."""
        if call.sinks is not None:  # the CPU flash kernel's log-sum-exp carries the sinks
            G = call.groups
            if G > 1:
                k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            out, lse = CPU_FLASH[0](q, k, v, 0.0, call.mask is not None, scale=call.scale)
            ct = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's own precision
            return with_sinks(out.to(ct), lse.to(ct), call.sinks.detach())[0].to(q.dtype)
        attn_mask, row_ok, is_causal = self.sdpa_args(q, k, v, call)
        args = dict(attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal, scale=call.scale,
                    enable_gqa=call.num_heads != call.num_kv_heads)
        if _math_for_grads(call):
            with sdpa_kernel([SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(q, k, v, **args)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **args)
        return out if row_ok is None else out.masked_fill(~row_ok, 0.0)


def _equal_widths(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SDPA's fused kernels need equal K and V widths (otherwise it runs its math kernel): K wider
    than V (MLA's 192 / 128) pads V with zero channels, whose outputs are sliced off; V wider pads
    q and k, whose zero channels add nothing to the scores (the scale is passed explicitly)."""
    D, Dv = k.shape[-1], v.shape[-1]
    if D > Dv:
        return q, k, F.pad(v, (0, D - Dv))
    if Dv > D:
        return F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D)), v
    return q, k, v
