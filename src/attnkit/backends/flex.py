"""``flex``: torch FlexAttention compiled from the mask's ``mask_mod``, block masks cached.

The block mask of a call is built once per (mask key, batch, heads, Sq, Sk, device) and kept in
an LRU cache (:func:`block_mask_for`): per query head when the mask differs by head
(:func:`block_mask_heads`), else once for every head. The kernel is ``torch.compile``d once per
guard signature (:func:`guard_signature`: shapes, dtypes, the mask's and modifiers' code and constants), with
``dynamic=False`` (torch 2.13's CPU template fails to compile some dynamic-shape kernels). Each
signature compiles its own copy of the calling function (:func:`compiled_for`): dynamo keeps
compiled entries on a code object and, past its recompile limit (8 per code object by default),
runs the function uncompiled, where FlexAttention materializes every score; per-signature copies
never reach that limit, and no process-wide dynamo setting changes. A signature whose compile
fails (inductor finding no kernel) raises :class:`BackendCompileFailed` at once on later calls;
under ``auto`` the call then runs on the next backend, with a warning. Score modifiers (soft-cap,
ALiBi from its slopes, an additive bias, sinks through the log-sum-exp) are closures built per
call from the same code, over tensors and the soft-cap value: dynamo guards on their code and on
the captured tensors' shapes and dtypes, not on the tensors' values or the closures' identity, so
a new call of the same shape, dtype and modifiers reuses the compiled kernel (tests/test_flex.py
counts the compiles on CPU). Forward runs on CPU and CUDA; backward on CUDA only (FlexAttention's
CPU kernel is forward-only). Grouped heads go in unrepeated (``enable_gqa``). On CPU it refuses
the calls torch's compiled CPU kernel computes wrongly (:func:`cpu_refusals`).

``auto`` picks it on CUDA for the calls SDPA has no fused kernel for (:func:`sdpa_cannot_fuse`): a
soft cap or sinks (SDPA cannot express them), a bias (ALiBi is computed per score from its slopes
instead of a materialized (B, H, Sq, Sk) bias, and any bias is added in fp32 inside the kernel
rather than rounded to the input dtype), and masks with a pattern of whole blocks to skip (windows,
packed documents, prefix-LM, ragged causal ``q_start``, per-query selections: SDPA computes every
pair of them, through a materialized mask). Decode-sized calls (Sq <= 16) are left to the Triton
decode kernel and the others: each decode step has a new Sk, which would compile a new kernel per
step. On CPU ``auto`` never picks it: its first call per shape compiles, and the split-K engine
runs these modifiers fused already.

With the optional ``flash_attn`` package installed, a sliding window (with or without padding)
on fp16/bf16 CUDA also runs on the ``flash`` backend, which needs no compile.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections import OrderedDict

import torch

from .._sysinfo import cpu_flags
from ..masks.typed import has_selection
from .common import MAX_DECODE_Q_LEN, sink_rows
from .registry import AttentionCall, BackendBase, BackendCompileFailed

__all__ = ["FlexBackend", "MAX_DECODE_Q_LEN", "block_mask_for", "block_mask_heads", "compiled_for", "cpu_refusals",
           "cpu_vector_isa", "guard_signature", "sdpa_cannot_fuse", "wants_lse"]


def cpu_vector_isa(flags: frozenset[str] | None = None, capability: str | None = None,
                   machine: str | None = None) -> str:
    """The vector ISA torch.compile generates CPU code for here: "avx512", "avx2" (x86 without
    AVX-512, or ``ATEN_CPU_CAPABILITY`` set to ``avx2`` / ``default``, which inductor follows), or
    the machine name elsewhere ("aarch64", ...). Arguments default to this machine's CPU flags,
    environment and architecture; given, the answer is a pure function of them."""
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return machine
    flags = cpu_flags() if flags is None else flags
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "") if capability is None else capability
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags and capability.lower() not in ("avx2", "default"):
        return "avx512"
    return "avx2"


#: This process's :func:`cpu_vector_isa`, read once at import (never inside traced code).
_CPU_VECTOR_ISA = cpu_vector_isa()


def cpu_refusals(call: AttentionCall, vector_isa: str | None = None) -> list[str]:
    """What FlexAttention's compiled CPU kernel computes wrongly, so that ``flex`` refuses it on
    CPU (empty for other devices). ``vector_isa`` as :func:`cpu_vector_isa` (default: this
    machine's), so every machine's answer is testable on any machine.

    Checked against the fp64 oracle with torch 2.13 (eager FlexAttention is exact on the same
    inputs, so the compiled kernel is at fault):

    * its AVX2 code (x86 without AVX-512) returns wrong values, often NaN, for small head dims
      such as D = 16, with or without a mask and with equal K and V widths too;
    * a V narrower or wider than K (Dv != D) gives wrong values on the same machines; it is
      refused on every CPU, AVX-512 included.

    The oracle grid of tests/test_flex.py holds both kinds of call: a torch whose compiled CPU
    kernel computes them right re-admits them by dropping the refusal here and passing it."""
    if call.device_type != "cpu":
        return []
    why = []
    if (_CPU_VECTOR_ISA if vector_isa is None else vector_isa) == "avx2":
        why.append(f"CPU without AVX-512 (torch {torch.__version__}'s compiled CPU FlexAttention returns wrong "
                   "values in its AVX2 code)")
    if call.head_dim != call.v_head_dim:
        why.append(f"D={call.head_dim} != Dv={call.v_head_dim} on CPU (torch {torch.__version__}'s compiled CPU "
                   "FlexAttention returns wrong values when V's width differs from K's)")
    return why


def sdpa_cannot_fuse(call: AttentionCall) -> str | None:
    """What in ``call`` no SDPA kernel runs fused (None: SDPA's fused kernels serve it): a pure
    function of the call's description, so the CUDA decision is tested on CPU."""
    if call.softcap is not None:
        return "soft-capping"
    if call.sinks is not None:
        return "sinks"
    if call.reduced.has_bias:
        return "a bias (ALiBi or additive)"
    if call.reduced.has_structure:
        return "a mask with blocks to skip (window, documents, prefix, ragged q_start, a per-query selection)"
    return None

#: Compiled copies of :func:`_flex_call`, one per guard signature, least recently used first.
_COMPILED: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_COMPILED = 64
#: Guard signatures whose compile failed, with why (LRU): a call with one raises at once instead
#: of spending seconds failing again.
_FAILED: "OrderedDict[tuple, str]" = OrderedDict()


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises: inductor's errors, and dynamo's wrapper of a backend's."""
    errors = []
    for module, name in (("torch._inductor.exc", "InductorError"), ("torch._dynamo.exc", "BackendCompilerFailed")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)
_BLOCK_MASKS: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_CACHED = 64


#: Whether this torch has FlexAttention (torch >= 2.5), found without importing it (the import
#: pulls in torch._dynamo) and once, outside any code torch.compile traces.
_HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _flex_module():
    if not _HAS_FLEX:
        return None
    from torch.nn.attention import flex_attention as fa

    return fa


def _flex_call(flex_attention, q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse):
    """The function each guard signature compiles a copy of: q (B, Hq, Sq, D), k (B, Hkv, Sk, D),
    v (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv), with the (B, Hq, Sq) log-sum-exp when ``return_lse``."""
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, return_lse=return_lse)


def guard_signature(obj) -> object:
    """A hashable key holding what dynamo guards on in ``obj``: for a function, its code and what
    its closure captures (recursively); for a tensor, shape, dtype, device and requires_grad (not
    its values); for a BlockMask, its fields; constants as they are. Calls with equal signatures
    reuse one compiled entry; tensors' values never enter it, so new slopes, lengths or biases of
    the same shapes compile nothing."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(guard_signature(o) for o in obj))
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(obj).__name__, obj)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return ("function", code, tuple(guard_signature(c.cell_contents) for c in (obj.__closure__ or ())))
    as_tuple = getattr(obj, "as_tuple", None)  # a BlockMask: its sizes, block tensors and mask_mod
    if callable(as_tuple):
        return (type(obj).__name__, guard_signature(as_tuple()))
    return (type(obj).__name__, id(obj))  # anything else: keyed by identity, never conflated


def compiled_for(signature):
    """The compiled copy of :func:`_flex_call` for ``signature`` (compiled on its first call)."""
    fn = _COMPILED.get(signature)
    if fn is not None:
        _COMPILED.move_to_end(signature)
        return fn
    import types

    code = _flex_call.__code__.replace(co_name=f"_flex_call_{len(_COMPILED)}")  # a code object of its own
    fn = torch.compile(types.FunctionType(code, _flex_call.__globals__, code.co_name), dynamic=False)
    _COMPILED[signature] = fn
    if len(_COMPILED) > _MAX_COMPILED:
        _COMPILED.popitem(last=False)
    return fn


def block_mask_heads(call: AttentionCall) -> int | None:
    """The heads the block mask of ``call`` is built over: the call's query heads when the mask's
    allowed keys can differ by head (a per-head dense mask, a selection per KV head), else None
    (one block mask broadcast to every head; building it from head 0 is exact then)."""
    return call.num_heads if call.reduced.varies_by_head else None


def block_mask_for(call: AttentionCall, device):
    """The BlockMask for ``call.mask``, cached (LRU) per mask key, shape, heads and device. A mask
    holding tensors is keyed by identity and tensor versions (see ``Mask.cache_key``); the cache
    keeps such a mask alive so its id cannot be reused while its entry exists."""
    m = call.mask
    heads = block_mask_heads(call)
    key = (m.cache_key(), call.batch, heads, call.q_len, call.kv_len, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        _BLOCK_MASKS.move_to_end(key)
        return hit[0]
    bm = _selection_block_mask(call, heads, device) if has_selection(m) else None
    if bm is None:
        bm = _flex_module().create_block_mask(m.mask_mod(call.q_len, call.kv_len, device),
                                              call.batch if m.has_tensors else None, heads,
                                              call.q_len, call.kv_len, device=device)
    _BLOCK_MASKS[key] = (bm, m)
    if len(_BLOCK_MASKS) > _MAX_CACHED:
        _BLOCK_MASKS.popitem(last=False)
    return bm


#: FlexAttention's tile (query rows, keys) for the block masks built here.
_TILE = 128


def _selection_block_mask(call: AttentionCall, heads: int | None, device):
    """The BlockMask of a mask holding a selection, from the tiles its parts may allow
    (:meth:`Mask.block_occupancy`: the selection's lists, the positional parts' key ranges) and
    its ``mask_mod`` (the lists as a bitmap), so no (Sq, Sk) tensor is built: create_block_mask
    would evaluate the mask over every pair. Every listed tile is partial (mask_mod decides each
    pair). None where the occupancy is unknown or this torch's BlockMask cannot take it."""
    m = call.mask
    occ = m.block_occupancy(call.batch, call.q_len, call.kv_len, _TILE, _TILE, device)
    if occ is None:
        return None
    H = heads or 1
    if occ.shape[1] != H:
        if H % occ.shape[1]:
            return None
        occ = occ.repeat_interleave(H // occ.shape[1], dim=1)
    kv_num = occ.sum(-1, dtype=torch.int32)
    kv_idx = torch.argsort(occ.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    try:
        return _flex_module().BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(_TILE, _TILE),
                                                       mask_mod=m.mask_mod(call.q_len, call.kv_len, device),
                                                       seq_lengths=(call.q_len, call.kv_len))
    except TypeError:  # a torch whose from_kv_blocks takes no seq_lengths (2.5)
        return None


def _compose(mods):
    """One score_mod applying ``mods`` in order."""
    def score_mod(score, b, h, q, kv):
        for f in mods:
            score = f(score, b, h, q, kv)
        return score
    return score_mod


def _bias_score_mod(bias):
    """score_mod adding a (B|1, H|1, Sq|1, Sk|1) bias; size-1 dims broadcast."""
    pick = [(lambda i: 0) if n == 1 else (lambda i: i) for n in bias.shape]

    def score_mod(score, b, h, q, kv):
        return score + bias[pick[0](b), pick[1](h), pick[2](q), pick[3](kv)].to(score.dtype)

    return score_mod


def wants_lse(call: AttentionCall) -> bool:
    """Whether the call asks FlexAttention for each row's log-sum-exp: for sinks, and on CUDA for
    the empty rows it marks (-inf); FlexAttention's CPU kernel cannot return it (there the empty
    rows come from the mask's key intervals). A pure function of the call, tested on CPU."""
    return call.sinks is not None or call.device_type == "cuda"


def _empty_rows(call: AttentionCall, device):
    """(B|1, 1, Sq) bool, True where the mask leaves a query no key, for a mask that is one key
    interval per row (read without materializing it); None otherwise."""
    if call.reduced.rest is None:
        return None
    rng = call.reduced.intervals(device)
    if rng is None:
        return None
    lo, hi = (t.to(device).clamp(0, call.kv_len) for t in rng)
    empty = lo >= hi
    return empty.reshape((1,) * (2 - empty.dim()) + tuple(empty.shape)).expand(-1, call.q_len)[:, None]


class FlexBackend(BackendBase):
    name = "flex"

    def available(self) -> str | None:
        if not _HAS_FLEX:
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
        return None

    auto_devices = ("cuda",)  # auto_skip_reason turns every other device away too

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        if call.device_type != "cuda":
            return "not CUDA (its first call per shape compiles; the split-K engine fuses these calls already)"
        if call.q_len <= MAX_DECODE_Q_LEN:
            return f"Sq={call.q_len} <= {MAX_DECODE_Q_LEN}: decode steps change Sk every call (a compile each)"
        if sdpa_cannot_fuse(call) is None:
            return "SDPA's fused kernels run this call without a compile"
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = []
        if call.return_weights:
            why.append("return_weights=True")
        if call.dropout_p > 0:
            why.append("dropout_p > 0 (FlexAttention has no dropout)")
        if call.needs_grad and call.device_type in ("cpu", "mps"):
            why.append(f"backward on {call.device_type.upper()} (FlexAttention's {call.device_type.upper()} "
                       "kernel is forward-only)")
        if call.sinks is not None and call.device_type in ("cpu", "mps"):
            why.append(f"sinks on {call.device_type.upper()} (FlexAttention's compiled CPU kernel cannot return the "
                       "log-sum-exp they need)")
        if call.dtype == torch.float64 and call.device_type == "cpu":
            why.append("fp64 on CPU")
        if call.device_type not in ("cpu", "mps") and min(call.head_dim, call.v_head_dim) < 16:
            why.append(f"D={call.head_dim}, Dv={call.v_head_dim} on {call.device_type} (FlexAttention's Triton "
                       "kernel needs D and Dv >= 16)")
        return why + cpu_refusals(call)

    def run(self, q, k, v, call: AttentionCall):
        kwargs, mods = {}, []
        alibi = call.reduced.alibi
        if call.softcap is not None:  # on the scaled score, before any bias
            c = call.softcap
            mods.append(lambda s, b, h, qi, kv: torch.tanh(s / c) * c)
        if call.mask is not None:
            kwargs["block_mask"] = block_mask_for(call, q.device)
            # the rest's bias (ALiBi is per score below); a per-row shift would change the ratio to a sink
            bias = call.reduced.dense(q.device, alibi=False, shift=call.sinks is None)[1] \
                if call.reduced.rest_has_bias else None
            if bias is not None:  # -inf entries are in the block mask; add the finite rest
                mods.append(_bias_score_mod(bias.masked_fill(torch.isneginf(bias), 0.0)))
        if alibi is not None:  # computed per score, never materialized
            slopes = alibi.slopes.to(q.device)
            pos = alibi.positions(call.q_len, call.kv_len, q.device)
            pb = (lambda b: 0) if pos.shape[0] == 1 else (lambda b: b)
            mods.append(lambda s, b, h, qi, kv: s + (slopes[h] * (kv - pos[pb(b), qi])).to(s.dtype))
        if mods:
            kwargs["score_mod"] = _compose(mods)
        if not call.needs_grad:  # e.g. leaves that require grad under no_grad: FlexAttention
            q, k, v = q.detach(), k.detach(), v.detach()  # looks at .requires_grad alone (CPU refuses)
        # The log-sum-exp comes back where the kernel can return it (CUDA): it carries the sinks,
        # and -inf marks the rows with no key to attend to, which attnkit's contract makes exactly
        # 0 whatever FlexAttention's kernel of this torch version leaves there.
        want_lse = wants_lse(call)
        args = (_flex_module().flex_attention, q, k, v, kwargs.get("score_mod"), kwargs.get("block_mask"),
                call.scale, call.num_heads != call.num_kv_heads, want_lse)
        signature = guard_signature(args)
        why = _FAILED.get(signature)
        if why is not None:
            raise BackendCompileFailed(f"FlexAttention failed to compile this call before ({why})")
        try:
            res = compiled_for(signature)(*args)
        except compile_errors() as e:
            text = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {text[0][:200] if text else ''}"
            _FAILED[signature] = why
            if len(_FAILED) > _MAX_COMPILED:
                _FAILED.popitem(last=False)
            _COMPILED.pop(signature, None)
            raise BackendCompileFailed(f"FlexAttention failed to compile this call ({why})") from e
        out, lse = res if want_lse else (res, None)
        empty = torch.isneginf(lse) if lse is not None else _empty_rows(call, q.device)  # (B|1, Hq|1, Sq)
        if call.sinks is not None:  # the sinks join each row's denominator once: out * e^lse / (e^lse + e^sink)
            gate = torch.sigmoid(lse.float() - sink_rows(call.sinks).float())
            out = (out.float() * gate.unsqueeze(-1)).to(out.dtype)
        if empty is not None:
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        return out, None
