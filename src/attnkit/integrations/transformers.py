"""Hugging Face transformers attention backend: ``attn_implementation="attnkit"``.

Importing this module registers "attnkit" with transformers' ``AttentionInterface`` (the
function every attention layer calls) and ``AttentionMaskInterface`` (the function the model
calls once per forward to build its masks)::

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

Every attention layer then runs :func:`attnkit.attention`:

* GQA / MQA without ``repeat_kv``: k, v (B, Hkv, Sk, D) go in as they are.
* Masks stay typed. The mask function recognises transformers' causal, sliding-window and
  bidirectional patterns and hands the layers an :class:`AttnkitMask` holding
  ``Causal`` / ``SlidingWindow`` (with the cache's query offset) ``& KeyPadding`` (from the 2-D
  ``attention_mask``: per-row lengths when it is left or right padding, so the whole mask is one
  key interval per query); nothing (B, Sq, Sk)-sized is built for them. Any other
  pattern (packed sequences, custom ``or``/``and`` mask functions, chunked attention) is
  materialized exactly as transformers' SDPA mask would be.
* A dense 4-D mask a user passes is accepted: bool True = attend, float added to the scores
  (values at or below the dtype's minimum, transformers' "masked" sentinel, mean masked).
* ``scaling``, dropout (``dropout`` is already 0 in eval), ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``) and ``s_aux`` (gpt-oss' per-head sinks) pass through to
  :func:`attnkit.attention`; ``output_attentions=True`` returns the weights.

One difference from ``eager``: a query with no key to attend to (a left-padding position) gets an
output of exactly 0 rather than the mean of every value; real positions are unaffected.

Shapes (transformers' convention at the interface): query (B, Hq, Sq, D), key (B, Hkv, Sk, D),
value (B, Hkv, Sk, Dv); the output goes back as (B, Sq, Hq, Dv).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import Tensor

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
except ImportError as e:  # pragma: no cover - exercised by the missing-package test
    raise ImportError(f"attnkit.integrations.transformers needs Hugging Face transformers "
                      f"(pip install 'attnkit[hf]'): {e}") from None

from ..functional import attention
from ..masks import Additive, And, Causal, Dense, KeyPadding, Mask, SlidingWindow

__all__ = ["NAME", "AttnkitMask", "attention_forward", "make_mask", "register"]

#: The ``attn_implementation`` name registered on import.
NAME = "attnkit"

_ATTENTION_PARAMS = frozenset(inspect.signature(attention).parameters)


class AttnkitMask:
    """What the "attnkit" mask function hands the attention layers: one attnkit mask (or None:
    attend everywhere) for a (B, H, Sq, Sk) call, like FlexAttention's ``BlockMask`` is for
    "flex_attention". ``generate`` may call ``.contiguous()`` on it and give it back to the
    model as a prepared mask; both are no-ops here.

    Attributes:
        mask: an :mod:`attnkit.masks` object (True = attend) or None.
        shape: (B, 1, Sq, Sk), what the mask covers.
    """

    ndim = 4

    def __init__(self, mask: Mask | None, batch: int, q_len: int, kv_len: int):
        self.mask = mask
        self.shape = (batch, 1, q_len, kv_len)

    def contiguous(self) -> "AttnkitMask":
        return self

    def dim(self) -> int:
        return 4

    def __repr__(self) -> str:
        return f"AttnkitMask({self.mask!r}, shape={self.shape})"


# ---------------------------------------------------------------------------- the mask function


def _window_of(fn: Callable, local_size: int) -> bool:
    """True if the index-based mask function ``fn`` is transformers' sliding-window causal
    pattern of ``local_size`` tokens (``q - local_size < kv <= q``), checked on a few query
    rows around the window's edges (O(local_size) work)."""
    W = int(local_size)
    q = torch.tensor([0, 1, W - 1, W, W + 1, 2 * W + 1]).clamp_min(0).view(1, 1, -1, 1)
    kv = torch.arange(2 * W + 3).view(1, 1, 1, -1)
    b = h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    try:
        got = fn(b, h, q, kv)
    except Exception:  # not index-based after all: let the caller materialize it
        return False
    want = (kv <= q) & (kv > q - W)
    return isinstance(got, Tensor) and got.dtype == torch.bool and bool((got.expand_as(want) == want).all())


def _pattern(fn: Callable, local_size: int | None, use_vmap: bool):
    """"causal", "bidirectional", ("window", W) or None (not recognised: materialize)."""
    if use_vmap:
        return None
    if fn is causal_mask_function:
        return "causal"
    if fn is bidirectional_mask_function:
        return "bidirectional"
    if local_size is not None and _window_of(fn, local_size):
        return ("window", int(local_size))
    return None


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def make_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function: Callable = causal_mask_function, attention_mask: Tensor | None = None,
              local_size: int | None = None, use_vmap: bool = False, device="cpu", **kwargs) -> AttnkitMask:
    """transformers' mask-interface signature (as ``sdpa_mask``): query row i sits at position
    ``q_offset + i``, key column j at ``kv_offset + j``; ``attention_mask`` (B, >= kv_offset +
    kv_length) is the 2-D padding mask (True / 1 = real token). Returns an :class:`AttnkitMask`."""
    if isinstance(attention_mask, AttnkitMask):  # prepared by generate() and handed back
        return attention_mask
    pattern = _pattern(mask_function, local_size, use_vmap)
    if pattern is None:
        dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                          use_vmap=use_vmap, device=device)
        return AttnkitMask(Dense(dense), batch_size, q_length, kv_length)
    parts: list[Mask] = []
    reach = kv_length  # keys some query may see: padding beyond them does not matter
    if pattern != "bidirectional":
        # Query i sees key j iff kv_offset + j <= q_offset + i (and, windowed, > q_offset + i - W).
        offset = q_offset - kv_offset
        if isinstance(offset, Tensor):
            offsets = {"offsets": offset.to(device=device, dtype=torch.long).clone()}
        elif offset == kv_length - q_length:
            offsets = {}  # bottom-right: lets backends use their causal fast paths
        else:
            offsets = {"offsets": torch.tensor(int(offset), device=device)}
        parts.append(Causal(**offsets) if pattern == "causal" else SlidingWindow(pattern[1] - 1, **offsets))
        if not _is_tracing():
            reach = min(kv_length, q_length + int(offset.max() if isinstance(offset, Tensor) else offset))
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        need = kv_offset + kv_length
        if valid.shape[-1] < need:  # positions not seen yet (static caches): padding
            valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
        valid = valid[:, kv_offset:need]
        if _is_tracing():
            parts.append(KeyPadding(valid=valid))
        elif not bool(valid[:, :reach].all()):
            parts.append(_key_padding(valid, reach))
    mask = None if not parts else (parts[0] if len(parts) == 1 else And(*parts))
    return AttnkitMask(mask, batch_size, q_length, kv_length)


def _key_padding(valid: Tensor, reach: int) -> KeyPadding:
    """(B, Sk) bool (True = real key) as lengths when it is left or right padding over the first
    ``reach`` keys (the ones any query can see): ``KeyPadding(lengths, side=...)`` is one key
    interval per row, which kernels walk without a materialized mask; else ``valid=``."""
    B, Sk = valid.shape
    j = torch.arange(Sk, device=valid.device)[None]
    lead = (~valid).int().cumprod(-1).sum(-1)  # (B,) leading padding
    if torch.equal(valid[:, :reach], (j >= lead[:, None])[:, :reach]):
        return KeyPadding(Sk - lead, side="left")
    n = valid.sum(-1)
    if torch.equal(valid[:, :reach], (j < n[:, None])[:, :reach]):
        return KeyPadding(n, side="right")
    return KeyPadding(valid=valid)


# ---------------------------------------------------------------------------- the attention function


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))


def _dense_to_attnkit(m: Tensor) -> Mask:
    """A transformers 4-D mask: bool True = attend; float added, where values at or below the
    dtype's minimum (transformers' eager "masked" value, or -inf) mean masked."""
    if m.dtype == torch.bool:
        return Dense(m)
    if not m.dtype.is_floating_point:
        raise TypeError(f"attention_mask must be bool (True = attend) or floating (added), got {m.dtype} "
                        f"of shape {_shape(m)}")
    blocked = m <= torch.finfo(m.dtype).min
    rest = m.masked_fill(blocked, 0.0)
    if not bool(rest.any()):
        return Dense(~blocked)
    return Additive(m.masked_fill(blocked, float("-inf")))


def _extra_kwargs(softcap, sinks) -> dict:
    extra = {}
    for name, value in (("softcap", softcap), ("sinks", sinks)):
        if value is None:
            continue
        if name not in _ATTENTION_PARAMS:
            raise NotImplementedError(f"this model passes {name}= (Gemma 2's attn_logit_softcapping / gpt-oss' "
                                      f"sinks), which this attnkit's attention() does not take yet")
        extra[name] = float(value) if name == "softcap" else value
    return extra


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: AttnkitMask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: Tensor | None = None, position_bias: Tensor | None = None,
                      **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-interface signature.

    Args:
        module: the calling attention layer (its ``is_causal`` is read when no mask is given).
        query: (B, Hq, Sq, D); key: (B, Hkv, Sk, D); value: (B, Hkv, Sk, Dv), Hq % Hkv == 0.
        attention_mask: an :class:`AttnkitMask`, a bool / float tensor broadcastable to
            (B, Hq, Sq, Sk), or None (then ``is_causal`` / ``module.is_causal`` decides:
            bottom-right causal, windowed by ``sliding_window`` if given).
        dropout: attention dropout probability (transformers passes 0 in eval).
        scaling: score scale (default D**-0.5).
        softcap: scores -> softcap * tanh(scores / softcap) before masking (Gemma 2).
        s_aux: (Hq,) sink logits joining each head's softmax denominator (gpt-oss).
        position_bias: an additive (B|1, Hq|1, Sq, Sk) score bias (T5-style models).

    Returns:
        (out (B, Sq, Hq, Dv), weights (B, Hq, Sq, Sk) in query's dtype with
        ``output_attentions=True``, else None).
    """
    if kwargs.get("cache") is not None:
        raise NotImplementedError("attn_implementation='attnkit' does not run transformers' continuous batching "
                                  "(PagedAttentionCache); use model.generate()")
    B, Hq, Sq, _ = query.shape
    Sk = key.shape[2]
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    mask: Mask | None
    if isinstance(attention_mask, AttnkitMask):
        if attention_mask.shape[2:] != (Sq, Sk):
            raise ValueError(f"attention_mask was built for (Sq, Sk) = {attention_mask.shape[2:]} but this layer has "
                             f"query {_shape(query)} and key {_shape(key)}")
        mask = attention_mask.mask
    elif isinstance(attention_mask, Tensor):
        mask = _dense_to_attnkit(attention_mask)
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = None
        if causal:
            mask = Causal() if not sliding_window else SlidingWindow(int(sliding_window) - 1)
    else:
        raise TypeError(f"attention_mask must be an AttnkitMask, a tensor or None, got {type(attention_mask).__name__}: "
                        f"build the model's masks with attn_implementation='{NAME}'")
    if position_bias is not None:
        bias = Additive(position_bias)
        mask = bias if mask is None else mask & bias
    want_weights = bool(kwargs.get("output_attentions", False))
    res = attention(query, key, value, mask, scale=scaling, dropout_p=float(dropout), return_weights=want_weights,
                    **_extra_kwargs(softcap, s_aux))
    out, weights = res if want_weights else (res, None)
    if weights is not None:
        weights = weights.to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


def register(name: str = NAME) -> str:
    """Register the attention and mask functions with transformers under ``name`` (done for
    "attnkit" on import); returns the name."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, make_mask)
    return name


register()
