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
* A model that reads the mask itself (DeepSeek sparse attention's indexer slices it, Doge builds
  its dynamic mask from it) gets a real tensor: the :class:`AttnkitMask` materializes, on first
  use by torch, to the bool (B, 1, Sq, Sk) tensor transformers' SDPA mask would be.
* A dense 4-D mask a user passes is accepted: bool True = attend, float added to the scores
  (values at or below the dtype's minimum, transformers' "masked" sentinel, mean masked).
* ``scaling``, dropout (``dropout`` is already 0 in eval), ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``), ``s_aux`` / ``sinks`` of one logit per head (gpt-oss),
  ``position_bias`` (T5-style) and ``indices`` (DeepSeek sparse attention's top-k keys) pass
  through to :func:`attnkit.attention`; attention weights come back whenever transformers
  records them (``output_attentions=True``).
* Every other keyword argument a model passes is either known to leave the result unchanged
  (:data:`HARMLESS_KWARGS`) or refused with an error naming it: silently ignoring, say, a
  sparse block selection would give dense attention and different outputs.
* A model attnkit cannot serve is refused when it is built (``from_pretrained`` /
  ``from_config`` / ``set_attn_implementation``), naming the model: one whose attention layers
  do not call transformers' attention interface (BLOOM, Falcon, GIT) would never run attnkit
  (:func:`unserved_reason`, :func:`_guard_layer_tables`).

Fully masked query rows: a query with no key to attend to (a left-padding position, or a row
of a user's 4-D mask that is all masked) gets an output of exactly 0, as SDPA gives for a bool
mask; ``eager`` (and SDPA with a float mask) give the mean of every value instead. Other
positions see that difference only through keys they may attend to: transformers' padding masks
hide padded keys from every query, so real positions are unaffected by padding; a user's mask
whose fully masked row is still visible as a key to later queries carries it into the next layer.

Shapes (transformers' convention at the interface): query (B, Hq, Sq, D), key (B, Hkv, Sk, D),
value (B, Hkv, Sk, Dv); the output goes back as (B, Sq, Hq, Dv).
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from torch import Tensor

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:  # pragma: no cover - exercised by the missing-package test
    raise ImportError(f"attnkit.integrations.transformers needs Hugging Face transformers "
                      f"(pip install 'attnkit[hf]'): {e}") from None

try:  # transformers' record of which outputs the current forward collects (see _weights_requested)
    from transformers.utils.output_capturing import _active_collector as _output_collector
except ImportError:  # pragma: no cover - older/newer transformers: only the output_attentions flag counts
    _output_collector = None

from .._checks import shape_of
from ..functional import attention
from ..masks import Additive, And, Causal, Dense, KeyPadding, Mask, SlidingWindow

__all__ = ["NAME", "HARMLESS_KWARGS", "AttnkitMask", "attention_forward", "make_mask", "register",
           "unserved_reason"]

#: The ``attn_implementation`` name registered on import.
NAME = "attnkit"


class AttnkitMask:
    """What the "attnkit" mask function hands the attention layers: one attnkit mask (or None:
    attend everywhere) for a (B, H, Sq, Sk) call, like FlexAttention's ``BlockMask`` is for
    "flex_attention". ``generate`` may call ``.contiguous()`` on it and give it back to the
    model as a prepared mask; both are no-ops here.

    Models that only pass the mask on never make it build anything. A model that reads it (slices
    it, asks its ``dtype``, adds it to something, hands it to a torch function) gets the tensor
    transformers' SDPA mask function would have returned: bool (B, 1, Sq, Sk), True = attend,
    built once on first use (:meth:`materialize`) and shared by every layer, as SDPA's is. Every
    model that runs on "sdpa" already reads masks of that form. It is not a ``torch.Tensor``
    subclass, so ``isinstance(mask, torch.Tensor)`` is False, as for ``BlockMask``.

    Attributes:
        mask: an :mod:`attnkit.masks` object (True = attend) or None.
        shape: torch.Size (B, 1, Sq, Sk), what the mask covers.
        dtype: torch.bool, the dtype of the materialized tensor.
        device: where the materialized tensor lives.
    """

    ndim = 4
    dtype = torch.bool

    def __init__(self, mask: Mask | None, batch: int, q_len: int, kv_len: int, device="cpu"):
        self.mask = mask
        self.shape = torch.Size((batch, 1, q_len, kv_len))
        self.device = torch.device(device)
        self._tensor: Tensor | None = None

    def materialize(self) -> Tensor:
        """The mask as transformers' SDPA mask: bool (B, 1, Sq, Sk), True = attend (cached)."""
        if self._tensor is None:
            B, _, Sq, Sk = self.shape
            if self.mask is None:
                t = torch.ones(self.shape, dtype=torch.bool, device=self.device)
            else:
                # contiguous: models may index or modify it like the tensor SDPA hands them
                t = self.mask.materialize(B, Sq, Sk, self.device).expand(self.shape).contiguous()
            self._tensor = t
        return self._tensor

    def contiguous(self) -> "AttnkitMask":
        return self

    def dim(self) -> int:
        return 4

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch calls this for any torch function or tensor method that receives an AttnkitMask
        # (torch.where(mask, ...), scores + mask, scores.masked_fill(mask, ...)): run it on the
        # materialized tensor.
        return func(*_materialized(args), **_materialized(kwargs or {}))

    def __getattr__(self, name: str):
        # Only reached for names the class does not define: tensor methods and attributes
        # (masked_fill, to, bool, sum, ...) answer from the materialized tensor. Private and
        # special names are not forwarded (copy / pickle probe them before __init__ has run).
        if name.startswith("_") or name == "mask":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"AttnkitMask({self.mask!r}, shape={tuple(self.shape)})"


def _forward_to_tensor(name: str):
    def method(self, *args):
        return getattr(self.materialize(), name)(*args)
    method.__name__ = name
    return method


# Python looks operators up on the class, never through __getattr__: each one that a model may
# apply to a mask tensor (mask[:, 0], ~mask, mask & other, scores + mask, mask == 0) is forwarded.
for _op in ("__getitem__", "__invert__", "__neg__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
            "__rxor__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__eq__", "__ne__",
            "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(AttnkitMask, _op, _forward_to_tensor(_op))
AttnkitMask.__hash__ = object.__hash__  # identity, as before __eq__ was forwarded


def _materialized(x):
    if isinstance(x, AttnkitMask):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_materialized(v) for v in x)
    if isinstance(x, dict):
        return {k: _materialized(v) for k, v in x.items()}
    return x


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
    # A window of no token (Qwen2-MoE's configs give sliding_window=0 to models that use no
    # windowed layer, and transformers still builds that mask) is left to sdpa_mask.
    if local_size is not None and local_size >= 1 and _window_of(fn, local_size):
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
        return AttnkitMask(Dense(dense), batch_size, q_length, kv_length, device)
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
    return AttnkitMask(mask, batch_size, q_length, kv_length, device)


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


# ---------------------------------------------------------------------------- keyword arguments

#: Keyword arguments models pass to the attention function that leave its result unchanged
#: (checked against transformers 5.24: ``sdpa_attention_forward``, ``flex_attention_forward``,
#: the models' eager functions, and what every causal LM passes). Each is listed with the reason.
#: Arguments that change the result are parameters of :func:`attention_forward`; anything else
#: that is not None is refused (:func:`_check_kwargs`).
HARMLESS_KWARGS: dict[str, str] = {
    "position_ids": "RoPE was applied before the call; the mask function reads packed documents from them",
    "cache_position": "the mask function placed the queries from it",
    "cu_seq_lens_q": "packed-document boundaries for varlen flash kernels: the 4-D mask already holds them, "
                     "as for sdpa and eager",
    "cu_seq_lens_k": "as cu_seq_lens_q",
    "max_length_q": "a varlen kernel's buffer size",
    "max_length_k": "a varlen kernel's buffer size",
    "seq_idx": "packed-sequence index for state-space layers, not attention",
    "use_cache": "the layer has updated its cache before calling attention",
    "cache": "the layer has read and written its cache before calling attention (a continuous-batching "
             "PagedAttentionCache is refused)",
    "past_key_values": "as cache (transformers' name before 5.40)",
    "past_key_value": "as cache (older name)",
    "layer_past": "as cache (older name)",
    "output_hidden_states": "a model-level output flag",
    "output_router_logits": "a mixture-of-experts output flag",
    "return_dict": "a model-level output flag",
    "num_items_in_batch": "loss normalisation",
    "logits_to_keep": "which positions the language-model head computes",
    "encoder_hidden_states": "cross-attention inputs, already projected into key and value",
    "deterministic": "a flash-attention option for how its backward accumulates",
    "target_dtype": "the dtype flash-attention casts fp32 inputs to",
}

# Refused arguments whose meaning we know: the error says what the model wanted.
_REFUSAL_HINTS = {
    "block_indices": "MiniMax-M3's sparse block selection: per query, the key blocks it may attend to",
    "sinks": "attention-sink logits of another shape than one per query head, (Hq,), which is what attnkit takes; "
             "Inkling 2 passes one per query",
    "s_aux": "attention-sink logits of another shape than one per query head, (Hq,), which is what attnkit takes",
    "topk_indices": "a sparse top-k key selection",
    "block_table": "a paged KV layout (continuous batching)",
}


def _refuse(module, name: str, value, what: str | None = None) -> NotImplementedError:
    desc = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"{value!r}"[:80]
    hint = what or _REFUSAL_HINTS.get(name, "an argument attnkit does not implement and may change the result")
    return NotImplementedError(
        f"attn_implementation='{NAME}' cannot honour {name}= ({hint}), which {type(module).__name__} passes to its "
        f"attention function as {desc}: ignoring it would compute different attention. Load the model with "
        f"attn_implementation='eager' or another implementation that supports {name}=.")


def _check_kwargs(module, kwargs: dict) -> None:
    """Raise for every keyword argument that is neither harmless nor None (see HARMLESS_KWARGS)."""
    for name, value in kwargs.items():
        if value is None or name == "output_attentions":
            continue
        if name in ("cache", "past_key_values") and type(value).__name__ == "PagedAttentionCache":
            raise NotImplementedError(f"attn_implementation='{NAME}' does not run transformers' continuous batching "
                                      f"(PagedAttentionCache); use model.generate()")
        if name not in HARMLESS_KWARGS:
            raise _refuse(module, name, value)


def _per_head_sinks(module, name: str, value: Tensor, heads: int) -> Tensor:
    """gpt-oss' ``s_aux`` (and a per-head ``sinks``): one logit per query head, (Hq,)."""
    if not isinstance(value, Tensor) or value.shape != (heads,):
        raise _refuse(module, name, value, _REFUSAL_HINTS[name] + f" (here Hq = {heads})")
    return value


def _selected_keys(module, indices: Tensor, batch: int, q_len: int, kv_len: int, device) -> Mask:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, ...): (B, Sq, k) indices of the keys
    each query keeps (negative = an unused slot, flash-mla's padding), as the bool (B, 1, Sq, Sk)
    mask transformers' eager and sdpa paths AND into the attention mask themselves."""
    if not isinstance(indices, Tensor) or indices.dtype.is_floating_point or indices.dim() != 3 \
            or tuple(indices.shape[:2]) not in ((batch, q_len), (1, q_len)):
        raise _refuse(module, "indices", indices, f"a sparse key selection, expected integer (B, Sq, k) = "
                                                  f"({batch}, {q_len}, k)")
    idx = indices.to(device=device, dtype=torch.long)
    idx = idx.masked_fill(idx < 0, kv_len)  # unused slots land in one extra column, dropped below
    keep = torch.zeros(idx.shape[0], q_len, kv_len + 1, dtype=torch.bool, device=device)
    return Dense(keep.scatter_(-1, idx, True)[..., :kv_len].unsqueeze(1))


def _weights_requested(kwargs: dict) -> bool:
    """Whether transformers will record this layer's attention weights.

    Models that forward their keyword arguments pass ``output_attentions`` down; others drop it
    on the way (GPT-2 pops it, StableLM, OPT, GPT-BigCode, Nemotron and Persimmon do not forward
    it), although transformers still records the weights the layers return, with forward hooks
    driven by its output collector. Asking the collector covers both."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _output_collector.get() if _output_collector is not None else None
    return bool(collecting) and ("attentions" in collecting or "cross_attentions" in collecting)


# ---------------------------------------------------------------------------- the attention function



def _and(mask: Mask | None, other: Mask) -> Mask:
    return other if mask is None else mask & other


def _dense_to_attnkit(m: Tensor) -> Mask:
    """A transformers 4-D mask: bool True = attend; float added, where values at or below the
    dtype's minimum (transformers' eager "masked" value, or -inf) mean masked: a row of them
    outputs 0, as a bool row of False does (see the module docstring)."""
    if m.dtype == torch.bool:
        return Dense(m)
    if not m.dtype.is_floating_point:
        raise TypeError(f"attention_mask must be bool (True = attend) or floating (added), got {m.dtype} "
                        f"of shape {shape_of(m)}")
    blocked = m <= torch.finfo(m.dtype).min
    rest = m.masked_fill(blocked, 0.0)
    if not bool(rest.any()):
        return Dense(~blocked)
    return Additive(m.masked_fill(blocked, float("-inf")))


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: AttnkitMask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: Tensor | None = None, sinks: Tensor | None = None,
                      position_bias: Tensor | None = None, indices: Tensor | None = None,
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
        sliding_window: window in tokens, the current one included; read only without a mask
            (a mask already holds the window, as for sdpa).
        softcap: scores -> softcap * tanh(scores / softcap) before masking (Gemma 2).
        s_aux, sinks: (Hq,) sink logits joining each head's softmax denominator (gpt-oss);
            any other shape (Inkling 2's per-query sinks) is refused.
        position_bias: an additive (B|1, Hq|1, Sq, Sk) score bias (T5-style models).
        indices: (B, Sq, k) keys each query keeps (DeepSeek sparse attention), ANDed with the mask.
        **kwargs: ``output_attentions`` and :data:`HARMLESS_KWARGS`; any other argument that is
            not None raises NotImplementedError naming it.

    Returns:
        (out (B, Sq, Hq, Dv), weights (B, Hq, Sq, Sk) in query's dtype when transformers records
        attention weights, else None).
    """
    _check_kwargs(module, kwargs)
    B, Hq, Sq, _ = query.shape
    Sk = key.shape[2]
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    sink_logits = None
    for name, given in (("s_aux", s_aux), ("sinks", sinks)):
        if given is not None:
            sink_logits = _per_head_sinks(module, name, given, Hq)
    mask: Mask | None
    if isinstance(attention_mask, AttnkitMask):
        if attention_mask.shape[2:] != (Sq, Sk):
            raise ValueError(f"attention_mask was built for (Sq, Sk) = {tuple(attention_mask.shape[2:])} but this "
                             f"layer has query {shape_of(query)} and key {shape_of(key)}")
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
    if indices is not None:
        mask = _and(mask, _selected_keys(module, indices, B, Sq, Sk, query.device))
    if position_bias is not None:
        mask = _and(mask, Additive(position_bias))
    want_weights = _weights_requested(kwargs)
    res = attention(query, key, value, mask, scale=scaling, dropout_p=float(dropout), return_weights=want_weights,
                    softcap=None if softcap is None else float(softcap), sinks=sink_logits)
    out, weights = res if want_weights else (res, None)
    if weights is not None:
        weights = weights.to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


# ---------------------------------------------------------------------------- models attnkit cannot serve


# Models that call the attention interface but need something attnkit does not do, found by
# running every causal LM of transformers 5.24 on "attnkit" against "eager". The attention
# function refuses their arguments too (at the first forward); naming them here moves the error
# to load time. model_type -> (whether a config of it is affected, why).
_UNSERVED_MODEL_TYPES: dict[str, tuple[Callable, str]] = {
    "deepseek_v4": (lambda config: True,
                    "appends its compressed keys' block bias to the attention mask only when the mask is a tensor "
                    "(it runs on 'eager' only), so its layers would get a mask shorter than their keys"),
    "inkling2_text": (lambda config: True, "passes per-query attention-sink logits, sinks= of shape (B, Hq, Sq, 1); "
                                           "attnkit takes one sink logit per query head"),
    "inkling2_loop_text": (lambda config: True, "passes per-query attention-sink logits, sinks= of shape "
                                                "(B, Hq, Sq, 1); attnkit takes one sink logit per query head"),
    "minimax_m3_vl_text": (lambda config: "minimax_m3_sparse" in (getattr(config, "layer_types", None) or ()),
                           "its sparse layers pass block_indices= (a per-query selection of key blocks), which "
                           "attnkit does not implement"),
}


def unserved_reason(model: PreTrainedModel) -> str | None:
    """Why ``attn_implementation="attnkit"`` cannot serve ``model`` (a PreTrainedModel, checked
    per class: a composite model's sub-models are checked as they are built), or None.

    * A model whose attention layers do not call transformers' attention interface (BLOOM,
      Falcon, MPT, BigBird, and others written before it) would compute attention its own way on
      attnkit's mask object. transformers' own test for "can this model switch implementation"
      (the modeling file defines attention modules but never fetches an interface function)
      finds them.
    * A model of :data:`_UNSERVED_MODEL_TYPES` needs something attnkit does not do."""
    cls, config = type(model), model.config
    if not cls._can_set_attn_implementation():
        return (f"{cls.__name__} ({config.model_type}) computes attention in its own code instead of calling "
                f"transformers' attention interface, so attn_implementation='{NAME}' would never run attnkit")
    affected, why = _UNSERVED_MODEL_TYPES.get(config.model_type, (lambda config: False, ""))
    if affected(config):
        return f"{cls.__name__} ({config.model_type}) {why}"
    return None


def _guard_layer_tables(model: PreTrainedModel, implementation: str) -> None:
    """Give the model's tables of attention classes per implementation an entry for ours that
    raises a clear error when a layer is built from it.

    Some modeling files pick an attention class by name from a module-level table
    (``GIT_SELF_ATTENTION_CLASSES = {"eager": GitSelfAttention}``; SAM's vision encoder, which the
    DeepSeek-OCR models embed); those classes compute attention in their own code. A model built
    with attnkit would fail there with ``KeyError: 'attnkit'``. Which sub-model builds from the
    table is not known before it is built (an OCR model's text part shares the file with its
    SAM encoder and can run attnkit), so the error is raised where the table is read."""
    module = sys.modules.get(type(model).__module__)
    for table_name, table in list(vars(module).items()) if module is not None else ():
        if not (isinstance(table, dict) and "eager" in table and implementation not in table
                and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in table.values())):
            continue

        def refuse(*args, _table=table_name, _choices=tuple(table), **kwargs):
            raise ValueError(
                f"{type(model).__name__} ({model.config.model_type}) builds attention layers from {_table}, a table "
                f"of classes that compute attention in their own code, one per implementation {_choices}, none for "
                f"'{implementation}'. Load it with one of those (for a composite model, give '{implementation}' only "
                f"to the parts that call transformers' attention interface, e.g. {{'text_config': '{implementation}', "
                f"'vision_config': 'sdpa'}}).")

        table[implementation] = refuse


def _is_ours(implementation) -> bool:
    return isinstance(implementation, str) and ALL_ATTENTION_FUNCTIONS.get(implementation) is attention_forward


def _install_load_check() -> None:
    """Refuse, when a model is built or switched to attnkit, a model attnkit cannot serve.

    transformers checks per model class that it can run "sdpa", "flash_attention_*" and
    "flex_attention" (``_sdpa_can_dispatch`` and friends) but has no such check for an
    implementation registered through ``AttentionInterface`` (transformers 5.24). Every model
    construction and ``set_attn_implementation`` resolves the implementation through
    ``PreTrainedModel.get_correct_attn_implementation`` with the model at hand, so that is
    wrapped (once) to call :func:`unserved_reason` when the answer is attnkit's function, and to
    guard the model's tables of attention classes (:func:`_guard_layer_tables`)."""
    current = PreTrainedModel.get_correct_attn_implementation
    # Registering again (another name, or this module reloaded) replaces our wrapper rather than
    # stacking a second one around it.
    original = getattr(current, "attnkit_original", current)  # our wrapper says what it wraps

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        chosen = original(self, requested_attention, is_init_check)
        if _is_ours(chosen):
            reason = unserved_reason(self)
            if reason is not None:
                raise ValueError(f"{reason}. Load it with attn_implementation='sdpa' or 'eager' (for a composite "
                                 f"model, a dict such as {{'text_config': '{NAME}', 'vision_config': 'sdpa'}}).")
            _guard_layer_tables(self, chosen)
        return chosen

    get_correct_attn_implementation.attnkit_original = original
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def register(name: str = NAME) -> str:
    """Register the attention and mask functions with transformers under ``name`` (done for
    "attnkit" on import); returns the name."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, make_mask)
    _install_load_check()
    return name


register()
