"""``flex``: torch FlexAttention compiled from the mask's ``mask_mod``, block masks cached.

The block mask of a call is built once per (mask key, batch, Sq, Sk, device) and kept in an LRU
cache (:func:`block_mask_for`); the kernel is ``torch.compile``d once per shape
(``dynamic=False``). Forward runs on CPU and CUDA; backward on CUDA only (FlexAttention's CPU
kernel is forward-only). Grouped heads go in unrepeated (``enable_gqa``).

``auto`` never picks it: its first call per shape compiles (seconds: about 6-30 s on a 2-core
CPU, several on a GPU), and without a GPU to measure on, the point where that pays off is not
known. Force it with ``backend="flex"`` when all of these hold:

* the mask is one SDPA has to materialize densely: :class:`~attnkit.masks.SlidingWindow`,
  :class:`~attnkit.masks.Document` (packed sequences), :class:`~attnkit.masks.PrefixLM`,
  per-sequence ``offsets``, or an AND/OR of those. SDPA then computes every (query, key) pair
  through its memory-efficient or cuDNN kernel (or math); FlexAttention skips fully masked
  blocks, so its work shrinks with the fraction of blocks the mask removes (a 4k window over
  32k tokens touches ~1/8 of the (Sq, Sk) grid SDPA computes). Plain and causal masks are not
  in this list: SDPA's flash / cuDNN kernels run them without a mask tensor or a compile. Key
  padding alone runs on SDPA's fused kernels with a bool mask; flex only pays off there when
  a large share of the batch is padding;
* the same shapes repeat many times (a training loop, fixed-size prefill buckets), so the
  compile is paid once. Varying lengths (every decode step has a new Sk) recompile;
* the call needs neither dropout nor ``return_weights``, and on CUDA D and Dv are >= 16.

With the optional ``flash_attn`` package installed, a sliding window (with or without padding)
on fp16/bf16 CUDA also runs on the ``flash`` backend, which needs no compile.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..masks import shifted_bias, split_alibi
from .registry import AttentionCall, BackendBase

_COMPILED = None
_BLOCK_MASKS: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_CACHED = 64


def _flex_module():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:  # torch < 2.5
        return None
    return fa


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _COMPILED


def block_mask_for(call: AttentionCall, device):
    """The BlockMask for ``call.mask``, cached (LRU) per mask key, shape and device. A mask holding
    tensors is keyed by identity and tensor versions (see ``Mask.cache_key``); the cache keeps
    such a mask alive so its id cannot be reused while its entry exists."""
    m = call.mask
    key = (m.cache_key(), call.batch, call.q_len, call.kv_len, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        _BLOCK_MASKS.move_to_end(key)
        return hit[0]
    bm = _flex_module().create_block_mask(m.mask_mod(call.q_len, call.kv_len, device),
                                          call.batch if m.has_tensors else None, None,
                                          call.q_len, call.kv_len, device=device)
    _BLOCK_MASKS[key] = (bm, m)
    if len(_BLOCK_MASKS) > _MAX_CACHED:
        _BLOCK_MASKS.popitem(last=False)
    return bm


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


class FlexBackend(BackendBase):
    name = "flex"

    def available(self) -> str | None:
        if _flex_module() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
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
        return why

    def run(self, q, k, v, call: AttentionCall):
        kwargs, mods = {}, []
        mask, alibi = split_alibi(call.mask)
        if call.softcap is not None:  # on the scaled score, before any bias
            c = call.softcap
            mods.append(lambda s, b, h, qi, kv: torch.tanh(s / c) * c)
        if call.mask is not None:
            kwargs["block_mask"] = block_mask_for(call, q.device)
            bias = None if mask is None else (  # a per-row shift would change the ratio to a sink
                mask.bias(call.batch, call.q_len, call.kv_len, q.device) if call.sinks is not None
                else shifted_bias(mask, call.batch, call.q_len, call.kv_len, q.device))
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
        res = _compiled()(q, k, v, scale=call.scale, enable_gqa=call.q_heads != call.kv_heads,
                          return_lse=call.sinks is not None, **kwargs)
        if call.sinks is None:
            return res, None
        out, lse = res  # the sinks join each row's denominator once: out * e^lse / (e^lse + e^sink)
        gate = torch.sigmoid(lse.float() - call.sinks.float().view(1, -1, 1))
        return (out.float() * gate.unsqueeze(-1)).to(out.dtype), None
