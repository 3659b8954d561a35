"""``flex``: torch FlexAttention compiled from the mask's ``mask_mod``, block masks cached.

Optional: the first compiled call per shape takes seconds (about 6-30 s on a 2-core CPU), then
runs at fused-kernel speed, so ``auto`` never picks it for one-off calls; force it with
``backend="flex"`` for long runs of one shape with masks SDPA cannot express cheaply (sliding
window, document, prefix-LM and their compositions).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..masks import shifted_bias
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
    """The BlockMask for ``call.mask``, cached (LRU) per mask key and shape. A mask holding
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
        if call.needs_grad and call.device.type == "cpu":
            why.append("backward on CPU (FlexAttention's CPU kernel is forward-only)")
        if call.dtype == torch.float64 and call.device.type == "cpu":
            why.append("fp64 on CPU")
        return why

    def run(self, q, k, v, call: AttentionCall):
        kwargs = {}
        if call.mask is not None:
            kwargs["block_mask"] = block_mask_for(call, q.device)
            bias = shifted_bias(call.mask, call.batch, call.q_len, call.kv_len, q.device)
            if bias is not None:  # -inf entries are in the block mask; add the finite rest
                kwargs["score_mod"] = _bias_score_mod(bias.masked_fill(torch.isneginf(bias), 0.0))
        out = _compiled()(q, k, v, scale=call.scale, enable_gqa=call.q_heads != call.kv_heads, **kwargs)
        return out, None
