"""The attention-interface function :func:`attention_forward` and its keyword policy: every
keyword argument a model passes is implemented, known to leave the result unchanged
(:data:`HARMLESS_KWARGS`), or refused with an error naming it."""

from __future__ import annotations

import torch
from torch import Tensor

try:  # transformers' record of which outputs the current forward collects (see _weights_requested)
    from transformers.utils.output_capturing import _active_collector as _output_collector
except ImportError:  # pragma: no cover - older/newer transformers: only the output_attentions flag counts
    _output_collector = None

from ..._checks import shape_of
from ...functional import attention
from ...masks import Additive, Causal, Dense, Mask, SelectedBlocks, SelectedKeys, SlidingWindow
from .masks import AttnkitMask

__all__ = ["NAME", "HARMLESS_KWARGS", "attention_forward"]

#: The ``attn_implementation`` name attnkit registers under on import.
NAME = "attnkit"


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
    "sinks": "attention-sink logits, of which attnkit takes one per query head, (Hq,), or one per query, "
             "(B|1, Hq, Sq[, 1])",
    "s_aux": "attention-sink logits, of which attnkit takes one per query head, (Hq,), or one per query, "
             "(B|1, Hq, Sq[, 1])",
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


def _sink_logits(module, name: str, value: Tensor, batch: int, heads: int, q_len: int) -> Tensor:
    """gpt-oss' ``s_aux`` (and a per-head ``sinks``): one logit per query head, (Hq,); Inkling 2's
    ``sinks``: one per query, (B|1, Hq, Sq, 1). Any other shape is refused naming it."""
    per_query = isinstance(value, Tensor) and value.dim() in (3, 4) and value.shape[0] in (1, batch) \
        and tuple(value.shape[1:3]) == (heads, q_len) and tuple(value.shape[3:]) in ((), (1,))
    if not isinstance(value, Tensor) or not (per_query or value.shape == (heads,)):
        raise _refuse(module, name, value, _REFUSAL_HINTS[name] + f" (here Hq = {heads}, B = {batch}, Sq = {q_len})")
    return value


def _selected_keys(module, indices: Tensor, batch: int, q_len: int, device) -> Mask:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, ...): (B, Sq, k) indices of the keys
    each query keeps (negative = an unused slot, flash-mla's padding), as a :class:`SelectedKeys`
    the caller ANDs with the attention mask, as transformers' eager and sdpa paths AND their dense
    form into it. Nothing (Sq, Sk)-sized is built here: a backend that needs a dense mask
    materializes it itself."""
    if not isinstance(indices, Tensor) or indices.dtype.is_floating_point or indices.dtype == torch.bool \
            or indices.dim() != 3 or tuple(indices.shape[:2]) not in ((batch, q_len), (1, q_len)):
        raise _refuse(module, "indices", indices, f"a sparse key selection, expected integer (B, Sq, k) = "
                                                  f"({batch}, {q_len}, k)")
    return SelectedKeys(indices.to(device=device))


def _block_size_of(module) -> int | None:
    """The key-block size of a layer's block selection: its indexer's ``block_size`` (MiniMax-M3),
    else its config's ``index_block_size``; None when the layer names none."""
    size = getattr(getattr(module, "indexer", None), "block_size", None)
    if size is None:
        size = getattr(getattr(module, "config", None), "index_block_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _selected_blocks(module, block_indices: Tensor, batch: int, heads: int, q_len: int, device) -> Mask:
    """MiniMax-M3's sparse layers: (B, H_sel, Sq, n) ids of the key blocks each query of a KV
    group keeps (negative = an unused slot; the indexer has already put the local blocks before
    the query among them), as a :class:`SelectedBlocks` the caller ANDs with the attention mask:
    what transformers' eager path builds densely (``build_block_mask``: each query head reads its
    group's list, ANDed with the causal / padding mask)."""
    size = _block_size_of(module)
    if not isinstance(block_indices, Tensor) or block_indices.dtype.is_floating_point \
            or block_indices.dtype == torch.bool or block_indices.dim() != 4 \
            or block_indices.shape[0] not in (1, batch) or block_indices.shape[2] != q_len \
            or heads % max(block_indices.shape[1], 1) or size is None:
        why = "" if size is not None else "; the layer names no block size (indexer.block_size or " \
                                          "config.index_block_size)"
        raise _refuse(module, "block_indices", block_indices,
                      f"a sparse key-block selection, expected integer (B, H_sel, Sq, n) = ({batch}, H_sel, {q_len}, "
                      f"n) with H_sel dividing Hq = {heads}{why}")
    return SelectedBlocks(block_indices.to(device=device), size, num_heads=heads)


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
                      block_indices: Tensor | None = None, **kwargs) -> tuple[Tensor, Tensor | None]:
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
        s_aux, sinks: sink logits joining each row's softmax denominator: (Hq,), one per query
            head (gpt-oss), or (B|1, Hq, Sq, 1), one per query (Inkling 2); any other shape is
            refused.
        position_bias: an additive (B|1, Hq|1, Sq, Sk) score bias (T5-style models).
        indices: (B, Sq, k) keys each query keeps (DeepSeek sparse attention), ANDed with the mask
            as a :class:`~attnkit.masks.SelectedKeys`.
        block_indices: (B, H_sel, Sq, n) key blocks each query of a KV group keeps (MiniMax-M3),
            of the layer's ``indexer.block_size`` keys, ANDed with the mask as a
            :class:`~attnkit.masks.SelectedBlocks`.
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
            sink_logits = _sink_logits(module, name, given, B, Hq, Sq)
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
        mask = _and(mask, _selected_keys(module, indices, B, Sq, query.device))
    if block_indices is not None:
        mask = _and(mask, _selected_blocks(module, block_indices, B, Hq, Sq, query.device))
    if position_bias is not None:
        mask = _and(mask, Additive(position_bias))
    want_weights = _weights_requested(kwargs)
    res = attention(query, key, value, mask, scale=scaling, dropout_p=float(dropout), return_weights=want_weights,
                    softcap=None if softcap is None else float(softcap), sinks=sink_logits)
    out, weights = res if want_weights else (res, None)
    if weights is not None:
        weights = weights.to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights
